"""The training engine's configs: its optimizer (OptimizerConfig, trainer/optimizer.py builds it)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

__all__ = ["SCHEDULES", "OptimizerConfig", "Schedule"]

Schedule = Literal["constant", "cosine", "linear"]
SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyperparameters.

    Attributes:
        lr: peak learning rate (paper: Adam 2e-5).
        warmup_steps: linear warmup over this many updates: update s uses lr * (s + 1) / W,
            so the first update already moves the weights.
        schedule: after warmup, "constant", or "cosine"/"linear" decay to lr * min_lr_ratio
            at update `total_steps` (held there afterwards).
        total_steps: total optimizer updates; required by "cosine" and "linear".
        min_lr_ratio: final lr as a fraction of `lr`, in [0, 1].
        weight_decay: decoupled (AdamW) weight decay, applied to every parameter.
        b1, b2, eps: Adam moments and denominator epsilon.
        max_grad_norm: clip the gradient to this global L2 norm; None disables clipping.
    """

    lr: float = 2e-5
    warmup_steps: int = 0
    schedule: Schedule = "constant"
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        for name in ("lr", "min_lr_ratio", "weight_decay", "b1", "b2", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"OptimizerConfig.{name} must be a finite number, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"OptimizerConfig.lr must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimizerConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.total_steps is not None and (
                isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int)
                or self.total_steps <= self.warmup_steps):
            raise ValueError(f"OptimizerConfig.total_steps must be an int > warmup_steps ({self.warmup_steps}), "
                             f"got {self.total_steps!r}")
        if self.schedule != "constant" and self.total_steps is None:
            raise ValueError(f"OptimizerConfig.schedule={self.schedule!r} needs total_steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"OptimizerConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0:
            raise ValueError(f"OptimizerConfig.eps must be > 0, got {self.eps}")
        if self.max_grad_norm is not None and not (
                isinstance(self.max_grad_norm, (int, float)) and not isinstance(self.max_grad_norm, bool)
                and math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
