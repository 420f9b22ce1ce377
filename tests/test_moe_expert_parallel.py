"""Expert parallelism through the meshes (MeshConfig.train_expert / generation_expert) on 8 fake CPU
devices (tests/conftest.py): the meshes carry the axis, a split the experts do not divide is a
one-line error, the weight transfer reshards expert weights from one expert split to another
exactly, and the expert-parallel model's logits equal one device's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from areal_jax.models import sharding as shd
from areal_jax.models.config import ModelConfig, MoEConfig
from areal_jax.models.transformer import forward, init_params, param_axes
from areal_jax.parallel import MeshConfig, WeightSync, build_meshes, check_model_fits_mesh
from areal_jax.trainer.programs import param_shardings

is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731


def _cfg(num_experts=8):
    return ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=8, family="qwen2_moe", qkv_bias=True,
                       moe=MoEConfig(num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=10,
                                     norm_topk_prob=False, shared_expert_intermediate_size=12, mlp_only_layers=(1,)))


@pytest.mark.parametrize("mesh_cfg, train_shape, generation_shape", [
    # trainer splits experts 4 ways, each generation replica 2 ways
    (MeshConfig(num_generation_devices_per_host=4, train_expert=4, generation_expert=2), (1, 4, 1), (2, 2, 1)),
    # trainer 2 ways (with tensor 2), one replica of all 4 generation devices 4 ways
    (MeshConfig(num_generation_devices_per_host=4, train_expert=2, train_tensor=2, generation_expert=4),
     (1, 2, 2), (1, 4, 1)),
    # colocated: the same 8 devices, experts 8 ways to train and 2 ways (x tensor 2) to generate
    (MeshConfig(colocated=True, train_expert=8, generation_expert=2, generation_tensor=2), (1, 8, 1), (2, 2, 2)),
])
def test_transfer_reshards_expert_weights_exactly(mesh_cfg, train_shape, generation_shape):
    cfg = _cfg()
    check_model_fits_mesh(cfg, mesh_cfg)
    meshes = build_meshes(mesh_cfg)
    assert meshes.train.devices.shape == train_shape and meshes.generation.devices.shape == generation_shape
    host = jax.device_get(init_params(cfg, 3, std=0.3))
    train = jax.device_put(host, param_shardings(cfg, shd.TRAIN_RULES, meshes.train))
    E1, E2 = mesh_cfg.train_expert, mesh_cfg.generation_expert
    assert train["layers"]["we_gate"].addressable_shards[0].data.shape[1] == 8 // E1
    sync = WeightSync.for_model(cfg, meshes, layout="stacked")
    out = sync.transfer(train)
    want = jax.tree.map(lambda a, x: NamedSharding(meshes.generation, shd.spec_for(a, shd.GENERATION_RULES,
                                                                                   meshes.generation, x.shape)),
                        param_axes(cfg), host, is_leaf=is_axes)
    for got, value, sharding in zip(jax.tree.leaves(out), jax.tree.leaves(host), jax.tree.leaves(want)):
        assert np.asarray(got).tobytes() == np.asarray(value).tobytes()
        assert got.sharding.is_equivalent_to(sharding, got.ndim)
        assert set(got.sharding.device_set) == set(meshes.generation_devices_local)
    for name in ("we_gate", "we_up", "we_down"):  # [L, E, ...]: E over the generation mesh's expert axis
        assert out["layers"][name].sharding.spec[1] == "expert"
        assert {s.data.shape[1] for s in out["layers"][name].addressable_shards} == {8 // E2}

    # The logits of both expert-parallel layouts equal one device's (the trainer's rows are sharded
    # over fsdp x expert and gathered per expert group; the generation rows are whole per replica).
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 50, (8, 6)))
    single = np.asarray(forward(host, cfg, ids)[0])
    for params, rules, mesh in ((train, shd.TRAIN_RULES, meshes.train),
                                (out, shd.GENERATION_RULES, meshes.generation)):
        with shd.activation_rules(rules, mesh):
            logits = jax.jit(lambda p, i: forward(p, cfg, i)[0])(params, ids)
        np.testing.assert_allclose(np.asarray(logits), single, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mesh_cfg, cfg, message", [
    (MeshConfig(train_expert=3), _cfg(6 * 4), None),  # 3 divides 24: fine
    (MeshConfig(train_expert=3), _cfg(8), "MeshConfig.train_expert = 3 does not divide the model's 8 experts"),
    (MeshConfig(generation_expert=16), _cfg(8), "MeshConfig.generation_expert = 16 does not divide the model's 8"),
    (MeshConfig(train_expert=2), ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=2,
                                             num_heads=2, num_kv_heads=1, head_dim=8),
     "MeshConfig.train_expert = 2 needs a mixture-of-experts model"),
])
def test_expert_split_is_checked_against_the_model(mesh_cfg, cfg, message):
    if message is None:
        check_model_fits_mesh(cfg, mesh_cfg)
        return
    with pytest.raises(ValueError, match=message) as e:
        check_model_fits_mesh(cfg, mesh_cfg)
    assert "\n" not in str(e.value)


def test_expert_split_must_fit_the_devices():
    with pytest.raises(ValueError, match="train_expert=4 x train_tensor=1 does not divide the 2 training") as e:
        build_meshes(MeshConfig(train_expert=4))  # 2 of the 8 devices train
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="generation_expert=4 x generation_tensor=1 does not divide the 6"):
        build_meshes(MeshConfig(generation_expert=4))
    with pytest.raises(ValueError, match="train_expert must be >= 1"):
        MeshConfig(train_expert=0)
