"""Every config a job reads, registered with gin, and the few that only jobs need.

A .gin file binds fields of these classes by class name (see configs/quickstart.gin);
`load_job_configs` builds them all (type-checked, validated) before any work starts.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from areal_jax import config_system as cs
from areal_jax.checkpoint import CheckpointConfig
from areal_jax.data.pipeline import DataConfig
from areal_jax.generation.engine import EngineConfig
from areal_jax.parallel.meshes import MeshConfig
from areal_jax.plan.config import PlanConfig
from areal_jax.ppo.advantages import AdvantageConfig
from areal_jax.rollout.workflow import RLVRConfig
from areal_jax.tasks.arithmetic import ArithmeticConfig
from areal_jax.trainer.loop import RLConfig
from areal_jax.trainer.optimizer import OptimizerConfig
from areal_jax.trainer.sft import SFTConfig
from areal_jax.trainer.train_step import PPOConfig


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the policy comes from: an HF directory, or (path unset) the built-in task model."""

    path: str | None = None
    tokenizer_path: str | None = None  # default: `path`
    dtype: Literal["float32", "bfloat16"] = "float32"
    init_seed: int = 0  # built-in model only
    hidden_size: int = 128  # built-in model only
    num_layers: int = 4  # built-in model only


@dataclasses.dataclass(frozen=True)
class TaskSource:
    """The prompts: the built-in arithmetic task, or files read through DataConfig."""

    kind: Literal["arithmetic", "dataset"] = "arithmetic"
    train_size: int = 20000  # arithmetic: distinct training problems
    eval_size: int = 200  # held-out prompts for accuracy
    seed: int = 0
    eval_paths: tuple[str, ...] = ()  # dataset: held-out files (same formats as DataConfig.paths)
    # arithmetic: prompts for SFT's validation checks (SFTConfig.eval_every), drawn from the
    # training split after its `train_size` problems: never trained on, disjoint from held-out.
    validation_size: int = 0

    def __post_init__(self):
        if self.train_size < 1 or self.eval_size < 0:
            raise ValueError("TaskSource.train_size must be >= 1 and eval_size >= 0")
        if self.validation_size < 0:
            raise ValueError(f"TaskSource.validation_size must be >= 0, got {self.validation_size!r}")
        if self.kind == "dataset" and self.eval_size and not self.eval_paths:
            raise ValueError("TaskSource.kind = 'dataset' needs eval_paths for held-out accuracy (or eval_size = 0)")


@dataclasses.dataclass(frozen=True)
class Stages:
    """Which stages `train` runs."""

    sft: bool = True
    rl: bool = True
    plot: bool = True
    save_final_model: bool = True


JOB_CONFIG_CLASSES = (ModelSource, TaskSource, Stages, ArithmeticConfig, DataConfig, SFTConfig, RLConfig, PPOConfig,
                      OptimizerConfig, AdvantageConfig, RLVRConfig, EngineConfig, MeshConfig, CheckpointConfig,
                      PlanConfig)  # PlanConfig: read by `areal-jax plan`, accepted (and ignored) by the run
for _cls in JOB_CONFIG_CLASSES:
    cs.register(_cls)


@dataclasses.dataclass(frozen=True)
class JobConfigs:
    model: ModelSource
    task: TaskSource
    stages: Stages
    arithmetic: ArithmeticConfig
    data: DataConfig | None
    sft: SFTConfig
    rl: RLConfig
    ppo: PPOConfig
    optimizer: OptimizerConfig
    advantages: AdvantageConfig
    rollout: RLVRConfig
    engine: EngineConfig
    mesh: MeshConfig
    checkpoint: CheckpointConfig | None

    def as_dict(self) -> dict:
        return {f.name: (None if getattr(self, f.name) is None else dataclasses.asdict(getattr(self, f.name)))
                for f in dataclasses.fields(self)}


def load_job_configs(gin_files=(), gin_params=(), *, run_dir: str) -> JobConfigs:
    """Parses the bindings and builds every config; any mistake raises ConfigError here."""
    cs.parse(gin_files, gin_params)
    task = cs.build(TaskSource)
    data = cs.build(DataConfig) if task.kind == "dataset" else None
    checkpoint = None
    bindings = cs.gin.get_bindings("CheckpointConfig")
    if bindings:
        checkpoint = cs.build(CheckpointConfig, **({} if "directory" in bindings else
                                                  {"directory": f"{run_dir}/checkpoints"}))
    sft, stages = cs.build(SFTConfig), cs.build(Stages)
    if stages.sft and sft.eval_every and (task.kind != "arithmetic" or task.validation_size == 0):
        raise cs.ConfigError(
            "SFTConfig.eval_every > 0 needs validation prompts: TaskSource.kind = 'arithmetic' with "
            f"TaskSource.validation_size > 0 (got kind {task.kind!r}, validation_size {task.validation_size})")
    return JobConfigs(
        model=cs.build(ModelSource), task=task, stages=stages, arithmetic=cs.build(ArithmeticConfig),
        data=data, sft=sft, rl=cs.build(RLConfig), ppo=cs.build(PPOConfig),
        optimizer=cs.build(OptimizerConfig), advantages=cs.build(AdvantageConfig), rollout=cs.build(RLVRConfig),
        engine=cs.build(EngineConfig), mesh=cs.build(MeshConfig), checkpoint=checkpoint)
