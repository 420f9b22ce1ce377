"""What rollouts hand to the trainer: trajectories grouped by prompt.

Token alignment used by the trainer (one row per trajectory, length L = P + G):
  input_ids[i]         = sequence token i              (prompt then completion)
  target i             = sequence token i + 1          (the last position has no target)
  loss_mask[i]         = 1 where target i is a completion token the model generated (a
                         multi-turn workflow's inserted tokens, e.g. feedback turns, are 0)
  behavior_logprobs[i] = log-prob the generator assigned to target i (0 elsewhere)
  versions[i]          = policy version that sampled target i (-1 for prompt targets / padding)
  moe_routing[i]       = experts `[L_moe, k]` (sparse layers only) the generator's router chose
                         for input token i (MoE policies; zeros where the engine never fed the
                         token in: the last completion token)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Trajectory", "TrajectoryGroup"]


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One sampled completion. completion arrays are `[G]`, prompt `[P]`.

    loss_mask `[G]` (None: every completion token was generated): 1 on the tokens the policy
    sampled, 0 on tokens a workflow put into the context itself (a multi-turn episode's feedback
    turns, tool output). Only the 1s are trained and count as generated; the 0s need no
    behaviour log-prob or version (by convention 0.0 and -1).
    """

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    behavior_logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    stop_reason: str = "stop"
    loss_mask: np.ndarray | None = None
    # MoE policies: the engine's chosen experts `[P + G, L_moe, k]` per input token and sparse layer
    # (models/moe.py `record`: uint8 up to 256 experts), replayed by TrainEngineConfig.moe_routing = "replay".
    moe_routing: np.ndarray | None = None

    def __post_init__(self):
        g = len(self.completion_ids)
        if len(self.prompt_ids) == 0:
            raise ValueError("Trajectory.prompt_ids is empty")
        if len(self.behavior_logprobs) != g or len(self.versions) != g:
            raise ValueError(f"Trajectory arrays disagree: {g} completion ids, {len(self.behavior_logprobs)} "
                             f"logprobs, {len(self.versions)} versions")
        if self.loss_mask is not None:
            mask = np.asarray(self.loss_mask)
            if mask.shape != (g,) or not np.isin(mask, (0, 1)).all():
                raise ValueError(f"Trajectory.loss_mask must be [{g}] zeros and ones (one per completion token), "
                                 f"got shape {mask.shape}")
            object.__setattr__(self, "loss_mask", mask.astype(np.float32))
        if self.moe_routing is not None and (np.ndim(self.moe_routing) != 3 or len(self.moe_routing) != self.length):
            raise ValueError(f"Trajectory.moe_routing must be [{self.length}, L_moe, k] (one row per input token), "
                             f"got shape {np.shape(self.moe_routing)}")

    @property
    def generated_tokens(self) -> int:
        """Completion tokens the policy sampled (the loss mask's 1s)."""
        return len(self.completion_ids) if self.loss_mask is None else int(self.loss_mask.sum())

    @property
    def generated_versions(self) -> np.ndarray:
        """The policy versions of the sampled tokens (inserted tokens left out)."""
        return self.versions if self.loss_mask is None else np.asarray(self.versions)[self.loss_mask > 0]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def training_row(self) -> dict[str, np.ndarray]:
        """Per-token arrays `[L]` in the alignment described in the module docstring."""
        P, G = len(self.prompt_ids), len(self.completion_ids)
        L = P + G
        ids = np.concatenate([self.prompt_ids, self.completion_ids]).astype(np.int32)
        loss_mask = np.zeros(L, np.float32)
        generated = 1.0 if self.loss_mask is None else self.loss_mask
        loss_mask[P - 1:L - 1] = generated
        behav = np.zeros(L, np.float32)
        behav[P - 1:L - 1] = self.behavior_logprobs * generated
        versions = np.full(L, -1, np.int32)
        versions[P - 1:L - 1] = np.where(generated > 0, self.versions, -1)
        targets = np.zeros(L, np.int32)
        targets[:-1] = ids[1:]
        row = {"input_ids": ids, "targets": targets, "loss_mask": loss_mask, "behavior_logprobs": behav,
               "versions": versions}
        if self.moe_routing is not None:
            row["moe_routing"] = np.asarray(self.moe_routing)
        return row


@dataclasses.dataclass(frozen=True)
class TrajectoryGroup:
    """The samples of one prompt (the unit of admission, staleness accounting and GRPO-style norms)."""

    query_id: str
    trajectories: tuple[Trajectory, ...]
    admitted_version: int
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(t.length for t in self.trajectories)

    @property
    def oldest_version(self) -> int:
        """Oldest policy version among generated tokens (admitted_version if none were generated)."""
        versions = [int(v.min()) for v in (t.generated_versions for t in self.trajectories) if len(v)]
        return min(versions, default=self.admitted_version)
