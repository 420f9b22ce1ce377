"""The trainer: packed micro-batches (batching), AdamW (optimizer), the jitted training step of an
objective (train_step, engine_config), the objectives (objectives) and the RL algorithm (algorithm)."""

from areal_jax.trainer.batching import (
    SEQUENCE_KEYS,
    PackedBatch,
    build_sequences,
    make_microbatches,
    rows_for_bin,
    rows_for_bucket,
)
from areal_jax.trainer.optimizer import OptimizerConfig, build_optimizer, learning_rate_schedule
from areal_jax.trainer.config import PPOConfig, RLConfig
from areal_jax.trainer.engine_config import Objective, TrainEngineConfig
from areal_jax.trainer.train_step import PolicyTrainer

__all__ = [
    "SEQUENCE_KEYS",
    "Objective",
    "OptimizerConfig",
    "PPOConfig",
    "PackedBatch",
    "PolicyTrainer",
    "RLConfig",
    "TrainEngineConfig",
    "build_optimizer",
    "build_sequences",
    "learning_rate_schedule",
    "make_microbatches",
    "rows_for_bin",
    "rows_for_bucket",
]
