"""Train -> generation weight transfer on 8 fake CPU devices, plus the 2-process run."""

import gc
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import portpicker
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from areal_jax.aot import bytes_per_device
from areal_jax.generation.programs import param_shardings as generation_shardings
from areal_jax.models import ModelConfig, init_params, quantize
from areal_jax.models.sharding import TRAIN_RULES
from areal_jax.models.transformer import forward
from areal_jax.parallel import MeshConfig, WeightSync, agree_max, agree_sum, build_meshes, transfer_program_specs
from areal_jax.trainer.train_step import param_shardings
from tests.multiprocess import run_all

ROOT = pathlib.Path(__file__).resolve().parents[1]

# name -> (shape, dtype, train spec, generation spec). Layouts differ on purpose: the
# embedding is fsdp-sharded on rows for training and tensor-sharded on columns for
# generation; "bias" is sharded over "data" to exercise the view's fallback. The "layers"
# leaves are stacked on a leading axis of 8 layers; "w_in" shards that axis for training and,
# in the stacked layout only, for generation.
PARAMS = {
    "embed": ((16, 8), jnp.float32, P("fsdp", None), P(None, "tensor")),
    "layers": {
        "attn": {"wq": ((8, 24), jnp.float32, P(None, ("fsdp", "tensor")), P(None, "tensor"))},
        "mlp": {"w_in": ((8, 32), jnp.float32, P("fsdp", "tensor"), P("tensor", None))},
    },
    "bias": ((60,), jnp.float32, P(), P("data")),
    "step": ((), jnp.int32, P(), P()),
}
NUM_LAYERS = 8
# The split layout keeps one array per layer, so no generation spec may shard the layer axis.
SPLIT_PARAMS = {**PARAMS, "layers": {
    **PARAMS["layers"], "mlp": {"w_in": ((8, 32), jnp.float32, P("fsdp", "tensor"), P(None, "tensor"))}}}
LAYOUT_PARAMS = {"split": SPLIT_PARAMS, "stacked": PARAMS}

class _BackendCompiles:
    """Counts XLA backend compilations (any program, not just ours) inside the block."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def _on_event(self, event, duration, **kwargs):
        self.count += event == self.EVENT

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on_event)


_is_entry = lambda x: isinstance(x, tuple) and len(x) == 4  # noqa: E731


def _specs(which, params=PARAMS):
    return jax.tree.map(lambda e: e[which], params, is_leaf=_is_entry)


def _host_values(offset=0.0):
    """Known values: each leaf is an arange (scaled so bf16 rounding matters) plus an offset."""

    def make(entry):
        shape, dtype, _, _ = entry
        n = int(np.prod(shape))
        if dtype == jnp.int32:
            return np.arange(n, dtype=np.int32).reshape(shape) + int(offset)
        return (np.arange(n, dtype=np.float32).reshape(shape) * np.float32(1.0 / 3.0) + np.float32(offset))

    return jax.tree.map(make, PARAMS, is_leaf=_is_entry)


def _on_train_mesh(meshes, host_values):
    return jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(meshes.train, s)), host_values, _specs(2)
    )


def _pieces(out, host_values, params, layout):
    """(got, want, generation spec) of every array the generation side receives."""
    specs = _specs(3, params)
    if layout == "stacked":
        return list(zip(jax.tree.leaves(out), jax.tree.leaves(host_values), jax.tree.leaves(specs)))
    top = [k for k in sorted(host_values) if k != "layers"]
    pieces = [(out[k], host_values[k], specs[k]) for k in top]
    assert isinstance(out["layers"], tuple) and len(out["layers"]) == NUM_LAYERS
    for layer, got in enumerate(out["layers"]):
        for g, want, spec in zip(jax.tree.leaves(got), jax.tree.leaves(host_values["layers"]),
                                 jax.tree.leaves(specs["layers"])):
            pieces.append((g, want[layer], P(*spec[1:])))
    return pieces


def _assert_transferred(meshes, out, host_values, dtype, layout="split", params=None):
    params = params or LAYOUT_PARAMS[layout]
    generation_devices = set(meshes.generation_devices_local)
    for got, want, spec in _pieces(out, host_values, params, layout):
        expected = want if dtype is None or want.dtype == np.int32 else np.asarray(jnp.asarray(want).astype(dtype))
        assert got.dtype == expected.dtype
        got_np = np.asarray(got)
        # Bitwise: compare raw bytes, not values.
        assert got_np.shape == expected.shape
        assert got_np.tobytes() == expected.tobytes()
        assert set(got.sharding.device_set) == generation_devices
        assert got.sharding.is_equivalent_to(NamedSharding(meshes.generation, spec), got.ndim)
        for shard in got.addressable_shards:
            assert np.asarray(shard.data).tobytes() == expected[shard.index].tobytes()


SPLITS = [  # (config, parameters whose host-local put must go through host memory)
    pytest.param(MeshConfig(train_tensor=2, generation_tensor=2), ("['bias']",), id="train1x2-gen3x2"),
    pytest.param(MeshConfig(num_generation_devices_per_host=4, train_tensor=2, generation_tensor=4), (), id="train2x2-gen1x4"),
    pytest.param(MeshConfig(num_generation_devices_per_host=4, train_tensor=1, generation_tensor=2), (), id="train4x1-gen2x2"),
    pytest.param(MeshConfig(colocated=True, train_tensor=2, generation_tensor=2), (), id="colocated"),
]


@pytest.fixture
def host_gathers(monkeypatch):
    """Shapes of arrays that jax gathers into host memory (`Array._value`) during the test."""
    from jax._src import array as array_impl

    seen = []
    value = array_impl.ArrayImpl._value
    monkeypatch.setattr(
        array_impl.ArrayImpl, "_value", property(lambda self: (seen.append(self.shape), value.fget(self))[1])
    )
    return seen


@pytest.mark.parametrize("layout", ["split", "stacked"])
@pytest.mark.parametrize("cfg, staged", SPLITS)
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16], ids=["fp32", "bf16"])
def test_transfer_is_exact_and_lands_on_generation_mesh(cfg, staged, dtype, layout, host_gathers):
    meshes = build_meshes(cfg)
    values = _host_values()
    train_params = _on_train_mesh(meshes, values)
    params = LAYOUT_PARAMS[layout]
    sync = WeightSync(meshes, _specs(2, params), _specs(3, params), generation_dtype=dtype, layout=layout)
    out = sync.transfer(train_params)
    # Device-to-device copies everywhere except the reported leaves (bias: (60,)).
    assert sync.host_staged_leaves == staged
    assert host_gathers == [(60,)] * len(staged)
    _assert_transferred(meshes, out, values, dtype, layout)
    # The trainer's copy is untouched.
    for got, want in zip(jax.tree.leaves(train_params), jax.tree.leaves(values)):
        assert np.asarray(got).tobytes() == want.tobytes()
    # Whole weights on one device (put piece by piece) land the same.
    _assert_transferred(meshes, sync.transfer(jax.tree.map(jnp.asarray, values)), values, dtype, layout)


@pytest.mark.parametrize("cfg, _staged", [SPLITS[0], SPLITS[1], SPLITS[3]])
def test_groups_stream_the_same_weights(cfg, _staged):
    """Small groups: layers in runs of 3 (3 + 3 + 2: two programs), whole leaves one or two at a
    time; the result is the one-group transfer's, bitwise, and so is that of whole weights on one device."""
    meshes = build_meshes(cfg)
    values = _host_values()
    train_params = _on_train_mesh(meshes, values)
    layer_bytes = 2 * (24 + 32)  # bf16 wq and w_in of one layer
    sync = WeightSync(meshes, _specs(2, SPLIT_PARAMS), _specs(3, SPLIT_PARAMS), generation_dtype=jnp.bfloat16,
                      group_bytes=3 * layer_bytes)
    seen = []
    sync.on_group_resharded = seen.append
    out = sync.transfer(train_params)
    _assert_transferred(meshes, out, values, jnp.bfloat16)
    stats = sync.last_stats
    # Leaves in tree order: bias (120 B), then embed (256 B) + step (4 B); layers 0-2, 3-5, 6-7.
    assert stats.groups == 5 and seen == [0, 1, 2, 3, 4]
    assert stats.max_group_bytes == 3 * layer_bytes
    assert sync.compiled_programs() == 4  # the runs of 3 layers share one program
    # The one entry point takes whole weights on one device too: put piece by piece, no reshard group.
    _assert_transferred(meshes, sync.transfer(jax.tree.map(jnp.asarray, values)), values, jnp.bfloat16)
    assert sync.last_stats is stats
    _assert_transferred(meshes, sync.transfer(train_params), values, jnp.bfloat16)
    assert sync.last_stats.index == 2 and sync.compiled_programs() == 4


def _partitioned_collectives(program, args, tmp_path) -> list[str]:
    """The collectives of `program` as the SPMD partitioner emits them. XLA:CPU later widens bf16
    collectives to f32 (it has no bf16 ones); TPUs and GPUs move them as they are."""
    dump = tmp_path / f"dump{len(list(tmp_path.iterdir()))}"
    program.lower(*args).compile({"xla_dump_to": str(dump), "xla_dump_hlo_pass_re": "spmd-partitioning",
                                  "xla_dump_hlo_as_text": True})
    (text,) = [f.read_text() for f in dump.glob("*after_spmd-partitioning*.txt")]
    return [line for line in text.splitlines()
            if any(f" {op}(" in line for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"))]


def test_cast_runs_before_the_gather(tmp_path):
    """The reshard's collectives move bf16, never the fp32 master weights."""
    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=4, train_tensor=2, generation_tensor=1))
    sync = WeightSync(meshes, _specs(2, SPLIT_PARAMS), _specs(3, SPLIT_PARAMS), generation_dtype=jnp.bfloat16)
    leaves = jax.tree.leaves(_on_train_mesh(meshes, _host_values()))
    plan, starts, _ = sync._plan(leaves)
    collectives = []
    for group, start in zip(plan.groups, starts):
        collectives += _partitioned_collectives(group.program, plan.group_args(group, leaves, start), tmp_path)
    assert collectives, "expected the reshard to gather over the training devices"
    assert all(" bf16[" in line and " f32[" not in line for line in collectives), collectives


def test_uneven_view_falls_back_to_replication():
    # 3 train + 5 generation devices: a 10-long leaf splits 5 ways over "data" on the
    # generation mesh but not 3 ways on the view of the train devices, so the view
    # replicates it and the host-local put does the split.
    specs = {"v": P("data")}
    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=5))
    sync = WeightSync(meshes, {"v": P()}, specs)
    v = np.arange(10, dtype=np.float32)  # 10 % 5 == 0 on generation, 10 % 3 != 0 on the view
    out = sync.transfer({"v": jax.device_put(v, NamedSharding(meshes.train, P()))})
    assert np.asarray(out["v"]).tobytes() == v.tobytes()
    assert out["v"].sharding.is_equivalent_to(NamedSharding(meshes.generation, P("data")), 1)
    assert sync.host_staged_leaves == ("['v']",)


@pytest.mark.parametrize("cfg, _staged", [SPLITS[0], SPLITS[3]])
def test_second_transfer_reuses_program_and_frees_staging(cfg, _staged):
    meshes = build_meshes(cfg)
    sync = WeightSync(meshes, _specs(2, SPLIT_PARAMS), _specs(3, SPLIT_PARAMS), generation_dtype=jnp.bfloat16)
    with _BackendCompiles() as compiles:
        first = sync.transfer(_on_train_mesh(meshes, _host_values()))
    assert compiles.count >= 1  # the counter works
    assert sync.compiled_programs() == 2  # whole leaves, and the layers
    assert sync.last_stats.index == 1 and sync.last_stats.compiled

    values = _host_values(offset=5.0)
    train_params = _on_train_mesh(meshes, values)
    live_before = len(jax.live_arrays())
    with _BackendCompiles() as compiles:
        second = sync.transfer(train_params)
    assert compiles.count == 0
    # Only the new generation parameters stay alive: the staging arrays were deleted.
    assert len(jax.live_arrays()) == live_before + len(jax.tree.leaves(second))
    assert sync.compiled_programs() == 2
    stats = sync.last_stats
    assert stats.index == 2 and not stats.compiled
    assert stats.total_s == sync.last_transfer_s > 0
    assert stats.total_s >= stats.reshard_s + stats.place_s - 1e-9
    n_float = sum(int(np.prod(e[0])) for e in jax.tree.leaves(PARAMS, is_leaf=_is_entry) if e[1] != jnp.int32)
    assert stats.num_bytes == 2 * n_float + 4
    _assert_transferred(meshes, second, values, jnp.bfloat16)
    # The first result is independent of the second.
    _assert_transferred(meshes, first, _host_values(), jnp.bfloat16)


def test_spec_validation():
    meshes = build_meshes(MeshConfig())
    with pytest.raises(ValueError, match="names axes \\['fsdp'\\]; the generation mesh"):
        WeightSync(meshes, {"w": P("fsdp")}, {"w": P("fsdp")})
    with pytest.raises(ValueError, match="names axes \\['data'\\]; the train mesh"):
        WeightSync(meshes, {"w": P("data")}, {"w": P()})
    with pytest.raises(ValueError, match="spec trees differ"):
        WeightSync(meshes, {"w": P()}, {"v": P()})
    with pytest.raises(ValueError, match="shards the layer axis"):
        WeightSync(meshes, {"layers": {"w": P()}}, {"layers": {"w": P("tensor")}})
    WeightSync(meshes, {"layers": {"w": P()}}, {"layers": {"w": P("tensor")}}, layout="stacked")
    with pytest.raises(ValueError, match="group_bytes must be an int >= 1"):
        WeightSync(meshes, {"w": P()}, {"w": P()}, group_bytes=0)
    sync = WeightSync(meshes, {"w": P()}, {"w": P("data")})  # data = 6
    w = jax.device_put(np.zeros(8, np.float32), NamedSharding(meshes.train, P()))
    with pytest.raises(ValueError, match="does not split shape \\(8,\\) evenly"):
        sync.transfer({"w": w})


def test_agree_is_identity_in_one_process():
    assert agree_max(7) == 7
    assert agree_sum(7) == 7


def test_initialize_without_cluster_runs_single_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR"))}
    code = (
        "from areal_jax.parallel import initialize_distributed as init\n"
        "assert init() is False\n"
        "import jax; assert jax.process_count() == 1 and jax.device_count() == 2\n"
        "assert init() is False  # still a no-op once the backend is up\n"
    )
    env.update(JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True, timeout=120)


def test_two_processes_transfer_exactly(tmp_path):
    """2 processes x 4 CPU devices over real jax.distributed (gloo), 2 train + 2 generation each."""
    port = portpicker.pick_unused_port()
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "4", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    worker = ROOT / "tests" / "multiprocess_weight_sync_worker.py"
    run_all([[sys.executable, str(worker), str(port), str(i), "2", str(tmp_path)] for i in range(2)], env,
            timeout=240)
    for i in range(2):
        result = json.loads((tmp_path / f"result_{i}.json").read_text())
        assert result["ok"], result
        assert result["agree_max"] == 4 and result["agree_sum"] == 7
        assert set(result["checked"]) == {"train4x1-gen2x1-bf16", "train4x1-gen2x1-bf16-stacked",
                                          "train2x2-gen1x2-fp32", "colocated-fp32",
                                          "train2x2-gen1x2-int8", "train2x2-gen1x2-int4-stacked"}


# A small decoder: 6 layers of 37,120 weights (74,240 B in bf16), embedding and head 1024 x 64
# each (128 KiB in bf16).
MODEL = ModelConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
                    num_kv_heads=2, head_dim=16, qkv_bias=True, family="qwen2")
LAYER_BYTES = 2 * (3 * 64 * 128 + 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 + 64 + 2 * 32)


def test_program_specs_describe_the_runs_transfer():
    """`transfer_program_specs` (the planner's view, from the mesh alone) gives one spec per group run,
    lowering to the very programs `WeightSync` runs, sized by the group budget."""
    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=4, train_tensor=2, generation_tensor=2))
    budget = 2 * LAYER_BYTES
    specs = transfer_program_specs(MODEL, meshes.train, num_hosts=1, generation_tensor=2, dtype=jnp.bfloat16,
                                   group_bytes=budget)
    sync = WeightSync.for_model(MODEL, meshes, jnp.bfloat16, group_bytes=budget)
    params = jax.device_put(init_params(MODEL, 0), param_shardings(MODEL, TRAIN_RULES, meshes.train))
    leaves = jax.tree.leaves(params)
    plan, starts, _ = sync._plan(leaves)
    # In the order every process runs them: two layers or up to 145 KiB of other weights per group.
    assert [s.name for s in specs] == [
        "transfer/embed+final_norm[bfloat16]", "transfer/lm_head[bfloat16]",
        "transfer/layers[0:2 of 6][bfloat16]", "transfer/layers[2:4 of 6][bfloat16]",
        "transfer/layers[4:6 of 6][bfloat16]"]
    assert len(plan.groups) == len(specs)
    fp32_bytes = bytes_per_device(params)
    for spec, group, start in zip(specs, plan.groups, starts):
        assert spec.role == "transfer" and "RLConfig.transfer_group_bytes" in spec.fields
        assert spec.lower().as_text() == group.program.lower(*plan.group_args(group, leaves, start)).as_text()
        # Arguments and resident weights are the fp32 weights once; resident also AdamW's two moments.
        weights, moments = spec.resident
        assert bytes_per_device(spec.args) - 4 * (group.layers is not None) + bytes_per_device(weights) == fp32_bytes
        assert bytes_per_device(moments) == 2 * fp32_bytes
        memory = spec.lower().compile().memory_analysis()
        # The output (this group in bf16, laid out like generation on each training device) fits the budget.
        assert 0 < memory.output_size_in_bytes <= budget


# ---- the stacked layout: quantized, and its peak on the generation devices --------------------


def _stack_split(split):
    """The split layout's output with its per-layer leaves stacked on a leading layer axis."""
    return {**split, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *split["layers"])}


def _assert_same_bytes(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("cfg, _staged", [SPLITS[1], SPLITS[3]])
def test_stacked_quantized_is_the_split_result_stacked_on_layers(cfg, _staged, kind):
    """Codes and scales in the stacked layout are the split layout's, bit for bit, with the layer
    axis in front, laid out as the engine's stacked generation shardings say; the forward scans them."""
    meshes = build_meshes(cfg)
    host = init_params(MODEL, 3, std=0.1)
    train_params = jax.device_put(host, param_shardings(MODEL, TRAIN_RULES, meshes.train))
    make = lambda layout: WeightSync.for_model(MODEL, meshes, jnp.bfloat16, group_bytes=2 * LAYER_BYTES,  # noqa: E731
                                               layout=layout, weight_dtype=kind)
    split = make("split").transfer(train_params)
    sync = make("stacked")
    stacked = sync.transfer(train_params)
    assert isinstance(stacked["layers"]["wq"], quantize.QuantizedWeight)
    assert stacked["layers"]["wq"].q.dtype == quantize.CODE_DTYPES[kind]
    want = _stack_split(split)
    _assert_same_bytes(stacked, want)
    wanted = generation_shardings(MODEL, meshes.generation, split=False, weight_dtype=kind)
    for got, sharding in zip(jax.tree.leaves(stacked), jax.tree.leaves(wanted)):
        assert got.sharding.is_equivalent_to(sharding, got.ndim)
    # Whole weights on one device (put piece by piece) land the same.
    _assert_same_bytes(sync.transfer(jax.tree.map(jnp.asarray, host)), want)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, MODEL.vocab_size, size=(2, 8)), jnp.int32)
    scanned = jax.jit(lambda p: forward(p, MODEL, tokens, compute_dtype=jnp.float32)[0])(stacked)
    unrolled = jax.jit(lambda p: forward(p, MODEL, tokens, compute_dtype=jnp.float32, scan_layers=False)[0])(split)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), rtol=1e-5, atol=1e-5)


def _live_bytes(devices) -> int:
    """Bytes of the live arrays on `devices` (a buffer two arrays share counted once)."""
    seen = {}
    for x in jax.live_arrays():
        for shard in x.addressable_shards:
            if shard.device in devices:
                data = shard.data
                seen[(shard.device.id, data.unsafe_buffer_pointer())] = data.nbytes
    return sum(seen.values())


def _bytes_on(shape, dtype, sharding) -> int:
    """Bytes of an array of `shape` laid out by `sharding`, summed over its devices (as `_live_bytes`)."""
    return len(sharding.device_set) * int(np.prod(sharding.shard_shape(shape))) * np.dtype(dtype).itemsize


def _served_piece_bytes(sync, i, leaf, sharding, kind) -> int:
    """Bytes of leaf i's piece laid out by `sharding` as served: its codes and scales when quantized."""
    struct = jax.ShapeDtypeStruct(leaf.piece_shape, leaf.out_dtype, sharding=sharding)
    axes = sync._quant_axes[i]
    served = [struct] if axes is None else jax.tree.leaves(quantize.quantized_struct(struct, axes, kind))
    return sum(_bytes_on(s.shape, s.dtype, s.sharding) for s in served)


class _LiveBytesSampler:
    """Live bytes on `devices` sampled at every explicit free (where a peak ends: the transfer frees
    what it made explicitly) and after each group's reshard of `sync`, while installed."""

    def __init__(self, sync, devices, monkeypatch):
        from jax._src import array as array_impl

        self.devices, self.samples = devices, []
        delete = array_impl.ArrayImpl.delete
        monkeypatch.setattr(array_impl.ArrayImpl, "delete", lambda x: (self.sample(), delete(x))[1])
        sync.on_group_resharded = self.sample
        gc.collect()
        self.before = _live_bytes(devices)

    def sample(self, *_) -> None:
        self.samples.append(_live_bytes(self.devices))


# Twelve layers, so a stacked leaf (w_gate: 12 x 16 KiB in bf16) outweighs a group of one layer
# (98 KiB summed over 4 generation devices, the small leaves replicated): stacking pieces collected
# to the end (the old way) overshoots the bound below: by a leaf, twice one group.
PEAK_MODEL = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=12, num_heads=4,
                         num_kv_heads=2, head_dim=16, qkv_bias=True, family="qwen2")


@pytest.mark.parametrize("kind", [None, "int8", "int4"])
@pytest.mark.parametrize("cfg, _staged", [SPLITS[1], SPLITS[3]])
def test_stacked_layout_holds_one_copy_plus_one_group(cfg, _staged, kind, monkeypatch):
    """The generation devices never hold more than the finished weights plus one group's pieces
    (quantized ones as codes and scales: no full-precision piece), sampled at every explicit free (where
    a peak ends: the transfer frees what it made explicitly) and after each group's reshard; and a
    second transfer compiles nothing."""
    meshes = build_meshes(cfg)
    devices = set(meshes.generation.devices.flat)
    train_params = jax.device_put(init_params(PEAK_MODEL, 0), param_shardings(PEAK_MODEL, TRAIN_RULES, meshes.train))
    sync = WeightSync.for_model(PEAK_MODEL, meshes, jnp.bfloat16, group_bytes=1, layout="stacked", weight_dtype=kind)
    sync.transfer(train_params)  # compiles (its result is dropped at once)
    sampler = _LiveBytesSampler(sync, devices, monkeypatch)
    with _BackendCompiles() as compiles:
        out = sync.transfer(train_params)
    sampler.sample()
    monkeypatch.undo()
    samples, before = sampler.samples, sampler.before
    assert compiles.count == 0  # the writes (the layer index an argument) compiled on the first transfer

    plan, _, shardings = sync._plan(jax.tree.leaves(train_params))
    assert len(plan.groups) == PEAK_MODEL.num_layers + 3  # a group per layer, embed, final_norm, lm_head
    # Each leaf's piece as it lands: its codes and scales when quantized.
    piece = {i: _served_piece_bytes(sync, i, leaf, shardings[i][1], kind) for i, leaf in enumerate(plan.leaves)}
    group = max(sum(piece[i] for i, _ in g.pieces) for g in plan.groups)
    weights = sum(_bytes_on(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(out))
    assert len(samples) > 2 * PEAK_MODEL.num_layers
    # Quantized on the training devices before the reshard, no full-precision piece of a quantized
    # weight comes here (colocated too: the reshard's outputs are codes and scales).
    assert max(samples) - before <= weights + group, (max(samples) - before, weights, group)
    assert samples[-1] - before == weights  # nothing but the weights stays
    # Each write is in place: its output aliases the donated buffer.
    for i in [i for i, leaf in enumerate(plan.leaves) if leaf.stacked]:
        leaf = plan.leaves[i]
        struct = jax.ShapeDtypeStruct(leaf.piece_shape, leaf.out_dtype, sharding=shardings[i][1])
        axes = sync._quant_axes[i]
        piece_struct = struct if axes is None else quantize.quantized_struct(struct, axes, kind)
        buffer = sync._assembly.output_struct(i, leaf)
        memory = sync._assembly._writes[i].lower(buffer, piece_struct, np.int32(0)).compile().memory_analysis()
        n = len(jax.tree.leaves(buffer))  # codes and scales come out as a tuple: its pointers are not aliased
        assert memory.alias_size_in_bytes > 0
        assert memory.output_size_in_bytes - memory.alias_size_in_bytes == (8 * n if n > 1 else 0)
        assert memory.temp_size_in_bytes < piece[i]

