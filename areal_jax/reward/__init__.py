"""Rewards computed off the generation path: math (math-verify), code (sandbox), and a
supervised process pool that runs them with deadlines.

Names are re-exported lazily (PEP 562) so that importing the pool in the controller does not
import sympy / math-verify into the JAX process; workers import what they run.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "math_reward": "areal_jax.reward.math",
    "extract_last_boxed": "areal_jax.reward.math",
    "code_reward": "areal_jax.reward.code",
    "extract_last_code_block": "areal_jax.reward.code",
    "run_test_cases": "areal_jax.reward.code",
    "SandboxLimits": "areal_jax.reward.code",
    "RewardPool": "areal_jax.reward.pool",
    "RewardPoolConfig": "areal_jax.reward.pool",
    "RewardPoolStats": "areal_jax.reward.pool",
    "RewardFunctionNotFound": "areal_jax.reward.pool",
    "BUILTIN_REWARDS": "areal_jax.reward.registry",
    "register_reward": "areal_jax.reward.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
