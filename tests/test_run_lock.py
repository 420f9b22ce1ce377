"""The run-directory lock (areal_jax/jobs/run_lock.py): one holder at a time, refused in one line
naming the holder, a killed holder's lock taken over, nothing left behind by a refused run; the
lease on gs:// (tests/fake_gcs.py) refused while fresh and taken over when stale."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from areal_jax.jobs.inputs import InputError
from areal_jax.jobs.run_lock import LEASE_NAME, LOCK_NAME, STALE_S, RunDirBusy, RunLock
from tests.fake_gcs import fake_gcs


def test_a_second_holder_is_refused_naming_the_first_and_nothing_is_left(tmp_path):
    run = tmp_path / "a" / "run"
    first = RunLock(run)
    first.acquire()
    record = json.loads((run / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(RunDirBusy) as refused:
        RunLock(run).acquire()
    message = str(refused.value)
    assert "\n" not in message and f"pid {os.getpid()}" in message and socket.gethostname() in message
    assert record["started"] in message
    first.release()
    # The directory the lock made is gone with it (it held nothing else).
    assert not run.exists() and (tmp_path / "a").is_dir()
    run.mkdir()
    with RunLock(run):
        (run / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # the lock file goes, the run stays


def test_a_file_in_the_path_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    for run in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(InputError, match="is a file, not a directory"):
            RunLock(run).acquire()


_HOLDER = """
import sys, time
from areal_jax.jobs.run_lock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_the_lock_of_a_killed_holder_is_taken_over(tmp_path, caplog):
    run = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid} "):
            RunLock(run).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (run / LOCK_NAME).exists()  # left behind by the kill
    with caplog.at_level(logging.WARNING), RunLock(run):
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"pid {holder.pid} " in caplog.text and "taking over" in caplog.text


def _lease_record(**changes) -> str:
    now = time.time()
    record = {"host": "other-host", "pid": 4242, "started": "earlier", "started_unix": now - 10,
              "heartbeat_unix": now, "boot_id": "x", "proc_start": "1", "command": "areal-jax train"}
    return json.dumps({**record, **changes})


@pytest.fixture
def gcs(monkeypatch):
    with fake_gcs(monkeypatch) as fs:
        yield fs


def test_a_fresh_lease_on_gcs_is_refused_a_stale_one_taken_over(gcs, caplog):
    from areal_jax import paths

    run = "gs://bkt/run"
    lease = paths.as_path(run) / LEASE_NAME
    lease.write_text(_lease_record())
    with pytest.raises(RunDirBusy, match="pid 4242 on host other-host .* renewed 0 s ago"):
        RunLock(run).acquire()
    lease.write_text(_lease_record(heartbeat_unix=time.time() - STALE_S - 1))
    with caplog.at_level(logging.WARNING), RunLock(run):
        mine = json.loads(lease.read_text())
        assert mine["pid"] == os.getpid()
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()} "):  # same host, live process: refused
            RunLock(run).acquire()
    assert "taking over the lease" in caplog.text
    assert not lease.exists()  # released


def test_a_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(gcs):
    from areal_jax import paths
    from areal_jax.jobs import run_lock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lease = paths.as_path("gs://bkt/run") / LEASE_NAME
    lease.write_text(_lease_record(host=socket.gethostname(), boot_id=run_lock._boot_id(), pid=dead.pid,
                                   proc_start="0"))
    with RunLock("gs://bkt/run"):
        assert json.loads(lease.read_text())["pid"] == os.getpid()
