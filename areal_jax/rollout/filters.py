"""Pure checks on finished groups: dynamic filtering and the token-staleness bound.

A group filter maps a group to a rejection reason (a short string that names the counter
it is reported under) or None to keep it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from areal_jax.api import TrajectoryGroup

__all__ = ["GroupFilter", "all_rewards_equal", "equal_rewards_filter", "is_too_stale", "token_lag"]

GroupFilter = Callable[[TrajectoryGroup], "str | None"]


def all_rewards_equal(group: TrajectoryGroup) -> bool:
    """Whether every trajectory of `group` has the same reward.

    Such a group has zero group-normalized advantage everywhere: no learning signal. A group
    of a single trajectory counts as all-equal only when that is intended, so callers filter
    on it only for groups of n >= 2.
    """
    rewards = np.asarray([t.reward for t in group.trajectories], np.float64)
    return rewards.size > 0 and bool(np.all(rewards == rewards[0]))


def equal_rewards_filter(group: TrajectoryGroup) -> str | None:
    """Group filter: reject groups of >= 2 trajectories whose rewards are all equal."""
    if len(group.trajectories) >= 2 and all_rewards_equal(group):
        return "all_equal_rewards"
    return None


def token_lag(group: TrajectoryGroup, trainer_version: int) -> int:
    """How many versions the oldest generated token of `group` lags behind `trainer_version`."""
    return int(trainer_version) - group.oldest_version


def is_too_stale(group: TrajectoryGroup, trainer_version: int, max_staleness: int) -> bool:
    """Whether training on `group` at `trainer_version` would use a token more than
    `max_staleness` versions old, i.e. `oldest_version < trainer_version - max_staleness`.

    `trainer_version` is the version of the weights the update is computed with (a token
    sampled by exactly those weights lags 0). The controller applies it when a group finishes
    (RLConfig.max_group_age); the trainer does not apply it again (see RolloutController for the
    bound that holds).
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return token_lag(group, trainer_version) > max_staleness
