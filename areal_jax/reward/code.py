"""Code reward: run the completion's last Python code block on stdin/stdout test cases.

Each test case runs in a fresh sandboxed process. The sandbox is built from plain POSIX
tools (no namespaces, no containers), so here is exactly what it does and does not do.

When the caller is root (the normal case on accelerator hosts):
- The program runs under a fresh, otherwise unused uid/gid (no supplementary groups), one
  per run. RLIMIT_NPROC is counted per uid and is not enforced for root, so a private uid is
  what makes the process limit real, keeps concurrent sandboxes from eating each other's
  process budget, and lets cleanup find every process the run created.
- The working directory is a private 0700 directory owned by that uid; HOME and TMPDIR
  point there. Root-owned directories (the repository, /root, site-packages) are not
  writable; 0700 directories such as /root are not even readable.
When the caller is not root the program runs under the caller's uid (NPROC is then set to
the caller's current task count plus the allowance, and files the caller can write are
writable by the program). Prefer running rewards as root or as a dedicated user.

Always:
- rlimits: CPU seconds, address space, processes (threads count), file size (stdout is a
  file, so this also caps output), open files, no core dumps;
- wall clock: a small bootstrap process (same uid) starts the program, enforces the wall
  clock, and as a child subreaper adopts every orphan the program leaves, then SIGKILLs and
  reaps all of its descendants before it exits, so nothing outlives a test case (and no
  zombies are left for an init that may not reap them);
- environment: only PATH, LANG, HOME, TMPDIR; python runs with -I (isolated) and -S (no
  site-packages: standard library only) unless ``site_packages=True``.

Residual risks, stated plainly: /tmp, /var/tmp and /dev/shm stay world-writable (after a
root-mode run, entries there owned by the run's uid are deleted); world-readable files can
be read; the network is reachable; a process that escapes the session *and* the subreaper
is impossible by design, but the parent still sweeps the run's uid after each case as a
backstop. Use namespaces/containers on top if completions are adversarial rather than merely
buggy.

The interpreter is the running Python if the sandbox uid may execute it, otherwise the
system ``python3`` (e.g. a pyenv Python under a 0700 /root is unreachable for other uids).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["CaseResult", "SandboxLimits", "code_reward", "extract_last_code_block", "run_test_cases"]

logger = logging.getLogger(__name__)

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = {"", "python", "py", "python3"}
# Private uids live far above any real account: base + (pid << 8 | per-process counter).
_UID_BASE = 1_500_000_000
_uid_counter = itertools.count()
_SHARED_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
_WALL_TIMEOUT_EXIT = 124
_STARTUP_FAILED_EXIT = 126


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one test-case run.

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

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive finite number, got {value!r}")
        for name, low in (("memory_mb", 32), ("max_processes", 1), ("file_size_mb", 1), ("open_files", 8)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"SandboxLimits.{name} must be an int >= {low}, got {value!r}")
        if self.python is not None and not os.path.isabs(self.python):
            raise ValueError(f"SandboxLimits.python must be an absolute path, got {self.python!r}")
        if self.run_as_uid is not None and (not isinstance(self.run_as_uid, int) or not 0 < self.run_as_uid < 2**32 - 1):
            raise ValueError(f"SandboxLimits.run_as_uid must be a non-root uid, got {self.run_as_uid!r}")


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """Outcome of one test case: verdict is passed / wrong_answer / runtime_error / timeout."""

    verdict: str
    uid: int
    exit_code: int | None
    stderr_tail: str = ""

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"


def extract_last_code_block(completion: str) -> str | None:
    """Return the body of the last complete fenced block tagged python/py/python3 or untagged."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be str, got {type(completion).__name__}")
    blocks = [m.group(2) for m in _FENCE.finditer(completion) if m.group(1).lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else None


def _as_text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise ValueError(f"test case {what} must be a str or a list of str, got {type(value).__name__}")


def normalize_test_cases(test_cases: dict | list | str) -> list[tuple[str, str]]:
    """(stdin, expected stdout) pairs from APPS ``{"inputs", "outputs"}`` (dict or JSON string)
    or a list of ``{"input", "output"}`` dicts."""
    if isinstance(test_cases, str):
        test_cases = json.loads(test_cases)
    if isinstance(test_cases, dict):
        if test_cases.get("fn_name"):
            raise ValueError("call-based test cases (fn_name) are not supported; use stdin/stdout cases")
        if "inputs" not in test_cases or "outputs" not in test_cases:
            raise ValueError(f"test cases dict needs 'inputs' and 'outputs', got keys {sorted(test_cases)}")
        inputs, outputs = test_cases["inputs"], test_cases["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("test cases 'inputs' and 'outputs' must be lists of equal length")
        pairs = list(zip(inputs, outputs))
    elif isinstance(test_cases, list):
        if not all(isinstance(c, dict) and "input" in c and "output" in c for c in test_cases):
            raise ValueError("a list of test cases must hold dicts with 'input' and 'output'")
        pairs = [(c["input"], c["output"]) for c in test_cases]
    else:
        raise ValueError(f"test cases must be a dict, list or JSON string, got {type(test_cases).__name__}")
    if not pairs:
        raise ValueError("no test cases: a program cannot pass an empty test set")
    return [(_as_text(i, "input"), _as_text(o, "output")) for i, o in pairs]


def outputs_match(actual: str, expected: str) -> bool:
    """Compare line by line after collapsing whitespace and stripping the ends."""
    def lines(text: str) -> list[str]:
        return [" ".join(line.split()) for line in text.strip().splitlines()]

    return lines(actual) == lines(expected)


def code_reward(completion: str, test_cases: dict | list | str, *, limits: SandboxLimits = SandboxLimits()) -> float:
    """1.0 if the last Python code block of ``completion`` passes every test case, else 0.0.

    No code block scores 0.0. Cases run one by one and stop at the first failure.
    Malformed ``test_cases`` raise ValueError (a data bug, not a wrong answer).
    Through a ``RewardPool``, give the call a timeout above ``len(cases) * limits.wall_s``
    (plus ~0.2 s per case of start-up), or slow-but-correct programs will be cut off.
    """
    cases = normalize_test_cases(test_cases)
    code = extract_last_code_block(completion)
    if code is None:
        return 0.0
    results = _run_cases(code, cases, limits, stop_at_first_failure=True)
    return 1.0 if all(r.passed for r in results) else 0.0


def run_test_cases(
    code: str,
    test_cases: dict | list | str,
    *,
    limits: SandboxLimits = SandboxLimits(),
    stop_at_first_failure: bool = False,
) -> list[CaseResult]:
    """Run ``code`` once per test case in the sandbox; one ``CaseResult`` per case run."""
    if not isinstance(code, str):
        raise TypeError(f"code must be str, got {type(code).__name__}")
    return _run_cases(code, normalize_test_cases(test_cases), limits, stop_at_first_failure)


def _run_cases(code: str, cases: list[tuple[str, str]], limits: SandboxLimits, stop_at_first_failure: bool):
    results = []
    for stdin, expected in cases:
        result = _run_case(code, stdin, expected, limits)
        results.append(result)
        if stop_at_first_failure and not result.passed:
            break
    return results


# ----------------------------------------------------------------------------- one run

# Runs as the sandbox uid. argv: wall cpu mem nproc fsize nofile python site_flag script.
_BOOTSTRAP = r"""
import os, resource, signal, sys
wall, cpu, mem, nproc, fsize, nofile = float(sys.argv[1]), *map(int, sys.argv[2:7])
python, site, script = sys.argv[7], sys.argv[8] == "1", sys.argv[9]
try:
    import ctypes
    libc = ctypes.CDLL(None)
    libc.prctl(1, 9)   # PR_SET_PDEATHSIG: die with the caller
    libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of the program come to us
except Exception:
    pass
child = os.fork()
if child == 0:
    try:
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


def _allocate_uid(limits: SandboxLimits) -> int:
    if not _is_root():
        return os.getuid()
    if limits.run_as_uid is not None:
        return limits.run_as_uid
    return _UID_BASE + ((os.getpid() << 8) | (next(_uid_counter) & 0xFF))


def _credentials(uid: int) -> dict:
    if not _is_root():
        return {}
    return {"user": uid, "group": uid, "extra_groups": []}


@functools.lru_cache(maxsize=16)
def _interpreter_for(preferred: str | None, root: bool) -> str:
    """The first interpreter that an unprivileged sandbox uid can actually start."""
    if preferred is not None:
        candidates = [preferred]
    else:
        candidates = [sys.executable, os.path.realpath(sys.executable), getattr(sys, "_base_executable", ""),
                      "/usr/bin/python3", shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or ""]
    probe_uid = _UID_BASE - 1  # never allocated to a run
    tried = []
    for candidate in dict.fromkeys(c for c in candidates if c):
        try:
            subprocess.run([candidate, "-I", "-S", "-c", "import ctypes, resource"], cwd="/", env={},
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           check=True, timeout=30, **(_credentials(probe_uid) if root else {}))
            return candidate
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{candidate}: {exc}")
    raise RuntimeError("no Python interpreter is executable by the sandbox uid; tried " + "; ".join(tried))


def _processes_of_uid(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(name))
                        break
        except (OSError, ValueError):
            continue
    return pids


def _tasks_of_uid(uid: int) -> int:
    total = 0
    for pid in _processes_of_uid(uid):
        try:
            total += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return total


def _sweep_uid(uid: int) -> None:
    """Backstop after a root-mode run: kill leftovers of the private uid, delete its tmp files."""
    for _ in range(100):
        pids = _processes_of_uid(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for tmp in _SHARED_TMP_DIRS:
        try:
            entries = list(os.scandir(tmp))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                continue


def _run_case(code: str, stdin: str, expected: str, limits: SandboxLimits) -> CaseResult:
    root = _is_root()
    uid = _allocate_uid(limits)
    python = _interpreter_for(limits.python, root)
    private_uid = root and limits.run_as_uid is None
    nproc = limits.max_processes + 1  # + the bootstrap, which shares the uid
    if not root:
        nproc += _tasks_of_uid(uid)
    workdir = tempfile.mkdtemp(prefix="areal-sandbox-")
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
                python, "1" if limits.site_packages else "0", script]
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
            fin.write(stdin.encode("utf-8"))
            fin.seek(0)
            proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=workdir, env=env,
                                    close_fds=True, start_new_session=True, **_credentials(uid))
            try:
                exit_code = proc.wait(timeout=limits.wall_s + 5.0)
            except subprocess.TimeoutExpired:  # the bootstrap itself is stuck: kill its session
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                exit_code = _WALL_TIMEOUT_EXIT
            fout.seek(0)
            actual = fout.read().decode("utf-8", errors="replace")
            ferr.seek(0)
            stderr_tail = ferr.read()[-2000:].decode("utf-8", errors="replace")
    finally:
        if private_uid:
            _sweep_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)
    if exit_code == _WALL_TIMEOUT_EXIT or exit_code == 128 + signal.SIGXCPU:
        verdict = "timeout"
    elif exit_code != 0:
        verdict = "runtime_error"
    else:
        verdict = "passed" if outputs_match(actual, expected) else "wrong_answer"
    if exit_code == _STARTUP_FAILED_EXIT:
        logger.warning("sandbox could not start the program: %s", stderr_tail)
    return CaseResult(verdict=verdict, uid=uid, exit_code=exit_code, stderr_tail=stderr_tail)
