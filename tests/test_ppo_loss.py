"""decoupled_ppo_loss against a NumPy reference, its gradient against finite
differences, micro-batch denominator splitting, naive-PPO equivalence, and the
token log-prob / entropy helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.ppo.loss import WEIGHT_HIST_BINS, WEIGHT_HIST_LOG_RANGE, weight_bins, weight_top_share
from areal_jax.ppo import (
    accumulate_loss_stats,
    decoupled_ppo_loss,
    loglinear_alpha,
    loglinear_proximal_logprobs,
    summarize_loss_stats,
    token_entropy,
    token_logprobs,
)


def reference_loss(logp, prox, behav, adv, mask, eps, eps_high=None, cap=None, denom=None, *, c_clip=None,
                   mode="mask", level="token", segment_ids=None):
    """Straight-line NumPy float64 version of the decoupled objective with AReaL's options.

    Order as in AReaL's ppo_actor_loss_fn: the cap first (mask mode narrows the mask the ratio
    and the sum use; clamp mode bounds w), then the (sequence) ratio, clip, dual clip, weight.
    """
    eps_high = eps if eps_high is None else eps_high
    w_raw = {idx: np.exp(prox[idx] - behav[idx]) for idx in np.ndindex(logp.shape) if mask[idx]}
    kept = {idx for idx, w in w_raw.items() if cap is None or mode == "clamp" or w <= cap}
    weight = {idx: (min(w, cap) if cap is not None and mode == "clamp" else w) for idx, w in w_raw.items()}
    ratio, a_of = {}, {}
    if level == "token":
        for idx in w_raw:
            ratio[idx], a_of[idx] = np.exp(logp[idx] - prox[idx]), adv[idx]
    else:
        def seq_of(idx):
            return idx[0] if segment_ids is None else (idx[0], segment_ids[idx])
        members = {}
        for idx in w_raw:
            members.setdefault(seq_of(idx), []).append(idx)
        for toks in members.values():
            k = [i for i in toks if i in kept]
            lr = np.mean([logp[i] - prox[i] for i in k]) if k else 0.0
            a = np.mean([adv[i] for i in k]) if k else 0.0
            for i in toks:
                ratio[i], a_of[i] = np.exp(lr), a
    total, n_clip, n_dual, n_cap, r_sum, kl_sum, n_out = 0.0, 0, 0, 0, 0.0, 0.0, 0
    hist_tokens, hist_grad = np.zeros(256), np.zeros(256)
    for idx in w_raw:
        r, a = ratio[idx], a_of[idx]
        unclipped = -a * r
        clipped = -a * min(max(r, 1 - eps), 1 + eps_high)
        n_clip += clipped > unclipped
        flows = idx in kept and not clipped > unclipped
        pg = max(unclipped, clipped)
        if c_clip is not None:
            n_dual += c_clip * abs(a) < pg
            flows = flows and not c_clip * abs(a) < pg
            pg = min(pg, c_clip * abs(a))
        behav_ratio = np.exp(logp[idx] - behav[idx])
        n_out += not 0.8 <= behav_ratio <= 1.2
        b = min(max(int(np.floor((np.log(w_raw[idx]) + 8.0) / 16.0 * 256)), 0), 255)
        hist_tokens[b] += 1
        hist_grad[b] += abs(weight[idx] * a * r) if flows else 0.0
        r_sum += r
        r_tok = np.exp(logp[idx] - prox[idx])
        kl_sum += r_tok - 1 - np.log(r_tok)
        n_cap += cap is not None and w_raw[idx] > cap
        if idx in kept:
            total += weight[idx] * pg
    n_valid = len(w_raw)
    d = n_valid if denom is None else denom
    loss = total / d if d > 0 else 0.0
    stats = dict(
        n_valid=n_valid, n_clipped=n_clip, n_dual_clipped=n_dual, n_capped=n_cap,
        imp_weight_sum=sum(w_raw.values()), imp_weight_max=max(w_raw.values(), default=0.0), ratio_sum=r_sum,
        approx_kl_sum=kl_sum, loss_sum=total, n_behav_ratio_out=n_out, weight_hist_tokens=hist_tokens,
        weight_hist_grad=hist_grad,
    )
    return loss, stats


def random_batch(seed, shape=(4, 9), spread=0.4, mask_p=0.7):
    rng = np.random.default_rng(seed)
    behav = -rng.uniform(0.05, 3.0, shape)
    prox = behav + rng.normal(0, spread, shape)
    logp = prox + rng.normal(0, spread, shape)
    adv = rng.normal(0, 1.5, shape)
    mask = rng.random(shape) < mask_p
    return logp, prox, behav, adv, mask


# Jitted once per hyperparameter set: eager dispatch of every op is slow on shared CPUs.
jit_loss = jax.jit(
    decoupled_ppo_loss, static_argnames=("eps_clip", "eps_clip_higher", "behav_imp_weight_cap", "c_clip",
                                         "behav_imp_weight_mode", "importance_sampling_level"))


def run(logp, prox, behav, adv, mask, **kw):
    if kw.get("segment_ids") is not None:
        kw["segment_ids"] = jnp.asarray(kw["segment_ids"])
    loss, stats = jit_loss(
        jnp.asarray(logp), jnp.asarray(prox), jnp.asarray(behav), jnp.asarray(adv),
        jnp.asarray(mask), **kw,
    )
    return float(loss), {k: (float(v) if np.ndim(v) == 0 else np.asarray(v)) for k, v in stats.items()}


def assert_stats_close(got, want, rtol=2e-5):
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=1e-5, err_msg=k)


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "kw",
    [
        dict(eps_clip=0.2),
        dict(eps_clip=0.2, eps_clip_higher=0.28),
        dict(eps_clip=0.1, behav_imp_weight_cap=1.3),
        dict(eps_clip=0.3, eps_clip_higher=0.5, behav_imp_weight_cap=1.1),
    ],
)
def test_matches_numpy_reference(seed, kw):
    batch = random_batch(seed)
    loss, stats = run(*batch, **kw)
    ref_loss, ref_stats = reference_loss(
        *batch, kw["eps_clip"], kw.get("eps_clip_higher"), kw.get("behav_imp_weight_cap")
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5, atol=1e-6)
    assert_stats_close(stats, ref_stats)
    assert stats["n_clipped"] > 0  # the random spread exercises the clipped branch
    if "behav_imp_weight_cap" in kw:
        assert stats["n_capped"] > 0


def test_cap_masks_but_keeps_denominator_hand_case():
    # Two valid tokens, A = 1, r = 1. Token 0: w = 1; token 1: w = e^1 > cap = 2.
    logp = np.array([[-1.0, -2.0, 0.0]])
    prox = logp.copy()
    behav = np.array([[-1.0, -3.0, 0.0]])
    adv = np.ones((1, 3))
    mask = np.array([[True, True, False]])
    loss, stats = run(logp, prox, behav, adv, mask, behav_imp_weight_cap=2.0)
    assert loss == pytest.approx(-1.0 / 2)  # only token 0 in numerator, 2 in denominator
    assert stats["n_capped"] == 1 and stats["n_valid"] == 2
    assert stats["imp_weight_max"] == pytest.approx(np.e, rel=1e-6)
    loss_uncapped, _ = run(logp, prox, behav, adv, mask)
    assert loss_uncapped == pytest.approx(-(1 + np.e) / 2, rel=1e-6)


def test_clip_higher_hand_case():
    # r = 1.25 with A > 0: clipped at 1 + eps_high; r = 0.7 with A < 0: clipped at 1 - eps.
    logp = np.log(np.array([[1.25, 0.7]]))
    zeros = np.zeros((1, 2))
    adv = np.array([[2.0, -1.0]])
    mask = np.ones((1, 2), bool)
    loss, stats = run(logp, zeros, zeros, adv, mask, eps_clip=0.2, eps_clip_higher=0.3)
    # token 0: max(-2*1.25, -2*1.25) = -2.5 (1.25 < 1.3, unclipped); token 1: max(0.7, 0.8)
    assert loss == pytest.approx((-2.5 + 0.8) / 2, rel=1e-6)
    assert stats["n_clipped"] == 1
    loss, stats = run(logp, zeros, zeros, adv, mask, eps_clip=0.2)
    assert loss == pytest.approx((-2.4 + 0.8) / 2, rel=1e-6)
    assert stats["n_clipped"] == 2


def test_all_masked_row_and_all_masked_batch():
    logp, prox, behav, adv, mask = random_batch(3)
    mask[1] = False
    loss, stats = run(logp, prox, behav, adv, mask, behav_imp_weight_cap=1.5)
    ref_loss, ref_stats = reference_loss(logp, prox, behav, adv, mask, 0.2, cap=1.5)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    assert_stats_close(stats, ref_stats)

    # Garbage (-inf) log-probs on padding must not leak into loss or gradients.
    logp[~mask] = -np.inf
    prox[~mask] = -np.inf
    loss2, _ = run(logp, prox, behav, adv, mask, behav_imp_weight_cap=1.5)
    assert loss2 == pytest.approx(loss, rel=1e-6)

    none = np.zeros_like(mask)
    loss, stats = run(logp, prox, behav, adv, none)
    assert loss == 0.0
    assert all(np.all(v == 0.0) for v in stats.values())
    grad = jax.jit(jax.grad(lambda lp: decoupled_ppo_loss(lp, prox, behav, adv, none)[0]))(
        jnp.asarray(logp, jnp.float32)
    )
    assert np.all(np.asarray(grad) == 0.0)


def test_naive_ppo_is_proximal_equal_behavior():
    logp, prox, behav, adv, mask = random_batch(11)
    loss, stats = run(logp, behav, behav, adv, mask, eps_clip=0.2)
    # Classic PPO-clip with behavior log-probs as the anchor and no weight.
    r = np.exp(logp - behav)
    per_tok = np.maximum(-adv * r, -adv * np.clip(r, 0.8, 1.2))
    np.testing.assert_allclose(loss, per_tok[mask].mean(), rtol=2e-5)
    assert stats["imp_weight_sum"] == pytest.approx(mask.sum())
    assert stats["imp_weight_max"] == pytest.approx(1.0)


def test_denominator_splits_across_micro_batches():
    logp, prox, behav, adv, mask = random_batch(5, shape=(8, 7))
    kw = dict(eps_clip=0.2, eps_clip_higher=0.3, behav_imp_weight_cap=1.4)
    full_loss, full_stats = run(logp, prox, behav, adv, mask, **kw)
    n_global = float(mask.sum())

    def loss_fn(lp, rows):
        return decoupled_ppo_loss(
            lp[rows], prox[rows], behav[rows], adv[rows], mask[rows], **kw,
            denominator=jnp.asarray(n_global),
        )

    lp = jnp.asarray(logp, jnp.float32)
    total, grads, stats = 0.0, jnp.zeros_like(lp), None
    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=1)
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        (l, st), g = step(lp, rows)
        total, grads, stats = total + float(l), grads + g, accumulate_loss_stats(stats, st)
    np.testing.assert_allclose(total, full_loss, rtol=1e-5)
    full_grad = jax.jit(jax.grad(lambda x: decoupled_ppo_loss(x, prox, behav, adv, mask, **kw)[0]))(lp)
    np.testing.assert_allclose(grads, full_grad, rtol=1e-5, atol=1e-8)
    assert_stats_close({k: np.asarray(v) for k, v in stats.items()}, full_stats)

    summary = summarize_loss_stats(stats)
    assert summary["n_valid_tokens"] == n_global
    assert summary["loss_token_mean"] == pytest.approx(full_loss, rel=1e-5)
    assert 0 < summary["clip_frac"] < 1 and 0 < summary["capped_frac"] < 1
    assert 0 < summary["behav_ratio_out_frac"] < 1
    # Here the largest weights all exceed the cap: masked, they carry no gradient.
    assert summary["weight_top1pct_grad_share"] == 0.0


def test_weight_top_share_against_sorting():
    # 200 tokens in distinct bins: the top 1% are the 2 highest bins exactly.
    rng = np.random.default_rng(0)
    bins = rng.choice(WEIGHT_HIST_BINS, size=200, replace=False)
    log_w = (bins + 0.5) / WEIGHT_HIST_BINS * 2 * WEIGHT_HIST_LOG_RANGE - WEIGHT_HIST_LOG_RANGE
    np.testing.assert_array_equal(weight_bins(log_w), bins)
    grad = rng.exponential(size=200) * np.exp(log_w)
    tokens_hist = np.bincount(bins, minlength=WEIGHT_HIST_BINS)
    grad_hist = np.bincount(bins, weights=grad, minlength=WEIGHT_HIST_BINS)
    top = np.argsort(log_w)[-2:]
    assert weight_top_share(tokens_hist, grad_hist) == pytest.approx(grad[top].sum() / grad.sum(), rel=1e-12)
    # Within a bin the share is proportional: 1% of 200 tokens is half of a 4-token top bin.
    tokens_hist, grad_hist = np.zeros(WEIGHT_HIST_BINS), np.zeros(WEIGHT_HIST_BINS)
    tokens_hist[[10, 200]], grad_hist[[10, 200]] = (196, 4), (6.0, 2.0)
    assert weight_top_share(tokens_hist, grad_hist) == pytest.approx(1.0 / 8.0)
    assert weight_top_share(tokens_hist, np.zeros(WEIGHT_HIST_BINS)) == 0.0
    grad_hist[3] = np.inf  # a non-finite gradient has no share to report
    assert np.isnan(weight_top_share(tokens_hist, grad_hist))
    assert weight_bins(np.array([-100.0, 100.0])).tolist() == [0, WEIGHT_HIST_BINS - 1]


def test_zero_denominator_gives_zero_loss():
    logp, prox, behav, adv, mask = random_batch(2)
    mask[:] = False
    loss, _ = run(logp, prox, behav, adv, mask, denominator=0.0)
    assert loss == 0.0


# --------------------------------------------------------------------------- AReaL's loss options


def random_segments(seed, shape, mask):
    """Packed-row segment ids [B, T]: contiguous runs 1..k per row, then padding (0, masked out)."""
    rng = np.random.default_rng(seed + 100)
    seg = np.zeros(shape, np.int32)
    for r in range(shape[0]):
        used = int(rng.integers(shape[1] // 2, shape[1] + 1))
        cuts = np.sort(rng.choice(np.arange(1, used), size=min(2, used - 1), replace=False))
        seg[r, :used] = 1 + np.searchsorted(cuts, np.arange(used), side="right")
    mask = mask & (seg > 0)
    return seg, mask


OPTION_SETS = [
    dict(eps_clip=0.2, c_clip=1.5),
    dict(eps_clip=0.2, behav_imp_weight_cap=1.3, behav_imp_weight_mode="clamp"),
    dict(eps_clip=0.2, eps_clip_higher=0.3, behav_imp_weight_cap=1.3, behav_imp_weight_mode="clamp", c_clip=1.3),
    dict(eps_clip=0.2, importance_sampling_level="sequence"),
    dict(eps_clip=0.1, importance_sampling_level="sequence", behav_imp_weight_cap=1.3, c_clip=1.2),
    dict(eps_clip=0.1, importance_sampling_level="sequence", behav_imp_weight_cap=1.3,
         behav_imp_weight_mode="clamp", packed=True),
    dict(eps_clip=0.2, importance_sampling_level="sequence", behav_imp_weight_cap=1.3, packed=True),
]


def option_case(seed, opts, shape=(4, 9), spread=0.4):
    opts = dict(opts)
    logp, prox, behav, adv, mask = random_batch(seed, shape=shape, spread=spread)
    seg = None
    if opts.pop("packed", False):
        seg, mask = random_segments(seed, shape, mask)
    ref_kw = dict(c_clip=opts.get("c_clip"), mode=opts.get("behav_imp_weight_mode", "mask"),
                  level=opts.get("importance_sampling_level", "token"), segment_ids=seg)
    return (logp, prox, behav, adv, mask), seg, opts, ref_kw


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("opts", OPTION_SETS)
def test_loss_options_match_numpy_reference(seed, opts):
    batch, seg, kw, ref_kw = option_case(seed, opts)
    loss, stats = run(*batch, segment_ids=seg, **kw)
    ref_loss, ref_stats = reference_loss(*batch, kw["eps_clip"], kw.get("eps_clip_higher"),
                                         kw.get("behav_imp_weight_cap"), **ref_kw)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5, atol=1e-6)
    assert_stats_close(stats, ref_stats)
    if "c_clip" in kw and kw.get("importance_sampling_level", "token") == "token":
        assert stats["n_dual_clipped"] > 0  # the dual clip binds on some tokens
    if "behav_imp_weight_cap" in kw:
        assert stats["n_capped"] > 0


@pytest.mark.parametrize("opts", OPTION_SETS)
def test_loss_options_gradient_matches_numpy_reference(opts):
    # Central differences of the NumPy reference itself, against jax.grad in float64.
    with jax.enable_x64(True):
        batch, seg, kw, ref_kw = option_case(21, opts, shape=(3, 7), spread=0.3)
        logp, prox, behav, adv, mask = batch

        @jax.jit
        def loss_fn(lp):
            return decoupled_ppo_loss(lp, prox, behav, adv, mask, segment_ids=None if seg is None
                                      else jnp.asarray(seg), **kw)[0]

        grad = np.asarray(jax.grad(loss_fn)(jnp.asarray(logp, jnp.float64)))
        h = 1e-6
        fd = np.zeros_like(logp)
        for idx in np.ndindex(logp.shape):
            e = np.zeros_like(logp)
            e[idx] = h
            hi = reference_loss(logp + e, prox, behav, adv, mask, kw["eps_clip"], kw.get("eps_clip_higher"),
                                kw.get("behav_imp_weight_cap"), **ref_kw)[0]
            lo = reference_loss(logp - e, prox, behav, adv, mask, kw["eps_clip"], kw.get("eps_clip_higher"),
                                kw.get("behav_imp_weight_cap"), **ref_kw)[0]
            fd[idx] = (hi - lo) / (2 * h)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
        assert np.any(grad != 0)


def test_dual_clip_hand_case():
    # A = -1, r = 4: PPO's loss max(4, 0.8 -> clip(4) = 1.2) = 4, dual clip bounds it at c = 3.
    # A = +1, r = 4: loss max(-4, -1.2) = -1.2 < 0, the dual clip never binds a positive advantage.
    logp = np.log(np.array([[4.0, 4.0]]))
    zeros = np.zeros((1, 2))
    adv = np.array([[-1.0, 1.0]])
    mask = np.ones((1, 2), bool)
    loss, stats = run(logp, zeros, zeros, adv, mask, c_clip=3.0)
    assert loss == pytest.approx((3.0 - 1.2) / 2, rel=1e-6)
    assert stats["n_dual_clipped"] == 1
    grad = jax.grad(lambda x: decoupled_ppo_loss(x, zeros, zeros, adv, mask, c_clip=3.0)[0])(jnp.asarray(logp))
    np.testing.assert_array_equal(np.asarray(grad), 0.0)  # both tokens sit on a constant branch


def test_clamp_mode_bounds_the_weight_hand_case():
    # r = 1, A = 1, w = (1, e): mask mode drops token 1, clamp mode weighs it by the cap 2.
    logp = np.array([[-1.0, -2.0]])
    behav = np.array([[-1.0, -3.0]])
    adv = np.ones((1, 2))
    mask = np.ones((1, 2), bool)
    masked, _ = run(logp, logp, behav, adv, mask, behav_imp_weight_cap=2.0)
    clamped, stats = run(logp, logp, behav, adv, mask, behav_imp_weight_cap=2.0, behav_imp_weight_mode="clamp")
    assert masked == pytest.approx(-1.0 / 2)
    assert clamped == pytest.approx(-(1.0 + 2.0) / 2)
    assert stats["n_capped"] == 1 and stats["imp_weight_max"] == pytest.approx(np.e, rel=1e-6)


def test_sequence_level_hand_case_and_mask_narrowing():
    # One row, three tokens, log-ratios (0.1, 0.3, 2.0), A = (1, 3, 5). Sequence level: every token
    # takes r = exp(mean log-ratio) and the mean advantage. Capping token 2 (w = e > 2) in mask
    # mode removes it from both means; clamp mode keeps it in them and weighs it by 2.
    logp = np.array([[0.1, 0.3, 2.0]])
    prox = np.zeros((1, 3))
    behav = np.array([[0.0, 0.0, -1.0]])
    adv = np.array([[1.0, 3.0, 5.0]])
    mask = np.ones((1, 3), bool)
    kw = dict(eps_clip=0.5, eps_clip_higher=10.0, importance_sampling_level="sequence")
    loss, _ = run(logp, prox, behav, adv, mask, **kw)
    r, a = np.exp(0.8), 3.0
    assert loss == pytest.approx(-(a * r) * (1 + 1 + np.e) / 3, rel=1e-6)
    loss, _ = run(logp, prox, behav, adv, mask, behav_imp_weight_cap=2.0, **kw)
    r, a = np.exp(0.2), 2.0
    assert loss == pytest.approx(-(a * r) * 2 / 3, rel=1e-6)  # 2 kept tokens over 3 valid
    loss, _ = run(logp, prox, behav, adv, mask, behav_imp_weight_cap=2.0, behav_imp_weight_mode="clamp", **kw)
    r, a = np.exp(0.8), 3.0
    assert loss == pytest.approx(-(a * r) * (1 + 1 + 2) / 3, rel=1e-6)


def test_sequence_level_packed_segments_equal_one_sequence_per_row():
    # Two sequences packed in one row give the loss and gradients of the same two as rows.
    batch = random_batch(13, shape=(2, 5))
    logp, prox, behav, adv, mask = batch
    packed = [np.concatenate([x[0], x[1]])[None] for x in batch]
    seg = np.array([[1] * 5 + [2] * 5])
    kw = dict(eps_clip=0.2, importance_sampling_level="sequence", behav_imp_weight_cap=1.3)

    def grads(args, segment_ids):
        f = lambda lp: decoupled_ppo_loss(lp, *args[1:], segment_ids=segment_ids, **kw)[0]  # noqa: E731
        return jax.value_and_grad(f)(jnp.asarray(args[0], jnp.float32))

    rows_loss, rows_grad = grads(batch, None)
    packed_loss, packed_grad = grads(packed, jnp.asarray(seg))
    np.testing.assert_allclose(packed_loss, rows_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(packed_grad).reshape(2, 5), rows_grad, rtol=1e-5, atol=1e-8)
    # Without segment ids the packed row would be one sequence: a different loss.
    one_seq, _ = grads(packed, None)
    assert abs(float(one_seq) - float(rows_loss)) > 1e-4


def test_loss_option_errors():
    batch = [jnp.asarray(x) for x in random_batch(0)]
    with pytest.raises(ValueError, match="c_clip"):
        decoupled_ppo_loss(*batch, c_clip=1.0)
    with pytest.raises(ValueError, match="behav_imp_weight_mode"):
        decoupled_ppo_loss(*batch, behav_imp_weight_mode="truncate")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        decoupled_ppo_loss(*batch, importance_sampling_level="group")
    with pytest.raises(ValueError, match="needs \\[B, T\\]"):
        decoupled_ppo_loss(*(x.reshape(-1) for x in batch), importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="segment_ids"):
        decoupled_ppo_loss(*batch, segment_ids=jnp.zeros((4, 8), jnp.int32))


# --------------------------------------------------------------------------- A-3PO


def reference_alpha(version, current):
    """AReaL's rule token by token: proximal = version current - 1, trained = current."""
    if version < 0 or current - version <= 0:
        return 0.0
    return min(max((current - 1 - version) / (current - version), 0.0), 1.0)


@pytest.mark.parametrize("current", [0, 1, 4, 9])
def test_loglinear_alpha_matches_reference(current):
    versions = np.random.default_rng(current).integers(-1, 11, (3, 8))
    want = np.vectorize(reference_alpha)(versions, current)
    np.testing.assert_allclose(loglinear_alpha(versions, current), want, rtol=1e-6)
    np.testing.assert_allclose(loglinear_alpha(jnp.asarray(versions), current), want, rtol=1e-6)
    assert loglinear_alpha(versions, current).dtype == np.float32


def test_loglinear_proximal_values_and_gradient_match_reference():
    # pi_prox = behav + alpha * (theta - behav) with theta constant: the loss gradient is the one of
    # the reference objective at a fixed pi_prox (central differences with prox held).
    with jax.enable_x64(True):
        logp, _, behav, adv, mask = random_batch(17, shape=(3, 7), spread=0.3)
        versions = np.random.default_rng(17).integers(-1, 6, logp.shape)
        alpha = loglinear_alpha(versions, 5).astype(np.float64)
        prox_ref = np.array([[behav[i, j] + reference_alpha(versions[i, j], 5) * (logp[i, j] - behav[i, j])
                              for j in range(logp.shape[1])] for i in range(logp.shape[0])])
        got = loglinear_proximal_logprobs(jnp.asarray(behav), jnp.asarray(logp), jnp.asarray(alpha))
        np.testing.assert_allclose(got, prox_ref, rtol=1e-7)  # alpha is float32
        assert 0 < np.sum((alpha > 0) & (alpha < 1) & mask)

        kw = dict(eps_clip=0.2, behav_imp_weight_cap=1.3)

        @jax.jit
        def loss_fn(lp):
            prox = loglinear_proximal_logprobs(behav, lp, alpha)
            return decoupled_ppo_loss(lp, prox, behav, adv, mask, **kw)[0]

        lp = jnp.asarray(logp, jnp.float64)
        value, grad = jax.value_and_grad(loss_fn)(lp)
        assert float(value) == pytest.approx(reference_loss(logp, prox_ref, behav, adv, mask, 0.2, cap=1.3)[0],
                                             rel=1e-7)
        h = 1e-6
        fd = np.zeros_like(logp)
        for idx in np.ndindex(logp.shape):
            e = np.zeros_like(logp)
            e[idx] = h
            fd[idx] = (reference_loss(logp + e, prox_ref, behav, adv, mask, 0.2, cap=1.3)[0]
                       - reference_loss(logp - e, prox_ref, behav, adv, mask, 0.2, cap=1.3)[0]) / (2 * h)
        np.testing.assert_allclose(np.asarray(grad), fd, rtol=1e-5, atol=1e-9)
        assert np.any(np.asarray(grad) != 0)


# --------------------------------------------------------------------------- gradients


def test_gradient_matches_central_finite_differences():
    with jax.enable_x64(True):
        logp, prox, behav, adv, mask = random_batch(7, shape=(3, 6), spread=0.3)
        kw = dict(eps_clip=0.2, eps_clip_higher=0.25, behav_imp_weight_cap=1.3)

        @jax.jit
        def loss_fn(lp):
            return decoupled_ppo_loss(lp, prox, behav, adv, mask, **kw)[0]

        lp = jnp.asarray(logp, jnp.float64)
        assert loss_fn(lp).dtype == jnp.float64
        grad = np.asarray(jax.grad(loss_fn)(lp))
        h = 1e-6
        fd = np.zeros_like(logp)
        for idx in np.ndindex(logp.shape):
            e = np.zeros_like(logp)
            e[idx] = h
            fd[idx] = (float(loss_fn(lp + e)) - float(loss_fn(lp - e))) / (2 * h)
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
        # Clipped, capped and padding tokens have zero gradient; the others do not.
        r = np.exp(logp - prox)
        w = np.exp(prox - behav)
        active = mask & (w <= 1.3) & (-adv * r >= -adv * np.clip(r, 0.8, 1.25))
        assert np.all(grad[~active] == 0)
        assert np.all(grad[active] != 0)
        assert 0 < active.sum() < mask.sum()


def test_gradient_closed_form_unclipped():
    # Inside the trust region d loss / d logp_t = -w_t A_t r_t / N.
    logp, prox, behav, adv, mask = random_batch(9, spread=0.01)
    grad = jax.grad(lambda x: decoupled_ppo_loss(x, prox, behav, adv, mask, eps_clip=0.5)[0])(
        jnp.asarray(logp, jnp.float32)
    )
    expected = np.where(mask, -np.exp(prox - behav) * adv * np.exp(logp - prox) / mask.sum(), 0)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-7)


def test_jit_compatible():
    batch = random_batch(4)
    f = jax.jit(lambda *a: decoupled_ppo_loss(*a, eps_clip=0.2, behav_imp_weight_cap=2.0))
    loss, _ = f(*(jnp.asarray(x) for x in batch))
    ref, _ = reference_loss(*batch, 0.2, cap=2.0)
    np.testing.assert_allclose(float(loss), ref, rtol=2e-5)


# --------------------------------------------------------------------------- errors


def test_bad_arguments():
    batch = [jnp.asarray(x) for x in random_batch(0)]
    with pytest.raises(ValueError, match="advantages"):
        decoupled_ppo_loss(*batch[:3], batch[3][:, :-1], batch[4])
    with pytest.raises(ValueError, match="eps_clip"):
        decoupled_ppo_loss(*batch, eps_clip=0.0)
    with pytest.raises(ValueError, match="eps_clip_higher"):
        decoupled_ppo_loss(*batch, eps_clip_higher=-0.1)
    with pytest.raises(ValueError, match="behav_imp_weight_cap"):
        decoupled_ppo_loss(*batch, behav_imp_weight_cap=0.0)


# --------------------------------------------------------------------------- helpers


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_token_logprobs_and_entropy_match_numpy(temperature):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 5))
    lsm = np_log_softmax(logits.astype(np.float64) / temperature)
    want = np.take_along_axis(lsm, targets[..., None], -1)[..., 0]
    got = token_logprobs(jnp.asarray(logits), jnp.asarray(targets), temperature)
    assert got.shape == (2, 5) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ent = token_entropy(jnp.asarray(logits), temperature)
    np.testing.assert_allclose(ent, -(np.exp(lsm) * lsm).sum(-1), rtol=1e-5, atol=1e-5)


def test_token_logprobs_bf16_and_entropy_bounds():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 2, (3, 4, 16)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, 16, (3, 4)))
    lp = token_logprobs(logits, targets)
    assert lp.dtype == jnp.float32 and bool(jnp.all(lp <= 0))
    # Probabilities over the whole vocabulary sum to one.
    all_ids = jnp.broadcast_to(jnp.arange(16), (3, 4, 16))
    all_lp = jax.jit(jax.vmap(lambda t: token_logprobs(logits, t), in_axes=-1, out_axes=-1))
    total = jnp.exp(all_lp(all_ids))
    np.testing.assert_allclose(total.sum(-1), 1.0, rtol=1e-5)
    ent = token_entropy(logits)
    assert bool(jnp.all(ent >= 0)) and bool(jnp.all(ent <= np.log(16) + 1e-5))
    np.testing.assert_allclose(token_entropy(jnp.zeros((2, 16))), np.log(16), rtol=1e-6)


def test_helper_errors():
    with pytest.raises(ValueError, match="vocabulary"):
        token_logprobs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="integer"):
        token_logprobs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3), jnp.int32), 0.0)
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(jnp.zeros((2, 5)), -1.0)
