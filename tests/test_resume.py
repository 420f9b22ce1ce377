"""Kill a training run with SIGKILL mid-run and resume it.

"sync": the uninterrupted run again: the same integer metrics (versions, counts) exactly, the same
float metrics and final weights to fp32 rounding. "async" (eta = 2): every step trained and recorded
once (metrics.jsonl, TensorBoard), staleness within eta, admission capacity as a run that lost
nothing, and the wall time of both segments in summary.json.

The policy is a tiny untrained model that never solves a problem, so the task's own reward would
be 0 everywhere (zero loss and gradients: an optimizer state lost on resume would go unnoticed);
tests.resume_fixtures:digit_share scores the text instead, so every step updates the weights.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from areal_jax.cli import main
from areal_jax.metrics import read_jsonl
from tests.multiprocess import run_cli_processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = [
    f"--gin_file={ROOT / 'configs' / 'quickstart.gin'}",
    *[f"--gin_param={p}" for p in (
        "ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "TaskSource.train_size = 300",
        "TaskSource.eval_size = 4", "SFTConfig.steps = 10", "SFTConfig.warmup_steps = 2", "RLConfig.steps = 6",
        "SFTConfig.eval_every = 0", "SFTConfig.stop_accuracy = 0.0",  # 10 SFT steps: no accuracy stop
        "RLConfig.batch_size = 2", "RLConfig.max_concurrent = 4", "RLVRConfig.n_samples = 2",
        "RLVRConfig.max_new_tokens = 8", "RLVRConfig.filter_all_equal_rewards = False",
        "RLConfig.eval_max_new_tokens = 8", "EngineConfig.num_slots = 8", "EngineConfig.max_seq_len = 64",
        "RLVRConfig.reward = 'tests.resume_fixtures:digit_share'",
    )],
    "--quiet",
]
# deterministic mode: synchronous RL, so nothing is in flight at a checkpoint
SYNC = [f"--gin_param={p}" for p in (
    "RLConfig.mode = 'sync'", "RLConfig.max_staleness = 0", "CheckpointConfig.save_interval_steps = 1")]
ETA, ASYNC_STEPS, ASYNC_BATCH, ASYNC_CONCURRENT = 2, 8, 2, 8
# The paper's mode. max_group_age = 0 drops a group whose generation spanned an update, so no trained
# token lags more than eta (the volume bound alone lets a straggler exceed it). max_concurrent is
# above (eta + 1) x batch_size, so a capacity cut by lost groups would show.
ASYNC = [f"--gin_param={p}" for p in (
    "RLConfig.mode = 'async'", f"RLConfig.max_staleness = {ETA}", "RLConfig.max_group_age = 0",
    f"RLConfig.steps = {ASYNC_STEPS}", f"RLConfig.batch_size = {ASYNC_BATCH}",
    f"RLConfig.max_concurrent = {ASYNC_CONCURRENT}", "RLConfig.dump_rollouts_every = 1",
    "CheckpointConfig.save_interval_steps = 3")]
# Wall-clock measurements (time/, throughput/, transfer/seconds) differ between runs, and so do the
# rollout side's progress counters (groups finished, accepted or queued when the step's metrics are
# read): rewards are scored in worker processes, so how far admission got after the weight update
# is a race. What was trained is not.
TIMING = ("time/", "throughput/", "timings", "rollout/", "transfer/seconds")
# This process's 8 fake devices: 4 train, 4 generate (the engine's 8 slots split evenly over "data").
SPLIT_8 = "--gin_param=MeshConfig.num_generation_devices_per_host = 4"


def _by_step(run_dir):
    """The record of each RL step; each step must have exactly one."""
    records = rl_records(run_dir)
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps recorded more than once: {steps}"
    return {r["step"]: r["metrics"] for r in records}


def rl_records(run_dir) -> list[dict]:
    """metrics.jsonl's RL steps (SFT's steps come first, at negative indices)."""
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] >= 0]


def tensorboard_steps(run_dir) -> dict[str, list[int]]:
    """Steps per scalar tag of RL (not SFT's sft/...) over every event file of the run, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"] if not tag.startswith("sft/")}


def assert_each_step_once_in_tensorboard(run_dir, steps: int) -> None:
    """No tag holds a step twice; "version", logged every step, holds each one."""
    points = tensorboard_steps(run_dir)
    repeated = {tag: s for tag, s in points.items() if len(s) != len(set(s))}
    assert not repeated, f"steps recorded more than once in TensorBoard: {repeated}"
    assert points["version"] == list(range(steps))


def final_weights(run_dir) -> dict:
    from safetensors.numpy import load_file

    return {k: v for f in sorted((run_dir / "final_model").glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_same_weights(want: dict, got: dict) -> None:
    """To fp32 rounding, as _assert_same_metrics: a step replayed with other data, seed or optimizer
    state moves the weights by about the learning rate (1e-4), far beyond it."""
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def start_run(args: list[str], run_dir, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "areal_jax.cli", "train", *args, f"--run_dir={run_dir}"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


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
    assert main(["train", *ARGS, *SYNC, SPLIT_8, f"--run_dir={straight}"]) == 0

    proc = start_run([*ARGS, *SYNC, SPLIT_8], killed)
    wait_for((killed / "checkpoints" / "2" / "_CHECKPOINT_METADATA").exists, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "summary.json").exists()

    assert main(["train", *ARGS, *SYNC, SPLIT_8, f"--run_dir={killed}", "--resume"]) == 0
    want, got = _by_step(straight), _by_step(killed)
    assert sorted(got) == sorted(want) == list(range(6))
    for step in range(6):
        a = {k: v for k, v in want[step].items() if not k.startswith(TIMING)}
        b = {k: v for k, v in got[step].items() if not k.startswith(TIMING)}
        _assert_same_metrics(a, b, step)
    assert got[5]["version"] == 6
    # Every step updates the weights, so the optimizer state restored with them is exercised. (The
    # loss itself is ~0: at ratio 1 it is minus the mean advantage, 0 under group normalisation.)
    assert all(want[s]["train/grad_norm"] > 0.1 for s in range(6))
    assert_same_weights(final_weights(straight), final_weights(killed))


def test_async_run_killed_and_resumed_keeps_its_regime_and_records_each_step_once(tmp_path):
    run_dir = tmp_path / "run"
    t_start = time.monotonic()
    # Frozen (SIGSTOP) as soon as step 3 is logged: checkpoint 3 (steps 0-2) is then on disk and
    # step 3 is recorded past it, so the resumed run must drop that record and redo the step.
    proc = start_run([*ARGS, *ASYNC, SPLIT_8], run_dir)
    metrics = run_dir / "metrics.jsonl"

    def step_3_logged() -> bool:
        return ((run_dir / "checkpoints" / "3" / "_CHECKPOINT_METADATA").exists() and metrics.exists()
                and '"step": 3,' in metrics.read_text())

    wait_for(step_3_logged, proc)
    proc.send_signal(signal.SIGSTOP)
    first_segment_s = time.monotonic() - t_start
    logged = rl_records(run_dir)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL, "the run finished before it could be killed"
    assert [r["step"] for r in logged][:4] == [0, 1, 2, 3] and len(logged) < ASYNC_STEPS
    last_logged_s = max(r["metrics"]["time/since_start_s"] for r in logged)

    t_resume = time.monotonic()
    assert main(["train", *ARGS, *ASYNC, SPLIT_8, f"--run_dir={run_dir}", "--resume"]) == 0
    resumed_s = time.monotonic() - t_resume

    got = _by_step(run_dir)
    assert sorted(got) == list(range(ASYNC_STEPS)) and got[ASYNC_STEPS - 1]["version"] == ASYNC_STEPS
    assert_each_step_once_in_tensorboard(run_dir, ASYNC_STEPS)
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == \
        sorted(f"step_{s}.jsonl" for s in range(ASYNC_STEPS))
    for step, m in got.items():
        assert m["staleness/max"] <= ETA, f"step {step} trained tokens {m['staleness/max']} versions old"
    assert all(m["train/grad_norm"] > 0.1 for m in got.values())

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == ASYNC_STEPS
    (resumed,) = summary["resumed"]
    assert resumed["step"] == resumed["version"] == 3
    # Groups generated ahead (queued or in flight) at the save are lost; admission is what a run at
    # version 3 that trained 3 x batch_size groups and lost nothing may admit, not that minus the lost.
    assert resumed["lost_groups"] > 0, "nothing was generated ahead at the save: the run was not asynchronous"
    assert resumed["capacity"] == min(ASYNC_CONCURRENT, (ETA + 1) * ASYNC_BATCH)
    # Both segments' wall time: the killed one up to its last record, the resumed one in full.
    assert last_logged_s + 0.8 * resumed_s - 5 <= summary["wall_time_s"] <= first_segment_s + resumed_s
    wall = [got[s]["time/since_start_s"] for s in range(ASYNC_STEPS)]
    assert wall == sorted(wall) and wall[3] > last_logged_s


@pytest.mark.slow  # ~70 s: two JAX processes, run then resumed
def test_two_process_run_resumes_from_its_checkpoint(tmp_path):
    """A multi-host run (two local processes over jax.distributed, one run directory) stopped after 3
    RL steps and resumed to 5 continues from the shared checkpoint, each step recorded once."""
    def both(steps, *extra):
        return run_cli_processes(["train", *ARGS, *SYNC, f"--gin_param=RLConfig.steps = {steps}",
                                  f"--run_dir={tmp_path}", *extra])

    both(3)
    first = json.loads((tmp_path / "summary.json").read_text())["reward"]["submitted"]
    logs = both(5, "--resume", "--override_config")
    assert all("resuming from checkpoint step 3" in log for log in logs)
    assert [r["step"] for r in rl_records(tmp_path)] == list(range(5))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 5
    # Reward calls carried by the checkpoint are both processes' (process 0's alone fell 4 short
    # here: 32 against 44): all of the first segment's but its final held-out check
    # (TaskSource.eval_size = 4 greedy calls), plus at least the resumed run's 2 steps x 2 groups x 2
    # samples and its own final check.
    assert summary["reward"]["submitted"] >= first - 4 + 2 * 4 + 4, (first, summary["reward"])
