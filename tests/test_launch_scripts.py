"""The launch scripts: every one parses, and the TPU pod launcher hands flags to every worker intact."""

import json
import os
import pathlib
import shlex
import stat
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "launch").iterdir() if p.suffix in (".sh", ".sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_launch_script_parses_and_is_executable(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    if script.name != "env.sh":  # sourced, not run
        assert script.stat().st_mode & stat.S_IXUSR, f"{script.name} is not executable"


def test_tpu_pod_launcher_without_a_pod_name_prints_usage():
    proc = subprocess.run([str(ROOT / "launch" / "tpu_pod.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr


@pytest.mark.parametrize("remote_dir,cd_word", [("/opt/areal jax", "/opt/areal jax"), (None, "~/areal_jax")])
def test_tpu_pod_launcher_runs_one_command_on_every_worker_with_flags_intact(tmp_path, remote_dir, cd_word):
    """gcloud cannot run here: a stand-in on PATH records what the launcher asks of it."""
    fake = tmp_path / "bin" / "gcloud"
    fake.parent.mkdir()
    fake.write_text('#!/usr/bin/env python3\nimport json, sys\n'
                    f'open({str(tmp_path / "argv.json")!r}, "w").write(json.dumps(sys.argv[1:]))\n')
    fake.chmod(0o755)
    flags = ["--gin_file=configs/qwen2_5_1_5b_gsm8k_tpu.gin", "--gin_param=RLConfig.steps = 40",
             "--gin_param=DataConfig.paths = ('/data/a b.jsonl',)", "--run_dir=/mnt/runs/q $1"]
    env = {k: v for k, v in os.environ.items() if k != "AREAL_REMOTE_DIR"}
    env["PATH"] = f"{fake.parent}:{os.environ['PATH']}"
    if remote_dir is not None:
        env["AREAL_REMOTE_DIR"] = remote_dir
    subprocess.run([str(ROOT / "launch" / "tpu_pod.sh"), "pod-1", "us-central2-b", *flags], env=env, check=True)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:5] == ["compute", "tpus", "tpu-vm", "ssh", "pod-1"]
    assert "--zone=us-central2-b" in argv and "--worker=all" in argv
    command = next(a for a in argv if a.startswith("--command="))[len("--command="):]
    words = shlex.split(command)  # what each worker's shell will see
    assert words[:2] == ["cd", cd_word]
    if remote_dir is None:  # left for the worker's shell to expand
        assert command.startswith("cd ~/areal_jax ")
    start = words.index("areal-jax")
    assert words[start:start + 3] == ["areal-jax", "train", "--distributed"]
    assert words[start + 3:] == flags



def _env_functions(tmp_path, home: pathlib.Path, call: str) -> subprocess.CompletedProcess:
    """env.sh's interpreter search and venv build functions alone, with a bare PATH and a fake root."""
    functions = subprocess.run(["sed", "-n", "/^_runs_at_least()/,/^_ensure_reference_venv()/p",
                                str(ROOT / "launch" / "env.sh")], capture_output=True, text=True, check=True).stdout
    root = tmp_path / "repo"
    (root / "launch").mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "launch/env.sh"):
        (root / name).write_text((ROOT / name).read_text())
    env = {"HOME": str(home), "PATH": "/nonexistent", "PYENV_ROOT": str(tmp_path / "no-pyenv")}
    script = f"ROOT={shlex.quote(str(root))}\n" + functions.rsplit("_ensure_reference_venv()", 1)[0] + "\n" + call
    return subprocess.run(["/bin/bash", "-c", script], capture_output=True, text=True, env=env)


def test_env_finds_a_python_installed_by_uv(tmp_path):
    """TPU VM images ship Python 3.10: a 3.12 from `uv python install` is found without AREAL_PYTHON."""
    import sys

    if sys.version_info[:2] < (3, 12):
        pytest.skip("needs a Python >= 3.12 to stand in for uv's")
    home = tmp_path / "home"
    bindir = home / ".local/share/uv/python/cpython-3.12.9-linux-x86_64-gnu/bin"
    bindir.mkdir(parents=True)
    (bindir / "python3.12").symlink_to(sys.executable)
    proc = _env_functions(tmp_path, home, "_find_python 3 12 0")
    assert proc.returncode == 0 and proc.stdout.strip() == str(bindir / "python3.12"), proc


def test_env_without_a_new_enough_python_says_how_to_get_one(tmp_path):
    if any(pathlib.Path(d, "python3.12").exists() for d in ("/usr/bin", "/usr/local/bin")):
        pytest.skip("this machine has a system Python 3.12")
    proc = _env_functions(tmp_path, tmp_path / "home", "_ensure_main_venv")
    assert proc.returncode == 1 and "uv python install 3.12" in proc.stderr, proc
    assert not (tmp_path / "repo" / ".venv").exists()
