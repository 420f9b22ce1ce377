"""Gin bindings over typed config dataclasses: values land, mistakes fail early and by name."""

import dataclasses
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
