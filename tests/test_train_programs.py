"""trainer/programs.py: the training step's programs, described ahead of time as ProgramSpecs.

A spec must describe what the run executes: it lowers and compiles without real arrays, its
compiled program accepts the arrays JaxTrainEngine places and computes what the trainer
computes, and the specs cover every micro-batch shape make_microbatches can produce.
"""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from areal_jax.aot import bytes_per_device
from areal_jax.models import ModelConfig, init_params
from areal_jax.packing import pack_sequences
from areal_jax.trainer.batching import PackedBatch, make_microbatches
from areal_jax.trainer.optimizer import OptimizerConfig
from areal_jax.trainer.programs import (
    FORWARD_KEYS,
    LOSS_KEYS,
    PROXIMAL_KEY,
    possible_microbatch_shapes,
    train_program_specs,
)
from areal_jax.trainer.algorithm import ppo_objective, ppo_trainer, proximal_keys
from areal_jax.trainer.config import PPOConfig, TrainEngineConfig

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
BUDGET, BUCKETS = 64, (16, 32, 64)
# Two minibatches: the grad program takes proximal log-probs. Chunks of 24 tokens: the larger
# micro-batches take the chunked path, as a real vocabulary would.
PPO = PPOConfig(num_minibatches=2, behav_imp_weight_cap=4.0)
ENGINE = TrainEngineConfig(max_tokens_per_microbatch=BUDGET, row_buckets=BUCKETS, logit_chunk_tokens=24)
OPT = OptimizerConfig(lr=1e-2)
INIT = init_params(CFG, jax.random.key(0), std=0.1)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])


@pytest.fixture(scope="module")
def specs(mesh):
    return {s.name: s for s in train_program_specs(CFG, ENGINE, ppo_objective(PPO), OPT, mesh,
                                                   extra_keys=proximal_keys(PPO))}


@pytest.fixture(scope="module")
def trainer(mesh):
    return ppo_trainer(CFG, INIT, OPT, PPO, engine=ENGINE, mesh=mesh)


def random_microbatch(shape, seed) -> PackedBatch:
    """A full micro-batch of `shape` = (R, T): every row two sequences, the second ending early."""
    R, T = shape
    rng = np.random.default_rng(seed)
    seqs, groups = [], []
    for r in range(R):
        first = int(rng.integers(1, T - 1))
        lengths = (first, int(rng.integers(1, T - first + 1)))
        groups.append([len(seqs), len(seqs) + 1])
        for n in lengths:
            mask = (rng.random(n) < 0.7).astype(np.float32)
            seqs.append({"input_ids": rng.integers(0, CFG.vocab_size, n).astype(np.int32),
                         "targets": rng.integers(0, CFG.vocab_size, n).astype(np.int32),
                         "loss_mask": mask,
                         "behavior_logprobs": (-4.6 + 0.3 * rng.normal(size=n)).astype(np.float32) * mask,
                         "advantages": rng.normal(size=n).astype(np.float32) * mask,
                         "versions": np.where(mask > 0, 3, -1).astype(np.int32),
                         PROXIMAL_KEY: (-4.6 + 0.3 * rng.normal(size=n)).astype(np.float32) * mask})
    arrays = pack_sequences(seqs, groups, T)
    return PackedBatch(arrays, (), int(arrays["loss_mask"].sum()) + 7)  # as if part of a larger minibatch


def test_names_cover_every_row_length_at_its_largest_row_count(specs):
    # fsdp = 2, one process: rows are a multiple of 2, as many as the 64-token budget per device allows.
    want = {16: 8, 32: 4, 64: 2}
    assert possible_microbatch_shapes(ENGINE, fsdp=2) == [(R, T) for T, R in want.items()]
    names = {f"train/{kind}[rows={R},len={T}]" for T, R in want.items() for kind in ("grad", "logprobs")}
    assert set(specs) == names | {"train/update", "train/zeros_like"}
    for name, spec in specs.items():
        assert spec.role == "train"
        assert "MeshConfig.train_tensor" in spec.fields, name
        if "[" in name:
            assert {"TrainEngineConfig.max_tokens_per_microbatch", "TrainEngineConfig.logit_chunk_tokens"} <= set(spec.fields)


def test_rows_scale_with_processes_as_the_loop_packs_them():
    # fsdp 8 over 2 processes: each packs rows for its 4 devices (its share of fsdp), 1024 // T per
    # device; the program sees both processes' rows.
    cfg = TrainEngineConfig(max_tokens_per_microbatch=1024, row_buckets=(128, 512, 1024))
    assert possible_microbatch_shapes(cfg, fsdp=8, num_processes=2) == [(64, 128), (16, 512), (8, 1024)]
    assert possible_microbatch_shapes(cfg, fsdp=8, num_processes=1) == [(64, 128), (16, 512), (8, 1024)]


def test_make_microbatches_never_exceeds_the_described_shapes():
    largest = {T: R for R, T in possible_microbatch_shapes(ENGINE, fsdp=2)}
    seen = set()
    for seed, (lo, hi) in enumerate([(2, 16), (2, BUDGET + 1), (16, BUDGET + 1), (30, 40)]):
        rng = np.random.default_rng(seed)
        seqs = []
        for n in rng.integers(lo, hi, 60):
            seqs.append({"input_ids": np.zeros(n, np.int32), "targets": np.zeros(n, np.int32),
                         "loss_mask": np.ones(n, np.float32), "behavior_logprobs": np.zeros(n, np.float32),
                         "advantages": np.zeros(n, np.float32), "versions": np.zeros(n, np.int32)})
        minibatches = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=2,
                                        buckets=BUCKETS, row_multiple=2)
        shapes = {m.shape for mb in minibatches for m in mb}
        assert all(R <= largest[T] for R, T in shapes), (seed, shapes)
        seen |= shapes
    assert {T for _, T in seen} == set(largest)  # every row length occurred...
    assert {(R, T) for R, T in seen if R == largest[T]} == {(R, T) for T, R in largest.items()}  # ...at its bound


def test_every_spec_lowers_and_compiles(specs, trainer):
    for name, spec in specs.items():
        compiled = spec.lower().compile()
        assert compiled.memory_analysis() is not None, name
        # The resident optimizer state is laid out as the trainer holds it.
        if spec.resident:
            assert bytes_per_device(spec.resident) == bytes_per_device(trainer.opt_state), name


def test_grad_spec_computes_what_the_trainer_computes(specs, trainer, mesh):
    for T, R in ((16, 8), (64, 2)):  # many short rows, two long ones (64 tokens each: chunked)
        spec = specs[f"train/grad[rows={R},len={T}]"]
        micro = random_microbatch((R, T), seed=T)
        want_grads, want_stats = trainer.minibatch_gradients([micro])
        # The trainer's own placement of params, accumulators and batch (what it passes the program).
        params = trainer.params
        zeros = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding), params)
        stats = {k: jax.device_put(np.zeros(s.shape, s.dtype), NamedSharding(mesh, PartitionSpec()))
                 for k, s in spec.args[2].items()}
        batch = trainer._to_device(micro, (*LOSS_KEYS, PROXIMAL_KEY))
        assert set(batch) == set(spec.args[3])
        for k, x in batch.items():
            assert (x.shape, x.dtype, x.sharding) == (spec.args[3][k].shape, spec.args[3][k].dtype,
                                                      spec.args[3][k].sharding), k
        grads, got_stats = spec.lower().compile()(params, zeros, stats, batch, np.float32(micro.minibatch_valid_tokens))
        assert float(got_stats["n_valid"]) == micro.num_valid_tokens > 0
        assert float(got_stats["clip_frac"]) > 0 or float(got_stats["capped_frac"]) > 0  # summed indicators
        for k in want_stats:
            np.testing.assert_allclose(np.asarray(got_stats[k]), np.asarray(want_stats[k]), rtol=1e-6, atol=1e-7,
                                       err_msg=k)
        for (path, got), want in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)):
            assert got.sharding == want.sharding, jax.tree_util.keystr(path)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-7,
                                       err_msg=jax.tree_util.keystr(path))


def test_logprobs_spec_computes_what_the_trainer_computes(specs, trainer):
    micro = random_microbatch((4, 32), seed=5)
    spec = specs["train/logprobs[rows=4,len=32]"]
    got = spec.lower().compile()(trainer.params, trainer._to_device(micro, FORWARD_KEYS))
    np.testing.assert_allclose(np.asarray(got), np.asarray(trainer.compute_logprobs(micro)), rtol=0, atol=1e-6)


def test_one_decoupled_update_per_step_describes_the_self_proximal_grad(mesh):
    # One update per step: pi_prox is the loss forward's own; naive PPO reads none; several: given.
    one = dataclasses.replace(PPO, num_minibatches=1)
    naive = dataclasses.replace(PPO, objective="naive")
    for cfg, has_proximal in ((one, False), (naive, False), (PPO, True)):
        grads = [s for s in train_program_specs(CFG, ENGINE, ppo_objective(cfg), OPT, mesh,
                                                extra_keys=proximal_keys(cfg)) if s.name.startswith("train/grad")]
        assert grads and all((PROXIMAL_KEY in s.args[3]) == has_proximal for s in grads)


def test_bad_num_processes():
    mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="num_processes"):
        train_program_specs(CFG, ENGINE, ppo_objective(PPO), OPT, mesh, num_processes=0)
