"""Fault injection: training runs SIGKILLed at seeded random moments, some of them while a checkpoint
is being written, and resumed until they finish.

"sync": the final weights equal an uninterrupted run's (to fp32 rounding, as tests/test_resume.py)
and so do its integer metrics. "async" (eta = 2): every step is trained and recorded once, in
metrics.jsonl and TensorBoard, no trained token is more than eta versions old, and every resume
starts with the admission capacity of a run that lost nothing.

A kill "at a save" waits for Orbax's `<step>.orbax-checkpoint-tmp-*` directory (it exists from the
start of a save until its rename to `<step>/`) and fires after a random 0-50 ms; whether the
directory was still there when the process died is recorded. Each attempt resumes when a finished
checkpoint exists, else starts over (--overwrite). The attempts are printed (pytest -s).
"""

import dataclasses
import json
import math
import random
import signal
import time

import pytest

from areal_jax.checkpoint import finalized_steps
from tests.test_resume import (ARGS, ASYNC, ASYNC_BATCH, ASYNC_CONCURRENT, ETA, SPLIT_8, SYNC, TIMING,
                               _assert_same_metrics, _by_step, assert_each_step_once_in_tensorboard,
                               assert_same_weights, final_weights, start_run)

SEED = 18
KILLS = 4  # per run; then it runs to the end
# Enough steps that four kills, each costing at most the steps since the last checkpoint, leave some.
STEPS = 12
SYNC_ARGS = [*ARGS, *SYNC, SPLIT_8, f"--gin_param=RLConfig.steps = {STEPS}"]
ASYNC_ARGS = [*ARGS, *[p for p in ASYNC if "RLConfig.steps" not in p and "save_interval_steps" not in p], SPLIT_8,
              f"--gin_param=RLConfig.steps = {STEPS}", "--gin_param=CheckpointConfig.save_interval_steps = 2"]


@dataclasses.dataclass
class Attempt:
    flags: list[str]
    kind: str  # "startup", "step", "save" or "finish"
    killed_after_s: float | None = None
    mid_save: bool | None = None  # a save's temporary directory of this attempt existed when it died
    latest_before: int | None = None  # the finished checkpoint it started from
    steps_logged: int = 0  # records in metrics.jsonl when it died


def _save_in_progress(checkpoints) -> set[str]:
    return {p.name for p in checkpoints.iterdir() if ".orbax-checkpoint-tmp" in p.name} if checkpoints.is_dir() \
        else set()


def _records(run_dir) -> int:
    """RL steps in metrics.jsonl (SFT's come first, at negative indices; a torn last line is not one)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return sum(not line.startswith('{"step": -') for line in lines)


def run_with_faults(args: list[str], run_dir, rng: random.Random) -> list[Attempt]:
    """Starts the run, SIGKILLs it KILLS times and resumes until it finishes; returns what each
    attempt did. Kill moments, in a seeded random order: "startup" (0-4 s after the start, before
    its first step: loading, SFT or compiling), "step" (once the attempt has finished a checkpoint,
    after 0-2 more steps are logged, then 0-0.5 s) and "save" (a checkpoint being written, 0-50 ms
    after its temporary directory appears)."""
    checkpoints = run_dir / "checkpoints"
    attempts: list[Attempt] = []
    kinds = ["startup"] + ["step", "save"] * ((KILLS - 1) // 2) + ["step"] * ((KILLS - 1) % 2)
    rng.shuffle(kinds)
    while True:
        steps = finalized_steps(checkpoints)
        flags = ["--resume"] if steps else (["--overwrite"] if run_dir.exists() else [])
        kind = kinds.pop() if kinds else "finish"
        attempt = Attempt(flags, kind, latest_before=steps[-1] if steps else None)
        attempts.append(attempt)
        leftovers = _save_in_progress(checkpoints)  # of a killed attempt; the new one removes them
        logged = _records(run_dir)
        proc = start_run([*args, *flags], run_dir)
        t0 = time.monotonic()
        if kind == "finish":
            assert proc.wait(timeout=900) == 0, f"the last attempt failed: {attempts}"
            return attempts
        # The attempt first drops the records past its checkpoint; count the steps it logs after.
        base = steps[-1] if steps else 0
        dropped = [logged <= base]

        def logged_more(k: int) -> bool:
            n = _records(run_dir)
            dropped[0] = dropped[0] or n <= base
            return dropped[0] and n > base + k

        if kind == "startup":  # loading, SFT or compiling: before this attempt's first step
            _wait_until(proc, lambda: logged_more(0), t0 + rng.uniform(0.0, 4.0))
        elif kind == "step":  # once this attempt has finished a checkpoint, so that the run moves on
            _wait_until(proc, lambda: (finalized_steps(checkpoints) or [-1])[-1] > base)
            seen = _records(run_dir)
            more = rng.randint(0, 2)
            _wait_until(proc, lambda: _records(run_dir) >= seen + more)
            time.sleep(rng.uniform(0.0, 0.5))
        else:
            _wait_until(proc, lambda: bool(_save_in_progress(checkpoints) - leftovers))
            time.sleep(rng.uniform(0.0, 0.05))
        if proc.poll() is not None:  # finished before the kill: the run is done
            assert proc.returncode == 0, f"attempt failed: {attempts}"
            attempt.kind += " (finished first)"
            return attempts
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        attempt.killed_after_s = round(time.monotonic() - t0, 2)
        attempt.mid_save = bool(_save_in_progress(checkpoints) - leftovers)
        attempt.steps_logged = _records(run_dir)


def _wait_until(proc, condition, deadline: float = math.inf) -> None:
    while proc.poll() is None and not condition() and time.monotonic() < deadline:
        time.sleep(0.002)


def _report(name: str, attempts: list[Attempt]) -> None:
    print(f"\n[fault injection] {name}: {len(attempts)} attempts")
    for a in attempts:
        print(f"  {a}")


@pytest.mark.slow  # ~5 min: seven training processes
def test_sync_run_killed_at_random_and_mid_save_ends_with_the_uninterrupted_weights(tmp_path):
    args = [*SYNC_ARGS, f"--compile_cache={tmp_path / 'xla'}"]
    straight, faulted = tmp_path / "straight", tmp_path / "faulted"
    assert start_run(args, straight).wait(timeout=900) == 0
    attempts = run_with_faults(args, faulted, random.Random(SEED))
    _report("sync", attempts)
    assert sum(a.killed_after_s is not None for a in attempts) == KILLS

    want, got = _by_step(straight), _by_step(faulted)
    assert sorted(got) == sorted(want) == list(range(STEPS))
    for step in range(STEPS):
        _assert_same_metrics({k: v for k, v in want[step].items() if not k.startswith(TIMING)},
                             {k: v for k, v in got[step].items() if not k.startswith(TIMING)}, step)
    assert_each_step_once_in_tensorboard(faulted, STEPS)
    assert_same_weights(final_weights(straight), final_weights(faulted))


@pytest.mark.slow  # ~5 min: six training processes
def test_async_run_killed_at_random_and_mid_save_records_each_step_once_within_eta(tmp_path):
    run_dir = tmp_path / "faulted"
    attempts = run_with_faults([*ASYNC_ARGS, f"--compile_cache={tmp_path / 'xla'}"], run_dir, random.Random(SEED + 1))
    _report("async", attempts)
    assert sum(a.killed_after_s is not None for a in attempts) == KILLS

    got = _by_step(run_dir)
    assert sorted(got) == list(range(STEPS)) and got[STEPS - 1]["version"] == STEPS
    assert_each_step_once_in_tensorboard(run_dir, STEPS)
    for step, m in got.items():
        assert m["staleness/max"] <= ETA, f"step {step} trained tokens {m['staleness/max']} versions old"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    resumes = summary.get("resumed", [])
    print(f"[fault injection] async resumes recorded in summary.json: {resumes}")
    assert resumes and resumes[-1]["step"] == next(a.latest_before for a in reversed(attempts) if a.latest_before)
    for r in resumes:
        assert r["capacity"] == min(ASYNC_CONCURRENT, (ETA + 1) * ASYNC_BATCH), r
