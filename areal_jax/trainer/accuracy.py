"""Greedy and sampled accuracy of a policy on prompt rows: SFT's validation checks and the job's
held-out accuracy. `GreedyAccuracy` keeps one generation engine across calls (new weights are
swapped in), so its programs compile once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from areal_jax.generation.engine import EngineConfig, GenerationEngine
from areal_jax.generation.offline import generate
from areal_jax.generation.sampling import SamplingParams
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Params, Transformer
from areal_jax.reward.scoring import score_all


def _row_answer(row: Mapping[str, Any]) -> Any:
    r = row["row"]
    return r["answer"] if isinstance(r, Mapping) else r.answer


def _completion_scorer(tokenizer: Any, reward_fn: Callable[[str, Any], float] | None
                       ) -> Callable[[Sequence[Mapping[str, Any]], Sequence[Sequence[int]]], list[float]]:
    """`score(rows, completions) -> rewards` of decoded completions against their rows' answers
    (`reward_fn` default: the arithmetic reward). Every call is submitted before any is awaited, so
    a `RewardScorer`'s pool works on them together: a reward that hangs costs its deadline once per
    batch of workers, not once per row."""
    if reward_fn is None:
        from areal_jax.tasks.reward import arithmetic_reward as reward_fn

    def score(rows: Sequence[Mapping[str, Any]], completions: Sequence[Sequence[int]]) -> list[float]:
        return score_all(reward_fn, [(tokenizer.decode(tokens, skip_special_tokens=True), _row_answer(row))
                                     for row, tokens in zip(rows, completions, strict=True)])

    return score


def sample_rewards(model_cfg: ModelConfig, params: Params, rows: Sequence[Mapping[str, Any]], tokenizer: Any, *,
                   max_new_tokens: int, batch: int = 64, n: int = 1, temperature: float = 0.0, seed: int = 0,
                   reward_fn: Callable[[str, Any], float] | None = None) -> np.ndarray:
    """Rewards `[R, n]` of `n` completions per row (`temperature=0`: greedy).

    rows: loader-style examples with `prompt_ids` and `row` (a PromptRow, or a dict, with `answer`).
    batch: decode slots of the generation engine. reward_fn: (completion_text, answer) -> float,
    default the arithmetic reward.
    """
    if not rows:
        return np.zeros((0, n), np.float32)
    score = _completion_scorer(tokenizer, reward_fn)
    model = Transformer(model_cfg, params)
    prompts = [np.asarray(r["prompt_ids"]).tolist() for r in rows]
    results = generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, n=n, seed=seed,
                       stop_token_ids=tokenizer.stop_token_ids, num_slots=batch)
    rewards = score([row for row in rows for _ in range(n)], [c.tokens for completions in results for c in completions])
    return np.asarray(rewards, np.float32).reshape(len(rows), n)


class GreedyAccuracy:
    """Greedy accuracy of changing weights on fixed prompt rows: `probe(params) -> float`.

    One generation engine serves every call (new weights are swapped in), so its programs are
    compiled once; a fresh `evaluate_accuracy` per check would compile them again each time.
    Same scoring as `evaluate_accuracy`: a row counts when its greedy completion earns reward >= 1.
    """

    def __init__(self, model_cfg: ModelConfig, rows: Sequence[Mapping[str, Any]], tokenizer: Any, *,
                 max_new_tokens: int, slots: int = 64, reward_fn: Callable[[str, Any], float] | None = None):
        if not rows:
            raise ValueError("GreedyAccuracy needs at least one prompt row")
        self.model_cfg, self.rows = model_cfg, list(rows)
        self.score = _completion_scorer(tokenizer, reward_fn)
        self.prompts = [np.asarray(r["prompt_ids"]).tolist() for r in self.rows]
        longest = max(len(p) for p in self.prompts)
        self.engine_config = EngineConfig(num_slots=min(slots, len(self.rows)),
                                          max_seq_len=-(-(longest + max_new_tokens + 1) // 16) * 16)
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                       stop_token_ids=tuple(tokenizer.stop_token_ids))
        self.engine: GenerationEngine | None = None
        self.calls = 0

    def __call__(self, params: Params) -> float:
        correct, total = self.count(params)
        return correct / total

    def _engine_config_for(self, params: Params) -> EngineConfig:
        """The engine config with its slots a multiple of the data size of the (generation) mesh the
        weights lie on: each data replica holds an equal share of the slots."""
        sharding = params["embed"].sharding
        data = sharding.mesh.shape.get("data", 1) if isinstance(sharding, NamedSharding) else 1
        slots = self.engine_config.num_slots
        return dataclasses.replace(self.engine_config, num_slots=max(data, slots - slots % data))

    def count(self, params: Params) -> tuple[int, int]:
        """(rows right, rows) under `params`."""
        self.calls += 1
        if self.engine is None:
            self.engine = GenerationEngine((self.model_cfg, params), self._engine_config_for(params),
                                           version=self.calls)
        else:
            self.engine.update_weights(params, self.calls)
        handles = [self.engine.submit(p, self.sampling, seed=0) for p in self.prompts]
        self.engine.run_until_idle()  # applies the new weights first, then generates
        rewards = self.score(self.rows, [h.result().completions[0].tokens for h in handles])
        correct = sum(reward >= 1.0 for reward in rewards)
        return int(correct), len(self.rows)


def evaluate_accuracy(model_cfg: ModelConfig, params: Params, rows: Sequence[Mapping[str, Any]], tokenizer: Any,
                      *, max_new_tokens: int, batch: int = 64,
                      reward_fn: Callable[[str, Any], float] | None = None) -> float:
    """Share of rows whose greedy completion earns reward >= 1 (0.0 for no rows): a one-off
    `GreedyAccuracy`, whose engine has `batch` slots at most."""
    if not rows:
        return 0.0
    return GreedyAccuracy(model_cfg, rows, tokenizer, max_new_tokens=max_new_tokens, slots=batch,
                          reward_fn=reward_fn)(params)
