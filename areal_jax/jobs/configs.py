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
from areal_jax.reward.registry import check_reward_function
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
    # Built-in model only: > 0 makes it a Qwen2-MoE of this many experts (configs/quickstart_moe.gin),
    # `num_experts_per_tok` of them per token; 0 = dense.
    num_experts: int = 0
    num_experts_per_tok: int = 2

    def __post_init__(self):
        if self.num_experts < 0:
            raise ValueError(f"ModelSource.num_experts must be >= 0, got {self.num_experts!r}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"ModelSource.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok!r}")


@dataclasses.dataclass(frozen=True)
class TaskSource:
    """The prompts: the built-in arithmetic task, or files read through DataConfig."""

    # None: "dataset" when DataConfig.paths or SFTConfig.paths is bound, else "arithmetic" (the
    # built-in task); "arithmetic" with files bound is refused, as the files would be ignored.
    kind: Literal["arithmetic", "dataset"] | None = None
    train_size: int = 20000  # arithmetic: distinct training problems
    eval_size: int = 200  # held-out prompts for accuracy (a dataset without eval_paths: 0)
    seed: int = 0
    eval_paths: tuple[str, ...] = ()  # dataset: held-out files (same formats as DataConfig.paths)
    # arithmetic: prompts for SFT's validation checks (SFTConfig.eval_every), drawn from the
    # training split after its `train_size` problems: never trained on, disjoint from held-out.
    validation_size: int = 0
    # Before any work, the reward (RLVRConfig.reward) scores a sample of the data files' reference
    # solutions (GSM8K answers, MATH solutions); a mean below this refuses the run, as a reward
    # that cannot read the answers the data teaches would be 0 throughout RL. 0: no check.
    solution_reward_min: float = 0.9

    def __post_init__(self):
        if self.train_size < 1 or self.eval_size < 0:
            raise ValueError("TaskSource.train_size must be >= 1 and eval_size >= 0")
        if self.validation_size < 0:
            raise ValueError(f"TaskSource.validation_size must be >= 0, got {self.validation_size!r}")
        if not 0.0 <= self.solution_reward_min <= 1.0:
            raise ValueError(f"TaskSource.solution_reward_min must be in [0, 1], got {self.solution_reward_min!r}")
        if self.kind == "dataset" and self.eval_size and not self.eval_paths:
            raise ValueError("TaskSource.kind = 'dataset' needs eval_paths for held-out accuracy (or eval_size = 0)")


@dataclasses.dataclass(frozen=True)
class Stages:
    """Which stages `train` runs."""

    sft: bool = True
    rl: bool = True
    plot: bool = True
    save_final_model: bool = True
    # RL checkpoints in CheckpointConfig.directory (default RUN/checkpoints) every 50 steps or 30
    # minutes unless CheckpointConfig binds an interval, and always after the last step. False: none.
    checkpoint: bool = True


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
    task = _task_source()
    data = None
    if task.kind == "dataset":
        # `areal-jax sft` on its own files reads no RL prompts: DataConfig.paths defaults to SFTConfig.paths.
        sft_paths = cs.gin.get_bindings("SFTConfig").get("paths")
        data = cs.build(DataConfig, **({"paths": sft_paths} if sft_paths and "paths" not in cs.bindings(DataConfig)
                                       else {}))
    stages = cs.build(Stages)
    rollout = cs.build(RLVRConfig)
    try:  # a reward named wrong is found now, not after SFT
        check_reward_function(rollout.reward, "RLVRConfig.reward")
    except ValueError as e:
        raise cs.ConfigError(str(e)) from None
    cfg = JobConfigs(
        model=cs.build(ModelSource), task=task, stages=stages, arithmetic=cs.build(ArithmeticConfig),
        data=data, sft=cs.build(SFTConfig), rl=_rl_config(rollout), ppo=_ppo_config(rollout),
        optimizer=cs.build(OptimizerConfig), advantages=cs.build(AdvantageConfig), rollout=rollout,
        engine=_engine_config(rollout, data), mesh=cs.build(MeshConfig), checkpoint=_checkpoint_config(stages, run_dir),
        metrics=cs.build(MetricsConfig), workflow=_workflow_config(workflow_class),
        reward_pool=cs.build(RewardPoolConfig), sandbox=cs.build(SandboxLimits))
    check_cross_fields(cfg, num_processes)
    return cfg


def _task_source() -> TaskSource:
    """TaskSource with its kind resolved: files bound select the dataset task (see TaskSource.kind)."""
    bound = cs.bindings(TaskSource)
    files = [f"{cls.__name__}.paths" for cls in (DataConfig, SFTConfig) if cs.bindings(cls).get("paths")]
    kind = bound.get("kind")
    if kind == "arithmetic" and files:
        raise cs.ConfigError(f"{files[0]} is bound, but TaskSource.kind = 'arithmetic' (the built-in task) reads no "
                             "files: bind TaskSource.kind = 'dataset' (or leave it unbound) to train on them")
    overrides: dict[str, Any] = {"kind": kind or ("dataset" if files else "arithmetic")}
    if overrides["kind"] == "dataset" and "eval_size" not in bound and not bound.get("eval_paths"):
        overrides["eval_size"] = 0  # no held-out files named: no held-out accuracy, not an error
    return cs.build(TaskSource, **overrides)


def _rl_config(rollout: RLVRConfig) -> RLConfig:
    rl = cs.build(RLConfig)  # held-out checks sample as long as the rollouts unless bound
    return rl if rl.eval_max_new_tokens is not None else dataclasses.replace(
        rl, eval_max_new_tokens=rollout.max_new_tokens)


def _ppo_config(rollout: RLVRConfig) -> PPOConfig:
    """PPOConfig with the sampling temperature: one field (RLVRConfig.temperature) sets both."""
    bound = cs.bindings(PPOConfig).get("temperature", rollout.temperature)  # an equal binding (older files) is moot
    if bound != rollout.temperature:
        raise cs.ConfigError(f"PPOConfig.temperature ({bound}) is derived from RLVRConfig.temperature "
                             f"({rollout.temperature}): the trainer takes log-probs at the sampling temperature; "
                             "bind RLVRConfig.temperature only")
    return cs.build(PPOConfig, temperature=rollout.temperature)


def _engine_config(rollout: RLVRConfig, data: DataConfig | None) -> EngineConfig:
    """EngineConfig with max_seq_len derived from the completion budget when not bound: the
    longest prompt (EngineConfig.max_prompt_len, else DataConfig.max_prompt_tokens) plus
    RLVRConfig.max_new_tokens. Without a prompt bound the field's default stays."""
    bound = cs.bindings(EngineConfig)
    prompt = bound.get("max_prompt_len") or (data.max_prompt_tokens if data is not None else None)
    if "max_seq_len" in bound or not prompt:
        return cs.build(EngineConfig)
    return cs.build(EngineConfig, max_seq_len=prompt + rollout.max_new_tokens)


def _checkpoint_config(stages: Stages, run_dir: str) -> CheckpointConfig | None:
    """The run's checkpoints: on unless Stages.checkpoint = False (see Stages.checkpoint)."""
    bound = cs.bindings(CheckpointConfig)
    if not stages.checkpoint:
        if bound:
            raise cs.ConfigError("CheckpointConfig is bound, but Stages.checkpoint = False turns checkpoints off")
        return None
    overrides: dict[str, Any] = {} if "directory" in bound else {"directory": f"{run_dir}/checkpoints"}
    if "save_interval_steps" not in bound and "save_interval_s" not in bound:
        overrides.update(save_interval_steps=DEFAULT_SAVE_INTERVAL_STEPS, save_interval_s=DEFAULT_SAVE_INTERVAL_S)
    return cs.build(CheckpointConfig, **overrides)


DEFAULT_SAVE_INTERVAL_STEPS = 50
DEFAULT_SAVE_INTERVAL_S = 1800.0


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
