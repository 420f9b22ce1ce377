"""The weight push with EngineConfig.weight_dtype set quantizes on the training devices, in the
training layout, before the reshard (parallel/transfer_plan.py), on 8 fake CPU devices: layer
weights land bit for bit as `quantize.quantize` of the bf16-cast weights (contracted axes split
over the training devices too), the reshard's collectives (on a 2-host-shaped mesh as well) and the
put carry codes and scales and `last_stats` counts them, the planner's specs are the programs that
run, and the training devices hold one group's codes and scales at most. The 2-process quantized
pushes run in tests/test_weight_sync.py's multi-process test."""

import re

import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from areal_jax.aot import dtype_bits
from areal_jax.models import ModelConfig, init_params, quantize
from areal_jax.models.config import MoEConfig
from areal_jax.models.sharding import TRAIN_RULES
from areal_jax.parallel import MeshConfig, WeightSync, build_meshes, transfer_program_specs
from areal_jax.parallel.meshes import TRAIN_AXES
from areal_jax.trainer.train_step import param_shardings
from tests.test_weight_sync import (MODEL, PEAK_MODEL, SPLITS, _assert_same_bytes, _live_bytes,
                                    _LiveBytesSampler, _partitioned_collectives, _served_piece_bytes, _stack_split)

# name -> (shape, train spec, generation spec), fp32 on the train mesh. Both layer weights shard
# their contracted axis over the training devices (w_up's D over fsdp x tensor, w_down's F over
# tensor), and w_down's generation spec (so the piece as staged on the view, where it is
# quantized) splits it too.
QUANT_LAYERS = 4
QUANT_PARAMS = {
    "embed": ((16, 128), P("fsdp", None), P(None, "tensor")),  # not a layer weight: sent as bf16
    "layers": {
        "w_up": ((QUANT_LAYERS, 128, 64), P(None, ("fsdp", "tensor"), None), P(None, None, "tensor")),  # [L, D, F]
        "w_down": ((QUANT_LAYERS, 512, 32), P(None, "tensor", "fsdp"), P(None, "tensor", None)),  # [L, F, D]
        "norm": ((QUANT_LAYERS, 32), P(), P()),  # not quantized
    },
}
_is_quant_entry = lambda x: isinstance(x, tuple) and len(x) == 3  # noqa: E731


def _quant_specs(which):
    return jax.tree.map(lambda e: e[which], QUANT_PARAMS, is_leaf=_is_quant_entry)


def _served_reference(w, name, kind):
    """What the old path landed for one layer piece: bf16-cast `w`, quantized by `quantize.quantize`
    (a tuple (q, scale)), or the bf16 piece itself for a weight that is not quantized."""
    w = jnp.asarray(w).astype(jnp.bfloat16)
    axes = quantize.contracted_axes(name)
    return w if axes is None else jax.tree.leaves(quantize.quantize(w, axes, kind))


def _nbytes(x) -> int:
    return -(-x.size * dtype_bits(x.dtype) // 8)  # jnp.int4: two codes a byte


@pytest.mark.parametrize("layout", ["split", "stacked"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("cfg, _staged", [SPLITS[1], SPLITS[3]])
def test_quantized_push_sends_codes_and_scales_bit_for_bit(cfg, _staged, kind, layout, monkeypatch):
    """Layer weights quantized on the training devices land, bit for bit, as `quantize.quantize` of
    the bf16-cast weights; the put onto the generation devices carries codes and scales (and the
    unquantized leaves in bf16), and `last_stats` counts exactly those bytes."""
    meshes = build_meshes(cfg)
    rng = np.random.default_rng(7)
    host = jax.tree.map(lambda e: rng.normal(0, 0.05, size=e[0]).astype(np.float32), QUANT_PARAMS,
                        is_leaf=_is_quant_entry)
    train_params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(meshes.train, s)), host, _quant_specs(1))
    sync = WeightSync(meshes, _quant_specs(1), _quant_specs(2), jnp.bfloat16, group_bytes=40_000, layout=layout,
                      weight_dtype=kind)
    sent = []
    put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **kw: (sent.extend(jax.tree.leaves(x)), put(x, *a, **kw))[1])
    out = sync.transfer(train_params)
    monkeypatch.undo()

    layers = out["layers"] if layout == "split" else [jax.tree.map(lambda x, i=i: x[i], out["layers"])
                                                       for i in range(QUANT_LAYERS)]
    assert len(layers) == QUANT_LAYERS
    want_bytes = _nbytes(out["embed"])
    _assert_same_bytes(out["embed"], jnp.asarray(host["embed"]).astype(jnp.bfloat16))
    for layer, got in enumerate(layers):
        for name in ("w_up", "w_down", "norm"):
            want = _served_reference(host["layers"][name][layer], name, kind)
            _assert_same_bytes(got[name] if name == "norm" else jax.tree.leaves(got[name]), want)
            want_bytes += sum(_nbytes(x) for x in jax.tree.leaves(want))
        q, scale = quantize.quantize_reference(np.asarray(jnp.asarray(host["layers"]["w_down"][layer])
                                                          .astype(jnp.bfloat16).astype(jnp.float32)), (0,), kind)
        assert np.asarray(got["w_down"].q).tobytes() == q.tobytes()
        assert np.asarray(got["w_down"].scale).tobytes() == scale.tobytes()
    # Laid out as the engine's generation shardings say (the stacked ones with the layer axis in front).
    for path, spec in jax.tree_util.tree_leaves_with_path(_quant_specs(2), is_leaf=lambda x: isinstance(x, P)):
        name = path[-1].key
        got = out["layers"][name] if path[0].key == "layers" and layout == "stacked" else None
        if got is None:
            continue
        axes = quantize.contracted_axes(name, stacked=True)
        wanted = NamedSharding(meshes.generation, spec)
        wanted = wanted if axes is None else quantize.quantized_sharding(wanted, axes, kind, got.shape)
        for x, sh in zip(jax.tree.leaves(got), jax.tree.leaves(wanted)):
            assert x.sharding.is_equivalent_to(sh, x.ndim)
    stats = sync.last_stats
    assert stats.num_bytes == want_bytes
    assert stats.groups > 2 and 0 < stats.max_group_bytes < want_bytes
    if meshes.colocated:
        assert not sent  # the view is the generation mesh: nothing crosses
    else:
        assert sum(_nbytes(x) for x in sent) == want_bytes
        # No full-precision copy of a quantized weight is put: its pieces go as codes.
        assert {np.dtype(x.dtype) for x in sent if x.shape in ((128, 64), (512, 32))} == {
            np.dtype(quantize.CODE_DTYPES[kind])}
        assert {np.dtype(x.dtype) for x in sent} == {np.dtype(jnp.bfloat16), np.dtype(quantize.CODE_DTYPES[kind]),
                                                     np.dtype(quantize.SCALE_DTYPES[kind])}
    # Whole weights on one device (quantized on the generation devices, a piece at a time) land the same.
    _assert_same_bytes(sync.transfer(jax.tree.map(jnp.asarray, host)), out)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_push_holds_one_group_and_its_codes_on_the_training_devices(kind, monkeypatch):
    """The training devices hold at most one group's staged pieces as served (codes and scales of
    a quantized weight, no bf16 copy of it) plus their program's temporaries (sampled at every
    explicit free and after each reshard), and nothing once the push is done."""
    meshes = build_meshes(SPLITS[1].values[0])
    devices = set(meshes.train_devices_local)
    host = init_params(PEAK_MODEL, 0)
    train_params = jax.device_put(host, param_shardings(PEAK_MODEL, TRAIN_RULES, meshes.train))
    sync = WeightSync.for_model(PEAK_MODEL, meshes, jnp.bfloat16, group_bytes=1, weight_dtype=kind)
    sync.transfer(train_params)  # compiles, and makes the groups' first-layer scalars (kept)
    sampler = _LiveBytesSampler(sync, devices, monkeypatch)
    out = sync.transfer(train_params)
    monkeypatch.undo()
    samples, before = sampler.samples, sampler.before
    gc.collect()
    after = _live_bytes(devices)

    plan, _, shardings = sync._plan(jax.tree.leaves(train_params))

    # Each group's pieces on the view as served: codes and scales when quantized.
    bound = max(sum(_served_piece_bytes(sync, i, plan.leaves[i], shardings[i][0], kind) for i, _ in g.pieces)
                for g in plan.groups)
    assert quantize.is_quantized(out) and len(samples) > 2 * PEAK_MODEL.num_layers
    assert 0 < max(samples) - before <= bound, (max(samples) - before, bound)
    assert after == before  # every staged piece and sent copy freed


# ---- what the reshard moves, and what the planner compiles ---------------------------------------

_COLLECTIVE = re.compile(r"= \(?((?:\w+\[[\d,]*\][^ ]*,? ?)+)\)? "
                         r"(all-gather|all-to-all|collective-permute|all-reduce)\(")


def _collectives(lines) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, shape) of each array the collectives of a partitioned HLO module output."""
    out = []
    for line in lines:
        m = _COLLECTIVE.search(line)
        assert m, line
        out += [(dtype, tuple(int(d) for d in dims.split(",") if d))
                for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))]
    return out


def _bytes_by_type(collectives) -> dict[str, int]:
    out: dict[str, int] = {}
    for dtype, shape in collectives:
        bits = {"s4": 4, "u4": 4, "s8": 8, "u8": 8, "bf16": 16, "f16": 16, "s32": 32, "f32": 32}[dtype]
        out[dtype] = out.get(dtype, 0) + math.prod(shape) * bits // 8
    return out


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_reshard_gathers_codes_across_hosts(kind, tmp_path):
    """On 8 devices as 2 hosts of 4 (training fsdp 4 x tensor 2, so fsdp spans both hosts), each
    layer group's reshard (the planner's spec of it) moves the layer weights as int8 / int4 codes:
    its collectives after SPMD partitioning carry s8 / s4 where the bf16 push's carry bf16, and the
    bytes they move shrink accordingly. (XLA:CPU's later passes widen s4 and bf16 collectives to s8
    and f32; the partitioned module is what the program asks every backend to move.)"""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 1, 2), TRAIN_AXES)
    code = {"int8": "s8", "int4": "s4"}[kind]
    programs = {}

    def moved(weight_dtype):
        specs = transfer_program_specs(MODEL, mesh, num_hosts=2, generation_tensor=2, dtype=jnp.bfloat16,
                                       group_bytes=1, weight_dtype=weight_dtype)
        (layer,) = [s for s in specs if s.name.startswith("transfer/layers[0:1 ")]
        programs[layer.name] = layer
        return layer.name, _collectives(_partitioned_collectives(layer.fn, layer.args, tmp_path))

    name, bf16 = moved(None)
    qname, quant = moved(kind)
    # The rounding to bf16 survives compilation (no pass may fold it into the fp32 weights).
    assert "mantissa_bits=7" in programs[qname].lower().compile().as_text()
    assert qname == name.replace("[bfloat16]", f"[bfloat16->{kind}]")
    # The bf16 push gathers the layer's weights in bf16 (e.g. bf16[64,64] all-gathers); the quantized
    # push gathers the same shapes as codes, and none of them in bf16.
    weights = {shape for _, shape in bf16}
    assert {dtype for dtype, _ in bf16} == {"bf16"}, bf16
    assert {dtype for dtype, shape in quant if shape in weights} == {code}, quant
    assert weights <= {shape for dtype, shape in quant if dtype == code}, (weights, quant)
    # What is left in bf16 / f32: the scales, and their cross-device max.
    before, after = _bytes_by_type(bf16), _bytes_by_type(quant)
    assert after.get("bf16", 0) + after.get("f32", 0) <= 0.1 * before["bf16"], (after, before)
    assert sum(after.values()) <= {"int8": 0.6, "int4": 0.35}[kind] * before["bf16"], (after, before)


def test_the_reshards_rounding_to_bf16_is_the_casts():
    """The fp32 values the reshard quantizes are the bf16 cast's, bit for bit, on every finite fp32
    bit pattern drawn (ties, subnormals, the largest values), laid out over 8 devices."""
    from areal_jax.parallel.transfer_plan import _rounded_where_it_lies

    bits = np.random.default_rng(0).integers(0, 2**32, size=1 << 16, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    edges = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3895314e38, 1e-40, -1e-40, 1e-45, 0.0, -0.0]
    x = np.concatenate([x[np.isfinite(x)][:(1 << 15) - len(edges)], np.float32(edges)]).astype(np.float32)
    sharding = NamedSharding(jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("x",)), P("x"))
    got = jax.jit(lambda v: _rounded_where_it_lies(v, np.dtype(jnp.bfloat16), sharding))(jax.device_put(x, sharding))
    want = jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_program_specs_are_the_quantized_programs_that_run(kind):
    """With `weight_dtype` the planner's transfer specs lower to the very programs a quantized
    `WeightSync` runs, whose outputs are the layer weights' codes and scales."""
    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=4, train_tensor=2, generation_tensor=2))
    specs = transfer_program_specs(MODEL, meshes.train, num_hosts=1, generation_tensor=2, dtype=jnp.bfloat16,
                                   group_bytes=1, weight_dtype=kind)
    sync = WeightSync.for_model(MODEL, meshes, jnp.bfloat16, group_bytes=1, weight_dtype=kind)
    leaves = jax.tree.leaves(jax.device_put(init_params(MODEL, 0), param_shardings(MODEL, TRAIN_RULES, meshes.train)))
    plan, starts, _ = sync._plan(leaves)
    assert len(specs) == len(plan.groups)
    # A group's name says what it outputs: the layer groups codes, the others (embedding, head) bf16.
    for spec, group in zip(specs, plan.groups):
        quantized = any(plan.leaves[i].quant_axes is not None for i in group.leaves)
        assert spec.name.endswith(f"[bfloat16->{kind}]" if quantized else "[bfloat16]"), spec.name
    assert any(s.name.endswith(f"[bfloat16->{kind}]") for s in specs)
    for spec, group, start in zip(specs, plan.groups, starts):
        assert spec.lower().as_text() == group.program.lower(*plan.group_args(group, leaves, start)).as_text()
    out = jax.eval_shape(specs[-1].fn, *specs[-1].args)  # one layer: its quantized weights as codes
    served = {np.dtype(x.dtype) for x in jax.tree.leaves([x for x in out if isinstance(x, quantize.QuantizedWeight)])}
    assert served == {np.dtype(quantize.CODE_DTYPES[kind]), np.dtype(quantize.SCALE_DTYPES[kind])}
    # What the planner sees staged on the training devices shrinks with the codes.
    bf16 = transfer_program_specs(MODEL, meshes.train, num_hosts=1, generation_tensor=2, dtype=jnp.bfloat16,
                                  group_bytes=1)[-1]
    staged = [spec.lower().compile().memory_analysis().output_size_in_bytes for spec in (specs[-1], bf16)]
    assert staged[0] <= {"int8": 0.6, "int4": 0.35}[kind] * staged[1], staged


MOE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, family="qwen3_moe", qk_norm=True,
                  moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))


@pytest.mark.parametrize("layout", ["split", "stacked"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_an_expert_parallel_moe_push_is_the_quantized_bf16_model(kind, layout):
    """Experts split 2 ways (x tensor 2) to train and 4 ways to generate: the push is, bit for bit,
    `quantize_params` of the bf16-cast model, and moves `quantize.served_bytes` of it."""
    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=4, train_expert=2, train_tensor=2,
                                     generation_expert=4))
    host = init_params(MOE, 5, std=0.1)
    sync = WeightSync.for_model(MOE, meshes, jnp.bfloat16, group_bytes=1, layout=layout, weight_dtype=kind)
    out = sync.transfer(jax.device_put(host, param_shardings(MOE, TRAIN_RULES, meshes.train)))
    want = quantize.quantize_params(jax.tree.map(lambda a: jnp.asarray(a).astype(jnp.bfloat16), host), kind)
    _assert_same_bytes(out if layout == "stacked" else _stack_split(out), want)
    if layout == "stacked":  # [L, E, D, Fe]: the codes keep the experts' split
        assert out["layers"]["we_up"].q.sharding.spec[1] == "expert"
    assert sync.last_stats.num_bytes == quantize.served_bytes(MOE, 2, kind)
