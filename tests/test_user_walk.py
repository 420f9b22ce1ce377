"""The user guide's path for one's own model and data, walked as a new user would with a base model
(no chat template) and GSM8K-style rows: SFT, then RL that gets nonzero reward, then eval of the run,
then export; each through the `areal-jax` command line in its own process, with no JAX_PLATFORMS
set (the CLI chooses the CPU itself on a machine without accelerators).

Slow (minutes on a CPU): `pytest -m slow tests/test_user_walk.py`. With AREAL_WALK_PYTHON=PATH it
runs under another interpreter, e.g. a clean venv holding only the base package."""

import json
import os
import pathlib
import random
import subprocess
import sys

import pytest

from areal_jax.metrics import read_jsonl
from tests.test_cli import _tiny_model_dir
from tests.test_sft_job import write_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("AREAL_WALK_PYTHON", sys.executable)


def rows(n: int, seed: int) -> list[dict]:
    """GSM8K-style rows: a question, a worked answer ending in '#### N'."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append({"question": f"Ann has {a} pens and gets {b} more. How many pens does she have?",
                    "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return out


def areal_jax(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([PYTHON, "-m", "areal_jax.cli", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=1800)
    print(f"$ areal-jax {' '.join(args)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done


# The guide's gin file for this path, written by the user beside their data.
MY_RUN = """\
ModelSource.path = "{model}"
DataConfig.paths = ("train.jsonl",)
DataConfig.prompt_template = "Question: {{question}}\\nAnswer:"
DataConfig.max_prompt_tokens = 48
TaskSource.eval_paths = ("test.jsonl",)
TaskSource.eval_size = 32
RLVRConfig.reward = "gsm8k"
RLVRConfig.max_new_tokens = 16
RLVRConfig.n_samples = 4
RLVRConfig.temperature = 1.0
SFTConfig.steps = 300
SFTConfig.rows_per_step = 16
SFTConfig.lr = 3e-3
SFTConfig.warmup_steps = 20
SFTConfig.max_len = 96
RLConfig.steps = 10
RLConfig.batch_size = 8
RLConfig.max_staleness = 1
RLConfig.eval_every = 5
OptimizerConfig.lr = 1e-4
TrainEngineConfig.scan_layers = False
PPOConfig.num_minibatches = 1
EngineConfig.num_slots = 32
Stages.plot = False
"""


@pytest.mark.slow
def test_sft_then_rl_with_reward_then_eval_then_export(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    model = _tiny_model_dir(tmp_path / "base-model", template_storage="none")  # a base model: no chat template
    write_jsonl(work / "train.jsonl", rows(400, seed=0))
    write_jsonl(work / "test.jsonl", rows(32, seed=1))
    (work / "my_run.gin").write_text(MY_RUN.format(model=model))

    done = areal_jax("train", "--gin_file=my_run.gin", "--run_dir=runs/mine", "--quiet", cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    run = work / "runs" / "mine"
    records = read_jsonl(run / "metrics.jsonl")
    rl = [r["metrics"] for r in records if r["step"] >= 0]
    assert len(rl) == 10
    rewards = [m["reward/mean"] for m in rl]
    assert max(rewards) > 0, rewards  # the reward reads what SFT taught: not 0 throughout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sft_accuracy"] is not None and summary["final_accuracy"] is not None

    out = work / "eval"
    done = areal_jax("eval", "--run_dir_of=runs/mine", f"--run_dir={out}", cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["reward"] == "gsm8k" and report["overall"]["num_prompts"] == 32
    # The run's own greedy held-out check and eval's agree: same model, prompts, reward and budget.
    assert report["overall"]["pass@1"] == pytest.approx(summary["final_accuracy"])

    done = areal_jax("export", "--checkpoint=runs/mine/checkpoints", "--out=exported", cwd=work)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    assert "exported step 10" in done.stdout
    assert (work / "exported" / "areal_jax_prompt.json").is_file()
