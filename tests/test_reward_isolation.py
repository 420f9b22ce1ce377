"""Rewards cannot stall a run, and nothing outlives it: `train` and `eval` score verifiable rewards
in worker processes under deadlines, a code reward is refused where the sandbox could not cut the
network, and a signal to `areal-jax` leaves no worker, fork server or sandboxed program behind."""

import glob
import json
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from areal_jax.cli import main
from areal_jax.metrics import read_jsonl
from areal_jax.reward import sandbox
from tests.test_cli import QUICKSTART, ROOT, SHORT, SPLIT_8, _tiny_model_dir

HANG = "tests.reward_fixtures:hang_sometimes"


def _gsm8k(path, rows):
    path.write_text("".join(json.dumps({"question": f"What is {i}+1?", "answer": f"so #### {i + 1}"}) + "\n"
                            for i in range(rows)))
    return path


def test_train_keeps_stepping_while_the_reward_hangs(tmp_path):
    """Half of the completions send the reward into a backtracking regular expression, which holds
    the GIL in C: in-process no thread of the trainer would run again. In the pool each such call
    is killed at its 1 s deadline, scores 0 and is counted; every step is trained."""
    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.jobs.train import run_train

    params = SHORT + [SPLIT_8, "Stages.sft = False", "RLConfig.steps = 3", "TaskSource.eval_size = 4",
                      f"RLVRConfig.reward = '{HANG}'", "RLVRConfig.reward_timeout_s = 1.0",
                      "RewardPoolConfig.num_workers = 2", "RewardPoolConfig.preload = ('areal_jax.tasks.reward',)"]
    cfg = load_job_configs([QUICKSTART], params, run_dir=str(tmp_path))
    summary = run_train(cfg, tmp_path, progress=False)
    records = [r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in records] == [0, 1, 2] and summary["steps"] == 3
    step_timeouts = sum(m["reward/timeouts"] for m in records)
    assert step_timeouts > 0 and all(m["reward/failures"] == 0 for m in records)
    calls = summary["reward"]
    assert calls["timeouts"] >= step_timeouts  # and the held-out checks' own
    assert calls["succeeded"] > 0 and calls["crashes"] == calls["errors"] == 0
    assert calls["submitted"] == sum(calls[k] for k in ("succeeded", "timeouts", "crashes", "errors", "cancelled"))
    assert json.loads((tmp_path / "summary.json").read_text())["reward"] == calls


def test_eval_finishes_when_the_reward_hangs(tmp_path):
    model_dir = _tiny_model_dir(tmp_path / "model")
    data = _gsm8k(tmp_path / "gsm8k.jsonl", 3)
    out = tmp_path / "eval"
    start = time.monotonic()
    assert main(["eval", f"--model={model_dir}", f"--run_dir={out}", "--reward_workers=2",
                 f"--gin_param=DataConfig.paths = ('{data}',)", "--gin_param=EvalConfig.n_samples = 2",
                 "--gin_param=EvalConfig.temperature = 1.0", "--gin_param=EvalConfig.ks = (1, 2)",
                 "--gin_param=EvalConfig.max_new_tokens = 8", "--gin_param=EvalConfig.max_seq_len = 64",
                 "--gin_param=EvalConfig.num_slots = 8",
                 "--gin_param=EvalConfig.reward = 'tests.reward_fixtures:catastrophic_regex'",
                 "--gin_param=EvalConfig.reward_timeout_s = 1.0", "--gin_param=RewardPoolConfig.preload = ()"]) == 0
    assert time.monotonic() - start < 300
    overall = json.loads((out / "report.json").read_text())["overall"]
    assert overall["num_samples"] == 6 and overall["reward_failures"] == 6 and overall["mean_reward"] == 0.0


def test_code_reward_is_refused_where_the_sandbox_cannot_cut_the_network(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "network_isolation_available", lambda: False)
    data = _gsm8k(tmp_path / "gsm8k.jsonl", 1)
    args = ["eval", f"--model={tmp_path / 'no_model'}", f"--run_dir={tmp_path / 'eval'}",
            f"--gin_param=DataConfig.paths = ('{data}',)", "--gin_param=EvalConfig.reward = 'code'"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("areal-jax: configuration error: SandboxLimits.allow_network:") and "\n" not in err
    assert not (tmp_path / "eval").exists()
    # Opting in gets past the check: the next problem reported is the missing model.
    assert main(args + ["--gin_param=SandboxLimits.allow_network = True"]) == 2
    err = capsys.readouterr().err
    assert "allow_network" not in err and "--model" in err


def _alive(procs):
    found = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_areal_jax_leaves_no_process_behind(tmp_path, sig):
    """`areal-jax eval` whose rewards are sandboxed programs sleeping for minutes, signalled while they
    run (SIGINT even where it was ignored when the command started): it exits with 143 / 130, and its fork server, pool workers, sandbox bootstraps and programs
    are gone from the process table, their run directories deleted."""
    model_dir = _tiny_model_dir(tmp_path / "model")
    data = _gsm8k(tmp_path / "gsm8k.jsonl", 2)
    cmd = [sys.executable, "-m", "areal_jax.cli", "eval", f"--model={model_dir}", f"--run_dir={tmp_path / 'eval'}",
           "--reward_workers=2", f"--gin_param=DataConfig.paths = ('{data}',)",
           "--gin_param=EvalConfig.max_new_tokens = 4", "--gin_param=EvalConfig.max_seq_len = 64",
           "--gin_param=EvalConfig.num_slots = 2",
           "--gin_param=EvalConfig.reward = 'tests.reward_fixtures:sandboxed_sleep_reward'",
           "--gin_param=EvalConfig.reward_timeout_s = 600.0", "--gin_param=RewardPoolConfig.preload = ()"]
    # Started with SIGINT ignored, as a script's `cmd &` starts it (and as some CI runners start the
    # tests): the command must still handle it.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    cli = psutil.Process(proc.pid)
    try:
        deadline = time.monotonic() + 300
        programs = []
        while len(programs) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            try:
                programs = [p for p in cli.children(recursive=True) if p.cmdline()[-1].endswith("/solution.py")]
            except (psutil.NoSuchProcess, IndexError):
                programs = []
        assert len(programs) == 2, f"the sandboxed programs never started (exit code {proc.poll()})"
        tree = cli.children(recursive=True)  # fork server, 2 workers, 2 bootstraps, 2 programs
        assert len(tree) >= 7
        proc.send_signal(sig)
        assert proc.wait(timeout=300) == (143 if sig == signal.SIGTERM else 130)  # a loaded host is slow to stop
        assert "stopped by" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    # The fork server sees its parent's end and exits, and what was killed is reaped, in their own
    # time on a loaded host: what matters is that they go, so the bound is a liveness one, not a speed.
    deadline = time.monotonic() + 300
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(tree) == []
    run_dirs = [d for p in tree for d in glob.glob(f"{tempfile.gettempdir()}/areal-sandbox-{p.pid}-*")]
    assert run_dirs == []


OWNER = """
import sys, time
from areal_jax.reward.pool import RewardPool, RewardPoolConfig
if __name__ == "__main__":
    pool = RewardPool(RewardPoolConfig(num_workers=2, preload=()))
    calls = [pool.submit_call("tests.reward_fixtures:sandboxed_sleep", (600,), timeout_s=600.0) for _ in range(2)]
    time.sleep(600)
"""


def _sandboxed_programs(proc):
    try:
        return [p for p in psutil.Process(proc.pid).children(recursive=True)
                if p.cmdline() and p.cmdline()[-1].endswith("/solution.py")]
    except psutil.NoSuchProcess:
        return []


def test_a_sigkilled_pool_owner_leaves_no_process_and_the_next_pool_removes_its_directories(tmp_path):
    """SIGKILL runs no cleanup: the fork server must notice its parent's end (no worker may hold the
    pipe it watches), the workers, bootstraps and programs die by parent-death signals, and the
    run directories nobody could delete are swept by the next pool that starts."""
    from areal_jax.reward.pool import RewardPool, RewardPoolConfig

    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while len(_sandboxed_programs(proc)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_sandboxed_programs(proc)) == 2, "the sandboxed programs never started"
        tree = psutil.Process(proc.pid).children(recursive=True)
    finally:
        proc.kill()
        proc.wait()
    run_dirs = [d for p in tree for d in glob.glob(f"{tempfile.gettempdir()}/areal-sandbox-{p.pid}-*")]
    assert len(tree) >= 6 and len(run_dirs) == 2
    deadline = time.monotonic() + 10
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(tree) == []
    with RewardPool(RewardPoolConfig(num_workers=1, preload=())) as pool:
        assert pool.submit("tests.reward_fixtures:add", 1, 2).result(60) == 3.0
    assert [d for d in run_dirs if pathlib.Path(d).exists()] == []
