"""The policy optimizer: AdamW with warmup + decay schedule and global-norm clipping.

Schedules count *optimizer updates* (one per minibatch, so `num_minibatches` per training
step); a skipped (non-finite) update does not advance them.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from areal_jax.trainer.engine_config import SCHEDULES, OptimizerConfig, Schedule  # noqa: F401  (re-exported)


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """lr as a function of the number of updates already applied (jit-compatible)."""
    peak, warmup, floor = float(cfg.lr), cfg.warmup_steps, float(cfg.lr) * cfg.min_lr_ratio
    decay_steps = None if cfg.total_steps is None else cfg.total_steps - warmup

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        if cfg.schedule == "constant" or decay_steps is None:
            after = jnp.full_like(count, peak)
        else:
            progress = jnp.clip((count - warmup) / decay_steps, 0.0, 1.0)
            if cfg.schedule == "linear":
                after = peak + (floor - peak) * progress
            else:  # cosine
                after = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        if warmup == 0:
            return after
        return jnp.where(count < warmup, peak * (count + 1.0) / warmup, after)

    return schedule


def build_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW driven by `learning_rate_schedule(cfg)`."""
    if not isinstance(cfg, OptimizerConfig):
        raise TypeError(f"cfg must be an OptimizerConfig, got {type(cfg).__name__}")
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay)
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
