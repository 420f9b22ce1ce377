"""User code is found where a user keeps it: the complete examples of docs/user_guide.md ("Your
own reward", "Your own workflow", "Your own loss") run as written, from the working directory, through real
`areal-jax` processes; --import_path works from elsewhere; a name that does not resolve stops the
job before any work in one line that names the module and says how to make it importable."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from areal_jax.metrics import read_jsonl
from tests.test_run_dir import assert_user_error as one_line_error  # exit 2, one line, no traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "user_guide.md"
QUICKSTART = str(ROOT / "configs" / "quickstart.gin")
TINY_RL = [  # RL only on the built-in task: two synchronous steps of a 1-layer model
    "ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "TaskSource.train_size = 50",
    "TaskSource.eval_size = 0", "TaskSource.validation_size = 0", "Stages.sft = False", "Stages.plot = False",
    "RLConfig.steps = 2", "RLConfig.batch_size = 2", "RLConfig.max_concurrent = 4", "RLConfig.eval_every = 0",
    "RLVRConfig.n_samples = 2", "RLVRConfig.max_new_tokens = 8", "RLVRConfig.filter_all_equal_rewards = False",
    "EngineConfig.num_slots = 4", "EngineConfig.max_seq_len = 64", "RLConfig.mode = 'sync'",
    "RLConfig.max_staleness = 0", "Stages.checkpoint = False", "Stages.save_final_model = False",
]


def guide_example(filename: str) -> str:
    """The guide's python block that starts with `# <filename>`."""
    blocks = re.findall(r"```python\n(# " + re.escape(filename) + r"\n.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) == 1, f"docs/user_guide.md has {len(blocks)} examples named {filename}"
    return blocks[0]


def areal_jax(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """The console script's way in (`areal_jax.cli:main`), run from `cwd`: sys.path[0] is not the
    working directory, as for the installed `areal-jax`; only the worktree is on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    code = "import sys; from areal_jax.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)



def train_args(run_dir: pathlib.Path, *params: str) -> list[str]:
    return ["train", f"--gin_file={QUICKSTART}", *[f"--gin_param={p}" for p in TINY_RL + list(params)],
            f"--run_dir={run_dir}", "--quiet"]


def test_the_guides_reward_example_scores_as_documented(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(guide_example("my_rewards.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_rewards import last_integer

    assert last_integer("3 + 4 = 7, so 7", "7") == 1.0
    assert last_integer("it is 1,234", "1,234") == 1.0
    assert last_integer("7 then 8", "7") == 0.0 and last_integer("no number", "7") == 0.0


def test_own_reward_is_imported_from_the_working_directory(tmp_path):
    (tmp_path / "my_rewards.py").write_text(guide_example("my_rewards.py"))
    run = tmp_path / "run"
    done = areal_jax(*train_args(run, "RLVRConfig.reward = 'my_rewards:last_integer'"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    summary = json.loads((run / "summary.json").read_text())
    # Every call ran in the reward workers, found there too: none failed to load or raised.
    assert summary["reward"]["succeeded"] >= 8 and summary["reward"]["errors"] == 0, summary["reward"]


def test_own_workflow_runs_from_the_working_directory(tmp_path):
    (tmp_path / "my_workflow.py").write_text(guide_example("my_workflow.py"))
    run = tmp_path / "run"
    done = areal_jax(*train_args(run, "RLConfig.workflow = 'my_workflow:BrevityWorkflow'",
                                 "BrevityConfig.penalty_per_token = 0.01", "TrainEngineConfig.max_tokens_per_microbatch = 64",
                                 "RLConfig.dump_rollouts_every = 1"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = read_jsonl(run / "rollouts" / "step_0.jsonl")
    assert samples
    for s in samples:  # the task's 0/1 reward less 0.01 per generated token
        base = s["reward"] + 0.01 * len(s["versions"])  # one version per generated token
        assert min(abs(base), abs(base - 1.0)) < 1e-6, s


def test_own_loss_trains_and_logs_its_metrics_under_train(tmp_path):
    """The guide's "Your own loss", as written: selected by PPOConfig.objective = "module:function"
    from the working directory, it trains, and its metric is in metrics.jsonl as train/<name>."""
    (tmp_path / "my_loss.py").write_text(guide_example("my_loss.py"))
    run = tmp_path / "run"
    done = areal_jax(*train_args(run, "PPOConfig.objective = 'my_loss:capped_ratio_pg'"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for m in (r["metrics"] for r in records):  # one update per step: the ratio to the pre-update policy is 1
        assert m["train/ratio"] == pytest.approx(1.0, abs=1e-5) and m["train/trained_tokens"] > 0
        assert "train/clip_frac" not in m  # the built-in loss's metrics are the built-in's


def test_import_path_finds_code_kept_elsewhere(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "my_rewards.py").write_text(guide_example("my_rewards.py"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    reward = "RLVRConfig.reward = 'my_rewards:last_integer'"
    one_line_error(areal_jax(*train_args(tmp_path / "r0", reward), cwd=elsewhere),
                   "RLVRConfig.reward", "'my_rewards'", "--import_path", "my_rewards.py")
    assert not (tmp_path / "r0").exists()
    done = areal_jax(*train_args(tmp_path / "r1", reward), f"--import_path={code}", cwd=elsewhere)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("binding,phrases", [
    ("RLVRConfig.reward = 'tests.reward_fixtures:no_such_fn'",
     ("RLVRConfig.reward", "no attribute 'no_such_fn'")),
    ("RLVRConfig.reward = 'no_such_module:fn'", ("RLVRConfig.reward", "no module named 'no_such_module'",
                                                 "--import_path")),
    ("RLVRConfig.reward = 'tests.reward_fixtures_crash_on_import:fn'",
     ("RLVRConfig.reward", "importing 'tests.reward_fixtures_crash_on_import' ended the process (exit code 7)")),
    ("RLVRConfig.reward = 'json:no_such_fn'", ("RLVRConfig.reward", "no attribute 'no_such_fn'")),
    ("RLConfig.workflow = 'no_such_workflows:Flow'", ("RLConfig.workflow", "no module named 'no_such_workflows'",
                                                      "--import_path")),
])
def test_user_code_that_does_not_resolve_stops_the_job_before_any_work(tmp_path, binding, phrases):
    run = tmp_path / "run"
    # SFT first: the reward is only called after it, yet the name is resolved before it starts.
    one_line_error(areal_jax(*train_args(run, binding, "Stages.sft = True", "SFTConfig.steps = 2",
                                         "SFTConfig.eval_every = 0", "SFTConfig.stop_accuracy = 0.0"), cwd=ROOT),
                   *phrases)
    assert not run.exists()  # nothing written, so no directory "holds a run"
