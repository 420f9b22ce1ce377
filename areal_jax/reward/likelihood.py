"""`LikelihoodReward`: a causal language model as a reward, scoring an answer by its likelihood.

An "lm:<directory>" term of `RLVRConfig.reward` names an HF `*ForCausalLM` checkpoint. It reads
the question as a chat's user turn (its own chat template, generation prompt added) and scores the
answer by the mean, over the answer's tokens, of log p(token | everything before it):

    score(question, answer) = mean_t log p_LM(answer_t | prompt, answer_<t)        (<= 0)

The mean, not the sum, so that a shorter answer is not preferred for being shorter.

A directory with a `reference/` subdirectory (a second causal LM over the same vocabulary) is an
implicit reward model: its score is the mean log-ratio to that reference,

    score(question, answer) = mean_t [log p_LM(answer_t | ...) - log p_reference(answer_t | ...)]

which rewards only what tuning taught the LM (which tokens are right), not how likely the
reference already found the answer. It is the implicit reward model's own score, but as an RL
reward on the quickstart task it was hacked within 20 steps (held-out accuracy 0.595 -> 0.27),
where the plain likelihood with a KL penalty to the SFT policy gained 19.5-30 points
(docs/benchmarks.md, issue 43).

Why a reward model of this kind: a scalar head reads one position, the last, and must learn to
gather there whether every step of an answer holds. An LM's log-probs already compare each
position's prediction with the token that follows, at every position. Tuned on right vs wrong
answers through the log-ratio to a reference LM (the implicit reward model of Yuan et al. 2024,
"Free Process Rewards without Process Labels"), the tuned LM's own likelihood ranks answers
(examples/learned_reward_model.py, `--rm_loss likelihood`; docs/benchmarks.md).

Rows are batched `batch_size` at a time, each batch padded to a power-of-two length, as
`RewardModel` does; on a ("data", "expert", "tensor") mesh rows split over "data".
Shapes: B rows, T positions, D hidden.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models import sharding as shd
from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_io import load_params, read_config
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.models.transformer import Params, forward, lm_head
from areal_jax.ppo.logprobs import hidden_logprobs
from areal_jax.reward.reward_model import (DEFAULT_BATCH, check_scored_tokens, length_bucket, padded_rows,
                                           rows_per_device)

__all__ = ["REFERENCE", "LikelihoodReward", "check_causal_lm", "likelihood_input", "likelihood_program",
           "reference_dir", "token_logprobs"]

REFERENCE = "reference"  # the subdirectory holding an implicit reward model's reference LM


def check_causal_lm(path: str | pathlib.Path) -> None:
    """ValueError naming `path` unless its config.json declares a `*ForCausalLM` architecture."""
    cfg_file = pathlib.Path(path) / "config.json"
    try:
        archs = json.loads(cfg_file.read_text()).get("architectures") or []
    except OSError:
        raise ValueError(f"{cfg_file} not found (is {path} a Hugging Face model directory?)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: malformed JSON ({e})") from None
    if not archs or not str(archs[0]).endswith("ForCausalLM"):
        raise ValueError(f"{path} is not a causal LM (config.json architectures {archs}); an 'lm:' term needs a "
                         f"*ForCausalLM checkpoint (a *ForSequenceClassification reward model is an 'rm:' term)")


def reference_dir(path: str | pathlib.Path) -> pathlib.Path | None:
    """The reference LM of the "lm:" directory `path` (its `reference/` subdirectory), or None."""
    ref = pathlib.Path(path) / REFERENCE
    return ref if (ref / "config.json").is_file() else None


def _check_reference(cfg: ModelConfig, reference: ModelConfig, name: str) -> None:
    if reference.vocab_size != cfg.vocab_size:
        raise ValueError(f"likelihood reward {name}: its reference's vocabulary ({reference.vocab_size}) is not the "
                         f"LM's ({cfg.vocab_size})")


def likelihood_input(tokenizer: Tokenizer, question: str, answer: str) -> tuple[list[int], int]:
    """(token ids, where the answer starts) of one (question, answer): the chat [user: question,
    assistant: answer] through the LM's template when its rendering begins with the prompt's
    (the user turn and the generation prompt), so the template's end of turn is scored too;
    otherwise the prompt followed by the answer's own tokens. Without a chat template: the
    question's tokens (special tokens added), then the answer's."""
    if tokenizer.has_chat_template:
        user = [{"role": "user", "content": question}]
        prompt = list(tokenizer.apply_chat_template(user, add_generation_prompt=True))
        full = list(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": answer}]))
        if full[:len(prompt)] == prompt and len(full) > len(prompt):
            return full, len(prompt)
    else:
        prompt = list(tokenizer.encode(question))
    return prompt + list(tokenizer.encode(answer, add_special_tokens=False)), len(prompt)


def token_logprobs(params: Params, cfg: ModelConfig, input_ids: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """`[B, T-1]` fp32: the log-prob of each next token (position t predicts token t + 1)."""
    hidden, _ = forward(params, cfg, input_ids, segment_ids=segment_ids, return_hidden=True)  # [B, T, D]
    return hidden_logprobs(hidden[:, :-1], lambda h: lm_head(params, cfg, h), input_ids[:, 1:])


def likelihood_program(cfg: ModelConfig, reference: ModelConfig | None = None):
    """The jitted score `(params, reference params or None, input_ids [B, T], segment_ids [B, T],
    scored [B, T]) -> [B]`: the mean log-prob of the tokens marked in `scored` (each predicted from
    the position before it; position 0 is never scored), less the reference's with a `reference`
    config. A row with none scores 0."""
    def score(params: Params, ref_params: Params | None, input_ids, segment_ids, scored):
        logp = token_logprobs(params, cfg, input_ids, segment_ids)
        if reference is not None:
            logp = logp - token_logprobs(ref_params, reference, input_ids, segment_ids)
        weight = scored[:, 1:].astype(jnp.float32)
        return jnp.sum(logp * weight, axis=1) / jnp.maximum(jnp.sum(weight, axis=1), 1.0)

    return jax.jit(score)


class LikelihoodReward:
    """Scores (question, answer) pairs by a causal LM's mean log-likelihood of the answer."""

    def __init__(self, cfg: ModelConfig, params: Params, tokenizer: Tokenizer, *, mesh: Mesh | None = None,
                 batch_size: int = DEFAULT_BATCH, name: str = "<memory>",
                 reference: tuple[ModelConfig, Params] | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"LikelihoodReward batch_size must be an int >= 1, got {batch_size!r}")
        if reference is not None:
            _check_reference(cfg, reference[0], name)
        self.config, self.params, self.tokenizer, self.mesh, self.name = cfg, params, tokenizer, mesh, name
        self.reference = reference
        data = mesh.shape["data"] if mesh is not None else 1
        self.batch_size = rows_per_device(batch_size, data) * data
        self._score = likelihood_program(cfg, reference[0] if reference is not None else None)

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, *, dtype=jnp.float32, mesh: Mesh | None = None,
                        batch_size: int = DEFAULT_BATCH) -> "LikelihoodReward":
        check_causal_lm(path)
        cfg, params = load_params(path, dtype=dtype, mesh=mesh)
        ref = reference_dir(path)
        if ref is not None:  # checked before its weights are read
            check_causal_lm(ref)
            _check_reference(cfg, read_config(ref), str(path))
        reference = load_params(ref, dtype=dtype, mesh=mesh) if ref is not None else None
        return cls(cfg, params, Tokenizer.from_pretrained(path), mesh=mesh, batch_size=batch_size, name=str(path),
                   reference=reference)

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """`[N]` fp32 scores of (question, answer) pairs."""
        return self.score_ids([likelihood_input(self.tokenizer, q, a) for q, a in pairs])

    def score_ids(self, rows: Sequence[tuple[Sequence[int], int]]) -> np.ndarray:
        """`[N]` scores of (token ids, answer start) rows: the mean log-prob of ids[start:]."""
        seqs = []
        for i, (ids, start) in enumerate(rows):
            s = np.asarray(ids, np.int32).reshape(-1)
            if not 1 <= start < s.size:
                raise ValueError(f"likelihood reward {self.name}: row {i} has no answer token to score "
                                 f"(answer start {start} of {s.size} tokens)")
            check_scored_tokens(s, self.config, f"likelihood reward {self.name}: row {i}")
            seqs.append((s, start))
        out = [self._batch(seqs[i:i + self.batch_size]) for i in range(0, len(seqs), self.batch_size)]
        return np.concatenate(out) if out else np.zeros((0,), np.float32)

    def warmup(self, max_tokens: int = 256) -> None:
        """Compiles every length bucket up to `max_tokens` now (no compile under a deadline)."""
        T = length_bucket(1)
        while T <= min(max_tokens, self.config.max_position_embeddings):
            self._batch([(np.zeros(T, np.int32), T - 1)])
            T *= 2

    def _batch(self, seqs: list[tuple[np.ndarray, int]]) -> np.ndarray:
        T = length_bucket(max(s.size for s, _ in seqs))
        ids, seg = padded_rows([s for s, _ in seqs], self.batch_size, T, pad=0, padding="right")  # [B, T] each
        scored = np.zeros_like(seg)
        for b, (s, start) in enumerate(seqs):
            scored[b, start:s.size] = 1
        ref = self.reference[1] if self.reference is not None else None
        if self.mesh is None:
            scores = self._score(self.params, ref, ids, seg, scored)
        else:
            rows = NamedSharding(self.mesh, PartitionSpec("data"))
            with shd.activation_rules(shd.GENERATION_RULES, self.mesh):
                scores = self._score(self.params, ref, *(jax.device_put(x, rows) for x in (ids, seg, scored)))
        return np.asarray(jax.device_get(scores), np.float32)[:len(seqs)]


def likelihood_batch(lm: LikelihoodReward, items: list[tuple[str, str]]) -> list[tuple[float, str | None]]:
    """`LearnedRewards`' call: (score, failed reason or None) per (question, answer)."""
    scores = lm.score(items)
    return [(float(s), None) if math.isfinite(s) else (0.0, "non-finite") for s in scores]
