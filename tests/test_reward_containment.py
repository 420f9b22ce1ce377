"""Reward processes contained (areal_jax/reward/containment.py): whatever a reward starts, a child or a
double-forked `setsid` daemon, is gone when its call ends, when the call is killed at its deadline,
and when the pool's owner is SIGKILLed; a reward past RewardPoolConfig.memory_mb fails alone."""

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from areal_jax.reward.containment import _PYMP_PREFIX
from areal_jax.reward.pool import RewardPool, RewardPoolConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pids(pid_file: pathlib.Path) -> list[int]:
    return [int(p) for p in pid_file.read_text().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def test_what_a_call_starts_ends_with_it_and_with_a_deadline_kill(tmp_path):
    with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=30.0)) as pool:
        done = tmp_path / "done"
        assert pool.submit("tests.reward_fixtures:fork_child_and_daemon", str(done)).result() == 1.0
        pids = _pids(done)
        assert len(pids) == 2
        assert _wait_gone(pids, timeout=2.0) == []
        killed = tmp_path / "killed"
        future = pool.submit_call("tests.reward_fixtures:fork_child_and_daemon", (str(killed), 600.0), timeout_s=3.0)
        assert future.result() == 0.0 and pool.stats().timeouts == 1
        assert len(_pids(killed)) == 2 and _wait_gone(_pids(killed), timeout=2.0) == []
        assert pool.submit("tests.reward_fixtures:add", 1, 2).result() == 3  # the replacement works


_OWNER = """
import sys, time
from areal_jax.reward.pool import RewardPool, RewardPoolConfig
pool = RewardPool(RewardPoolConfig(num_workers=2, timeout_s=600.0))
futures = [pool.submit("tests.reward_fixtures:fork_child_and_daemon", sys.argv[1], 600.0) for _ in range(2)]
print("submitted", flush=True)
time.sleep(600)
"""


def test_a_sigkilled_owner_leaves_no_reward_process_and_no_pymp_directory(tmp_path):
    pid_file = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(pid_file)], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (pid_file.exists() and len(pid_file.read_text().split()) == 4):
        time.sleep(0.05)
    pids = _pids(pid_file)
    assert len(pids) == 4
    pymp = [p for p in os.listdir(tempfile.gettempdir()) if p.startswith(f"{_PYMP_PREFIX}{owner.pid}-")]
    assert len(pymp) == 1
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert _wait_gone(pids) == []
    assert os.path.isdir(os.path.join(tempfile.gettempdir(), pymp[0]))  # nobody ran the owner's cleanup
    with RewardPool(RewardPoolConfig(num_workers=1)) as pool:  # the next pool sweeps it
        assert pool.submit("tests.reward_fixtures:add", 1, 1).result() == 2
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), pymp[0]))


def test_a_reward_past_its_memory_cap_fails_alone(tmp_path):
    with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=60.0, memory_mb=1024)) as pool:
        assert pool.submit("tests.reward_fixtures:hog_memory", 256).result() == 1.0
        started = pool.stats().workers_started
        # Submitted together: the second must not reach the worker that is exiting after its MemoryError.
        failing = pool.submit("tests.reward_fixtures:hog_memory", 4096)
        after = pool.submit("tests.reward_fixtures:hog_memory", 256)
        assert failing.result() == 0.0
        assert after.result() == 1.0  # a fresh worker
        stats = pool.stats()
        assert (stats.errors, stats.crashes, stats.succeeded) == (1, 0, 2)
        assert stats.workers_started == started + 1


@pytest.mark.slow  # ~40 s: a two-step run whose reward leaves processes behind at every call
def test_nothing_a_reward_started_outlives_train(tmp_path):
    from tests.test_resume import ARGS, SPLIT_8

    pid_file = tmp_path / "pids"
    pid_file.write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "AREAL_TEST_PID_FILE": str(pid_file)}
    args = [*ARGS, SPLIT_8, "--gin_param=RLConfig.steps = 2", "--gin_param=Stages.sft = False",
            "--gin_param=TaskSource.eval_size = 0",
            "--gin_param=RLVRConfig.reward = 'tests.reward_fixtures:forking_reward'"]
    done = subprocess.run([sys.executable, "-m", "areal_jax.cli", "train", *args, f"--run_dir={tmp_path / 'run'}"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    pids = _pids(pid_file)
    assert len(pids) >= 2 * 2 * 2  # a child and a daemon per call, 2 steps x 2 prompts x 2 samples at least
    assert [p for p in pids if _alive(p)] == []
