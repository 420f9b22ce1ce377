"""The compiled programs of a training step, and their ahead-of-time descriptions.

`build_train_programs` jits the four programs `JaxTrainEngine` runs: per micro-batch shape a
log-prob forward (proximal / reference log-probs) and a gradient micro-step (loss forward and
backward, gradients and the objective's metrics accumulated), plus one optimizer update and one
zeros-like for the gradient accumulator. The loss is the `Objective` the engine is given
(trainer/objectives.py states the contract): the engine masks its per-token values, divides by the
minibatch's valid tokens and knows nothing of the algorithm behind it. `train_program_specs` describes the same programs at a config's
shapes as `aot.ProgramSpec`s (abstract, sharded arguments; nothing allocated), one per shape
`make_microbatches` can produce, for the planner to compile and measure without hardware.

The logits never exist whole for a large micro-batch: the forward stops at the final hidden
states and `ppo.logprobs` takes log-probs and entropy `TrainEngineConfig.logit_chunk_tokens` tokens at a
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
from areal_jax.ppo.logprobs import hidden_logprobs, hidden_logprobs_and_entropy
from areal_jax.trainer.batching import candidate_row_lengths, rows_for_bucket
from areal_jax.trainer.engine_config import Objective, TrainEngineConfig
from areal_jax.trainer.optimizer import OptimizerConfig, build_optimizer
from areal_jax.trainer.prefix_tree import TREE_INDEX_KEY, TREE_KEYS
from areal_jax.parallel.meshes import batch_shards

# The device dtypes of TrainEngineConfig.compute_dtype (trainer/engine_config.py names them).
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
FORWARD_KEYS = ("input_ids", "targets", "segment_ids", "positions")
# What every objective may read (trainer/objectives.py); PROXIMAL_KEY is filled in where absent.
LOSS_KEYS = (*FORWARD_KEYS, "loss_mask", "behavior_logprobs", "advantages", "versions")
PROXIMAL_KEY = "proximal_logprobs"
# `[R, T]` 1.0 where a token's version is the one being trained (lag 0), else 0.0; optional (the
# algorithm adds it: it knows the version): the engine-vs-trainer log-prob gap of the same weights.
FRESH_KEY = "fresh"
# The engine's chosen experts `[R, T, L_moe, k]` (sparse layers, uint8/uint16; MoE policies), replayed
# when TrainEngineConfig.moe_routing is "replay"; prompt tokens carry the engine's prefill choices, padding zeros.
MOE_ROUTING_KEY = "moe_routing"
# Device dtypes of a micro-batch's arrays (trainer/batching.py packs these; proximal log-probs
# come from the log-prob program). Other `[R, T]` keys an algorithm adds travel as float32.
BATCH_DTYPES = {"input_ids": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32,
                "loss_mask": jnp.float32, "behavior_logprobs": jnp.float32, "advantages": jnp.float32,
                "versions": jnp.int32, PROXIMAL_KEY: jnp.float32,
                **{k: jnp.int32 for k in TREE_KEYS}}


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


def zero_loss_stats(objective: Objective, sharding: NamedSharding | None) -> dict[str, jax.Array]:
    """Zeros for every stat the grad program accumulates (the objective's metrics and the engine's)."""
    stats = {k: jnp.zeros(s.shape, s.dtype) for k, s in loss_stats_shapes(objective).items()}
    return stats if sharding is None else jax.device_put(stats, sharding)


def loss_stats_shapes(objective: Objective, batch_keys=LOSS_KEYS) -> dict[str, jax.ShapeDtypeStruct]:
    """The accumulated stats: per objective metric, its sum over valid tokens (`[K]` for a per-token
    vector; a "_max" metric's max), plus the engine's own (ENGINE_STATS)."""
    x = jax.ShapeDtypeStruct((1, 1), jnp.float32)
    batch = {k: jax.ShapeDtypeStruct((1, 1), BATCH_DTYPES.get(k, jnp.float32)) for k in (*batch_keys, PROXIMAL_KEY)}
    _, metrics = jax.eval_shape(lambda lp, b: objective.fn(lp, b, objective.config), x, batch)
    clashes = sorted(set(metrics) & set(ENGINE_STATS))
    if clashes:
        raise ValueError(f"objective {objective.name or objective.fn.__name__}: metric names {clashes} are the "
                         "engine's own; rename them")
    for name, m in metrics.items():
        if m.ndim not in (2, 3) or m.shape[:2] != (1, 1):
            raise ValueError(f"objective {objective.name or objective.fn.__name__}: metric {name!r} must be per "
                             f"token, [R, T] or [R, T, K], like logprobs; got shape {m.shape} for [1, 1] logprobs")
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    return {**{k: jax.ShapeDtypeStruct(m.shape[2:], jnp.float32) for k, m in metrics.items()},
            **{k: scalar for k in ENGINE_STATS}}


# The engine's own sums over a micro-batch. n_valid: loss-mask tokens; loss: the minibatch loss
# (micro-batch shares summed); entropy_sum; behav_logp_gap_sum: |log pi_behav - log pi_theta| over
# valid tokens (this forward's log-probs); fresh_logp_gap_sum / n_fresh: the same over the valid
# tokens FRESH_KEY marks (sampled by the weights being trained), and their count (0 without the
# key); MoE models (zeros for dense ones): the load-balancing loss and the busiest expert's load
# over its fair share, each summed as micro-batch value x valid tokens; assignments dropped (0);
# (valid token, sparse layer) pairs whose own top-k set differs from the engine's record, and how
# many pairs were compared (0 without a record).
MOE_STATS = ("moe_aux_loss_sum", "moe_load_max_sum", "moe_dropped", "moe_route_mismatched", "moe_route_pairs")
ENGINE_STATS = ("n_valid", "loss", "entropy_sum", "behav_logp_gap_sum", "fresh_logp_gap_sum", "n_fresh",
                *MOE_STATS)


def accumulate_stats(total: dict[str, jax.Array], new: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Two micro-batches' stats combined: sums add, "_max" metrics take the max."""
    return {k: jnp.maximum(total[k], new[k]) if k.endswith("_max") else total[k] + new[k] for k in total}


# ---- the programs ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainPrograms:
    """The jitted programs of a training step.

    Attributes:
        logprobs: `(params, batch) -> [R, T]` fp32 log-probs of `batch["targets"]` at the
            objective's temperature; batch holds FORWARD_KEYS.
        grad: `(params, grad_acc, stats_acc, batch, denominator[, dropout_index]) -> (grad_acc,
            stats_acc)`: one micro-batch's gradient of the objective's loss (its per-token values
            summed over the loss mask, divided by `denominator`, the minibatch's valid tokens) and
            stats added to the accumulators (`loss_stats_shapes`); batch holds LOSS_KEYS and what
            the algorithm added (PROXIMAL_KEY, where absent, becomes the differentiated weights'
            own stop-gradient log-probs). Donates grad_acc. With LoRA dropout, `dropout_index`
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


def build_train_programs(model_cfg: ModelConfig, engine_cfg: TrainEngineConfig, objective: Objective,
                         optimizer: optax.GradientTransformation, *,
                         param_shardings: Any = None, opt_state_shardings: Any = None,
                         counts: collections.Counter | None = None, lora: LoRAConfig | None = None) -> TrainPrograms:
    """The jitted programs of `JaxTrainEngine` (see TrainPrograms).

    param_shardings / opt_state_shardings: the layouts `update` and `zeros_like` return (None:
    wherever the inputs are). counts: incremented per trace of each program ("logprobs", "grad",
    "update"), i.e. per compilation. Activations follow the rules active while tracing
    (`models.sharding.activation_rules`). lora: its `dropout` (and `seed`) drive the loss
    forward's adapter dropout; nothing else of it matters here (the params carry the adapters).
    """
    cfg, engine, temperature = model_cfg, engine_cfg, objective.temperature
    dropout = lora.dropout if lora is not None and lora.enabled else 0.0
    counts = collections.Counter() if counts is None else counts
    compute_dtype = COMPUTE_DTYPES[engine.compute_dtype]

    def replayed(batch):
        """The engine's experts `[L, R, T, k]` to replay, or None (route afresh)."""
        if cfg.moe is None or engine.moe_routing != "replay":
            return None
        if MOE_ROUTING_KEY not in batch:
            raise ValueError(f"TrainEngineConfig.moe_routing='replay' needs the engine's experts (batch key "
                             f"{MOE_ROUTING_KEY!r}); this batch has none")
        return moe.replay_layers(cfg, batch[MOE_ROUTING_KEY])

    def hidden_of(params, batch, with_routing=False):
        # A shared-prefix batch (trainer/prefix_tree.py) runs the forward on its trie rows.
        tree = "tree_" if TREE_INDEX_KEY in batch else ""
        hidden, _, routing = forward(params, cfg, batch[tree + "input_ids"], batch[tree + "positions"],
                                     batch[tree + "segment_ids"],
                                     compute_dtype=compute_dtype, remat=engine.remat, return_hidden=True,
                                     scan_layers=engine.scan_layers, attention_impl=engine.attention_impl,
                                     return_routing=True, moe_routing=replayed(batch),
                                     key_ends=batch.get("tree_key_ends"))
        head = functools.partial(lm_head, params, cfg)  # [R, T, D], its head -> fp32 logits
        return (hidden, head, routing) if with_routing else (hidden, head)

    def target_logprobs(hidden, head, batch, entropy=False):
        """Log-probs of batch["targets"] `[R, T]` (and the entropy with `entropy`). A shared-prefix
        batch takes them once per trie node (its token from its parent's hidden state) and gathers
        them onto the plain rows, whose loss then runs as for plain packing; the gather's gradient
        adds every row's term onto the shared node."""
        take = hidden_logprobs_and_entropy if entropy else hidden_logprobs
        if TREE_INDEX_KEY not in batch:
            return take(hidden, head, batch["targets"], temperature, chunk_tokens=engine.logit_chunk_tokens)
        R, T, D = hidden.shape
        parents = hidden.reshape(R * T, D)[batch["tree_sources"].reshape(-1)].reshape(R, T, D)
        out = take(parents, head, batch["tree_input_ids"], temperature, chunk_tokens=engine.logit_chunk_tokens)
        gather = lambda x: x.reshape(-1)[batch[TREE_INDEX_KEY]]  # noqa: E731  [R_plain, T_plain]
        return tuple(map(gather, out)) if entropy else gather(out)

    def policy_logprobs(params, batch):
        hidden, head = hidden_of(params, batch)
        return target_logprobs(hidden, head, batch)

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
            logp, entropy = target_logprobs(hidden, head, batch, entropy=True)
            inputs = {k: v for k, v in batch.items() if k != MOE_ROUTING_KEY and k not in TREE_KEYS}
            if PROXIMAL_KEY not in inputs:  # the weights' own log-probs before this update, no gradient:
                # with dropout a deterministic forward of its own, else the loss forward's
                inputs[PROXIMAL_KEY] = jax.lax.stop_gradient(
                    policy_logprobs(jax.lax.stop_gradient(p), batch) if dropout else logp)
            per_token, metrics = objective.fn(logp, inputs, objective.config)
            valid = batch["loss_mask"] > 0
            loss_sum = jnp.sum(jnp.where(valid, per_token, 0.0))
            loss = jnp.where(denominator > 0, loss_sum / jnp.where(denominator > 0, denominator, 1.0), 0.0)
            stats = {}
            for name, m in metrics.items():
                m = jax.lax.stop_gradient(m).astype(jnp.float32)
                if name.endswith("_max"):
                    stats[name] = jnp.max(jnp.where(valid, m, 0.0), initial=0.0)
                else:
                    where = valid.reshape(valid.shape + (1,) * (m.ndim - 2))
                    stats[name] = jnp.sum(jnp.where(where, m, 0.0), axis=(0, 1))
            stats["n_valid"] = jnp.sum(valid.astype(jnp.float32))
            stats["entropy_sum"] = jnp.sum(jnp.where(valid, entropy, 0.0))
            if "behavior_logprobs" in batch:  # RL batches (SFT's have no sampler)
                gap = jnp.abs(batch["behavior_logprobs"].astype(jnp.float32) - jax.lax.stop_gradient(logp))
                stats["behav_logp_gap_sum"] = jnp.sum(jnp.where(valid, gap, 0.0))
                fresh = valid & (batch[FRESH_KEY] > 0) if FRESH_KEY in batch else jnp.zeros_like(valid)
                stats["fresh_logp_gap_sum"] = jnp.sum(jnp.where(fresh, gap, 0.0))
                stats["n_fresh"] = jnp.sum(fresh).astype(jnp.float32)
            else:
                stats.update({k: jnp.zeros((), jnp.float32) for k in ("behav_logp_gap_sum", "fresh_logp_gap_sum",
                                                                      "n_fresh")})
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
        return grad_acc, accumulate_stats(stats_acc, stats)

    def update(params, opt_state, grads):
        counts["update"] += 1
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, new_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if engine.skip_nonfinite:
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
_MICROBATCH_FIELDS = ("TrainEngineConfig.max_tokens_per_microbatch", "TrainEngineConfig.row_buckets")
_ACTIVATION_FIELDS = ("TrainEngineConfig.logit_chunk_tokens", "TrainEngineConfig.remat",
                      "TrainEngineConfig.compute_dtype", "TrainEngineConfig.scan_layers",
                      "TrainEngineConfig.attention_impl")


def possible_microbatch_shapes(engine_cfg: TrainEngineConfig, fsdp: int, num_processes: int = 1
                               ) -> list[tuple[int, int]]:
    """(R, T) of the largest micro-batch of each row length `make_microbatches` can produce.

    R counts the rows of every process: each packs up to `rows_for_bucket(T)` rows, budget // T
    (at least one) for each device of its share of the "fsdp" axis (what `RLLoop` passes as
    row_multiple: the budget is per training device), and the trainer stacks the processes' rows
    into one global array."""
    row_multiple = max(fsdp // num_processes, 1)
    budget = engine_cfg.max_tokens_per_microbatch
    return [(rows_for_bucket(T, budget, row_multiple) * num_processes, T)
            for T in candidate_row_lengths(budget, engine_cfg.row_buckets or None)]


def train_program_specs(model_cfg: ModelConfig, engine_cfg: TrainEngineConfig, objective: Objective,
                        opt_cfg: OptimizerConfig, mesh: Mesh, *, extra_keys: tuple[str, ...] = (),
                        rules: Rules = TRAIN_RULES, num_processes: int = 1, lora: LoRAConfig | None = None
                        ) -> list[ProgramSpec]:
    """Every program a training step runs at this config's shapes, on the train mesh `mesh`.

    Per row length T (`possible_microbatch_shapes`, each at its largest row count, which bounds its
    memory): "train/grad[rows=R,len=T]" and "train/logprobs[rows=R,len=T]"; then "train/update"
    and "train/zeros_like". Arguments are ShapeDtypeStructs sharded as JaxTrainEngine places
    them: fp32 params and optimizer state by the rule table, batch rows over "fsdp". The
    optimizer state is resident during every micro-batch program. The grad program takes the
    `[R, T]` inputs every objective reads plus `extra_keys`, what the algorithm adds (its proximal
    log-probs or A-3PO's weights; `trainer.algorithm.proximal_keys`); with one minibatch and the KL
    penalty on, the run also compiles the other variant (one `[R, T]` input more or less).

    num_processes: processes sharing the train mesh (rows per micro-batch scale with it).
    lora: with rank > 0, the weights are the frozen base in `lora.base_dtype` plus fp32 adapters,
    and gradients, optimizer state and the update cover the adapters alone (as JaxTrainEngine).
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
    programs = build_train_programs(model_cfg, engine_cfg, objective, optimizer, param_shardings=t_sh,
                                    opt_state_shardings=s_sh, lora=lora)
    replicated = NamedSharding(mesh, PartitionSpec())
    # LoRA dropout: the micro-batch's (step, minibatch, micro-batch) that seeds its masks.
    dropout_index = ((jax.ShapeDtypeStruct((3,), jnp.uint32, sharding=replicated),)
                     if lora.enabled and lora.dropout else ())
    stats = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), loss_stats_shapes(objective))
    denominator = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    context = functools.partial(activation_rules, rules, mesh)
    grad_keys = (*LOSS_KEYS, *extra_keys)
    micro_fields = (*_MICROBATCH_FIELDS, *_ACTIVATION_FIELDS, *_MESH_FIELDS)
    replays = model_cfg.moe is not None and engine_cfg.moe_routing == "replay"

    specs = []
    for R, T in possible_microbatch_shapes(engine_cfg, batch_shards(mesh), num_processes):
        rows = sharding_for(("batch", "seq"), rules, mesh, (R, T))
        batch = lambda keys: {k: jax.ShapeDtypeStruct((R, T), BATCH_DTYPES.get(k, jnp.float32),  # noqa: E731
                                                      sharding=rows)
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

