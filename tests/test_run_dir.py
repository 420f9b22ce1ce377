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

    # Resuming with flags that change the run's config (RUN/config.gin): the changes listed, refused.
    changed = TINY + ["ModelSource.hidden_size = 64", "RLConfig.batch_size = 4", "EngineConfig.seed = 3",
                      "EngineConfig.num_slots = 8"]
    assert_user_error(train(run, "--resume", params=changed), "--resume: the flags change the run's own config",
                      "EngineConfig.num_slots: 4 -> 8", "ModelSource.hidden_size: 32 -> 64", "--override_config")
    # The .gin file alone: the run's own --gin_params would be dropped, so the same.
    assert_user_error(cli("train", f"--gin_file={QUICKSTART}", f"--run_dir={run}", "--resume", "--quiet"),
                      "RLConfig.steps: 2 -> 120", "ModelSource.hidden_size: 32 -> 128", "--override_config")
    assert snapshot(run) == before
    # --override_config with another model, batch and engine seed: refused before any work, naming each field.
    line = assert_user_error(train(run, "--resume", "--override_config", params=changed),
                             "ModelSource.hidden_size: 32 -> 64", "RLConfig.batch_size: 2 -> 4",
                             "EngineConfig.seed: 0 -> 3")
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


def _rows(n: int) -> str:
    return "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(n))


def _cli_in(cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    return subprocess.run([sys.executable, "-m", "areal_jax.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


DATASET = ["TaskSource.eval_size = 0", "TaskSource.solution_reward_min = 0.0",
           "RLVRConfig.reward = 'tests.resume_fixtures:digit_share'"]


def test_a_resume_reads_the_files_the_run_trained_on_from_anywhere_and_refuses_changed_ones(tmp_path):
    first, other, run = tmp_path / "first", tmp_path / "other", tmp_path / "run"
    for directory, n in ((first, 20), (other, 5)):  # the same relative name, two datasets
        directory.mkdir()
        (directory / "train.jsonl").write_text(_rows(n))
    done = _cli_in(first, "train", f"--gin_file={QUICKSTART}", *[f"--gin_param={p}" for p in TINY + DATASET],
                   "--gin_param=DataConfig.paths = ('train.jsonl',)", f"--run_dir={run}", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    data = str(first / "train.jsonl")
    assert json.loads((run / "config.json").read_text())["data"]["paths"] == [data]
    assert f"DataConfig.paths = ('{data}',)" in (run / "config.gin").read_text()
    # From another directory, whose train.jsonl is another dataset: the run's own files.
    done = _cli_in(other, "train", f"--run_dir={run}", "--resume", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    # The run's file shrank since: refused, naming it, before anything is written.
    (first / "train.jsonl").write_text(_rows(5))
    before = snapshot(run)
    assert_user_error(_cli_in(other, "train", f"--run_dir={run}", "--resume", "--quiet"),
                      "--resume: DataConfig.paths is not the data the run trained on", f"{data}: 20 lines",
                      f"now {data}: 5 lines")
    assert snapshot(run) == before


API_RUN = """
import sys
import areal_jax as aj
from areal_jax.jobs.inputs import InputError
run, n, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume"
rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(n)]
cfg = aj.load_config(sys.argv[4], overrides=sys.argv[5:])
trainer = aj.Trainer(cfg, run_dir=run, train_data=rows, reward_fn=lambda text, gold: float(len(text) % 2))
try:
    trainer.train(progress=False, resume=resume)
except InputError as e:
    print(f"refused: {e}")
    sys.exit(3)
"""


def test_a_trainers_rows_go_into_the_run_only_after_its_checks_and_a_resume_on_other_rows_is_refused(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}

    def api(n: int, mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", API_RUN, str(run), str(n), mode, QUICKSTART, *TINY,
                               "TaskSource.solution_reward_min = 0.0"], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=600)

    done = api(200, "new")
    assert done.returncode == 0, done.stderr[-3000:]
    before = snapshot(run)
    assert before["inputs/train.jsonl"].count(b"\n") == 200
    done = api(50, "new")  # a second Trainer on the run: refused, its rows not written
    assert done.returncode == 3 and "already holds a run" in done.stdout, done.stdout + done.stderr[-3000:]
    assert snapshot(run) == before
    done = api(50, "resume")  # resuming on other rows: refused before they replace the run's
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    assert "DataConfig.paths is not the data the run trained on" in done.stdout and "200 lines" in done.stdout
    assert snapshot(run) == before
    done = api(200, "resume")  # the same rows: resumed
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_resume_whose_model_or_lora_shapes_differ_is_refused_before_anything_is_written(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    lora = TINY + ["LoRAConfig.rank = 4", "LoRAConfig.base_dtype = 'float32'"]
    done = train(run, params=lora)
    assert done.returncode == 0, done.stderr[-3000:]
    before = snapshot(run)
    # LoRAConfig is among the fields a resume keeps (config.json): refused whatever --override_config says.
    assert_user_error(train(run, "--resume", "--override_config", params=lora + ["LoRAConfig.rank = 8"]),
                      "LoRAConfig.rank: 4 -> 8")
    assert snapshot(run) == before
    # Without the run's config.json (its checkpoints read from another run directory): the checkpoint's
    # own shapes refuse it, one line naming the field, before anything is written.
    elsewhere = [f"CheckpointConfig.directory = '{run / 'checkpoints'}'"]
    for params, phrase in ((["LoRAConfig.rank = 8"], "LoRAConfig.rank is 8, checkpoint step 2 under"),
                           (["LoRAConfig.targets = ('q', 'v')"], "LoRAConfig.targets are ('q', 'v'), checkpoint"),
                           (["ModelSource.hidden_size = 64"], "the model's weight embed is (")):
        assert_user_error(train(other, "--resume", params=lora + elsewhere + params), "--resume: " + phrase)
        assert not other.exists()
    assert snapshot(run) == before
    done = cli("train", f"--run_dir={run}", "--resume", "--quiet")  # the correct resume still goes
    assert done.returncode == 0, done.stderr[-3000:]
