"""One process of the 2-process weight-transfer test (run by tests/test_weight_sync.py).

Usage: multiprocess_weight_sync_worker.py PORT PROCESS_ID NUM_PROCESSES OUT_DIR
Expects JAX_NUM_CPU_DEVICES=4 in the environment. Writes OUT_DIR/result_<id>.json.
"""

import json
import pathlib
import sys
import traceback

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _expected(shape, offset):
    import numpy as np

    n = int(np.prod(shape))
    return np.arange(n, dtype=np.float32).reshape(shape) * np.float32(0.25) + np.float32(offset)


GROUP_BYTES = 1152  # 4 layers in bf16, 2 in fp32: several groups, layers in runs


def _check_case(name, cfg, dtype, programs, groups, checked, layout="split"):
    """Builds meshes, transfers twice (new values the second time) in groups, checks bitwise.

    `programs`: distinct reshard programs the `groups` need; `layout`: WeightSync's."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from areal_jax.parallel import WeightSync, build_meshes

    meshes = build_meshes(cfg)
    # The global train mesh spans both hosts, each host a contiguous block along fsdp.
    flat = list(meshes.train.devices.flat)
    assert len(flat) == (8 if meshes.colocated else 4), flat
    owners = [d.process_index for d in flat]
    assert owners == sorted(owners), owners
    assert all(d.process_index == jax.process_index() for d in meshes.generation.devices.flat)

    tree = {  # name -> (shape, train spec, generation spec)
        "embed": ((32, 16), P("fsdp", "tensor"), P(None, "tensor")),
        "block": {
            "w": ((16, 48), P(None, ("fsdp", "tensor")), P("tensor", None)),
            "norm": ((16,), P(), P("data")),
        },
        # Stacked on 6 layers: they arrive in runs of layers, as a tuple of per-layer dicts (split
        # layout) or written into [6, ...] arrays on the generation devices (stacked).
        "layers": {
            "w": ((6, 8, 16), P(None, "fsdp", "tensor"), P(None, None, "tensor")),
            "b": ((6, 16), P(), P()),
        },
    }
    is_entry = lambda x: isinstance(x, tuple) and len(x) == 3  # noqa: E731
    train_specs = jax.tree.map(lambda e: e[1], tree, is_leaf=is_entry)
    generation_specs = jax.tree.map(lambda e: e[2], tree, is_leaf=is_entry)
    sync = WeightSync(meshes, train_specs, generation_specs, generation_dtype=dtype, group_bytes=GROUP_BYTES,
                      layout=layout)

    for offset in (0.0, 3.0):
        def make(entry):
            shape, spec, _ = entry
            full = _expected(shape, offset)
            return jax.make_array_from_callback(shape, NamedSharding(meshes.train, spec), lambda i: full[i])

        train_params = jax.tree.map(make, tree, is_leaf=is_entry)
        compiles = []
        listener = lambda event, _secs, **kw: compiles.append(event == BACKEND_COMPILE)  # noqa: E731
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            out = sync.transfer(train_params)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        # First transfer compiles; the second must not compile anything.
        assert any(compiles) == (offset == 0.0), (name, offset, sum(compiles))
        pieces = []  # (got, want, generation spec of the piece)
        for key in ("block", "embed"):
            pieces += [(got, _expected(shape, offset), spec) for (shape, _, spec), got in zip(
                jax.tree.leaves(tree[key], is_leaf=is_entry), jax.tree.leaves(out[key]))]
        if layout == "stacked":
            pieces += [(got, _expected(shape, offset), spec) for (shape, _, spec), got in zip(
                jax.tree.leaves(tree["layers"], is_leaf=is_entry), jax.tree.leaves(out["layers"]))]
        else:
            assert isinstance(out["layers"], tuple) and len(out["layers"]) == 6
        for layer, got_layer in enumerate(out["layers"] if layout == "split" else ()):
            pieces += [(got, _expected(shape, offset)[layer], P(*spec[1:])) for (shape, _, spec), got in zip(
                jax.tree.leaves(tree["layers"], is_leaf=is_entry), jax.tree.leaves(got_layer))]
        for got, want, spec in pieces:
            if dtype is not None:
                want = np.asarray(jnp.asarray(want).astype(dtype))
            assert got.is_fully_addressable
            assert got.sharding.is_equivalent_to(NamedSharding(meshes.generation, spec), got.ndim)
            assert set(got.sharding.device_set) == set(meshes.generation_devices_local)
            assert np.asarray(got).tobytes() == want.tobytes(), (name, want.shape)
            for shard in got.addressable_shards:
                assert np.asarray(shard.data).tobytes() == want[shard.index].tobytes()
        del train_params
    assert sync.host_staged_leaves == (), sync.host_staged_leaves  # device-to-device puts only
    assert sync.compiled_programs() == programs, sync.compiled_programs()
    assert not sync.last_stats.compiled and sync.last_stats.index == 2
    assert sync.last_stats.groups == groups, sync.last_stats
    checked.append(name)


def _check_quantized_case(name, cfg, kind, layout, checked):
    """Quantized push: the reshard quantizes in the training layout before its gathers (each
    training device its own shard); twice, codes and scales bit for bit the NumPy quantizer's of the
    bf16-cast weights, and `last_stats.num_bytes` their size. w_up's contracted axis is split across
    the two hosts for training (its scales take a max across processes), w_down's over "tensor"."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from areal_jax.aot import dtype_bits
    from areal_jax.models import quantize
    from areal_jax.parallel import WeightSync, build_meshes

    meshes = build_meshes(cfg)
    tree = {  # name -> (shape, train spec, generation spec)
        "embed": ((8, 16), P("fsdp", None), P(None, "tensor")),
        "layers": {
            "w_up": ((4, 16, 32), P(None, "fsdp", "tensor"), P(None, None, "tensor")),  # [L, D, F]
            "w_down": ((4, 32, 16), P(None, "tensor", "fsdp"), P(None, "tensor", None)),  # [L, F, D]
            "norm": ((4, 16), P(), P()),
        },
    }
    is_entry = lambda x: isinstance(x, tuple) and len(x) == 3  # noqa: E731
    sync = WeightSync(meshes, jax.tree.map(lambda e: e[1], tree, is_leaf=is_entry),
                      jax.tree.map(lambda e: e[2], tree, is_leaf=is_entry), jnp.bfloat16, group_bytes=GROUP_BYTES,
                      layout=layout, weight_dtype=kind)
    nbytes = lambda x: -(-x.size * dtype_bits(x.dtype) // 8)  # noqa: E731
    for offset in (0.0, 3.0):
        full = jax.tree.map(lambda e: (np.sin(np.arange(np.prod(e[0]), dtype=np.float32)).reshape(e[0])
                                       * np.float32(offset + 1)), tree, is_leaf=is_entry)
        train_params = jax.tree.map(
            lambda e, x: jax.make_array_from_callback(e[0], NamedSharding(meshes.train, e[1]), lambda i: x[i]),
            tree, full, is_leaf=is_entry)
        out = sync.transfer(train_params)
        bf16 = jax.tree.map(lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)), full)
        assert np.asarray(out["embed"].astype(jnp.float32)).tobytes() == bf16["embed"].tobytes()
        moved = nbytes(out["embed"])
        for layer in range(4):
            for key, want in bf16["layers"].items():
                got = out["layers"][layer][key] if layout == "split" else jax.tree.map(
                    lambda x: x[layer], out["layers"][key])
                axes = quantize.contracted_axes(key)
                wants = [want[layer]] if axes is None else quantize.quantize_reference(want[layer], axes, kind)
                gots = [got.astype(jnp.float32)] if axes is None else [got.q, got.scale]
                for g, w in zip(gots, wants):
                    assert set(g.sharding.device_set) <= set(meshes.generation_devices_local)
                    assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), (name, layer, key)
                moved += sum(nbytes(x) for x in jax.tree.leaves(got))
        assert sync.last_stats.num_bytes == moved, (sync.last_stats, moved)
        del train_params
    checked.append(name)


def main():
    port, process_id, num_processes, out_dir = sys.argv[1:5]
    process_id, num_processes = int(process_id), int(num_processes)
    result = {"ok": False, "process_id": process_id, "checked": []}
    try:
        from areal_jax.parallel import initialize_distributed

        assert initialize_distributed(f"127.0.0.1:{port}", num_processes, process_id)
        assert initialize_distributed(f"127.0.0.1:{port}", num_processes, process_id)  # idempotent

        import jax
        import jax.numpy as jnp

        from areal_jax.parallel import MeshConfig, agree_max, agree_sum

        assert jax.process_count() == num_processes and jax.local_device_count() == 4
        result["agree_max"] = agree_max(process_id + 3)
        result["agree_sum"] = agree_sum(process_id + 3)

        split = dict(num_generation_devices_per_host=2)
        # bf16: norm | block.w | embed | layers 0-3 | 4-5 (5 programs, 5 groups);
        # fp32: norm | block.w | embed | layers 0-1 | 2-3 | 4-5 (4 programs, 6 groups).
        _check_case("train4x1-gen2x1-bf16", MeshConfig(**split), jnp.bfloat16, 5, 5, result["checked"])
        _check_case("train4x1-gen2x1-bf16-stacked", MeshConfig(**split), jnp.bfloat16, 5, 5, result["checked"],
                    layout="stacked")
        _check_case(
            "train2x2-gen1x2-fp32",
            MeshConfig(**split, train_tensor=2, generation_tensor=2),
            None,
            4,
            6,
            result["checked"],
        )
        _check_case(
            "colocated-fp32",
            MeshConfig(colocated=True, train_tensor=2, generation_tensor=2),
            None,
            4,
            6,
            result["checked"],
        )
        quantized = MeshConfig(**split, train_tensor=2, generation_tensor=2)
        _check_quantized_case("train2x2-gen1x2-int8", quantized, "int8", "split", result["checked"])
        _check_quantized_case("train2x2-gen1x2-int4-stacked", quantized, "int4", "stacked", result["checked"])
        result["ok"] = True
    except Exception:  # the parent test reports the traceback
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr, flush=True)
    pathlib.Path(out_dir, f"result_{process_id}.json").write_text(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
