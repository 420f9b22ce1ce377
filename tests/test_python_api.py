"""The Python API's configs and inputs (areal_jax/python_api.py, job_config.py): configs built in
Python and from gin are the same configs, rows and rewards become what a file-configured run reads,
and the package stays light to import. Whole runs: tests/test_example_scripts.py."""

import json
import subprocess
import sys

import pytest

import areal_jax as aj
from areal_jax.jobs.configs import load_job_configs


def test_configs_built_in_python_round_trip_through_their_gin_text(tmp_path):
    cfg = aj.JobConfigs(model=aj.ModelSource(hidden_size=32, num_layers=1), task=aj.TaskSource(train_size=300),
                        rl=aj.RLConfig(steps=3, batch_size=2, max_concurrent=4),
                        rollout=aj.RLVRConfig(n_samples=2, max_new_tokens=8, reward="arithmetic", temperature=0.7),
                        ppo=aj.PPOConfig(num_minibatches=1),
                        train_engine=aj.TrainEngineConfig(max_tokens_per_microbatch=512),
                        engine=aj.EngineConfig(num_slots=8, max_seq_len=64),
                        lora=aj.LoRAConfig(rank=4, targets=("q", "v"))).for_run(tmp_path)
    # Derived as the gin front end derives them: the task, the training temperature, the eval budget.
    assert cfg.task.kind == "arithmetic" and cfg.ppo.temperature == 0.7 and cfg.rl.eval_max_new_tokens == 8
    assert cfg.checkpoint.directory == f"{tmp_path}/checkpoints"
    text = cfg.gin_text()
    assert "RLConfig.steps = 3" in text and "LoRAConfig.targets = ('q', 'v')" in text
    assert "OptimizerConfig" not in text  # only what differs from the defaults
    loaded = load_job_configs((), text.splitlines(), run_dir=str(tmp_path))
    assert loaded.as_dict() == cfg.as_dict() and loaded == cfg


# The same job bound in gin and built in Python: JobConfigs derives every derived field (task kind and
# held-out size, the training temperature, the eval budget, the engine's sequence length), so the
# two paths cannot drift (EngineConfig.max_seq_len was once derived on the gin path only).
SAME_JOB = {
    "arithmetic": ([], {}),
    "dataset": (["DataConfig.paths = ('a.jsonl',)", "DataConfig.max_prompt_tokens = 100",
                 "RLVRConfig.max_new_tokens = 64", "RLVRConfig.temperature = 0.7"],
                {"data": aj.DataConfig(paths=("a.jsonl",), max_prompt_tokens=100),
                 "rollout": aj.RLVRConfig(max_new_tokens=64, temperature=0.7)}),
    "sft files": (["SFTConfig.paths = ('s.jsonl',)", "TaskSource.eval_paths = ('e.jsonl',)"],
                  {"sft": aj.SFTConfig(paths=("s.jsonl",)), "task": aj.TaskSource(eval_paths=("e.jsonl",))}),
    "engine bound": (["EngineConfig.num_slots = 8", "EngineConfig.max_seq_len = 80", "RLConfig.eval_max_new_tokens = 5",
                      "TaskSource.eval_size = 7"],
                     {"engine": aj.EngineConfig(num_slots=8, max_seq_len=80), "rl": aj.RLConfig(eval_max_new_tokens=5),
                      "task": aj.TaskSource(eval_size=7)}),
}
DERIVED = {  # (task kind, eval size, PPO temperature, eval budget, engine max_seq_len)
    "arithmetic": ("arithmetic", 200, 1.0, 256, 512), "dataset": ("dataset", 0, 0.7, 64, 164),
    "sft files": ("dataset", 200, 1.0, 256, 512), "engine bound": ("arithmetic", 7, 1.0, 5, 80),
}


@pytest.mark.parametrize("name", SAME_JOB)
def test_the_same_job_bound_in_gin_and_built_in_python_is_the_same_config(name, tmp_path):
    params, parts = SAME_JOB[name]
    gin = load_job_configs((), params, run_dir=str(tmp_path))
    python = aj.JobConfigs(**parts).for_run(tmp_path)
    assert gin.as_dict() == python.as_dict() and gin == python
    derived = (gin.task.kind, gin.task.eval_size, gin.ppo.temperature, gin.rl.eval_max_new_tokens,
               gin.engine.max_seq_len)
    assert derived == DERIVED[name]
    # Replacing a part derives again from the parts as given (nothing derived from the old part stays).
    hotter = python.with_parts(rollout=aj.RLVRConfig(temperature=0.5, max_new_tokens=32))
    assert hotter.ppo.temperature == 0.5 and hotter.rl.eval_max_new_tokens == (5 if name == "engine bound" else 32)


def test_rows_given_to_the_trainer_make_the_job_gin_makes_from_their_file(tmp_path):
    no_sft = "Stages.sft = False"  # the quickstart's SFT checks read arithmetic validation prompts
    trainer = aj.Trainer("configs/quickstart.gin", run_dir=tmp_path, train_data=[str(tmp_path / "a.jsonl")],
                         overrides=[no_sft])
    gin = load_job_configs(["configs/quickstart.gin"], [no_sft, f"DataConfig.paths = ('{tmp_path / 'a.jsonl'}',)",
                                                        "TaskSource.eval_size = 0"], run_dir=str(tmp_path))
    assert trainer.config.as_dict() == gin.as_dict()


def test_gin_configs_leave_the_run_directory_to_the_run(tmp_path):
    cfg = aj.load_config("configs/quickstart.gin", overrides=["RLConfig.steps = 7"])
    assert cfg.rl.steps == 7 and cfg.checkpoint.directory == "{run_dir}/checkpoints"
    assert cfg.for_run(tmp_path).checkpoint.directory == f"{tmp_path}/checkpoints"


@pytest.mark.parametrize("kwargs, message", [
    ({"rl": aj.PPOConfig()}, "JobConfigs.rl must be a RLConfig, got PPOConfig"),
    ({"ppo": aj.PPOConfig(temperature=0.5)}, "PPOConfig.temperature (0.5) is derived from RLVRConfig.temperature"),
    ({"task": aj.TaskSource(kind="arithmetic"), "data": aj.DataConfig(paths=("a.jsonl",))},
     "DataConfig.paths is set, but TaskSource.kind = 'arithmetic'"),
    ({"model": aj.ModelSource(hidden_size="32")}, "ModelSource.hidden_size = '32' does not match its type int"),
])
def test_a_bad_python_config_is_one_line_naming_the_field(kwargs, message):
    with pytest.raises((aj.ConfigError, ValueError)) as info:
        aj.JobConfigs(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_rows_and_a_python_reward_become_a_dataset_run(tmp_path):
    rows = [{"question": f"{i} + 1?", "answer": f"#### {i + 1}"} for i in range(5)]
    held_out = ({"question": "9 + 1?", "answer": "#### 10"} for _ in range(3))  # any finite iterable
    trainer = aj.Trainer("configs/quickstart.gin", run_dir=tmp_path, overrides=["RLConfig.steps = 2"],
                         reward_fn=lambda text, gold: float(text.strip() == gold), train_data=rows,
                         eval_data=held_out)
    cfg = trainer.config
    assert cfg.task.kind == "dataset" and cfg.data.paths == (str(tmp_path / "inputs" / "train.jsonl"),)
    assert cfg.task.eval_paths == (str(tmp_path / "inputs" / "eval.jsonl"),) and cfg.task.eval_size == 3
    assert cfg.checkpoint.directory == f"{tmp_path}/checkpoints" and cfg.rl.steps == 2
    assert "DataConfig.paths" in cfg.gin_text()  # written as config.gin: not the .gin file's text any more
    from areal_jax.reward.registry import load_reward_function, resolve_reward_path, runs_in_process

    assert runs_in_process(cfg.rollout.reward)
    assert load_reward_function(resolve_reward_path(cfg.rollout.reward))(" 4", "4") == 1.0
    from areal_jax.jobs.run_data import write_inputs

    assert not (tmp_path / "inputs").exists()  # written by train(), once the run directory's checks pass
    write_inputs(trainer._input_files())
    assert [json.loads(line) for line in (tmp_path / "inputs" / "train.jsonl").read_text().splitlines()] == rows
    assert len((tmp_path / "inputs" / "eval.jsonl").read_text().splitlines()) == 3
    with pytest.raises(ValueError, match="stage must be one of"):
        trainer.add_hook(print, stage="later")
    with pytest.raises(TypeError, match="train_data must be a path"):
        aj.Trainer(cfg, run_dir=tmp_path, train_data=[1, 2])


def test_import_is_light_and_plan_reads_no_jobs():
    code = ("import sys, areal_jax as aj; assert 'jax' not in sys.modules, 'jax'; aj.InferenceEngine; "
            "assert 'jax' not in sys.modules, 'api'; import areal_jax.plan.job; "
            "assert not [m for m in sys.modules if m.startswith('areal_jax.jobs')], 'jobs'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_two_closures_of_one_factory_keep_their_own_rewards_in_two_trainers(tmp_path):
    """Two rewards of one name and module (a notebook's sweep): each Trainer scores with its own."""
    import asyncio

    from areal_jax.reward.registry import register_reward_callable
    from areal_jax.reward.scoring import RewardScorer
    from areal_jax.rollout.workflow import RolloutClient

    def make_reward(value):
        return lambda text, gold: value

    rows = [{"question": "1 + 1?", "answer": "#### 2"}]
    trainers = [aj.Trainer("configs/quickstart.gin", run_dir=tmp_path / name, reward_fn=make_reward(value),
                           train_data=rows) for name, value in (("a", 0.25), ("b", 0.75))]
    names = [t.config.rollout.reward for t in trainers]
    assert names[0] != names[1]
    for trainer, value in zip(trainers, (0.25, 0.75)):
        reward = trainer.config.rollout.reward
        assert RewardScorer(reward, None, timeout_s=5.0)("x", "2") == value  # what the run's scorer calls
        client = RolloutClient(engine=None, tokenizer=None)
        try:
            assert asyncio.run(client.reward(reward, "x", "2", timeout_s=5.0)) == value  # what rollouts call
        finally:
            client.close()
    fn = make_reward(1.0)
    assert register_reward_callable(fn) == register_reward_callable(fn)  # the same callable: the same name
    with pytest.raises(ValueError, match="taken by another reward"):
        register_reward_callable(make_reward(0.5), name=names[0])


@pytest.mark.parametrize("value, message", [("1.0", "returned str '1.0', expected a real number"),
                                            (None, "returned NoneType 'None', expected a real number"),
                                            (float("nan"), "returned a non-finite value nan")])
def test_an_in_process_reward_that_returns_no_finite_number_is_refused_by_name(value, message):
    """float("1.0") would pass a str off as a reward; a NaN would stop the run unnamed. Both name it."""
    import asyncio

    from areal_jax.reward.registry import register_reward_callable
    from areal_jax.reward.scoring import RewardScorer
    from areal_jax.rollout.workflow import RolloutClient

    name = register_reward_callable(lambda text, gold: value)
    with pytest.raises((TypeError, ValueError), match=f"reward '{name}' {message}"):
        RewardScorer(name, None, timeout_s=5.0)("x", "1")
    client = RolloutClient(engine=None, tokenizer=None)
    try:
        with pytest.raises((TypeError, ValueError), match=f"reward '{name}' {message}"):
            asyncio.run(client.reward(name, "x", "1", timeout_s=5.0))
    finally:
        client.close()


def test_export_never_replaces_the_run_or_a_directory_holding_it(tmp_path):
    from areal_jax.jobs.inputs import InputError

    run = tmp_path / "run"
    (run / "final_model").mkdir(parents=True)
    (run / "final_model" / "config.json").write_text("{}")
    (run / "config.gin").write_text("RLConfig.steps = 1\n")
    trainer = aj.Trainer("configs/quickstart.gin", run_dir=run)
    for out, phrase in ((run, "out {} is the run directory"), (tmp_path, "out {} contains the run directory"),
                        (run / "final_model", "out {} is the final model")):
        with pytest.raises(InputError, match="^" + phrase.format(out)):
            trainer.export(out, overwrite=True)
    assert (run / "config.gin").is_file() and (run / "final_model" / "config.json").is_file()


def test_a_refused_second_trainer_writes_nothing_into_the_run(tmp_path):
    """Its rows would replace the run's own inputs/ (and a later resume would train on them)."""
    from areal_jax.jobs.inputs import InputError

    run = tmp_path / "run"
    (run / "inputs").mkdir(parents=True)
    (run / "config.gin").write_text("RLConfig.steps = 1\n")
    (run / "inputs" / "train.jsonl").write_text("the run's rows\n")
    trainer = aj.Trainer("configs/quickstart.gin", run_dir=run, train_data=[{"question": "1 + 1?", "answer": "#### 2"}],
                         overrides=["SFTConfig.eval_every = 0", "SFTConfig.stop_accuracy = 0.0",
                                    "TaskSource.validation_size = 0"])
    with pytest.raises(InputError, match="already holds a run") as refused:
        trainer.train(progress=False)
    assert "pass overwrite=True to replace it, resume=True to continue it" in str(refused.value)
    assert "--" not in str(refused.value)  # the API's parameters, not the CLI's flags
    assert sorted(p.name for p in run.rglob("*")) == ["config.gin", "inputs", "train.jsonl"]
    assert (run / "inputs" / "train.jsonl").read_text() == "the run's rows\n"


def test_a_list_of_strings_is_read_as_paths_only_when_they_are_files(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    assert aj.Trainer("configs/quickstart.gin", run_dir=tmp_path / "a", train_data=[str(data)]).config.data.paths == (
        str(data),)
    with pytest.raises(FileNotFoundError, match="^train_data: no file 'What is 2 \\+ 2\\?' .* give rows as dicts"):
        aj.Trainer("configs/quickstart.gin", run_dir=tmp_path / "b", train_data=["What is 2 + 2?", "And 3 + 3?"])
    assert not (tmp_path / "b").exists()


def test_data_config_overrides_survive_rows_given_as_train_data(tmp_path):
    template = "Question: {question}\nAnswer:"
    cfg = aj.load_config("configs/quickstart.gin", overrides=[f"DataConfig.prompt_template = {template!r}"])
    trainer = aj.Trainer(cfg, run_dir=tmp_path, train_data=[{"question": "1 + 1?", "answer": "#### 2"}])
    assert trainer.config.data.prompt_template == template
    assert trainer.config.data.paths == (str(tmp_path / "inputs" / "train.jsonl"),)
    assert f"DataConfig.prompt_template = {template!r}" in trainer.config.gin_text()
