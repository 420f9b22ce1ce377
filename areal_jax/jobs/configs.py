"""Every config a job reads, registered with gin, and the few that only jobs need.

A .gin file binds fields of these classes by class name (see configs/quickstart.gin);
`load_job_configs` builds them all (type-checked, validated) before any work starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from areal_jax import config_system as cs
from areal_jax.checkpoint import CheckpointConfig
from areal_jax.data.pipeline import DataConfig
from areal_jax.generation.engine import EngineConfig
from areal_jax.metrics import MetricsConfig
from areal_jax.parallel.meshes import MeshConfig
from areal_jax.plan.config import PlanConfig
from areal_jax.ppo.advantages import AdvantageConfig
from areal_jax.reward.pool import RewardPoolConfig
from areal_jax.reward.sandbox import SandboxLimits
from areal_jax.rollout.workflow import RLVRConfig, resolve_workflow_class
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
                      RewardPoolConfig, SandboxLimits,
                      MetricsConfig,
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
    metrics: MetricsConfig = MetricsConfig()  # TensorBoard and W&B besides metrics.jsonl
    workflow: Any = None  # the config_class instance of RLConfig.workflow's class (None: it has none)
    reward_pool: RewardPoolConfig = RewardPoolConfig()  # the workers of every reward not declared in-process
    sandbox: SandboxLimits = SandboxLimits()  # the code reward's sandbox in those workers

    def as_dict(self) -> dict:
        return {f.name: (None if getattr(self, f.name) is None else dataclasses.asdict(getattr(self, f.name)))
                for f in dataclasses.fields(self)}


def load_job_configs(gin_files=(), gin_params=(), *, run_dir: str, num_processes: int | None = None) -> JobConfigs:
    """Parses the bindings and builds every config; any mistake raises ConfigError here.

    Checks between fields of different configs run here too (`check_cross_fields`), so nothing
    is trained before they pass; with `num_processes` also those that depend on the host count.
    """
    # A custom workflow's own config class is registered by importing its module, which only
    # RLConfig.workflow names: a first pass finds it, the second parses strictly with it known.
    cs.parse(gin_files, gin_params, skip_unknown=True)
    workflow_class = _workflow_class(cs.build(RLConfig))
    cs.parse(gin_files, gin_params)
    task = cs.build(TaskSource)
    data = None
    if task.kind == "dataset":
        # `areal-jax sft` on its own files reads no RL prompts: DataConfig.paths defaults to SFTConfig.paths.
        sft_paths = cs.gin.get_bindings("SFTConfig").get("paths")
        data = cs.build(DataConfig, **({"paths": sft_paths} if sft_paths and "paths" not in cs.bindings(DataConfig)
                                       else {}))
    checkpoint = None
    bindings = cs.gin.get_bindings("CheckpointConfig")
    if bindings:
        checkpoint = cs.build(CheckpointConfig, **({} if "directory" in bindings else
                                                  {"directory": f"{run_dir}/checkpoints"}))
    cfg = JobConfigs(
        model=cs.build(ModelSource), task=task, stages=cs.build(Stages), arithmetic=cs.build(ArithmeticConfig),
        data=data, sft=cs.build(SFTConfig), rl=cs.build(RLConfig), ppo=cs.build(PPOConfig),
        optimizer=cs.build(OptimizerConfig), advantages=cs.build(AdvantageConfig), rollout=cs.build(RLVRConfig),
        engine=cs.build(EngineConfig), mesh=cs.build(MeshConfig), checkpoint=checkpoint,
        metrics=cs.build(MetricsConfig), workflow=_workflow_config(workflow_class),
        reward_pool=cs.build(RewardPoolConfig), sandbox=cs.build(SandboxLimits))
    check_cross_fields(cfg, num_processes)
    return cfg


_WORKFLOW_CONFIGS: set[type] = set()  # config classes of the workflows loaded in this process


def _workflow_class(rl: RLConfig) -> type | None:
    """RLConfig.workflow's class (already checked by RLConfig), its config class registered with gin."""
    if rl.workflow is None:
        return None
    cls = resolve_workflow_class(rl.workflow)
    if getattr(cls, "config_class", None) is not None:
        cs.register(cls.config_class)
        _WORKFLOW_CONFIGS.add(cls.config_class)
    return cls


def _workflow_config(cls: type | None) -> Any:
    config_class = getattr(cls, "config_class", None)
    # A workflow config registered earlier in this process (the strict parse then accepts its
    # bindings) that the configured workflow does not read: its bindings would be ignored.
    for other in _WORKFLOW_CONFIGS - {config_class}:
        if cs.bindings(other):
            raise cs.ConfigError(f"{other.__name__} is bound, but RLConfig.workflow ({getattr(cls, '__name__', None)}) "
                                 f"does not read it")
    return None if config_class is None else cs.build(config_class)


def check_cross_fields(cfg: JobConfigs, num_processes: int | None = None) -> None:
    """Raises ConfigError naming both fields when two configs disagree in a way the run would
    otherwise find only when it reaches the stage (the RL loop runs after SFT)."""
    if cfg.stages.sft:
        _check_sft(cfg)
    if cfg.stages.rl:
        _check_rl(cfg)
        if num_processes is not None:
            _check_rl_processes(cfg, num_processes)


def _check_sft(cfg: JobConfigs) -> None:
    task = cfg.task
    if cfg.sft.eval_every and (task.kind != "arithmetic" or task.validation_size == 0):
        raise cs.ConfigError(
            "SFTConfig.eval_every > 0 needs validation prompts: TaskSource.kind = 'arithmetic' with "
            f"TaskSource.validation_size > 0 (got kind {task.kind!r}, validation_size {task.validation_size})")
    if (cfg.sft.paths or cfg.sft.eval_paths) and task.kind != "dataset":
        raise cs.ConfigError("SFTConfig.paths / SFTConfig.eval_paths are read with DataConfig's format and templates: "
                             f"they need TaskSource.kind = 'dataset' (got {task.kind!r})")


def _check_rl(cfg: JobConfigs) -> None:
    rollout, ppo, engine = cfg.rollout, cfg.ppo, cfg.engine
    if rollout.temperature != ppo.temperature:
        # Behavior log-probs are taken at the sampling temperature; the trainer's at its own.
        raise cs.ConfigError(
            f"RLVRConfig.temperature ({rollout.temperature}) and PPOConfig.temperature ({ppo.temperature}) "
            "must be equal: the importance weights would otherwise measure the temperature, not the staleness")
    longest = min(engine.max_seq_len, engine.prompt_limit + rollout.max_new_tokens)
    if cfg.rl.workflow is not None and engine.max_seq_len > ppo.max_tokens_per_microbatch:
        # A custom workflow may grow an episode turn by turn, up to the engine's limit.
        raise cs.ConfigError(
            f"PPOConfig.max_tokens_per_microbatch ({ppo.max_tokens_per_microbatch}) is below EngineConfig.max_seq_len "
            f"({engine.max_seq_len}), the longest sequence RLConfig.workflow ({cfg.rl.workflow!r}) may build; such "
            "a sequence could not be trained")
    if longest > ppo.max_tokens_per_microbatch:
        raise cs.ConfigError(
            f"PPOConfig.max_tokens_per_microbatch ({ppo.max_tokens_per_microbatch}) is below the longest sample "
            f"({longest} tokens: EngineConfig.max_seq_len {engine.max_seq_len}, or EngineConfig.max_prompt_len + "
            f"RLVRConfig.max_new_tokens); such a sample could not be trained")
    sequences = cfg.rl.batch_size * rollout.n_samples
    if sequences < ppo.num_minibatches:
        raise cs.ConfigError(
            f"PPOConfig.num_minibatches ({ppo.num_minibatches}) exceeds the sequences of a step: RLConfig.batch_size "
            f"({cfg.rl.batch_size}) x RLVRConfig.n_samples ({rollout.n_samples}) = {sequences}")


def _check_rl_processes(cfg: JobConfigs, num_processes: int) -> None:
    rl = cfg.rl
    if rl.batch_size % num_processes:
        raise cs.ConfigError(f"RLConfig.batch_size ({rl.batch_size}) must divide over the {num_processes} processes")
    local_batch = rl.batch_size // num_processes
    if rl.channel_capacity and rl.channel_capacity < local_batch:
        raise cs.ConfigError(
            f"RLConfig.channel_capacity ({rl.channel_capacity}) is below a process's share of RLConfig.batch_size "
            f"({local_batch}): the batch could never fill")
    if local_batch * cfg.rollout.n_samples < cfg.ppo.num_minibatches:
        raise cs.ConfigError(
            f"PPOConfig.num_minibatches ({cfg.ppo.num_minibatches}) exceeds a process's sequences per step: "
            f"RLConfig.batch_size / {num_processes} processes x RLVRConfig.n_samples = "
            f"{local_batch * cfg.rollout.n_samples}")
