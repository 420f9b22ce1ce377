"""A user's own base model and GSM8K-style rows, through real `areal-jax` processes: the data paths
select the dataset task; a reward that cannot read the data's reference solutions, or a model
without the template its prompts need, stops the job in one line before any work; a run's model
carries its prompt encoding into export, eval and generate; a run resumes without its gin file;
checkpoints are on by default and export names the step it wrote."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from areal_jax import config_system as cs
from areal_jax.jobs.configs import load_job_configs
from areal_jax.metrics import read_jsonl
from tests.test_run_dir import assert_user_error as one_line_error  # exit 2, one line, no traceback
from tests.test_cli import _tiny_model_dir
from tests.test_sft_job import gsm8k_rows, write_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.gin")
TEMPLATE = "DataConfig.prompt_template = 'Question: {question}\\nAnswer:'"
SHORT = [  # SFT then RL, each a few steps of a 1-layer model, one device
    "SFTConfig.steps = 4", "SFTConfig.warmup_steps = 1", "SFTConfig.rows_per_step = 4", "SFTConfig.max_len = 160",
    "RLConfig.steps = 2", "RLConfig.batch_size = 2", "RLConfig.max_concurrent = 4", "RLConfig.eval_every = 0",
    "RLConfig.mode = 'sync'", "RLConfig.max_staleness = 0", "RLVRConfig.n_samples = 2",
    "RLVRConfig.max_new_tokens = 8", "RLVRConfig.filter_all_equal_rewards = False", "EngineConfig.num_slots = 4",
    "DataConfig.max_prompt_tokens = 64", "Stages.plot = False",
]


def areal_jax(*args: str, env_extra: dict | None = None, unset: tuple = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1",
           **(env_extra or {})}
    for name in unset:
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "areal_jax.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)



def params(*bindings: str) -> list[str]:
    return [f"--gin_param={b}" for b in bindings]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    return {"base": _tiny_model_dir(root / "base", template_storage="none"), "chat": _tiny_model_dir(root / "chat"),
            "train": write_jsonl(root / "train.jsonl", gsm8k_rows(16)),
            "test": write_jsonl(root / "test.jsonl", gsm8k_rows(4, start=50)), "root": root}


def data_params(files, model="base", *extra):
    return params(f"ModelSource.path = '{files[model]}'", f"DataConfig.paths = ('{files['train']}',)",
                  f"TaskSource.eval_paths = ('{files['test']}',)", "TaskSource.eval_size = 4", *SHORT, *extra)


# ---- which task, and checks before any work ------------------------------------------------------

def test_data_paths_select_the_dataset_task():
    try:
        cfg = load_job_configs([QUICKSTART], ["DataConfig.paths = ('x.jsonl',)", "TaskSource.eval_size = 0",
                                              "SFTConfig.eval_every = 0", "SFTConfig.stop_accuracy = 0.0"],
                               run_dir="r")
        assert cfg.task.kind == "dataset" and cfg.data.paths == ("x.jsonl",)
        assert load_job_configs([QUICKSTART], [], run_dir="r").task.kind == "arithmetic"
        # Files without held-out files: no held-out accuracy rather than an error.
        assert load_job_configs([], ["DataConfig.paths = ('x.jsonl',)"], run_dir="r").task.eval_size == 0
        with pytest.raises(cs.ConfigError, match=r"DataConfig.paths is bound, but TaskSource.kind = 'arithmetic'"):
            load_job_configs([], ["DataConfig.paths = ('x.jsonl',)", "TaskSource.kind = 'arithmetic'"], run_dir="r")
    finally:
        cs.parse()


def test_a_reward_that_cannot_read_the_solutions_is_refused_before_any_work(files):
    run = files["root"] / "refused"
    # 'arithmetic' reads only \boxed{} integers: GSM8K's "#### 16" scores 0.
    line = one_line_error(areal_jax("train", *data_params(files, "base", TEMPLATE, "RLVRConfig.reward = 'arithmetic'"),
                                    f"--run_dir={run}", "--quiet"),
                          "RLVRConfig.reward = 'arithmetic'", files["train"], "0.00", "(16 rows)",
                          "TaskSource.solution_reward_min = 0.9", "'gsm8k'", "solution_reward_min = 0")
    assert "#### 2" in line  # what the rows teach
    assert not run.exists()


def test_a_reward_that_raises_on_the_solutions_is_one_line_naming_it(files):
    """A pool reward that raises on every reference solution: one line with the reward and its first
    error (was a traceback per solution, then a line blaming the data's format)."""
    run = files["root"] / "raising"
    reward = "tests.reward_fixtures:boom"  # boom(message) called as boom(text, gold): a TypeError
    done = areal_jax("train", *data_params(files, "base", TEMPLATE, f"RLVRConfig.reward = '{reward}'"),
                     f"--run_dir={run}", "--quiet")
    line = one_line_error(done, f"RLVRConfig.reward = '{reward}' failed on a reference solution of {files['train']}",
                          "raised TypeError: boom() takes")
    assert "cannot read the answers" not in line and done.stderr.count("boom()") == 1
    assert not run.exists()


def test_the_self_check_gives_an_in_process_reward_a_deadline(files):
    """An in-process reward that blocks: the self-check refuses after RLVRConfig.reward_timeout_s
    instead of hanging train() before any output."""
    import threading

    from areal_jax.jobs.inputs import InputError
    from areal_jax.jobs.preflight import check_solution_rewards
    from areal_jax.reward.registry import register_reward_callable
    from areal_jax.reward.scoring import RewardScorer

    never = threading.Event()
    blocking = register_reward_callable(lambda text, gold: never.wait() and 1.0)
    try:
        cfg = load_job_configs([], [f"DataConfig.paths = ('{files['train']}',)", "TaskSource.eval_size = 0",
                                    f"RLVRConfig.reward = '{blocking}'", "RLVRConfig.reward_timeout_s = 1.0"],
                               run_dir="r")
        scorer = RewardScorer(cfg.rollout.reward, None, timeout_s=cfg.rollout.reward_timeout_s)
        with pytest.raises(InputError, match=f"reward '{blocking}' took longer than 1 s"):
            check_solution_rewards(cfg, scorer.checked_map)
        wrong = register_reward_callable(lambda text, gold: "1")
        with pytest.raises(InputError, match=f"reward '{wrong}' returned str '1', expected a real number"):
            check_solution_rewards(cfg, RewardScorer(wrong, None, timeout_s=1.0).checked_map)
    finally:
        never.set()
        cs.parse()


@pytest.mark.parametrize("command", ["sft", "train"])
def test_a_base_model_without_prompt_template_is_one_line_in_every_job(files, command):
    run = files["root"] / f"no-template-{command}"
    one_line_error(areal_jax(command, *data_params(files, "base", "RLVRConfig.reward = 'gsm8k'"), f"--run_dir={run}",
                             "--quiet"), "no chat template", "DataConfig.prompt_template")
    # The built-in task prompts through a chat template too.
    one_line_error(areal_jax(command, *params(f"ModelSource.path = '{files['base']}'", *SHORT), f"--run_dir={run}",
                             "--quiet"), "no chat template", "built-in arithmetic task", "DataConfig.paths")
    assert not run.exists()


def test_eval_of_a_base_model_without_prompt_template_is_one_line(files):
    one_line_error(areal_jax("eval", f"--model={files['base']}", f"--run_dir={files['root'] / 'e0'}",
                             *params(f"DataConfig.paths = ('{files['test']}',)", "EvalConfig.reward = 'gsm8k'")),
                   "no chat template", "DataConfig.prompt_template")


# ---- one run, then everything that reads it ------------------------------------------------------

@pytest.fixture(scope="module")
def run(files):
    run_dir = files["root"] / "run"
    done = areal_jax("train", *data_params(files, "base", TEMPLATE, "RLVRConfig.reward = 'gsm8k'",
                                           f"CheckpointConfig.export_dir = '{run_dir / 'hf'}'",
                                           "CheckpointConfig.export_hf_interval_steps = 2"),
                     f"--run_dir={run_dir}", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_the_run_checkpoints_by_default_and_its_models_carry_the_prompt_encoding(run):
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]  # the last step
    settings = json.loads((run / "final_model" / "areal_jax_prompt.json").read_text())
    assert settings == {"prompt_template": "Question: {question}\nAnswer:", "chat_template_kwargs": {},
                        "system_prompt": None, "prompt_suffix": ""}
    # The exports the run writes as it goes carry the same, and the tokenizer.
    export = run / "hf" / "step_2"
    assert json.loads((export / "areal_jax_prompt.json").read_text()) == settings
    assert (export / "tokenizer.json").is_file()


def test_export_names_its_step_carries_the_encoding_and_prints_no_warning(run, files):
    out = files["root"] / "export"
    done = areal_jax("export", f"--checkpoint={run / 'checkpoints'}", f"--out={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported step 2 of {run / 'checkpoints'}" in done.stdout
    assert done.stderr == "", done.stderr[-3000:]
    assert (out / "areal_jax_prompt.json").read_text() == (run / "final_model" / "areal_jax_prompt.json").read_text()


def test_eval_of_the_run_uses_its_model_reward_files_and_prompts(run, files):
    out = files["root"] / "eval"
    # The base model has no chat template: this only runs with the run's prompt_template.
    done = areal_jax("eval", f"--run_dir_of={run}", f"--run_dir={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["reward"] == "gsm8k" and report["config"]["max_new_tokens"] == 8
    assert report["overall"]["num_prompts"] == 4
    assert {s["source"].split(":")[0] for s in read_jsonl(out / "samples.jsonl")} == {files["test"]}


def test_generate_encodes_as_the_run_did_and_takes_sampling_flags(run):
    done = areal_jax("generate", f"--model={run / 'final_model'}", "--prompt=Ann has 3 pens.", "--max_new_tokens=4",
                     "--temperature=1.0", "--top_p=0.9", "--top_k=5", "--n=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("### Ann has 3 pens.") == 2
    one_line_error(areal_jax("generate", f"--model={run / 'final_model'}", "--prompt=x", "--system=Be brief."),
                   "--system", "prompt_template 'Question: {question}\\nAnswer:'", "areal_jax_prompt.json")


def test_resume_needs_no_gin_file(run):
    done = areal_jax("train", f"--run_dir={run}", "--resume", "--override_config", "--quiet",
                     *params("RLConfig.steps = 3"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [-4, -3, -2, -1, 0, 1, 2]
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


# ---- prompt encodings of generate, and platforms ---------------------------------------------------

def test_generate_prompt_encodings(files):
    from areal_jax.jobs.run_settings import encode_prompts, generate_settings
    from areal_jax.models.tokenizer import Tokenizer

    base, chat = Tokenizer.from_pretrained(files["base"]), Tokenizer.from_pretrained(files["chat"])
    plain = generate_settings(str(files["base"]), system=None, chat_template_kwargs=None)
    assert encode_prompts(base, ["Ann has 3 pens."], plain) == [base.encode("Ann has 3 pens.")]
    templated = {**plain, "prompt_template": "Q: {question}\nA:"}
    assert encode_prompts(base, ["hi"], templated) == [base.encode("Q: hi\nA:", add_special_tokens=True)]
    settings = generate_settings(str(files["chat"]), system="Be brief.", chat_template_kwargs='{"flag": true}')
    assert settings["system_prompt"] == "Be brief." and settings["chat_template_kwargs"] == {"flag": True}
    ids = encode_prompts(chat, ["hi"], settings)[0]
    assert ids == chat.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert "Be brief." in chat.decode(ids)


def test_no_accelerator_means_cpu_unless_the_user_chose(monkeypatch):
    from areal_jax import platforms

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platforms, "accelerator_present", lambda: False)
    assert platforms.choose_platforms() == "cpu" and os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert platforms.choose_platforms() is None and os.environ["JAX_PLATFORMS"] == "cuda"
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(platforms, "accelerator_present", lambda: True)
    assert platforms.choose_platforms() is None and "JAX_PLATFORMS" not in os.environ


def test_commands_on_a_machine_without_accelerators_print_no_plugin_noise(files):
    from areal_jax.platforms import accelerator_present

    if accelerator_present():
        pytest.skip("this machine has an accelerator: its plugins are meant to start")
    done = areal_jax("config", unset=("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES"))
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    # generate starts jax's backends: with the CUDA and TPU plugins installed they would speak here.
    done = areal_jax("generate", f"--model={files['chat']}", "--prompt=hi", "--max_new_tokens=2",
                     unset=("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES"))
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]


def test_solution_check_scores_each_file_and_can_be_turned_off(files):
    from areal_jax.jobs.preflight import check_solution_rewards, solution_samples
    from areal_jax.reward.gsm8k import gsm8k_reward

    samples = list(solution_samples(files["train"], "auto"))
    assert len(samples) == 16 and all(gold == text.rsplit("#### ", 1)[1] for text, gold in samples)
    try:
        bindings = [f"DataConfig.paths = ('{files['train']}',)", f"TaskSource.eval_paths = ('{files['test']}',)",
                    "TaskSource.eval_size = 4"]
        cfg = load_job_configs([], bindings, run_dir="r")
        score = lambda calls: [gsm8k_reward(*c) for c in calls]  # noqa: E731
        assert check_solution_rewards(cfg, score) == {files["train"]: 1.0, files["test"]: 1.0}
        cfg = load_job_configs([], bindings + ["TaskSource.solution_reward_min = 0"], run_dir="r")
        assert check_solution_rewards(cfg, lambda calls: [0.0] * len(calls)) == {}  # allowed on purpose
    finally:
        cs.parse()


def test_import_paths_go_first_once(tmp_path, monkeypatch):
    from areal_jax.user_code import add_import_paths

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["/a", str(tmp_path), "/b"])
    monkeypatch.setenv("PYTHONPATH", "/c")
    assert add_import_paths(["/extra"]) == ["/extra"]
    assert sys.path == ["/extra", str(tmp_path), "/a", "/b"]
    assert os.environ["PYTHONPATH"] == os.pathsep.join(["/extra", str(tmp_path), "/c"])
    add_import_paths(["/extra"])  # idempotent
    assert sys.path == ["/extra", str(tmp_path), "/a", "/b"]
