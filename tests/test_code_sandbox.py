"""code_reward and its sandbox: verdicts, limits, isolation (processes, files, network), and cleanup."""

import dataclasses
import json
import os
import pathlib
import shutil
import socket
import subprocess
import time
import uuid

import pytest

from areal_jax.reward.code import (
    code_reward,
    extract_last_code_block,
    normalize_test_cases,
    outputs_match,
    run_test_cases,
)
from areal_jax.reward import sandbox
from areal_jax.reward.sandbox import SandboxLimits, SandboxUnavailable, processes_of_uid

ISOLATED = sandbox.network_isolation_available()
# Where no network namespace can be made, the other tests opt in to the host's network.
LIMITS = SandboxLimits(wall_s=1.5, cpu_s=1, memory_mb=256, max_processes=8, file_size_mb=1, allow_network=not ISOLATED)
ROOT = pathlib.Path(__file__).resolve().parents[1]
DOUBLE = {"inputs": ["3\n", "5\n", "-4\n"], "outputs": ["6\n", "10\n", "-8\n"]}
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="private-uid sandbox needs root")


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}\n```\nIt reads n and prints 2n."


def assert_no_leftovers(results, within_s=120.0):
    """No process of a run's uid is left, zombies included. The sandbox waits (bounded) for the
    kernel to reap what it killed; on a loaded host that can take longer, so this waits too: a
    liveness bound, not a speed check (a leaked process would never go)."""
    for r in results:
        if os.geteuid() == 0:
            deadline = time.monotonic() + within_s
            while processes_of_uid(r.uid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert processes_of_uid(r.uid) == [], f"processes of sandbox uid {r.uid} survived"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("```python\nprint(1)\n```", "print(1)\n"),
        ("```py\na\n```\n```\nb\n```", "b\n"),
        ("```python\na\n```\n```bash\nls\n```", "a\n"),  # a non-Python block is skipped
        ("```Python3\nx = {'a': 1}\n```", "x = {'a': 1}\n"),
        ("```python\nfirst\n```\ntext\n```python\ntruncated", "first\n"),  # unterminated last block
        ("  ```python\n  indented\n  ```", "  indented\n"),
        ("no code here", None),
        ("inline ```print(1)``` only", None),
    ],
)
def test_extract_last_code_block(completion, expected):
    assert extract_last_code_block(completion) == expected


def test_test_case_formats_and_errors():
    expected = [("1", "2"), ("a\nb", "c\nd")]
    apps = {"inputs": ["1", ["a", "b"]], "outputs": ["2", ["c", "d"]]}
    assert normalize_test_cases(apps) == expected
    assert normalize_test_cases(json.dumps(apps)) == expected
    assert normalize_test_cases([{"input": "1", "output": "2"}, {"input": "a\nb", "output": "c\nd"}]) == expected
    for bad, culprit in [
        ({"inputs": [], "outputs": []}, "no test cases"),
        ({"inputs": ["1"], "outputs": []}, "equal length"),
        ({"inputs": ["1"]}, "'outputs'"),
        ({"fn_name": "solve", "inputs": [[1]], "outputs": [2]}, "fn_name"),
        ([{"input": "1"}], "'input' and 'output'"),
        ({"inputs": [1], "outputs": ["1"]}, "input must be a str"),
        (42, "dict, list or JSON"),
    ]:
        with pytest.raises(ValueError, match=culprit):
            normalize_test_cases(bad)


@pytest.mark.parametrize(
    ("actual", "expected", "match"),
    [("6\n", "6", True), ("1  2 \n3\n\n", "1 2\n3", True), ("1 2", "1\n2", False), ("6", "7", False), ("", "0", False)],
)
def test_outputs_match(actual, expected, match):
    assert outputs_match(actual, expected) is match


@pytest.mark.parametrize("fmt", ["dict", "json", "list"])
def test_correct_solution_passes(fmt):
    cases = {"dict": DOUBLE, "json": json.dumps(DOUBLE),
             "list": [{"input": i, "output": o} for i, o in zip(DOUBLE["inputs"], DOUBLE["outputs"])]}[fmt]
    assert code_reward(fenced("n = int(input())\nprint(2 * n)"), cases, limits=LIMITS) == 1.0


def test_plain_fence_and_whitespace_tolerance():
    completion = fenced("n = int(input())\nprint('  ', 2 * n, '  ')\nprint()", tag="")
    assert code_reward(completion, DOUBLE, limits=LIMITS) == 1.0


def test_wrong_answer_and_partial_pass_fail():
    results = run_test_cases("n = int(input())\nprint(n * n if n != 3 else 6)", DOUBLE, limits=LIMITS)
    assert [r.verdict for r in results] == ["passed", "wrong_answer", "wrong_answer"]
    assert code_reward(fenced("print(6)"), DOUBLE, limits=LIMITS) == 0.0


def test_runtime_error_and_no_code_block():
    [result] = run_test_cases("raise SystemExit(int(input()) // 0)", {"inputs": ["1"], "outputs": ["1"]}, limits=LIMITS)
    assert result.verdict == "runtime_error" and "ZeroDivisionError" in result.stderr_tail
    assert code_reward("I think the answer is print(6)", DOUBLE, limits=LIMITS) == 0.0


@pytest.mark.parametrize("program", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_infinite_loop_and_sleep_fail_within_limit(program):
    start = time.monotonic()
    results = run_test_cases(program, {"inputs": ["1"], "outputs": ["1"]}, limits=LIMITS)
    elapsed = time.monotonic() - start
    assert [r.verdict for r in results] == ["timeout"]
    assert elapsed < LIMITS.wall_s + 1.5
    assert_no_leftovers(results)


def test_fork_bomb_is_contained():
    """What matters: the bomb fails, nothing of it survives, the caller can still start processes.
    Which limit ends it (the wall clock, or its CPU seconds: a runtime error) depends on the
    host's load, so either verdict is right."""
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    results = run_test_cases(bomb, {"inputs": [""], "outputs": ["x"]}, limits=LIMITS)
    assert [r.verdict in ("timeout", "runtime_error") for r in results] == [True], results
    assert_no_leftovers(results)
    # the calling process is unharmed: it can still start processes
    assert subprocess.run(["true"], check=False).returncode == 0


@needs_root
def test_process_limit_is_exact():
    program = (
        "import os, time\nok = 0\n"
        "for _ in range(30):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        continue\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
        "    ok += 1\n"
        "print(ok)"
    )
    [result] = run_test_cases(program, {"inputs": [""], "outputs": [str(LIMITS.max_processes - 1)]}, limits=LIMITS)
    assert result.passed  # the program itself plus 7 children; the 8th fork is refused
    assert_no_leftovers([result])


@needs_root
def test_escaped_daemon_is_killed():
    # double fork + setsid: the grandchild leaves the session and is orphaned
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\n"
        "time.sleep(0.2)\nprint('done')"
    )
    [result] = run_test_cases(program, {"inputs": [""], "outputs": ["done"]}, limits=LIMITS)
    assert result.passed
    assert_no_leftovers([result])


def test_memory_hog_fails():
    [result] = run_test_cases("x = bytearray(1 << 30)\nprint(1)", {"inputs": [""], "outputs": ["1"]}, limits=LIMITS)
    assert result.verdict == "runtime_error" and "MemoryError" in result.stderr_tail


def test_output_flood_is_capped():
    [result] = run_test_cases("while True:\n    print('y' * 1000)", {"inputs": [""], "outputs": ["y"]}, limits=LIMITS)
    assert result.verdict == "runtime_error"  # SIGXFSZ at file_size_mb of stdout


@needs_root
def test_writes_outside_private_dir_fail():
    tag = uuid.uuid4().hex
    repo_target = ROOT / f"sandbox_escape_{tag}.txt"
    root_target = pathlib.Path(f"/root/sandbox_escape_{tag}.txt")
    tmp_target = pathlib.Path(f"/tmp/sandbox_escape_{tag}.txt")
    program = (
        "import sys\n"
        "for path in sys.stdin.read().split():\n"
        "    try:\n        open(path, 'w').write('pwned')\n        print(path, 'written')\n"
        "    except OSError:\n        print(path, 'denied')\n"
    )
    stdin = f"own_file.txt {repo_target} {root_target} {tmp_target}"
    expected = f"own_file.txt written\n{repo_target} denied\n{root_target} denied\n{tmp_target} written"
    [result] = run_test_cases(program, {"inputs": [stdin], "outputs": [expected]}, limits=LIMITS)
    assert result.passed, result
    assert not repo_target.exists() and not root_target.exists()
    assert not tmp_target.exists()  # world-writable /tmp: swept after the run


def test_parent_secrets_are_invisible(monkeypatch):
    secret = f"hunter2-{uuid.uuid4().hex}"
    monkeypatch.setenv("AREAL_FAKE_SECRET", secret)
    program = (
        "import os, sys\n"
        "print(' '.join(sorted(os.environ)))\n"
        "found = 'SECRET' in ''.join(os.environ) or any(os.environ.get(k, '').startswith('hunter2') for k in os.environ)\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n        found |= b'hunter2-' in open(f'/proc/{pid}/environ', 'rb').read()\n"
        "    except OSError:\n        pass\n"
        "print('leaked' if found else 'clean')\n"
    )
    expected_env = "HOME LANG PATH TMPDIR" if os.geteuid() == 0 else None
    [result] = run_test_cases(program, {"inputs": [""], "outputs": [f"{expected_env}\nclean"]}, limits=LIMITS)
    if expected_env is not None:
        assert result.passed, result
    assert secret not in result.stderr_tail


def test_code_reward_through_pool():
    from areal_jax.reward.pool import RewardPool, RewardPoolConfig

    good = fenced("n = int(input())\nprint(2 * n)")
    with RewardPool(RewardPoolConfig(num_workers=2, timeout_s=20.0, preload=("areal_jax.reward.code",))) as pool:
        futures = [pool.submit("code", c, DOUBLE, limits=LIMITS) for c in (good, fenced("print(0)"), "no code")]
        assert [f.result(60) for f in futures] == [1.0, 0.0, 0.0]


CONNECT = (
    "import socket\n"
    "try:\n    socket.create_connection(('127.0.0.1', int(input())), timeout=2).close()\n    print('connected')\n"
    "except OSError:\n    print('unreachable')\n"
)


@pytest.fixture
def listening_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.0)
    yield server
    server.close()


def _accepted(server) -> bool:
    try:
        server.accept()[0].close()
        return True
    except BlockingIOError:
        return False


@pytest.mark.skipif(not ISOLATED, reason="this host cannot make a network namespace")
def test_sandboxed_code_cannot_reach_loopback(listening_port):
    port = str(listening_port.getsockname()[1])
    isolated = SandboxLimits(wall_s=5.0, cpu_s=2, memory_mb=256)
    [result] = run_test_cases(CONNECT, {"inputs": [port], "outputs": ["unreachable"]}, limits=isolated)
    assert result.passed, result
    assert not _accepted(listening_port)
    # The same program with the host's network (the opt-in) does reach the listening socket.
    opted_in = SandboxLimits(wall_s=5.0, cpu_s=2, memory_mb=256, allow_network=True)
    [result] = run_test_cases(CONNECT, {"inputs": [port], "outputs": ["connected"]}, limits=opted_in)
    assert result.passed, result
    assert _accepted(listening_port)


def test_no_network_namespace_refuses_untrusted_code_unless_opted_in(monkeypatch, listening_port):
    monkeypatch.setattr(sandbox, "network_isolation_available", lambda: False)
    port = str(listening_port.getsockname()[1])
    with pytest.raises(SandboxUnavailable, match=r"^SandboxLimits.allow_network: .*127.0.0.1") as refused:
        run_test_cases(CONNECT, {"inputs": [port], "outputs": ["unreachable"]}, limits=SandboxLimits())
    assert "\n" not in str(refused.value)
    assert code_reward(fenced("print(1)"), {"inputs": [""], "outputs": ["1"]},
                       limits=SandboxLimits(allow_network=True)) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "culprit"),
    [
        ({"wall_s": 0}, "wall_s"),
        ({"cpu_s": float("nan")}, "cpu_s"),
        ({"memory_mb": 8}, "memory_mb"),
        ({"max_processes": 0}, "max_processes"),
        ({"file_size_mb": 0}, "file_size_mb"),
        ({"open_files": 2}, "open_files"),
        ({"python": "python3"}, "python"),
        ({"run_as_uid": 0}, "run_as_uid"),
        ({"allow_network": 1}, "allow_network"),
    ],
)
def test_limits_validation(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        SandboxLimits(**kwargs)


HUNT = '''
import glob, json, os, re, sys
found = set()
for cmdline in glob.glob("/proc/*/cmdline"):  # the trainer's command line names its data and run directory
    try:
        found.update(re.findall(r"(/[^\\x00'\\",()]+)", open(cmdline, "rb").read().decode(errors="ignore")))
    except OSError:
        pass
for top in sys.stdin.read().split():  # and a walk of the places data usually sits
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in (".git", ".venv", ".venv-ref", "__pycache__")]
        found.update(os.path.join(folder, f) for f in files if f.endswith(".jsonl"))
for path in sorted(found):
    try:
        for line in open(path):
            print(json.loads(line)["input_output"]["outputs"][0])
            raise SystemExit
    except (OSError, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        pass
print("nothing found")
'''


@pytest.mark.skipif(not sandbox.filesystem_isolation_available(), reason="needs a private mount namespace (root)")
def test_a_completion_hunting_for_the_expected_outputs_scores_zero(tmp_path):
    """Issue 39 (4): a completion read the test cases' outputs from the data file it found through
    /proc/*/cmdline, and scored 1.0 through the real reward pool. Now it sees no other process and
    the job's data files and run directory are empty for it."""
    import sys

    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.jobs.preflight import sandbox_for_run
    from areal_jax.reward.pool import RewardPool, RewardPoolConfig

    secret = f"expected-{uuid.uuid4().hex}"
    if any(ROOT.is_relative_to(d) for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")):
        pytest.skip(f"the checkout ({ROOT}) lies in a directory the sandbox replaces with its own tmpfs, so the "
                    "control (nothing hidden) could not see the planted outputs either")
    base = ROOT / f".sandbox_attack_{uuid.uuid4().hex}"  # outside /tmp, which the sandbox replaces anyway
    data, run = base / "data" / "code.jsonl", base / "run"
    row = {"question": "Print the answer.", "input_output": {"inputs": ["1\n"], "outputs": [secret + "\n"]}}
    trainer = None
    try:
        data.parent.mkdir(parents=True)
        (run / "inputs").mkdir(parents=True)
        for path in (data, run / "inputs" / "train.jsonl"):
            path.write_text(json.dumps(row) + "\n")
            path.chmod(0o644)  # world-readable, as data files are
        trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                                    f"--gin_param=DataConfig.paths = ('{data}',)", f"--run_dir={run}"])
        cfg = load_job_configs([], [f"DataConfig.paths = ('{data}',)", "RLVRConfig.reward = 'code'",
                                    "TaskSource.eval_size = 0"], run_dir=str(run))
        hidden = dataclasses.replace(LIMITS, wall_s=30.0, cpu_s=20,
                                     hidden_paths=sandbox_for_run(cfg, run).hidden_paths)
        assert str(data) in hidden.hidden_paths and str(run) in hidden.hidden_paths
        visible = dataclasses.replace(hidden, hidden_paths=())
        cases = {"inputs": [str(base)], "outputs": [secret]}
        with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=90.0, preload=("areal_jax.reward.code",))) as pool:
            control = pool.submit("code", fenced(HUNT), cases, limits=visible).result(120)
            attack = pool.submit("code", fenced(HUNT), cases, limits=hidden).result(120)
        assert control == 1.0  # the hunt is real: where nothing is hidden, it finds the outputs
        assert attack == 0.0
        peek = f"print(open('/proc/{trainer.pid}/cmdline').read())"
        [result] = run_test_cases(peek, {"inputs": [""], "outputs": ["x"]}, limits=hidden)
        assert result.verdict == "runtime_error" and "FileNotFoundError" in result.stderr_tail
    finally:
        if trainer is not None:
            trainer.kill()
            trainer.wait()
        shutil.rmtree(base, ignore_errors=True)


@needs_root
@pytest.mark.skipif(not sandbox.filesystem_isolation_available(), reason="needs a private mount namespace (root)")
def test_what_a_program_writes_is_capped_in_total_and_gone_afterwards():
    """Issue 39 (14): files in pre-existing world-writable subdirectories of /tmp survived the sweep,
    and nothing capped the total. Now /tmp, /var/tmp and /dev/shm are one private tmpfs of disk_mb."""
    shared = pathlib.Path(f"/tmp/areal-shared-{uuid.uuid4().hex}")
    shared.mkdir()
    shared.chmod(0o1777)
    try:
        program = (f"open('{shared}/left.txt', 'w').write('x')\n"
                   "chunk = b'a' * (1 << 20)\nn = 0\n"
                   "try:\n    for i in range(100):\n        open(f'/tmp/f{i}', 'wb').write(chunk)\n        n += 1\n"
                   "except OSError as e:\n    print(n, e.errno)\n")
        limits = dataclasses.replace(LIMITS, disk_mb=8, file_size_mb=4)
        [result] = run_test_cases(program, {"inputs": [""], "outputs": ["x"]}, limits=limits)
        assert result.verdict == "runtime_error" and "No such file or directory" in result.stderr_tail  # not there
        done = sandbox.run_program(program.split("\n", 1)[1], "", limits)
        written, errno = map(int, done.stdout.split())
        assert errno == 28 and 4 <= written <= 8, done  # 8 MiB in all (4 MiB per file): full by the 9th
        assert list(shared.iterdir()) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.skipif(not sandbox.filesystem_isolation_available(), reason="needs a private mount namespace (root)")
def test_a_hidden_path_holding_the_interpreter_stays_visible():
    """A run directory that holds the virtual environment must not stop every program from starting."""
    python = sandbox._interpreter_for(None, os.geteuid() == 0)
    limits = dataclasses.replace(LIMITS, hidden_paths=(os.path.dirname(python),))
    [result] = run_test_cases("print(int(input()) * 2)", {"inputs": ["4"], "outputs": ["8"]}, limits=limits)
    assert result.passed, result
