"""compute_advantages: hand-computed cases per normalization, loop-based NumPy
references on random batches, KL shaping, KL estimators against closed forms, errors."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.ppo import AdvantageConfig, compute_advantages, kl_estimate


def mask_from_lengths(lengths, t):
    return np.arange(t)[None, :] < np.asarray(lengths)[:, None]


# --------------------------------------------------------------------------- hand cases


def test_batch_norm_hand_case_token_weighted():
    # Rewards 5 (2 tokens) and -5 (3 tokens). Token-weighted: mean = (10 - 15) / 5 = -1,
    # var = (2 * 36 + 3 * 16) / 5 = 24.
    mask = mask_from_lengths([2, 3], 4)
    adv = compute_advantages(np.array([5.0, -5.0]), np.array([0, 0]), mask, AdvantageConfig(eps=1e-5))
    std = np.sqrt(24.0)
    want = np.array([[6, 6, 0, 0], [-4, -4, -4, 0]]) / (std + 1e-5)
    np.testing.assert_allclose(adv, want * mask, rtol=1e-6)
    assert adv.dtype == np.float32


def test_group_norms_hand_case():
    # Group 7: rewards 1 (1 token), 3 (1 token); group 2: rewards 0 (2 tokens), 0, 6 (1 token).
    rewards = np.array([1.0, 3.0, 0.0, 6.0])
    groups = np.array([7, 7, 2, 2])
    mask = mask_from_lengths([1, 1, 2, 1], 3)
    g = compute_advantages(rewards, groups, mask, AdvantageConfig(norm="group", eps=0.5))
    # group 7: mean 2, std 1 -> +-1 / 1.5; group 2: tokens [0, 0, 6], mean 2, std sqrt(8)
    s2 = np.sqrt(8.0) + 0.5
    want = np.array([[-1 / 1.5, 0, 0], [1 / 1.5, 0, 0], [-2 / s2, -2 / s2, 0], [4 / s2, 0, 0]])
    np.testing.assert_allclose(g, want, rtol=1e-6)

    gm = compute_advantages(rewards, groups, mask, AdvantageConfig(norm="group_mean"))
    np.testing.assert_allclose(gm, [[-1, 0, 0], [1, 0, 0], [-2, -2, 0], [4, 0, 0]], rtol=1e-6)

    loo = compute_advantages(rewards, groups, mask, AdvantageConfig(norm="rloo"))
    # rloo: sequence-level baseline = the other member's reward.
    np.testing.assert_allclose(loo, [[-2, 0, 0], [2, 0, 0], [-6, -6, 0], [6, 0, 0]], rtol=1e-6)

    none = compute_advantages(rewards, groups, mask, AdvantageConfig(norm="none"))
    np.testing.assert_allclose(none, rewards[:, None] * mask)


def test_rloo_three_members():
    rewards = np.array([1.0, 2.0, 6.0])
    adv = compute_advantages(rewards, np.zeros(3, int), np.ones((3, 2), bool), AdvantageConfig(norm="rloo"))
    np.testing.assert_allclose(adv[:, 0], [1 - 4, 2 - 3.5, 6 - 1.5])
    assert abs(adv[:, 0].sum() - 1.5 * (rewards - rewards.mean()).sum()) < 1e-9


def test_reward_bias_scale_clip_order():
    # (r + bias) * scale, then clip: (4 + 1) * 2 = 10 -> 3; (-1 + 1) * 2 = 0; (-3 + 1) * 2 = -4 -> -3.
    cfg = AdvantageConfig(norm="none", reward_bias=1.0, reward_scale=2.0, reward_clip=3.0)
    adv = compute_advantages(np.array([4.0, -1.0, -3.0]), np.arange(3), np.ones((3, 1), bool), cfg)
    np.testing.assert_allclose(adv[:, 0], [3.0, 0.0, -3.0])


@pytest.mark.parametrize("norm", ["group", "group_mean", "rloo"])
def test_identical_rewards_in_group_give_zero(norm):
    rng = np.random.default_rng(0)
    rewards = np.repeat([5.0, -5.0, 1.0], 4)
    groups = np.repeat([3, 1, 2], 4)
    mask = mask_from_lengths(rng.integers(1, 9, 12), 8)
    adv = compute_advantages(rewards, groups, mask, AdvantageConfig(norm=norm))
    np.testing.assert_array_equal(adv, 0.0)


def test_all_masked_batch_and_rows_are_zero():
    mask = np.zeros((3, 4), bool)
    for norm in ("batch", "group", "group_mean", "none"):
        adv = compute_advantages(np.array([1.0, 2.0, 3.0]), np.zeros(3, int), mask, AdvantageConfig(norm=norm))
        np.testing.assert_array_equal(adv, 0.0)
    mask[0, :2] = True
    mask[2, :1] = True
    adv = compute_advantages(np.array([1.0, 9.0, 3.0]), np.zeros(3, int), mask, AdvantageConfig())
    assert np.all(adv[1] == 0)  # the empty row does not enter the statistics
    # Token values [1, 1, 3]: mean 5/3, biased std sqrt(8/9).
    std = np.sqrt(8 / 9) + 1e-5
    np.testing.assert_allclose(adv[0], [-2 / 3 / std, -2 / 3 / std, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(adv[2], [4 / 3 / std, 0, 0, 0], rtol=1e-6)


# --------------------------------------------------------------------------- references


def reference(rewards, groups, mask, cfg, logprobs=None, ref_logprobs=None, no_eos=None):
    """Loop-based NumPy reference, written independently of the library's vectorization."""
    n, t = mask.shape
    r = np.array(rewards, np.float64)
    if cfg.overlong_tokens is not None:
        for i in range(n):
            length = sum(bool(mask[i, j]) for j in range(t))
            over = length - (cfg.max_response_tokens - cfg.overlong_tokens)
            r[i] += min(-over / cfg.overlong_tokens * cfg.overlong_penalty_factor, 0.0)
    r = (r + cfg.reward_bias) * cfg.reward_scale
    if cfg.reward_clip is not None:
        r = np.clip(r, -cfg.reward_clip, cfg.reward_clip)
    if cfg.norm == "group_then_batch":  # sequence rewards within each group, std with n - 1
        g = r.copy()
        for i in range(n):
            vals = [r[k] for k in range(n) if groups[k] == groups[i]]
            std = np.std(vals, ddof=1) if len(vals) > 1 else 1.0
            g[i] = (r[i] - np.mean(vals)) / (std + cfg.eps)
        r = g
    if cfg.mask_no_eos_with_zero:
        r = np.where(no_eos, 0.0, r)
    ret = np.zeros((n, t))
    for i in range(n):
        running = r[i]
        for j in reversed(range(t)):
            if not mask[i, j]:
                continue
            if cfg.kl_coef:
                d = logprobs[i, j] - ref_logprobs[i, j]
                kl = {"k1": d, "k2": d * d / 2, "k3": np.exp(-d) + d - 1}[cfg.kl_estimator]
                running -= cfg.kl_coef * kl
            ret[i, j] = running
    vals = lambda rows: [ret[i, j] for i in rows for j in range(t) if mask[i, j]]  # noqa: E731
    out = np.zeros((n, t))
    for i in range(n):
        members = [k for k in range(n) if groups[k] == groups[i]]
        pool = range(n) if cfg.norm == "batch" else members
        v = np.array(vals(pool))
        for j in range(t):
            if not mask[i, j]:
                continue
            if cfg.norm == "none":
                out[i, j] = ret[i, j]
            elif cfg.norm == "group_then_batch":
                v = np.array(vals(range(n)))
                std = v.std(ddof=1) if v.size > 1 else 1.0
                out[i, j] = (ret[i, j] - v.mean()) / (std + cfg.eps)
            elif cfg.norm in ("batch", "group"):
                out[i, j] = (ret[i, j] - v.mean()) / (v.std() + cfg.eps)
            elif cfg.norm == "group_mean":
                out[i, j] = ret[i, j] - v.mean()
            else:
                others = [r[k] for k in members if k != i]
                out[i, j] = ret[i, j] - np.mean(others)
    return out


def random_case(seed, n_groups=4, group_size=3, t=10):
    rng = np.random.default_rng(seed)
    n = n_groups * group_size
    rewards = rng.choice([5.0, -5.0, 0.5], n) + rng.normal(0, 0.1, n)
    groups = rng.permutation(np.repeat(rng.choice(100, n_groups, replace=False), group_size))
    lengths = rng.integers(1, t + 1, n)
    lengths[rng.integers(n)] = 0  # an answer with no trained tokens
    mask = mask_from_lengths(lengths, t)
    logprobs = -rng.uniform(0.01, 3, (n, t))
    ref = logprobs + rng.normal(0, 0.3, (n, t))
    logprobs[~mask] = -np.inf  # padding garbage must not leak
    return rewards, groups, mask, logprobs, ref


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("norm", ["batch", "group", "group_mean", "rloo", "group_then_batch", "none"])
@pytest.mark.parametrize("kl", [(0.0, "k1"), (0.1, "k1"), (0.05, "k2"), (0.2, "k3")])
def test_matches_reference(seed, norm, kl):
    rewards, groups, mask, logprobs, ref = random_case(seed)
    cfg = AdvantageConfig(norm=norm, kl_coef=kl[0], kl_estimator=kl[1], reward_bias=0.5,
                          reward_scale=0.5, reward_clip=2.0)
    got = compute_advantages(rewards, groups, mask, cfg, logprobs=logprobs, ref_logprobs=ref)
    want = reference(rewards, groups, mask, cfg, logprobs, ref)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("norm", ["batch", "group_then_batch"])
@pytest.mark.parametrize("shaping", [dict(overlong_tokens=4, max_response_tokens=10, overlong_penalty_factor=2.0),
                                     dict(mask_no_eos_with_zero=True),
                                     dict(overlong_tokens=10, max_response_tokens=10, mask_no_eos_with_zero=True)])
def test_reward_shaping_options_match_reference(seed, norm, shaping):
    rewards, groups, mask, logprobs, ref = random_case(seed)
    no_eos = np.random.default_rng(seed + 7).random(len(rewards)) < 0.4
    cfg = AdvantageConfig(norm=norm, reward_bias=0.5, reward_scale=0.5, kl_coef=0.1, **shaping)
    got = compute_advantages(rewards, groups, mask, cfg, logprobs=logprobs, ref_logprobs=ref, no_eos=no_eos)
    want = reference(rewards, groups, mask, cfg, logprobs, ref, no_eos)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    plain = compute_advantages(rewards, groups, mask, dataclasses.replace(
        cfg, overlong_tokens=None, mask_no_eos_with_zero=False), logprobs=logprobs, ref_logprobs=ref)
    assert np.abs(got - plain).max() > 1e-3  # the option changed something


def test_overlong_penalty_and_no_eos_hand_case():
    # max 10 tokens, penalty over the last 4: lengths 5, 8, 10 lose 0, 2/4 * 2 = 1, 4/4 * 2 = 2.
    mask = mask_from_lengths([5, 8, 10], 10)
    cfg = AdvantageConfig(norm="none", overlong_tokens=4, max_response_tokens=10, overlong_penalty_factor=2.0)
    adv = compute_advantages(np.array([1.0, 1.0, 1.0]), np.zeros(3, int), mask, cfg)
    np.testing.assert_allclose(adv[:, 0], [1.0, 0.0, -1.0])
    cfg = AdvantageConfig(norm="none", mask_no_eos_with_zero=True, reward_bias=1.0)
    adv = compute_advantages(np.array([5.0, -5.0, 5.0]), np.zeros(3, int), mask, cfg,
                             no_eos=np.array([False, True, False]))
    np.testing.assert_allclose(adv[:, 0], [6.0, 0.0, 6.0])  # bias applies first, then the zero


def test_group_then_batch_hand_case():
    # Groups (5, -5) and (5, 5, -5): each reward normalized within its group (std n - 1), then the
    # token-weighted batch normalization (std n - 1) over the sequences' tokens.
    eps = 1e-5
    rewards = np.array([5.0, -5.0, 5.0, 5.0, -5.0])
    groups = np.array([0, 0, 1, 1, 1])
    mask = mask_from_lengths([1, 2, 1, 1, 3], 3)
    g0 = np.array([5.0, -5.0])
    g1 = np.array([5.0, 5.0, -5.0])
    seq = np.concatenate([(g0 - g0.mean()) / (g0.std(ddof=1) + eps), (g1 - g1.mean()) / (g1.std(ddof=1) + eps)])
    tokens = np.repeat(seq, [1, 2, 1, 1, 3])
    want = (seq - tokens.mean()) / (tokens.std(ddof=1) + eps)
    adv = compute_advantages(rewards, groups, mask, AdvantageConfig(norm="group_then_batch", eps=eps))
    np.testing.assert_allclose(adv[:, 0], want, rtol=1e-6)
    np.testing.assert_allclose(adv[mask].mean(), 0.0, atol=1e-6)


def test_invariants_of_normalizations():
    rewards, groups, mask, logprobs, ref = random_case(7)
    cfg = AdvantageConfig(kl_coef=0.1)
    batch = compute_advantages(rewards, groups, mask, cfg, logprobs=logprobs, ref_logprobs=ref)
    np.testing.assert_allclose(batch[mask].mean(), 0.0, atol=1e-5)
    np.testing.assert_allclose(batch[mask].std(), 1.0, atol=1e-4)
    for gid in np.unique(groups):
        rows = groups == gid
        g = compute_advantages(rewards, groups, mask, dataclasses.replace(cfg, norm="group"),
                               logprobs=logprobs, ref_logprobs=ref)
        np.testing.assert_allclose(g[rows][mask[rows]].mean(), 0.0, atol=1e-5)
    # Shift invariance: adding a constant to every reward changes no normalized advantage.
    for norm in ("batch", "group", "group_mean", "rloo"):
        c = dataclasses.replace(cfg, norm=norm)
        a = compute_advantages(rewards, groups, mask, c, logprobs=logprobs, ref_logprobs=ref)
        b = compute_advantages(rewards + 3.0, groups, mask, c, logprobs=logprobs, ref_logprobs=ref)
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_kl_shaping_is_reward_to_go():
    # One sequence, 3 tokens, k1 penalty: tokens see R - c * (kl_t + kl_{t+1} + ...).
    logp = np.array([[-1.0, -2.0, -0.5, -9.0]])
    ref = np.array([[-1.5, -1.0, -0.5, 0.0]])  # k1 = [0.5, -1, 0]
    mask = np.array([[True, True, True, False]])
    cfg = AdvantageConfig(norm="none", kl_coef=0.1)
    adv = compute_advantages(np.array([2.0]), np.array([0]), mask, cfg, logprobs=logp, ref_logprobs=ref)
    np.testing.assert_allclose(adv, [[2 - 0.1 * (-0.5), 2 - 0.1 * (-1.0), 2.0, 0.0]], rtol=1e-6)


# --------------------------------------------------------------------------- KL estimators


def test_kl_estimators_closed_forms():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7))
    q = rng.dirichlet(np.ones(7))
    kl = float(np.sum(p * np.log(p / q)))
    lp, lq = np.log(p), np.log(q)
    # Expectations under x ~ p, taken exactly over the support.
    assert np.sum(p * kl_estimate(lp, lq, "k1")) == pytest.approx(kl, rel=1e-12)
    assert np.sum(p * kl_estimate(lp, lq, "k3")) == pytest.approx(kl, rel=1e-10)
    assert np.sum(p * kl_estimate(lp, lq, "k2")) == pytest.approx(0.5 * np.sum(p * np.log(p / q) ** 2))
    assert np.all(kl_estimate(lp, lq, "k2") >= 0) and np.all(kl_estimate(lp, lq, "k3") >= 0)
    # k2 matches KL to second order for nearby distributions.
    q2 = p * np.exp(1e-3 * rng.normal(size=7))
    q2 /= q2.sum()
    kl2 = float(np.sum(p * np.log(p / q2)))
    assert np.sum(p * kl_estimate(lp, np.log(q2), "k2")) == pytest.approx(kl2, rel=1e-2)


def test_kl_estimate_pointwise_and_jax():
    d = np.array([-1.0, 0.0, 0.3])
    np.testing.assert_allclose(kl_estimate(d, np.zeros(3), "k1"), d)
    np.testing.assert_allclose(kl_estimate(d, np.zeros(3), "k2"), d**2 / 2)
    np.testing.assert_allclose(kl_estimate(d, np.zeros(3), "k3"), np.exp(-d) + d - 1)
    out = kl_estimate(jnp.asarray(d), jnp.zeros(3), "k3")
    assert isinstance(out, jnp.ndarray)
    np.testing.assert_allclose(out, np.exp(-d) + d - 1, rtol=1e-6)
    tiny = kl_estimate(np.array([1e-9]), np.array([0.0]), "k3")
    assert tiny[0] == pytest.approx(5e-19, rel=1e-6)  # expm1 keeps precision near 0


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(norm="grpo"), ValueError, "norm"),
        (dict(kl_estimator="k4"), ValueError, "kl_estimator"),
        (dict(eps=0.0), ValueError, "eps"),
        (dict(reward_scale=0.0), ValueError, "reward_scale"),
        (dict(reward_scale=float("nan")), ValueError, "reward_scale"),
        (dict(reward_clip=0.0), ValueError, "reward_clip"),
        (dict(kl_coef=-0.1), ValueError, "kl_coef"),
        (dict(reward_bias="1"), TypeError, "reward_bias"),
        (dict(overlong_tokens=4), ValueError, "max_response_tokens"),
        (dict(overlong_tokens=0, max_response_tokens=8), ValueError, "overlong_tokens"),
        (dict(overlong_tokens=9, max_response_tokens=8), ValueError, "overlong_tokens"),
        (dict(overlong_penalty_factor=0.0), ValueError, "overlong_penalty_factor"),
        (dict(mask_no_eos_with_zero=1), ValueError, "mask_no_eos_with_zero"),
    ],
)
def test_bad_config(kwargs, err, match):
    with pytest.raises(err, match=match):
        AdvantageConfig(**kwargs)


def test_config_is_frozen():
    cfg = AdvantageConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.norm = "group"


def test_bad_inputs():
    mask = np.ones((2, 3), bool)
    cfg = AdvantageConfig()
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(np.ones(3), np.zeros(2, int), mask, cfg)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(np.ones(2), np.zeros(3, int), mask, cfg)
    with pytest.raises(TypeError, match="group_ids"):
        compute_advantages(np.ones(2), np.zeros(2), mask, cfg)
    with pytest.raises(ValueError, match="loss_mask"):
        compute_advantages(np.ones(2), np.zeros(2, int), np.ones(2, bool), cfg)
    with pytest.raises(ValueError, match="finite"):
        compute_advantages(np.array([1.0, np.nan]), np.zeros(2, int), mask, cfg)
    with pytest.raises(TypeError, match="AdvantageConfig"):
        compute_advantages(np.ones(2), np.zeros(2, int), mask, {"norm": "batch"})
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_advantages(np.ones(2), np.zeros(2, int), mask, AdvantageConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="logprobs"):
        compute_advantages(np.ones(2), np.zeros(2, int), mask, AdvantageConfig(kl_coef=0.1),
                           logprobs=np.zeros((2, 4)), ref_logprobs=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="no_eos"):
        compute_advantages(np.ones(2), np.zeros(2, int), mask, AdvantageConfig(mask_no_eos_with_zero=True))
    with pytest.raises(ValueError, match="no_eos"):
        compute_advantages(np.ones(2), np.zeros(2, int), mask, AdvantageConfig(mask_no_eos_with_zero=True),
                           no_eos=np.zeros(3, bool))
    with pytest.raises(ValueError, match=r"groups \[5\]"):
        compute_advantages(np.ones(3), np.array([1, 1, 5]), np.ones((3, 2), bool), AdvantageConfig(norm="rloo"))
    with pytest.raises(ValueError, match="estimator"):
        kl_estimate(np.zeros(2), np.zeros(2), "k5")
    with pytest.raises(ValueError, match="shape"):
        kl_estimate(np.zeros(2), np.zeros(3))


# --------------------------------------------------------------------------- across processes
# Run as a script, this file is one process of the 2-process test below.

MP_GROUPS = {0: (30, 3), 1: (31, 5)}  # process -> (seed, prompt groups): unequal shares of the batch
MP_NORMS = ("batch", "group_then_batch")


def random_groups(seed, n_groups):
    """Trajectory groups of 4 with random lengths, rewards in {-5, 5, 1} and some truncations."""
    from areal_jax.rollout.types import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        trajs = []
        for _ in range(4):
            c = int(rng.integers(1, 12))
            trajs.append(Trajectory(rng.integers(0, 50, 3), rng.integers(0, 50, c), np.zeros(c, np.float32),
                                    np.zeros(c, np.int32), float(rng.choice([-5.0, 5.0, 1.0])),
                                    stop_reason=str(rng.choice(["stop", "length"]))))
        groups.append(TrajectoryGroup(f"p{seed}-{g}", tuple(trajs), 0))
    return groups


def mp_config(norm):
    return AdvantageConfig(norm=norm, reward_clip=4.0, mask_no_eos_with_zero=True)


@pytest.mark.slow  # two JAX processes start and gather (about 20 s)
def test_two_processes_normalise_over_the_global_batch(tmp_path):
    # Each process holds its own groups; with the cross-process sum its advantages equal those of
    # one process normalising the whole batch, and differ from normalising its own share alone.
    from areal_jax.trainer.batching import build_sequences
    from tests.multiprocess import run_processes

    results = run_processes(__file__, lambda i: (tmp_path,), tmp_path, devices_per_process=1)
    shares = [random_groups(*MP_GROUPS[i]) for i in range(2)]
    for norm in MP_NORMS:
        whole = build_sequences(shares[0] + shares[1], mp_config(norm))
        start = 0
        for i, result in enumerate(results):
            alone = build_sequences(shares[i], mp_config(norm))
            got = result[norm]
            assert len(got) == len(alone)
            for k, adv in enumerate(got):
                np.testing.assert_allclose(np.asarray(adv, np.float32), whole[start + k]["advantages"], rtol=1e-6,
                                           atol=1e-7, err_msg=f"{norm}, process {i}, sequence {k}")
            assert not all(np.allclose(np.asarray(a, np.float32), s["advantages"]) for a, s in zip(got, alone))
            start += len(got)
    # The float64 sum (float32 would give 0.3000000119 and 1.0) reaches both processes bit for bit.
    assert results[0]["sum"] == results[1]["sum"] == [0.1 + 0.2, 1e-10 + 1.0]


def _worker(port: str, process_id: int, out_dir: str) -> None:
    """One process of test_two_processes_normalise_over_the_global_batch."""
    import json
    import pathlib

    from areal_jax.parallel import agree_sum_array, initialize_distributed
    from areal_jax.trainer.batching import build_sequences

    assert initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    groups = random_groups(*MP_GROUPS[process_id])
    result = {norm: [s["advantages"].tolist() for s in build_sequences(groups, mp_config(norm),
                                                                          reduce_sum=agree_sum_array)]
              for norm in MP_NORMS}
    mine = np.array([[0.1, 1e-10], [0.2, 1.0]][process_id])
    result["sum"] = agree_sum_array(mine).tolist()
    pathlib.Path(out_dir, f"result_{process_id}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    import sys

    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
