"""The behaviour-weight modes and the staleness ablation's three objectives (ppo/loss.py).

`head_actor_loss` restates, in this file's own terms, the arithmetic of AReaL HEAD's actor loss
(`ppo_actor_loss_fn` in areal/utils/functional/functional.py, token level, 2-D rows): an optional
rejection-sampling step on pi_prox / pi_behav (metric "ratio", an upper bound, action "mask" or
"clamp") and, only when that step is configured, a behaviour weight. `decoupled_ppo_loss` must match
it in values and gradients: "disabled" against no rejection sampling, the cap modes against it.
The naive_recompute objective is checked against its direct formula and gradient.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.ppo import decoupled_ppo_loss
from areal_jax.trainer.config import OBJECTIVES, PPOConfig
from areal_jax.trainer.objectives import BUILTIN_OBJECTIVES, resolve_objective


def head_actor_loss(logp, prox, old, adv, mask, eps, eps_high=None, c_clip=None, rejection=None,
                    level="token"):
    """AReaL HEAD's loss, restated (float64 jax.numpy so jax.grad gives its gradient).

    rejection: None (no behaviour weight at all) or (upper, action) with action "mask" / "clamp".
    level "sequence" is GSPO with one sequence per row, as HEAD computes it on packed (1-D) input,
    the layout its trainer uses: the mean log-ratio and the mean advantage over the tokens the
    (possibly narrowed) mask keeps. (HEAD's padded 2-D branch sums the advantage over every token
    of the row instead; the two differ only where rejection removed tokens.)
    """
    mask = jnp.asarray(mask, bool)
    count = jnp.maximum(jnp.sum(mask), 1)  # taken before rejection can narrow the mask
    weight = None
    if rejection is not None:
        upper, action = rejection
        log_w = jax.lax.stop_gradient(prox - old)
        log_w = jnp.where(jnp.isfinite(log_w), log_w, 0.0)
        weight = jnp.exp(log_w)
        if action == "mask":
            mask = mask & (weight <= upper)
        else:
            weight = jnp.clip(weight, 0.0, upper)
        weight = jnp.where(mask, weight, 0.0)
    if level == "sequence":
        per_row = jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1)
        mean_log_ratio = jnp.sum(jnp.where(mask, logp - prox, 0.0), axis=1, keepdims=True) / per_row
        ratio = jnp.where(mask, jnp.exp(jnp.broadcast_to(mean_log_ratio, logp.shape)), 0.0)
        adv = jnp.broadcast_to(jnp.sum(jnp.where(mask, adv, 0.0), axis=1, keepdims=True) / per_row, logp.shape)
    else:
        ratio = jnp.where(mask, jnp.exp(logp - prox), 0.0)
    high = eps if eps_high is None else eps_high
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - eps, 1.0 + high)
    pg = jnp.maximum(unclipped, clipped)
    if c_clip is not None:
        pg = jnp.minimum(pg, jnp.sign(adv) * c_clip * adv)
    if weight is not None:
        pg = pg * weight
    return jnp.sum(jnp.where(mask, pg, 0.0)) / count


def random_batch(seed, shape=(4, 9), spread=0.4, mask_p=0.7):
    rng = np.random.default_rng(seed)
    behav = -rng.uniform(0.05, 3.0, shape)
    prox = behav + rng.normal(0, spread, shape)
    logp = prox + rng.normal(0, spread, shape)
    mask = rng.random(shape) < mask_p
    adv = rng.normal(0, 1.5, shape) * mask  # zero off the mask, as the trainer's advantages are
    return logp, prox, behav, adv, mask


# (our keyword arguments, HEAD's rejection argument)
CASES = [
    (dict(behav_imp_weight_mode="disabled"), None),
    (dict(behav_imp_weight_mode="disabled", eps_clip_higher=0.3, c_clip=1.4), None),
    (dict(behav_imp_weight_mode="disabled", importance_sampling_level="sequence"), None),
    (dict(behav_imp_weight_cap=1.3, behav_imp_weight_mode="mask"), (1.3, "mask")),
    (dict(behav_imp_weight_cap=1.3, behav_imp_weight_mode="clamp", c_clip=1.5), (1.3, "clamp")),
    (dict(behav_imp_weight_cap=1.2, importance_sampling_level="sequence"), (1.2, "mask")),
]


def _head_kw(kw, rejection):
    return dict(eps_high=kw.get("eps_clip_higher"), c_clip=kw.get("c_clip"), rejection=rejection,
                level=kw.get("importance_sampling_level", "token"))


@pytest.mark.parametrize("kw, rejection", CASES)
def test_matches_areal_head_in_values_and_gradients(kw, rejection):
    with jax.enable_x64(True):
        for seed in range(3):
            logp, prox, behav, adv, mask = (jnp.asarray(x) for x in random_batch(seed))
            ours = jax.jit(jax.value_and_grad(lambda lp: decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip=0.2,
                                                                             **kw)[0]))
            head = jax.jit(jax.value_and_grad(lambda lp: head_actor_loss(lp, prox, behav, adv, mask, 0.2,
                                                                          **_head_kw(kw, rejection))))
            (loss, grad), (want, want_grad) = ours(logp), head(logp)
            assert loss.dtype == jnp.float64
            np.testing.assert_allclose(float(loss), float(want), rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-10, atol=1e-14)
            assert np.count_nonzero(np.asarray(grad)) > 0


def test_disabled_differs_from_the_uncapped_weight_by_exactly_w():
    # Inside the trust region each token's gradient is -w A r / N with the weight, -A r / N without.
    logp, prox, behav, adv, mask = random_batch(3, spread=0.01)
    n = mask.sum()

    def grad(mode):
        return np.asarray(jax.grad(lambda lp: decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip=0.5,
                                                                 behav_imp_weight_mode=mode)[0])(
            jnp.asarray(logp, jnp.float32)))

    r, w = np.exp(logp - prox), np.exp(prox - behav)
    np.testing.assert_allclose(grad("disabled"), np.where(mask, -adv * r / n, 0.0), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(grad("mask"), np.where(mask, -w * adv * r / n, 0.0), rtol=1e-4, atol=1e-7)


def test_disabled_stats_report_the_raw_weight_and_cap_nothing():
    logp, prox, behav, adv, mask = random_batch(5, spread=0.8)
    _, stats = decoupled_ppo_loss(*(jnp.asarray(x) for x in (logp, prox, behav, adv, mask)),
                                  behav_imp_weight_mode="disabled")
    w = np.exp(prox - behav)[mask]
    assert float(stats["n_capped"]) == 0
    np.testing.assert_allclose(float(stats["imp_weight_sum"]), w.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(stats["imp_weight_max"]), w.max(), rtol=1e-5)


# ---- naive_recompute: the clip anchored at the recomputed pi_prox, no behaviour weight --------------


def naive_recompute_formula(logp, prox, adv, mask, eps):
    """(loss, d loss / d logp) written out per token in NumPy float64."""
    n = mask.sum()
    r = np.exp(logp - prox)
    unclipped, clipped = -adv * r, -adv * np.clip(r, 1 - eps, 1 + eps)
    loss = np.where(mask, np.maximum(unclipped, clipped), 0.0).sum() / n
    # d(-A r)/d logp = -A r inside the clip range (both branches agree there) and where the
    # unclipped branch is the larger outside it; the clipped branch is flat outside.
    inside = (r >= 1 - eps) & (r <= 1 + eps)
    grad = np.where(mask & (inside | (unclipped > clipped)), -adv * r / n, 0.0)
    return loss, grad


@pytest.mark.parametrize("seed", range(4))
def test_naive_recompute_matches_its_formula_and_ignores_the_behaviour_policy(seed):
    cfg = PPOConfig(**OBJECTIVES["naive_recompute"])
    assert cfg.objective == "naive_recompute"
    with jax.enable_x64(True):
        logp, prox, behav, adv, mask = random_batch(seed, spread=0.3)

        def loss_and_grad(b):
            f = lambda lp: decoupled_ppo_loss(lp, prox, b, adv, mask, eps_clip=cfg.eps_clip,  # noqa: E731
                                              behav_imp_weight_cap=cfg.behav_imp_weight_cap,
                                              behav_imp_weight_mode=cfg.behav_imp_weight_mode)[0]
            loss, grad = jax.value_and_grad(f)(jnp.asarray(logp))
            return float(loss), np.asarray(grad)

        loss, grad = loss_and_grad(behav)
        want, want_grad = naive_recompute_formula(logp, prox, adv, mask, cfg.eps_clip)
        np.testing.assert_allclose(loss, want, rtol=1e-12)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-15)
        r = np.exp(logp - prox)[mask]
        assert np.any((r < 0.8) | (r > 1.2)) and np.any((r > 0.8) & (r < 1.2))  # both branches exercised
        # Another behaviour policy changes nothing (decoupled PPO's loss would move with it).
        other = behav + np.random.default_rng(seed).normal(0, 0.5, behav.shape)
        assert loss_and_grad(other)[0] == loss
        np.testing.assert_array_equal(loss_and_grad(other)[1], grad)
        dec = lambda b: float(decoupled_ppo_loss(jnp.asarray(logp), prox, b, adv, mask)[0])  # noqa: E731
        assert dec(other) != dec(behav)


def test_objectives_name_their_settings():
    for name, fields in OBJECTIVES.items():
        cfg = PPOConfig(**fields)
        assert cfg.objective == name and resolve_objective(name) is BUILTIN_OBJECTIVES[name]
        assert cfg.decoupled == (name != "naive")  # naive PPO reads no pi_prox
    assert PPOConfig().objective == "decoupled"
    assert PPOConfig(objective="tests.test_ppo_objectives:user_loss").objective == "tests.test_ppo_objectives:user_loss"
    with pytest.raises(ValueError, match="PPOConfig.objective = 'ppo': not a built-in objective"):
        PPOConfig(objective="ppo")
    with pytest.raises(ValueError, match="PPOConfig.objective = 'tests.no_such_module:loss': cannot import"):
        PPOConfig(objective="tests.no_such_module:loss")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        PPOConfig(objective="tests.test_ppo_objectives:missing")


def user_loss(logprobs, batch, config):
    """A user objective (`PPOConfig.objective = "tests.test_ppo_objectives:user_loss"`)."""
    return -batch["advantages"] * logprobs, {"advantage_mean": batch["advantages"]}


def _packed(seed, rows=3, width=14):
    """Packed rows `[R, T]` of 2-3 sequences each (segment ids 1..k, padding 0), and the same
    sequences one per row, right-padded: what the engine sees, and what HEAD's loss reads."""
    rng = np.random.default_rng(seed)
    packed = {k: np.zeros((rows, width)) for k in ("logp", "prox", "behav", "adv", "mask")}
    packed["segment_ids"] = np.zeros((rows, width), np.int32)
    singles = []
    for r in range(rows):
        start = 0
        for seg in range(1, int(rng.integers(2, 4)) + 1):
            n = int(rng.integers(2, 5))
            logp, prox, behav, adv, mask = random_batch(int(rng.integers(1 << 30)), shape=(n,), spread=0.4, mask_p=0.8)
            mask[0] = True  # every sequence trains a token
            for k, v in zip(("logp", "prox", "behav", "adv", "mask"), (logp, prox, behav, adv, mask)):
                packed[k][r, start:start + n] = v
            packed["segment_ids"][r, start:start + n] = seg
            singles.append((logp, prox, behav, adv * mask, mask))
            start += n
    width1 = max(len(x[0]) for x in singles)
    single = [np.zeros((len(singles), width1)) for _ in range(5)]
    for i, seq in enumerate(singles):
        for arr, v in zip(single, seq):
            arr[i, :len(v)] = v
    packed["mask"] = packed["mask"].astype(bool)
    return packed, [jnp.asarray(x) for x in single[:4]] + [jnp.asarray(single[4].astype(bool))]


@pytest.mark.parametrize("name, kw, rejection", [
    ("decoupled", dict(behav_imp_weight_cap=1.3, behav_imp_weight_mode="mask"), (1.3, "mask")),
    ("decoupled", dict(behav_imp_weight_cap=1.2, behav_imp_weight_mode="clamp", c_clip=1.5), (1.2, "clamp")),
    ("decoupled", dict(importance_sampling_level="sequence", behav_imp_weight_cap=1.2), (1.2, "mask")),
    ("naive_recompute", dict(eps_clip_higher=0.3), None),
    ("naive_recompute", dict(importance_sampling_level="sequence"), None),
    ("naive", dict(c_clip=1.4), "naive"),
])
def test_builtin_objectives_reduced_as_the_engine_does_equal_areal_heads_loss(name, kw, rejection):
    """The objective path: the built-in's per-token loss, masked and divided by the minibatch's
    valid tokens as the training engine does, equals AReaL HEAD's loss (restated above) over the same
    sequences one per row, in values and gradients, on packed rows of several sequences (GSPO's
    sequences are the segments); its metrics' token means are the reference statistics'."""
    cfg = PPOConfig(objective=name, eps_clip=0.2, **kw)
    with jax.enable_x64(True):
        for seed in range(3):
            p, (logp1, prox1, behav1, adv1, mask1) = _packed(seed)
            denom = float(p["mask"].sum()) + 5.0  # a micro-batch of a larger minibatch
            batch = {"proximal_logprobs": jnp.asarray(p["prox"]), "behavior_logprobs": jnp.asarray(p["behav"]),
                     "advantages": jnp.asarray(p["adv"] * p["mask"]), "loss_mask": jnp.asarray(p["mask"], jnp.float64),
                     "segment_ids": jnp.asarray(p["segment_ids"]),
                     "versions": jnp.where(jnp.asarray(p["mask"]), 3, -1)}
            mask = jnp.asarray(p["mask"])

            def engine(lp):
                per_token, metrics = BUILTIN_OBJECTIVES[name](lp, batch, cfg)
                assert per_token.shape == lp.shape and all(m.shape[:2] == lp.shape for m in metrics.values())
                return jnp.sum(jnp.where(mask, per_token, 0.0)) / denom, metrics

            (loss, metrics), grad = jax.value_and_grad(engine, has_aux=True)(jnp.asarray(p["logp"]))
            anchor = behav1 if rejection == "naive" else prox1
            head = lambda lp: head_actor_loss(lp, anchor, behav1, adv1, mask1, 0.2,  # noqa: E731
                                              **_head_kw(kw, None if rejection == "naive" else rejection))
            want, want_grad = jax.value_and_grad(head)(logp1)
            n = float(mask1.sum())
            np.testing.assert_allclose(float(loss), float(want) * n / denom, rtol=1e-12, atol=1e-14)
            # Gradients per token: the packed positions of each sequence, in order.
            got = np.asarray(grad)[p["segment_ids"] > 0]
            want_tokens = np.asarray(want_grad)[np.asarray(jnp.arange(want_grad.shape[1])[None, :]
                                                           < np.asarray([np.count_nonzero(row) for row in
                                                                         np.asarray(logp1 != 0)])[:, None])]
            np.testing.assert_allclose(got, want_tokens * n / denom, rtol=1e-10, atol=1e-14)
            _, stats = decoupled_ppo_loss(jnp.asarray(p["logp"]), anchor_packed(p, rejection), batch["behavior_logprobs"],
                                          batch["advantages"], mask, eps_clip=0.2, segment_ids=batch["segment_ids"],
                                          **_ppo_kw(cfg))
            for metric, stat in (("clip_frac", "n_clipped"), ("capped_frac", "n_capped"),
                                 ("imp_weight_mean", "imp_weight_sum"), ("approx_kl", "approx_kl_sum")):
                np.testing.assert_allclose(float(jnp.sum(jnp.where(mask, metrics[metric], 0.0))), float(stats[stat]),
                                           rtol=1e-12, atol=1e-14)


def anchor_packed(p, rejection):
    return jnp.asarray(p["behav"] if rejection == "naive" else p["prox"])


def _ppo_kw(cfg):
    mode, cap = cfg.behav_imp_weight_mode, cfg.behav_imp_weight_cap
    if cfg.objective == "naive_recompute":
        mode, cap = "disabled", None
    return dict(eps_clip_higher=cfg.eps_clip_higher, c_clip=cfg.c_clip, behav_imp_weight_mode=mode,
                behav_imp_weight_cap=cap, importance_sampling_level=cfg.importance_sampling_level)


def test_disabled_mode_refuses_a_cap():
    with pytest.raises(ValueError, match="PPOConfig.behav_imp_weight_cap must be None"):
        PPOConfig(behav_imp_weight_mode="disabled", behav_imp_weight_cap=5.0)
    batch = [jnp.zeros((1, 2))] * 5
    with pytest.raises(ValueError, match="behav_imp_weight_cap must be None"):
        decoupled_ppo_loss(*batch, behav_imp_weight_mode="disabled", behav_imp_weight_cap=2.0)


@pytest.mark.parametrize("variant", ["decoupled", "naive", "naive_recompute"])
def test_ablation_bindings_select_each_objective_over_the_quickstart(variant):
    # The quickstart caps the weight at 5: naive_recompute must lift the cap, decoupled keep it.
    from areal_jax import config_system as cs
    from areal_jax.jobs.configs import load_job_configs
    from bench.staleness_ablation import ROOT, objective_bindings

    try:
        ppo = load_job_configs([ROOT / "configs" / "quickstart.gin"], objective_bindings(variant), run_dir="/x").ppo
    finally:
        cs.parse()  # leave no bindings behind for other tests
    assert ppo.objective == variant
    assert ppo.behav_imp_weight_cap == (None if variant == "naive_recompute" else 5.0)


def test_the_offpolicy_quickstart_config_is_the_ablation_regime():
    # configs/quickstart_offpolicy.gin is what bench/staleness_ablation.py runs as --regime offpolicy
    # at eta 8 over 40 steps: the shipped file and the benchmark's bindings must not drift apart.
    from areal_jax.jobs.configs import load_job_configs
    from bench.staleness_ablation import REGIMES

    configs = pathlib.Path(__file__).resolve().parents[1] / "configs"
    shipped = load_job_configs([configs / "quickstart_offpolicy.gin"], [], run_dir="x", num_processes=1)
    regime = load_job_configs([configs / "quickstart.gin"],
                              [*REGIMES["offpolicy"], "RLConfig.max_staleness = 8", "RLConfig.steps = 40"],
                              run_dir="x", num_processes=1)
    assert shipped == regime
    assert shipped.ppo.temperature == 1.0 and shipped.rl.max_staleness == 8 and shipped.ppo.objective == "decoupled"
