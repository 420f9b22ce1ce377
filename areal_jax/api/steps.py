"""A finished RL step as data (`StepInfo`): what the loop hands its hooks."""

from __future__ import annotations

import dataclasses
from typing import Any

from areal_jax.api.trajectories import TrajectoryGroup

__all__ = ["StepInfo"]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One RL step as its hooks see it.

    step: the step's index (0-based); version: the policy version after its update; groups: the
    trajectory groups it trained on; metrics: its record (hooks at the "metrics" stage add to
    this dict); last: whether it is the run's last step.
    """

    step: int
    version: int
    groups: list[TrajectoryGroup]
    metrics: dict[str, Any]
    last: bool = False
