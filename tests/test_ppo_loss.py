"""decoupled_ppo_loss against a NumPy reference, its gradient against finite
differences, micro-batch denominator splitting, naive-PPO equivalence, and the
token log-prob / entropy helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.ppo import (
    accumulate_loss_stats,
    decoupled_ppo_loss,
    summarize_loss_stats,
    token_entropy,
    token_logprobs,
)


def reference_loss(logp, prox, behav, adv, mask, eps, eps_high=None, cap=None, denom=None):
    """Straight-line NumPy float64 version of the decoupled objective, token by token."""
    eps_high = eps if eps_high is None else eps_high
    total, n_valid, n_clip, n_cap = 0.0, 0, 0, 0
    w_sum, w_max, r_sum, kl_sum = 0.0, 0.0, 0.0, 0.0
    for idx in np.ndindex(logp.shape):
        if not mask[idx]:
            continue
        n_valid += 1
        r = np.exp(logp[idx] - prox[idx])
        w = np.exp(prox[idx] - behav[idx])
        a = adv[idx]
        unclipped = -a * r
        clipped = -a * min(max(r, 1 - eps), 1 + eps_high)
        n_clip += clipped > unclipped
        w_sum += w
        w_max = max(w_max, w)
        r_sum += r
        kl_sum += r - 1 - np.log(r)
        if cap is not None and w > cap:
            n_cap += 1
            continue
        total += w * max(unclipped, clipped)
    d = n_valid if denom is None else denom
    loss = total / d if d > 0 else 0.0
    stats = dict(
        n_valid=n_valid, n_clipped=n_clip, n_capped=n_cap, imp_weight_sum=w_sum,
        imp_weight_max=w_max, ratio_sum=r_sum, approx_kl_sum=kl_sum, loss_sum=total,
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
    decoupled_ppo_loss, static_argnames=("eps_clip", "eps_clip_higher", "behav_imp_weight_cap")
)


def run(logp, prox, behav, adv, mask, **kw):
    loss, stats = jit_loss(
        jnp.asarray(logp), jnp.asarray(prox), jnp.asarray(behav), jnp.asarray(adv),
        jnp.asarray(mask), **kw,
    )
    return float(loss), {k: float(v) for k, v in stats.items()}


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
    assert all(v == 0.0 for v in stats.values())
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
    assert_stats_close({k: float(v) for k, v in stats.items()}, full_stats)

    summary = summarize_loss_stats(stats)
    assert summary["n_valid_tokens"] == n_global
    assert summary["loss_token_mean"] == pytest.approx(full_loss, rel=1e-5)
    assert 0 < summary["clip_frac"] < 1 and 0 < summary["capped_frac"] < 1


def test_zero_denominator_gives_zero_loss():
    logp, prox, behav, adv, mask = random_batch(2)
    mask[:] = False
    loss, _ = run(logp, prox, behav, adv, mask, denominator=0.0)
    assert loss == 0.0


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
