"""`describe_configs`: every configurable field with its value, type and doc line."""

import dataclasses

import pytest

from areal_jax import config_system as cs
from areal_jax.jobs.describe import describe_configs, field_docs, type_name


@dataclasses.dataclass(frozen=True)
class DocumentedConfig:
    """A config documented three ways.

    Attributes:
        alpha: weight of the first term. More detail that is not shown.
        beta: a long entry that runs
            onto a second line.
    """

    alpha: float = 0.5
    beta: tuple[int, ...] = (1, 2)
    gamma: str | None = None  # beside the field. Second sentence.
    # Above the field, first sentence. Second one.
    delta: int = 3
    epsilon: int = 4


@dataclasses.dataclass(frozen=True)
class ProseConfig:
    """Prose docs. steps: optimizer steps. lr: peak rate, reached after
    warmup (e.g. 50 steps).
    """

    steps: int = 1
    lr: float = 0.1


def test_docs_come_from_attributes_prose_and_comments():
    assert field_docs(DocumentedConfig) == {
        "alpha": "weight of the first term.",
        "beta": "a long entry that runs onto a second line.",
        "gamma": "beside the field.",
        "delta": "Above the field, first sentence.",
    }
    assert field_docs(ProseConfig) == {"steps": "optimizer steps.", "lr": "peak rate, reached after warmup (e.g. 50 steps)."}


def test_type_names_are_readable():
    assert type_name(int) == "int"
    assert type_name(str | None) == "str | None"
    assert type_name(tuple[int, ...]) == "tuple[int, ...]"


def test_every_job_field_is_listed_with_default_type_and_doc():
    from areal_jax.jobs.configs import JOB_CONFIG_CLASSES

    text = describe_configs()
    lines = text.splitlines()
    for cls in JOB_CONFIG_CLASSES:
        for f in dataclasses.fields(cls):
            assert any(line.startswith(f"{cls.__name__}.{f.name} = ") for line in lines), f"{cls.__name__}.{f.name}"
    assert "PPOConfig.eps_clip = 0.2  # float: clip range of r = pi_theta / pi_prox (paper: 0.2)." in lines
    assert "RLConfig.mode = 'async'  # Literal['async', 'sync']" in lines
    assert "EngineConfig.max_seq_len = 512  # int: prompt + completion tokens of one sample; the KV cache length S" in lines
    assert any(line.startswith("EvalConfig.n_samples = 1  # int: samples per prompt.") for line in lines)


def test_bound_values_replace_defaults(tmp_path):
    f = tmp_path / "run.gin"
    f.write_text("PPOConfig.eps_clip = 0.1\nRLConfig.steps = 7\n")
    lines = describe_configs([str(f)], ["RLConfig.steps = 9"]).splitlines()
    assert any(line.startswith("PPOConfig.eps_clip = 0.1  # float, bound (default 0.2): clip range") for line in lines)
    assert any(line.startswith("RLConfig.steps = 9  # int, bound (default 20)") for line in lines)
    assert any(line.startswith("RLConfig.batch_size = 8  # int") and "bound" not in line for line in lines)


def test_output_is_a_gin_file_that_binds_the_same_values(tmp_path):
    text = describe_configs([], ["RLConfig.steps = 9"])
    f = tmp_path / "all.gin"
    f.write_text("\n".join(line for line in text.splitlines() if "<required>" not in line))
    again = describe_configs([str(f)], [])
    assert "RLConfig.steps = 9  # int, bound (default 20)" in again


def test_bad_bindings_are_named(tmp_path):
    with pytest.raises(cs.ConfigError, match="stepz"):
        describe_configs([], ["RLConfig.stepz = 3"])
    with pytest.raises(cs.ConfigError, match="nope.gin"):
        describe_configs([str(tmp_path / "nope.gin")], [])


def test_config_command_prints_the_bound_values_of_a_gin_file():
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "areal_jax.cli", "config", "--gin_file=configs/quickstart.gin"],
                         capture_output=True, text=True, cwd=root, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RLConfig.steps = 120" in out.stdout and "PPOConfig.eps_clip = 0.2" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "areal_jax.cli", "config", "--gin_param=RLConfig.nope = 1"],
                         capture_output=True, text=True, cwd=root, timeout=300)
    assert bad.returncode == 2 and "RLConfig.nope" in bad.stderr
