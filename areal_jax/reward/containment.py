"""Every process a reward function starts ends with its call, and with the pool however the pool's
owner ends; a reward's memory is capped.

The process tree of one pool worker (Linux; elsewhere only the memory cap and the owner's sweep):

    pool owner (trainer) -> [fork server] -> guardian G -> worker W -> what the reward starts

- W runs the reward calls in its own session (setsid: its own process group, so a terminal's
  signals and group kills aimed at the trainer do not reach it, nor the other way) and is a child
  subreaper (PR_SET_CHILD_SUBREAPER): an orphan anywhere below it, a double-forked `setsid` daemon
  included, is reparented to W rather than to init. So after each call every live descendant of W
  is one of W's children, and W kills them all (`kill_descendants`) before it replies.
- G is a subreaper too, forks W, and waits. When W ends (a deadline kill, a crash) G kills whatever
  W left below it; when G's parent dies (the owner was SIGKILLed and the fork server went with it) G
  gets SIGTERM (its parent-death signal) and does the same. A process leaving its session cannot
  leave G's subtree.
- The owner's sweep: a worker the pool kills (deadline, close) is killed with its whole tree, frozen
  first (SIGSTOP on every member until no new one appears, then SIGKILL), so nothing forks its way out.
- W's address space is capped (RLIMIT_AS, RewardPoolConfig.memory_mb) and every process it starts
  inherits the cap: a leaking reward gets MemoryError (an error, scored 0.0) or dies (a crash, 0.0),
  and the trainer's memory is left alone.

The fork server's temporary directory (`/tmp/pymp-*`) is named after its owner's pid here, so the
directory of an owner that was SIGKILLed is removed by the next pool (`sweep_orphaned_pymp_dirs`).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
import re
import resource
import shutil
import signal
import sys
import tempfile
import time

__all__ = ["become_subreaper", "cap_address_space", "descendants", "kill_descendants", "kill_tree", "own_pymp_dir",
           "signal_on_parent_death", "sweep_orphaned_pymp_dirs"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PYMP_PREFIX = "pymp-areal-"


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def signal_on_parent_death(sig: int) -> bool:
    """Asks the kernel to send `sig` to this process when its parent dies (PR_SET_PDEATHSIG)."""
    return _prctl(_PR_SET_PDEATHSIG, sig)


def become_subreaper() -> bool:
    """Orphans of this process's descendants are reparented to it (Linux); False where unsupported."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def cap_address_space(memory_mb: int | None) -> None:
    """RLIMIT_AS of this process (and of everything it starts) to `memory_mb` MiB; None: unchanged."""
    if memory_mb is None:
        return
    limit = memory_mb << 20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError) as e:  # a platform without RLIMIT_AS enforcement (macOS)
        logging.getLogger(__name__).warning("RewardPoolConfig.memory_mb not applied: %s", e)


def _children_map() -> dict[int, list[int]]:
    """ppid -> pids over every process (one pass over /proc)."""
    out: dict[int, list[int]] = {}
    if not os.path.isdir("/proc"):  # no procfs (macOS): the process group and the memory cap remain
        return out
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(int(entry))
    return out


def has_children(pid: int | None = None) -> bool:
    """Whether `pid` (default: this process) has a child, from /proc/PID/task/*/children when the
    kernel offers it (cheap), else from a scan of /proc."""
    pid = os.getpid() if pid is None else pid
    files = glob.glob(f"/proc/{pid}/task/*/children")
    if not files:
        return bool(_children_map().get(pid))
    for path in files:
        with contextlib.suppress(OSError), open(path) as f:
            if f.read().strip():
                return True
    return False


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, parents before children."""
    tree = _children_map()
    out, frontier = [], [pid]
    while frontier:
        nxt = [c for p in frontier for c in tree.get(p, ())]
        out += nxt
        frontier = nxt
    return out


def _signal_all(pids, sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def kill_descendants(pid: int | None = None) -> int:
    """SIGKILLs every descendant of `pid` (default: this process), frozen first so none can fork
    past the sweep; this process reaps those that are its children. Returns how many were killed."""
    root = os.getpid() if pid is None else pid
    frozen: set[int] = set()
    for _ in range(100):  # a fork bomb is stopped member by member; bounded all the same
        new = [p for p in descendants(root) if p not in frozen]
        if not new:
            break
        _signal_all(new, signal.SIGSTOP)
        frozen.update(new)
    _signal_all(frozen, signal.SIGKILL)
    if root == os.getpid():
        _reap(frozen)
    return len(frozen)


def kill_tree(pid: int) -> int:
    """SIGKILLs `pid` and every descendant, all frozen first (the owner's sweep of a worker)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGSTOP)
    killed = kill_descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
    return killed + 1


def _reap(pids: set[int], timeout_s: float = 5.0) -> None:
    """Waits for the killed processes that became this process's children (zombies otherwise)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if not any(os.path.exists(f"/proc/{p}") for p in pids):
                return
            time.sleep(0.005)


# (the guardian G: reward/guardian.py)


# ---- the fork server's temporary directory ---------------------------------------------------


def own_pymp_dir() -> None:
    """Makes multiprocessing's temporary directory of this process (where the fork server's socket
    lives) `/tmp/pymp-areal-<pid>-*` before multiprocessing makes an anonymous one, so that a pool
    owner killed before its cleanup ran leaves a directory the next pool can attribute."""
    from multiprocessing import process, util

    config = process.current_process()._config  # multiprocessing has no public setter for it
    if config.get("tempdir") is not None:
        return
    path = tempfile.mkdtemp(prefix=f"{_PYMP_PREFIX}{os.getpid()}-")
    util.Finalize(None, shutil.rmtree, args=(path, True), exitpriority=-100)
    config["tempdir"] = path


def sweep_orphaned_pymp_dirs() -> None:
    """Removes `pymp-areal-<pid>-*` directories whose pid no longer runs."""
    pattern = re.compile(re.escape(_PYMP_PREFIX) + r"(\d+)-")
    for path in glob.glob(os.path.join(tempfile.gettempdir(), _PYMP_PREFIX + "*")):
        match = pattern.match(os.path.basename(path))
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            shutil.rmtree(path, ignore_errors=True)
