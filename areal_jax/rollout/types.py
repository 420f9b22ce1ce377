"""What rollouts hand to the trainer: trajectories grouped by prompt (defined in `areal_jax.api`,
the seams' own types; re-exported here for existing imports)."""

from areal_jax.api.trajectories import Trajectory, TrajectoryGroup

__all__ = ["Trajectory", "TrajectoryGroup"]
