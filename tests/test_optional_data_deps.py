"""pyarrow and datasets (the [data] extra), wandb (the [wandb] extra) and aiohttp, httpx and openai
(the [agents] extra) are optional: the job imports, logs and trains without them, and what needs one names the package and the extra."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyarrow", "datasets", "wandb", "aiohttp", "httpx", "openai"):
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, Block())
"""


def test_the_job_imports_without_pyarrow_or_datasets_and_parquet_names_the_extra(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    code = BLOCK + f"""
import areal_jax.cli, areal_jax.jobs.train, areal_jax.data.pipeline
from areal_jax.data.sources import iter_parquet
try:
    list(iter_parquet({str(tmp_path / 'd.parquet')!r}))
except ImportError as e:
    print("MESSAGE", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MESSAGE" in out.stdout and "pyarrow" in out.stdout and "areal-jax[data]" in out.stdout


def test_metrics_log_without_wandb_and_wandb_mode_names_the_extra(tmp_path):
    code = BLOCK + f"""
from areal_jax.metrics import MetricsConfig, MetricsLogger, read_jsonl
log = MetricsLogger({str(tmp_path / 'run')!r}, console=False)  # the default: W&B disabled
log.log(0, {{"reward/mean": 0.5}})
log.close()
print("STEPS", [r["step"] for r in read_jsonl({str(tmp_path / 'run' / 'metrics.jsonl')!r})])
try:
    MetricsLogger({str(tmp_path / 'other')!r}, console=False, wandb=MetricsConfig(wandb_mode="offline"))
except ImportError as e:
    print("MESSAGE", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "STEPS [0]" in out.stdout
    assert "MESSAGE" in out.stdout and "wandb" in out.stdout and "areal-jax[wandb]" in out.stdout


def test_the_quickstart_trains_end_to_end_without_pyarrow_datasets_or_wandb(tmp_path):
    # The whole job (SFT, asynchronous RL, evaluation, the plot, the saved model) in the short form
    # of tests/test_cli.py, in a process where importing any of the optional packages fails.
    from tests.test_cli import QUICKSTART, SHORT

    args = ["train", f"--gin_file={QUICKSTART}", *[f"--gin_param={p}" for p in SHORT],
            f"--run_dir={tmp_path / 'run'}", "--quiet"]
    code = BLOCK + f"""
from areal_jax.cli import main
rc = main({args!r})
print("BLOCKED_LOADED", sorted(m for m in sys.modules
                              if m.split(".")[0] in ("pyarrow", "datasets", "wandb", "aiohttp", "httpx", "openai")))
sys.exit(rc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BLOCKED_LOADED []" in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trained_tokens"] > 0
    assert (tmp_path / "run" / "final_model" / "config.json").exists()


def test_the_agent_endpoint_without_aiohttp_names_the_extra_at_once():
    code = BLOCK + """
import time
from areal_jax.agents.server import Endpoint
t0 = time.monotonic()
try:
    Endpoint(None, None).start(timeout_s=30)
except ImportError as e:
    print("MESSAGE", e, "AFTER", round(time.monotonic() - t0))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MESSAGE" in out.stdout and "aiohttp" in out.stdout and "areal-jax[agents]" in out.stdout
    assert "AFTER 0" in out.stdout  # not the 30 s start timeout
