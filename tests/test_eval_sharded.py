"""`areal-jax eval` on a tensor-parallel mesh: the weights load sharded (in float32 or bfloat16)
onto a host-local ("data", "tensor") mesh, and greedy results equal a single device's.

The CLI runs in subprocesses with 1 or 4 fake CPU devices (this process has conftest's 8); the
loader's layout is checked here on 4 of this process's devices.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from areal_jax import config_system as cs
from areal_jax.cli import main
from areal_jax.jobs.evaluate import load_model
from areal_jax.evaluation import EvalConfig, engine_mesh
from areal_jax.metrics import read_jsonl
from areal_jax.models.hf_io import read_config
from tests.multiprocess import ROOT, run_cli_processes
from tests.test_cli import _tiny_model_dir

TIMINGS = {"wall_s", "generation_s", "scoring_s", "tokens_per_s"}
# Greedy, 5 rows; 4 slots: a multiple of every data size used here (1, 2).
ENGINE = ["EvalConfig.temperature = 0.0", "EvalConfig.max_new_tokens = 8", "EvalConfig.max_seq_len = 64",
          "EvalConfig.num_slots = 4"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir: 4 heads, 2 kv heads, mlp 64, vocab 508, all split by 2; data file; the one-device
    float32 run's directory, the reference)."""
    root = tmp_path_factory.mktemp("sharded")
    model_dir = _tiny_model_dir(root / "model")
    data = root / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i}+3?", "answer": f"so #### {i + 3}"}) + "\n"
                            for i in range(5)))
    one = root / "one"
    done = _eval_cli(model_dir, data, one, devices=1)
    assert done.returncode == 0, done.stderr
    return model_dir, data, one


def _eval_args(model_dir, data, run_dir, *bindings: str) -> list[str]:
    return ["eval", f"--model={model_dir}", f"--run_dir={run_dir}", "--reward_workers=1",
            f"--gin_param=DataConfig.paths = ('{data}',)", *[f"--gin_param={b}" for b in ENGINE + list(bindings)]]


def _eval_cli(model_dir, data, run_dir, *bindings: str, devices: int) -> subprocess.CompletedProcess:
    """`areal-jax eval` in a fresh process with `devices` fake CPU devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices), "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # a device count forced there would override JAX_NUM_CPU_DEVICES
    return subprocess.run([sys.executable, "-m", "areal_jax.cli", *_eval_args(model_dir, data, run_dir, *bindings)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)


def _assert_same_results(run_dir, reference_dir) -> None:
    """The same report numbers (timings aside) and the same per-sample file."""
    got, want = (json.loads((d / "report.json").read_text()) for d in (run_dir, reference_dir))
    assert {k: v for k, v in got["overall"].items() if k not in TIMINGS} == \
        {k: v for k, v in want["overall"].items() if k not in TIMINGS}
    assert got["per_dataset"] == want["per_dataset"]
    assert read_jsonl(run_dir / "samples.jsonl") == read_jsonl(reference_dir / "samples.jsonl")


def test_tensor_parallel_eval_matches_one_device(setup, tmp_path):
    model_dir, data, one = setup
    done = _eval_cli(model_dir, data, tmp_path, "EvalConfig.tensor_parallel = 2", devices=4)  # a 2 x 2 mesh
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "report.json").read_text())["config"]["tensor_parallel"] == 2
    _assert_same_results(tmp_path, one)


def test_two_hosts_each_on_its_own_tensor_parallel_mesh_match_one_device(setup, tmp_path):
    """Two processes over real jax.distributed, 2 devices each: each loads the model onto its own
    1 x 2 mesh (host-local) and evaluates its share of the rows."""
    model_dir, data, one = setup
    run_cli_processes(_eval_args(model_dir, data, tmp_path, "EvalConfig.tensor_parallel = 2"),
                      devices_per_process=2)
    _assert_same_results(tmp_path, one)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_load_sharded_in_their_dtype(setup, dtype):
    """The loader `eval` uses puts each weight on the 2 x 2 mesh, split over "tensor" by the
    generation rules (whole per data replica), in the configured dtype."""
    model_dir = setup[0]
    mesh_for = lambda model_cfg: engine_mesh(model_cfg, 2, devices=jax.devices()[:4])  # noqa: E731
    _, model = load_model(str(model_dir), dtype=dtype, mesh_for=mesh_for)
    params = model.params
    wq = params["layers"]["wq"]  # [L, D, N, H]: heads over "tensor"
    assert dict(wq.sharding.mesh.shape) == {"data": 2, "expert": 1, "tensor": 2}
    assert wq.sharding.spec == PartitionSpec(None, None, "tensor")
    assert {s.data.shape for s in wq.addressable_shards} == {(1, 32, 2, 8)}  # half the 4 heads on each device
    assert params["embed"].sharding.spec == PartitionSpec("tensor")  # [V, D]: vocabulary split
    assert params["layers"]["w_down"].sharding.spec == PartitionSpec(None, "tensor")  # [L, F, D]
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(dtype)}


def test_bfloat16_eval_completes(setup, tmp_path):
    """In bfloat16, with 3 slots: rounded up to 4, 2 on each of the 2 replicas."""
    model_dir, data, _ = setup
    done = _eval_cli(model_dir, data, tmp_path, "EvalConfig.tensor_parallel = 2", "EvalConfig.dtype = 'bfloat16'",
                     "EvalConfig.num_slots = 3", devices=4)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["dtype"] == "bfloat16"
    assert report["overall"]["num_samples"] == 5 and len(read_jsonl(tmp_path / "samples.jsonl")) == 5


def test_tensor_parallel_that_does_not_divide_the_devices_exits_2(setup, tmp_path):
    model_dir, data, _ = setup
    done = _eval_cli(model_dir, data, tmp_path, "EvalConfig.tensor_parallel = 3", devices=4)
    assert done.returncode == 2
    assert "configuration error: EvalConfig.tensor_parallel = 3 does not divide this process's 4 local device(s)" \
        in done.stderr
    assert not (tmp_path / "samples.jsonl").exists()


def test_impossible_splits_are_refused_naming_the_numbers(setup, capsys):
    model_cfg = read_config(setup[0])
    four = jax.devices()[:4]
    with pytest.raises(cs.ConfigError, match=r"EvalConfig.tensor_parallel = 4 does not divide the model's "
                                             r"kv_heads = 2: those weights would be replicated"):
        engine_mesh(model_cfg, 4, devices=four)
    assert engine_mesh(model_cfg, 1, devices=four[:1]) is None  # one device: the weights stay on it
    assert main(["generate", f"--model={setup[0]}", "--prompt=hi", "--tensor_parallel=3"]) == 2
    assert "--tensor_parallel = 3 does not divide this process's 8 local device(s)" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, culprit", [
    (dict(tensor_parallel=0), "EvalConfig.tensor_parallel must be an int >= 1"),
    (dict(dtype="float16"), "EvalConfig.dtype must be one of"),
])
def test_bad_dtype_or_tensor_parallel_names_the_field(overrides, culprit):
    with pytest.raises(ValueError, match=culprit):
        EvalConfig(**overrides)
