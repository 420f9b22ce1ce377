"""AdapterSync (parallel/adapter_sync.py): the base once, then only adapters, merged on the
generation mesh; and the size of an adapter transfer at a 7B shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import lora as lora_lib
from areal_jax.models.config import ModelConfig
from areal_jax.models.lora import LoRAConfig
from areal_jax.models.sharding import TRAIN_RULES
from areal_jax.models.transformer import init_params, split_layers
from areal_jax.parallel import MeshConfig, build_meshes
from areal_jax.parallel.adapter_sync import AdapterSync, adapter_bytes
from areal_jax.parallel.transfer_plan import model_partition_specs
from areal_jax.trainer.programs import param_shardings

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, family="qwen2")
# Qwen2.5-7B's shapes (config.json of Qwen/Qwen2.5-7B).
QWEN25_7B = ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                        num_kv_heads=4, head_dim=128, qkv_bias=True, family="qwen2", max_position_embeddings=32768)


def test_a_rank_16_transfer_of_a_7b_model_is_under_one_percent_of_a_full_one():
    lora = LoRAConfig(rank=16)  # every projection
    train, _ = model_partition_specs(QWEN25_7B, build_meshes(MeshConfig()).train, 1, lora)
    shapes = lora_lib.adapter_shapes(QWEN25_7B, lora)
    moved = sum(int(np.prod(shapes[w][k])) for w in train["layers"] for k in train["layers"][w]) * 2  # bf16
    full = QWEN25_7B.num_params() * 2
    assert moved == adapter_bytes(QWEN25_7B, lora, jnp.bfloat16)
    # 28 layers x 16 x (2 x (3584 + 3584) + 2 x (3584 + 512) + 3 x (3584 + 18944)) = 40.4M of 7.6B
    assert moved == 28 * 16 * (2 * 7168 + 2 * 4096 + 3 * 22528) * 2
    assert moved / full < 0.01, moved / full


def _adapted(meshes, lora, seed):
    adapters = lora_lib.init_adapters(CFG, lora)
    rng = np.random.default_rng(seed)
    adapters = {k: v if k == lora_lib.SCALE else {n: jnp.asarray(rng.normal(0, 0.3, x.shape), jnp.float32)
                                                  for n, x in v.items()} for k, v in adapters.items()}
    params = lora_lib.attach(jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(CFG, seed)), adapters)
    return jax.device_put(params, param_shardings(CFG, TRAIN_RULES, meshes.train, lora))


@pytest.mark.parametrize("mesh", [MeshConfig(train_tensor=2, generation_tensor=2),
                                  MeshConfig(colocated=True, train_tensor=2, generation_tensor=2)],
                         ids=["split", "colocated"])
def test_swaps_move_only_adapters_and_deliver_the_merged_weights(mesh):
    meshes = build_meshes(mesh)
    lora = LoRAConfig(rank=2, alpha=3.0, targets=("q", "o", "up", "down"))
    sync = AdapterSync(CFG, lora, meshes, None)  # generation dtype = the trained dtypes: exact comparison
    for i, seed in enumerate((0, 1)):
        params = _adapted(meshes, lora, 0 if i == 0 else seed)
        if i == 1:  # same base, new adapters
            params = lora_lib.attach(lora_lib.detach(first), lora_lib.adapters_of(params))
        got = sync.transfer(params)
        want = split_layers(lora_lib.merge(jax.tree.map(np.asarray, params)))
        for (path, x), y in zip(jax.tree.leaves_with_path(want), jax.tree.leaves(got)):
            assert y.sharding.mesh == meshes.generation and y.dtype == x.dtype, path
            # bf16 base: the fp32 sums of two programs may round one bf16 ulp apart
            np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(x, np.float32), rtol=2 ** -8, atol=1e-6,
                                       err_msg=str(path))
        first = params if i == 0 else first
    assert sync.base_sync.last_stats.index == 1  # the base crossed once
    assert sync.last_stats.num_bytes == adapter_bytes(CFG, lora, jnp.float32)


def test_the_planner_counts_adapter_state_not_the_full_optimizer_state():
    from areal_jax.parallel.weight_sync import transfer_program_specs
    from areal_jax.trainer.optimizer import OptimizerConfig
    from areal_jax.trainer.algorithm import ppo_objective
    from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
    from areal_jax.trainer.programs import train_program_specs

    mesh = build_meshes(MeshConfig(num_generation_devices_per_host=4)).train
    engine = TrainEngineConfig(max_tokens_per_microbatch=1024, compute_dtype="bfloat16", remat="full")
    objective = ppo_objective(PPOConfig())
    lora = LoRAConfig(rank=16)
    n, a, L = QWEN25_7B.num_params(), lora_lib.adapter_param_count(QWEN25_7B, lora), QWEN25_7B.num_layers
    # rank x (in + out) per projection and layer: q, o (3584 + 3584); k, v (3584 + 512); gate, up, down (3584 + 18944)
    assert a == 28 * 16 * (2 * 7168 + 2 * 4096 + 3 * 22528) == 40_370_176
    total = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731  (global bytes)
    specs = {s.name: s for s in train_program_specs(QWEN25_7B, engine, objective, OptimizerConfig(), mesh, lora=lora)}
    full = {s.name: s for s in train_program_specs(QWEN25_7B, engine, objective, OptimizerConfig(), mesh)}
    grad = next(s for name, s in specs.items() if name.startswith("train/grad"))
    assert 0 <= total(grad.resident) - 8 * a < 64  # Adam's two fp32 moments of the adapters (+ counters)
    assert total(grad.args[1]) == 4 * a  # the gradient accumulator: adapters only
    assert total(grad.args[0]) == 2 * n + 4 * a + 4 * L  # bf16 base, fp32 adapters and their scale
    assert 0 <= total(full[grad.name].resident) - 8 * n < 64  # full fine-tuning: moments of every weight
    assert total(specs["train/update"].args) - 16 * a < 64  # adapters, their moments, their gradient
    moved = [s for s in transfer_program_specs(QWEN25_7B, mesh, num_hosts=1, generation_tensor=1,
                                               dtype=jnp.bfloat16, lora=lora) if s.name.startswith("transfer/lora/")]
    assert moved and sum(total(s.args[0]) for s in moved) == 4 * a  # reads the fp32 adapters, nothing else


def test_the_planned_grad_program_takes_the_dropout_index_with_lora_dropout():
    from areal_jax.trainer.optimizer import OptimizerConfig
    from areal_jax.trainer.algorithm import ppo_objective
    from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
    from areal_jax.trainer.programs import train_program_specs

    mesh = build_meshes(MeshConfig(num_generation_devices_per_host=4)).train
    engine, objective = TrainEngineConfig(max_tokens_per_microbatch=64), ppo_objective(PPOConfig())
    for dropout, extra in ((0.0, 0), (0.1, 1)):
        lora = LoRAConfig(rank=2, dropout=dropout)
        grad = next(s for s in train_program_specs(CFG, engine, objective, OptimizerConfig(), mesh, lora=lora)
                    if s.name.startswith("train/grad"))
        assert len(grad.args) == 5 + extra
        grad.lower()  # traces: the planner compiles what the trainer runs
