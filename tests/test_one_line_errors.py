"""Issue 26, point 8 of its Why: problems that were tracebacks are one line, exit code 2 (a full or
read-only disk: 74, tests/test_fault_injection.py)."""

import errno
import json
import pathlib
import subprocess
import sys

import pytest

from areal_jax.cli import main
from areal_jax.jobs.errors import STORAGE_EXIT, user_error
from tests.test_optional_data_deps import BLOCK

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.gin")


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("areal-jax:")]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("flag,phrase", [("--n=0", "--n must be >= 1, got 0"),
                                         ("--max_new_tokens=-5", "--max_new_tokens must be >= 1, got -5"),
                                         ("--temperature=-1", "--temperature must be finite and >= 0, got -1.0"),
                                         ("--temperature=nan", "--temperature must be finite and >= 0"),
                                         ("--top_p=0", "--top_p must be in (0, 1], got 0.0"),
                                         ("--top_k=-1", "--top_k must be >= 0 (0: no cut), got -1")])
def test_generate_flags(tmp_path, capsys, flag, phrase):
    assert main(["generate", f"--model={tmp_path / 'no_model'}", "--prompt=hi", flag]) == 2
    assert phrase in _one_line(capsys)


def test_generate_refuses_more_new_tokens_than_the_model_has_positions(tmp_path, capsys):
    """Was silent: an engine of 100,000 positions compiling for minutes."""
    from tests.test_cli import _tiny_model_dir

    model = _tiny_model_dir(tmp_path / "model")
    limit = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    assert main(["generate", f"--model={model}", "--prompt=hi", "--max_new_tokens=100000"]) == 2
    assert (f"--max_new_tokens = 100000 leaves no position for the prompt within the model's "
            f"max_position_embeddings = {limit}") in _one_line(capsys)
    assert main(["generate", f"--model={model}", "--prompt=hi", f"--max_new_tokens={limit - 1}"]) == 2
    line = _one_line(capsys)
    assert f"--max_new_tokens = {limit - 1} after the longest prompt (" in line and "new tokens" in line


def test_a_run_dir_below_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for run_dir in (tmp_path / "file" / "sub", tmp_path / "file"):
        assert main(["train", f"--gin_file={QUICKSTART}", f"--run_dir={run_dir}", "--quiet"]) == 2
        line = _one_line(capsys)
        assert "--run_dir" in line and "is a file, not a directory" in line, line
    assert (tmp_path / "file").read_text() == "x"


def test_parquet_data_without_pyarrow(tmp_path):
    data = tmp_path / "d.parquet"
    data.write_bytes(b"PAR1")
    code = BLOCK + f"""
from areal_jax.cli import main
sys.exit(main(["train", "--gin_file={QUICKSTART}", "--gin_param=TaskSource.kind = 'dataset'",
               "--gin_param=DataConfig.paths = ('{data}',)", "--gin_param=Stages.sft = False",
               "--gin_param=TaskSource.eval_size = 0", "--run_dir={tmp_path / 'run'}", "--quiet"]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    lines = [line for line in done.stderr.splitlines() if line.startswith("areal-jax:")]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "pyarrow" in lines[0] and "areal-jax[data]" in lines[0]


def test_storage_errors_name_the_path_and_the_free_space(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))
    line, code = user_error(full)
    assert code == STORAGE_EXIT == 74
    assert line.startswith(f"storage error: {tmp_path / 'run' / 'metrics.jsonl'}: no space left (")
    assert "MiB free of" in line and "--resume" in line
    # Orbax and TensorStore carry the OS error as text, wrapped in their own exceptions.
    wrapped = ValueError(f"Error writing \"{tmp_path}/ckpt/1/state/d/abc\": [OS error 30: Read-only file system]")
    try:
        raise RuntimeError("save failed") from wrapped
    except RuntimeError as e:
        line, code = user_error(e)
    assert code == 74 and f"{tmp_path}/ckpt/1/state/d/abc" in line and "read-only file system" in line
    assert user_error(RuntimeError("a bug")) is None and user_error(KeyError("x")) is None


def test_a_run_whose_every_update_was_skipped_is_a_failure():
    """Was exit 0 with a final model equal to the initial one; run_train now raises this as one line
    (exit 2) after writing every record."""
    from areal_jax.jobs.train import nothing_trained

    every = [{"train/skipped_updates": 2.0, "reward/mean": 0.5}] * 3
    assert nothing_trained(every, 2).startswith("RL applied none of its 6 optimizer updates: each had a non-finite")
    assert nothing_trained(every[:2] + [{"train/skipped_updates": 1.0}], 2) is None  # one update applied
    assert nothing_trained([{"reward/mean": 0.5}], 2) is None  # no RL update recorded (SFT only, a resume at the end)
