"""Gin bindings over typed config dataclasses: values land, mistakes fail early and by name."""

import dataclasses
import pathlib
import re
from typing import Literal

import pytest

from areal_jax import config_system as cs


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    steps: int = 10
    lr: float = 1e-3
    mode: Literal["async", "sync"] = "async"
    buckets: tuple[int, ...] = (16, 32)
    path: str | None = None

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


cs.register(DemoConfig)


def test_files_then_params_override(tmp_path):
    f = tmp_path / "a.gin"
    f.write_text("DemoConfig.steps = 5\nDemoConfig.mode = 'sync'\n")
    cs.parse([f], ["DemoConfig.steps = 7", "DemoConfig.buckets = (8,)"])
    cfg = cs.build(DemoConfig)
    assert cfg == DemoConfig(steps=7, lr=1e-3, mode="sync", buckets=(8,), path=None)
    assert "DemoConfig.steps = 7" in cs.operative_config()


def test_int_is_accepted_where_float_is_declared():
    cs.parse([], ["DemoConfig.lr = 1"])
    assert cs.build(DemoConfig).lr == 1


@pytest.mark.parametrize("binding,message", [
    ("DemoConfig.stepz = 3", "stepz"),
    ("NoSuchConfig.steps = 3", "NoSuchConfig"),
    ("DemoConfig.steps = 'ten'", r"DemoConfig\.steps = 'ten' does not match its type int"),
    ("DemoConfig.steps = True", "DemoConfig.steps"),
    ("DemoConfig.mode = 'later'", "one of 'async', 'sync'"),
    ("DemoConfig.buckets = (8, 'x')", "DemoConfig.buckets"),
    ("DemoConfig.steps = 0", "steps must be >= 1"),
    ("DemoConfig.steps = ", "DemoConfig.steps = "),
])
def test_mistakes_are_named(binding, message):
    with pytest.raises(cs.ConfigError, match=message):
        cs.parse([], [binding])
        cs.build(DemoConfig)


def test_missing_gin_file_is_named(tmp_path):
    with pytest.raises(cs.ConfigError, match="nope.gin"):
        cs.parse([tmp_path / "nope.gin"])


def test_bad_line_in_file_names_the_file(tmp_path):
    f = tmp_path / "bad.gin"
    f.write_text("DemoConfig.steps = 3\nDemoConfig.oops = 1\n")
    with pytest.raises(cs.ConfigError, match=r"bad\.gin.*oops"):
        cs.parse([f])


# ---- checks between configs run in load_job_configs, before any stage ----------------------------


QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.gin"


def _load(*params, num_processes=None):
    from areal_jax.jobs.configs import load_job_configs

    return load_job_configs([QUICKSTART], list(params), run_dir="unused", num_processes=num_processes)


def test_the_quickstart_passes_every_cross_field_check():
    cfg = _load(num_processes=1)
    assert cfg.rollout.temperature == cfg.ppo.temperature == 0.7


def test_the_training_temperature_is_the_sampling_temperature():
    assert _load("RLVRConfig.temperature = 1.3").ppo.temperature == 1.3
    with pytest.raises(cs.ConfigError, match=r"PPOConfig.temperature \(1.0\) is derived from RLVRConfig.temperature "
                                             r"\(0.7\)"):
        _load("PPOConfig.temperature = 1.0")
    assert _load("PPOConfig.temperature = 0.7").ppo.temperature == 0.7  # an older file binding both alike


def test_the_completion_budget_is_set_once():
    # Held-out checks sample as long as the rollouts; the engine's length follows prompt + completion.
    from areal_jax.jobs.configs import load_job_configs

    cfg = load_job_configs([], ["RLVRConfig.max_new_tokens = 40", "EngineConfig.max_prompt_len = 30"], run_dir="x")
    assert cfg.rl.eval_max_new_tokens == 40 and cfg.engine.max_seq_len == 70 and cfg.engine.max_prompt_len == 30
    cfg = load_job_configs([], ["RLVRConfig.max_new_tokens = 40", "EngineConfig.max_prompt_len = 30",
                                "EngineConfig.max_seq_len = 100", "RLConfig.eval_max_new_tokens = 8"], run_dir="x")
    assert cfg.engine.max_seq_len == 100 and cfg.rl.eval_max_new_tokens == 8  # explicit values stay


@pytest.mark.parametrize("params,fields", [
    (["TrainEngineConfig.max_tokens_per_microbatch = 64"],
     [r"TrainEngineConfig\.max_tokens_per_microbatch \(64\)", r"EngineConfig\.max_seq_len 96", "RLVRConfig.max_new_tokens"]),
    (["RLConfig.batch_size = 1", "RLVRConfig.n_samples = 2", "PPOConfig.num_minibatches = 3"],
     [r"PPOConfig\.num_minibatches \(3\)", r"RLConfig\.batch_size \(1\)", r"RLVRConfig\.n_samples \(2\)"]),
])
def test_cross_field_mistakes_name_both_fields(params, fields):
    with pytest.raises(cs.ConfigError) as err:
        _load(*params)
    for field in fields:
        assert re.search(field, str(err.value)), (field, str(err.value))


def test_rl_checks_are_skipped_without_the_rl_stage():
    cfg = _load("Stages.rl = False", "TrainEngineConfig.max_tokens_per_microbatch = 64")
    assert cfg.train_engine.max_tokens_per_microbatch == 64


def test_the_longest_sample_is_bounded_by_prompt_limit_plus_new_tokens():
    # max_seq_len 96 exceeds the budget, but a 40-token prompt plus 48 new tokens fits in 90.
    cfg = _load("TrainEngineConfig.max_tokens_per_microbatch = 90", "EngineConfig.max_prompt_len = 40")
    assert cfg.train_engine.max_tokens_per_microbatch == 90


def test_process_dependent_checks_run_when_the_process_count_is_known():
    with pytest.raises(cs.ConfigError, match=r"RLConfig\.batch_size \(32\) must divide over the 3 processes"):
        _load(num_processes=3)
    with pytest.raises(cs.ConfigError, match=r"RLConfig\.channel_capacity \(10\).*RLConfig\.batch_size \(16\)"):
        _load("RLConfig.channel_capacity = 10", num_processes=2)
    _load("RLConfig.channel_capacity = 16", num_processes=2)
    _load("RLConfig.channel_capacity = 10")  # unknown process count: not checked


@pytest.mark.parametrize("old, new", [("PPOConfig.remat = 'full'", "TrainEngineConfig.remat"),
                                      ("PPOConfig.max_tokens_per_microbatch = 64",
                                       "TrainEngineConfig.max_tokens_per_microbatch"),
                                      ("PPOConfig.decoupled = False", "PPOConfig.objective"),
                                      ("SFTConfig.batch_size = 8", "SFTConfig.rows_per_step"),
                                      ("SFTConfig.warmup = 5", "SFTConfig.warmup_steps"),
                                      ("SFTConfig.scan_layers = False", "TrainEngineConfig.scan_layers")])
def test_a_moved_field_names_where_it_went(old, new):
    with pytest.raises(cs.ConfigError, match=rf"{re.escape(old.split(' ')[0])} moved: bind {re.escape(new)}"):
        _load(old)


def test_a_missing_include_is_one_error_without_a_log_line(tmp_path, caplog):
    (tmp_path / "a.gin").write_text("include 'no_such.gin'\nRLConfig.steps = 3\n")
    with pytest.raises(cs.ConfigError, match=r"a.gin: Unable to open file: no_such.gin") as info:
        cs.parse([str(tmp_path / "a.gin")])
    assert "\n" not in str(info.value)
    assert not [r for r in caplog.records if "Path not found" in r.getMessage()]  # said once, by the error


def test_api_config_errors_name_the_apis_parameter():
    import areal_jax as aj

    with pytest.raises(cs.ConfigError, match=r"^overrides 'RLConfig.stepz = 3': ") as info:
        aj.load_config("configs/quickstart.gin", overrides=["RLConfig.stepz = 3"])
    assert "--" not in str(info.value)
