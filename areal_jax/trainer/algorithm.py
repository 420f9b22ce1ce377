"""The algorithm step of RL: a batch of prompt groups -> advantages -> micro-batches -> `train_step`.

`PPOStep` is what one training step computes, with nothing of the cluster around it: no engine,
no weight transfer, no records. It works on any `api.TrainEngine`. Every process must run the
same programs in the same order, so across processes the micro-batch counts and shapes and the
loss denominator are agreed (collectives: every process calls the step in step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from areal_jax import api
from areal_jax.parallel.distributed import agree_max, agree_sum, agree_sum_array
from areal_jax.ppo.advantages import AdvantageConfig
from areal_jax.api import TrajectoryGroup
from areal_jax.trainer.batching import PackedBatch, make_microbatches, sequence_group_ids
from areal_jax.trainer.reference import ReferencePolicy, sequences_with_kl

__all__ = ["PPOStep", "StepOutput"]


@dataclasses.dataclass
class StepOutput:
    """What one step computed: the trainer's metrics, the minibatches it ran (lists of micro-batches)
    and, with the KL penalty on, the mean KL to the reference policy."""

    train: dict[str, Any]
    minibatches: list[list[PackedBatch]]
    kl_mean: float | None = None


class PPOStep:
    """Decoupled PPO's step on `trainer`: advantages per `advantages` (shaped by the KL to
    `reference` when given), the groups split into `PPOConfig.num_minibatches` minibatches in a
    seeded order reproducible by step, packed into micro-batches whose rows split over the train
    mesh's "fsdp" x "expert" axes (`rows_per_process` rows per process at least), then one `train_step`."""

    def __init__(self, trainer: api.TrainEngine, advantages: AdvantageConfig, *,
                 reference: ReferencePolicy | None = None, rows_per_process: int = 1):
        self.trainer, self.advantages, self.reference = trainer, advantages, reference
        self.rows_per_process = rows_per_process

    def __call__(self, groups: Sequence[TrajectoryGroup], *, step: int, version: int) -> StepOutput:
        ppo = self.trainer.ppo_config
        multi = jax.process_count() > 1
        # KL against the frozen reference (off by default) shapes the advantages; with it off this
        # is exactly build_sequences. Batch-level advantage statistics span every process's groups.
        buckets = ppo.row_buckets or None  # () = make_microbatches' default lengths
        shaped = sequences_with_kl(groups, self.advantages, self.trainer, self.reference,
                                   row_multiple=self.rows_per_process, buckets=buckets,
                                   agree_max=agree_max if multi else None,
                                   reduce_sum=agree_sum_array if multi else None)
        seqs = shaped.sequences
        # Every process must run the same programs in the same order: agree on micro-batch counts
        # and shapes, and on the minibatch token count that divides the loss. The groups are split
        # into minibatches in a seeded order of their own, reproducible by step.
        minibatches = make_microbatches(seqs, max_tokens_per_microbatch=ppo.max_tokens_per_microbatch,
                                        buckets=buckets,
                                        num_minibatches=min(ppo.num_minibatches, len(seqs)),
                                        row_multiple=self.rows_per_process,
                                        agree_max=agree_max if multi else None, agree_sum=agree_sum if multi else None,
                                        group_ids=sequence_group_ids(groups), shuffle_seed=(ppo.minibatch_seed, step))
        train = self.trainer.train_step(minibatches, current_version=version)
        return StepOutput(train=train, minibatches=minibatches, kl_mean=shaped.kl_mean)
