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
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from areal_jax.checkpoint import finalized_steps
from tests.test_resume import (ARGS, ROOT, ASYNC, ASYNC_BATCH, ASYNC_CONCURRENT, ETA, SPLIT_8, SYNC, TIMING,
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


# ---- issue 26: two writers, a corrupt latest step, SIGTERM, a full or read-only disk ----------------

# No SFT, a checkpoint only when asked (or forced by a stop), steps many enough to be caught mid-run.
LONG = [*ARGS, *SYNC[:2], SPLIT_8, "--gin_param=Stages.sft = False", "--gin_param=TaskSource.eval_size = 0",
        "--gin_param=Stages.plot = False", "--gin_param=RLConfig.eval_every = 0"]


def _start(args: list[str], run_dir, *flags: str, command: str = "train") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "areal_jax.cli", command, *args, f"--run_dir={run_dir}", *flags],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _one_line(proc: subprocess.Popen, code: int = 2, timeout: float = 600) -> str:
    """The process's exit code is `code` and stderr holds one `areal-jax:` line and no traceback."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == code, (proc.returncode, err[-3000:])
    lines = [line for line in err.splitlines() if line.startswith("areal-jax:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def _wait_records(proc, run_dir, n: int, timeout: float = 600) -> None:
    _wait_until(proc, lambda: _records(run_dir) >= n, time.monotonic() + timeout)
    assert proc.poll() is None, f"the run ended before {n} records: {proc.communicate()[1][-3000:]}"


def _run_past_step_3(tmp_path, run, steps: int, save_interval: int) -> tuple[list[str], subprocess.Popen]:
    """A LONG run of `steps` steps saving every `save_interval`, started and waited for until 3 steps
    are logged; returns its arguments and process."""
    args = [*LONG, f"--gin_param=RLConfig.steps = {steps}",
            f"--gin_param=CheckpointConfig.save_interval_steps = {save_interval}",
            f"--compile_cache={tmp_path / 'xla'}"]
    proc = _start(args, run)
    _wait_records(proc, run, 3)
    return args, proc


@pytest.mark.slow  # ~1.5 min: one run, four refused starts beside it
def test_a_second_writer_is_refused_while_a_run_holds_its_directory(tmp_path):
    run = tmp_path / "run"
    # Far more steps than the refused starts take: the run is stopped by SIGTERM once they are done.
    args, first = _run_past_step_3(tmp_path, run, 100000, 5)
    try:
        before = {p.name for p in run.iterdir()}
        second = [_start(args, run, *flags) for flags in ((), ("--overwrite",), ("--resume",))]
        second.append(_start(args, run, command="sft"))
        for proc in second:
            line = _one_line(proc)
            assert f"is in use by another run: pid {first.pid} on host" in line, line
        assert first.poll() is None and {p.name for p in run.iterdir()} == before
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=600)
    assert first.returncode == 143, err[-3000:]
    logged = _records(run)
    assert sorted(_by_step(run)) == list(range(logged))  # each step once
    assert_each_step_once_in_tensorboard(run, logged)
    assert finalized_steps(run / "checkpoints")[-1] == logged
    assert not (run / ".areal-jax.lock").exists()


@pytest.mark.slow  # ~2 min: a run, then three resumes over broken checkpoints
def test_resume_falls_back_past_a_corrupt_latest_step(tmp_path):
    run = tmp_path / "run"
    args = [*LONG, "--gin_param=CheckpointConfig.save_interval_steps = 1", f"--compile_cache={tmp_path / 'xla'}"]
    assert _start([*args, "--gin_param=RLConfig.steps = 4"], run).wait(timeout=600) == 0
    checkpoints = run / "checkpoints"
    assert finalized_steps(checkpoints) == [2, 3, 4]
    # A truncated data file in the newest step: resume from step 3, the bad step set aside.
    biggest = max((p for p in (checkpoints / "4" / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
                  key=lambda p: p.stat().st_size)
    os.truncate(biggest, biggest.stat().st_size // 2)
    proc = _start([*args, "--gin_param=RLConfig.steps = 6"], run, "--resume", "--override_config")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    warning = [line for line in err.splitlines() if "checkpoint step 4" in line]
    assert len(warning) == 1 and "truncated" in warning[0] and "resuming from step 3" in warning[0], err[-3000:]
    assert "resuming from checkpoint step 3" in out
    assert [p.name.split(".")[1].split("-")[0] for p in checkpoints.iterdir() if ".corrupt-" in p.name] == ["corrupt"]
    assert sorted(_by_step(run)) == list(range(6))
    # A missing meta/ in the newest, then _METADATA missing too in the one before: back two steps.
    paths_rm = [checkpoints / "6" / "meta", checkpoints / "5" / "state" / "_METADATA"]
    shutil.rmtree(paths_rm[0])
    paths_rm[1].unlink()
    proc = _start([*args, "--gin_param=RLConfig.steps = 6"], run, "--resume", "--override_config")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "meta/metadata is missing" in err and "state/_METADATA is missing" in err
    assert "resuming from checkpoint step 4" in out
    assert sorted(_by_step(run)) == list(range(6))
    # Nothing intact: one line, exit 2, nothing moved.
    for step in finalized_steps(checkpoints):
        (checkpoints / str(step) / "state" / "_METADATA").unlink()
    before = sorted(p.name for p in checkpoints.iterdir())
    line = _one_line(_start(args, run, "--resume"))
    assert "no intact checkpoint" in line and "state/_METADATA is missing" in line
    assert sorted(p.name for p in checkpoints.iterdir()) == before


@pytest.mark.slow  # ~1.5 min
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_checkpoints_the_last_step_and_the_resume_redoes_none(tmp_path, sig):
    run = tmp_path / "run"
    steps = 40
    # No checkpoint is due before the end: the only one mid-run is the signal's.
    args, proc = _run_past_step_3(tmp_path, run, steps, 1000)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err[-3000:]
    assert took < 60, took  # CheckpointConfig.save_on_signal_s
    logged = _records(run)
    assert finalized_steps(run / "checkpoints") == [logged], (logged, err[-2000:])
    assert not _save_in_progress(run / "checkpoints")
    proc = _start(args, run, "--resume")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert f"resuming from checkpoint step {logged}" in out  # nothing redone: it starts at the first unlogged step
    assert sorted(_by_step(run)) == list(range(steps))
    assert_each_step_once_in_tensorboard(run, steps)
    print(f"[fault injection] {sig.name}: stopped {took:.1f} s after the signal with {logged} steps logged, "
          f"checkpoint {logged}")


def _mount_tmpfs(where, size: str) -> str | None:
    """Mounts a tmpfs of `size` at `where`; None if it worked, else why not (the test skips)."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    return None if done.returncode == 0 else f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}"


@pytest.mark.slow  # ~2 min
@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_full_or_read_only_disk_is_one_line_and_the_last_checkpoint_resumes(tmp_path, fault):
    fs = tmp_path / "fs"
    why = _mount_tmpfs(fs, "64m")
    if why:
        pytest.skip(why)
    try:
        run = fs / "run"
        steps = 12
        args, proc = _run_past_step_3(tmp_path, run, steps, 1)
        if fault == "full":
            subprocess.run(["dd", "if=/dev/zero", f"of={fs / 'filler'}", "bs=1M"], capture_output=True)
        else:  # a read-only bind mount over the run directory: every file opened from now on is read-only
            # (remounting the tmpfs itself is refused while the run has files open for writing)
            assert subprocess.run(["mount", "--bind", str(run), str(run)]).returncode == 0
            assert subprocess.run(["mount", "-o", "remount,bind,ro", str(run)]).returncode == 0
        line = _one_line(proc, code=74)
        assert line.startswith("areal-jax: storage error: ") and str(fs) in line, line
        assert ("no space left" if fault == "full" else "read-only file system") in line, line
        assert "MiB free of" in line and "--resume" in line

        def leftovers() -> list[str]:
            return [str(p) for p in run.rglob("*") if "tmp" in p.name and p.name != "tensorboard"]

        # A full disk: the failed save's directory is gone at once. A read-only one cannot be cleaned
        # until it is writable again: the resume removes it (below).
        assert fault != "full" or not leftovers(), leftovers()
        latest = finalized_steps(run / "checkpoints")
        assert latest
        # Room again: the last finished checkpoint resumes and the run ends with every step once.
        if fault == "full":
            (fs / "filler").unlink()
        else:
            assert subprocess.run(["umount", str(run)]).returncode == 0
        proc = _start(args, run, "--resume")
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert sorted(_by_step(run)) == list(range(steps)) and not leftovers()
        print(f"[fault injection] disk {fault}: {line} | resumed from {latest[-1]}")
    finally:
        subprocess.run(["umount", "-l", str(run)], capture_output=True)  # the bind mount, if still there
        subprocess.run(["umount", "-l", str(fs)])
