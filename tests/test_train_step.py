"""trainer/train_step.py + optimizer.py: the jitted training step (here of decoupled PPO's objective,
trainer/algorithm.py) on a tiny random model.

References are independent of packing: one sequence per row of a right-padded batch, the
plain decoder `forward`, and `decoupled_ppo_loss` over the whole minibatch.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec

from areal_jax.models import ModelConfig, forward, init_params
from areal_jax.packing import unpack
from areal_jax.ppo import AdvantageConfig, decoupled_ppo_loss, token_logprobs
from areal_jax.rollout.types import Trajectory, TrajectoryGroup
from areal_jax.trainer.batching import build_sequences, make_microbatches
from areal_jax.trainer.algorithm import PPOStep, attach_proximal, ppo_trainer
from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
from areal_jax.trainer.optimizer import OptimizerConfig, build_optimizer, learning_rate_schedule

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
BUDGET, BUCKETS = 32, (16, 32)
PPO = PPOConfig(eps_clip=0.2, behav_imp_weight_cap=3.0, num_minibatches=1)
ENGINE = TrainEngineConfig(max_tokens_per_microbatch=BUDGET)
OPT = OptimizerConfig(lr=1e-2)
INIT = init_params(CFG, jax.random.key(0), std=0.1)


def random_seqs(seed, n_groups=4, per_group=3, proximal=False):
    """Sequences with random tokens, behavior log-probs, versions and advantages."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        trajs = []
        for _ in range(per_group):
            p, c = int(rng.integers(2, 6)), int(rng.integers(1, 10))
            trajs.append(Trajectory(rng.integers(0, CFG.vocab_size, p), rng.integers(0, CFG.vocab_size, c),
                                    (-4.0 - 2.0 * rng.random(c)).astype(np.float32), rng.integers(3, 6, c),
                                    float(rng.choice([-5.0, 5.0]))))
        groups.append(TrajectoryGroup(f"q{g}", tuple(trajs), 0))
    seqs = build_sequences(groups, AdvantageConfig(norm="none"))
    for s in seqs:
        s["advantages"] = (rng.normal(size=s["loss_mask"].shape) * s["loss_mask"]).astype(np.float32)
        if proximal:  # near the model's own log-probs (about -log 64), so some tokens clip
            s["proximal_logprobs"] = (-4.2 + 0.4 * rng.normal(size=s["loss_mask"].shape)).astype(np.float32)
    return seqs


def padded(seqs):
    """One sequence per row, right-padded: `[N, L_max]` per key."""
    n, width = len(seqs), max(len(s["input_ids"]) for s in seqs)
    out = {k: np.zeros((n, width), np.asarray(v).dtype) for k, v in seqs[0].items()}
    for i, s in enumerate(seqs):
        for k, v in s.items():
            out[k][i, :len(v)] = v
    return out


def reference_loss_and_grads(params, seqs, ppo):
    batch = {k: jnp.asarray(v) for k, v in padded(seqs).items()}

    def loss_fn(p):
        logits, _ = forward(p, CFG, batch["input_ids"])  # causal: right padding is never attended
        logp = token_logprobs(logits, batch["targets"], ppo.logit_temperature)
        loss, _ = decoupled_ppo_loss(logp, batch["proximal_logprobs"], batch["behavior_logprobs"],
                                     batch["advantages"], batch["loss_mask"], eps_clip=ppo.eps_clip,
                                     behav_imp_weight_cap=ppo.behav_imp_weight_cap, c_clip=ppo.c_clip,
                                     behav_imp_weight_mode=ppo.behav_imp_weight_mode,
                                     importance_sampling_level=ppo.importance_sampling_level)
        return loss

    return jax.value_and_grad(loss_fn)(params)


def teacher_forced_logprobs(params, seqs):
    batch = padded(seqs)
    logits, _ = forward(params, CFG, jnp.asarray(batch["input_ids"]))
    logp = np.asarray(token_logprobs(logits, jnp.asarray(batch["targets"])))
    return [logp[i, :len(s["input_ids"])] for i, s in enumerate(seqs)]


def recomputed(trainer, minibatches):
    """`minibatches` with pi_prox = the trainer's current log-probs on every micro-batch (what the
    algorithm attaches before a step of several updates)."""
    return [[m.with_arrays(proximal_logprobs=trainer.compute_logprobs(m)) for m in mb] for mb in minibatches]


def snapshot(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def assert_trees_close(a, b, atol):
    for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0, err_msg=str(path))


@pytest.fixture(scope="module")
def trainer():
    """One fp32 decoupled trainer for the module (compiles once); tests reset it to INIT."""
    return ppo_trainer(CFG, INIT, OPT, PPO, engine=ENGINE)


@pytest.fixture
def fresh(trainer):
    trainer.load_state_dict({"params": INIT, "opt_state": build_optimizer(OPT).init(INIT), "step": 0})
    return trainer


# ---- loss and gradients ----------------------------------------------------------------------------


def test_packed_microbatches_equal_one_sequence_per_row(fresh):
    seqs = random_seqs(0, proximal=True)
    [microbatches] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    assert len(microbatches) >= 2 and any(len(row) >= 2 for m in microbatches for row in m.rows)
    grads, stats = fresh.minibatch_gradients(microbatches)
    ref_loss, ref_grads = reference_loss_and_grads(INIT, seqs, PPO)
    assert 0 < stats["clip_frac"] < stats["n_valid"]  # the clipped branch is exercised (summed indicators)
    assert stats["capped_frac"] > 0
    np.testing.assert_allclose(float(stats["loss"]), float(ref_loss), atol=1e-5)
    assert_trees_close(grads, ref_grads, atol=1e-5)


def test_padding_microbatches_contribute_nothing(fresh):
    seqs = random_seqs(1, proximal=True)
    [plain] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    extra = []

    def peer_with_more_bins(n):
        """A peer with two bins of 16-token rows more: this process proposes row length 0 once it
        is done (make_microbatches agrees each bin's row length, then its rows)."""
        if n == 0 and len(extra) < 2:
            extra.append(n)
            return BUCKETS[0]
        return n

    [with_pad] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS,
                                   agree_max=peer_with_more_bins)
    assert len(with_pad) == len(plain) + 2
    g_plain, s_plain = fresh.minibatch_gradients(plain)
    g_pad, s_pad = fresh.minibatch_gradients(with_pad)
    assert_trees_close(g_pad, g_plain, atol=1e-7)
    assert float(s_pad["loss"]) == pytest.approx(float(s_plain["loss"]), abs=1e-7)
    assert float(s_pad["n_valid"]) == float(s_plain["n_valid"])


def test_chunked_logits_equal_the_dense_programs(fresh):
    # 5-token chunks: every micro-batch (up to 32 tokens) takes its log-probs chunk by chunk,
    # with padding of the last chunk; values and gradients must be the dense programs'.
    chunked = ppo_trainer(CFG, INIT, OPT, PPO, engine=dataclasses.replace(ENGINE, logit_chunk_tokens=5))
    seqs = random_seqs(13, proximal=True)
    [microbatches] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    assert all(np.prod(m.shape) > 5 for m in microbatches)
    grads, stats = chunked.minibatch_gradients(microbatches)
    ref_loss, ref_grads = reference_loss_and_grads(INIT, seqs, PPO)
    np.testing.assert_allclose(float(stats["loss"]), float(ref_loss), atol=1e-5)
    assert_trees_close(grads, ref_grads, atol=1e-5)
    _, dense_stats = fresh.minibatch_gradients(microbatches)
    assert float(stats["entropy_sum"]) == pytest.approx(float(dense_stats["entropy_sum"]), rel=1e-5)
    for micro in microbatches:
        np.testing.assert_allclose(np.asarray(chunked.compute_logprobs(micro)),
                                   np.asarray(fresh.compute_logprobs(micro)), atol=1e-5)


# ---- proximal log-probs -----------------------------------------------------------------------------


def test_proximal_logprobs_equal_teacher_forced_logprobs(fresh):
    seqs = random_seqs(2)
    [microbatches] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    expected = teacher_forced_logprobs(INIT, seqs)
    for micro in recomputed(fresh, [microbatches])[0]:
        local = micro.sequence_indices
        position = {i: j for j, i in enumerate(local)}
        rows = [[position[i] for i in row] for row in micro.rows]
        arrays = {"segment_ids": micro.arrays["segment_ids"], "prox": np.asarray(micro.arrays["proximal_logprobs"])}
        for i, got in zip(local, unpack(arrays, rows, ["prox"])):
            np.testing.assert_allclose(got["prox"], expected[i], atol=1e-5)


def test_proximal_logprobs_stay_fixed_across_minibatches(fresh):
    seqs = random_seqs(3)
    minibatches = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=2, buckets=BUCKETS)
    # Behavior := pre-step log-probs, so w = pi_prox / pi_behav is exactly 1 iff proximal is pre-step.
    pre = attach_proximal(fresh, minibatches, dataclasses.replace(PPO, num_minibatches=2), version=0)
    assert all("proximal_logprobs" in m.arrays for mb in pre for m in mb)
    minibatches = [[m.with_arrays(behavior_logprobs=np.asarray(m.arrays["proximal_logprobs"])) for m in mb]
                   for mb in pre]
    metrics = fresh.train_step(minibatches)
    first, second = fresh.last_minibatch_metrics
    assert metrics["skipped_updates"] == 0
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # nothing updated yet
    assert second["imp_weight_mean"] == pytest.approx(1.0, abs=1e-6)  # still the pre-step proximal...
    assert abs(second["ratio_mean"] - 1.0) > 1e-3  # ...while the weights moved after minibatch 1
    post = fresh.compute_logprobs(minibatches[1][0])
    mask = minibatches[1][0].arrays["loss_mask"] > 0
    assert np.max(np.abs(np.asarray(post) - np.asarray(pre[1][0].arrays["proximal_logprobs"]))[mask]) > 1e-3


def test_one_update_per_step_takes_the_proximal_from_the_loss_forward(fresh):
    # With one minibatch the pre-step weights are the differentiated weights: the step skips the
    # proximal forward and must update exactly as the explicit proximal path does.
    explicit = ppo_trainer(CFG, INIT, OPT, PPO, engine=ENGINE)
    [mb] = make_microbatches(random_seqs(12), max_tokens_per_microbatch=BUDGET, num_minibatches=1,
                             buckets=BUCKETS)
    m_self = fresh.train_step([mb])
    m_explicit = explicit.train_step(recomputed(explicit, [mb]))
    assert explicit.compile_counts["logprobs"] >= 1
    for key in ("loss", "grad_norm", "imp_weight_mean", "imp_weight_max", "capped_frac", "clip_frac", "ratio_mean"):
        assert m_self[key] == pytest.approx(m_explicit[key], rel=1e-5, abs=1e-6), key
    assert m_self["ratio_mean"] == 1.0 and m_self["clip_frac"] == 0.0
    assert_trees_close(fresh.params, explicit.params, atol=1e-5)  # Adam's sign-like first step


@pytest.mark.parametrize("options", [
    dict(c_clip=1.5, behav_imp_weight_mode="clamp"),
    dict(importance_sampling_level="sequence", c_clip=2.0),
    dict(behav_imp_weight_cap=None, behav_imp_weight_mode="disabled"),  # the naive_recompute objective
])
def test_loss_options_on_packed_rows_equal_one_sequence_per_row(options):
    # GSPO's sequences are the packed segments: the packed step equals one sequence per row.
    ppo = dataclasses.replace(PPO, **options)
    trainer = ppo_trainer(CFG, INIT, OPT, ppo, engine=ENGINE)
    seqs = random_seqs(8, proximal=True)
    [mb] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    assert any(len(row) > 1 for m in mb for row in m.rows)  # some rows hold several sequences
    grads, stats = trainer.minibatch_gradients(mb)
    ref_loss, ref_grads = reference_loss_and_grads(INIT, seqs, ppo)
    assert float(stats["loss"]) == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-7)
    assert_trees_close(grads, ref_grads, atol=1e-6)


def test_loglinear_proximal_skips_the_forward_and_matches_its_reference():
    # A-3PO: pi_prox = pi_behav + alpha(version) * (pi_theta - pi_behav) with pi_theta the current
    # weights' (constant) log-probs; versions 3..5 at current version 6 give alpha 2/3, 1/2, 0.
    ppo = dataclasses.replace(PPO, num_minibatches=2, prox_logp_method="loglinear")
    trainer = ppo_trainer(CFG, INIT, OPT, ppo, engine=ENGINE)
    seqs = random_seqs(9)
    minibatches = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=2, buckets=BUCKETS)
    with_alpha = attach_proximal(trainer, minibatches, ppo, version=6)
    assert all("proximal_alpha" in m.arrays and "proximal_logprobs" not in m.arrays for mb in with_alpha for m in mb)
    first = [i for m in minibatches[0] for i in m.sequence_indices]
    current = teacher_forced_logprobs(INIT, [seqs[i] for i in first])
    ref_seqs = []
    for i, logp in zip(first, current):
        s = dict(seqs[i])
        alpha = np.where(s["versions"] >= 0, np.clip((6 - 1 - s["versions"]) / np.maximum(6 - s["versions"], 1), 0, 1),
                         0.0)
        assert set(np.round(alpha[s["loss_mask"] > 0], 6)) <= {0.0, 0.5, round(2 / 3, 6)}
        s["proximal_logprobs"] = (s["behavior_logprobs"] + alpha * (logp - s["behavior_logprobs"])).astype(np.float32)
        ref_seqs.append(s)
    grads, stats = trainer.minibatch_gradients(with_alpha[0])
    ref_loss, ref_grads = reference_loss_and_grads(INIT, ref_seqs, ppo)
    assert float(stats["loss"]) == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-7)
    assert_trees_close(grads, ref_grads, atol=1e-6)
    metrics = PPOStep(trainer, AdvantageConfig(), ppo).train(minibatches, 6)
    assert trainer.compile_counts["logprobs"] == 0 and metrics["skipped_updates"] == 0


# ---- updates ------------------------------------------------------------------------------------------


def _on_policy(trainer, seed):
    """Minibatches whose behavior log-probs are the current model's (proximal = behavior = current)."""
    [mb] = make_microbatches(random_seqs(seed), max_tokens_per_microbatch=BUDGET, num_minibatches=1,
                             buckets=BUCKETS)
    return [[m.with_arrays(behavior_logprobs=np.asarray(trainer.compute_logprobs(m))) for m in mb]]


def test_positive_advantages_raise_logprobs(fresh):
    minibatches = _on_policy(fresh, 4)
    minibatches = [[m.with_arrays(advantages=np.abs(m.arrays["advantages"]) * m.arrays["loss_mask"]) for m in mb]
                   for mb in minibatches]
    before = [np.asarray(fresh.compute_logprobs(m)) for m in minibatches[0]]
    fresh.train_step(minibatches)
    for m, old in zip(minibatches[0], before):
        new = np.asarray(fresh.compute_logprobs(m))
        mask = m.arrays["loss_mask"] > 0
        # Summed over the trained tokens the log-likelihood goes up (a single token may not).
        assert (new[mask] - old[mask]).sum() > 0.1


def test_naive_ppo_equals_decoupled_when_behavior_is_proximal(fresh):
    # Naive also runs with full remat: recomputing activations must not change the numbers.
    naive = ppo_trainer(CFG, INIT, OPT, dataclasses.replace(PPO, objective="naive"),
                        engine=dataclasses.replace(ENGINE, remat="full"))
    minibatches = _on_policy(fresh, 5)
    dec_mb, naive_mb = recomputed(fresh, minibatches)[0], minibatches[0]
    for d, n in zip(dec_mb, naive_mb):  # decoupled recomputes exactly what naive takes from behavior
        np.testing.assert_array_equal(np.asarray(d.arrays["proximal_logprobs"]), n.arrays["behavior_logprobs"])
    g_dec, s_dec = fresh.minibatch_gradients(dec_mb)
    g_naive, s_naive = naive.minibatch_gradients(naive_mb)
    assert float(s_naive["loss"]) == pytest.approx(float(s_dec["loss"]), abs=1e-7)
    assert_trees_close(g_naive, g_dec, atol=1e-7)
    fresh.train_step(minibatches)
    naive.train_step(minibatches)
    assert naive.compile_counts["logprobs"] == 0  # naive PPO never recomputes log-probs
    # Adam's first step is about lr * sign(g): tiny gradient entries amplify rounding, hence 1e-5.
    assert_trees_close(naive.params, fresh.params, atol=1e-5)


def test_nonfinite_gradient_skips_the_update(fresh):
    [mb] = make_microbatches(random_seqs(6), max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    adv = np.array(mb[0].arrays["advantages"])
    adv[np.nonzero(mb[0].arrays["loss_mask"])[0][0], np.nonzero(mb[0].arrays["loss_mask"])[1][0]] = np.inf
    poisoned = [[mb[0].with_arrays(advantages=adv), *mb[1:]]]
    params, opt_state = snapshot(fresh.params), snapshot(fresh.opt_state)
    metrics = fresh.train_step(poisoned)
    assert metrics["skipped_updates"] == 1 and metrics["trained_tokens"] == 0
    assert not np.isfinite(metrics["grad_norm"])
    assert fresh.num_updates == 0 and fresh.step == 1
    assert_trees_close(fresh.params, params, atol=0)
    assert_trees_close(fresh.opt_state, opt_state, atol=0)
    # The trainer is not poisoned: the clean batch trains normally.
    metrics = fresh.train_step([mb])
    assert metrics["skipped_updates"] == 0 and fresh.num_updates == 1
    assert metrics["trained_tokens"] == sum(m.num_valid_tokens for m in mb)
    assert np.abs(np.asarray(fresh.params["embed"]) - params["embed"]).max() > 0


def test_metrics_version_lag_and_compilation_bound(fresh):
    minibatches = make_microbatches(random_seqs(7), max_tokens_per_microbatch=BUDGET, num_minibatches=2,
                                    buckets=BUCKETS)
    metrics = PPOStep(fresh, AdvantageConfig(), dataclasses.replace(PPO, num_minibatches=2)).train(minibatches, 6)
    versions = np.concatenate([m.arrays["versions"][m.arrays["loss_mask"] > 0] for mb in minibatches for m in mb])
    lags, counts = np.unique(6 - versions, return_counts=True)
    assert metrics["version_lag_hist"] == dict(zip(lags.tolist(), counts.tolist()))
    assert 0 <= metrics["weight_top1pct_grad_share"] <= 1 and "weight_hist_tokens" not in metrics
    assert metrics["trained_tokens"] == len(versions) == metrics["n_valid_tokens"]
    assert metrics["lr"] == pytest.approx(OPT.lr) and metrics["num_minibatches"] == 2
    assert 0 < metrics["entropy"] <= np.log(CFG.vocab_size) + 1e-5
    for key in ("loss", "grad_norm", "clip_frac", "imp_weight_mean", "imp_weight_max", "capped_frac",
                "approx_kl", "time_step_s"):
        assert np.isfinite(metrics[key]), key
    # One program per bucket shape and batch key set (this module's direct calls: pi_prox given, or
    # the loss's own for one update per step; PPOStep's: pi_prox and the lag-0 marks), one update
    # program, however many steps ran in this module.
    assert fresh.compile_counts["grad"] <= 3 * len(BUCKETS)
    assert fresh.compile_counts["logprobs"] <= len(BUCKETS)
    assert fresh.compile_counts["update"] == 1


def test_state_dict_round_trip(fresh):
    mb1 = make_microbatches(random_seqs(8), max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    mb2 = make_microbatches(random_seqs(9), max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    fresh.train_step(mb1)
    saved = snapshot(fresh.state_dict())
    fresh.train_step(mb2)
    after_two = snapshot(fresh.params)
    fresh.load_state_dict(saved)
    assert fresh.step == 1 and fresh.num_updates == 1
    fresh.train_step(mb2)
    assert_trees_close(fresh.params, after_two, atol=0)


# ---- numerics and sharding ------------------------------------------------------------------------------


def test_bf16_compute_keeps_fp32_master_state(fresh):
    seqs = random_seqs(10, proximal=True)
    [mb] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=(32,))
    bf16 = ppo_trainer(CFG, jax.tree.map(lambda x: x.astype(jnp.bfloat16), INIT), OPT, PPO,
                       engine=dataclasses.replace(ENGINE, compute_dtype="bfloat16"))
    _, stats32 = fresh.minibatch_gradients(mb)
    grads16, stats16 = bf16.minibatch_gradients(mb)
    assert float(stats16["loss"]) == pytest.approx(float(stats32["loss"]), abs=2e-2)
    bf16.train_step([mb])
    for tree in (bf16.params, bf16.opt_state, grads16):
        floats = [x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert floats and all(d == jnp.float32 for d in floats)


def test_sharded_step_matches_single_device(fresh):
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    sharded = ppo_trainer(CFG, INIT, OPT, PPO, engine=ENGINE, mesh=mesh)
    assert sharded.params["layers"]["wq"].sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    # One bucket: R = 2 rows of 32 (rows split over fsdp), so the mesh compiles one program of each kind.
    minibatches = make_microbatches(random_seqs(11), max_tokens_per_microbatch=BUDGET, num_minibatches=2,
                                    buckets=(32,), row_multiple=2)
    assert {m.shape for mb in minibatches for m in mb} == {(2, 32)}
    m_one = fresh.train_step(minibatches)
    m_mesh = sharded.train_step(minibatches)
    # Every micro-batch has one shape: the first accumulator is placed like later ones, so the
    # grad program compiles once (an unplaced one compiled it twice).
    assert sharded.compile_counts["grad"] == 1
    assert m_mesh["loss"] == pytest.approx(m_one["loss"], abs=1e-6)
    assert m_mesh["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-5)
    # Adam divides by sqrt(v): on entries whose gradient is near rounding level the two
    # reduction orders give visibly different updates (measured up to 3.4e-5 after two updates
    # at lr 1e-2), so the weights are compared at 1% of one update's size.
    assert_trees_close(sharded.params, fresh.params, atol=1e-2 * OPT.lr)
    assert sharded.opt_state[1][0].mu["layers"]["wq"].sharding.spec == PartitionSpec(None, "fsdp", "tensor")


# ---- optimizer -----------------------------------------------------------------------------------------------


def test_schedules_match_closed_forms():
    lr, w, total = 1e-3, 4, 24
    cos = learning_rate_schedule(OptimizerConfig(lr=lr, warmup_steps=w, schedule="cosine", total_steps=total,
                                                 min_lr_ratio=0.1))
    lin = learning_rate_schedule(OptimizerConfig(lr=lr, warmup_steps=w, schedule="linear", total_steps=total))
    const = learning_rate_schedule(OptimizerConfig(lr=lr, warmup_steps=w))
    for s in range(30):
        if s < w:
            warm = lr * (s + 1) / w
            assert float(cos(s)) == pytest.approx(warm) and float(lin(s)) == pytest.approx(warm)
            continue
        p = min((s - w) / (total - w), 1.0)
        assert float(cos(s)) == pytest.approx(lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * p))), rel=1e-5)
        assert float(lin(s)) == pytest.approx(lr * (1 - p), rel=1e-5, abs=1e-12)
        assert float(const(s)) == pytest.approx(lr)


def test_adamw_first_step_is_lr_times_sign_plus_decay():
    cfg = OptimizerConfig(lr=0.1, weight_decay=0.5, max_grad_norm=1e-3)  # clipping rescales, signs stay
    opt = build_optimizer(cfg)
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    grads = {"w": jnp.array([4.0, -0.5, 0.0])}
    updates, _ = opt.update(grads, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * (np.sign([4.0, -0.5, 0.0]) + 0.5 * np.array([1.0, -2.0, 3.0])),
                               rtol=1e-4)
    clipped, _ = optax.clip_by_global_norm(1e-3).update(grads, None)
    assert float(optax.tree.norm(clipped)) == pytest.approx(1e-3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=0.0), "lr"), (dict(schedule="cosine"), "total_steps"), (dict(schedule="step"), "schedule"),
    (dict(warmup_steps=5, total_steps=5, schedule="linear"), "total_steps"), (dict(min_lr_ratio=2.0), "min_lr"),
    (dict(max_grad_norm=0.0), "max_grad_norm"), (dict(b2=1.0), "b2"), (dict(warmup_steps=-1), "warmup")])
def test_optimizer_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(eps_clip=1.5), "eps_clip"), (dict(num_minibatches=0), "num_minibatches"),
    (dict(temperature=0.0), "temperature"), (dict(behav_imp_weight_cap=-1.0), "cap"),
    (dict(c_clip=1.0), "c_clip"), (dict(behav_imp_weight_mode="truncate"), "behav_imp_weight_mode"),
    (dict(importance_sampling_level="group"), "importance_sampling_level"),
    (dict(prox_logp_method="linear"), "prox_logp_method"),
    (dict(prox_logp_method="loglinear", objective="naive"), "objective 'naive' has none"),
    (dict(objective="naive_ppo"), "not a built-in objective"),
    (dict(minibatch_seed=-1), "minibatch_seed"),
    (dict(behav_imp_weight_mode="disabled", behav_imp_weight_cap=2.0), "behav_imp_weight_cap must be None")])
def test_ppo_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(compute_dtype="float16"), "compute_dtype"), (dict(remat="x"), "remat"),
    (dict(row_buckets=(0, 4096)), "row_buckets"),
    (dict(row_buckets=(96, 8192)), "max_tokens_per_microbatch .* smaller than the longest of TrainEngineConfig.row_buckets"),
    (dict(logit_chunk_tokens=0), "logit_chunk_tokens"), (dict(logit_chunk_tokens=2.0), "logit_chunk_tokens"),
    (dict(max_tokens_per_microbatch=0), "max_tokens_per_microbatch"), (dict(skip_nonfinite=1), "skip_nonfinite")])
def test_engine_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=rf"TrainEngineConfig\.{match}"):
        TrainEngineConfig(**kwargs)


def test_a_user_objective_trains_and_reports_its_metrics(fresh):
    """PPOConfig.objective = "module:function": the engine compiles that function, masks and
    normalises its per-token loss (the gradient is REINFORCE's over the minibatch's valid tokens)
    and reports its metric's token mean."""
    from tests.test_ppo_objectives import user_loss

    trainer = ppo_trainer(CFG, INIT, OPT, dataclasses.replace(PPO, objective="tests.test_ppo_objectives:user_loss"),
                          engine=ENGINE)
    seqs = random_seqs(14)
    [mb] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    grads, stats = trainer.minibatch_gradients(mb)
    batch = {k: jnp.asarray(v) for k, v in padded(seqs).items()}

    def reference(p):
        logits, _ = forward(p, CFG, batch["input_ids"])
        per_token, _ = user_loss(token_logprobs(logits, batch["targets"]), batch, None)
        return jnp.sum(jnp.where(batch["loss_mask"] > 0, per_token, 0.0)) / jnp.sum(batch["loss_mask"])

    ref_loss, ref_grads = jax.value_and_grad(reference)(INIT)
    assert float(stats["loss"]) == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-7)
    assert_trees_close(grads, ref_grads, atol=1e-6)
    metrics = trainer.train_step([mb])
    mask = batch["loss_mask"] > 0
    assert metrics["advantage_mean"] == pytest.approx(float(batch["advantages"][mask].mean()), rel=1e-5)
    assert "clip_frac" not in metrics  # nothing of PPO's


def test_the_engines_old_name_still_resolves_with_a_warning():
    import areal_jax.trainer as trainer_pkg
    from areal_jax.trainer import train_step

    for module in (train_step, trainer_pkg):
        with pytest.warns(DeprecationWarning, match="JaxTrainEngine"):
            assert module.PolicyTrainer is train_step.JaxTrainEngine
