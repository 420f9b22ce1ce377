"""Rollout-side generation: continuous batching over slots with interruptible weight swaps."""

from areal_jax.generation.config import EngineConfig
from areal_jax.generation.engine import (
    Completion,
    EngineStats,
    GenerationEngine,
    GroupResult,
    RequestHandle,
)
from areal_jax.generation.offline import generate
from areal_jax.generation.program_specs import engine_program_specs
from areal_jax.generation.sampling import SamplingParams, allowed_mask, behavior_logprobs, sample_tokens

__all__ = [
    "Completion", "EngineConfig", "EngineStats", "GenerationEngine", "GroupResult", "RequestHandle",
    "engine_program_specs",
    "SamplingParams", "allowed_mask", "behavior_logprobs", "generate", "sample_tokens",
]
