"""Checkpoints: bitwise state round trip, meta, exact data resume, resharding, retention,
interval logic, crash atomicity under SIGKILL, atomic HF export."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from areal_jax.checkpoint import CheckpointConfig, Checkpointer
from areal_jax.models import ModelConfig, load_pretrained, param_shapes
from tests.checkpoint_crash_worker import data_iterator as crash_data_iterator
from tests.checkpoint_crash_worker import state_for

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bits(x) -> np.ndarray:
    """Raw bytes of an array, so NaN payloads and signed zeros compare exactly."""
    a = np.asarray(jax.device_get(x))
    return a.reshape(-1).view(np.uint8)


def _assert_bitwise_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, x.dtype, y.shape, y.dtype)
        np.testing.assert_array_equal(_bits(x), _bits(y))


def _template(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _random_state(seed: int):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w[0, 0], w[0, 1], w[0, 2] = np.nan, -0.0, np.inf
    params = {
        "embed": jnp.asarray(w),
        "layers": {"wq": jnp.asarray(rng.standard_normal((2, 8, 4)), dtype=jnp.bfloat16),
                   "b": jnp.asarray(rng.standard_normal(4), dtype=jnp.float32)},
    }
    opt_state = optax.adam(1e-3).init(params)  # namedtuples + int32 scalar count
    return {"params": params, "opt_state": opt_state, "step": jnp.asarray(7, jnp.int32),
            "tokens": jnp.asarray(rng.integers(-2**31, 2**31 - 1, size=(5, 3)), dtype=jnp.int32),
            "mask": jnp.asarray(rng.integers(0, 256, size=(9,)), dtype=jnp.uint8)}


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="save_interval_steps"):
        CheckpointConfig(tmp_path, save_interval_steps=0)
    with pytest.raises(ValueError, match="save_interval_s"):
        CheckpointConfig(tmp_path, save_interval_s=-1.0)
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointConfig(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="export_dir"):
        CheckpointConfig(tmp_path, export_hf_interval_steps=10)
    with pytest.raises(ValueError, match="directory"):
        CheckpointConfig("")


def test_state_and_meta_round_trip_bitwise(tmp_path):
    state = _random_state(0)
    meta = {"policy_version": 3, "staleness": {"accepted": 5, "running": 2}, "trainer_step": 12,
            "rng": [0, 1, 2**32 - 1, 12345], "config_hash": "ab12", "lr": 2e-5, "note": None}
    with Checkpointer(CheckpointConfig(tmp_path / "ck")) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.save(12, state=state, meta=meta, force=True)
        ckpt.wait()
        assert ckpt.latest_step() == 12
        restored, restored_meta = ckpt.restore(state_template=_template(state))
    _assert_bitwise_equal(restored, state)
    assert type(restored["opt_state"][0]) is type(state["opt_state"][0])  # namedtuple kept
    assert restored_meta == meta

    # A fresh Checkpointer (a new run) sees the same step; concrete arrays work as template.
    with Checkpointer(CheckpointConfig(tmp_path / "ck")) as ckpt:
        assert ckpt.all_steps() == [12]
        again, _ = ckpt.restore(12, state_template=jax.tree.map(jnp.zeros_like, state))
    _assert_bitwise_equal(again, state)


def test_donating_the_state_right_after_save_is_safe(tmp_path):
    # The trainer's step donates params/opt_state; save() returns while the write is in flight.
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    state = {"w": jax.device_put(jnp.arange(1 << 22, dtype=jnp.float32), sharding)}
    expected = np.arange(1 << 22, dtype=np.float32)
    update = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0)
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(1, state=state, force=True)
        for _ in range(3):
            state = update(state)
        jax.block_until_ready(state)
        ckpt.wait()
        restored, _ = ckpt.restore(state_template={"w": jax.ShapeDtypeStruct((1 << 22,), jnp.float32,
                                                                             sharding=sharding)})
    np.testing.assert_array_equal(np.asarray(restored["w"]), expected)
    np.testing.assert_array_equal(np.asarray(state["w"]), expected * 8 + 7)


def test_meta_must_be_json(tmp_path):
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        with pytest.raises(TypeError, match="JSON"):
            ckpt.save(1, state={"x": jnp.ones(2)}, meta={"bad": np.float32(1.0)}, force=True)
        with pytest.raises(TypeError, match="JSON"):
            ckpt.save(1, state={"x": jnp.ones(2)}, meta={"loss": float("nan")}, force=True)
        assert ckpt.latest_step() is None


def _pipeline():
    return (grain.MapDataset.range(40).shuffle(seed=3).map(lambda x: x * x + 1).batch(3)
            .to_iter_dataset())


@pytest.mark.parametrize("k", [0, 4])
def test_grain_iterator_resumes_at_the_next_element(tmp_path, k):
    it = iter(_pipeline())
    for _ in range(k):
        next(it)
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(k + 1, state={"x": jnp.arange(3)}, data_iterator=it, force=True)
        # Keep consuming before the write lands: the saved position must be the one at save().
        expected = [np.asarray(b) for b in it]
        ckpt.wait()
        fresh = iter(_pipeline())
        ckpt.restore(state_template={"x": jax.ShapeDtypeStruct((3,), jnp.int32)}, data_iterator=fresh)
    got = [np.asarray(b) for b in fresh]
    assert len(got) == len(expected) == 14 - k  # 40 elements in batches of 3
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    # Independent reference: the pipeline's batches from scratch, skipping k.
    reference = [np.asarray(b) for b in _pipeline()][k:]
    for a, b in zip(got, reference):
        np.testing.assert_array_equal(a, b)


class _BytesCursor:
    """A non-grain iterator whose state is bytes (like grain's DataLoaderIterator)."""

    def __init__(self):
        self.pos = 0

    def get_state(self) -> bytes:
        return bytes([self.pos, 0xFF, 0x00])

    def set_state(self, state: bytes) -> None:
        assert state[1:] == b"\xff\x00"
        self.pos = state[0]


def test_any_get_state_set_state_object(tmp_path):
    cursor = _BytesCursor()
    cursor.pos = 200
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(1, state={"x": jnp.ones(1)}, data_iterator=cursor, force=True)
        ckpt.save(2, state={"x": jnp.ones(1)}, force=True)
        ckpt.wait()
        fresh = _BytesCursor()
        ckpt.restore(1, state_template={"x": jax.ShapeDtypeStruct((1,), jnp.float32)}, data_iterator=fresh)
        assert fresh.pos == 200
        with pytest.raises(ValueError, match="no data-iterator state"):
            ckpt.restore(2, state_template={"x": jax.ShapeDtypeStruct((1,), jnp.float32)}, data_iterator=fresh)


def test_restore_onto_a_different_mesh_and_sharding(tmp_path):
    devices = jax.devices()
    assert len(devices) >= 6, "conftest provides 8 CPU devices"
    src_mesh = Mesh(np.array(devices[:4]), ("x",))
    dst_mesh = Mesh(np.array(devices[4:6]), ("y",))
    ref = {"w": np.arange(8 * 6, dtype=np.float32).reshape(8, 6) - 7.5,
           "e": (np.arange(4 * 8 * 2) % 13).astype(np.float32).reshape(4, 8, 2)}
    src = {"w": jax.device_put(ref["w"], NamedSharding(src_mesh, P("x", None))),
           "e": jax.device_put(jnp.asarray(ref["e"], jnp.bfloat16), NamedSharding(src_mesh, P(None, "x")))}
    dst_sharding = {"w": NamedSharding(dst_mesh, P(None, "y")), "e": NamedSharding(dst_mesh, P("y"))}
    template = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dst_sharding[k]) for k, v in src.items()}
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(5, state=src, force=True)
        ckpt.wait()
        restored, _ = ckpt.restore(state_template=template)
    for k in src:
        assert restored[k].sharding == dst_sharding[k]
        assert {d.id for d in restored[k].devices()} == {d.id for d in devices[4:6]}
        np.testing.assert_array_equal(np.asarray(restored[k], np.float32), ref[k])
    # Each destination device holds exactly its half along the new axis.
    w_shards = sorted(restored["w"].addressable_shards, key=lambda s: s.index[1].start)
    np.testing.assert_array_equal(np.asarray(w_shards[1].data), ref["w"][:, 3:])


def test_interval_logic(tmp_path):
    cfg = CheckpointConfig(tmp_path, save_interval_steps=5, save_interval_s=100.0)
    with Checkpointer(cfg) as ckpt:
        t0 = time.monotonic()
        assert ckpt.should_save(5) and ckpt.should_save(10)
        assert not ckpt.should_save(6, now=t0 + 1.0)
        assert ckpt.should_save(6, now=t0 + 101.0)  # time trigger
        assert not ckpt.save(7, state={"x": jnp.ones(1)})  # not due: nothing written
        assert ckpt.save(10, state={"x": jnp.ones(1)})
        ckpt.wait()
        t1 = time.monotonic()
        assert not ckpt.should_save(11, now=t1 + 50.0)  # clock restarted by the save
        assert ckpt.should_save(11, now=t1 + 100.0)
        assert not ckpt.should_save(10) and not ckpt.should_save(5)  # already saved / older
        assert not ckpt.save(10, state={"x": jnp.ones(1)}, force=True)  # exists: not rewritten
        assert ckpt.all_steps() == [10]
    never = Checkpointer(CheckpointConfig(tmp_path / "never"))
    assert not any(never.should_save(s, now=time.monotonic() + 1e9) for s in range(1, 50))
    never.close()


def test_max_to_keep(tmp_path):
    with Checkpointer(CheckpointConfig(tmp_path, max_to_keep=2)) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, state={"x": jnp.full((4,), step, jnp.float32)}, meta={"step": step}, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]
    with Checkpointer(CheckpointConfig(tmp_path, max_to_keep=2)) as ckpt:
        state, meta = ckpt.restore(4, state_template={"x": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert meta == {"step": 4}
    np.testing.assert_array_equal(np.asarray(state["x"]), np.full(4, 4.0))


def test_unfinished_step_directories_are_ignored(tmp_path):
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        ckpt.save(3, state={"x": jnp.arange(4.0)}, meta={"step": 3}, force=True)
        ckpt.wait()
        # A crashed save in Orbax's temporary form, and a step dir without the finalize marker
        # (e.g. a half-deleted old step), both newer than the real one.
        (tmp_path / "9.orbax-checkpoint-tmp-1700000000").mkdir()
        (tmp_path / "9.orbax-checkpoint-tmp-1700000000" / "junk").write_bytes(b"\0" * 100)
        (tmp_path / "7" / "state").mkdir(parents=True)
        assert ckpt.latest_step() == 3
        state, meta = ckpt.restore(state_template={"x": jax.ShapeDtypeStruct((4,), jnp.float32)})
        assert meta == {"step": 3}
        with pytest.raises(FileNotFoundError, match="7"):
            ckpt.restore(7, state_template={"x": jax.ShapeDtypeStruct((4,), jnp.float32)})
    with Checkpointer(CheckpointConfig(tmp_path)) as ckpt:
        assert ckpt.latest_step() == 3
        assert ckpt.save(4, state={"x": jnp.arange(4.0) + 1}, meta={"step": 4}, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
        # Orbax removes leftover temporary dirs in the background from start-up (awaited by a save).
        assert not (tmp_path / "9.orbax-checkpoint-tmp-1700000000").exists()
        state, meta = ckpt.restore(state_template={"x": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert meta == {"step": 4}
    np.testing.assert_array_equal(np.asarray(state["x"]), np.arange(4.0) + 1)


def _run_crash_trials(tmp_path: pathlib.Path, trials: int, seed: int):
    n = 1 << 22  # 16 MiB fp32 + 2 MiB bf16 + 2 MiB int32 per step: ~0.2 s a save here
    rng = np.random.default_rng(seed)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    killed_mid_save = 0
    for trial in range(trials):
        directory = tmp_path / f"t{trial}"
        progress = tmp_path / f"t{trial}.progress"
        progress.touch()
        proc = subprocess.Popen([sys.executable, "-m", "tests.checkpoint_crash_worker", str(directory),
                                 str(progress), str(n)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            # "started 2" means save 1 was committed: Orbax waits for the previous save first.
            while "started 2\n" not in progress.read_text():
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline, "worker made no progress"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 1.5))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        if any(".orbax-checkpoint-tmp" in p.name for p in directory.iterdir()):
            killed_mid_save += 1
        last_started = int(progress.read_text().split()[-1])

        ckpt = Checkpointer(CheckpointConfig(directory, max_to_keep=2))
        step = ckpt.latest_step()
        assert step is not None and last_started - 2 <= step <= last_started
        template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state_for(step, n))
        it = crash_data_iterator()
        state, meta = ckpt.restore(state_template=template, data_iterator=it)
        _assert_bitwise_equal(state, state_for(step, n))
        assert meta == {"step": step}
        assert next(it) == step  # the worker had consumed `step` elements at that save
        ckpt.close()
    return killed_mid_save


def test_sigkill_mid_save_never_yields_a_bad_latest_step(tmp_path):
    killed_mid_save = _run_crash_trials(tmp_path, trials=3, seed=0)
    # Saves run back to back, so nearly every kill lands inside one; demand at least one.
    assert killed_mid_save >= 1


@pytest.mark.slow
def test_sigkill_mid_save_many_trials(tmp_path):
    killed_mid_save = _run_crash_trials(tmp_path, trials=12, seed=1)
    assert killed_mid_save >= 6


def _tiny_model_config() -> ModelConfig:
    return ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, family="qwen2", qkv_bias=True)


def _random_params(cfg: ModelConfig, seed: int):
    # NumPy draws: init_params compiles one program per leaf, seconds on this CPU.
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32), param_shapes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))


def test_export_hf_loads_back_equal(tmp_path):
    cfg = _tiny_model_config()
    params = _random_params(cfg, 0)
    export_dir = tmp_path / "hf"
    with Checkpointer(CheckpointConfig(tmp_path / "ck", export_hf_interval_steps=4, export_dir=export_dir)) as ckpt:
        assert ckpt.export_hf(params, cfg, 3) is None and not export_dir.exists()
        path = ckpt.export_hf(params, cfg, 8)
        assert path == export_dir.absolute() / "step_8"
        model = load_pretrained(path)
        assert model.config == cfg
        _assert_bitwise_equal(model.params, params)
        # Re-exporting a step replaces it whole; no temporary directories are left behind.
        params2 = _random_params(cfg, 1)
        ckpt.export_hf(params2, cfg, 3, force=True)
        ckpt.export_hf(params2, cfg, 8)
        _assert_bitwise_equal(load_pretrained(path).params, params2)
        _assert_bitwise_equal(load_pretrained(export_dir / "step_3").params, params2)
    assert sorted(p.name for p in export_dir.iterdir()) == ["step_3", "step_8"]
