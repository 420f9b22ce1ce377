"""`PlanConfig`: what `areal-jax plan` plans for, bound gin-style beside the run's own configs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """Where a config is meant to run, and the planner's assumptions.

    Attributes:
        target: the hardware (plan/targets.py names: "v5e-16", "v5p-128", "8xh100", "4x8xh100").
            `--target` overrides it.
        model_config: an HF config.json, or a directory holding one, for the model's shapes;
            default ModelSource.path. A relative path is looked up from the working directory,
            then beside the first gin file.
        headroom: share of each device's memory a program must leave free to count as fitting
            (allocator fragmentation, runtime buffers, collectives' scratch).
        mean_prompt_fraction: mean prompt length as a share of DataConfig.max_prompt_tokens,
            for the throughput prediction.
        mean_completion_fraction: mean completion length as a share of RLVRConfig.max_new_tokens.
    """

    target: str | None = None
    model_config: str | None = None
    headroom: float = 0.10
    mean_prompt_fraction: float = 0.5
    mean_completion_fraction: float = 0.5

    def __post_init__(self):
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"PlanConfig.headroom must be in [0, 1), got {self.headroom!r}")
        for name in ("mean_prompt_fraction", "mean_completion_fraction"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"PlanConfig.{name} must be in (0, 1], got {value!r}")
