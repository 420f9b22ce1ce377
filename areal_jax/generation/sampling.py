"""Sampling parameters and the per-slot sampler used inside the decode loop.

Behavior log-probabilities: for every sampled token we record
`log_softmax(logits / temperature)[token]` over the *full* vocabulary, whatever top-p/top-k
did to the sampling distribution. That is exactly what the trainer recomputes for the
proximal and current policies (areal_jax.ppo.token_logprobs), so the importance weight
exp(prox - behav) compares like with like; the truncation by top-p/top-k is treated as part of
the environment rather than of the policy, as AReaL and most RL systems do. Greedy decoding
(temperature 0) records the temperature-1 log-probability of the argmax token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.api.sampling import MAX_STOP_IDS, SamplingParams

__all__ = ["MAX_STOP_IDS", "SAMPLERS", "SamplingParams", "allowed_mask", "behavior_logprobs", "first_argmax",
           "sample_tokens", "sampler_kind"]

def first_argmax(logits: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (first index of the maximum) as two plain reductions:
    argmax's fused (value, index) reduction is not vectorized by XLA CPU and cost ~0.5 ms per
    `[16, 8192]` decode step."""
    V = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == top, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
    return jnp.minimum(first, V - 1)  # V only if the row holds a NaN


def behavior_logprobs(logits: jax.Array, tokens: jax.Array, temperature: jax.Array) -> jax.Array:
    """`log_softmax(logits / t)[token]` per row: logits `[B, V]`, tokens `[B]`, temperature `[B]`.

    Same arithmetic as areal_jax.ppo.token_logprobs; temperature 0 (greedy) scores at t = 1.
    """
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    scaled = logits.astype(jnp.float32) / t[:, None]
    picked = jnp.take_along_axis(scaled, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def allowed_mask(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Tokens top-k then top-p keep, per row: logits `[B, V]` -> bool `[B, V]`.

    top-k keeps the k largest logits; top-p then keeps the smallest prefix (by descending
    probability of the top-k-renormalized distribution at this temperature) whose mass reaches p.
    """
    B, V = logits.shape
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    scaled = logits.astype(jnp.float32) / t[:, None]
    ordered = -jnp.sort(-scaled, axis=-1)  # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    rank = jnp.arange(V)[None, :]
    ordered = jnp.where(rank < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) & (rank < k[:, None])
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    n_keep = jnp.sum(keep, axis=-1)
    threshold = jnp.take_along_axis(ordered, (n_keep - 1)[:, None], axis=-1)  # [B, 1]
    return scaled >= threshold


SAMPLERS = ("greedy", "sample", "filter")  # host-static sampler kinds, least work first


def sampler_kind(temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray) -> str:
    """The least sampler that serves rows with these params (host arrays `[B]`, the live rows'):
    "greedy" (all temperature 0), "sample" (no top-k/top-p on a sampled row) or "filter"."""
    sampled = temperature > 0
    if not sampled.any():
        return "greedy"
    return "filter" if ((top_k[sampled] > 0) | (top_p[sampled] < 1.0)).any() else "sample"


def sample_tokens(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  top_k: jax.Array, kind: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row. logits `[B, V]`, per-row params `[B]` -> (tokens `[B]`, logprobs `[B]`).

    `key` is one key for the whole batch, or a key per row `[B]` (the engine's: each sample's
    randomness then depends only on its own seed and position, not on what else is batched).
    Inverse-CDF sampling: one uniform per row instead of V Gumbel draws, since generating V
    random numbers per row per step dominated the decode step on CPU.

    `kind` (static, `sampler_kind` of the rows): which sampler runs; None decides on the device
    (two conditionals, each a device-to-host round trip on GPU).
    """
    greedy = first_argmax(logits)
    # All-greedy batches (evaluation, benchmarks) skip the sampler: its [B, V] cumsum and
    # random draws would cost about as much as the logprobs themselves.
    if kind is None:
        sampled = jax.lax.cond(jnp.any(temperature > 0),
                               lambda: _inverse_cdf_sample(logits, key, temperature, top_p, top_k), lambda: greedy)
    elif kind not in SAMPLERS:
        raise ValueError(f"sampler kind must be one of {SAMPLERS}, got {kind!r}")
    else:
        sampled = greedy if kind == "greedy" else _inverse_cdf_sample(logits, key, temperature, top_p, top_k,
                                                                      kind == "filter")
    tokens = jnp.where(temperature > 0, sampled, greedy)
    return tokens, behavior_logprobs(logits, tokens, temperature)


def _inverse_cdf_sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array,
                        top_k: jax.Array, filtered: bool | None = None) -> jax.Array:
    """One draw per row from the tempered, top-k/top-p filtered distribution: `[B, V] -> [B]` int32.
    `filtered` (static): whether any row filters; None decides on the device."""
    B, V = logits.shape
    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    scaled = logits.astype(jnp.float32) / t[:, None]
    if filtered is None:
        mask = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)),
                            lambda: allowed_mask(logits, temperature, top_p, top_k),
                            lambda: jnp.ones(logits.shape, bool))
    else:
        mask = allowed_mask(logits, temperature, top_p, top_k) if filtered else jnp.ones(logits.shape, bool)
    weights = jnp.where(mask, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
    cdf = jnp.cumsum(weights, axis=-1)  # [B, V], unnormalized
    if key.ndim == 0:
        u = jax.random.uniform(key, (B,), jnp.float32)
    else:
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key)
    # u in (0, total): the chosen index i has cdf[i-1] < u <= cdf[i], so weights[i] > 0 (allowed).
    u = jnp.maximum(u, jnp.finfo(jnp.float32).tiny) * cdf[:, -1]
    return jnp.minimum(jnp.sum(cdf < u[:, None], axis=-1), V - 1).astype(jnp.int32)
