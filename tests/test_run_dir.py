"""Run directories and readable errors, end to end through `python -m areal_jax.cli`: a directory that
holds a run is refused unless --overwrite (which starts it afresh) or --resume (which needs a
checkpoint and the same model, mesh and batch); model and data problems are one line naming the file
and field, exit code 2, and --debug shows the traceback."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from areal_jax.metrics import read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.gin")
TINY = [  # RL only, two synchronous steps of a 1-layer model, a checkpoint per step
    "ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "TaskSource.train_size = 50",
    "TaskSource.eval_size = 0", "TaskSource.validation_size = 0", "Stages.sft = False", "Stages.plot = False",
    "RLConfig.steps = 2", "RLConfig.batch_size = 2", "RLConfig.max_concurrent = 4", "RLConfig.eval_every = 0",
    "RLVRConfig.n_samples = 2", "RLVRConfig.max_new_tokens = 8", "RLVRConfig.filter_all_equal_rewards = False",
    "EngineConfig.num_slots = 4", "EngineConfig.max_seq_len = 64", "RLConfig.mode = 'sync'",
    "RLConfig.max_staleness = 0", "CheckpointConfig.save_interval_steps = 1",
]
NO_CHECKPOINTS = [p for p in TINY if not p.startswith("CheckpointConfig")]


def cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m areal_jax.cli ARGS` on one CPU device (the fastest split for a tiny run)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    return subprocess.run([sys.executable, "-m", "areal_jax.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def train(run_dir: pathlib.Path, *extra: str, params: list[str] = TINY, command: str = "train"):
    return cli(command, f"--gin_file={QUICKSTART}", *[f"--gin_param={p}" for p in params], f"--run_dir={run_dir}",
               "--quiet", *extra)


def assert_user_error(done: subprocess.CompletedProcess, *phrases: str) -> str:
    """Exit code 2 and one line on stderr holding every phrase, no traceback; returns the line."""
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("areal-jax:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])
    return lines[0]


def snapshot(run_dir: pathlib.Path) -> dict[str, bytes]:
    """Every file under the run directory with its bytes (directories' files included)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def checkpoint_steps(run_dir: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def test_a_run_directory_is_refused_resumed_only_unchanged_and_overwritten_afresh(tmp_path):
    run = tmp_path / "run"
    done = train(run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 1]
    first_steps = checkpoint_steps(run)
    assert first_steps and (run / "final_model").is_dir()
    before = snapshot(run)

    # A new run in the same directory: refused, naming the directory and what it holds; nothing moves.
    assert_user_error(train(run, params=TINY + ["RLConfig.steps = 1"]), str(run), "config.gin", "metrics.jsonl",
                      "summary.json", "final_model/", f"checkpoints/ (step {first_steps[-1]})", "--overwrite")
    assert snapshot(run) == before

    # Resuming with another model, batch and engine seed: refused before any work, naming each field.
    line = assert_user_error(
        train(run, "--resume", params=TINY + ["ModelSource.hidden_size = 64", "RLConfig.batch_size = 4",
                                              "EngineConfig.seed = 3", "EngineConfig.num_slots = 8"]),
        "ModelSource.hidden_size: 32 -> 64", "RLConfig.batch_size: 2 -> 4", "EngineConfig.seed: 0 -> 3")
    assert "num_slots" not in line  # sizes no saved state: free to change on resume
    assert snapshot(run) == before
    assert_user_error(train(run, "--resume", "--overwrite"), "--overwrite")
    assert snapshot(run) == before

    # --overwrite: the old records go, so one step is one metrics record and checkpoints start over.
    done = train(run, "--overwrite", params=TINY + ["RLConfig.steps = 1"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0]
    assert json.loads((run / "summary.json").read_text())["steps"] == 1
    assert checkpoint_steps(run) == first_steps[:1]  # saved again (not taken as "already saved")
    assert "RLConfig.steps = 1" in (run / "config.gin").read_text()


@pytest.mark.parametrize("params,phrases", [
    (NO_CHECKPOINTS + ["Stages.checkpoint = False"], ("--resume: nothing to resume", "Stages.checkpoint = False")),
    (NO_CHECKPOINTS, ("--resume: nothing to resume", "no finished checkpoint under", "checkpoints")),  # on by default
    (TINY, ("--resume: nothing to resume", "no finished checkpoint under", "checkpoints")),
])
def test_resume_with_nothing_to_resume_is_an_error_that_writes_nothing(tmp_path, params, phrases):
    run = tmp_path / "run"
    assert_user_error(train(run, "--resume", params=params), *phrases)
    assert not run.exists()


@pytest.mark.parametrize("params,phrases", [
    (["EngineConfig.kv_layout = 'paged'", "EngineConfig.kv_pool_bytes = 1000"],
     ("EngineConfig: EngineConfig.kv_pool_bytes = 1000 holds 0 pages", "less than one sequence of max_seq_len = 64")),
    (["EngineConfig.kv_layout = 'paged'", "EngineConfig.attention_impl = 'pallas'"],
     ("EngineConfig: paged attention impl 'pallas': no kernel for platform 'cpu'", "use 'reference' or 'auto'")),
    (["ModelSource.num_experts = 4", "LoRAConfig.rank = 4"],  # every layer sparse: no gate, up or down
     ("LoRAConfig.targets = ('q', 'k', 'v', 'o', 'gate', 'up', 'down'): this model has no gate, up, down",
      "set LoRAConfig.targets = ('q', 'k', 'v', 'o')")),
])
def test_an_engine_or_adapters_that_cannot_be_built_are_refused_before_anything_is_written(tmp_path, params, phrases):
    """Was a traceback from the engine (LoRA: KeyError 'w_down' in the trainer), after config.json,
    config.gin and the tokenizer were written."""
    run = tmp_path / "run"
    assert_user_error(train(run, params=TINY + params), *phrases)
    assert not run.exists()


def tiny_model(path: pathlib.Path) -> pathlib.Path:
    from tests.test_cli import _tiny_model_dir

    return _tiny_model_dir(path)


def test_model_and_data_problems_are_one_line_naming_file_and_field(tmp_path):
    model = tiny_model(tmp_path / "model")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"question": "What is 1+1?", "answer": "so #### 2"}) + "\n")
    dataset = ["TaskSource.kind = 'dataset'", "TaskSource.eval_size = 0", "RLVRConfig.reward = 'math'"]

    def train_on(model_dir, data, run_name):
        return train(tmp_path / run_name, params=TINY + dataset + [f"ModelSource.path = '{model_dir}'",
                                                                    f"DataConfig.paths = ('{data}',)"])

    missing = tmp_path / "no_such_model"
    assert_user_error(train_on(missing, good, "r1"), "ModelSource.path", f"model directory {missing} does not exist")
    assert_user_error(train_on(model, tmp_path / "nope.jsonl", "r2"), "DataConfig.paths",
                      f"data file {tmp_path / 'nope.jsonl'} does not exist")
    unusable = tmp_path / "unusable.jsonl"
    unusable.write_text(json.dumps({"question": "What is 1+1?", "answer": "no gold here"}) + "\nnot json\n")
    assert_user_error(train_on(model, unusable, "r3"), "DataConfig.paths", "no usable prompt rows", str(unusable))

    no_field = tmp_path / "no_field"
    no_field.mkdir()
    for f in model.iterdir():
        (no_field / f.name).write_bytes(f.read_bytes())
    config = json.loads((model / "config.json").read_text())
    del config["hidden_size"]
    (no_field / "config.json").write_text(json.dumps(config))
    assert_user_error(train_on(no_field, good, "r4"), "ModelSource.path", str(no_field / "config.json"),
                      "'hidden_size'")
    for name in ("r1", "r2", "r3", "r4"):
        assert not (tmp_path / name / "config.gin").exists() and not (tmp_path / name / "config.json").exists()

    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # the last tensor loses its end
    assert_user_error(cli("generate", f"--model={model}", "--prompt=hi"), str(weights), "truncated", "tensor '")
    assert_user_error(cli("eval", f"--model={no_field}", f"--gin_param=DataConfig.paths = ('{good}',)"),
                      "--model", "'hidden_size'")
    assert_user_error(cli("eval", f"--model={no_field}", "--gin_param=DataConfig.paths = ('/no/data.jsonl',)"),
                      "DataConfig.paths", "/no/data.jsonl")

    debug = cli("generate", f"--model={missing}", "--prompt=hi", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and str(missing) in debug.stderr
