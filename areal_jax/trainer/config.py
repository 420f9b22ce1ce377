"""The trainers' configs: the RL loop (RLConfig), the PPO objective and step (PPOConfig) and SFT
(SFTConfig); the training engine's (TrainEngineConfig, OptimizerConfig: trainer/engine_config.py)
are re-exported here.

Plain frozen dataclasses, validated in __post_init__, with no program or device state: a job
builds them from gin bindings (jobs/configs.py) or directly in Python (`areal_jax.JobConfigs`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from areal_jax.parallel.weight_sync import DEFAULT_GROUP_BYTES
from areal_jax.ppo.loss import BEHAV_IMP_WEIGHT_MODES, IMPORTANCE_SAMPLING_LEVELS
from areal_jax.rollout.workflow import resolve_workflow_class
from areal_jax.trainer.engine_config import (  # noqa: F401  (re-exported: the job's configs in one place)
    COMPUTE_DTYPE_NAMES,
    REMATS,
    SCHEDULES,
    OptimizerConfig,
    Schedule,
    TrainEngineConfig,
)
from areal_jax.trainer.objectives import resolve_objective

__all__ = ["COMPUTE_DTYPE_NAMES", "MOVED_FIELDS", "OBJECTIVES", "OptimizerConfig", "PPOConfig", "PROX_LOGP_METHODS",
           "REMATS", "RLConfig", "SCHEDULES", "SFTConfig", "TrainEngineConfig"]

PROX_LOGP_METHODS = ("recompute", "loglinear")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL loop. batch_size is in prompt groups per training step (global, all processes)."""

    steps: int = 20
    batch_size: int = 8
    max_staleness: int = 4  # eta (AReaL's max_head_offpolicyness); 0 = synchronous
    max_concurrent: int = 32  # prompt groups in flight on the generator
    mode: Literal["async", "sync"] = "async"
    # Reject groups whose oldest token lags more than this behind the trainer when they finish;
    # then no trained token lags more than max_staleness + max_group_age versions. No AReaL twin.
    max_group_age: int | None = None
    channel_capacity: int = 0  # 0: 4 x batch_size
    generation_dtype: str | None = None  # e.g. "bfloat16": cast on the way to the generator
    # Generation weights one reshard group moves (whole arrays): the training devices hold at most
    # one group's staging buffers beside the fp32 weights and optimizer state during a transfer.
    transfer_group_bytes: int = DEFAULT_GROUP_BYTES
    # "delta": after the first push, send only the weights whose generation-dtype bits changed
    # (sparse positions and values) when that is smaller than the weights, else all of them
    # (parallel/delta_sync.py): for pushes over a slow network (several nodes, TPU slices over DCN).
    # "full": every weight every push. A LoRA run always sends its adapters only.
    transfer_mode: str = "full"
    eval_every: int = 0  # steps between held-out evaluations (0: only at the start and end)
    # Completion budget of held-out checks. None: RLVRConfig.max_new_tokens (the rollouts' budget).
    eval_max_new_tokens: int | None = None
    dump_rollouts_every: int = 0  # write the step's trajectories to rollouts/step_N.jsonl every N steps
    batch_timeout_s: float = 600.0  # waiting longer than this for a batch is an error
    # A custom rollout workflow, "package.module:Class" (the contract: areal_jax/rollout/workflow.py;
    # an example: areal_jax.workflows.multi_turn_math:MultiTurnMathWorkflow). None: RLVRWorkflow.
    workflow: str | None = None
    # AReaL's name for eta, kept only to refuse it: a ported config must not set the age filter by mistake.
    max_head_offpolicyness: int | None = None

    def __post_init__(self):
        if self.max_head_offpolicyness is not None:
            raise ValueError("RLConfig.max_head_offpolicyness is AReaL's name for eta: set RLConfig.max_staleness "
                             "instead (the per-group age filter here is RLConfig.max_group_age)")
        for name in ("steps", "batch_size", "max_concurrent"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RLConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"RLConfig.max_staleness must be an int >= 0, got {self.max_staleness!r}")
        if self.max_group_age is not None and (isinstance(self.max_group_age, bool)
                                               or not isinstance(self.max_group_age, int) or self.max_group_age < 0):
            raise ValueError(f"RLConfig.max_group_age must be None or an int >= 0, got {self.max_group_age!r}")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"RLConfig.mode must be 'async' or 'sync', got {self.mode!r}")
        if self.mode == "sync" and self.max_staleness != 0:
            raise ValueError("RLConfig.mode = 'sync' needs max_staleness = 0")
        if self.eval_max_new_tokens is not None and (isinstance(self.eval_max_new_tokens, bool) or not isinstance(
                self.eval_max_new_tokens, int) or self.eval_max_new_tokens < 1):
            raise ValueError(f"RLConfig.eval_max_new_tokens must be None or an int >= 1, got {self.eval_max_new_tokens!r}")
        if self.channel_capacity < 0 or self.eval_every < 0 or self.dump_rollouts_every < 0:
            raise ValueError("RLConfig.channel_capacity, eval_every and dump_rollouts_every must be >= 0")
        if (not isinstance(self.transfer_group_bytes, int) or isinstance(self.transfer_group_bytes, bool)
                or self.transfer_group_bytes < 1):
            raise ValueError(f"RLConfig.transfer_group_bytes must be an int >= 1, got {self.transfer_group_bytes!r}")
        if self.transfer_mode not in ("full", "delta"):
            raise ValueError(f"RLConfig.transfer_mode must be 'full' or 'delta', got {self.transfer_mode!r}")
        if not self.batch_timeout_s > 0:
            raise ValueError(f"RLConfig.batch_timeout_s must be > 0, got {self.batch_timeout_s!r}")
        if self.workflow is not None:
            resolve_workflow_class(self.workflow)  # imports it: a wrong path fails here, before any work



@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """The PPO objective and step (the training engine's knobs are TrainEngineConfig's).

    Attributes:
        objective: the loss, "decoupled", "naive", "naive_recompute" (`OBJECTIVES`: the staleness
            ablation's three, ppo/loss.py) or "package.module:function", a function
            `objective(logprobs, batch, config) -> (per_token_loss, metrics)` called with this
            config (trainer/objectives.py states the contract). "decoupled": the clip anchored at
            pi_prox (recomputed with the pre-step weights), each token weighted by pi_prox /
            pi_behav as behav_imp_weight_cap / _mode say; "naive": anchored at pi_behav, no
            weight (the paper's ablation); "naive_recompute": anchored at pi_prox, no weight. Any
            objective but "naive" gets pi_prox in `batch["proximal_logprobs"]`.
        eps_clip: clip range of r = pi_theta / pi_prox (paper: 0.2).
        eps_clip_higher: upper clip range (DAPO clip-higher); None = eps_clip.
        behav_imp_weight_cap: bound on w = pi_prox / pi_behav; None = w applied unbounded (the
            paper's and AReaL v1.0.0's objective), or not at all with mode "disabled".
        behav_imp_weight_mode: with a cap, "mask" (tokens with w > cap leave the loss, still
            counted in the denominator) or "clamp" (their w becomes the cap): AReaL HEAD's
            rejection-sampling actions. "disabled" (cap must be None): no behaviour weight at
            all, AReaL HEAD's loss without rejection sampling (objective "decoupled" then equals
            "naive_recompute").
        c_clip: dual clip (> 1): a token's loss is at most c_clip * |A|; None = off.
        importance_sampling_level: "token" (PPO) or "sequence" (GSPO: one ratio per packed
            sequence, the exp of its mean log-ratio, with its mean advantage).
        prox_logp_method: "recompute" (a forward with the pre-step weights) or "loglinear"
            (A-3PO, AReaL HEAD: pi_prox interpolated in log space between pi_behav and the
            current pi_theta by token version, `ppo.loglinear_alpha`; no proximal forward).
            Not with "naive". With one minibatch the exact pi_prox costs no forward either and is
            used whatever the method.
        minibatch_seed: seeds the order of a step's groups before the minibatch split (with the
            step: `batching.minibatch_indices`).
        temperature: sampling temperature the log-probs are taken at. None (the default): the
            rollout's, RLVRConfig.temperature, derived in one place (`job_config.training_temperature`,
            which JobConfigs and build_rl_loop call; one field, so the two cannot differ); 1.0 for a
            trainer used alone.
        num_minibatches: optimizer updates per training step.
    """

    objective: str = "decoupled"
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    behav_imp_weight_cap: float | None = None
    behav_imp_weight_mode: Literal["mask", "clamp", "disabled"] = "mask"
    c_clip: float | None = None
    importance_sampling_level: Literal["token", "sequence"] = "token"
    prox_logp_method: Literal["recompute", "loglinear"] = "recompute"
    minibatch_seed: int = 0
    temperature: float | None = None
    num_minibatches: int = 4

    @property
    def logit_temperature(self) -> float:
        """The temperature log-probs are taken at (`temperature`, 1.0 when unset)."""
        return 1.0 if self.temperature is None else self.temperature

    @property
    def decoupled(self) -> bool:
        """Whether the objective reads a proximal policy (every objective but "naive")."""
        return self.objective != "naive"

    def __post_init__(self) -> None:
        if not isinstance(self.objective, str) or not self.objective:
            raise ValueError(f"PPOConfig.objective must name an objective, got {self.objective!r}")
        resolve_objective(self.objective)  # imports a user's: a wrong path fails here, before any work
        if not _is_number(self.eps_clip) or not 0.0 < self.eps_clip < 1.0:
            raise ValueError(f"PPOConfig.eps_clip must be in (0, 1), got {self.eps_clip!r}")
        if self.eps_clip_higher is not None and not (_is_number(self.eps_clip_higher) and self.eps_clip_higher > 0):
            raise ValueError(f"PPOConfig.eps_clip_higher must be > 0 or None, got {self.eps_clip_higher!r}")
        if self.behav_imp_weight_cap is not None and not (
                _is_number(self.behav_imp_weight_cap) and self.behav_imp_weight_cap > 0):
            raise ValueError(f"PPOConfig.behav_imp_weight_cap must be > 0 or None, got {self.behav_imp_weight_cap!r}")
        if self.behav_imp_weight_mode not in BEHAV_IMP_WEIGHT_MODES:
            raise ValueError(f"PPOConfig.behav_imp_weight_mode must be one of {BEHAV_IMP_WEIGHT_MODES}, "
                             f"got {self.behav_imp_weight_mode!r}")
        if self.behav_imp_weight_mode == "disabled" and self.behav_imp_weight_cap is not None:
            raise ValueError(f"PPOConfig.behav_imp_weight_cap must be None with behav_imp_weight_mode = 'disabled' "
                             f"(no behaviour weight to cap), got {self.behav_imp_weight_cap!r}")
        if self.c_clip is not None and not (_is_number(self.c_clip) and self.c_clip > 1):
            raise ValueError(f"PPOConfig.c_clip must be > 1 or None, got {self.c_clip!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"PPOConfig.importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        if self.prox_logp_method not in PROX_LOGP_METHODS:
            raise ValueError(f"PPOConfig.prox_logp_method must be one of {PROX_LOGP_METHODS}, "
                             f"got {self.prox_logp_method!r}")
        if self.prox_logp_method == "loglinear" and not self.decoupled:
            raise ValueError("PPOConfig.prox_logp_method = 'loglinear' approximates the proximal policy of "
                             "decoupled PPO; objective 'naive' has none")
        if isinstance(self.minibatch_seed, bool) or not isinstance(self.minibatch_seed, int) or self.minibatch_seed < 0:
            raise ValueError(f"PPOConfig.minibatch_seed must be an int >= 0, got {self.minibatch_seed!r}")
        if self.temperature is not None and (not _is_number(self.temperature) or not self.temperature > 0):
            raise ValueError(f"PPOConfig.temperature must be > 0 or None, got {self.temperature!r}")
        if isinstance(self.num_minibatches, bool) or not isinstance(self.num_minibatches, int) or self.num_minibatches < 1:
            raise ValueError(f"PPOConfig.num_minibatches must be a positive int, got {self.num_minibatches!r}")


# The PPOConfig fields of each objective of the staleness ablation: decoupled PPO, naive PPO
# anchored at the behaviour policy, and naive PPO anchored at the recomputed pre-step policy
# (AReaL v0.3.0 with recomputed log-probs and decoupling off; the cap fields then unused, so cleared).
OBJECTIVES: dict[str, dict[str, Any]] = {
    "decoupled": {"objective": "decoupled"},
    "naive": {"objective": "naive"},
    "naive_recompute": {"objective": "naive_recompute", "behav_imp_weight_mode": "disabled",
                        "behav_imp_weight_cap": None},
}

# Fields that moved (gin bindings and Python keywords of the old names fail naming the new one).
MOVED_FIELDS: dict[str, str] = {
    **{f"PPOConfig.{name}": f"TrainEngineConfig.{name}" for name in (
        "max_tokens_per_microbatch", "row_buckets", "compute_dtype", "remat", "scan_layers", "attention_impl",
        "skip_nonfinite", "logit_chunk_tokens", "moe_routing")},
    "PPOConfig.decoupled": "PPOConfig.objective ('decoupled', or 'naive' for decoupled = False)",
    "SFTConfig.warmup": "SFTConfig.warmup_steps",
    "SFTConfig.grad_clip": "SFTConfig.max_grad_norm",
    # RLConfig.batch_size counts prompt groups; SFT's count is of packed rows.
    "SFTConfig.batch_size": "SFTConfig.rows_per_step",
    **{f"SFTConfig.{name}": f"TrainEngineConfig.{name} (SFT runs on the RL trainer's engine)"
       for name in ("compute_dtype", "scan_layers", "attention_impl")},
}


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """SFT hyper-parameters.

    steps: optimizer steps. rows_per_step: packed rows per step (B; each holds several examples,
    so not an example count). max_len: tokens per row (T);
    every example must fit in one row. lr: peak AdamW learning rate (the default suits a pretrained
    model, as TRL's; the built-in task's tiny model wants ~3e-3, as configs/quickstart.gin sets),
    reached after `warmup_steps` linear steps, then cosine decay to `lr * min_lr_ratio`;
    weight_decay and max_grad_norm (a global norm) as OptimizerConfig's, whose names these are
    (`optimizer_config`). log_every: steps between metric read-backs (reading forces a device
    sync). SFT runs on the RL trainer's engine (trainer/sft.py): its compute dtype, layer scan and
    attention are TrainEngineConfig's.

    Validation (needs validation prompts, e.g. TaskSource.validation_size for the built-in task):
    eval_every: steps between greedy-accuracy checks on them (0 = none), from step `eval_from`
    on. stop_accuracy: end SFT at the first check whose accuracy reaches it (0 = run all `steps`;
    the schedule stays the one over `steps`). Stopping on accuracy rather than a step count gives
    RL the same kind of start on any machine: where a small policy lands after a fixed number of
    steps moves with the numerics (docs/benchmarks.md, quickstart).

    Files (TaskSource.kind = "dataset"; read with DataConfig's format and templates):
    paths: SFT rows (GSM8K, MATH, AReaL, or chat `messages`); default DataConfig.paths.
    eval_paths: held-out rows of the same kinds: their completion loss is `val_loss`.
    val_every: steps between held-out loss passes over eval_paths (0: once, after the last step).
    """

    steps: int = 1000
    rows_per_step: int = 16
    lr: float = 2e-5
    warmup_steps: int = 50
    max_len: int = 256
    seed: int = 0
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    min_lr_ratio: float = 0.1
    log_every: int = 10
    eval_every: int = 0
    eval_from: int = 0
    stop_accuracy: float = 0.0
    paths: tuple[str, ...] = ()
    eval_paths: tuple[str, ...] = ()
    val_every: int = 0

    def __post_init__(self):
        for name in ("steps", "rows_per_step", "max_len", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SFTConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"SFTConfig.warmup_steps must be an int in [0, steps={self.steps}], "
                             f"got {self.warmup_steps!r}")
        if not self.lr > 0:
            raise ValueError(f"SFTConfig.lr must be positive, got {self.lr!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"SFTConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"SFTConfig.max_grad_norm must be positive, got {self.max_grad_norm!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"SFTConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        for name in ("paths", "eval_paths"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(p, str) and p for p in value):
                raise ValueError(f"SFTConfig.{name} must be a tuple of paths, got {value!r}")
            object.__setattr__(self, name, tuple(value))  # lists from gin become tuples
        for name in ("eval_every", "eval_from", "val_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SFTConfig.{name} must be an int >= 0, got {value!r}")
        if self.val_every and not self.eval_paths:
            raise ValueError("SFTConfig.val_every needs held-out files: set SFTConfig.eval_paths")
        if not 0.0 <= self.stop_accuracy <= 1.0:
            raise ValueError(f"SFTConfig.stop_accuracy must be in [0, 1] (0 = off), got {self.stop_accuracy!r}")
        if self.stop_accuracy > 0 and self.eval_every == 0:
            raise ValueError("SFTConfig.stop_accuracy needs validation checks: set SFTConfig.eval_every > 0")
        try:  # what SFTConfig's checks above let through and the shared optimizer would refuse
            self.optimizer_config()
        except ValueError as e:
            raise ValueError(f"SFTConfig (lr, warmup_steps, weight_decay, max_grad_norm, min_lr_ratio): {e}") from None
        # The first check: the first multiple of eval_every at or after eval_from (steps count from 1).
        if self.eval_every and -(-max(self.eval_from, 1) // self.eval_every) * self.eval_every > self.steps:
            raise ValueError(f"SFTConfig.eval_every = {self.eval_every} with eval_from = {self.eval_from} runs no "
                             f"validation check within steps = {self.steps}: lower SFTConfig.eval_from, or set "
                             f"SFTConfig.eval_every = 0 and SFTConfig.stop_accuracy = 0.0 to train all steps")

    def optimizer_config(self) -> OptimizerConfig:
        """SFT's optimizer as the RL trainer's (trainer/optimizer.py, one AdamW and schedule for
        both): global-norm clipping at `max_grad_norm`, AdamW (b2 0.98, `weight_decay`), linear warmup
        over `warmup_steps` updates (update s at lr * (s + 1) / warmup_steps), then cosine decay to
        lr * min_lr_ratio at update `steps`."""
        return OptimizerConfig(lr=self.lr, warmup_steps=self.warmup_steps, schedule="cosine",
                               total_steps=max(self.steps, self.warmup_steps + 1),  # warmup == steps: warmup only
                               min_lr_ratio=self.min_lr_ratio, weight_decay=self.weight_decay, b2=0.98,
                               max_grad_norm=self.max_grad_norm)

    def validates_at(self, step: int) -> bool:
        """Whether step `step` (1-based) ends with a validation check."""
        return self.eval_every > 0 and step >= self.eval_from and step % self.eval_every == 0


def weight_swap_conflict(weight_swap: str, rl: RLConfig, lora_rank: int) -> str | None:
    """Why `EngineConfig.weight_swap` cannot be used with this run's push, or None.

    "evict" lands a push where the served weights were, so the push must not read them: a delta
    push writes the changed elements into a copy of the served weights, and a LoRA push merges
    the adapters into a base held on the generation devices beside the served weights (two
    copies whatever the swap does)."""
    if weight_swap != "evict":
        return None
    if lora_rank > 0:
        return ("EngineConfig.weight_swap = 'evict' with LoRAConfig.rank > 0: a LoRA push merges adapters into a "
                "base copy kept on the generation devices, so evicting the served weights saves nothing; use "
                "'alongside'")
    if rl.transfer_mode == "delta":
        return ("EngineConfig.weight_swap = 'evict' with RLConfig.transfer_mode = 'delta': a delta push writes the "
                "changed elements into a copy of the served weights, which eviction drops; use transfer_mode 'full'")
    return None


def weight_dtype_conflict(weight_dtype: str | None, rl: RLConfig, lora_rank: int) -> str | None:
    """Why `EngineConfig.weight_dtype` cannot be used with this run's push, or None.

    A quantized engine (int8 or int4) holds only codes and scales of its matmul weights: a LoRA push merges the
    adapters into a full-precision base on the generation devices and a delta push writes the
    changed elements of the generation dtype into the served weights, neither of which exists."""
    if weight_dtype is None:
        return None
    if lora_rank > 0:
        return (f"EngineConfig.weight_dtype = {weight_dtype!r} with LoRAConfig.rank > 0: a LoRA push merges adapters "
                "into full-precision served weights; use weight_dtype None")
    if rl.transfer_mode == "delta":
        return (f"EngineConfig.weight_dtype = {weight_dtype!r} with RLConfig.transfer_mode = 'delta': a delta push "
                "writes changed elements into the served weights, which are quantized; use transfer_mode 'full'")
    return None
