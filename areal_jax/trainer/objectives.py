"""Objectives: what the training engine minimises, one function each.

The contract, `objective(logprobs, batch, config) -> (per_token_loss, metrics)`:
- `logprobs` `[R, T]`: the current policy's log-probs of `batch["targets"]` (differentiated), at
  the objective's temperature.
- `batch` maps names to `[R, T]` arrays of the packed micro-batch: "loss_mask", "advantages",
  "behavior_logprobs", "proximal_logprobs", "versions" (-1 off the trained tokens), "segment_ids"
  (packed sequences: 0 = padding, 1..k the row's sequences), "input_ids", "targets",
  "positions", and what the algorithm added (A-3PO: "proximal_alpha"). "proximal_logprobs" is
  the algorithm's pi_prox where it gave one, else the policy's own log-probs before this update
  (a stop-gradient copy of `logprobs` without LoRA dropout).
- `config`: the algorithm's config (`PPOConfig` for RL; None for SFT).
- `per_token_loss` `[R, T]` and `metrics` {name: `[R, T]`, or `[R, T, K]` for a per-token
  vector}: the engine masks both with "loss_mask", divides the loss's sum by the minibatch's
  valid tokens (DESIGN.md 1.4: a token mean over the whole minibatch, however it is split into
  micro-batches) and each metric's by the step's; a metric whose name ends in "_max" is the max
  over the mask instead. Each is logged as `train/<name>`. The metrics' names and shapes must
  not depend on which optional keys the batch holds.

`PPOConfig.objective` picks one: a built-in name (`BUILTIN_OBJECTIVES`) or "package.module:function".
The built-ins are written the same way: the staleness ablation's three PPO objectives
(ppo/loss.py explains them) and SFT's completion loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from areal_jax.ppo.loss import loglinear_proximal_logprobs, ppo_token_loss
from areal_jax.user_code import load_callable

__all__ = ["ALPHA_KEY", "BUILTIN_OBJECTIVES", "PROXIMAL_KEY", "completion_nll", "decoupled", "naive",
           "naive_recompute", "resolve_objective"]

PROXIMAL_KEY = "proximal_logprobs"
# A-3PO: per-token weight of the log-linear proximal approximation (ppo.loglinear_alpha), which the
# algorithm computes on the host from the token versions in place of a proximal forward.
ALPHA_KEY = "proximal_alpha"

Batch = Mapping[str, jax.Array]


def _ppo(logprobs: jax.Array, anchor: jax.Array, batch: Batch, config: Any, *, mode: str, cap: float | None):
    return ppo_token_loss(logprobs, anchor, batch["behavior_logprobs"], batch["advantages"], batch["loss_mask"],
                          eps_clip=config.eps_clip, eps_clip_higher=config.eps_clip_higher, behav_imp_weight_cap=cap,
                          c_clip=config.c_clip, behav_imp_weight_mode=mode,
                          importance_sampling_level=config.importance_sampling_level,
                          segment_ids=batch["segment_ids"])


def decoupled(logprobs: jax.Array, batch: Batch, config: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoupled PPO: the clip anchored at pi_prox, the token weighted by pi_prox / pi_behav (capped
    as PPOConfig.behav_imp_weight_cap / _mode say). With "proximal_alpha" in the batch (A-3PO),
    pi_prox is interpolated between pi_behav and the policy's own log-probs."""
    prox = batch[PROXIMAL_KEY]
    if ALPHA_KEY in batch:
        prox = loglinear_proximal_logprobs(batch["behavior_logprobs"], prox, batch[ALPHA_KEY])
    return _ppo(logprobs, prox, batch, config, mode=config.behav_imp_weight_mode, cap=config.behav_imp_weight_cap)


def naive(logprobs: jax.Array, batch: Batch, config: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Naive PPO: the clip anchored at the behaviour policy (pi_prox := pi_behav, so w = 1)."""
    behav = batch["behavior_logprobs"]
    return _ppo(logprobs, behav, batch, config, mode=config.behav_imp_weight_mode, cap=config.behav_imp_weight_cap)


def naive_recompute(logprobs: jax.Array, batch: Batch, config: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clip anchored at the recomputed pi_prox, no behaviour weight (the cap fields unused)."""
    return _ppo(logprobs, batch[PROXIMAL_KEY], batch, config, mode="disabled", cap=None)


def completion_nll(logprobs: jax.Array, batch: Batch, config: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SFT's completion loss: the negative log-likelihood of the loss-mask tokens (their mean, once the
    engine divides by the minibatch's valid tokens)."""
    nll = -logprobs.astype(jnp.promote_types(logprobs.dtype, jnp.float32))
    return nll, {}


BUILTIN_OBJECTIVES: dict[str, Callable[..., Any]] = {
    "decoupled": decoupled,
    "naive": naive,
    "naive_recompute": naive_recompute,
    "sft": completion_nll,
}


def resolve_objective(name: str, field: str = "PPOConfig.objective") -> Callable[..., Any]:
    """The objective function `name` names: a built-in, or "package.module:function" (imported; one
    ValueError line naming `field` when it cannot be)."""
    if name in BUILTIN_OBJECTIVES:
        return BUILTIN_OBJECTIVES[name]
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"{field} = {name!r}: not a built-in objective ({', '.join(BUILTIN_OBJECTIVES)}) "
                         "nor of the form 'package.module:function'")
    return load_callable(name, field)
