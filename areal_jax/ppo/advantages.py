"""Advantages for critic-free PPO with gamma = lambda = 1 (AReaL's paper setting).

Shapes: N = sequences (all answers of all prompt groups in the batch), T = token positions
(padded rows; loss_mask marks generated tokens that are trained).

Without a critic and with gamma = lambda = 1, GAE reduces to the reward-to-go: every
generated token of a sequence sees the sequence reward R, placed on its last generated
token. An optional per-token KL penalty against a frozen reference policy is reward
shaping, so token t additionally gets -kl_coef * sum_{s >= t} kl_s (its KL-to-go).

The returns are then normalized. Statistics are token-weighted -- every valid token
counts once, so a long answer weighs more than a short one -- like AReaL's AdvNorm
(masked mean and biased std over the loss mask, eps added to the std):
    "batch"       (G - mean) / (std + eps) over all valid tokens of the batch (paper)
    "group"       the same within each prompt group (GRPO)
    "group_mean"  G - group mean (Dr. GRPO: no std division)
    "rloo"        G - mean of the other sequences' rewards in the group (leave-one-out;
                  sequence-level, unweighted: the RLOO baseline is per sample)
    "group_then_batch"  AReaL HEAD's GRPO recipe (examples/math/gsm8k_grpo.yaml: reward_norm
                  at group level, then adv_norm at batch level; areal/utils/data.py
                  `Normalization`): each sequence reward is normalized within its group over
                  sequences, (R - mean) / (std + eps), then the returns get the token-weighted
                  batch normalization; both stds unbiased (n - 1), AReaL's default
    "none"        G unchanged

Reward shaping before any of this, in AReaL's order (areal/trainer/ppo/actor.py,
`_compute_advantages`): the overlong penalty (DAPO, areal/utils/functional/functional.py
`reward_overlong_penalty`) on the raw reward, then bias, scale and clip, then (with
"group_then_batch") the group normalization, then `mask_no_eos_with_zero` sets the reward of
truncated sequences (no EOS) to 0. The sequence still trains, with the advantage a 0 reward gets.

Across processes: each data-parallel process holds whole prompt groups, so the group statistics
are local; the batch statistics ("batch", the batch step of "group_then_batch") span the global
batch when `compute_advantages` gets `reduce_sum` (a cross-process sum, e.g.
`parallel.agree_sum_array`), as AReaL all-reduces them over its data-parallel ranks. The mean is
agreed first, then the squared deviations from it: the same two-pass statistics as on one process.

Implemented in NumPy (float64 inside): it runs once per step on the trainer host, before
packing, on a few thousand sequences; arbitrary group ids need np.unique, and host
float64 keeps the statistics exact without enabling x64 in JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import numpy as np

from areal_jax.ppo.kl import KL_ESTIMATORS, kl_estimate

AdvantageNorm = Literal["batch", "group", "group_mean", "rloo", "group_then_batch", "none"]
ADVANTAGE_NORMS: tuple[str, ...] = ("batch", "group", "group_mean", "rloo", "group_then_batch", "none")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """How sequence rewards become per-token advantages.

    Attributes:
        norm: normalization (see module docstring); "batch" is the paper default.
        reward_scale, reward_bias: reward -> (reward + bias) * scale, as in AReaL.
        reward_clip: then clip to [-reward_clip, reward_clip]; None disables.
        eps: added to the std before dividing ("batch", "group").
        kl_coef: weight of the per-token KL penalty against a reference policy; 0 = off.
        kl_estimator: "k1", "k2" or "k3" (see areal_jax.ppo.kl).
        overlong_tokens: DAPO's overlong penalty: a completion longer than
            max_response_tokens - overlong_tokens loses overlong_penalty_factor * (excess /
            overlong_tokens) of reward (a full factor at max_response_tokens). None = off.
        overlong_penalty_factor: the penalty at the length limit (> 0).
        max_response_tokens: the generation limit the penalty counts from (set it to the
            sampler's max_new_tokens); required with overlong_tokens.
        mask_no_eos_with_zero: reward 0 for sequences that ended without EOS (truncated).
    """

    norm: AdvantageNorm = "batch"
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float | None = None
    eps: float = 1e-5
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    overlong_tokens: int | None = None
    overlong_penalty_factor: float = 1.0
    max_response_tokens: int | None = None
    mask_no_eos_with_zero: bool = False

    def __post_init__(self) -> None:
        if self.norm not in ADVANTAGE_NORMS:
            raise ValueError(f"norm must be one of {ADVANTAGE_NORMS}, got {self.norm!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        for name in ("reward_scale", "reward_bias", "eps", "kl_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        if self.reward_scale <= 0:
            raise ValueError(f"reward_scale must be > 0, got {self.reward_scale}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.reward_clip is not None and not self.reward_clip > 0:
            raise ValueError(f"reward_clip must be > 0 or None, got {self.reward_clip}")
        for name in ("overlong_tokens", "max_response_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.overlong_tokens is not None:
            if self.max_response_tokens is None:
                raise ValueError("overlong_tokens needs max_response_tokens (the sampler's max_new_tokens)")
            if self.overlong_tokens > self.max_response_tokens:
                raise ValueError(f"overlong_tokens ({self.overlong_tokens}) must be <= max_response_tokens "
                                 f"({self.max_response_tokens})")
        factor = self.overlong_penalty_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor)
                                                                                     and factor > 0):
            raise ValueError(f"overlong_penalty_factor must be a finite number > 0, got {factor!r}")
        if not isinstance(self.mask_no_eos_with_zero, bool):
            raise ValueError(f"mask_no_eos_with_zero must be a bool, got {self.mask_no_eos_with_zero!r}")


def compute_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    loss_mask: np.ndarray,
    cfg: AdvantageConfig,
    *,
    logprobs: np.ndarray | None = None,
    ref_logprobs: np.ndarray | None = None,
    no_eos: np.ndarray | None = None,
    reduce_sum: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Per-token advantages [N, T] (float32, zero off the loss mask).

    Args:
        rewards: [N] sequence rewards (e.g. +5 / -5).
        group_ids: [N] integer id of each sequence's prompt group (any values; equal id =
            same prompt). Only used by the group norms.
        loss_mask: [N, T] True on generated (trained) tokens.
        cfg: AdvantageConfig.
        logprobs: [N, T] log-probs of the tokens under the policy that produced them;
            required when cfg.kl_coef > 0.
        ref_logprobs: [N, T] the same tokens under the frozen reference policy; required
            when cfg.kl_coef > 0.
        no_eos: [N] bool, True for sequences that ended without EOS (truncated at the
            length limit); required when cfg.mask_no_eos_with_zero.
        reduce_sum: with several data-parallel processes, a float64 vector -> its elementwise
            sum over the processes (`parallel.agree_sum_array`); the batch statistics then cover
            every process's sequences. Called (twice, with "batch" or "group_then_batch") at the
            same point on every process. None: these sequences are the whole batch.
    """
    if not isinstance(cfg, AdvantageConfig):
        raise TypeError(f"cfg must be an AdvantageConfig, got {type(cfg).__name__}")
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    mask = np.asarray(loss_mask).astype(bool)
    if mask.ndim != 2:
        raise ValueError(f"loss_mask must be [N, T], got shape {mask.shape}")
    n = mask.shape[0]
    if rewards.shape != (n,):
        raise ValueError(f"rewards must have shape ({n},) like loss_mask, got {rewards.shape}")
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must have shape ({n},), got {group_ids.shape}")
    if not np.issubdtype(group_ids.dtype, np.integer):
        raise TypeError(f"group_ids must be integers, got dtype {group_ids.dtype}")
    if not np.all(np.isfinite(rewards)):
        bad = np.flatnonzero(~np.isfinite(rewards)).tolist()
        raise ValueError(f"rewards must be finite; bad at indices {bad}")

    if cfg.overlong_tokens is not None:
        # Completion length = the sequence's trained tokens.
        excess = mask.sum(axis=1) - (cfg.max_response_tokens - cfg.overlong_tokens)  # [N]
        rewards = rewards + np.minimum(-excess / cfg.overlong_tokens * cfg.overlong_penalty_factor, 0.0)
    shaped = (rewards + cfg.reward_bias) * cfg.reward_scale  # [N]
    if cfg.reward_clip is not None:
        shaped = np.clip(shaped, -cfg.reward_clip, cfg.reward_clip)
    if cfg.norm == "group_then_batch":
        shaped = _group_standardize_rewards(shaped, group_ids, cfg.eps)
    if cfg.mask_no_eos_with_zero:
        if no_eos is None:
            raise ValueError("mask_no_eos_with_zero needs no_eos, one bool per sequence")
        no_eos = np.asarray(no_eos)
        if no_eos.shape != (n,) or no_eos.dtype != bool:
            raise ValueError(f"no_eos must be a bool array of shape ({n},), got {no_eos.dtype} {no_eos.shape}")
        shaped = np.where(no_eos, 0.0, shaped)
    returns = np.broadcast_to(shaped[:, None], mask.shape).copy()  # [N, T]
    if cfg.kl_coef > 0:
        returns += _kl_penalty_to_go(mask, cfg, logprobs, ref_logprobs)
    returns *= mask

    if cfg.norm == "none":
        adv = returns
    elif cfg.norm == "batch":
        adv = _standardize(returns, mask, cfg.eps, reduce_sum=reduce_sum)
    elif cfg.norm == "group_then_batch":
        adv = _standardize(returns, mask, cfg.eps, unbiased=True, reduce_sum=reduce_sum)
    elif cfg.norm == "rloo":
        adv = returns - _leave_one_out_baseline(shaped, group_ids)[:, None]
    else:
        adv = np.zeros_like(returns)
        for gid in np.unique(group_ids):
            rows = group_ids == gid
            if cfg.norm == "group":
                adv[rows] = _standardize(returns[rows], mask[rows], cfg.eps)
            else:  # group_mean
                adv[rows] = returns[rows] - _masked_mean(returns[rows], mask[rows])
    return (adv * mask).astype(np.float32)


def _kl_penalty_to_go(mask, cfg, logprobs, ref_logprobs) -> np.ndarray:
    """-kl_coef * sum_{s >= t} kl_s over valid tokens: [N, T]."""
    if logprobs is None or ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs both logprobs and ref_logprobs")
    logprobs = np.asarray(logprobs, dtype=np.float64)
    ref_logprobs = np.asarray(ref_logprobs, dtype=np.float64)
    for name, arr in (("logprobs", logprobs), ("ref_logprobs", ref_logprobs)):
        if arr.shape != mask.shape:
            raise ValueError(
                f"{name} must have shape {mask.shape} like loss_mask, got {arr.shape}"
            )
    # Padding may hold -inf; zero it before the estimator so nothing leaks.
    kl = kl_estimate(
        np.where(mask, logprobs, 0.0), np.where(mask, ref_logprobs, 0.0), cfg.kl_estimator
    )
    penalty = -cfg.kl_coef * np.where(mask, kl, 0.0)
    return np.cumsum(penalty[:, ::-1], axis=1)[:, ::-1]


def _masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    count = mask.sum()
    return float((x * mask).sum() / count) if count else 0.0


def _standardize(x: np.ndarray, mask: np.ndarray, eps: float, unbiased: bool = False,
                 reduce_sum: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """(x - mean) / (std + eps) with token-weighted mean and std over mask (biased, or n - 1 with
    `unbiased`, where one token has std 1 as in AReaL's Normalization); with `reduce_sum` the
    count, sum and squared deviations are summed over the processes."""
    count, x_sum = _summed([mask.sum(), (x * mask).sum()], reduce_sum)
    if count == 0:  # the global count: every process takes the same branch
        return np.zeros_like(x)
    mean = x_sum / count
    [sq] = _summed([(((x - mean) * mask) ** 2).sum()], reduce_sum)
    if unbiased:
        std = np.sqrt(sq / (count - 1)) if count > 1 else 1.0
    else:
        std = np.sqrt(sq / count)
    return (x - mean) / (std + eps)


def _summed(values, reduce_sum) -> np.ndarray:
    """float64 partial sums, summed over the processes when `reduce_sum` is given."""
    v = np.asarray(values, np.float64)
    return v if reduce_sum is None else np.asarray(reduce_sum(v), np.float64)


def _group_standardize_rewards(rewards: np.ndarray, group_ids: np.ndarray, eps: float) -> np.ndarray:
    """[N] rewards normalized within each group over its sequences (unweighted, std n - 1)."""
    out = np.zeros_like(rewards)
    for gid in np.unique(group_ids):
        rows = group_ids == gid
        out[rows] = _standardize(rewards[rows], np.ones(int(rows.sum()), bool), eps, unbiased=True)
    return out


def _leave_one_out_baseline(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """[N] mean reward of the other members of each sequence's group."""
    uniq, inverse, counts = np.unique(group_ids, return_inverse=True, return_counts=True)
    if np.any(counts < 2):
        lonely = uniq[counts < 2].tolist()
        raise ValueError(f"norm='rloo' needs >= 2 sequences per group; groups {lonely} have 1")
    sums = np.bincount(inverse, weights=rewards)
    return (sums[inverse] - rewards) / (counts[inverse] - 1)
