"""Kill a training run with SIGKILL mid-run, resume it, and get the uninterrupted run: the same
integer metrics (versions, counts) exactly, the same float metrics to fp32 rounding."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from areal_jax.cli import main
from areal_jax.metrics import read_jsonl
from tests.multiprocess import run_cli_processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = [
    f"--gin_file={ROOT / 'configs' / 'quickstart.gin'}",
    *[f"--gin_param={p}" for p in (
        "ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "TaskSource.train_size = 300",
        "TaskSource.eval_size = 4", "SFTConfig.steps = 10", "SFTConfig.warmup = 2", "RLConfig.steps = 6",
        "SFTConfig.eval_every = 0", "SFTConfig.stop_accuracy = 0.0",  # 10 SFT steps: no accuracy stop
        "RLConfig.batch_size = 2", "RLConfig.max_concurrent = 4", "RLVRConfig.n_samples = 2",
        "RLVRConfig.max_new_tokens = 8", "RLVRConfig.filter_all_equal_rewards = False",
        "RLConfig.eval_max_new_tokens = 8", "EngineConfig.num_slots = 8", "EngineConfig.max_seq_len = 64",
        # deterministic mode: synchronous RL, so nothing is in flight at a checkpoint
        "RLConfig.mode = 'sync'", "RLConfig.max_staleness = 0", "CheckpointConfig.save_interval_steps = 1",
    )],
    "--quiet",
]
TIMING = ("time/", "throughput/")
# This process's 8 fake devices: 4 train, 4 generate (the engine's 8 slots split evenly over "data").
SPLIT_8 = "--gin_param=MeshConfig.num_generation_devices_per_host = 4"


def _by_step(run_dir):
    """Last record of each step (a killed run may have logged steps its checkpoint does not hold)."""
    return {r["step"]: r["metrics"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def _assert_same_metrics(want: dict, got: dict, step: int) -> None:
    """Same keys; ints, strings and bools exactly; floats to fp32 rounding.

    The killed run's early steps were computed in another process (and the resumed steps start
    from weights that process wrote), so reduction order may differ in the last bits. The metrics
    are fp32 reductions of O(1) terms: 1e-5 relative is about 80 fp32 ulps (eps 1.2e-7), and 1e-6
    absolute covers the values that cancel to ~0 (loss, approx_kl) while still resolving the
    learning rate (~1e-5). A resume that replays the wrong data, seed or step is off by far more.
    """
    assert want.keys() == got.keys(), f"step {step}: metric names differ after resume"
    for key, a in want.items():
        b = got[key]
        if isinstance(a, dict):
            _assert_same_metrics(a, b, step)
        elif isinstance(a, float) or isinstance(b, float):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-6), f"step {step}: {key} differs after resume"
        else:
            assert a == b, f"step {step}: {key} differs after resume"


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(["train", *ARGS, SPLIT_8, f"--run_dir={straight}"]) == 0

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "areal_jax.cli", "train", *ARGS, SPLIT_8, f"--run_dir={killed}"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = killed / "checkpoints" / "2" / "_CHECKPOINT_METADATA"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "summary.json").exists()

    assert main(["train", *ARGS, SPLIT_8, f"--run_dir={killed}", "--resume"]) == 0
    want, got = _by_step(straight), _by_step(killed)
    assert sorted(got) == sorted(want) == list(range(6))
    for step in range(6):
        a = {k: v for k, v in want[step].items() if not k.startswith(TIMING)}
        b = {k: v for k, v in got[step].items() if not k.startswith(TIMING)}
        _assert_same_metrics(a, b, step)
    assert got[5]["version"] == 6


@pytest.mark.slow  # ~70 s: two JAX processes, run then resumed
def test_two_process_run_resumes_from_its_checkpoint(tmp_path):
    """A multi-host run (two local processes over jax.distributed, one run directory) stopped after 3
    RL steps and resumed to 5 continues from the shared checkpoint, each step recorded once."""
    def both(steps, *extra):
        return run_cli_processes(["train", *ARGS, f"--gin_param=RLConfig.steps = {steps}", f"--run_dir={tmp_path}",
                                  *extra])

    both(3)
    logs = both(5, "--resume")
    assert all("resuming from checkpoint step 3" in log for log in logs)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(5))
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 5
