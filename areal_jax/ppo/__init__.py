"""PPO math: the decoupled objective, advantages, KL estimators, chunked log-probs (pure functions)."""

from areal_jax.ppo.advantages import AdvantageConfig, compute_advantages
from areal_jax.ppo.kl import KL_ESTIMATORS, kl_estimate
from areal_jax.ppo.logprobs import DEFAULT_LOGIT_CHUNK_TOKENS, hidden_logprobs, hidden_logprobs_and_entropy
from areal_jax.ppo.loss import (
    accumulate_loss_stats,
    decoupled_ppo_loss,
    loglinear_alpha,
    loglinear_proximal_logprobs,
    ppo_token_loss,
    summarize_loss_stats,
    token_entropy,
    token_logprobs,
)

__all__ = [
    "AdvantageConfig",
    "DEFAULT_LOGIT_CHUNK_TOKENS",
    "KL_ESTIMATORS",
    "accumulate_loss_stats",
    "compute_advantages",
    "decoupled_ppo_loss",
    "hidden_logprobs",
    "hidden_logprobs_and_entropy",
    "kl_estimate",
    "loglinear_alpha",
    "loglinear_proximal_logprobs",
    "ppo_token_loss",
    "summarize_loss_stats",
    "token_entropy",
    "token_logprobs",
]
