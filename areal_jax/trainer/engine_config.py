"""The training engine's configs: how it runs (TrainEngineConfig), the loss it compiles (Objective)
and its optimizer (OptimizerConfig, trainer/optimizer.py builds it).

Nothing here knows an RL algorithm: the objective is a function the algorithm hands over
(trainer/objectives.py states the contract and holds the built-in ones).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

from areal_jax.models.transformer import ATTENTION_IMPLS
from areal_jax.ppo.logprobs import DEFAULT_LOGIT_CHUNK_TOKENS
from areal_jax.trainer.batching import candidate_row_lengths

__all__ = ["COMPUTE_DTYPE_NAMES", "REMATS", "SCHEDULES", "Objective", "OptimizerConfig", "Schedule",
           "TrainEngineConfig"]

COMPUTE_DTYPE_NAMES = ("float32", "bfloat16")
REMATS = ("none", "full", "save_dots")


@dataclasses.dataclass(frozen=True)
class TrainEngineConfig:
    """How the training engine packs and computes (nothing here changes what is optimized).

    Attributes:
        max_tokens_per_microbatch: token budget of one micro-batch **per training device** (for
            make_microbatches): each device holding rows gets at most budget // T rows of length
            T, so a micro-batch over D training devices carries up to D x budget tokens, in sync
            (every device trains) and async alike. Changed in issue 40: it was the budget of a
            whole process's micro-batch, and rows were then rounded up to one per device, which
            padded long rows heavily on many devices (8 rows of 17,408 for 32,768 real tokens).
            A config written for the old meaning keeps its peak memory if the budget is at least
            its longest bucket; it must be (checked), and the longest sample must fit a bucket.
        row_buckets: row lengths micro-batches may use (for make_microbatches), none above the
            budget; () = powers of two from 128 below the budget, and the budget. Adding a size
            near the common sequence length (e.g. 96 for ~70-token samples that do not pair in
            128) cuts padding and attention cost.
        compute_dtype: "float32", or "bfloat16" compute on fp32 master weights.
        remat: rematerialization of the decoder layers ("none", "full", "save_dots").
        scan_layers: run the layers as a scan (one compiled layer body, the choice for deep
            models) or unrolled: on CPU ~15% faster per step for small models, whose compile
            is then also shorter (the scan's saved activations are stacked and sliced back).
        attention_impl: self-attention of the training forwards (loss, proximal and reference
            log-probs): "auto" (flash attention: the platform's Pallas kernel, splash on TPU and
            Triton on GPU, else the jnp reference), "reference", "pallas", or "blocked" (the
            blocked formula under autodiff, whose backward keeps O(T^2) scores per layer).
            kernels/flash_attention.py.
        skip_nonfinite: skip (and count) updates whose gradient has a NaN/inf.
        logit_chunk_tokens: tokens of a micro-batch (all its rows, every process's) whose
            logits exist at once; longer micro-batches take log-probs and entropy chunk by chunk
            along the sequence, recomputing each chunk's logits in the backward. The default
            4096 keeps one fp32 copy at 2.5 GB for a 151,936-token vocabulary (divided over the
            devices holding rows and vocabulary), where a 16k-token micro-batch's whole logits
            would be 10 GB per copy; micro-batches of at most this many tokens run dense.
        moe_routing: for a mixture-of-experts policy, how the forwards route tokens: "recompute"
            (the trainer's router chooses afresh) or "replay" (the experts the generation engine
            chose, batch key `moe_routing`, are used; the router still weighs them and learns).
            At staleness > 0 replay keeps each token's routing at the behaviour version that
            sampled it. Ignored for dense policies.
        share_prefixes: shared-prefix ("tree") training: each prompt group's rows (an agent's
            sessions and turns, a prompt's samples) packed as one prefix trie, every shared prefix
            computed once; the loss is unchanged (each row's own advantage, behaviour and proximal
            log-probs, summed over the rows through a shared token). The micro-batch budget
            counts trie tokens. Attention takes a trie mask: the "blocked" formula, or the jnp
            reference flash attention for "auto"/"reference"/"pallas" (no Pallas kernel takes the
            mask: it falls back, logged once). Dense policies, one training process
            (trainer/prefix_tree.py).
    """

    max_tokens_per_microbatch: int = 4096
    row_buckets: tuple[int, ...] = ()
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "save_dots"] = "none"
    scan_layers: bool = True
    attention_impl: Literal["auto", "reference", "pallas", "blocked"] = "auto"
    skip_nonfinite: bool = True
    logit_chunk_tokens: int = DEFAULT_LOGIT_CHUNK_TOKENS
    moe_routing: Literal["recompute", "replay"] = "recompute"
    share_prefixes: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_microbatch", "logit_chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainEngineConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.row_buckets, list):
            object.__setattr__(self, "row_buckets", tuple(self.row_buckets))  # lists from gin become tuples
        if not isinstance(self.row_buckets, tuple):
            raise ValueError(f"TrainEngineConfig.row_buckets must be a tuple of ints, got {self.row_buckets!r}")
        if self.row_buckets and all(isinstance(b, int) for b in self.row_buckets) \
                and max(self.row_buckets) > self.max_tokens_per_microbatch:
            # The budget is per training device since issue 40; a row lives on one device.
            raise ValueError(f"TrainEngineConfig.max_tokens_per_microbatch ({self.max_tokens_per_microbatch}) is "
                             f"smaller than the longest of TrainEngineConfig.row_buckets ({max(self.row_buckets)}): "
                             "the budget is tokens per training device and must hold one row of every bucket")
        if self.row_buckets:  # the check make_microbatches would run at the first step
            try:
                candidate_row_lengths(self.max_tokens_per_microbatch, self.row_buckets)
            except ValueError as e:
                raise ValueError(f"TrainEngineConfig.row_buckets {self.row_buckets}: {e}") from None
        if self.compute_dtype not in COMPUTE_DTYPE_NAMES:
            raise ValueError(f"TrainEngineConfig.compute_dtype must be one of {COMPUTE_DTYPE_NAMES}, "
                             f"got {self.compute_dtype!r}")
        if self.remat not in REMATS:
            raise ValueError(f"TrainEngineConfig.remat must be one of {REMATS}, got {self.remat!r}")
        if self.moe_routing not in ("recompute", "replay"):
            raise ValueError(f"TrainEngineConfig.moe_routing must be 'recompute' or 'replay', got {self.moe_routing!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"TrainEngineConfig.attention_impl must be one of {ATTENTION_IMPLS}, "
                             f"got {self.attention_impl!r}")
        for name in ("scan_layers", "skip_nonfinite", "share_prefixes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TrainEngineConfig.{name} must be a bool, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Objective:
    """The loss the training engine compiles: `fn(logprobs, batch, config) -> (per_token_loss,
    metrics)` (the contract: trainer/objectives.py), called with `config`; the engine takes the
    log-probs at `temperature` (the sampling temperature, so they are of the distribution that
    sampled the tokens). `name` labels it in errors and records."""

    fn: Callable[..., Any]
    config: Any = None
    temperature: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"Objective.fn must be callable, got {type(self.fn).__name__}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
                math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"Objective.temperature must be a finite number > 0, got {self.temperature!r}")

Schedule = Literal["constant", "cosine", "linear"]
SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyperparameters.

    Attributes:
        lr: peak learning rate (paper: Adam 2e-5).
        warmup_steps: linear warmup over this many updates: update s uses lr * (s + 1) / W,
            so the first update already moves the weights.
        schedule: after warmup, "constant", or "cosine"/"linear" decay to lr * min_lr_ratio
            at update `total_steps` (held there afterwards).
        total_steps: total optimizer updates; required by "cosine" and "linear".
        min_lr_ratio: final lr as a fraction of `lr`, in [0, 1].
        weight_decay: decoupled (AdamW) weight decay, applied to every parameter.
        b1, b2, eps: Adam moments and denominator epsilon.
        max_grad_norm: clip the gradient to this global L2 norm; None disables clipping.
    """

    lr: float = 2e-5
    warmup_steps: int = 0
    schedule: Schedule = "constant"
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        for name in ("lr", "min_lr_ratio", "weight_decay", "b1", "b2", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"OptimizerConfig.{name} must be a finite number, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"OptimizerConfig.lr must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimizerConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.total_steps is not None and (
                isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int)
                or self.total_steps <= self.warmup_steps):
            raise ValueError(f"OptimizerConfig.total_steps must be an int > warmup_steps ({self.warmup_steps}), "
                             f"got {self.total_steps!r}")
        if self.schedule != "constant" and self.total_steps is None:
            raise ValueError(f"OptimizerConfig.schedule={self.schedule!r} needs total_steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"OptimizerConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0:
            raise ValueError(f"OptimizerConfig.eps must be > 0, got {self.eps}")
        if self.max_grad_norm is not None and not (
                isinstance(self.max_grad_norm, (int, float)) and not isinstance(self.max_grad_norm, bool)
                and math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
