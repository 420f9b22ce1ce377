"""The compiled programs of a PPO training step, and their ahead-of-time descriptions.

`build_train_programs` jits the four programs `PolicyTrainer` runs: per micro-batch shape a
log-prob forward (proximal / reference log-probs) and a gradient micro-step (loss forward and
backward, gradients and loss stats accumulated), plus one optimizer update and one zeros-like
for the gradient accumulator. `train_program_specs` describes the same programs at a config's
shapes as `aot.ProgramSpec`s (abstract, sharded arguments; nothing allocated), one per shape
`make_microbatches` can produce, for the planner to compile and measure without hardware.

The logits never exist whole for a large micro-batch: the forward stops at the final hidden
states and `ppo.logprobs` takes log-probs and entropy `PPOConfig.logit_chunk_tokens` tokens at a
time, recomputing each chunk's logits in the backward.

Shapes: R rows (of all processes), T row length (a bucket), V vocabulary.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.aot import ProgramSpec, abstract
from areal_jax.models.config import ModelConfig
from areal_jax.models.sharding import TRAIN_RULES, Rules, activation_rules, sharding_for
from areal_jax.models.transformer import ATTENTION_IMPLS, Params, forward, lm_head, param_axes, param_shapes
from areal_jax.ppo import accumulate_loss_stats, decoupled_ppo_loss, loglinear_proximal_logprobs
from areal_jax.ppo.loss import BEHAV_IMP_WEIGHT_MODES, IMPORTANCE_SAMPLING_LEVELS
from areal_jax.ppo.logprobs import DEFAULT_LOGIT_CHUNK_TOKENS, hidden_logprobs, hidden_logprobs_and_entropy
from areal_jax.trainer.batching import candidate_row_lengths, rows_for_bucket
from areal_jax.trainer.optimizer import OptimizerConfig, build_optimizer

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REMATS = ("none", "full", "save_dots")
FORWARD_KEYS = ("input_ids", "targets", "segment_ids", "positions")
LOSS_KEYS = (*FORWARD_KEYS, "loss_mask", "behavior_logprobs", "advantages")
PROXIMAL_KEY = "proximal_logprobs"
# The engine's chosen experts `[R, T, L, k]` (int; MoE policies), replayed when PPOConfig.moe_routing
# is "replay"; the entries of prompt and padding tokens are the engine's prefill choices or zeros.
MOE_ROUTING_KEY = "moe_routing"
# A-3PO: per-token weight of the log-linear proximal approximation (ppo.loglinear_alpha), computed on
# the host from the token versions in place of a proximal forward.
ALPHA_KEY = "proximal_alpha"
PROX_LOGP_METHODS = ("recompute", "loglinear")
# Device dtypes of a micro-batch's arrays (trainer/batching.py packs these; proximal log-probs
# come from the log-prob program).
BATCH_DTYPES = {"input_ids": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32,
                "loss_mask": jnp.float32, "behavior_logprobs": jnp.float32, "advantages": jnp.float32,
                PROXIMAL_KEY: jnp.float32, ALPHA_KEY: jnp.float32}


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
            experts the generation engine chose, batch key MOE_ROUTING_KEY, are used; the router
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
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"PPOConfig.compute_dtype must be one of {tuple(COMPUTE_DTYPES)}, "
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


# ---- layouts -----------------------------------------------------------------------------------------


def param_shardings(cfg: ModelConfig, rules: Rules, mesh: Mesh) -> Any:
    """NamedSharding of every parameter on `mesh` by the rule table."""
    return jax.tree.map(lambda axes, shape: sharding_for(axes, rules, mesh, shape), param_axes(cfg),
                        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Params, shardings: Any, mesh: Mesh) -> Any:
    """Optimizer state shardings: each moment like its parameter, counters replicated."""
    shapes = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(optimizer, lambda _, s: s, shapes, shardings, transform_non_params=lambda _: replicated)


def zero_loss_stats(sharding: NamedSharding | None) -> dict[str, jax.Array]:
    """Zeros for every stat the grad program accumulates (keys taken from decoupled_ppo_loss)."""
    stats = {k: jnp.zeros(s.shape, s.dtype) for k, s in _loss_stats_shapes().items()}
    return stats if sharding is None else jax.device_put(stats, sharding)


def _loss_stats_shapes() -> dict[str, jax.ShapeDtypeStruct]:
    x = jax.ShapeDtypeStruct((1, 1), jnp.float32)
    shapes = dict(jax.eval_shape(lambda a: decoupled_ppo_loss(a, a, a, a, a)[1], x))
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    # MoE models (zeros for dense ones): the load-balancing loss and the busiest expert's load over
    # its fair share, each summed as micro-batch value x valid tokens; assignments dropped (0).
    return {**shapes, "entropy_sum": scalar, "loss": scalar, **{k: scalar for k in MOE_STATS}}


MOE_STATS = ("moe_aux_loss_sum", "moe_load_max_sum", "moe_dropped")


# ---- the programs ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainPrograms:
    """The jitted programs of a training step.

    Attributes:
        logprobs: `(params, batch) -> [R, T]` fp32 log-probs of `batch["targets"]` at the PPO
            temperature; batch holds FORWARD_KEYS.
        grad: `(params, grad_acc, stats_acc, batch, denominator) -> (grad_acc, stats_acc)`: one
            micro-batch's loss gradient (loss divided by `denominator`, the minibatch's valid
            tokens) and stats added to the accumulators; batch holds LOSS_KEYS, plus
            PROXIMAL_KEY, or ALPHA_KEY (A-3PO: pi_prox interpolated from pi_behav and the
            stop-gradient log-probs), or neither: pi_prox is the differentiated weights' own
            (stop-gradient) log-probs. Donates grad_acc.
        update: `(params, opt_state, grads) -> (params, opt_state, grad_norm, finite)`; donates
            params and opt_state; a non-finite gradient leaves both unchanged when
            `skip_nonfinite`.
        zeros_like: `params -> zeros` laid out like params (a fresh gradient accumulator).
    """

    logprobs: Callable
    grad: Callable
    update: Callable
    zeros_like: Callable


def build_train_programs(model_cfg: ModelConfig, ppo_cfg: PPOConfig, optimizer: optax.GradientTransformation, *,
                         param_shardings: Any = None, opt_state_shardings: Any = None,
                         counts: collections.Counter | None = None) -> TrainPrograms:
    """The jitted programs of `PolicyTrainer` (see TrainPrograms).

    param_shardings / opt_state_shardings: the layouts `update` and `zeros_like` return (None:
    wherever the inputs are). counts: incremented per trace of each program ("logprobs", "grad",
    "update"), i.e. per compilation. Activations follow the rules active while tracing
    (`models.sharding.activation_rules`).
    """
    cfg, ppo = model_cfg, ppo_cfg
    counts = collections.Counter() if counts is None else counts
    compute_dtype = COMPUTE_DTYPES[ppo.compute_dtype]

    def replayed(batch):
        """The engine's experts `[L, R, T, k]` to replay, or None (route afresh)."""
        if cfg.moe is None or ppo.moe_routing != "replay":
            return None
        if MOE_ROUTING_KEY not in batch:
            raise ValueError(f"PPOConfig.moe_routing='replay' needs the engine's experts (batch key "
                             f"{MOE_ROUTING_KEY!r}); this batch has none")
        return jnp.moveaxis(batch[MOE_ROUTING_KEY].astype(jnp.int32), 2, 0)

    def hidden_of(params, batch, with_routing=False):
        hidden, _, routing = forward(params, cfg, batch["input_ids"], batch["positions"], batch["segment_ids"],
                                     compute_dtype=compute_dtype, remat=ppo.remat, return_hidden=True,
                                     scan_layers=ppo.scan_layers, attention_impl=ppo.attention_impl,
                                     return_routing=True, moe_routing=replayed(batch))
        head = functools.partial(lm_head, params, cfg)  # [R, T, D], its head -> fp32 logits
        return (hidden, head, routing) if with_routing else (hidden, head)

    def logprobs(params, batch):
        counts["logprobs"] += 1  # runs once per trace, i.e. per compilation
        hidden, head = hidden_of(params, batch)
        return hidden_logprobs(hidden, head, batch["targets"], ppo.logit_temperature, chunk_tokens=ppo.logit_chunk_tokens)

    def grad_step(params, grad_acc, stats_acc, batch, denominator):
        counts["grad"] += 1

        def loss_fn(p):
            hidden, head, routing = hidden_of(p, batch, with_routing=True)
            logp, entropy = hidden_logprobs_and_entropy(hidden, head, batch["targets"], ppo.logit_temperature,
                                                        chunk_tokens=ppo.logit_chunk_tokens)
            if PROXIMAL_KEY in batch:
                prox = batch[PROXIMAL_KEY]
            elif ALPHA_KEY in batch:  # A-3PO
                prox = loglinear_proximal_logprobs(batch["behavior_logprobs"], logp, batch[ALPHA_KEY])
            else:  # pi_prox = the weights being differentiated
                prox = jax.lax.stop_gradient(logp)
            loss, stats = decoupled_ppo_loss(
                logp, prox, batch["behavior_logprobs"], batch["advantages"],
                batch["loss_mask"], eps_clip=ppo.eps_clip, eps_clip_higher=ppo.eps_clip_higher,
                behav_imp_weight_cap=ppo.behav_imp_weight_cap, denominator=denominator, c_clip=ppo.c_clip,
                behav_imp_weight_mode=ppo.behav_imp_weight_mode,
                importance_sampling_level=ppo.importance_sampling_level, segment_ids=batch["segment_ids"])
            stats["entropy_sum"] = jnp.sum(jnp.where(batch["loss_mask"] > 0, entropy, 0.0))
            stats.update({k: jnp.zeros((), jnp.float32) for k in MOE_STATS})
            if routing is not None:
                # The micro-batch's aux loss weighted by its share of the minibatch's tokens, so
                # the minibatch's total is their token-weighted mean.
                tokens = jnp.sum(batch["loss_mask"] > 0).astype(jnp.float32)
                loss = loss + cfg.moe.router_aux_loss_coef * routing.aux_loss * tokens / denominator
                stats.update(moe_aux_loss_sum=jax.lax.stop_gradient(routing.aux_loss) * tokens,
                             moe_load_max_sum=routing.load_max * tokens,
                             moe_dropped=routing.dropped.astype(jnp.float32))
            stats["loss"] = jax.lax.stop_gradient(loss)
            return loss, stats

        (_, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grad_acc = jax.tree.map(jnp.add, grad_acc, grads)
        return grad_acc, accumulate_loss_stats(stats_acc, stats)

    def update(params, opt_state, grads):
        counts["update"] += 1
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, new_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if ppo.skip_nonfinite:
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_params = jax.tree.map(keep, new_params, params)
            new_state = jax.tree.map(keep, new_state, opt_state)
        return new_params, new_state, grad_norm, finite

    placed = param_shardings is not None
    return TrainPrograms(
        logprobs=jax.jit(logprobs),
        grad=jax.jit(grad_step, donate_argnums=(1,)),  # stats are scalars: not worth donating
        update=jax.jit(update, donate_argnums=(0, 1),
                       out_shardings=(param_shardings, opt_state_shardings, None, None) if placed else None),
        zeros_like=jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=param_shardings),
    )


# ---- ahead-of-time descriptions ----------------------------------------------------------------------------

# Config fields that size the train mesh (fsdp = training devices / train_tensor).
_MESH_FIELDS = ("MeshConfig.train_tensor", "MeshConfig.generation_fraction",
                "MeshConfig.num_generation_devices_per_host")
_MICROBATCH_FIELDS = ("PPOConfig.max_tokens_per_microbatch", "PPOConfig.row_buckets")
_ACTIVATION_FIELDS = ("PPOConfig.logit_chunk_tokens", "PPOConfig.remat", "PPOConfig.compute_dtype",
                      "PPOConfig.scan_layers", "PPOConfig.attention_impl")


def microbatch_shapes(ppo_cfg: PPOConfig, fsdp: int, num_processes: int = 1) -> list[tuple[int, int]]:
    """(R, T) of the largest micro-batch of each row length `make_microbatches` can produce.

    R counts the rows of every process: each packs up to `rows_for_bucket(T)` rows, a multiple
    of its share of the "fsdp" axis (what `RLLoop` passes as row_multiple), and the trainer
    stacks the processes' rows into one global array."""
    row_multiple = max(fsdp // num_processes, 1)
    budget = ppo_cfg.max_tokens_per_microbatch
    return [(rows_for_bucket(T, budget, row_multiple) * num_processes, T)
            for T in candidate_row_lengths(budget, ppo_cfg.row_buckets or None)]


def self_proximal(ppo_cfg: PPOConfig) -> bool:
    """Whether a step's gradient program takes pi_prox from its own forward (one decoupled update
    per step: PolicyTrainer.train_step) instead of a `proximal_logprobs` input."""
    return ppo_cfg.decoupled and ppo_cfg.num_minibatches == 1


def proximal_input_key(ppo_cfg: PPOConfig) -> str:
    """The grad program's pi_prox input when the step has several minibatches: the recomputed
    log-probs, or A-3PO's interpolation weights."""
    return ALPHA_KEY if ppo_cfg.decoupled and ppo_cfg.prox_logp_method == "loglinear" else PROXIMAL_KEY


def train_program_specs(model_cfg: ModelConfig, ppo_cfg: PPOConfig, opt_cfg: OptimizerConfig, mesh: Mesh, *,
                        rules: Rules = TRAIN_RULES, num_processes: int = 1) -> list[ProgramSpec]:
    """Every program a training step runs at this config's shapes, on the train mesh `mesh`.

    Per row length T (`microbatch_shapes`, each at its largest row count, which bounds its
    memory): "train/grad[rows=R,len=T]" and "train/logprobs[rows=R,len=T]"; then "train/update"
    and "train/zeros_like". Arguments are ShapeDtypeStructs sharded as PolicyTrainer places
    them: fp32 params and optimizer state by the rule table, batch rows over "fsdp". The
    optimizer state is resident during every micro-batch program. The grad program takes
    `proximal_logprobs` unless `self_proximal(ppo_cfg)`; with one minibatch and the KL penalty
    on, the run also compiles the other variant (one `[R, T]` input more or less).

    num_processes: processes sharing the train mesh (rows per micro-batch scale with it).
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    optimizer = build_optimizer(opt_cfg)
    p_sh = param_shardings(model_cfg, rules, mesh)
    params = jax.tree.map(lambda shape, s: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s),
                          param_shapes(model_cfg), p_sh, is_leaf=lambda x: isinstance(x, tuple))
    s_sh = opt_state_shardings(optimizer, params, p_sh, mesh)
    opt_state = abstract(jax.eval_shape(optimizer.init, params), s_sh)
    programs = build_train_programs(model_cfg, ppo_cfg, optimizer, param_shardings=p_sh, opt_state_shardings=s_sh)
    replicated = NamedSharding(mesh, PartitionSpec())
    stats = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), _loss_stats_shapes())
    denominator = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    context = functools.partial(activation_rules, rules, mesh)
    grad_keys = LOSS_KEYS if self_proximal(ppo_cfg) else (*LOSS_KEYS, proximal_input_key(ppo_cfg))
    micro_fields = (*_MICROBATCH_FIELDS, *_ACTIVATION_FIELDS, *_MESH_FIELDS)

    specs = []
    for R, T in microbatch_shapes(ppo_cfg, mesh.shape.get("fsdp", 1), num_processes):
        rows = sharding_for(("batch", "seq"), rules, mesh, (R, T))
        batch = lambda keys: {k: jax.ShapeDtypeStruct((R, T), BATCH_DTYPES[k], sharding=rows)  # noqa: E731
                              for k in keys}
        specs.append(ProgramSpec(f"train/grad[rows={R},len={T}]", "train", programs.grad,
                                 args=(params, params, stats, batch(grad_keys), denominator),
                                 resident=(opt_state,), context=context, fields=micro_fields))
        specs.append(ProgramSpec(f"train/logprobs[rows={R},len={T}]", "train", programs.logprobs,
                                 args=(params, batch(FORWARD_KEYS)), resident=(opt_state,), context=context,
                                 fields=micro_fields))
    specs.append(ProgramSpec("train/update", "train", programs.update, args=(params, opt_state, params),
                             context=context, fields=_MESH_FIELDS))
    specs.append(ProgramSpec("train/zeros_like", "train", programs.zeros_like, args=(params,),
                             resident=(opt_state,), context=context, fields=_MESH_FIELDS))
    return specs

