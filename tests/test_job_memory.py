"""What the job's weight paths leave on the devices, counted with jax.live_arrays() on fake CPU devices.

A transfer holds at most one group of generation weights on the training devices at a time; an
RL loop built with `donate_params` keeps no initial copy of the weights; evaluation on the
generation devices gives the same greedy completions as evaluation where the weights lie.
"""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from areal_jax.evaluation.held_out import GreedyAccuracy
from areal_jax.generation import EngineConfig
from areal_jax.models import ModelConfig, init_params
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.parallel import MeshConfig, WeightSync, build_meshes, model_partition_specs
from areal_jax.ppo import AdvantageConfig
from areal_jax.rollout.workflow import RLVRConfig
from areal_jax.trainer import OptimizerConfig, PPOConfig, RLConfig
from areal_jax.jobs.rl_loop_builder import build_rl_loop
from areal_jax.trainer.cluster import generation_weight_sync
from tests.test_rl_loop import REWARD, rows
from tests.tokenizer_fixtures import build_tiny_tokenizer

# 6 layers of 37,120 weights (74,240 B in bf16); embedding and head 1024 x 64 (128 KiB each in bf16).
MODEL = ModelConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
                    num_kv_heads=2, head_dim=16, qkv_bias=True, family="qwen2")
LAYER_BYTES = 74_240


def _buffers(arrays, devices) -> dict:
    """{(device, buffer address): bytes} of the arrays' shards on `devices`, each buffer once (a
    sharded array and the per-device arrays of its shards are live alike)."""
    out = {}
    for x in arrays:
        for shard in x.addressable_shards:
            if shard.device in devices:
                out[(shard.device, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    return out


def _bytes_on(devices) -> dict:
    """Bytes of the live device buffers on each of `devices`."""
    gc.collect()
    out = {d: 0 for d in devices}
    for (device, _), n in _buffers(jax.live_arrays(), set(devices)).items():
        out[device] += n
    return out


def _on_train_mesh(cfg, meshes, params):
    train_specs, _ = model_partition_specs(cfg, meshes.train, meshes.generation.shape["tensor"])
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(meshes.train, spec)), params, train_specs)


def _extra_during_transfer(sync, train_params, train_devices) -> tuple[int, list[int]]:
    """(bytes the training devices hold after the transfer beyond before it, per group: the
    most any one training device holds beyond before it while that group is staged)."""
    before = _bytes_on(train_devices)
    peaks = []
    sync.on_group_resharded = lambda _: peaks.append(
        max(n - before[d] for d, n in _bytes_on(train_devices).items()))
    out = sync.transfer(train_params)
    after = _bytes_on(train_devices)
    del out
    return max(after[d] - before[d] for d in train_devices), peaks


def test_transfer_holds_at_most_one_group_on_the_training_devices():
    # One host of 4 training devices and 4 generation devices, generation_tensor = 1: every
    # training device receives whole groups (the worst case, as with one training chip per host).
    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=4))
    train_devices = meshes.train_devices_local
    train_params = _on_train_mesh(MODEL, meshes, init_params(MODEL, 0))
    budget = 2 * LAYER_BYTES
    sync = WeightSync.for_model(MODEL, meshes, jnp.bfloat16, group_bytes=budget)
    sync.transfer(train_params)  # compiles and makes the groups' first-layer scalars (16 B, kept)

    left, peaks = _extra_during_transfer(sync, train_params, train_devices)
    stats = sync.last_stats
    assert stats.num_bytes == 6 * LAYER_BYTES + 2 * 1024 * 64 * 2 + 64 * 2
    assert stats.groups == len(peaks) == 5  # embed + final_norm | lm_head | 3 runs of 2 layers
    # Each training device holds one group's outputs at most (plus nothing else), never the whole.
    assert max(peaks) <= budget < stats.num_bytes / 3
    assert max(peaks) >= 2 * LAYER_BYTES  # and the measurement sees them
    assert left == 0  # every staging buffer freed

    # Unbounded groups (all other weights, then all layers): every layer at once on each device.
    whole = WeightSync.for_model(MODEL, meshes, jnp.bfloat16, group_bytes=1 << 40)
    whole.transfer(train_params)
    _, peaks = _extra_during_transfer(whole, train_params, train_devices)
    assert max(peaks) == 6 * LAYER_BYTES


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), "chatml"))


def _loop(tokenizer, params, **kw):
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    return build_rl_loop(cfg, params, tokenizer=tokenizer, data_iter=rows(tokenizer),
                         rl=RLConfig(steps=1, batch_size=2), ppo=PPOConfig(), optimizer=OptimizerConfig(),
                         advantages=AdvantageConfig(), workflow=RLVRConfig(n_samples=2, max_new_tokens=4, reward=REWARD),
                         engine=EngineConfig(num_slots=4, max_seq_len=32),
                         mesh=MeshConfig(num_generation_devices_per_host=2), devices=jax.devices()[:4], **kw)


@pytest.mark.parametrize("donate", [True, False], ids=["donated", "kept"])
def test_rl_loop_keeps_no_initial_copy_of_the_weights(tokenizer, donate):
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=2), jax.devices()[:4])
    train_devices = set(meshes.train_devices_local)
    # Only buffers this test makes count: earlier tests of the process may leave arrays alive.
    # Holding the earlier arrays keeps their buffer addresses from being reused meanwhile.
    gc.collect()
    earlier = jax.live_arrays()
    earlier_buffers = set(_buffers(earlier, train_devices))
    params = _on_train_mesh(cfg, meshes, init_params(cfg, 0))  # as jobs/train loads them
    param_bytes = sum(_buffers(jax.tree.leaves(params), train_devices).values())
    loop = _loop(tokenizer, params, donate_params=donate)
    trainer = loop.cluster.trainer
    gc.collect()
    held = sum(n for key, n in _buffers(jax.live_arrays(), train_devices).items() if key not in earlier_buffers)
    state = sum(_buffers([x for x in jax.tree.leaves((trainer.params, trainer.opt_state)) if isinstance(x, jax.Array)],
                         train_devices).values())
    assert all(x.is_deleted() for x in jax.tree.leaves(params)) == donate
    # The training devices hold the trainer's weights and optimizer state (and a few scalars);
    # the caller's initial copy only when it was not donated.
    initial = 0 if donate else param_bytes
    assert state + initial <= held <= state + initial + 8192


def test_evaluation_on_the_generation_mesh_matches_evaluation_where_the_weights_lie(tokenizer):
    """fp32, one device (the quickstart's case): the evaluation engine on the generation mesh, fed
    per-layer weights, completes every prompt exactly as an engine on the weights' own device."""
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    params = init_params(cfg, 3, std=0.3)
    meshes = build_meshes(MeshConfig(colocated=True), jax.devices()[:1])
    sync = generation_weight_sync(cfg, meshes, RLConfig())
    prompts = [row for _, row in zip(range(12), rows(tokenizer))]

    def completions(weights) -> list[str]:
        texts = []  # the reward sees every greedy completion, in row order
        GreedyAccuracy(cfg, prompts, tokenizer, max_new_tokens=12,
                       reward_fn=lambda text, gold: texts.append(text) or 0.0).count(weights)
        return texts

    on_generation = sync.transfer(params)
    assert isinstance(on_generation["layers"], tuple)  # per layer, as the engine holds them
    assert on_generation["embed"].sharding.mesh == meshes.generation
    np.testing.assert_array_equal(np.asarray(on_generation["layers"][1]["wq"]), np.asarray(params["layers"]["wq"][1]))
    expected = completions(params)
    assert len(set(expected)) > 1  # the check compares something
    assert completions(on_generation) == expected
