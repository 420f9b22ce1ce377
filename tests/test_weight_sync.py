"""Train -> generation weight transfer on 8 fake CPU devices, plus the 2-process run."""

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

from areal_jax.parallel import MeshConfig, WeightSync, agree_max, agree_sum, build_meshes
from tests.multiprocess import run_all

ROOT = pathlib.Path(__file__).resolve().parents[1]

# name -> (shape, dtype, train spec, generation spec). Layouts differ on purpose: the
# embedding is fsdp-sharded on rows for training and tensor-sharded on columns for
# generation; "bias" is sharded over "data" to exercise the view's fallback.
PARAMS = {
    "embed": ((16, 8), jnp.float32, P("fsdp", None), P(None, "tensor")),
    "layers": {
        "attn": {"wq": ((8, 24), jnp.float32, P(None, ("fsdp", "tensor")), P(None, "tensor"))},
        "mlp": {"w_in": ((8, 32), jnp.float32, P("fsdp", "tensor"), P("tensor", None))},
    },
    "bias": ((60,), jnp.float32, P(), P("data")),
    "step": ((), jnp.int32, P(), P()),
}

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


def _specs(which):
    return jax.tree.map(lambda e: e[which], PARAMS, is_leaf=_is_entry)


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


def _assert_transferred(meshes, out, host_values, dtype):
    generation_devices = set(meshes.generation_devices_local)
    for got, want, spec in zip(
        jax.tree.leaves(out), jax.tree.leaves(host_values), jax.tree.leaves(_specs(3))
    ):
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


@pytest.mark.parametrize("cfg, staged", SPLITS)
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16], ids=["fp32", "bf16"])
def test_transfer_is_exact_and_lands_on_generation_mesh(cfg, staged, dtype, host_gathers):
    meshes = build_meshes(cfg)
    values = _host_values()
    train_params = _on_train_mesh(meshes, values)
    sync = WeightSync(meshes, _specs(2), _specs(3), generation_dtype=dtype)
    out = sync.transfer(train_params)
    # Device-to-device copies everywhere except the reported leaves (bias: (60,)).
    assert sync.host_staged_leaves == staged
    assert host_gathers == [(60,)] * len(staged)
    _assert_transferred(meshes, out, values, dtype)
    # The trainer's copy is untouched.
    for got, want in zip(jax.tree.leaves(train_params), jax.tree.leaves(values)):
        assert np.asarray(got).tobytes() == want.tobytes()


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
    sync = WeightSync(meshes, _specs(2), _specs(3), generation_dtype=jnp.bfloat16)
    with _BackendCompiles() as compiles:
        first = sync.transfer(_on_train_mesh(meshes, _host_values()))
    assert compiles.count >= 1  # the counter works
    assert sync.compiled_programs() == 1
    assert sync.last_stats.index == 1 and sync.last_stats.compiled

    values = _host_values(offset=5.0)
    train_params = _on_train_mesh(meshes, values)
    live_before = len(jax.live_arrays())
    with _BackendCompiles() as compiles:
        second = sync.transfer(train_params)
    assert compiles.count == 0
    # Only the new generation parameters stay alive: the staging arrays were deleted.
    assert len(jax.live_arrays()) == live_before + len(jax.tree.leaves(second))
    assert sync.compiled_programs() == 1
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
        assert set(result["checked"]) == {"train4x1-gen2x1-bf16", "train2x2-gen1x2-fp32", "colocated-fp32"}
