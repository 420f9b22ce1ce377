"""The algorithm step of RL: a batch of prompt groups -> advantages -> micro-batches -> `train_step`.

`PPOStep` is what one training step computes, with nothing of the cluster around it: no engine,
no weight transfer, no records. It works on any `api.TrainEngine`, which it hands the step's
micro-batches with what its objective reads beyond the packed arrays: the proximal policy's
log-probs (decoupled PPO; recomputed with the pre-step weights, or A-3PO's interpolation weights),
and it adds its own metrics to the engine's (the version lag of the trained tokens, the share of
the gradient the most off-policy tokens carry). The objective itself is a function the engine
compiles (`ppo_objective`; trainer/objectives.py). Every process must run the same programs in
the same order, so across processes the micro-batch counts and shapes and the loss denominator
are agreed (collectives: every process calls the step in step).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from areal_jax import api
from areal_jax.api import PackedBatch, TrajectoryGroup
from areal_jax.models.config import ModelConfig
from areal_jax.parallel.distributed import agree_max, agree_sum, agree_sum_array
from areal_jax.ppo.advantages import AdvantageConfig
from areal_jax.ppo.loss import loglinear_alpha, weight_top_share
from areal_jax.trainer.batching import make_microbatches, sequence_group_ids
from areal_jax.trainer.config import PPOConfig
from areal_jax.trainer.engine_config import Objective, OptimizerConfig, TrainEngineConfig
from areal_jax.trainer.objectives import ALPHA_KEY, PROXIMAL_KEY, resolve_objective
from areal_jax.trainer.programs import FRESH_KEY
from areal_jax.trainer.reference import ReferencePolicy, sequences_with_kl
from areal_jax.trainer.train_step import JaxTrainEngine

__all__ = ["PPOStep", "StepOutput", "attach_proximal", "mark_fresh", "ppo_objective", "ppo_trainer", "proximal_keys",
           "version_lag_hist"]


def ppo_objective(ppo: PPOConfig) -> Objective:
    """The loss a training engine compiles for `ppo`: PPOConfig.objective's function, called with
    `ppo`, the log-probs at its temperature."""
    return Objective(resolve_objective(ppo.objective), ppo, ppo.logit_temperature, name=ppo.objective)


def ppo_trainer(model_cfg: ModelConfig, params: Any, opt_cfg: OptimizerConfig, ppo: PPOConfig, *,
                engine: TrainEngineConfig | None = None, **kwargs: Any) -> JaxTrainEngine:
    """The native training engine set up for `ppo` (kwargs: JaxTrainEngine's mesh, rules, lora)."""
    return JaxTrainEngine(model_cfg, params, opt_cfg, ppo_objective(ppo), engine=engine, **kwargs)


def proximal_keys(ppo: PPOConfig, num_minibatches: int | None = None) -> tuple[str, ...]:
    """The batch keys `attach_proximal` adds for a step of `num_minibatches` (default
    PPOConfig.num_minibatches): none where the objective needs no pi_prox (naive PPO) or the engine's
    own pre-update log-probs are it (one update per step), else the recomputed log-probs or A-3PO's
    weights."""
    m = ppo.num_minibatches if num_minibatches is None else num_minibatches
    if not ppo.decoupled or m == 1:
        return ()
    return (ALPHA_KEY,) if ppo.prox_logp_method == "loglinear" else (PROXIMAL_KEY,)


def attach_proximal(trainer: api.TrainEngine, minibatches: Sequence[Sequence[PackedBatch]], ppo: PPOConfig,
                    version: int) -> list[list[PackedBatch]]:
    """`minibatches` with pi_prox for the objective, taken before any update of the step: the
    current weights' log-probs (`trainer.compute_logprobs`), or with PPOConfig.prox_logp_method
    "loglinear" (A-3PO) the interpolation weights from the token versions (`version`: the policy
    version being trained), on micro-batches that lack them. One minibatch needs neither: the
    engine's own pre-update log-probs are pi_prox (trainer/train_step.py); naive PPO anchors at the
    behaviour policy."""
    if not proximal_keys(ppo, len(minibatches)) or all(PROXIMAL_KEY in m.arrays for mb in minibatches for m in mb):
        return [list(mb) for mb in minibatches]
    if ppo.prox_logp_method == "loglinear":
        return [[m if PROXIMAL_KEY in m.arrays or ALPHA_KEY in m.arrays
                 else m.with_arrays(**{ALPHA_KEY: loglinear_alpha(np.asarray(m.arrays["versions"]), version)})
                 for m in mb] for mb in minibatches]
    out = [[m if PROXIMAL_KEY in m.arrays else m.with_arrays(**{PROXIMAL_KEY: trainer.compute_logprobs(m)})
            for m in mb] for mb in minibatches]
    jax.block_until_ready([m.arrays[PROXIMAL_KEY] for mb in out for m in mb])
    return out


def mark_fresh(minibatches: Sequence[Sequence[PackedBatch]], version: int) -> list[list[PackedBatch]]:
    """`minibatches` with FRESH_KEY: 1.0 on the tokens `version` (the weights being trained)
    sampled, so the engine reports its log-prob gap to the inference engine's on them (lag 0)."""
    return [[m.with_arrays(**{FRESH_KEY: (np.asarray(m.arrays["versions"]) == version).astype(np.float32)})
             for m in mb] for mb in minibatches]


def version_lag_hist(minibatches: Sequence[Sequence[PackedBatch]], version: int) -> dict[int, int]:
    """{lag: tokens} of `version` - the version that sampled each trained token."""
    lags = [version - np.asarray(m.arrays["versions"])[np.asarray(m.arrays["loss_mask"]) > 0]
            for mb in minibatches for m in mb]
    values, counts = np.unique(np.concatenate(lags) if lags else np.zeros(0, np.int64), return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts)}


def ppo_metrics(train: dict[str, Any]) -> dict[str, Any]:
    """The engine's metrics of a PPO objective with the histograms over log(pi_prox / pi_behav)
    turned into `weight_top1pct_grad_share`: the share of the gradient the 1% of trained tokens with
    the largest weight carry (ppo.loss.weight_top_share)."""
    out = dict(train)
    if "weight_hist_tokens" in out and "weight_hist_grad" in out:
        out["weight_top1pct_grad_share"] = weight_top_share(out.pop("weight_hist_tokens"), out.pop("weight_hist_grad"))
    return out


@dataclasses.dataclass
class StepOutput:
    """What one step computed: the trainer's metrics with the algorithm's own, the minibatches it
    ran (lists of micro-batches) and, with the KL penalty on, the mean KL to the reference policy."""

    train: dict[str, Any]
    minibatches: list[list[PackedBatch]]
    kl_mean: float | None = None


class PPOStep:
    """PPO's step on `trainer` (built with `ppo_objective(ppo)`): advantages per `advantages`
    (shaped by the KL to `reference` when given), the groups split into `PPOConfig.num_minibatches`
    minibatches in a seeded order reproducible by step, packed into micro-batches (the engine's
    TrainEngineConfig budget and buckets) whose rows split over the train mesh's "fsdp" x "expert"
    axes (`rows_per_process` rows per process at least), pi_prox attached, then one `train_step`."""

    def __init__(self, trainer: api.TrainEngine, advantages: AdvantageConfig, ppo: PPOConfig, *,
                 reference: ReferencePolicy | None = None, rows_per_process: int = 1):
        self.trainer, self.advantages, self.ppo, self.reference = trainer, advantages, ppo, reference
        self.rows_per_process = rows_per_process

    def __call__(self, groups: Sequence[TrajectoryGroup], *, step: int, version: int) -> StepOutput:
        ppo, engine = self.ppo, self.trainer.engine_config
        multi = jax.process_count() > 1
        # KL against the frozen reference (off by default) shapes the advantages; with it off this
        # is exactly build_sequences. Batch-level advantage statistics span every process's groups.
        buckets = engine.row_buckets or None  # () = make_microbatches' default lengths
        shaped = sequences_with_kl(groups, self.advantages, self.trainer, self.reference,
                                   row_multiple=self.rows_per_process, buckets=buckets,
                                   agree_max=agree_max if multi else None,
                                   reduce_sum=agree_sum_array if multi else None, attach_proximal=ppo.decoupled)
        seqs = shaped.sequences
        # Every process must run the same programs in the same order: agree on micro-batch counts
        # and shapes, and on the minibatch token count that divides the loss. The groups are split
        # into minibatches in a seeded order of their own, reproducible by step.
        minibatches = make_microbatches(seqs, max_tokens_per_microbatch=engine.max_tokens_per_microbatch,
                                        buckets=buckets,
                                        num_minibatches=min(ppo.num_minibatches, len(seqs)),
                                        row_multiple=self.rows_per_process,
                                        agree_max=agree_max if multi else None, agree_sum=agree_sum if multi else None,
                                        group_ids=sequence_group_ids(groups), shuffle_seed=(ppo.minibatch_seed, step),
                                        share_prefixes=engine.share_prefixes)
        train = self.train(minibatches, version)
        return StepOutput(train=train, minibatches=minibatches, kl_mean=shaped.kl_mean)

    def train(self, minibatches: Sequence[Sequence[PackedBatch]], version: int) -> dict[str, Any]:
        """pi_prox attached (`attach_proximal`) and the lag-0 tokens marked (`mark_fresh`), one
        `train_step`; the metrics with the algorithm's:
        "version_lag_hist" ({lag: tokens}), weight_top1pct_grad_share, time_proximal_s."""
        t0 = time.perf_counter()
        prepared = attach_proximal(self.trainer, minibatches, self.ppo, version)
        t_prox = time.perf_counter() - t0
        train = ppo_metrics(self.trainer.train_step(mark_fresh(prepared, version)))
        train["time_proximal_s"] = t_prox
        train["time_step_s"] = train.get("time_step_s", 0.0) + t_prox
        train["version_lag_hist"] = version_lag_hist(prepared, version)
        return train
