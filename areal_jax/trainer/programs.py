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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.aot import ProgramSpec, abstract
from areal_jax.models import moe
from areal_jax.models.config import ModelConfig
from areal_jax.models.lora import (
    LoRAConfig,
    adapter_axes,
    adapter_shapes,
    attach,
    join_trainable,
    split_trainable,
    with_dropout,
)
from areal_jax.models.sharding import TRAIN_RULES, Rules, activation_rules, sharding_for
from areal_jax.models.transformer import Params, forward, lm_head, param_axes, param_shapes
from areal_jax.ppo import accumulate_loss_stats, decoupled_ppo_loss, loglinear_proximal_logprobs
from areal_jax.ppo.logprobs import hidden_logprobs, hidden_logprobs_and_entropy
from areal_jax.trainer.batching import candidate_row_lengths, rows_for_bucket
from areal_jax.trainer.config import PPOConfig
from areal_jax.trainer.optimizer import OptimizerConfig, build_optimizer
from areal_jax.parallel.meshes import batch_shards

# The device dtypes of PPOConfig.compute_dtype (trainer/config.py names them).
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
FORWARD_KEYS = ("input_ids", "targets", "segment_ids", "positions")
LOSS_KEYS = (*FORWARD_KEYS, "loss_mask", "behavior_logprobs", "advantages")
PROXIMAL_KEY = "proximal_logprobs"
# `[R, T]` 1.0 where a token's version is the trainer's (lag 0), else 0.0; optional (train_step adds
# it when it knows the version): the engine-vs-trainer log-prob gap of the same weights.
FRESH_KEY = "fresh"
# The engine's chosen experts `[R, T, L_moe, k]` (sparse layers, uint8/uint16; MoE policies), replayed
# when PPOConfig.moe_routing is "replay"; prompt tokens carry the engine's prefill choices, padding zeros.
MOE_ROUTING_KEY = "moe_routing"
# A-3PO: per-token weight of the log-linear proximal approximation (ppo.loglinear_alpha), computed on
# the host from the token versions in place of a proximal forward.
ALPHA_KEY = "proximal_alpha"
# Device dtypes of a micro-batch's arrays (trainer/batching.py packs these; proximal log-probs
# come from the log-prob program).
BATCH_DTYPES = {"input_ids": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32,
                "loss_mask": jnp.float32, "behavior_logprobs": jnp.float32, "advantages": jnp.float32,
                PROXIMAL_KEY: jnp.float32, ALPHA_KEY: jnp.float32}


# ---- layouts -----------------------------------------------------------------------------------------


def param_shardings(cfg: ModelConfig, rules: Rules, mesh: Mesh, lora: LoRAConfig | None = None) -> Any:
    """NamedSharding of every parameter (and adapter, with LoRA) on `mesh` by the rule table."""
    axes, shapes = param_axes(cfg), param_shapes(cfg)
    if lora is not None and lora.enabled:
        axes = attach(axes, adapter_axes(cfg, lora))
        shapes = attach(shapes, adapter_shapes(cfg, lora))
    return jax.tree.map(lambda a, shape: sharding_for(a, rules, mesh, shape), axes, shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


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
    # its fair share, each summed as micro-batch value x valid tokens; assignments dropped (0);
    # (valid token, sparse layer) pairs whose own top-k set differs from the engine's record, and
    # how many pairs were compared (0 without a record). behav_logp_gap_sum: sum over valid tokens
    # of |log pi_behav - log pi_theta| (this forward's log-probs); fresh_logp_gap_sum / n_fresh:
    # the same over the valid tokens FRESH_KEY marks (sampled by the weights being trained), and
    # their count (0 without the key).
    return {**shapes, "entropy_sum": scalar, "loss": scalar, "behav_logp_gap_sum": scalar,
            "fresh_logp_gap_sum": scalar, "n_fresh": scalar,
            **{k: scalar for k in MOE_STATS}}


MOE_STATS = ("moe_aux_loss_sum", "moe_load_max_sum", "moe_dropped", "moe_route_mismatched", "moe_route_pairs")


# ---- the programs ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainPrograms:
    """The jitted programs of a training step.

    Attributes:
        logprobs: `(params, batch) -> [R, T]` fp32 log-probs of `batch["targets"]` at the PPO
            temperature; batch holds FORWARD_KEYS.
        grad: `(params, grad_acc, stats_acc, batch, denominator[, dropout_index]) -> (grad_acc,
            stats_acc)`: one micro-batch's loss gradient (loss divided by `denominator`, the
            minibatch's valid tokens) and stats added to the accumulators; batch holds LOSS_KEYS,
            plus PROXIMAL_KEY, or ALPHA_KEY (A-3PO: pi_prox interpolated from pi_behav and the
            stop-gradient log-probs), or neither: pi_prox is the differentiated weights' own
            (stop-gradient) log-probs. Donates grad_acc. With LoRA dropout, `dropout_index`
            (uint32 [3]: step, minibatch, micro-batch) picks the masks (`dropout_key`).
        update: `(params, opt_state, grads) -> (params, opt_state, grad_norm, finite)`; donates
            params and opt_state; a non-finite gradient leaves both unchanged when
            `skip_nonfinite`. With LoRA adapters, `params` here is the trainable part only
            (`models.lora.split_trainable`), as are the gradients `grad` accumulates.
        zeros_like: `params -> zeros` laid out like params (a fresh gradient accumulator; the
            trainable part with LoRA).
    """

    logprobs: Callable
    grad: Callable
    update: Callable
    zeros_like: Callable


def dropout_key(seed: int, index: jax.Array) -> jax.Array:
    """The LoRA dropout key of one micro-batch: `LoRAConfig.seed` folded with (step, minibatch,
    micro-batch), so a resumed run (same step counter) draws the same masks."""
    key = jax.random.key(seed)
    for i in range(3):
        key = jax.random.fold_in(key, index[i])
    return key


def build_train_programs(model_cfg: ModelConfig, ppo_cfg: PPOConfig, optimizer: optax.GradientTransformation, *,
                         param_shardings: Any = None, opt_state_shardings: Any = None,
                         counts: collections.Counter | None = None, lora: LoRAConfig | None = None) -> TrainPrograms:
    """The jitted programs of `PolicyTrainer` (see TrainPrograms).

    param_shardings / opt_state_shardings: the layouts `update` and `zeros_like` return (None:
    wherever the inputs are). counts: incremented per trace of each program ("logprobs", "grad",
    "update"), i.e. per compilation. Activations follow the rules active while tracing
    (`models.sharding.activation_rules`). lora: its `dropout` (and `seed`) drive the loss
    forward's adapter dropout; nothing else of it matters here (the params carry the adapters).
    """
    cfg, ppo = model_cfg, ppo_cfg
    dropout = lora.dropout if lora is not None and lora.enabled else 0.0
    counts = collections.Counter() if counts is None else counts
    compute_dtype = COMPUTE_DTYPES[ppo.compute_dtype]

    def replayed(batch):
        """The engine's experts `[L, R, T, k]` to replay, or None (route afresh)."""
        if cfg.moe is None or ppo.moe_routing != "replay":
            return None
        if MOE_ROUTING_KEY not in batch:
            raise ValueError(f"PPOConfig.moe_routing='replay' needs the engine's experts (batch key "
                             f"{MOE_ROUTING_KEY!r}); this batch has none")
        return moe.replay_layers(cfg, batch[MOE_ROUTING_KEY])

    def hidden_of(params, batch, with_routing=False):
        hidden, _, routing = forward(params, cfg, batch["input_ids"], batch["positions"], batch["segment_ids"],
                                     compute_dtype=compute_dtype, remat=ppo.remat, return_hidden=True,
                                     scan_layers=ppo.scan_layers, attention_impl=ppo.attention_impl,
                                     return_routing=True, moe_routing=replayed(batch))
        head = functools.partial(lm_head, params, cfg)  # [R, T, D], its head -> fp32 logits
        return (hidden, head, routing) if with_routing else (hidden, head)

    def policy_logprobs(params, batch):
        hidden, head = hidden_of(params, batch)
        return hidden_logprobs(hidden, head, batch["targets"], ppo.logit_temperature, chunk_tokens=ppo.logit_chunk_tokens)

    def logprobs(params, batch):
        counts["logprobs"] += 1  # runs once per trace, i.e. per compilation
        return policy_logprobs(params, batch)

    def grad_step(params, grad_acc, stats_acc, batch, denominator, dropout_index=None):
        counts["grad"] += 1
        if dropout and dropout_index is None:
            raise ValueError(f"LoRAConfig.dropout = {dropout}: the grad program needs dropout_index")

        def loss_fn(p):
            # Adapter dropout acts in this forward only, the one differentiated. Every log-prob
            # the objective compares against (behaviour from the engine, proximal from the
            # log-prob program or below) is the policy's own deterministic one: a dropped
            # forward is a random perturbation of the policy, not the policy that sampled or
            # will sample, so importance ratios against it would measure the noise.
            dropped = with_dropout(p, dropout_key(lora.seed, dropout_index), dropout) if dropout else p
            hidden, head, routing = hidden_of(dropped, batch, with_routing=True)
            logp, entropy = hidden_logprobs_and_entropy(hidden, head, batch["targets"], ppo.logit_temperature,
                                                        chunk_tokens=ppo.logit_chunk_tokens)
            # The differentiated weights' own log-probs as pi_prox: with dropout a deterministic
            # forward of its own (no gradient flows through it), else the loss forward's.
            own = lambda: (jax.lax.stop_gradient(policy_logprobs(jax.lax.stop_gradient(p), batch))  # noqa: E731
                           if dropout else logp)
            if PROXIMAL_KEY in batch:
                prox = batch[PROXIMAL_KEY]
            elif ALPHA_KEY in batch:  # A-3PO
                prox = loglinear_proximal_logprobs(batch["behavior_logprobs"], own(), batch[ALPHA_KEY])
            else:  # pi_prox = the weights being differentiated
                prox = jax.lax.stop_gradient(own())
            loss, stats = decoupled_ppo_loss(
                logp, prox, batch["behavior_logprobs"], batch["advantages"],
                batch["loss_mask"], eps_clip=ppo.eps_clip, eps_clip_higher=ppo.eps_clip_higher,
                behav_imp_weight_cap=ppo.behav_imp_weight_cap, denominator=denominator, c_clip=ppo.c_clip,
                behav_imp_weight_mode=ppo.behav_imp_weight_mode,
                importance_sampling_level=ppo.importance_sampling_level, segment_ids=batch["segment_ids"])
            valid = batch["loss_mask"] > 0
            stats["entropy_sum"] = jnp.sum(jnp.where(valid, entropy, 0.0))
            gap = jnp.abs(batch["behavior_logprobs"].astype(jnp.float32) - jax.lax.stop_gradient(logp))
            stats["behav_logp_gap_sum"] = jnp.sum(jnp.where(valid, gap, 0.0))
            fresh = valid & (batch[FRESH_KEY] > 0) if FRESH_KEY in batch else jnp.zeros_like(valid)
            stats["fresh_logp_gap_sum"] = jnp.sum(jnp.where(fresh, gap, 0.0))
            stats["n_fresh"] = jnp.sum(fresh).astype(jnp.float32)
            stats.update({k: jnp.zeros((), jnp.float32) for k in MOE_STATS})
            if routing is not None:
                # The micro-batch's aux loss weighted by its share of the minibatch's tokens, so
                # the minibatch's total is their token-weighted mean.
                tokens = jnp.sum(batch["loss_mask"] > 0).astype(jnp.float32)
                loss = loss + cfg.moe.router_aux_loss_coef * routing.aux_loss * tokens / denominator
                stats.update(moe_aux_loss_sum=jax.lax.stop_gradient(routing.aux_loss) * tokens,
                             moe_load_max_sum=routing.load_max * tokens,
                             moe_dropped=routing.dropped.astype(jnp.float32))
                if MOE_ROUTING_KEY in batch:  # the trainer's own top-k against the engine's (either mode)
                    stats.update(moe_route_mismatched=moe.mismatched(cfg, routing.own, batch[MOE_ROUTING_KEY],
                                                                     valid).astype(jnp.float32),
                                 moe_route_pairs=tokens * len(moe.sparse_layer_ids(cfg)))
            stats["loss"] = jax.lax.stop_gradient(loss)
            return loss, stats

        # LoRA: only the adapters' a and b are differentiated (models/lora.py); else every weight.
        frozen, trainable = split_trainable(params)
        (_, stats), grads = jax.value_and_grad(lambda t: loss_fn(join_trainable(frozen, t)), has_aux=True)(trainable)
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

# Config fields that size the train mesh (fsdp = training devices / (train_expert x train_tensor)).
_MESH_FIELDS = ("MeshConfig.train_tensor", "MeshConfig.train_expert", "MeshConfig.generation_fraction",
                "MeshConfig.num_generation_devices_per_host")
_MICROBATCH_FIELDS = ("PPOConfig.max_tokens_per_microbatch", "PPOConfig.row_buckets")
_ACTIVATION_FIELDS = ("PPOConfig.logit_chunk_tokens", "PPOConfig.remat", "PPOConfig.compute_dtype",
                      "PPOConfig.scan_layers", "PPOConfig.attention_impl")


def possible_microbatch_shapes(ppo_cfg: PPOConfig, fsdp: int, num_processes: int = 1) -> list[tuple[int, int]]:
    """(R, T) of the largest micro-batch of each row length `make_microbatches` can produce.

    R counts the rows of every process: each packs up to `rows_for_bucket(T)` rows, budget // T
    (at least one) for each device of its share of the "fsdp" axis (what `RLLoop` passes as
    row_multiple: the budget is per training device), and the trainer stacks the processes' rows
    into one global array."""
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
                        rules: Rules = TRAIN_RULES, num_processes: int = 1, lora: LoRAConfig | None = None
                        ) -> list[ProgramSpec]:
    """Every program a training step runs at this config's shapes, on the train mesh `mesh`.

    Per row length T (`possible_microbatch_shapes`, each at its largest row count, which bounds its
    memory): "train/grad[rows=R,len=T]" and "train/logprobs[rows=R,len=T]"; then "train/update"
    and "train/zeros_like". Arguments are ShapeDtypeStructs sharded as PolicyTrainer places
    them: fp32 params and optimizer state by the rule table, batch rows over "fsdp". The
    optimizer state is resident during every micro-batch program. The grad program takes
    `proximal_logprobs` unless `self_proximal(ppo_cfg)`; with one minibatch and the KL penalty
    on, the run also compiles the other variant (one `[R, T]` input more or less).

    num_processes: processes sharing the train mesh (rows per micro-batch scale with it).
    lora: with rank > 0, the weights are the frozen base in `lora.base_dtype` plus fp32 adapters,
    and gradients, optimizer state and the update cover the adapters alone (as PolicyTrainer).
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    optimizer = build_optimizer(opt_cfg)
    lora = LoRAConfig() if lora is None else lora
    p_sh = param_shardings(model_cfg, rules, mesh, lora)
    shapes = param_shapes(model_cfg)
    base_dtype = COMPUTE_DTYPES[lora.base_dtype] if lora.enabled else jnp.float32
    dtypes = jax.tree.map(lambda _: base_dtype, shapes, is_leaf=lambda x: isinstance(x, tuple))
    if lora.enabled:
        shapes = attach(shapes, adapter_shapes(model_cfg, lora))
        dtypes = attach(dtypes, jax.tree.map(lambda _: jnp.float32, adapter_shapes(model_cfg, lora),
                                             is_leaf=lambda x: isinstance(x, tuple)))
    params = jax.tree.map(lambda shape, d, s: jax.ShapeDtypeStruct(shape, d, sharding=s), shapes, dtypes, p_sh,
                          is_leaf=lambda x: isinstance(x, tuple))
    trainable, t_sh = split_trainable(params)[1], split_trainable(p_sh)[1]
    s_sh = opt_state_shardings(optimizer, trainable, t_sh, mesh)
    opt_state = abstract(jax.eval_shape(optimizer.init, trainable), s_sh)
    programs = build_train_programs(model_cfg, ppo_cfg, optimizer, param_shardings=t_sh, opt_state_shardings=s_sh,
                                    lora=lora)
    replicated = NamedSharding(mesh, PartitionSpec())
    # LoRA dropout: the micro-batch's (step, minibatch, micro-batch) that seeds its masks.
    dropout_index = ((jax.ShapeDtypeStruct((3,), jnp.uint32, sharding=replicated),)
                     if lora.enabled and lora.dropout else ())
    stats = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), _loss_stats_shapes())
    denominator = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    context = functools.partial(activation_rules, rules, mesh)
    grad_keys = LOSS_KEYS if self_proximal(ppo_cfg) else (*LOSS_KEYS, proximal_input_key(ppo_cfg))
    micro_fields = (*_MICROBATCH_FIELDS, *_ACTIVATION_FIELDS, *_MESH_FIELDS)
    replays = model_cfg.moe is not None and ppo_cfg.moe_routing == "replay"

    specs = []
    for R, T in possible_microbatch_shapes(ppo_cfg, batch_shards(mesh), num_processes):
        rows = sharding_for(("batch", "seq"), rules, mesh, (R, T))
        batch = lambda keys: {k: jax.ShapeDtypeStruct((R, T), BATCH_DTYPES[k], sharding=rows)  # noqa: E731
                              for k in keys}
        grad_batch = batch(grad_keys)
        if model_cfg.moe is not None:  # the engine's record `[R, T, L_moe, k]`: the loss forward compares
            # it with its own routing (RL batches carry it); with replay every forward replays it
            record = jax.ShapeDtypeStruct((R, T, len(moe.sparse_layer_ids(model_cfg)), model_cfg.moe.num_experts_per_tok),
                                          moe.record_dtype(model_cfg), sharding=rows)
            grad_batch = {**grad_batch, MOE_ROUTING_KEY: record}
            if replays:
                batch = functools.partial(lambda plain, keys: {**plain(keys), MOE_ROUTING_KEY: record}, batch)
        specs.append(ProgramSpec(f"train/grad[rows={R},len={T}]", "train", programs.grad,
                                 args=(params, trainable, stats, grad_batch, denominator, *dropout_index),
                                 resident=(opt_state,), context=context, fields=micro_fields))
        specs.append(ProgramSpec(f"train/logprobs[rows={R},len={T}]", "train", programs.logprobs,
                                 args=(params, batch(FORWARD_KEYS)), resident=(opt_state,), context=context,
                                 fields=micro_fields))
    # With LoRA the frozen base stays resident beside the adapters' update.
    frozen = () if split_trainable(params)[0] is None else (split_trainable(params)[0],)
    specs.append(ProgramSpec("train/update", "train", programs.update, args=(trainable, opt_state, trainable),
                             resident=frozen, context=context, fields=_MESH_FIELDS))
    specs.append(ProgramSpec("train/zeros_like", "train", programs.zeros_like, args=(trainable,),
                             resident=(opt_state, *frozen), context=context, fields=_MESH_FIELDS))
    return specs

