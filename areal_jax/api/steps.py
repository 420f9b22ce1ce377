"""A finished RL step as data (`StepInfo`): what the loop hands its hooks, and the hooks (`Hook`).

A hook receives data, never the loop: what else it needs (an engine, a writer, a checkpointer) it
is built with. Stages of a step, in order (trainer/hooks.py has the built-in hooks):

- "update": the trainer has updated and the version is bumped; the new weights have not reached
  the generator yet (a checkpoint's resume point is taken here);
- "metrics": the step's record is assembled; a hook may add to `info.metrics`;
- "record": the record is final (the run's records, then the checkpoint write);
- "end": once, when the run ends however it ends, with the last completed step's info.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from areal_jax.api.trajectories import TrajectoryGroup

__all__ = ["STAGES", "Hook", "Stage", "StepInfo"]

Stage = Literal["update", "metrics", "record", "end"]
STAGES: tuple[Stage, ...] = ("update", "metrics", "record", "end")


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One RL step as its hooks see it.

    step: the step's index (0-based); version: the policy version after its update; groups: the
    trajectory groups it trained on, in the order it trained them; metrics: its record (empty at
    "update"; hooks at "metrics" add to this dict); trained_tokens: over the whole run, resumes
    included, this step's counted; last: whether it is the run's last step (RLConfig.steps - 1);
    stopped: at "end", whether a stop request (SIGTERM/SIGINT) ended the run early; counters: the
    run's cumulative counts of what it trained, resumes included, this step's counted (the agent
    workflow's "agent/sessions", "agent/failed_sessions", "agent/timed_out_sessions",
    "agent/calls"; empty for other workflows). A checkpoint saves them.
    """

    step: int
    version: int
    groups: tuple[TrajectoryGroup, ...]
    metrics: dict[str, Any]
    trained_tokens: float = 0.0
    last: bool = False
    stopped: bool = False
    counters: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn(info)` at `stage` after each step whose index + 1 is a multiple of `every` ("end": once)."""

    fn: Callable[[StepInfo], None]
    stage: Stage = "record"
    every: int = 1

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"hook stage must be one of {STAGES}, got {self.stage!r}")
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ValueError(f"hook every must be an int >= 1, got {self.every!r}")
