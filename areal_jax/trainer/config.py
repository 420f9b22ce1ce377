"""The RL stage's configs: the loop (RLConfig) and the PPO step (PPOConfig).

Plain frozen dataclasses, validated in __post_init__, with no program or device state: a job
builds them from gin bindings (jobs/configs.py) or directly in Python (`areal_jax.JobConfigs`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from areal_jax.models.transformer import ATTENTION_IMPLS
from areal_jax.parallel.weight_sync import DEFAULT_GROUP_BYTES
from areal_jax.ppo.logprobs import DEFAULT_LOGIT_CHUNK_TOKENS
from areal_jax.ppo.loss import BEHAV_IMP_WEIGHT_MODES, IMPORTANCE_SAMPLING_LEVELS
from areal_jax.rollout.workflow import resolve_workflow_class
from areal_jax.trainer.batching import candidate_row_lengths

__all__ = ["COMPUTE_DTYPE_NAMES", "OBJECTIVES", "PPOConfig", "PROX_LOGP_METHODS", "REMATS", "RLConfig"]

COMPUTE_DTYPE_NAMES = ("float32", "bfloat16")
REMATS = ("none", "full", "save_dots")
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
        if not self.batch_timeout_s > 0:
            raise ValueError(f"RLConfig.batch_timeout_s must be > 0, got {self.batch_timeout_s!r}")
        if self.workflow is not None:
            resolve_workflow_class(self.workflow)  # imports it: a wrong path fails here, before any work



@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO step hyperparameters.

    Attributes:
        eps_clip: clip range of r = pi_theta / pi_prox (paper: 0.2).
        eps_clip_higher: upper clip range (DAPO clip-higher); None = eps_clip.
        behav_imp_weight_cap: bound on w = pi_prox / pi_behav; None = w applied unbounded (the
            paper's and AReaL v1.0.0's objective), or not at all with mode "disabled".
        behav_imp_weight_mode: with a cap, "mask" (tokens with w > cap leave the loss, still
            counted in the denominator) or "clamp" (their w becomes the cap): AReaL HEAD's
            rejection-sampling actions. "disabled" (cap must be None): no behaviour weight at
            all, AReaL HEAD's loss without rejection sampling; with decoupled = True this is the
            "naive_recompute" objective (`OBJECTIVES`).
        c_clip: dual clip (> 1): a token's loss is at most c_clip * |A|; None = off.
        importance_sampling_level: "token" (PPO) or "sequence" (GSPO: one ratio per packed
            sequence, the exp of its mean log-ratio, with its mean advantage).
        decoupled: True = decoupled PPO (proximal recomputed with pre-step weights);
            False = naive PPO (proximal := behavior, the paper's ablation). `objective` names
            the combination with behav_imp_weight_mode.
        prox_logp_method: "recompute" (a forward with the pre-step weights) or "loglinear"
            (A-3PO, AReaL HEAD: pi_prox interpolated in log space between pi_behav and the
            current pi_theta by token version, `ppo.loglinear_alpha`; no proximal forward).
            Decoupled only. With one minibatch the exact pi_prox costs no forward either and is
            used whatever the method.
        minibatch_seed: seeds the order of a step's groups before the minibatch split (with the
            step: `batching.minibatch_indices`).
        temperature: sampling temperature the log-probs are taken at. None (the default): the
            rollout's, RLVRConfig.temperature, which the job and RLLoop fill in (one field, so
            the two cannot differ); 1.0 for a trainer used alone.
        num_minibatches: optimizer updates per training step.
        max_tokens_per_microbatch: token budget of one micro-batch (for make_microbatches).
        row_buckets: row lengths micro-batches may use (for make_microbatches); () = powers of
            two from 128 up to the budget. Adding a size near the common sequence length (e.g.
            96 for ~70-token samples that do not pair in 128) cuts padding and attention cost.
        compute_dtype: "float32", or "bfloat16" compute on fp32 master weights.
        remat: rematerialization of the decoder layers ("none", "full", "save_dots").
        scan_layers: run the layers as a scan (one compiled layer body, the choice for deep
            models) or unrolled: on CPU ~15% faster per step for small models, whose compile
            is then also shorter (the scan's saved activations are stacked and sliced back).
        attention_impl: self-attention of the training forwards (policy gradient, proximal and
            reference log-probs): "auto" (flash attention: the platform's Pallas kernel, splash
            on TPU and Triton on GPU, else the jnp reference), "reference", "pallas", or "blocked"
            (the blocked formula under autodiff, whose backward keeps O(T^2) scores per layer).
            kernels/flash_attention.py.
        skip_nonfinite: skip (and count) updates whose gradient has a NaN/inf.
        logit_chunk_tokens: tokens of a micro-batch (all its rows, every process's) whose
            logits exist at once; longer micro-batches take log-probs and entropy chunk by chunk
            along the sequence, recomputing each chunk's logits in the backward. The default
            4096 keeps one fp32 copy at 2.5 GB for a 151,936-token vocabulary (divided over the
            devices holding rows and vocabulary), where a 16k-token micro-batch's whole logits
            would be 10 GB per copy; micro-batches of at most this many tokens run dense.
        moe_routing: for a mixture-of-experts policy, how the proximal and current log-probs
            route tokens: "recompute" (the trainer's router chooses afresh) or "replay" (the
            experts the generation engine chose, batch key `moe_routing`, are used; the router
            still weighs them and learns). Ignored for dense policies.
    """

    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    behav_imp_weight_cap: float | None = None
    behav_imp_weight_mode: Literal["mask", "clamp", "disabled"] = "mask"
    c_clip: float | None = None
    importance_sampling_level: Literal["token", "sequence"] = "token"
    decoupled: bool = True
    prox_logp_method: Literal["recompute", "loglinear"] = "recompute"
    minibatch_seed: int = 0
    temperature: float | None = None
    num_minibatches: int = 4
    max_tokens_per_microbatch: int = 4096
    row_buckets: tuple[int, ...] = ()
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "save_dots"] = "none"
    scan_layers: bool = True
    attention_impl: Literal["auto", "reference", "pallas", "blocked"] = "auto"
    skip_nonfinite: bool = True
    logit_chunk_tokens: int = DEFAULT_LOGIT_CHUNK_TOKENS
    moe_routing: Literal["recompute", "replay"] = "recompute"

    @property
    def logit_temperature(self) -> float:
        """The temperature log-probs are taken at (`temperature`, 1.0 when unset)."""
        return 1.0 if self.temperature is None else self.temperature

    def __post_init__(self) -> None:
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
        if self.prox_logp_method == "loglinear" and self.decoupled is False:
            raise ValueError("PPOConfig.prox_logp_method = 'loglinear' approximates the proximal policy of "
                             "decoupled PPO; it needs decoupled = True")
        if isinstance(self.minibatch_seed, bool) or not isinstance(self.minibatch_seed, int) or self.minibatch_seed < 0:
            raise ValueError(f"PPOConfig.minibatch_seed must be an int >= 0, got {self.minibatch_seed!r}")
        if self.temperature is not None and (not _is_number(self.temperature) or not self.temperature > 0):
            raise ValueError(f"PPOConfig.temperature must be > 0 or None, got {self.temperature!r}")
        for name in ("num_minibatches", "max_tokens_per_microbatch", "logit_chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PPOConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.row_buckets, tuple):
            raise ValueError(f"PPOConfig.row_buckets must be a tuple of ints, got {self.row_buckets!r}")
        if self.row_buckets:  # the check make_microbatches would run at the first step
            try:
                candidate_row_lengths(self.max_tokens_per_microbatch, self.row_buckets)
            except ValueError as e:
                raise ValueError(f"PPOConfig.row_buckets {self.row_buckets}: {e}") from None
        if self.compute_dtype not in COMPUTE_DTYPE_NAMES:
            raise ValueError(f"PPOConfig.compute_dtype must be one of {COMPUTE_DTYPE_NAMES}, "
                             f"got {self.compute_dtype!r}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"PPOConfig.scan_layers must be a bool, got {self.scan_layers!r}")
        if self.remat not in REMATS:
            raise ValueError(f"PPOConfig.remat must be one of {REMATS}, got {self.remat!r}")
        if self.moe_routing not in ("recompute", "replay"):
            raise ValueError(f"PPOConfig.moe_routing must be 'recompute' or 'replay', got {self.moe_routing!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"PPOConfig.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        for name in ("decoupled", "skip_nonfinite"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PPOConfig.{name} must be a bool, got {getattr(self, name)!r}")


    @property
    def objective(self) -> str:
        """The staleness ablation's name for this objective (`OBJECTIVES`, ppo/loss.py): "naive"
        (clip anchored at pi_behav), "naive_recompute" (clip anchored at the recomputed pi_prox,
        no behaviour weight) or "decoupled" (anchored at pi_prox, weighted by pi_prox / pi_behav,
        capped or not)."""
        if not self.decoupled:
            return "naive"
        return "naive_recompute" if self.behav_imp_weight_mode == "disabled" else "decoupled"


# The PPOConfig fields that select each objective of the staleness ablation (PPOConfig.objective):
# decoupled PPO, naive PPO anchored at the behaviour policy, and naive PPO anchored at the
# recomputed pre-step policy (AReaL v0.3.0 with recomputed log-probs and decoupling off).
OBJECTIVES: dict[str, dict[str, Any]] = {
    "decoupled": {"decoupled": True},
    "naive": {"decoupled": False},
    "naive_recompute": {"decoupled": True, "behav_imp_weight_mode": "disabled", "behav_imp_weight_cap": None},
}


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
