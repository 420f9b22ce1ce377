"""The sandbox that runs model-written programs: one process tree per run, limited, isolated, and
swept away afterwards, built from plain POSIX tools and one Linux namespace.

When the caller is root (the normal case on accelerator hosts):
- The program runs under a fresh, otherwise unused uid/gid (no supplementary groups), one per
  run. RLIMIT_NPROC is counted per uid and is not enforced for root, so a private uid is what
  makes the process limit real, keeps concurrent sandboxes from eating each other's process
  budget, and lets cleanup find every process the run created.
- No network at all, loopback included: the bootstrap enters a fresh network namespace (whose
  only interface, lo, is down) before it drops to the private uid, so a connect to 127.0.0.1
  fails with "Network is unreachable". A namespace needs CAP_SYS_ADMIN; where it cannot be made
  (not root, or a container without that capability) a run is refused (`SandboxUnavailable`)
  unless `SandboxLimits.allow_network` opts in to the host's network.
- The working directory is a private 0700 directory owned by that uid; HOME and TMPDIR point
  there. Root-owned directories (the repository, /root, site-packages) are not writable; 0700
  directories such as /root are not even readable.
- A private mount namespace (where one can be made: `filesystem_isolation_available`): /tmp,
  /var/tmp, /dev/shm and /run/lock are one fresh tmpfs of `disk_mb` (the program's home is in it),
  so what it writes is capped in total and gone with the run; /proc is mounted with hidepid=2, so
  no other process (the trainer's command line, which names its data) is visible; every
  `hidden_paths` entry (the job's data files, run and checkpoint directories) is empty.
When the caller is not root the program runs under the caller's uid (NPROC is then set to the
caller's current task count plus the allowance, and files the caller can write are writable).

Always:
- rlimits: CPU seconds, address space, processes (threads count), file size (stdout is a file,
  so this also caps output), open files, no core dumps;
- wall clock: a small bootstrap process starts the program, enforces the wall clock, and as a
  child subreaper adopts every orphan the program leaves, then SIGKILLs and reaps all of its
  descendants before it exits, so nothing outlives a test case;
- environment: only PATH, LANG, HOME, TMPDIR; python runs with -I (isolated) and -S (no
  site-packages: standard library only) unless ``site_packages=True``.

Cleanup has three owners. After each run the calling process sweeps the run's uid (processes, and
its files in /tmp, /var/tmp, /dev/shm). If the calling process itself dies mid-run (a reward pool
worker killed at its deadline), the process that supervises it calls
`sweep_sandboxes_of(worker_pid)`: a run's directory is named after the process that made it and
its uid is drawn from a range keyed by that pid, so both are found without the dead process. If
the supervisor dies too (SIGKILL), the bootstrap and the program die with the worker
(parent-death signals) and the next pool to start sweeps the directories of dead pids
(`sweep_orphaned_sandboxes`).

Residual risks, stated plainly: without a mount namespace, /tmp, /var/tmp and /dev/shm stay
world-writable (swept after a root-mode run) and the data files are readable; world-readable files
other than `hidden_paths` can be read (a copy of the data elsewhere, e.g. a datasets cache); in
non-root mode a program that leaves both its session and its directory can outlive a killed worker. Use containers on top if completions
are adversarial rather than merely buggy.

The interpreter is the running Python if the sandbox uid may execute it, otherwise the system
``python3`` (e.g. a pyenv Python under a 0700 /root is unreachable for other uids).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import itertools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["RunResult", "SandboxLimits", "SandboxUnavailable", "check_network_isolation", "default_limits",
           "filesystem_isolation_available", "network_isolation_available", "run_program", "set_default_limits", "sweep_orphaned_sandboxes",
           "sweep_sandboxes_of"]

logger = logging.getLogger(__name__)

# Private uids live far above any real account: base + (pid << 8 | per-process counter), so the
# 256 uids of one process's runs are known from its pid alone.
_UID_BASE = 1_500_000_000
_uid_counter = itertools.count()
_SHARED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
_DIR_PREFIX = "areal-sandbox-"
WALL_TIMEOUT_EXIT = 124
STARTUP_FAILED_EXIT = 126
_CLONE_NEWNET = 0x40000000


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot isolate the program as configured (no network namespace)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run (a code reward's test case).

    wall_s: wall-clock seconds per test case (enforced by the bootstrap, backstopped here).
    cpu_s: CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds).
    memory_mb: address space per process (RLIMIT_AS); the interpreter needs ~30 MB of it.
    max_processes: tasks (processes + threads) the program may have, itself included.
    file_size_mb: largest file the program may write, stdout included (RLIMIT_FSIZE).
    open_files: RLIMIT_NOFILE.
    python: interpreter for the program; None picks one the sandbox uid can execute.
    run_as_uid: uid (and gid) to run under when root; None allocates a fresh private uid
        per run (recommended: cleanup then kills by uid and sweeps shared tmp dirs).
    site_packages: let the program import site-packages of its interpreter (drops -S).
    allow_network: run the program with the host's network (no network namespace). Off, a host
        that cannot make a namespace (not root, no CAP_SYS_ADMIN) refuses to run untrusted code.
    disk_mb: everything the program may write (its home, /tmp, /var/tmp, /dev/shm: one private
        tmpfs of this size, gone with the run), where a mount namespace can be made (root).
    hidden_paths: files and directories the program must not see (emptied in its mount namespace):
        a job adds its data files and its run directory (the expected outputs of code test cases).
    """

    wall_s: float = 4.0
    cpu_s: float = 2.0
    memory_mb: int = 512
    max_processes: int = 8
    file_size_mb: int = 16
    open_files: int = 64
    python: str | None = None
    run_as_uid: int | None = None
    site_packages: bool = False
    allow_network: bool = False
    disk_mb: int = 64
    hidden_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_paths", tuple(self.hidden_paths))
        if not all(isinstance(p, str) and os.path.isabs(p) for p in self.hidden_paths):
            raise ValueError(f"SandboxLimits.hidden_paths must be absolute paths, got {self.hidden_paths!r}")
        for name in ("wall_s", "cpu_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive finite number, got {value!r}")
        for name, low in (("memory_mb", 32), ("max_processes", 1), ("file_size_mb", 1), ("open_files", 8),
                          ("disk_mb", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"SandboxLimits.{name} must be an int >= {low}, got {value!r}")
        if self.python is not None and not os.path.isabs(self.python):
            raise ValueError(f"SandboxLimits.python must be an absolute path, got {self.python!r}")
        if self.run_as_uid is not None and (not isinstance(self.run_as_uid, int) or not 0 < self.run_as_uid < 2**32 - 1):
            raise ValueError(f"SandboxLimits.run_as_uid must be a non-root uid, got {self.run_as_uid!r}")
        for name in ("site_packages", "allow_network"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SandboxLimits.{name} must be a bool, got {getattr(self, name)!r}")


_default_limits = SandboxLimits()


def default_limits() -> SandboxLimits:
    """The limits of runs that name none (a reward pool worker sets its pool's)."""
    return _default_limits


def set_default_limits(limits: SandboxLimits) -> None:
    global _default_limits
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be SandboxLimits, got {type(limits).__name__}")
    _default_limits = limits


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One finished run: exit code (124: wall clock), stdout, the tail of stderr, the uid it ran as."""

    exit_code: int
    stdout: str
    stderr_tail: str
    uid: int


# ----------------------------------------------------------------------------- network isolation


@functools.lru_cache(maxsize=1)
def network_isolation_available() -> bool:
    """Whether this host lets the sandbox make a network namespace (tried once, in a child)."""
    if os.geteuid() != 0:
        return False
    probe = ("import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
             f"sys.exit(0 if libc.unshare({_CLONE_NEWNET}) == 0 else 1)")
    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", probe], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=1)
def filesystem_isolation_available() -> bool:
    """Whether this host lets the sandbox make a private mount namespace (root with CAP_SYS_ADMIN):
    then a program sees its own /tmp and processes only, and no `hidden_paths`."""
    if os.geteuid() != 0:
        return False
    probe = ("import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
             "sys.exit(0 if libc.unshare(0x00020000) == 0 else 1)")
    try:
        return subprocess.run([sys.executable, "-I", "-S", "-c", probe], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def check_network_isolation(limits: SandboxLimits) -> None:
    """Raises SandboxUnavailable (one line) when untrusted code would run with the host's network
    without the user having opted in."""
    if limits.allow_network or network_isolation_available():
        return
    why = "the process is not root" if os.geteuid() != 0 else "unshare(CLONE_NEWNET) is not permitted here"
    raise SandboxUnavailable(
        f"SandboxLimits.allow_network: the code sandbox cannot give programs a network namespace ({why}), "
        "so they would reach the host's network, 127.0.0.1 included; refusing to run them. Run as root with "
        "CAP_SYS_ADMIN, or bind SandboxLimits.allow_network = True to accept the risk")


# ----------------------------------------------------------------------------- one run

# Starts as root (root mode) or as the caller. argv: wall cpu mem nproc fsize nofile python site_flag
# script uid netns_flag fs_flag disk_bytes hidden_paths(json). Enters the network namespace while it
# still may; with fs_flag, a private mount namespace too (see _private_view); then drops to the uid
# (which also clears a parent-death signal, so that is set after).
_BOOTSTRAP = r"""
import json, os, resource, signal, sys
wall, cpu, mem, nproc, fsize, nofile = float(sys.argv[1]), *map(int, sys.argv[2:7])
python, site, script = sys.argv[7], sys.argv[8] == "1", sys.argv[9]
uid, netns, fs, disk, hidden = int(sys.argv[10]), sys.argv[11] == "1", sys.argv[12] == "1", int(sys.argv[13]), json.loads(sys.argv[14])
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
if netns and libc.unshare(0x40000000) != 0:
    print("sandbox: unshare(CLONE_NEWNET) failed:", os.strerror(ctypes.get_errno()), file=sys.stderr)
    os._exit(126)

def mount(source, target, kind, flags, data=None):
    if libc.mount(source.encode(), target.encode(), kind and kind.encode(), flags, data and data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {kind or source} on {target}: {os.strerror(ctypes.get_errno())}")

if fs:  # private view: own /tmp (capped, gone afterwards), /proc showing own processes only, hidden paths
    try:
        with open(script, "rb") as f:
            source = f.read()
        if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS): " + os.strerror(ctypes.get_errno()))
        NOSUID, NODEV, NOEXEC, RDONLY, BIND, REC, PRIVATE = 0x2, 0x4, 0x8, 0x1, 0x1000, 0x4000, 0x40000
        mount("none", "/", None, REC | PRIVATE)  # nothing mounted here reaches the host
        mount("tmpfs", "/tmp", "tmpfs", NOSUID | NODEV, f"size={disk},mode=1777")
        for shared in ("/var/tmp", "/dev/shm", "/run/lock"):  # the other world-writable places: the same tmpfs
            if os.path.isdir(shared) and not os.path.islink(shared):
                mount("/tmp", shared, None, BIND)
        mount("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC, "hidepid=2")  # other uids' processes: invisible
        for path in hidden:
            if os.path.isdir(path):
                mount("tmpfs", path, "tmpfs", NOSUID | NODEV | NOEXEC | RDONLY, "size=4k,mode=000")
            elif os.path.exists(path):
                mount("/dev/null", path, None, BIND)
        home = "/tmp/home"
        os.mkdir(home, 0o700)
        os.chown(home, uid, uid)
        script = os.path.join(home, "solution.py")
        with open(script, "wb") as f:
            f.write(source)
        os.chdir(home)
        os.environ.update(HOME=home, TMPDIR=home)
    except OSError as e:
        print("sandbox: private filesystem view failed:", e, file=sys.stderr)
        os._exit(126)
if os.getuid() != uid:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
libc.prctl(1, 9)   # PR_SET_PDEATHSIG: die with the caller
libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of the program come to us
child = os.fork()
if child == 0:
    try:
        libc.prctl(1, 9)  # the program dies with the bootstrap, whatever kills that
        R = resource
        for res, soft, hard in ((R.RLIMIT_CORE, 0, 0), (R.RLIMIT_AS, mem, mem), (R.RLIMIT_CPU, cpu, cpu + 1),
                                (R.RLIMIT_NPROC, nproc, nproc), (R.RLIMIT_FSIZE, fsize, fsize),
                                (R.RLIMIT_NOFILE, nofile, nofile)):
            R.setrlimit(res, (soft, hard))
        flags = ["-I", "-B"] + ([] if site else ["-S"])
        os.execv(python, [python, *flags, script])
    except BaseException:
        import traceback
        traceback.print_exc()
    os._exit(126)

class WallClock(Exception):
    pass

def on_alarm(signum, frame):
    raise WallClock

signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, wall)
code = None
try:
    while True:
        pid, status = os.waitpid(-1, 0)  # also reaps orphans adopted as subreaper
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            break
except WallClock:
    pass
signal.setitimer(signal.ITIMER_REAL, 0)

def children():
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me:
                found.append(int(name))
    return found

# Kill and reap every descendant; a killed process's children are re-parented to us.
while True:
    kids = children()
    if not kids:
        break
    for kid in kids:
        try:
            os.kill(kid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for kid in kids:
        try:
            os.waitpid(kid, 0)
        except ChildProcessError:
            pass
if code is None:
    os._exit(124)
os._exit(code if code >= 0 else 128 - code)
"""


def _is_root() -> bool:
    return os.geteuid() == 0


def _uid_range(pid: int) -> range:
    """The private uids a process with this pid draws its runs' uids from."""
    return range(_UID_BASE + (pid << 8), _UID_BASE + ((pid + 1) << 8))


def _allocate_uid(limits: SandboxLimits) -> int:
    if not _is_root():
        return os.getuid()
    if limits.run_as_uid is not None:
        return limits.run_as_uid
    return _uid_range(os.getpid())[next(_uid_counter) & 0xFF]


@functools.lru_cache(maxsize=16)
def _interpreter_for(preferred: str | None, root: bool) -> str:
    """The first interpreter that an unprivileged sandbox uid can actually start."""
    if preferred is not None:
        candidates = [preferred]
    else:
        candidates = [sys.executable, os.path.realpath(sys.executable), getattr(sys, "_base_executable", ""),
                      "/usr/bin/python3", shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or ""]
    probe_uid = _UID_BASE - 1  # never allocated to a run
    credentials = {"user": probe_uid, "group": probe_uid, "extra_groups": []} if root else {}
    tried = []
    for candidate in dict.fromkeys(c for c in candidates if c):
        try:
            subprocess.run([candidate, "-I", "-S", "-c", "import ctypes, resource"], cwd="/", env={},
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           check=True, timeout=30, **credentials)
            return candidate
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{candidate}: {exc}")
    raise RuntimeError("no Python interpreter is executable by the sandbox uid; tried " + "; ".join(tried))


_warned_unhidden: set[str] = set()


def _hideable(paths: tuple[str, ...], python: str) -> list[str]:
    """The hidden paths that do not hold the program's interpreter (a run directory that holds the
    virtual environment, say): hiding one of those would stop every program from starting."""
    needed = {os.path.abspath(python), os.path.realpath(python)}
    keep = []
    for path in paths:
        root = os.path.abspath(path)
        if any(n == root or n.startswith(root.rstrip("/") + "/") for n in needed):
            if root not in _warned_unhidden:  # once per path, not per test case
                _warned_unhidden.add(root)
                logger.warning("sandbox: %s holds the interpreter %s: not hidden from sandboxed programs", path, python)
        else:
            keep.append(root)
    return keep


def run_program(code: str, stdin: str, limits: SandboxLimits | None = None) -> RunResult:
    """Run the Python program `code` on `stdin` in a fresh sandbox; everything it started is gone
    when this returns. Raises SandboxUnavailable when the network cannot be isolated and
    `limits.allow_network` is off."""
    limits = limits or default_limits()
    check_network_isolation(limits)
    root = _is_root()
    uid = _allocate_uid(limits)
    python = _interpreter_for(limits.python, root)
    private_uid = root and limits.run_as_uid is None
    private_view = root and filesystem_isolation_available()
    nproc = limits.max_processes + 1  # + the bootstrap, which shares the uid
    if not root:
        nproc += _tasks_of_uid(uid)
    # Named after this process, so whoever supervises it can find the directory if it dies.
    workdir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
    try:
        script = os.path.join(workdir, "solution.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        if root:
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        argv = [python, "-I", "-S", "-c", _BOOTSTRAP, repr(float(limits.wall_s)), str(math.ceil(limits.cpu_s)),
                str(limits.memory_mb << 20), str(nproc), str(limits.file_size_mb << 20), str(limits.open_files),
                python, "1" if limits.site_packages else "0", script, str(uid),
                "0" if limits.allow_network else "1", "1" if private_view else "0", str(limits.disk_mb << 20),
                json.dumps(_hideable(limits.hidden_paths, python))]
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
            fin.write(stdin.encode("utf-8"))
            fin.seek(0)
            # The bootstrap drops to `uid` itself, after entering its network namespace.
            proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=workdir, env=env,
                                    close_fds=True, start_new_session=True)
            try:
                exit_code = proc.wait(timeout=limits.wall_s + 5.0)
            except subprocess.TimeoutExpired:  # the bootstrap itself is stuck: kill its session
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                exit_code = WALL_TIMEOUT_EXIT
            fout.seek(0)
            stdout = fout.read().decode("utf-8", errors="replace")
            ferr.seek(0)
            stderr_tail = ferr.read()[-2000:].decode("utf-8", errors="replace")
    finally:
        if private_uid:
            _sweep_uids(range(uid, uid + 1))
        shutil.rmtree(workdir, ignore_errors=True)
    if exit_code == STARTUP_FAILED_EXIT:
        logger.warning("sandbox could not start the program: %s", stderr_tail)
    return RunResult(exit_code=exit_code, stdout=stdout, stderr_tail=stderr_tail, uid=uid)


# ----------------------------------------------------------------------------- cleanup


def _proc_status(pid: str) -> dict[str, str]:
    """The fields of /proc/<pid>/status ({} if the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def _status_int(status: dict[str, str], key: str) -> int | None:
    try:
        return int(status[key].split()[0])
    except (KeyError, ValueError, IndexError):
        return None


def _proc_uid(pid: str, *, live: bool = False) -> int | None:
    """The real uid of process `pid`; None if it is gone (or, with `live`, a zombie: killing one
    does nothing, and its parent or init reaps it)."""
    status = _proc_status(pid)
    if live and status.get("State", "").startswith("Z"):
        return None
    return _status_int(status, "Uid")


def _pids() -> list[str]:
    return [name for name in os.listdir("/proc") if name.isdigit()]


def processes_of_uid(uid: int) -> list[int]:
    """Live (or zombie) processes whose real uid is `uid`."""
    return [int(pid) for pid in _pids() if _proc_uid(pid) == uid]


def _tasks_of_uid(uid: int) -> int:
    total = 0
    for pid in processes_of_uid(uid):
        try:
            total += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return total


def _kill_matching(match, timeout_s: float = 10.0) -> None:
    """SIGKILL every process `match(pid)` selects until none is left (a fork in flight may add one).

    By time, not by rounds: on a loaded host a fork bomb's children may still be starting after
    any fixed number of sweeps."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [int(pid) for pid in _pids() if match(pid)]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)
    logger.warning("sandbox cleanup: processes still appearing after %.0f s of SIGKILL sweeps", timeout_s)


def _await_gone(uids: range, timeout_s: float = 10.0) -> None:
    """Waits (bounded) until no process of `uids` is left, zombies included: killed processes are
    reaped by whoever inherited them, later on a loaded host; a caller that checks right after a
    run, or reuses the uid, must not find them."""
    deadline = time.monotonic() + timeout_s
    me = os.getpid()
    while time.monotonic() < deadline:
        left = [pid for pid in _pids() if _proc_uid(pid) in uids]
        if not left:
            return
        for pid in left:  # those re-parented to this process (a subreaper) are ours to reap
            if _status_int(_proc_status(pid), "PPid") == me:
                try:
                    os.waitpid(int(pid), os.WNOHANG)
                except ChildProcessError:
                    pass
        time.sleep(0.01)


def _sweep_uids(uids: range) -> None:
    """Kill every process of `uids` and delete their entries in the shared tmp dirs (root mode)."""
    _kill_matching(lambda pid: (uid := _proc_uid(pid, live=True)) is not None and uid in uids)
    _await_gone(uids)
    for tmp in _SHARED_TMP_DIRS:
        try:
            entries = list(os.scandir(tmp))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid not in uids:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                continue


def sweep_sandboxes_of(pid: int) -> None:
    """Remove what runs started by the (dead) process `pid` left: their processes and directories.

    For a reward pool's supervisor, after a worker was killed at its deadline or died: the worker
    cannot clean up after itself then. Finds processes by the worker's private uid range (root
    mode) or by a working directory inside one of its run directories (any mode).
    """
    dirs = glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{_DIR_PREFIX}{pid}-*"))
    if dirs:
        inside = tuple(os.path.realpath(d) for d in dirs)

        def in_run_dir(p: str) -> bool:
            try:
                cwd = os.readlink(f"/proc/{p}/cwd")
            except OSError:
                return False
            return cwd.startswith(inside) and _proc_uid(p, live=True) is not None

        _kill_matching(in_run_dir)
    if _is_root():
        _sweep_uids(_uid_range(pid))
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def sweep_orphaned_sandboxes() -> None:
    """Sweep the run directories (and uids) of processes that no longer exist: what a SIGKILLed
    reward pool's workers left, since no supervisor outlived them. A reward pool calls this when it
    starts."""
    for d in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{_DIR_PREFIX}*-*")):
        owner = os.path.basename(d)[len(_DIR_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and _proc_uid(owner, live=True) is None:  # gone, or a zombie no one reaps
            sweep_sandboxes_of(int(owner))
