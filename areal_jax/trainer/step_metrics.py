"""A step's record (one metrics.jsonl line): what the algorithm step computed, the trained batch,
the rollout side's counters since the previous step, and the programs' timings, which
`areal-jax simulate --calibrate` fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax

from areal_jax.generation.timings import timings_delta
from areal_jax.metrics import batch_metrics
from areal_jax.parallel.distributed import agree_sum
from areal_jax.reward.composite import term_metrics
from areal_jax.api import TrajectoryGroup
from areal_jax.trainer.algorithm import StepOutput
from areal_jax.trainer.cluster import RLCluster

__all__ = ["StepMetrics", "agent_counters"]


class StepMetrics:
    """`metrics(step, groups, out, wait_s=, transfer_s=)`: the record of a step of `cluster`, just
    trained (its version bumped, the weights pushed). Counters of the rollout side, the reward pool
    and the engine's timings are differences since the previous call. With several processes the
    reward pool's counts are summed over them (a collective: every process calls in step)."""

    def __init__(self, cluster: RLCluster):
        self.cluster = cluster
        self._reward_tally = (0, 0.0)  # (trajectories, reward sum) finished before the last step
        self._reprefill_seen = 0  # the engine's re-prefilled tokens at the previous step's record
        self._shared_seen = 0  # the engine's shared KV pages at the previous step's record
        self._spared_seen = 0  # the engine's re-prefill tokens spared by shared prefixes, likewise
        self._rode_seen = 0  # and those its decode steps carried (re-prefill beside decode), likewise
        self._pool_seen = (0, 0)  # the pool's (timeouts, crashes + errors) counted by earlier steps
        self._timings_seen: dict | None = None  # engine timings at the previous step's record

    def __call__(self, step: int, groups: Sequence[TrajectoryGroup], out: StepOutput, *, wait_s: float,
                 transfer_s: float) -> dict[str, Any]:
        cluster, train = self.cluster, out.train
        counters = cluster.staleness.stats()  # restored on resume, unlike the controller's own
        ctl = cluster.controller.stats()
        n_prev, sum_prev = self._reward_tally
        self._reward_tally = (ctl.finished_trajectories, ctl.finished_reward_sum)
        n_new = ctl.finished_trajectories - n_prev
        reprefill, self._reprefill_seen = (ctl.generation_reprefill_tokens - self._reprefill_seen,
                                           ctl.generation_reprefill_tokens)
        shared, self._shared_seen = (ctl.generation_kv_pages_shared - self._shared_seen,
                                     ctl.generation_kv_pages_shared)
        spared, self._spared_seen = (ctl.generation_reprefill_shared_tokens - self._spared_seen,
                                     ctl.generation_reprefill_shared_tokens)
        rode, self._rode_seen = (ctl.generation_reprefill_ride_tokens - self._rode_seen,
                                 ctl.generation_reprefill_ride_tokens)
        lag = train.get("version_lag_hist", {})
        metrics = {
            "step": step,
            "version": cluster.version,
            # reward mean/std/accuracy, generated length mean/max, truncated fraction
            **batch_metrics(t for g in groups for t in g.trajectories),
            # Every group finished since the previous step, filtered ones included (unbiased,
            # unlike reward/mean over the trained groups when the all-equal filter is on).
            "rollout/reward_mean": (ctl.finished_reward_sum - sum_prev) / n_new if n_new else math.nan,
            "staleness/mean": float(sum(int(k) * v for k, v in lag.items()) / max(sum(lag.values()), 1)),
            "staleness/max": int(max((int(k) for k, v in lag.items() if v), default=0)),
            "staleness/hist": {str(k): float(v) for k, v in lag.items()},
            "rollout/queue_depth": cluster.channel.qsize(),
            "rollout/accepted": counters.accepted,
            "rollout/rejected": counters.rejected,
            "throughput/generated_tokens_per_s": ctl.generation_tokens_per_s,
            "rollout/preempted_samples": ctl.generation_preempted_samples,  # cumulative (paged KV cache)
            # History tokens re-prefilled since the last step (EngineConfig.on_swap "recompute": every
            # in-flight history at each swap; also resumed preemptions).
            "rollout/reprefill_tokens": reprefill,
            # Of those, tokens computed once for several samples (a group's shared prompt).
            "rollout/reprefill_shared_tokens": spared,
            # Of those, tokens the decode steps re-prefilled beside their decode rows
            # (EngineConfig.reprefill_in_decode_rows); the rest ran as packed calls.
            "rollout/reprefill_ride_tokens": rode,
            # KV pages a group's samples shared (their prompt's full pages) since the last step.
            "rollout/kv_pages_shared": shared,
            "throughput/tokens_per_s": train.get("trained_tokens", 0.0) / max(train.get("time_step_s", 1e-9), 1e-9),
            "time/wait_batch_s": wait_s,
            "time/train_step_s": train.get("time_step_s", math.nan),
            "time/weight_transfer_s": transfer_s,
            # What the last swap moved to the generation devices (with LoRA: the adapters only).
            "transfer/bytes": _last_transfer_bytes(cluster.weight_sync),
            # Its wall time on this process, and whether it sent every weight or only the changed
            # ones (RLConfig.transfer_mode "delta": 1.0 when sparse).
            "transfer/seconds": _last_transfer_stat(cluster.weight_sync, "total_s"),
            "transfer/sparse": float(_last_transfer_stat(cluster.weight_sync, "mode") == "sparse"),
        }
        agent = agent_counters(groups)
        if agent:  # the agent workflow's sessions behind this step's groups (workflows/agent.py)
            metrics.update({k: v for k, v in agent.items() if k != "agent/calls"})
            metrics["agent/calls_mean"] = agent["agent/calls"] / max(agent["agent/sessions"], 1)
        pool = cluster.reward_pool
        if pool is not None:  # calls past their deadline (scored 0.0), and ones that crashed or raised
            stats = pool.stats()
            seen, self._pool_seen = self._pool_seen, (stats.timeouts, stats.crashes + stats.errors)
            timeouts, failures = self._pool_seen[0] - seen[0], self._pool_seen[1] - seen[1]
            if jax.process_count() > 1:
                timeouts, failures = agree_sum(timeouts), agree_sum(failures)
            metrics["reward/timeouts"], metrics["reward/failures"] = timeouts, failures
        metrics.update(term_metrics(g.info for g in groups))  # a composite reward's terms: mean, failed
        # The engine's and the objective's metrics (a user loss's included) as train/<name>; timings
        # go under time/, the lag histogram under staleness/; the engine-vs-trainer log-prob gap of
        # the tokens the trained weights sampled is the rollout side's (rollout/behav_logp_gap).
        metrics.update({f"train/{k}": v for k, v in train.items() if k != "fresh_logp_gap"
                        and isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("time_")})
        if "fresh_logp_gap" in train:
            metrics["rollout/behav_logp_gap"] = train["fresh_logp_gap"]
        metrics["timings"] = self._timings(train, out.minibatches)
        if out.kl_mean is not None:
            metrics["train/kl_to_reference"] = out.kl_mean
        return metrics

    def _timings(self, train: dict[str, Any], minibatches) -> dict[str, Any]:
        """The engine's calls since the previous record (generation/timings.py) and the training step
        with the shapes it ran."""
        now = self.cluster.engine.timings()
        out = timings_delta(now, self._timings_seen)
        self._timings_seen = now
        shapes = [mb.shape for minibatch in minibatches for mb in minibatch]
        out["train"] = {"s": train.get("time_step_s", math.nan), "minibatches": len(minibatches),
                        "microbatches": len(shapes), "padded_tokens": sum(r * t for r, t in shapes),
                        "attention": float(sum(r * t * t for r, t in shapes))}
        return out


def agent_counters(groups: Sequence[TrajectoryGroup]) -> dict[str, int]:
    """The agent workflow's sessions behind `groups` (workflows/agent.py's group info): sessions,
    failed and timed-out ones, model calls. Empty when no group came from that workflow."""
    agent = [g.info for g in groups if "failed_sessions" in g.info]
    if not agent:
        return {}
    return {"agent/sessions": sum(len(info["turns"]) for info in agent),
            "agent/failed_sessions": sum(info["failed_sessions"] for info in agent),
            "agent/timed_out_sessions": sum(info["timed_out_sessions"] for info in agent),
            "agent/calls": sum(sum(info["turns"]) for info in agent)}


def _last_transfer_stat(sync: Any, name: str) -> Any:
    """One field of the last swap's TransferStats (NaN before any)."""
    stats = None if sync is None else sync.last_stats
    return getattr(stats, name) if stats is not None else math.nan


def _last_transfer_bytes(sync: Any) -> float:
    """Bytes the last swap moved to the generation devices (0 before any, or for another engine pair)."""
    stats = None if sync is None else sync.last_stats
    return float(stats.num_bytes) if stats is not None else 0.0
