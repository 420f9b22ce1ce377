"""The gin front end of a job's configs: every config class registered with gin by its name.

A .gin file binds fields of these classes by class name (see configs/quickstart.gin);
`load_job_configs` builds them all (type-checked, validated) into `areal_jax.job_config.JobConfigs`
before any work starts. The classes themselves live with their parts (job_config.py, trainer/config.py, ...).
"""

from __future__ import annotations

from typing import Any

from areal_jax import config_system as cs
from areal_jax.checkpoint import CheckpointConfig
from areal_jax.data.pipeline import DataConfig
from areal_jax.generation.config import EngineConfig
from areal_jax.job_config import (DEFAULT_SAVE_INTERVAL_S, DEFAULT_SAVE_INTERVAL_STEPS, JobConfigs, ModelSource,
                                  Stages, TaskSource, check_cross_fields, derived_max_seq_len)
from areal_jax.metrics import MetricsConfig
from areal_jax.models.lora import LoRAConfig
from areal_jax.parallel.meshes import MeshConfig
from areal_jax.plan.config import PlanConfig
from areal_jax.ppo.advantages import AdvantageConfig
from areal_jax.reward.pool import RewardPoolConfig
from areal_jax.reward.composite import JUDGE, check_terms
from areal_jax.reward.judge_config import JudgeConfig
from areal_jax.reward.registry import check_reward_function
from areal_jax.reward.sandbox import SandboxLimits
from areal_jax.rollout.workflow import RLVRConfig, resolve_workflow_class
from areal_jax.tasks.arithmetic import ArithmeticConfig
from areal_jax.trainer.config import MOVED_FIELDS, OptimizerConfig, PPOConfig, RLConfig, SFTConfig, TrainEngineConfig


JOB_CONFIG_CLASSES = (ModelSource, TaskSource, Stages, ArithmeticConfig, DataConfig, SFTConfig, RLConfig, PPOConfig,
                      TrainEngineConfig, OptimizerConfig, AdvantageConfig, RLVRConfig, EngineConfig, MeshConfig, CheckpointConfig,
                      RewardPoolConfig, SandboxLimits,
                      MetricsConfig, LoRAConfig, JudgeConfig,
                      PlanConfig)  # PlanConfig: read by `areal-jax plan`, accepted (and ignored) by the run
for _cls in JOB_CONFIG_CLASSES:
    cs.register(_cls)
cs.register_moved(MOVED_FIELDS)


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
    task, files = _task_source()
    data = None
    if task.kind == "dataset" or files:
        # `areal-jax sft` on its own files reads no RL prompts: DataConfig.paths defaults to SFTConfig.paths.
        sft_paths = cs.gin.get_bindings("SFTConfig").get("paths")
        data = cs.build(DataConfig, **({"paths": sft_paths} if sft_paths and "paths" not in cs.bindings(DataConfig)
                                       else {}))
    stages = cs.build(Stages)
    # A "judge" term's judge: RLVRConfig.judge, else JudgeConfig's own bindings.
    bound_reward = cs.bindings(RLVRConfig).get("reward")
    judge_term = isinstance(bound_reward, (tuple, list)) and any(
        isinstance(term, (tuple, list)) and term and term[0] == JUDGE for term in bound_reward)
    rollout = cs.build(RLVRConfig, **({"judge": cs.build(JudgeConfig)}
                                      if judge_term and "judge" not in cs.bindings(RLVRConfig) else {}))
    try:  # a reward named wrong is found now, not after SFT
        if isinstance(rollout.reward, str):
            check_reward_function(rollout.reward, "RLVRConfig.reward")
        else:
            check_terms(rollout.reward, check_reward_function, "RLVRConfig.reward")
    except ValueError as e:
        raise cs.ConfigError(str(e)) from None
    cfg = JobConfigs(
        model=cs.build(ModelSource), task=task, stages=stages, arithmetic=cs.build(ArithmeticConfig),
        data=data, sft=cs.build(SFTConfig), rl=cs.build(RLConfig), ppo=cs.build(PPOConfig),
        train_engine=cs.build(TrainEngineConfig), optimizer=cs.build(OptimizerConfig), advantages=cs.build(AdvantageConfig), rollout=rollout,
        engine=_engine_config(rollout, data), mesh=cs.build(MeshConfig), checkpoint=_checkpoint_config(stages, run_dir),
        metrics=cs.build(MetricsConfig), workflow_config=_workflow_config(workflow_class),
        reward_pool=cs.build(RewardPoolConfig), sandbox=cs.build(SandboxLimits), lora=cs.build(LoRAConfig),
        bindings=cs.operative_config())
    check_cross_fields(cfg, num_processes)
    return cfg


def _task_source() -> tuple[TaskSource, list[str]]:
    """TaskSource as bound (JobConfigs derives its kind and eval_size: files bound, "dataset") and
    the paths fields bound."""
    files = [f"{cls.__name__}.paths" for cls in (DataConfig, SFTConfig) if cs.bindings(cls).get("paths")]
    if cs.bindings(TaskSource).get("kind") == "arithmetic" and files:
        raise cs.ConfigError(f"{files[0]} is bound, but TaskSource.kind = 'arithmetic' (the built-in task) reads no "
                             "files: bind TaskSource.kind = 'dataset' (or leave it unbound) to train on them")
    return cs.build(TaskSource), files


def _engine_config(rollout: RLVRConfig, data: DataConfig | None) -> EngineConfig | None:
    """None (JobConfigs derives EngineConfig.max_seq_len) when EngineConfig is not bound; else the
    bound one, with max_seq_len unbound derived by the same rule (`derived_max_seq_len`)."""
    bound = cs.bindings(EngineConfig)
    if not bound:
        return None
    max_seq_len = None if "max_seq_len" in bound else derived_max_seq_len(bound.get("max_prompt_len", 0), data,
                                                                         rollout)
    return cs.build(EngineConfig, **({} if max_seq_len is None else {"max_seq_len": max_seq_len}))


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


_WORKFLOW_CONFIGS: set[type] = set()  # config classes of the workflows loaded in this process


def _workflow_class(rl: RLConfig) -> type | None:
    """RLConfig.workflow's class (already checked by RLConfig), its config class registered with gin."""
    if rl.workflow is None:
        return None
    cls = resolve_workflow_class(rl.workflow)
    if cls.config_class is not None:
        cs.register(cls.config_class)
        _WORKFLOW_CONFIGS.add(cls.config_class)
    return cls


def _workflow_config(cls: type | None) -> Any:
    config_class = None if cls is None else cls.config_class
    # A workflow config registered earlier in this process (the strict parse then accepts its
    # bindings) that the configured workflow does not read: its bindings would be ignored.
    for other in _WORKFLOW_CONFIGS - {config_class}:
        if cs.bindings(other):
            raise cs.ConfigError(f"{other.__name__} is bound, but RLConfig.workflow ({None if cls is None else cls.__name__}) "
                                 f"does not read it")
    return None if config_class is None else cs.build(config_class)
