"""Decoupled PPO objective (AReaL, arXiv 2505.24298, Sec. 5) and token log-prob helpers.

Shapes: B = rows (sequences or packed rows), T = tokens per row, V = vocabulary. The loss
functions accept any shape as long as all per-token inputs agree; [B, T] is typical.

Three policies meet in the decoupled objective:
    pi_theta  the policy being optimized           (logprobs, carries gradient)
    pi_prox   the proximal anchor for clipping     (proximal_logprobs: recomputed once per
              training step with the pre-update weights)
    pi_behav  the policy that sampled each token   (behavior_logprobs: from the generator;
              may mix several versions in one sequence after interrupted generation)
Per token, with r = pi_theta / pi_prox and w = stop_grad(pi_prox / pi_behav):
    loss_t = w * max(-A * r, -A * clip(r, 1 - eps, 1 + eps_high))

The three objectives of the staleness ablation are calls of this one function:
    decoupled        pi_prox recomputed, w applied (the paper's objective; AReaL v1.0.0)
    naive            proximal = behavior, so r = pi_theta / pi_behav and w = 1: the clip is a
                     trust region around the policy that sampled each token
    naive_recompute  pi_prox recomputed, no w (`behav_imp_weight_mode="disabled"`): the clip is
                     anchored at the pre-step policy and nothing corrects for pi_behav (AReaL
                     v0.3.0's recomputed-log-prob PPO without decoupling; AReaL HEAD's decoupled
                     loss when no rejection sampling is configured)

What happens to w is `behav_imp_weight_mode` with `behav_imp_weight_cap`:
    cap None, "mask"/"clamp"  w applied as is, unbounded (the paper's formula, AReaL v1.0.0)
    cap c, "mask"             tokens with w > c leave the mask the ratio and the sum use, still
                              counted in the denominator (AReaL HEAD's token-level rejection
                              sampling on the ratio, action "mask", upper bound c)
    cap c, "clamp"            w becomes min(w, c) (the same with action "clamp")
    "disabled" (cap None)     no w at all (AReaL HEAD without rejection sampling)
Further options, defaults off: the dual clip `c_clip` and GSPO's sequence-level ratio
(`importance_sampling_level`). The order of operations: the behaviour-weight filter first, then
the ratio, the clip, the dual clip, the weight, and the sum over the original valid-token count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.ppo.kl import kl_estimate

# Stats whose cross-micro-batch combination is a max; every other stat is a sum.
_MAX_STATS = ("imp_weight_max",)
# Off-policy diagnostics. A token is off-policy when pi_theta / pi_behav leaves this band.
BEHAV_RATIO_BAND = (0.8, 1.2)
# Histograms over log w (w = pi_prox / pi_behav before any cap): WEIGHT_HIST_BINS equal bins on
# [-WEIGHT_HIST_LOG_RANGE, WEIGHT_HIST_LOG_RANGE], values beyond in the end bins. Summed over
# micro-batches they rank the step's tokens by w without holding them (`weight_top_share`).
WEIGHT_HIST_BINS = 256
WEIGHT_HIST_LOG_RANGE = 8.0
BEHAV_IMP_WEIGHT_MODES = ("mask", "clamp", "disabled")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log_softmax(logits / temperature) at the target ids, in float32.

    Trainer and generator both call this so behavior and proximal log-probs agree
    bit-for-bit on identical logits.

    Args:
        logits: [..., V] (e.g. [B, T, V]); any float dtype, computed in float32.
        targets: [...] (e.g. [B, T]) integer token ids in [0, V).
        temperature: > 0, the sampling temperature.
    Returns:
        [...] float32 log-probabilities.
    """
    _check_temperature(temperature)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {logits.shape} must be targets {targets.shape} plus a vocabulary axis"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be integer token ids, got dtype {targets.dtype}")
    scaled = logits.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(scaled, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def token_entropy(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Entropy of softmax(logits / temperature) per position, in float32: [..., V] -> [...]."""
    _check_temperature(temperature)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def ppo_token_loss(
    logprobs: jax.Array,
    proximal_logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    behav_imp_weight_cap: float | None = None,
    c_clip: float | None = None,
    behav_imp_weight_mode: str = "mask",
    importance_sampling_level: str = "token",
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The decoupled PPO objective per token: `(per_token_loss [B, T], metrics)` (module docstring).

    Arguments as `decoupled_ppo_loss`. per_token_loss is 0 off the tokens the loss keeps; its sum
    over the valid tokens divided by their count is the token-mean loss. metrics are per-token
    values whose mean over the loss mask is the logged number: clip_frac, dual_clip_frac,
    capped_frac (indicators), imp_weight_mean (w before the cap), ratio_mean, approx_kl (k3 of
    KL(pi_prox || pi_theta)), loss_token_mean, behav_ratio_out_frac (pi_theta / pi_behav outside
    BEHAV_RATIO_BAND); imp_weight_max, the same w, is read as the max over the mask (its name
    ends in "_max"); weight_hist_tokens and weight_hist_grad `[B, T, WEIGHT_HIST_BINS]` put each
    token (and the size of its gradient with respect to its log-prob, |w' A r| where the gradient
    flows, w' the weight applied) in its bin of log w, for `weight_top_share`.
    """
    _check_clip_args(eps_clip, eps_clip_higher, behav_imp_weight_cap)
    _check_loss_options(c_clip, behav_imp_weight_mode, importance_sampling_level, behav_imp_weight_cap)
    shapes = {
        "logprobs": logprobs.shape,
        "proximal_logprobs": proximal_logprobs.shape,
        "behavior_logprobs": behavior_logprobs.shape,
        "advantages": advantages.shape,
        "loss_mask": loss_mask.shape,
    }
    if segment_ids is not None:
        shapes["segment_ids"] = segment_ids.shape
    for name, shape in shapes.items():
        if shape != logprobs.shape:
            raise ValueError(f"{name} has shape {shape}, expected {logprobs.shape} like logprobs")
    if importance_sampling_level == "sequence" and logprobs.ndim != 2:
        raise ValueError(f"importance_sampling_level='sequence' needs [B, T] inputs, got shape {logprobs.shape}")
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher

    # At least float32 (bf16 log-probs are too coarse for exp of differences); float64
    # inputs stay float64 so the gradient can be checked against finite differences.
    dtype = jnp.promote_types(logprobs.dtype, jnp.float32)
    mask = loss_mask.astype(bool)
    logp = logprobs.astype(dtype)
    prox = jax.lax.stop_gradient(proximal_logprobs.astype(dtype))
    behav = jax.lax.stop_gradient(behavior_logprobs.astype(dtype))
    adv = jax.lax.stop_gradient(advantages.astype(dtype))

    # The behaviour-weight filter comes first. Padding may hold -inf or garbage log-probs:
    # neutralize before exp so that neither values nor gradients see them.
    raw_weight = jnp.exp(jnp.where(mask, prox - behav, 0.0))  # [B, T], constant
    if behav_imp_weight_mode == "disabled":
        kept, imp_weight = mask, jnp.ones_like(raw_weight)
    elif behav_imp_weight_cap is None:
        kept, imp_weight = mask, raw_weight
    elif behav_imp_weight_mode == "mask":
        kept, imp_weight = mask & (raw_weight <= behav_imp_weight_cap), raw_weight
    else:  # clamp
        kept, imp_weight = mask, jnp.minimum(raw_weight, behav_imp_weight_cap)
    capped = mask & (raw_weight > behav_imp_weight_cap) if behav_imp_weight_cap is not None else mask & False

    if importance_sampling_level == "sequence":  # means over the filtered mask
        log_ratio = _sequence_mean(jnp.where(kept, logp - prox, 0.0), kept, segment_ids)  # [B, T]
        adv = _sequence_mean(jnp.where(kept, adv, 0.0), kept, segment_ids)
    else:  # a masked-out token's own ratio never reaches the sum; the stats still see it
        log_ratio = jnp.where(mask, logp - prox, 0.0)  # [B, T]
    ratio = jnp.exp(log_ratio)  # [B, T]

    surrogate = -adv * ratio
    clipped_surrogate = -adv * jnp.clip(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    pg_loss = jnp.maximum(surrogate, clipped_surrogate)  # [B, T]
    clipped = mask & (clipped_surrogate > surrogate)
    if c_clip is None:
        dual_clipped = mask & False
    else:
        bound = c_clip * jnp.abs(adv)  # only binds where A < 0: otherwise pg_loss <= 0 < bound
        dual_clipped = mask & (bound < pg_loss)
        pg_loss = jnp.minimum(pg_loss, bound)
    per_token = jnp.where(kept, imp_weight * pg_loss, 0.0)  # [B, T]

    sg = jax.lax.stop_gradient
    approx_kl = kl_estimate(prox, sg(logp), "k3")  # r - 1 - log r
    behav_ratio = jnp.exp(jnp.where(mask, sg(logp) - behav, 0.0))  # pi_theta / pi_behav, [B, T]
    off_policy = mask & ((behav_ratio < BEHAV_RATIO_BAND[0]) | (behav_ratio > BEHAV_RATIO_BAND[1]))
    flows = kept & ~clipped & ~dual_clipped
    grad_size = jnp.where(flows, jnp.abs(imp_weight * adv * sg(ratio)), 0.0)  # [B, T]
    bins = jax.nn.one_hot(weight_bins(jnp.where(mask, prox - behav, 0.0)), WEIGHT_HIST_BINS, dtype=dtype)
    metrics = {
        "clip_frac": clipped.astype(dtype),
        "dual_clip_frac": dual_clipped.astype(dtype),
        "capped_frac": capped.astype(dtype),
        "imp_weight_mean": raw_weight,
        "imp_weight_max": raw_weight,
        "ratio_mean": sg(ratio),
        "approx_kl": approx_kl,
        "loss_token_mean": sg(per_token),
        "behav_ratio_out_frac": off_policy.astype(dtype),
        "weight_hist_tokens": bins,  # [B, T, WEIGHT_HIST_BINS]
        "weight_hist_grad": bins * grad_size[..., None],
    }
    return per_token, metrics


def decoupled_ppo_loss(
    logprobs: jax.Array,
    proximal_logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    behav_imp_weight_cap: float | None = None,
    denominator: jax.Array | float | None = None,
    c_clip: float | None = None,
    behav_imp_weight_mode: str = "mask",
    importance_sampling_level: str = "token",
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-mean decoupled PPO loss and summable statistics: `ppo_token_loss` reduced over a batch.

    The semantics of AReaL's `ppo_actor_loss_fn` (areal/utils/functional/functional.py): with a
    cap, its token-level rejection sampling on the ratio pi_prox / pi_behav; with
    `behav_imp_weight_mode="disabled"`, its behaviour without rejection sampling (no weight);
    with neither, the uncapped weight of the paper (module docstring).

    Args:
        logprobs: [B, T] log pi_theta of the sampled tokens (differentiated).
        proximal_logprobs: [B, T] log pi_prox (treated as constant).
        behavior_logprobs: [B, T] log pi_behav (treated as constant).
        advantages: [B, T] per-token advantages (treated as constant).
        loss_mask: [B, T] bool/0-1, True on tokens that are trained (generated tokens).
        eps_clip: lower clip range, r >= 1 - eps_clip; in (0, 1).
        eps_clip_higher: upper clip range (DAPO's clip-higher); defaults to eps_clip.
        behav_imp_weight_cap: bound on w = pi_prox / pi_behav; None: w is used as is (or not
            at all with mode "disabled").
        denominator: valid-token count to divide by. Pass the count of the whole
            minibatch when it is split into micro-batches, so that the micro-batch losses
            (and gradients) sum to the minibatch token-mean. Default: loss_mask.sum() (the
            mask before any capping). A zero denominator yields loss 0.
        c_clip: dual clip (> 1): a token's loss is at most c_clip * |A|, which bounds the
            loss of negative-advantage tokens whose ratio grew large. None disables.
        behav_imp_weight_mode: what the cap does to a token with w > cap. "mask": the token
            leaves the mask the ratio and the sum use (it still counts in the denominator);
            "clamp": its weight becomes the cap. "disabled": no behaviour weight at all (w := 1;
            needs cap None); the stats still report the raw w.
        importance_sampling_level: "token" (PPO) or "sequence" (GSPO): every token of a
            sequence takes the ratio exp(mean log(pi_theta / pi_prox)) and the advantage
            mean over the sequence's (filtered) valid tokens.
        segment_ids: [B, T] ints of packed rows (0 = padding, 1..k = the row's sequences);
            with "sequence", a sequence is a (row, segment) pair. None: a sequence is a row.
    Returns:
        loss: scalar in the promoted dtype of logprobs and float32 (float32 for bf16).
        stats: scalars of the same dtype, sums over this call's valid tokens so they add up across
            micro-batches (combine with accumulate_loss_stats, read with
            summarize_loss_stats): n_valid, n_clipped (clipped branch active), n_dual_clipped,
            n_capped (w > cap: masked or clamped), imp_weight_sum / imp_weight_max (w before
            the cap, over valid tokens), ratio_sum, approx_kl_sum (k3 estimate of
            KL(pi_prox || pi_theta) per token), loss_sum, n_behav_ratio_out (pi_theta / pi_behav
            outside BEHAV_RATIO_BAND), and two [WEIGHT_HIST_BINS] histograms over log w:
            weight_hist_tokens (valid tokens) and weight_hist_grad (the size of each token's
            gradient with respect to its log-prob, |w' A r| where the gradient flows and 0 where
            the clip, the dual clip or the cap stops it; w' the weight applied).
    """
    per_token, m = ppo_token_loss(
        logprobs, proximal_logprobs, behavior_logprobs, advantages, loss_mask, eps_clip=eps_clip,
        eps_clip_higher=eps_clip_higher, behav_imp_weight_cap=behav_imp_weight_cap, c_clip=c_clip,
        behav_imp_weight_mode=behav_imp_weight_mode, importance_sampling_level=importance_sampling_level,
        segment_ids=segment_ids)
    dtype = per_token.dtype
    mask = loss_mask.astype(bool)
    valid = mask.astype(dtype)
    loss_sum = jnp.sum(per_token)
    n_valid = jnp.sum(valid)
    denom = n_valid if denominator is None else jnp.asarray(denominator, dtype)
    loss = jnp.where(denom > 0, loss_sum / jnp.where(denom > 0, denom, 1.0), 0.0)

    def total(name):
        x = m[name]
        return jnp.sum(jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)), x, 0.0),
                       axis=tuple(range(mask.ndim)))

    stats = {
        "n_valid": n_valid,
        "n_clipped": total("clip_frac"),
        "n_dual_clipped": total("dual_clip_frac"),
        "n_capped": total("capped_frac"),
        "imp_weight_sum": total("imp_weight_mean"),
        "imp_weight_max": jnp.max(jnp.where(mask, m["imp_weight_max"], 0.0), initial=0.0),
        "ratio_sum": total("ratio_mean"),
        "approx_kl_sum": total("approx_kl"),
        "loss_sum": jax.lax.stop_gradient(loss_sum),
        "n_behav_ratio_out": total("behav_ratio_out_frac"),
        "weight_hist_tokens": total("weight_hist_tokens"),
        "weight_hist_grad": total("weight_hist_grad"),
    }
    return loss, stats


def weight_bins(log_weight):
    """The WEIGHT_HIST_BINS bin of each log w (NumPy or JAX arrays alike): [...] -> [...] int32."""
    xp = jnp if isinstance(log_weight, jax.Array) else np
    scaled = (xp.asarray(log_weight) + WEIGHT_HIST_LOG_RANGE) / (2 * WEIGHT_HIST_LOG_RANGE) * WEIGHT_HIST_BINS
    return xp.clip(xp.floor(scaled), 0, WEIGHT_HIST_BINS - 1).astype(xp.int32)


def weight_top_share(hist_tokens, hist_grad, top: float = 0.01) -> float:
    """The share of the summed gradient size carried by the `top` fraction of tokens with the
    largest w, from the histograms of `decoupled_ppo_loss`. Tokens are taken from the highest bin
    down; of the bin where the count runs out, the share of its gradient in proportion to the
    tokens taken (exact up to the bin width, a factor exp(1/16) in w). 0 when no gradient flows,
    NaN when the gradient was not finite."""
    tokens = np.asarray(hist_tokens, np.float64)[::-1]
    grad = np.asarray(hist_grad, np.float64)[::-1]
    if not np.isfinite(grad.sum()):
        return float("nan")
    if grad.sum() <= 0 or tokens.sum() <= 0:
        return 0.0
    want = top * tokens.sum()
    before = np.concatenate([[0.0], np.cumsum(tokens)[:-1]])  # tokens in higher bins
    taken = np.clip(want - before, 0.0, tokens)
    part = np.divide(taken, tokens, out=np.zeros_like(tokens), where=tokens > 0)
    return float((grad * part).sum() / grad.sum())


def _sequence_mean(x: jax.Array, mask: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """[B, T] -> [B, T]: each token gets the mean of x over its sequence's masked tokens.

    x must already be zero off the mask. A sequence is a row (segment_ids None) or a
    (row, segment) pair of a packed row; a sequence with no masked token gets 0.
    """
    count = mask.astype(x.dtype)
    if segment_ids is None:
        total = jnp.sum(x, axis=-1, keepdims=True)  # [B, 1]
        n = jnp.sum(count, axis=-1, keepdims=True)
        return jnp.broadcast_to(total / jnp.maximum(n, 1.0), x.shape)
    b, t = x.shape
    # One id per (row, segment): a row holds at most T segments (ids 0..T).
    ids = (jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1) + segment_ids.astype(jnp.int32)).reshape(-1)
    total = jax.ops.segment_sum(x.reshape(-1), ids, num_segments=b * (t + 1))
    n = jax.ops.segment_sum(count.reshape(-1), ids, num_segments=b * (t + 1))
    return (total / jnp.maximum(n, 1.0))[ids].reshape(b, t)


def loglinear_alpha(versions, current_version: int):
    """A-3PO's interpolation weight per token (NumPy or JAX arrays alike): [...] -> [...] float32.

    AReaL HEAD's log-linear proximal approximation (areal/trainer/ppo/actor.py,
    `compute_prox_logp_approximations`): the proximal policy is taken to be version
    v_prox = current_version - 1 and the policy being trained version current_version, so a token
    sampled at version v gets alpha = (v_prox - v) / (current_version - v), clipped to [0, 1];
    tokens with v < 0 (prompt, padding) or v >= current_version get 0 (pi_prox := pi_behav).
    `current_version` is the trainer's version when the step starts (AReaL's get_version(): the
    version of the weights the freshest tokens were sampled with).
    """
    xp = jnp if isinstance(versions, jax.Array) else np
    v = xp.asarray(versions).astype(xp.float32)
    gap = float(current_version) - v  # > 0 for tokens older than the trained policy
    usable = (gap > 0) & (v >= 0)
    alpha = xp.where(usable, (gap - 1.0) / xp.where(usable, gap, 1.0), 0.0)
    return xp.clip(alpha, 0.0, 1.0).astype(xp.float32)


def loglinear_proximal_logprobs(behavior_logprobs: jax.Array, logprobs: jax.Array, alpha: jax.Array) -> jax.Array:
    """log pi_prox ~= log pi_behav + alpha * (log pi_theta - log pi_behav), all [B, T] (A-3PO).

    Interpolates in log space between the behaviour policy and the current one (whose log-probs
    enter as a constant, as in AReaL: the approximation carries no gradient), so the decoupled loss
    needs no proximal forward pass. alpha from `loglinear_alpha`.
    """
    behav = behavior_logprobs.astype(jnp.promote_types(logprobs.dtype, jnp.float32))
    return behav + alpha * (jax.lax.stop_gradient(logprobs).astype(behav.dtype) - behav)


def accumulate_loss_stats(
    total: dict[str, jax.Array] | None, new: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """Combine decoupled_ppo_loss stats of two micro-batches (sums add, maxima max)."""
    if total is None:
        return dict(new)
    if total.keys() != new.keys():
        raise ValueError(f"stats keys differ: {sorted(total)} vs {sorted(new)}")
    return {
        k: jnp.maximum(total[k], new[k]) if k in _MAX_STATS else total[k] + new[k]
        for k in total
    }


def summarize_loss_stats(stats: dict[str, jax.Array]) -> dict[str, float]:
    """Turn accumulated sums into logged means (fractions over valid tokens)."""
    n = float(stats["n_valid"])
    per_token = max(n, 1.0)  # an all-padding batch logs zeros
    return {
        "n_valid_tokens": n,
        "clip_frac": float(stats["n_clipped"]) / per_token,
        "dual_clip_frac": float(stats["n_dual_clipped"]) / per_token,
        "capped_frac": float(stats["n_capped"]) / per_token,
        "imp_weight_mean": float(stats["imp_weight_sum"]) / per_token,
        "imp_weight_max": float(stats["imp_weight_max"]),
        "ratio_mean": float(stats["ratio_sum"]) / per_token,
        "approx_kl": float(stats["approx_kl_sum"]) / per_token,
        "loss_token_mean": float(stats["loss_sum"]) / per_token,
        "behav_ratio_out_frac": float(stats["n_behav_ratio_out"]) / per_token,
        "weight_top1pct_grad_share": weight_top_share(stats["weight_hist_tokens"], stats["weight_hist_grad"]),
    }


def _check_temperature(temperature: float) -> None:
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_clip_args(eps_clip, eps_clip_higher, cap) -> None:
    # Only Python numbers are checked: these are static hyperparameters, but a traced
    # value must not crash the check.
    if isinstance(eps_clip, (int, float)) and not 0.0 < eps_clip < 1.0:
        raise ValueError(f"eps_clip must be in (0, 1), got {eps_clip}")
    if isinstance(eps_clip_higher, (int, float)) and not eps_clip_higher > 0.0:
        raise ValueError(f"eps_clip_higher must be > 0, got {eps_clip_higher}")
    if isinstance(cap, (int, float)) and not cap > 0.0:
        raise ValueError(f"behav_imp_weight_cap must be > 0, got {cap}")


def _check_loss_options(c_clip, mode, level, cap) -> None:
    if isinstance(c_clip, (int, float)) and not c_clip > 1.0:
        raise ValueError(f"c_clip must be > 1 or None, got {c_clip}")
    if mode not in BEHAV_IMP_WEIGHT_MODES:
        raise ValueError(f"behav_imp_weight_mode must be one of {BEHAV_IMP_WEIGHT_MODES}, got {mode!r}")
    if mode == "disabled" and cap is not None:
        raise ValueError(f"behav_imp_weight_mode='disabled' applies no behaviour weight, so "
                         f"behav_imp_weight_cap must be None, got {cap}")
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")
