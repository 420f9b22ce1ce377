"""PPO math: the decoupled objective, advantages, KL estimators (pure functions)."""

from areal_jax.ppo.advantages import AdvantageConfig, compute_advantages
from areal_jax.ppo.kl import KL_ESTIMATORS, kl_estimate
from areal_jax.ppo.loss import (
    accumulate_loss_stats,
    decoupled_ppo_loss,
    summarize_loss_stats,
    token_entropy,
    token_logprobs,
)

__all__ = [
    "AdvantageConfig",
    "KL_ESTIMATORS",
    "accumulate_loss_stats",
    "compute_advantages",
    "decoupled_ppo_loss",
    "kl_estimate",
    "summarize_loss_stats",
    "token_entropy",
    "token_logprobs",
]
