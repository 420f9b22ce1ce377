"""Rewards computed off the generation path: math (math-verify), code (sandbox), a supervised
process pool that runs them with deadlines, the registry that says which may run in-process, and
learned rewards (`RewardModel`: a scalar reward model; `Judge`: a generative judge).

Names are re-exported lazily (PEP 562) so that importing the pool in the controller does not
import sympy / math-verify into the JAX process; workers import what they run.
"""

from __future__ import annotations

from areal_jax.lazy_exports import lazy_exports

_EXPORTS = {
    "math_reward": "areal_jax.reward.math",
    "gsm8k_reward": "areal_jax.reward.gsm8k",
    "extract_last_boxed": "areal_jax.reward.math",
    "code_reward": "areal_jax.reward.code",
    "extract_last_code_block": "areal_jax.reward.code",
    "run_test_cases": "areal_jax.reward.code",
    "SandboxLimits": "areal_jax.reward.sandbox",
    "SandboxUnavailable": "areal_jax.reward.sandbox",
    "Judge": "areal_jax.reward.judge",
    "JudgeConfig": "areal_jax.reward.judge",
    "RewardModel": "areal_jax.reward.reward_model",
    "RewardPool": "areal_jax.reward.pool",
    "RewardPoolConfig": "areal_jax.reward.pool",
    "RewardPoolStats": "areal_jax.reward.pool",
    "RewardFunctionNotFound": "areal_jax.reward.pool",
    "REWARDS": "areal_jax.reward.registry",
    "RewardSpec": "areal_jax.reward.registry",
    "register_reward": "areal_jax.reward.registry",
    "register_reward_callable": "areal_jax.reward.registry",
    "runs_in_process": "areal_jax.reward.registry",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
