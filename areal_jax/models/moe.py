"""The sparse MLP of Qwen2-MoE / Qwen3-MoE decoders: top-k softmax router, experts run as grouped
matmuls over tokens sorted by expert, optional shared expert behind a sigmoid gate.

Dimension letters (beside ModelConfig's): M tokens of a layer call (B*T), E experts (E_l of them
held by one expert-parallel shard), k experts per token, Fe one expert's hidden size, Fs the
shared expert's, A = M*k token-expert assignments.

Routing is dropless: every assignment is computed (the grouped matmul takes per-expert group
sizes, so no capacity is reserved and no token is dropped; `LayerRouting.dropped` counts the
assignments the grouped matmuls did not cover, which must be 0). Expert parallelism: when the
active sharding rules put the "experts" axis on a mesh axis of size > 1, each shard of an
expert group gathers the group's tokens, computes the assignments of the experts it holds,
and the partial outputs are reduce-scattered back to the rows' owners (`_experts`;
docs/architecture.md, "Mixture of experts").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from areal_jax.kernels.grouped_matmul import grouped_matmul
from areal_jax.models.config import ModelConfig
from areal_jax.models.sharding import active, constrain, spec_for

EXPERT_AXIS = "expert"  # the mesh axis expert weights shard over (models/sharding.py rules)



def layer_axes(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Logical axes of the expert-block parameters of every layer (stacked on "layers")."""
    m = cfg.moe
    axes = {
        "router": ("layers", "embed", "router"),  # [L, D, E]: replicated over E, every shard routes
        "we_gate": ("layers", "experts", "embed", "moe_mlp"),  # [L, E, D, Fe]
        "we_up": ("layers", "experts", "embed", "moe_mlp"),
        "we_down": ("layers", "experts", "moe_mlp", "embed"),  # [L, E, Fe, D]
    }
    if m.shared_expert_intermediate_size:
        axes.update(ws_gate=("layers", "embed", "shared_mlp"), ws_up=("layers", "embed", "shared_mlp"),
                    ws_down=("layers", "shared_mlp", "embed"),
                    ws_router=("layers", "embed", "shared_gate"))  # [L, D, 1]: the gate's one logit
    return axes


def axis_sizes(cfg: ModelConfig) -> dict[str, int]:
    m = cfg.moe
    return {"experts": m.num_experts, "router": m.num_experts, "moe_mlp": m.moe_intermediate_size,
            "shared_mlp": m.shared_expert_intermediate_size, "shared_gate": 1}


class LayerRouting(NamedTuple):
    """What one layer's router did. experts `[B, T, k]` int32 (chosen ids, by falling probability);
    own `[B, T, k]` int32: the router's own top-k (differs from experts only under replay); load `[E]`: share of valid tokens sent to each expert (sums to k); importance `[E]`: mean router
    probability; entropy: mean router entropy (nats); dropped: assignments not computed (0)."""

    experts: jax.Array
    own: jax.Array
    load: jax.Array
    importance: jax.Array
    entropy: jax.Array
    dropped: jax.Array

    @classmethod
    def none(cls, cfg: ModelConfig, B: int, T: int) -> "LayerRouting":
        """A dense layer's entry (so a scan over mixed layers yields one structure)."""
        E, k = cfg.moe.num_experts, cfg.moe.num_experts_per_tok
        return cls(jnp.zeros((B, T, k), jnp.int32), jnp.zeros((B, T, k), jnp.int32), jnp.zeros((E,), jnp.float32), jnp.zeros((E,), jnp.float32),
                   jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))


def route(cfg: ModelConfig, h: jax.Array, router: jax.Array, forced: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h `[M, D]` -> (weights `[M, k]` fp32, experts `[M, k]` int32, probabilities `[M, E]` fp32).

    Softmax over all experts in fp32, the k most probable chosen (renormalized when
    norm_topk_prob). `forced` `[M, k]` (routing replay) fixes the choice; the weights are then
    the current router's probabilities of the forced experts, so the router still learns.
    """
    logits = jnp.dot(h, router.astype(h.dtype), preferred_element_type=jnp.float32)  # [M, E]
    probs = jax.nn.softmax(logits, axis=-1)
    if forced is None:
        weights, experts = jax.lax.top_k(probs, cfg.moe.num_experts_per_tok)
    else:
        experts = forced.astype(jnp.int32)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if cfg.moe.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


def expert_mlp(x: jax.Array, experts: jax.Array, weights: jax.Array, wg: jax.Array, wu: jax.Array,
               wd: jax.Array, impl: str, expert_offset: jax.Array | int = 0) -> tuple[jax.Array, jax.Array]:
    """Sum over each token's experts of weight * SwiGLU expert output, for the experts held here.

    x `[M, D]`; experts, weights `[M, k]`; wg, wu `[E_l, D, Fe]`, wd `[E_l, Fe, D]` hold global
    experts [expert_offset, expert_offset + E_l); assignments to other experts add nothing.
    Returns (`[M, D]` in x's dtype, number of local assignments computed).
    """
    M, k = experts.shape
    E_l = wg.shape[0]
    flat = experts.reshape(-1) - expert_offset  # [A]
    key = jnp.where((flat >= 0) & (flat < E_l), flat, E_l)  # other shards' experts sort last
    order = jnp.argsort(key, stable=True)  # [A]: assignments grouped by local expert
    sizes = jnp.bincount(key, length=E_l + 1)[:E_l].astype(jnp.int32)  # [E_l]
    covered = jnp.arange(M * k) < jnp.sum(sizes)  # rows the groups hold; the rest are other shards'
    # Zeroed past the groups, so the unspecified rows' gradients never reach x.
    xs = jnp.where(covered[:, None], x[order // k], 0)  # [A, D]
    act = jax.nn.silu(grouped_matmul(xs, wg, sizes, impl)) * grouped_matmul(xs, wu, sizes, impl)  # [A, Fe]
    ys = grouped_matmul(act, wd, sizes, impl)  # [A, D]
    ws = jnp.where(covered, weights.reshape(-1)[order], 0).astype(x.dtype)
    ys = jnp.where(covered[:, None], ys, 0) * ws[:, None]
    unsorted = jnp.zeros_like(ys).at[order].set(ys)  # back to token-major order
    return unsorted.reshape(M, k, -1).sum(axis=1), jnp.sum(sizes)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _experts(x, experts, weights, p, impl, cast):
    """expert_mlp over all experts: on one device, or as a shard_map over the whole active mesh.

    Manual over every mesh axis (libtpu cannot partition the megablox kernel itself): rows come in
    sharded like the batch; where they shard over the expert axis too (training), each expert
    group first gathers its members' rows, every member computes the assignments of the experts
    it holds, and a reduce-scatter returns each member the sums for its own rows. Where rows are
    whole over the expert axis (generation), the partial sums are summed over it. Each expert's
    hidden units may split over "tensor" (moe_mlp), summed after the down projection.
    """
    wg, wu, wd = cast(p["we_gate"]), cast(p["we_up"]), cast(p["we_down"])
    rules_mesh = active()
    if rules_mesh is None or rules_mesh[1].size == 1:
        return expert_mlp(x, experts, weights, wg, wu, wd, impl)
    rules, mesh = rules_mesh
    ep = EXPERT_AXIS if rules.get("experts") == EXPERT_AXIS and mesh.shape.get(EXPERT_AXIS, 1) > 1 else None
    shards = mesh.shape[ep] if ep else 1
    if wg.shape[0] % shards:
        raise ValueError(f"{wg.shape[0]} experts do not split over expert={shards} shards "
                         f"(MeshConfig expert size must divide MoEConfig.num_experts)")
    rows = spec_for(("batch",), rules, mesh, (x.shape[0],))
    row_axes = _axes(rows[0] if len(rows) else None)
    hidden = spec_for(("moe_mlp",), rules, mesh, (wg.shape[-1],))
    hidden = hidden[0] if len(hidden) else None
    gather = ep is not None and ep in row_axes
    sum_axes = tuple(a for a in row_axes if a != ep) + ((ep,) if ep else ())

    def local(x, experts, weights, wg, wu, wd):
        if gather:  # the expert group's rows, in row order (ep is the minor row axis)
            x, experts, weights = (jax.lax.all_gather(a, ep, axis=0, tiled=True) for a in (x, experts, weights))
        offset = jax.lax.axis_index(ep) * wg.shape[0] if ep else 0
        out, done = expert_mlp(x, experts, weights, wg, wu, wd, impl, offset)
        if hidden is not None:
            out = jax.lax.psum(out, _axes(hidden))
        if gather:
            out = jax.lax.psum_scatter(out, ep, scatter_dimension=0, tiled=True)
        elif ep:
            out = jax.lax.psum(out, ep)
        return out, (jax.lax.psum(done, sum_axes) if sum_axes else done)

    row_spec = P(rows[0] if row_axes else None)
    w_in, w_out = P(ep, None, hidden), P(ep, hidden, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(row_spec, row_spec, row_spec, w_in, w_in, w_out),
                         out_specs=(row_spec, P()), check_vma=False)(x, experts, weights, wg, wu, wd)


def sparse_block(cfg: ModelConfig, h: jax.Array, p: dict[str, jax.Array], compute_dtype,
                 forced: jax.Array | None = None, valid: jax.Array | None = None
                 ) -> tuple[jax.Array, LayerRouting]:
    """The expert block on normed hidden states `h [B, T, D]` -> (`[B, T, D]`, LayerRouting).
    forced `[B, T, k]`: replay these experts; valid `[B, T]`: tokens counted in the statistics."""
    m = cfg.moe
    B, T, D = h.shape
    cast = lambda a: a.astype(compute_dtype)  # noqa: E731
    x = h.reshape(B * T, D)
    weights, experts, probs = route(cfg, x, p["router"], None if forced is None else forced.reshape(B * T, -1))
    out, done = _experts(x, experts, weights, p, m.grouped_matmul, cast)
    # What the router would have chosen itself (the replay metrics compare it with the record).
    own = experts if forced is None else jax.lax.top_k(probs, m.num_experts_per_tok)[1]
    if m.shared_expert_intermediate_size:
        act = jax.nn.silu(jnp.dot(x, cast(p["ws_gate"]))) * jnp.dot(x, cast(p["ws_up"]))
        shared = jnp.dot(act, cast(p["ws_down"]))
        gate = jax.nn.sigmoid(jnp.dot(x, cast(p["ws_router"])))  # [M, 1]
        out = out + gate * shared
    mask = jnp.ones((B * T,), jnp.float32) if valid is None else valid.reshape(-1).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    onehot = jax.nn.one_hot(experts, m.num_experts, dtype=jnp.float32).sum(axis=1)  # [M, E]
    stats = LayerRouting(
        experts=experts.reshape(B, T, -1),
        own=jax.lax.stop_gradient(own).reshape(B, T, -1),
        load=jax.lax.stop_gradient(mask @ onehot) / count,
        importance=(mask @ probs) / count,
        entropy=jax.lax.stop_gradient(-jnp.sum(mask @ (probs * jnp.log(probs + 1e-20))) / count),
        dropped=(B * T * m.num_experts_per_tok - done).astype(jnp.int32),
    )
    return constrain(out.reshape(B, T, D), ("batch", "seq", "act_embed")), stats


def mlp(cfg: ModelConfig, h: jax.Array, p: dict[str, jax.Array], compute_dtype, layer: jax.Array | int,
        dense: Callable[[jax.Array], jax.Array], forced: jax.Array | None = None, valid: jax.Array | None = None
        ) -> tuple[jax.Array, LayerRouting]:
    """The MLP of layer `layer` of a MoE model: the expert block where the layer is sparse, else
    `dense(h)` (the decoder's SwiGLU). A mixed pattern picks per layer with `lax.cond` (the layer
    index may be a scan's traced counter): only the chosen branch runs."""
    sparse = cfg.sparse_layers
    B, T, _ = h.shape
    run_sparse = lambda h: sparse_block(cfg, h, p, compute_dtype, forced, valid)  # noqa: E731
    run_dense = lambda h: (dense(h), LayerRouting.none(cfg, B, T))  # noqa: E731
    if all(sparse):
        return run_sparse(h)
    if isinstance(layer, int):
        return run_sparse(h) if sparse[layer] else run_dense(h)
    return jax.lax.cond(jnp.asarray(sparse)[layer], run_sparse, run_dense, h)


class Routing(NamedTuple):
    """Routing of a whole forward pass: experts `[L, B, T, k]` int32 (dense layers: zeros), own
    `[L, B, T, k]` the router's own top-k (equal to experts unless replayed), and the
    load-balancing loss over the sparse layers (HF's: E * sum_e load_e * importance_e, each
    averaged over the sparse layers), with statistics for the metrics."""

    experts: jax.Array
    own: jax.Array
    aux_loss: jax.Array
    load_max: jax.Array  # most-loaded expert's share of tokens over its fair share k/E (1 = balanced)
    entropy: jax.Array
    dropped: jax.Array


def combine(cfg: ModelConfig, per_layer: LayerRouting) -> Routing:
    """Per-layer routing stacked on a leading `[L]` axis -> the pass's Routing."""
    m = cfg.moe
    sparse = jnp.asarray(cfg.sparse_layers, jnp.float32)  # [L]
    n = jnp.maximum(jnp.sum(sparse), 1.0)
    load = (sparse @ per_layer.load) / n  # [E]
    importance = (sparse @ per_layer.importance) / n
    return Routing(
        experts=per_layer.experts,
        own=per_layer.own,
        aux_loss=m.num_experts * jnp.sum(load * importance),
        load_max=jnp.max(load) * m.num_experts / m.num_experts_per_tok,
        entropy=(sparse @ per_layer.entropy) / n,
        dropped=jnp.sum(per_layer.dropped),
    )


# ---- the engine's record of its routing (routing replay) -------------------------------------------
# The generation engine records, per input token, the experts of every sparse layer: `[T, L_moe, k]`
# (L_moe = sum(cfg.sparse_layers); dense layers route nothing, so they take no room), in the
# smallest unsigned type holding an expert id. The trainer scatters it back to `[L, ...]`.


def sparse_layer_ids(cfg: ModelConfig) -> tuple[int, ...]:
    """Indices of the layers whose MLP is the expert block (those the engine records)."""
    return tuple(i for i, s in enumerate(cfg.sparse_layers) if s)


def record_dtype(cfg: ModelConfig):
    """dtype of recorded expert ids: uint8 up to 256 experts, else uint16."""
    return jnp.uint8 if cfg.moe.num_experts <= 256 else jnp.uint16


def record(cfg: ModelConfig, experts: list[jax.Array] | jax.Array) -> jax.Array:
    """Experts of every layer (a list of L `[..., k]` arrays, or one `[L, ..., k]`) -> the record
    `[..., L_moe, k]` of the sparse layers, in `record_dtype`."""
    ids = sparse_layer_ids(cfg)
    picked = jnp.stack([experts[i] for i in ids])  # [L_moe, ..., k]
    return jnp.moveaxis(picked, 0, -2).astype(record_dtype(cfg))


def mismatched(cfg: ModelConfig, own: jax.Array, recorded: jax.Array, valid: jax.Array) -> jax.Array:
    """How many (valid token, sparse layer) pairs route to a different expert SET than the record.

    own `[L, R, T, k]` (Routing.own), recorded `[R, T, L_moe, k]`, valid `[R, T]` bool -> int32 scalar.
    Order within the top-k is ignored (ties may order the same set differently)."""
    ids = jnp.asarray(sparse_layer_ids(cfg))
    mine = jnp.sort(jnp.moveaxis(own[ids], 0, 2), axis=-1)  # [R, T, L_moe, k]
    theirs = jnp.sort(recorded.astype(jnp.int32), axis=-1)
    differs = jnp.any(mine != theirs, axis=-1) & valid[:, :, None]  # [R, T, L_moe]
    return jnp.sum(differs).astype(jnp.int32)


def replay_layers(cfg: ModelConfig, recorded: jax.Array) -> jax.Array:
    """A record `[R, T, L_moe, k]` -> experts to replay `[L, R, T, k]` int32 (dense layers: zeros,
    ignored by the forward)."""
    ids = sparse_layer_ids(cfg)
    if recorded.shape[2] != len(ids):
        raise ValueError(f"recorded routing has {recorded.shape[2]} layers, the model {len(ids)} sparse ones "
                         f"(moe_routing must be [R, T, L_moe, k])")
    per_layer = jnp.moveaxis(recorded.astype(jnp.int32), 2, 0)  # [L_moe, R, T, k]
    out = jnp.zeros((cfg.num_layers, *per_layer.shape[1:]), jnp.int32)
    return out.at[jnp.asarray(ids)].set(per_layer)
