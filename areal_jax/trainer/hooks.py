"""The built-in hooks on an RL step: held-out evaluation, rollout dumps, the step's record
(checkpoints: trainer/checkpoint_hook.py), and `Hooks`, a loop's hooks by stage.

A `Hook(fn, stage=..., every=N)` (api/steps.py, with the stages "update", "metrics", "record" and
"end") runs `fn(info)` after steps whose index + 1 is a multiple of N, in the order the hooks were
added. A hook receives data (`api.StepInfo`: step, version, groups, metrics), never the loop: what
else it needs (an engine, a writer, a checkpointer) it is built with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from areal_jax import api
from areal_jax.api import STAGES, Hook, SamplingParams, Stage, StepInfo, TrajectoryGroup
from areal_jax.data.examples import prompt_example
from areal_jax.evaluation.held_out import CORRECT, greedy_correct, sample
from areal_jax.parallel.distributed import agree_sum, agree_sum_array
from areal_jax.reward.composite import TermsScorer, question_text, term_metrics
from areal_jax.reward.scoring import RewardScorer
from areal_jax.rollout.workflow import RLVRConfig
from areal_jax.trainer.config import RLConfig

__all__ = ["STAGES", "EvaluationHook", "Hook", "Hooks", "Stage", "StepInfo", "record_hook", "rollout_dump_hook",
           "rollout_records"]


class Hooks:
    """A loop's hooks by stage, each stage's in the order added."""

    def __init__(self, hooks: Sequence[Hook] = ()):
        self._by_stage: dict[str, list[Hook]] = {stage: [] for stage in STAGES}
        for hook in hooks:
            self.add(hook)

    def add(self, hook: Hook) -> None:
        self._by_stage[hook.stage].append(hook)

    def run(self, stage: Stage, info: StepInfo) -> None:
        for hook in self._by_stage[stage]:
            if stage == "end" or (info.step + 1) % hook.every == 0:
                hook.fn(info)


def record_hook(on_step: Callable[[int, dict[str, Any]], None]) -> Hook:
    """The step's final record to `on_step(step, metrics)` (the run's metrics sinks)."""
    return Hook(lambda info: on_step(info.step, info.metrics), stage="record")


def rollout_records(groups: Sequence[TrajectoryGroup], tokenizer: Any) -> list[dict[str, Any]]:
    """Human-readable trajectories of a batch: prompt, completion, reward, per-token versions; the
    completion's token ids where it holds inserted tokens (a loss mask); an agent session's
    messages (workflows/agent.py: group info "session_of" and "messages") with each of its rows."""
    decode = tokenizer.decode

    def session(g: TrajectoryGroup, i: int) -> dict[str, Any]:
        of, messages = g.info.get("session_of"), g.info.get("messages")
        return {} if of is None or messages is None else {"session": of[i], "messages": messages[of[i]]}

    return [{"query_id": g.query_id, "admitted_version": g.admitted_version, "sample": i,
             "prompt": decode(t.prompt_ids), "prompt_tokens": len(t.prompt_ids),
             "completion": decode(t.completion_ids), "reward": t.reward,
             "stop_reason": t.stop_reason, "versions": t.versions.tolist(),
             **({} if t.loss_mask is None else {"loss_mask": t.loss_mask.astype(int).tolist(),
                                                "completion_tokens": t.completion_ids.tolist()}),
             "behavior_logprobs": t.behavior_logprobs.tolist(), **session(g, i)}
            for g in groups for i, t in enumerate(g.trajectories)]


def rollout_dump_hook(write: Callable[[int, list[dict[str, Any]]], None], tokenizer: Any, every: int = 1) -> Hook:
    """The step's trajectories, human-readable (`rollout_records`), to `write(step, records)` every
    `every` steps, at "metrics" (before the step's record)."""
    return Hook(lambda info: write(info.step, rollout_records(info.groups, tokenizer)), stage="metrics", every=every)


class EvaluationHook:
    """Held-out greedy evaluation every RLConfig.eval_every steps and after the last, on the loop's
    running `engine` (evaluation.held_out). `rollout`: the RLVRConfig the rollouts sample with
    (reward, its deadline, stop tokens, budget); `reward_pool`: theirs (None: scored in this
    process). With several processes each evaluates its shard of the rows.

    A single reward gives "eval/accuracy". A composite reward is scored as the rollouts score it
    (`reward.composite.TermsScorer`, its learned terms on the rollouts' `learned` models): "eval/
    reward/mean" (the weighted reward) and each term's "eval/reward/<name>/mean" and "/failed",
    with "eval/accuracy" read from its verifier term when it has one."""

    def __init__(self, engine: api.InferenceEngine, rows: Sequence[Any], *, tokenizer: Any, rl: RLConfig,
                 rollout: RLVRConfig | None = None, reward_pool: Any = None, learned: Any = None):
        self.engine, self.tokenizer, self.rl, self.rollout = engine, tokenizer, rl, rollout
        self.examples = [prompt_example(row) for row in rows]  # a malformed row fails here
        self.reward_pool, self.learned = reward_pool, learned
        self._terms: TermsScorer | None = None

    def __call__(self, info: StepInfo) -> None:
        every = self.rl.eval_every
        if self.examples and every and ((info.step + 1) % every == 0 or info.last):
            info.metrics.update(self.evaluate())

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics with the engine's current weights (a collective with several processes)."""
        rollout = self.rollout
        if rollout is None or isinstance(rollout.reward, str):
            return {"eval/accuracy": self.accuracy()}
        if self._terms is None:  # loads the learned terms only when the rollouts did not
            self._terms = TermsScorer(rollout.reward_terms, pool=self.reward_pool, learned=self.learned,
                                      timeout_s=rollout.reward_timeout_s, judge=rollout.judge)
        sampling = SamplingParams(max_new_tokens=self._budget(), temperature=0.0,
                                  stop_token_ids=tuple(rollout.stop_token_ids))
        groups = sample(self.engine, self.examples, sampling, None, self.tokenizer, drive=False,
                        timeout_s=self.rl.batch_timeout_s)
        rewards, values, _, totals = self._terms.score([(question_text(g.example), g.texts[0], g.example.gold)
                                                     for g in groups])
        verifier = self._terms.verifier
        right = sum(v[verifier] >= CORRECT for v in values) if verifier is not None else 0
        names = [name for name, _ in rollout.reward_terms]
        sums = np.array([sum(rewards), len(rewards), right] + [x for name in names for x in totals[name]], np.float64)
        if jax.process_count() > 1:  # each host evaluates its own shard of the held-out rows
            sums = agree_sum_array(sums)
        total = max(int(sums[1]), 1)
        out = {"eval/reward/mean": float(sums[0]) / total,
               **term_metrics([{"reward_terms": {name: sums[3 + 3 * i:6 + 3 * i].tolist()
                                                 for i, name in enumerate(names)}}], prefix="eval/")}
        if verifier is not None:
            out["eval/accuracy"] = float(sums[2]) / total
        return out

    def _budget(self) -> int:
        rollout = self.rollout
        return self.rl.eval_max_new_tokens or (rollout.max_new_tokens if rollout else 64)

    def accuracy(self) -> float:
        """Held-out greedy accuracy by a single reward with the engine's current weights (a
        collective with several processes)."""
        rollout = self.rollout
        # In the rollouts' pool under their deadline (in this process only when no pool was given).
        scorer = RewardScorer(rollout.verifier if rollout else "math", self.reward_pool,
                              timeout_s=rollout.reward_timeout_s if rollout else 10.0)
        correct = greedy_correct(self.engine, self.examples, scorer, self.tokenizer, max_new_tokens=self._budget(),
                                 stop_token_ids=rollout.stop_token_ids if rollout else (), drive=False,
                                 timeout_s=self.rl.batch_timeout_s)
        total = len(self.examples)
        if jax.process_count() > 1:  # each host evaluates its own shard of the held-out rows
            correct, total = agree_sum(int(correct)), agree_sum(total)
        return correct / max(total, 1)

    def close(self) -> None:
        if self._terms is not None:
            self._terms.close()
