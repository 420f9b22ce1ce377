"""Token log-probs and entropy from final hidden states, one chunk of logits at a time.

At a real vocabulary the logits dominate a training step's memory: fp32 `[R, T, V]` is 0.6 MB
per token at V = 151,936 (10 GB for a 16k-token micro-batch), and autodiff keeps the logits and
the softmax for the backward on top. Here the sequence axis is cut into n chunks of Tc
positions; a scan turns each chunk's hidden states `[R, Tc, D]` into logits `[R, Tc, V]`,
reduces them to per-token log-prob and entropy, and drops them. Each chunk is under
`jax.checkpoint`, so the backward recomputes the chunk's logits from its hidden states instead
of saving them: peak memory O(R * Tc * V), whatever T. Rows stay where the mesh put them
("batch" -> "fsdp"); logits are constrained like `models.transformer.lm_head`'s (vocab over
"tensor").

A micro-batch of at most `chunk_tokens` tokens runs the dense computation unchanged (one
`[R, T, V]` logits array, no scan), so small runs compute exactly what they always did.

Shapes: R rows, T positions per row, Tc positions per chunk, D hidden, V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from areal_jax.models.sharding import constrain
from areal_jax.models.transformer import project
from areal_jax.ppo.loss import token_entropy, token_logprobs

# Tokens whose logits exist at once: 2.5 GB of fp32 logits per copy at V = 151,936, divided
# over the devices holding the rows and the vocabulary; a [4096, D] x [D, V] head matmul per
# chunk is still large enough to run at full speed on any accelerator.
DEFAULT_LOGIT_CHUNK_TOKENS = 4096

Head = Callable[[jax.Array], jax.Array]  # hidden [R, Tc, D] -> fp32 logits [R, Tc, V]


def chunk_layout(rows: int, length: int, chunk_tokens: int) -> tuple[int, int]:
    """(n, Tc): n chunks of Tc positions covering `length` (n * Tc >= length, padded by < n).

    One chunk (Tc = length) when the `rows x length` tokens fit in `chunk_tokens`; otherwise
    each chunk holds at most `chunk_tokens` tokens (at least one position of every row)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if rows * length <= chunk_tokens:
        return 1, length
    n = -(-length // max(1, chunk_tokens // rows))
    return n, -(-length // n)  # the same n with the least padding


def weight_head(w: jax.Array) -> Head:
    """The head of a weight `[D, V]` (any dtype; cast to the hidden states' dtype inside, so its
    gradient accumulates in w's own dtype): fp32 logits, vocab over "tensor"."""
    def head(hidden: jax.Array) -> jax.Array:
        logits = project(hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "seq", "act_vocab"))

    return head


def hidden_logprobs(hidden: jax.Array, head: Head | jax.Array, targets: jax.Array, temperature: float = 1.0,
                    *, chunk_tokens: int = DEFAULT_LOGIT_CHUNK_TOKENS) -> jax.Array:
    """log_softmax(head(hidden) / temperature) at the targets: `[R, T]` fp32, as
    `token_logprobs` of the dense logits, computed chunk by chunk (module docstring).

    Args:
        hidden: `[R, T, D]` final-norm hidden states (`forward(..., return_hidden=True)`).
        head: a function `[R, Tc, D] -> [R, Tc, V]` fp32 logits, or a weight `[D, V]`.
        targets: `[R, T]` integer token ids.
        temperature: > 0.
        chunk_tokens: tokens (rows x positions) whose logits exist at once.
    """
    logp, _ = _chunked(hidden, head, targets, temperature, chunk_tokens, with_entropy=False)
    return logp


def hidden_logprobs_and_entropy(hidden: jax.Array, head: Head | jax.Array, targets: jax.Array,
                                temperature: float = 1.0, *, chunk_tokens: int = DEFAULT_LOGIT_CHUNK_TOKENS
                                ) -> tuple[jax.Array, jax.Array]:
    """(`hidden_logprobs(...)`, entropy `[R, T]` fp32 of softmax(logits / temperature)).

    The entropy carries no gradient (`token_entropy` of stop-gradient logits): it is logged,
    not optimized."""
    return _chunked(hidden, head, targets, temperature, chunk_tokens, with_entropy=True)


def _reduce(logits, targets, temperature, with_entropy):
    """Exactly the dense computation on one chunk's logits."""
    logp = token_logprobs(logits, targets, temperature)
    entropy = token_entropy(jax.lax.stop_gradient(logits), temperature) if with_entropy else None
    return logp, entropy


def _chunked(hidden, head, targets, temperature, chunk_tokens, *, with_entropy):
    if hidden.ndim != 3 or hidden.shape[:2] != targets.shape:
        raise ValueError(f"hidden {hidden.shape} must be [R, T, D] with targets {targets.shape} = [R, T]")
    head_fn = head if callable(head) else weight_head(head)
    R, T, D = hidden.shape
    n, tc = chunk_layout(R, T, chunk_tokens)
    if n == 1:
        return _reduce(head_fn(hidden), targets, temperature, with_entropy)

    pad = n * tc - T  # padded positions: zero hidden states, target 0, sliced off below
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [R, n*Tc, D] -> [n, R, Tc, D]: the scan walks chunks of positions; rows keep their sharding.
    xs = (constrain(hidden.reshape(R, n, tc, D).swapaxes(0, 1), (None, "batch", "seq", "act_embed")),
          constrain(targets.reshape(R, n, tc).swapaxes(0, 1), (None, "batch", "seq")))

    # Saves only the chunk's inputs; the backward recomputes its logits (no CSE guard needed:
    # XLA does not merge work across a scan's iterations).
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(h, t):
        return _reduce(head_fn(constrain(h, ("batch", "seq", "act_embed"))), t, temperature, with_entropy)

    _, out = jax.lax.scan(lambda carry, x: (carry, chunk(*x)), None, xs)
    # [n, R, Tc] -> [R, T]
    logp, entropy = (None if y is None else y.swapaxes(0, 1).reshape(R, n * tc)[:, :T] for y in out)
    return logp, entropy
