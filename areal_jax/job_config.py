"""The configs of a job, as plain frozen dataclasses: what a run reads, however it was configured.

`JobConfigs` gathers one config per part (model, task, stages, SFT, RL, PPO, optimizer, rollout,
engine, mesh, checkpoints, metrics, reward workers). The gin front end (`jobs/configs.py`,
`areal_jax.load_config`) builds it from .gin files; Python code builds it directly,
`JobConfigs(rl=RLConfig(steps=5))`, every part it leaves out at its defaults and the derived
fields filled as the gin front end fills them. `check_cross_fields` finds configs that disagree.

This module imports configs only: `plan/` and `jobs/` both read it, neither reads the other's
internals through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from areal_jax.checkpoint import CheckpointConfig
from areal_jax.config_system import ConfigError, check_types
from areal_jax.data.pipeline import DataConfig
from areal_jax.generation.config import EngineConfig
from areal_jax.metrics import MetricsConfig
from areal_jax.models.lora import LoRAConfig
from areal_jax.parallel.meshes import MeshConfig
from areal_jax.ppo.advantages import AdvantageConfig
from areal_jax.reward.pool import RewardPoolConfig
from areal_jax.reward.sandbox import SandboxLimits
from areal_jax.rollout.workflow import RLVRConfig
from areal_jax.tasks.arithmetic import ArithmeticConfig
from areal_jax.trainer.config import (OptimizerConfig, PPOConfig, RLConfig, SFTConfig, TrainEngineConfig,
                                     weight_dtype_conflict, weight_swap_conflict)

__all__ = ["DEFAULT_EVAL_SIZE", "DEFAULT_SAVE_INTERVAL_S", "DEFAULT_SAVE_INTERVAL_STEPS", "EVAL_SLOTS", "JobConfigs",
           "ModelSource", "RUN_DIR", "Stages", "TaskSource", "check_cross_fields", "derived_max_seq_len"]

EVAL_SLOTS = 64  # most slots of a held-out evaluation engine (`JobConfigs.eval_slots`)
DEFAULT_EVAL_SIZE = 200  # held-out prompts of a job that sets no TaskSource.eval_size (and has some)
# Checkpoints of a run that binds no interval: every 50 steps or 30 minutes, and after the last step.
DEFAULT_SAVE_INTERVAL_STEPS = 50
DEFAULT_SAVE_INTERVAL_S = 1800.0
# Stands for the run directory in CheckpointConfig.directory until a run fills it in (`JobConfigs.for_run`).
RUN_DIR = "{run_dir}"


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
    # Held-out prompts for accuracy. None: derived by JobConfigs, DEFAULT_EVAL_SIZE for the
    # arithmetic task or a dataset with eval_paths, 0 for a dataset without (no held-out accuracy).
    eval_size: int | None = None
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
        if self.train_size < 1 or (self.eval_size is not None and self.eval_size < 0):
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


def training_temperature(ppo: PPOConfig, rollout: RLVRConfig) -> PPOConfig:
    """`ppo` with its temperature derived from the rollouts' (`RLVRConfig.temperature`): the trainer's
    log-probs must be of the distribution that sampled the tokens, or the importance weights
    pi_prox / pi_behav measure the temperature, not the staleness. The one place it is derived:
    JobConfigs (the gin and Python job paths) and `jobs.rl_loop_builder.build_rl_loop` (direct
    callers) both call this. A different value already set is refused."""
    if ppo.temperature is None:
        return dataclasses.replace(ppo, temperature=rollout.temperature)
    if ppo.temperature != rollout.temperature:
        raise ConfigError(f"PPOConfig.temperature ({ppo.temperature}) is derived from RLVRConfig.temperature "
                          f"({rollout.temperature}): the trainer takes log-probs at the sampling temperature; "
                          "set RLVRConfig.temperature only")
    return ppo

@dataclasses.dataclass(frozen=True)
class JobConfigs:
    """Every config of a job. Parts left out take their defaults; `__post_init__` fills every field
    derived from other parts, the one place that does, for the gin front end and Python alike:
    TaskSource.kind (files bound: "dataset") and eval_size, PPOConfig.temperature
    (RLVRConfig.temperature: one field sets both), RLConfig.eval_max_new_tokens (the rollouts'
    budget) and, with `engine` left out, EngineConfig.max_seq_len (`derived_max_seq_len`). A field
    is derived where it is None (`engine`: the part is None). `with_parts` replaces parts and
    derives again from the parts as given. `checkpoint` None with Stages.checkpoint: the run's
    default (`for_run`: RUN/checkpoints)."""

    model: ModelSource = ModelSource()
    task: TaskSource = TaskSource()
    stages: Stages = Stages()
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    data: DataConfig | None = None  # the prompt files (TaskSource.kind "dataset"); None: the arithmetic task
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    ppo: PPOConfig = PPOConfig()
    train_engine: TrainEngineConfig = TrainEngineConfig()  # how the trainer packs and computes (RL and SFT)
    optimizer: OptimizerConfig = OptimizerConfig()
    advantages: AdvantageConfig = AdvantageConfig()
    rollout: RLVRConfig = RLVRConfig()
    engine: EngineConfig | None = None  # None: EngineConfig() with max_seq_len derived (`derived_max_seq_len`)
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig | None = None
    metrics: MetricsConfig = MetricsConfig()  # TensorBoard and W&B besides metrics.jsonl
    # The config (config_class instance) of RLConfig.workflow's class, None when it has none: a
    # workflow's settings, not a workflow (the workflow itself is built from RLConfig.workflow).
    workflow_config: Any = None
    reward_pool: RewardPoolConfig = RewardPoolConfig()  # the workers of every reward not declared in-process
    sandbox: SandboxLimits = SandboxLimits()  # the code reward's sandbox in those workers
    lora: LoRAConfig = LoRAConfig()  # RL trains adapters on a frozen base when rank > 0
    # The gin bindings these configs were parsed from (the run writes them as config.gin); "" when
    # built in Python: config.gin then holds the fields that differ from their defaults.
    bindings: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, cls = getattr(self, f.name), _PART_TYPES.get(f.name)
            if cls is not None and not isinstance(value, cls) and not (value is None and f.name in _OPTIONAL):
                raise ConfigError(f"JobConfigs.{f.name} must be a {cls.__name__}, got {type(value).__name__}")
            if value is not None and dataclasses.is_dataclass(value):
                check_types(value)  # a field of the wrong type: one line naming it, as a gin binding would
        # The parts as given, before anything below derives from them: `with_parts` starts from these.
        object.__setattr__(self, "_given", {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        task = self.task
        if task.kind is None or task.eval_size is None:
            files = bool(self.data is not None and self.data.paths) or bool(self.sft.paths)
            kind = task.kind or ("dataset" if files else "arithmetic")
            # A dataset with no held-out files named: no held-out accuracy, not an error.
            eval_size = task.eval_size if task.eval_size is not None else (
                DEFAULT_EVAL_SIZE if kind == "arithmetic" or task.eval_paths else 0)
            object.__setattr__(self, "task", dataclasses.replace(task, kind=kind, eval_size=eval_size))
        if self.task.kind == "dataset" and self.data is None and self.sft.paths:
            object.__setattr__(self, "data", DataConfig(paths=tuple(self.sft.paths)))
        if self.task.kind == "arithmetic" and self.data is not None and self.data.paths:
            raise ConfigError("DataConfig.paths is set, but TaskSource.kind = 'arithmetic' (the built-in task) reads "
                              "no files: leave TaskSource.kind unset (or 'dataset') to train on them")
        if self.task.kind == "dataset" and self.data is None:
            raise ConfigError("TaskSource.kind = 'dataset' needs JobConfigs.data (a DataConfig with paths)")
        rollout = self.rollout
        object.__setattr__(self, "ppo", training_temperature(self.ppo, rollout))
        if self.rl.eval_max_new_tokens is None:  # held-out checks sample as long as the rollouts
            object.__setattr__(self, "rl", dataclasses.replace(self.rl, eval_max_new_tokens=rollout.max_new_tokens))
        if self.engine is None:
            max_seq_len = derived_max_seq_len(0, self.data, rollout)
            object.__setattr__(self, "engine", EngineConfig() if max_seq_len is None else
                               EngineConfig(max_seq_len=max_seq_len))
        if self.checkpoint is not None and not self.stages.checkpoint:
            raise ConfigError("CheckpointConfig is set, but Stages.checkpoint = False turns checkpoints off")

    @property
    def eval_slots(self) -> int:
        """Most slots of a held-out evaluation engine (the run's, and `areal-jax plan`'s account of
        it): EVAL_SLOTS, and no more than the RL engine's, whose KV cache is what the config sized to
        fit the generation devices (64 slots of a 17k-token reasoning budget would not)."""
        return min(EVAL_SLOTS, self.engine.num_slots)

    def eval_slots_within(self, page_bytes: int, data: int) -> int:
        """`eval_slots`, and no more than the full-length sequences the RL engine's KV pool holds
        over its `data` replicas (at least one per replica): the evaluation engine caches every
        slot at full length, so 64 slots of a 17k-token budget can need more than the pool the
        config sized to fit (the 32B config's did: 85 of 80 GiB). `page_bytes`: one page of one
        replica, every layer's keys and values."""
        held = self.engine.pool_pages(page_bytes, data) * data // self.engine.pages_per_sequence
        return max(data, min(self.eval_slots, held))

    def eval_engine_slots(self, model_cfg: Any, data: int) -> int:
        """The slots of the run's held-out evaluation engine over `data` replicas, and of
        `areal-jax plan`'s account of it: `eval_slots_within` the RL engine's pool of `model_cfg`'s
        pages in the cache dtype (EngineConfig.cache_dtype, else the generation dtype)."""
        from areal_jax.generation.paged import page_bytes

        dtype = self.engine.cache_dtype or self.rl.generation_dtype or self.model.dtype
        return self.eval_slots_within(page_bytes(model_cfg, self.engine.page_size, dtype), data)

    def with_parts(self, **parts: Any) -> JobConfigs:
        """These configs with `parts` replaced, every derived field derived again from the parts as
        given (a value this instance derived, e.g. PPOConfig.temperature from the old
        RLVRConfig.temperature, is not carried over). Bindings are dropped: the gin text no longer
        says it all."""
        return JobConfigs(**{**self._given, "bindings": "", **parts})

    def given(self, name: str) -> Any:
        """Part `name` as it was given, before `__post_init__` derived its fields (after a
        `dataclasses.replace`, the parts it was given: derived ones included)."""
        return self._given[name]

    def as_dict(self) -> dict:
        return {f.name: (None if getattr(self, f.name) is None else dataclasses.asdict(getattr(self, f.name)))
                for f in dataclasses.fields(self) if f.name != "bindings"}

    def for_run(self, run_dir: Any) -> JobConfigs:
        """These configs for the run in `run_dir`: "{run_dir}" in CheckpointConfig.directory replaced
        by it, and with Stages.checkpoint on and no CheckpointConfig set, the default one (RUN/checkpoints,
        every DEFAULT_SAVE_INTERVAL_STEPS steps or DEFAULT_SAVE_INTERVAL_S seconds)."""
        ckpt = self.checkpoint
        if ckpt is None and self.stages.checkpoint:
            ckpt = CheckpointConfig(directory=f"{RUN_DIR}/checkpoints", save_interval_steps=DEFAULT_SAVE_INTERVAL_STEPS,
                                    save_interval_s=DEFAULT_SAVE_INTERVAL_S)
        if ckpt is not None and RUN_DIR in str(ckpt.directory):
            ckpt = dataclasses.replace(ckpt, directory=str(ckpt.directory).replace(RUN_DIR, str(run_dir)))
        if ckpt is self.checkpoint:
            return self
        run = dataclasses.replace(self, checkpoint=ckpt)
        object.__setattr__(run, "_given", {**self._given, "checkpoint": ckpt})  # `with_parts` still derives
        return run

    def gin_text(self) -> str:
        """The bindings that rebuild these configs: the parsed ones, or (built in Python) one line
        per field that differs from its default."""
        if self.bindings:
            return self.bindings
        lines = []
        for f in dataclasses.fields(self):
            part = getattr(self, f.name)
            if f.name == "bindings" or part is None or not dataclasses.is_dataclass(part):
                continue
            try:  # defaults as constructed (a default_factory's, a value __post_init__ derives)
                default = type(part)()
            except (TypeError, ValueError):  # a class with required fields: the declared defaults
                default = None
            for field in dataclasses.fields(part):
                value = getattr(part, field.name)
                if value != _default_of(field, default):
                    lines.append(f"{type(part).__name__}.{field.name} = {value!r}")
        return "\n".join(lines) + "\n"


def derived_max_seq_len(max_prompt_len: int, data: DataConfig | None, rollout: RLVRConfig) -> int | None:
    """EngineConfig.max_seq_len of a job that does not set it: the longest prompt
    (EngineConfig.max_prompt_len, else DataConfig.max_prompt_tokens) plus RLVRConfig.max_new_tokens;
    None (the field's default stays) when neither prompt limit is set."""
    prompt = max_prompt_len or (data.max_prompt_tokens if data is not None else None)
    return prompt + rollout.max_new_tokens if prompt else None


def _default_of(field: dataclasses.Field, instance: Any) -> Any:
    """The default of `field`: `instance`'s value, else the declared one (a required field has none)."""
    if instance is not None:
        return getattr(instance, field.name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _NO_DEFAULT


_NO_DEFAULT = object()
_PART_TYPES: dict[str, type] = {}  # JobConfigs field -> its config class (filled below)
_OPTIONAL = ("data", "checkpoint", "engine")


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
        raise ConfigError(
            "SFTConfig.eval_every > 0 needs validation prompts: TaskSource.kind = 'arithmetic' with "
            f"TaskSource.validation_size > 0 (got kind {task.kind!r}, validation_size {task.validation_size})")
    if cfg.sft.eval_every and cfg.rollout.verifier is None:
        raise ConfigError(f"SFTConfig.eval_every > 0 stops SFT on accuracy, which needs a verifier term in "
                          f"RLVRConfig.reward (got {cfg.rollout.reward!r}); set SFTConfig.eval_every = 0")
    if (cfg.sft.paths or cfg.sft.eval_paths) and task.kind != "dataset":
        raise ConfigError("SFTConfig.paths / SFTConfig.eval_paths are read with DataConfig's format and templates: "
                             f"they need TaskSource.kind = 'dataset' (got {task.kind!r})")


def _check_rl(cfg: JobConfigs) -> None:
    rollout, ppo, engine, budget = cfg.rollout, cfg.ppo, cfg.engine, cfg.train_engine.max_tokens_per_microbatch
    longest = min(engine.max_seq_len, engine.prompt_limit + rollout.max_new_tokens)
    if cfg.rl.workflow is not None and engine.max_seq_len > budget:
        # A custom workflow may grow an episode turn by turn, up to the engine's limit.
        raise ConfigError(
            f"TrainEngineConfig.max_tokens_per_microbatch ({budget}) is below EngineConfig.max_seq_len "
            f"({engine.max_seq_len}), the longest sequence RLConfig.workflow ({cfg.rl.workflow!r}) may build; such "
            "a sequence could not be trained")
    if longest > budget:
        raise ConfigError(
            f"TrainEngineConfig.max_tokens_per_microbatch ({budget}) is below the longest sample "
            f"({longest} tokens: EngineConfig.max_seq_len {engine.max_seq_len}, or EngineConfig.max_prompt_len + "
            f"RLVRConfig.max_new_tokens); such a sample could not be trained")
    buckets = cfg.train_engine.row_buckets
    if buckets and longest > max(buckets):
        raise ConfigError(
            f"the longest sample ({longest} tokens: EngineConfig.max_seq_len, or EngineConfig.max_prompt_len + "
            f"RLVRConfig.max_new_tokens) exceeds the longest of TrainEngineConfig.row_buckets ({max(buckets)}); "
            "such a sample could not be packed into a row")
    conflict = (weight_swap_conflict(engine.weight_swap, cfg.rl, cfg.lora.rank)
                or weight_dtype_conflict(engine.weight_dtype, cfg.rl, cfg.lora.rank))
    if conflict:
        raise ConfigError(conflict)
    sequences = cfg.rl.batch_size * rollout.n_samples
    if sequences < ppo.num_minibatches:
        raise ConfigError(
            f"PPOConfig.num_minibatches ({ppo.num_minibatches}) exceeds the sequences of a step: RLConfig.batch_size "
            f"({cfg.rl.batch_size}) x RLVRConfig.n_samples ({rollout.n_samples}) = {sequences}")


def _check_rl_processes(cfg: JobConfigs, num_processes: int) -> None:
    rl = cfg.rl
    if rl.batch_size % num_processes:
        raise ConfigError(f"RLConfig.batch_size ({rl.batch_size}) must divide over the {num_processes} processes")
    local_batch = rl.batch_size // num_processes
    if rl.channel_capacity and rl.channel_capacity < local_batch:
        raise ConfigError(
            f"RLConfig.channel_capacity ({rl.channel_capacity}) is below a process's share of RLConfig.batch_size "
            f"({local_batch}): the batch could never fill")
    if local_batch * cfg.rollout.n_samples < cfg.ppo.num_minibatches:
        raise ConfigError(
            f"PPOConfig.num_minibatches ({cfg.ppo.num_minibatches}) exceeds a process's sequences per step: "
            f"RLConfig.batch_size / {num_processes} processes x RLVRConfig.n_samples = "
            f"{local_batch * cfg.rollout.n_samples}")


for _f in dataclasses.fields(JobConfigs):
    if _f.name not in ("workflow_config", "bindings"):
        _PART_TYPES[_f.name] = ({"data": DataConfig, "checkpoint": CheckpointConfig, "engine": EngineConfig}.get(_f.name)
                                or type(_f.default))
