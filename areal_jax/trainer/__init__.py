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
from areal_jax.trainer.train_step import JaxTrainEngine

__all__ = [
    "SEQUENCE_KEYS",
    "Objective",
    "OptimizerConfig",
    "PPOConfig",
    "PackedBatch",
    "JaxTrainEngine",
    "RLConfig",
    "TrainEngineConfig",
    "build_optimizer",
    "build_sequences",
    "learning_rate_schedule",
    "make_microbatches",
    "rows_for_bin",
    "rows_for_bucket",
]


def __getattr__(name: str):
    if name == "PolicyTrainer":  # the training engine's name before issue 38, with its warning
        from areal_jax.trainer import train_step

        return train_step.PolicyTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
