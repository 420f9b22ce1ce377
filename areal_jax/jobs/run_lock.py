"""One writer per run directory: `train`, `train --resume` and `sft` hold an exclusive lock on their
run directory for the run's whole life, taken before anything is written there (--overwrite's
removal included); a second run on the same directory is refused with one line naming the holder.

Local directories: an `fcntl.flock` on `<run_dir>/.areal-jax.lock`, whose content records the
holder (host, pid, start time, command). The kernel drops the lock when its process ends, however
it ends, so a lock file left by a killed run is simply taken over (with a warning naming the
earlier holder). On a filesystem that refuses flock (some network filesystems) the record itself
is the lock, as on an object store (below).

Object stores (gs://) have no locks: the run writes a lease object `<run_dir>/.areal-jax.lease`
with the same record plus a heartbeat time it rewrites every HEARTBEAT_S. A run finding a lease
whose heartbeat is younger than STALE_S (or, on the same host, whose process still lives) is
refused; an older one was left by a run that died and is taken over. This refuses the obvious case
(a second run on a live one); two runs started within the same moment can both pass, since
the lease is written and read back without a conditional write. One writer per gs:// directory
remains the user's contract there.

Multi-process runs: process 0 holds the lock; every process refuses together (on_every_process).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

import jax

from areal_jax import paths
from areal_jax.jobs.inputs import InputError, on_every_process

logger = logging.getLogger(__name__)

LOCK_NAME = ".areal-jax.lock"
LEASE_NAME = ".areal-jax.lease"
HEARTBEAT_S = 30.0  # a lease's heartbeat is rewritten this often
STALE_S = 120.0  # a lease not refreshed for this long belongs to a run that died
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class RunDirBusy(InputError):
    """Another live run holds the run directory."""


def _record() -> dict:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "started_unix": now, "heartbeat_unix": now, "boot_id": _boot_id(), "proc_start": _proc_start(os.getpid()),
            "command": " ".join(sys.argv)[:500]}


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/pid/stat): with the
    pid, it names one process (a pid reused later has another start time)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _holder_text(record: dict | None) -> str:
    if not record:
        return "a run that is starting (its record is not written yet)"
    return (f"pid {record.get('pid')} on host {record.get('host')} since {record.get('started')}"
            + (f" ({record['command']})" if record.get("command") else ""))


def _holder_alive(record: dict) -> bool | None:
    """Whether the recorded holder still runs: known on the same host and boot; None elsewhere."""
    if record.get("host") != socket.gethostname() or record.get("boot_id") != _boot_id():
        return None
    pid = record.get("pid")
    if not isinstance(pid, int):
        return False
    start = _proc_start(pid)
    return start is not None and (record.get("proc_start") in (None, start))


class RunLock:
    """The exclusive lock of one run directory; `acquire` raises RunDirBusy (or InputError for a
    path that cannot be a directory), `release` undoes everything acquire created."""

    def __init__(self, run_dir: paths.PathLike):
        self.run_dir = paths.as_path(run_dir)
        self._fd: int | None = None
        self._lease: paths.Path | None = None
        self._record: dict | None = None
        self._created_dir = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # ---- acquire ----------------------------------------------------------------------------

    def acquire(self) -> None:
        try:
            paths.check_reachable(self.run_dir, "--run_dir")
        except ValueError as e:
            raise InputError(str(e)) from None
        if paths.is_remote(self.run_dir):
            self._take_lease(self.run_dir / LEASE_NAME)
            return
        self._make_dir()
        try:
            self._take_flock()
        except BaseException:
            self._remove_created_dir()
            raise

    def _make_dir(self) -> None:
        if self.run_dir.is_dir():
            return
        existing = self.run_dir.absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise InputError(f"--run_dir {self.run_dir}: {existing} is a file, not a directory")
        try:
            self.run_dir.mkdir(parents=True)
            self._created_dir = True
        except FileExistsError:  # made by a run starting beside this one: the lock decides
            pass
        except OSError as e:
            if e.errno in _STORAGE_ERRNOS:  # a full or read-only disk: reported as such (jobs/errors.py, exit 74)
                raise
            raise InputError(f"--run_dir {self.run_dir}: cannot create it: {e.strerror}") from None

    def _take_flock(self) -> None:
        path = self.run_dir / LOCK_NAME
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if e.errno in _STORAGE_ERRNOS:
                    raise
                raise InputError(f"--run_dir {self.run_dir}: cannot create its lock file {path}: "
                                 f"{e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read_record_fd(fd)
                os.close(fd)
                raise RunDirBusy(f"--run_dir {self.run_dir} is in use by another run: {_holder_text(record)}; "
                                 "wait for it to end or choose another --run_dir") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in _NO_FLOCK:
                    raise
                logger.warning("%s: the filesystem refuses flock (%s): the lock is a lease record", path, e.strerror)
                self._take_lease(self.run_dir / LEASE_NAME)
                return
            # The file may have been unlinked by its holder's release between our open and flock:
            # a lock on a name no longer in the directory guards nothing, so start over.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            break
        earlier = _read_record_fd(fd)
        if earlier:
            logger.warning("%s: taking over the lock of a run that ended without releasing it (%s)",
                           self.run_dir, _holder_text(earlier))
        self._record = _record()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self._record).encode(), 0)
        self._fd = fd

    def _take_lease(self, lease: paths.Path) -> None:
        earlier = _read_record_path(lease)
        if earlier:
            alive = _holder_alive(earlier)
            age = time.time() - float(earlier.get("heartbeat_unix", 0))
            if alive or (alive is None and age < STALE_S):
                raise RunDirBusy(f"--run_dir {self.run_dir} is in use by another run: {_holder_text(earlier)}, "
                                 f"lease {lease} renewed {max(age, 0):.0f} s ago; wait for it to end (a lease "
                                 f"not renewed for {STALE_S:.0f} s is taken over) or choose another --run_dir")
            logger.warning("%s: taking over the lease of a run that ended without releasing it (%s)",
                           self.run_dir, _holder_text(earlier))
        self._record = _record()
        self._lease = lease
        self._write_lease()
        # Read back: of two runs writing at once, the one whose record is not there gives way.
        if (_read_record_path(lease) or {}).get("started_unix") != self._record["started_unix"]:
            self._lease = None
            raise RunDirBusy(f"--run_dir {self.run_dir} was taken by another run starting at the same moment: "
                             f"{_holder_text(_read_record_path(lease))}")
        self._heartbeat = threading.Thread(target=self._renew, name="run-dir-lease", daemon=True)
        self._heartbeat.start()

    def _write_lease(self) -> None:
        assert self._lease is not None and self._record is not None
        self._record["heartbeat_unix"] = time.time()
        paths.write_whole(self._lease, json.dumps(self._record))

    def _renew(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write_lease()
            except Exception as e:  # a transient store error: the next beat tries again
                logger.warning("run directory lease %s not renewed: %s", self._lease, e)

    # ---- release ----------------------------------------------------------------------------

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        if self._lease is not None:
            with contextlib.suppress(Exception):
                if (_read_record_path(self._lease) or {}).get("started_unix") == self._record["started_unix"]:
                    paths.remove(self._lease)
            self._lease = None
        if self._fd is not None:
            # Unlinked while still held, so no other run can lock this inode after us and believe it
            # holds the directory (acquire re-checks the name's inode).
            with contextlib.suppress(OSError):
                os.unlink(self.run_dir / LOCK_NAME)
            os.close(self._fd)
            self._fd = None
        self._remove_created_dir()

    def _remove_created_dir(self) -> None:
        # A run refused after making the directory leaves none behind (only when still empty).
        if self._created_dir:
            with contextlib.suppress(OSError):
                os.rmdir(self.run_dir)
            self._created_dir = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_record_fd(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 65536, 0)
        return json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None


def _read_record_path(path: paths.Path) -> dict | None:
    try:
        text = path.read_text() if path.exists() else ""
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def hold_run_dir(run_dir: paths.PathLike) -> Iterator[RunLock | None]:
    """Holds `run_dir` for the body: on process 0 its RunLock (the others hold nothing); a refusal
    on process 0 is raised on every process."""
    lock = RunLock(run_dir) if jax.process_index() == 0 else None
    on_every_process(lambda: lock.acquire() if lock is not None else None)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
