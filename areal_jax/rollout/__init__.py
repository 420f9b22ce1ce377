"""Rollout side: admission control (staleness), workflows, and the channel to the trainer."""

from areal_jax.rollout.channel import ChannelClosed, TrajectoryChannel
from areal_jax.rollout.controller import ControllerStats, RolloutController, ShutdownReport
from areal_jax.rollout.filters import GroupFilter, all_rewards_equal, equal_rewards_filter, is_too_stale, token_lag
from areal_jax.rollout.staleness import StalenessManager, StalenessStats
from areal_jax.rollout.workflow import (
    GenerationAborted,
    RewardTimeout,
    RLVRConfig,
    RLVRWorkflow,
    RolloutClient,
    RolloutWorkflow,
    load_workflow,
)

__all__ = [
    "ChannelClosed", "ControllerStats", "GenerationAborted", "GroupFilter", "RLVRConfig", "RLVRWorkflow",
    "RewardTimeout", "RolloutClient", "RolloutController", "RolloutWorkflow", "ShutdownReport", "StalenessManager",
    "StalenessStats", "TrajectoryChannel", "all_rewards_equal", "equal_rewards_filter", "is_too_stale",
    "load_workflow", "token_lag",
]
