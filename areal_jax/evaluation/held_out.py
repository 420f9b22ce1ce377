"""Held-out evaluation: sample a policy on prompt examples and score the samples.

The one implementation behind every accuracy the system reports:

- RL's held-out accuracy (`trainer.hooks.EvaluationHook`, the `eval/accuracy` record) runs
  `greedy_correct` on the loop's running engine (`drive=False`: the engine thread generates, this thread waits);
- the job's accuracy before and after RL and SFT's stopping rule run `GreedyAccuracy`, one engine
  kept across calls with new weights swapped in (programs compile once), driven from this thread;
- ``areal-jax eval`` (`runner.run_evaluation`) runs `sample` and `rewards` with n samples per prompt
  and builds pass@k / maj@k from them.

A sample is scored as reward(completion_text, gold) with the text decoded without special tokens and
gold from `data.examples.prompt_example`. A `RewardScorer` with a pool gets each group's calls as soon
as the engine hands the group back, so scoring in the workers overlaps the rest of generation; any
other reward (a plain function, an in-process scorer) runs on this thread after generation, never on
the engine's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from areal_jax import api
from areal_jax.data.examples import PromptExample, prompt_example
from areal_jax.generation.engine import EngineConfig, GenerationEngine, GroupResult
from areal_jax.api import SamplingParams
from areal_jax.generation.config import prompts_engine_config
from areal_jax.generation.programs import mesh_of, mesh_sizes
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Params
from areal_jax.reward.scoring import RewardScorer, score_all

__all__ = ["GreedyAccuracy", "SampledGroup", "evaluate_accuracy", "greedy_correct", "rewards", "sample",
           "sample_rewards"]

Reward = Callable[[str, Any], float]  # (completion_text, gold) -> reward; a RewardScorer fits
CORRECT = 1.0  # a greedy completion counts as right at this reward or more (math and code give 1.0 or 0.0)


@dataclasses.dataclass(frozen=True, eq=False)
class SampledGroup:
    """One example's samples: the engine's result, the decoded texts, and the reward calls already
    in a pool (None: `rewards` scores the texts on the calling thread)."""

    example: PromptExample
    result: GroupResult
    texts: tuple[str, ...]
    futures: tuple[concurrent.futures.Future, ...] | None


def sample(engine: api.InferenceEngine, examples: Sequence[PromptExample], sampling: SamplingParams, reward: Reward,
           tokenizer: Any, *, n: int = 1, drive: bool = True, timeout_s: float | None = None) -> list[SampledGroup]:
    """`n` samples of each example on `engine`, decoded, in example order.

    Any `api.InferenceEngine` serves with drive False. drive: run the engine from this thread until
    idle (an engine nobody else runs; needs the native engine's `run_until_idle`); False waits on
    an engine running on its own thread, `timeout_s` per example. Request seeds are the engine's
    counter, so a fresh engine samples a list the same way every time.
    """
    pooled = isinstance(reward, RewardScorer) and reward.pool is not None
    groups: dict[int, SampledGroup] = {}
    errors: list[BaseException] = []

    def finished(i: int, handle: concurrent.futures.Future) -> None:
        try:
            result = handle.result()
            texts = tuple(tokenizer.decode([int(t) for t in c.tokens], skip_special_tokens=True)
                          for c in result.completions)
            gold = examples[i].gold
            futures = tuple(reward.submit(text, gold) for text in texts) if pooled else None
            groups[i] = SampledGroup(examples[i], result, texts, futures)
        except BaseException as exc:  # noqa: BLE001 - a done-callback's exception would be swallowed
            errors.append(exc)

    handles = [engine.submit(ex.prompt_ids, sampling, n, request_id=f"eval-{i}") for i, ex in enumerate(examples)]
    if drive:
        for i, handle in enumerate(handles):  # runs on this thread, inside run_until_idle
            handle.add_done_callback(lambda h, i=i: finished(i, h))
        engine.run_until_idle()
    else:
        for i, handle in enumerate(handles):
            handle.result(timeout=timeout_s)
            finished(i, handle)
    if errors:
        raise errors[0]
    if len(groups) != len(examples):
        raise RuntimeError(f"the engine went idle with {len(examples) - len(groups)} of {len(examples)} "
                           "prompts unfinished")
    return [groups[i] for i in range(len(examples))]


def rewards(groups: Sequence[SampledGroup], reward: Reward) -> list[list[float]]:
    """Each group's sample rewards: the pool's results, or `reward` over the texts here."""
    unscored = [(text, g.example.gold) for g in groups if g.futures is None for text in g.texts]
    scored = iter(score_all(reward, unscored))
    return [[float(f.result()) for f in g.futures] if g.futures is not None else [next(scored) for _ in g.texts]
            for g in groups]


def greedy_correct(engine: api.InferenceEngine, examples: Sequence[PromptExample], reward: Reward, tokenizer: Any, *,
                   max_new_tokens: int, stop_token_ids: Sequence[int], drive: bool = True,
                   timeout_s: float | None = None) -> int:
    """How many `examples` the greedy completion gets right (reward >= 1)."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=tuple(stop_token_ids))
    groups = sample(engine, examples, sampling, reward, tokenizer, drive=drive, timeout_s=timeout_s)
    return sum(r[0] >= CORRECT for r in rewards(groups, reward))


def _default_reward(reward_fn: Reward | None) -> Reward:
    if reward_fn is None:  # the built-in arithmetic task's
        from areal_jax.tasks.reward import arithmetic_reward
        return arithmetic_reward
    return reward_fn


class GreedyAccuracy:
    """Greedy accuracy of changing weights on fixed prompt rows: `probe(params) -> float`.

    One generation engine serves every call (new weights are swapped in), so its programs are
    compiled once; a fresh `evaluate_accuracy` per check would compile them again each time.
    rows: loader rows (`data.examples.prompt_example`). reward_fn: (completion_text, gold) ->
    float, default the arithmetic reward.
    """

    def __init__(self, model_cfg: ModelConfig, rows: Sequence[Mapping[str, Any] | PromptExample], tokenizer: Any, *,
                 max_new_tokens: int, slots: int = 64, reward_fn: Reward | None = None, scan_layers: bool = False):
        if not rows:
            raise ValueError("GreedyAccuracy needs at least one prompt row")
        self.model_cfg, self.tokenizer = model_cfg, tokenizer
        self.examples = [prompt_example(r) for r in rows]
        self.reward = _default_reward(reward_fn)
        self.max_new_tokens = max_new_tokens
        self.longest_prompt = max(len(ex.prompt_ids) for ex in self.examples)
        self.slots = slots
        self.scan_layers = scan_layers  # the run's EngineConfig.scan_layers: its pushes' layout
        self.engine: GenerationEngine | None = None
        self.calls = 0

    def __call__(self, params: Params) -> float:
        correct, total = self.count(params)
        return correct / total

    def _engine_config_for(self, params: Params) -> EngineConfig:
        """The engine for these rows on the (generation) mesh the weights lie on
        (`prompts_engine_config`: `areal-jax plan` sizes the run's evaluation engine the same way)."""
        return prompts_engine_config(len(self.examples), self.longest_prompt, self.max_new_tokens, slots=self.slots,
                                     data=mesh_sizes(mesh_of(params))[0], scan_layers=self.scan_layers)

    def count(self, params: Params) -> tuple[int, int]:
        """(rows right, rows) under `params`."""
        self.calls += 1
        if self.engine is None:
            self.engine = GenerationEngine((self.model_cfg, params), self._engine_config_for(params),
                                           version=self.calls)
        else:
            self.engine.update_weights(params, self.calls)  # applied before the first new request
        correct = greedy_correct(self.engine, self.examples, self.reward, self.tokenizer,
                                 max_new_tokens=self.max_new_tokens, stop_token_ids=self.tokenizer.stop_token_ids)
        return correct, len(self.examples)


def evaluate_accuracy(model_cfg: ModelConfig, params: Params, rows: Sequence[Mapping[str, Any]], tokenizer: Any,
                      *, max_new_tokens: int, slots: int = 64, reward_fn: Reward | None = None) -> float:
    """Share of rows whose greedy completion earns reward >= 1 (0.0 for no rows): a one-off
    `GreedyAccuracy`, whose engine has `slots` slots at most."""
    if not rows:
        return 0.0
    return GreedyAccuracy(model_cfg, rows, tokenizer, max_new_tokens=max_new_tokens, slots=slots,
                          reward_fn=reward_fn)(params)


def sample_rewards(model_cfg: ModelConfig, params: Params, rows: Sequence[Mapping[str, Any]], tokenizer: Any, *,
                   max_new_tokens: int, slots: int = 64, n: int = 1, temperature: float = 0.0, seed: int = 0,
                   reward_fn: Reward | None = None) -> np.ndarray:
    """Rewards `[R, n]` of `n` completions per row (`temperature=0`: greedy) on a one-off engine
    with `slots` decode slots at most and sampling seed `seed`. reward_fn as `GreedyAccuracy`'s."""
    if not rows:
        return np.zeros((0, n), np.float32)
    examples = [prompt_example(r) for r in rows]
    reward = _default_reward(reward_fn)
    longest = max(len(ex.prompt_ids) for ex in examples)
    engine = GenerationEngine((model_cfg, params), prompts_engine_config(
        len(examples) * n, longest, max_new_tokens, slots=slots, data=mesh_sizes(mesh_of(params))[0], seed=seed))
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              stop_token_ids=tuple(tokenizer.stop_token_ids))
    groups = sample(engine, examples, sampling, reward, tokenizer, n=n)
    return np.asarray(rewards(groups, reward), np.float32).reshape(len(examples), n)
