"""`areal-jax simulate`'s numeric flags checked before any work: finite, positive where a zero or a
negative value has no meaning, and never replaced by a default (an explicit 0 is refused, not read
as "unset"). Raises ValueError naming the flag (the command prints it as one line, exit 2)."""

from __future__ import annotations

import math
from typing import Any

# flag -> (smallest allowed value, whether it may equal it); None values mean "unset" (the default).
_BOUNDS = {"steps": (1, True), "warmup": (0, True), "devices_per_host": (1, True), "hosts": (1, True),
           "calibrate_skip": (0, True), "reward_s": (0.0, True), "transfer_gbps": (0.0, False),
           "tune_top": (1, True), "tune_compiled_s": (0.0, True)}


def check_flags(args: Any) -> None:
    for name, (low, inclusive) in _BOUNDS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            bound = f">= {low}" if inclusive else f"> {low}"
            raise ValueError(f"--{name} must be a finite number {bound}, got {value}")
    changed = getattr(args, "transfer_changed", None)
    if changed is not None and not (math.isfinite(changed) and 0.0 <= changed <= 1.0):
        raise ValueError(f"--transfer_changed must be a share between 0 and 1, got {changed}")
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup ({args.warmup}) must be below --steps ({args.steps}): no step would be measured")
