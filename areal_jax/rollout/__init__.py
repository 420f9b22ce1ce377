"""Rollout side: admission control (staleness), workflows, and the channel to the trainer."""

from areal_jax.rollout.staleness import StalenessManager, StalenessStats

__all__ = ["StalenessManager", "StalenessStats"]
