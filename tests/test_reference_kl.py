"""trainer/reference.py: the KL penalty against a frozen reference policy, end to end.

References are independent of packing: teacher-forced log-probs of one sequence per row with
the plain decoder `forward`, the k1/k2/k3 estimators and the KL-to-go written out in NumPy.
Run as a script, this file is one process of the 2-process test (see the end).
"""

import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from areal_jax.models import ModelConfig, forward, init_params
from areal_jax.ppo import AdvantageConfig, token_logprobs
from areal_jax.rollout.types import Trajectory, TrajectoryGroup
from areal_jax.trainer.batching import build_sequences, make_microbatches
from areal_jax.trainer.optimizer import OptimizerConfig, build_optimizer
from areal_jax.trainer.reference import ReferencePolicy, sequences_with_kl
from areal_jax.trainer.algorithm import PPOStep, ppo_trainer
from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
from tests.multiprocess import run_processes

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
BUDGET, BUCKETS = 32, (16, 32)
PPO = PPOConfig(num_minibatches=2, temperature=0.9)
ENGINE = TrainEngineConfig(max_tokens_per_microbatch=BUDGET)
OPT = OptimizerConfig(lr=1e-2)


@functools.cache
def weights():
    """(initial weights, reference weights = initial plus noise, so KL is clearly nonzero).

    Built on first use, not at import: the 2-process worker must start jax.distributed first.
    """
    init = jax.tree.map(np.asarray, init_params(CFG, jax.random.key(0), std=0.1))
    noise = init_params(CFG, jax.random.key(1), std=0.05)
    return init, jax.tree.map(lambda a, n: a + np.asarray(n), init, noise)


def random_groups(seed, n_groups=4, per_group=3):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        trajs = []
        for _ in range(per_group):
            p, c = int(rng.integers(2, 6)), int(rng.integers(1, 12))
            trajs.append(Trajectory(rng.integers(0, CFG.vocab_size, p), rng.integers(0, CFG.vocab_size, c),
                                    (-4.0 - 0.5 * rng.random(c)).astype(np.float32), np.zeros(c, np.int32),
                                    float(rng.choice([-5.0, 5.0]))))
        groups.append(TrajectoryGroup(f"q{g}", tuple(trajs), 0))
    return groups


def teacher_forced(params, groups):
    """[L_i] target log-probs per trajectory: one right-padded sequence per row, plain forward."""
    rows = [t.training_row() for g in groups for t in g.trajectories]
    width = max(len(r["input_ids"]) for r in rows)
    ids, targets = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])], targets[i, :len(r["targets"])] = r["input_ids"], r["targets"]
    logits, _ = forward(params, CFG, jnp.asarray(ids))  # causal: right padding is never attended
    logp = np.asarray(token_logprobs(logits, jnp.asarray(targets), PPO.logit_temperature), np.float64)
    return [logp[i, :len(r["input_ids"])] for i, r in enumerate(rows)], rows


def numpy_kl(logp, ref, estimator):
    d = logp - ref  # log p/q of the sampled token
    return {"k1": d, "k2": 0.5 * d * d, "k3": np.exp(-d) - 1.0 + d}[estimator]


def numpy_advantages(groups, estimator, kl_coef, norm):
    """Reward on every completion token minus kl_coef * the KL-to-go, then the norm."""
    init, ref_params = weights()
    logp, rows = teacher_forced(init, groups)
    ref, _ = teacher_forced(ref_params, groups)
    rewards = [t.reward for g in groups for t in g.trajectories]
    returns, kls = [], []
    for lp, rf, row, reward in zip(logp, ref, rows, rewards):
        mask = row["loss_mask"] > 0
        kl = np.where(mask, numpy_kl(lp, rf, estimator), 0.0)
        kls.append(kl[mask])
        to_go = np.array([kl[t:].sum() for t in range(len(kl))])
        returns.append(np.where(mask, reward - kl_coef * to_go, 0.0))
    if norm == "batch":
        valid = np.concatenate([r[row["loss_mask"] > 0] for r, row in zip(returns, rows)])
        mean, std = valid.mean(), valid.std()
        returns = [np.where(row["loss_mask"] > 0, (r - mean) / (std + 1e-5), 0.0) for r, row in zip(returns, rows)]
    return returns, logp, ref, float(np.concatenate(kls).mean())


def reset(trainer):
    """Back to the initial weights and a fresh optimizer state."""
    init = weights()[0]
    trainer.load_state_dict({"params": init, "opt_state": build_optimizer(OPT).init(init), "step": 0})
    return trainer


@pytest.fixture(scope="module")
def trainer():
    return ppo_trainer(CFG, weights()[0], OPT, PPO, engine=ENGINE)


@pytest.fixture
def fresh(trainer):
    return reset(trainer)


def test_kl_off_is_exactly_build_sequences(fresh):
    groups, cfg = random_groups(0), AdvantageConfig(norm="group")
    out = sequences_with_kl(groups, cfg, fresh, None)
    want = build_sequences(groups, cfg)
    assert out.kl_mean is None and out.logprobs is None
    assert len(out.sequences) == len(want)
    for got, ref in zip(out.sequences, want):
        assert got.keys() == ref.keys()
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k])
            assert got[k].dtype == ref[k].dtype


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_equal_to_policy_gives_zero_kl(fresh, estimator):
    groups = random_groups(1)
    reference = ReferencePolicy(fresh)  # a copy of the current weights
    cfg = AdvantageConfig(norm="batch", kl_coef=0.5, kl_estimator=estimator)
    out = sequences_with_kl(groups, cfg, fresh, reference, buckets=BUCKETS)
    assert out.kl_mean == 0.0 and out.kl_tokens == sum(len(t.completion_ids) for g in groups for t in g.trajectories)
    plain = build_sequences(groups, AdvantageConfig(norm="batch"))
    for got, want, lp, rf in zip(out.sequences, plain, out.logprobs, out.ref_logprobs):
        np.testing.assert_array_equal(lp, rf)
        np.testing.assert_array_equal(got["advantages"], want["advantages"])


def test_reference_reuses_the_compiled_logprob_program(fresh):
    reference = ReferencePolicy(fresh, weights()[1])
    seqs = build_sequences(random_groups(2), AdvantageConfig())
    [micro] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    fresh.compute_logprobs(micro[0])
    before = fresh.compile_counts["logprobs"]
    ref_out = reference.compute_logprobs(micro[0])
    assert fresh.compile_counts["logprobs"] == before
    assert jax.tree.map(lambda x: (x.dtype, x.sharding), reference.params) == \
        jax.tree.map(lambda x: (x.dtype, x.sharding), fresh.params)
    assert not np.allclose(np.asarray(ref_out), np.asarray(fresh.compute_logprobs(micro[0])), atol=1e-3)


@pytest.mark.parametrize("estimator,norm", [("k1", "none"), ("k2", "batch"), ("k3", "none")])
def test_perturbed_reference_matches_numpy(fresh, estimator, norm):
    groups, kl_coef = random_groups(3), 2.0
    reference = ReferencePolicy(fresh, weights()[1])
    out = sequences_with_kl(groups, AdvantageConfig(norm=norm, kl_coef=kl_coef, kl_estimator=estimator), fresh,
                            reference, buckets=BUCKETS)
    want_adv, want_logp, want_ref, want_kl = numpy_advantages(groups, estimator, kl_coef, norm)
    assert abs(want_kl) > 1e-3  # the penalty is visible...
    plain = build_sequences(groups, AdvantageConfig(norm=norm))
    assert max(np.abs(s["advantages"] - p["advantages"]).max() for s, p in zip(out.sequences, plain)) > 1e-2
    for seq, lp, rf, w_adv, w_lp, w_rf in zip(out.sequences, out.logprobs, out.ref_logprobs, want_adv, want_logp,
                                               want_ref):
        mask = seq["loss_mask"] > 0
        np.testing.assert_allclose(lp[mask], w_lp[mask], atol=2e-5)
        np.testing.assert_allclose(rf[mask], w_rf[mask], atol=2e-5)
        np.testing.assert_allclose(seq["advantages"], w_adv, atol=2e-4)  # ...and matches
        np.testing.assert_array_equal(seq["advantages"][~mask], 0.0)
        np.testing.assert_array_equal(seq["proximal_logprobs"], np.where(mask, lp, 0.0).astype(np.float32))
    assert out.kl_mean == pytest.approx(want_kl, abs=1e-5)
    assert out.kl_sum == pytest.approx(out.kl_mean * out.kl_tokens)


def test_train_step_on_kl_sequences_with_reused_proximal(trainer):
    groups, cfg = random_groups(4, n_groups=6), AdvantageConfig(norm="group", kl_coef=0.3, kl_estimator="k3")
    results = []
    for attach in (True, False):
        reset(trainer)
        frozen_copy = ReferencePolicy(trainer)  # default: the weights now (initial); train_step donates the trainer's
        out = sequences_with_kl(groups, cfg, trainer, ReferencePolicy(trainer, weights()[1]), buckets=BUCKETS,
                                attach_proximal=attach)
        assert ("proximal_logprobs" in out.sequences[0]) == attach
        minibatches = make_microbatches(out.sequences, max_tokens_per_microbatch=BUDGET,
                                        num_minibatches=PPO.num_minibatches, buckets=(BUDGET,))  # one grad shape
        metrics = PPOStep(trainer, cfg, PPO).train(minibatches, 0)
        assert np.isfinite(metrics["loss"]) and metrics["skipped_updates"] == 0 and metrics["grad_norm"] > 0
        assert trainer.last_minibatch_metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # pi_theta == pi_prox
        results.append((metrics, jax.tree.map(np.asarray, trainer.params)))
        for x, y in zip(jax.tree.leaves(frozen_copy.params), jax.tree.leaves(weights()[0])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # the copy survived the donation
    (m_reused, p_reused), (m_recomputed, p_recomputed) = results
    assert m_reused["loss"] == pytest.approx(m_recomputed["loss"], abs=1e-6)
    for x, y in zip(jax.tree.leaves(p_reused), jax.tree.leaves(p_recomputed)):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_on_a_train_mesh_equals_single_device(fresh):
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    sharded = ppo_trainer(CFG, weights()[0], OPT, PPO, engine=ENGINE, mesh=mesh)
    reference = ReferencePolicy(sharded, weights()[1])
    assert jax.tree.map(lambda x: x.sharding, reference.params) == jax.tree.map(lambda x: x.sharding, sharded.params)
    groups, cfg = random_groups(5), AdvantageConfig(norm="batch", kl_coef=1.0, kl_estimator="k1")
    got = sequences_with_kl(groups, cfg, sharded, reference, row_multiple=4, buckets=BUCKETS)
    want = sequences_with_kl(groups, cfg, fresh, ReferencePolicy(fresh, weights()[1]), buckets=BUCKETS)
    assert got.kl_mean == pytest.approx(want.kl_mean, abs=1e-6)
    for a, b in zip(got.sequences, want.sequences):
        np.testing.assert_allclose(a["advantages"], b["advantages"], atol=1e-5)
    with pytest.raises(ValueError, match="another JaxTrainEngine"):
        sequences_with_kl(groups, cfg, fresh, reference)


def test_rejects_missing_reference_and_bad_shapes(fresh):
    groups, cfg = random_groups(6), AdvantageConfig(kl_coef=0.1)
    with pytest.raises(TypeError, match="ReferencePolicy"):
        sequences_with_kl(groups, cfg, fresh, None)
    with pytest.raises(ValueError, match="kl_coef"):
        build_sequences(groups, cfg)
    with pytest.raises(ValueError, match="shape"):
        ReferencePolicy(fresh, jax.tree.map(lambda x: np.zeros((1, *np.shape(x)[1:])), weights()[0]))


# ---- two processes ----------------------------------------------------------------------------------

MP_GROUPS = {0: (10, 4), 1: (11, 2)}  # process -> (seed, groups): unequal, so padding micro-batches run
MP_CFG = AdvantageConfig(norm="none", kl_coef=2.0, kl_estimator="k3")


@pytest.mark.slow  # about 60 s: two JAX processes compile and run the programs
def test_two_processes_match_numpy(tmp_path):
    """2 processes x 4 CPU devices, train mesh over all 8 with the processes' devices interleaved
    on "fsdp" (so each process's rows are non-contiguous in the global micro-batch)."""
    results = run_processes(__file__, lambda i: (tmp_path,), tmp_path)
    for i, result in enumerate(results):
        seed, n_groups = MP_GROUPS[i]
        want_adv, _, _, want_kl = numpy_advantages(random_groups(seed, n_groups), MP_CFG.kl_estimator,
                                                   MP_CFG.kl_coef, MP_CFG.norm)
        assert len(result["advantages"]) == len(want_adv)
        for got, want in zip(result["advantages"], want_adv):
            np.testing.assert_allclose(np.asarray(got), want, atol=2e-4)
        assert result["kl_mean"] == pytest.approx(want_kl, abs=1e-5)
        assert np.isfinite(result["loss"])
    assert results[0]["loss"] == results[1]["loss"]  # one global step, seen alike by both
    assert results[0]["num_microbatches"] == results[1]["num_microbatches"]


def _worker(port: str, process_id: int, out_dir: str) -> None:
    """One process of test_two_processes_match_numpy."""
    from jax.sharding import Mesh

    from areal_jax.parallel import agree_max, agree_sum, initialize_distributed

    assert initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    init, ref = weights()
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(2)]
    devices = [d for pair in zip(*by_process) for d in pair]  # p0, p1, p0, p1, ...
    mesh = Mesh(np.array(devices).reshape(8, 1), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    trainer = ppo_trainer(CFG, init, OPT, PPO, engine=ENGINE, mesh=mesh)
    seed, n_groups = MP_GROUPS[process_id]
    out = sequences_with_kl(random_groups(seed, n_groups), MP_CFG, trainer, ReferencePolicy(trainer, ref),
                            row_multiple=4, buckets=BUCKETS, agree_max=agree_max)
    minibatches = make_microbatches(out.sequences, max_tokens_per_microbatch=BUDGET, num_minibatches=1,
                                    buckets=(BUDGET,), row_multiple=4, agree_max=agree_max, agree_sum=agree_sum)
    metrics = trainer.train_step(minibatches)
    result = {"advantages": [s["advantages"].tolist() for s in out.sequences], "kl_mean": out.kl_mean,
              "loss": metrics["loss"], "num_microbatches": metrics["num_microbatches"]}
    pathlib.Path(out_dir, f"result_{process_id}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), sys.argv[3])
