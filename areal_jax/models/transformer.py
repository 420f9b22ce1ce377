"""One decoder for Llama 3, Qwen2/2.5 and Qwen3: GQA, RoPE, RMSNorm, SwiGLU.

Conventions (see ModelConfig for the dimension letters B T S D N K H F V L):
- Parameters live in one nested dict of arrays; layer weights are stacked on a leading `L` axis
  and the forward pass scans over them (one compiled layer body, whatever the depth).
- Every parameter has logical axis names (PARAM_AXES); models/sharding.py maps them to a mesh.
- `forward` is a pure function of (params, tokens) used by the trainer and the generation
  engine alike; `Transformer` is the Flax NNX module users hold, a thin owner of the same dict.
- Packed rows: `segment_ids [B, T]` mark sequences (0 = padding); a token attends only to
  earlier tokens of its own non-zero segment.
- KV cache (generation): `KVCache` arrays `[L, B, K, S, H]`; a token at position p writes its
  key/value at cache index p and attends to cache indices <= p of its own row. Or paged
  (kernels/paged_attention.py): per-layer pools of pages, a slot's positions on the pages its
  page table lists. The generation entry points over either cache (prefill into slots or pages,
  the paged decode step, the chunked prefill) live in models/decoding.py.
- LoRA: a layer holding adapters (`params["layers"]["lora"]`, models/lora.py) adds their update to
  each targeted projection (`adapt`); without them every path is the plain decoder's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.kernels.flash_attention import FLASH_IMPLS
from areal_jax.models import moe
from areal_jax.models.attention import cached_attention, causal_attention, training_attention
from areal_jax.models.config import ModelConfig, rope_inverse_frequencies
from areal_jax.models.lora import adapt
from areal_jax.models.sharding import constrain

Params = dict[str, Any]
Remat = Literal["none", "full", "save_dots"]
# Self-attention of the no-cache forward: "blocked" = models.attention.causal_attention under
# autodiff (its backward keeps every block's scores: O(T^2) per layer); the others are
# kernels.flash_attention's impls (the backward recomputes from the log-sum-exp: O(T)).
ATTENTION_IMPLS = ("blocked", *FLASH_IMPLS)


def param_axes(cfg: ModelConfig) -> dict[str, Any]:
    """Logical axis names of every parameter, in the layout of the params dict."""
    layers: dict[str, tuple[str, ...]] = {
        "attn_norm": ("layers", "norm"),
        "wq": ("layers", "embed", "q_heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "q_heads", "head_dim", "embed"),
        "mlp_norm": ("layers", "norm"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    }
    if cfg.qkv_bias:
        layers.update(bq=("layers", "q_heads", "head_dim"), bk=("layers", "kv_heads", "head_dim"),
                      bv=("layers", "kv_heads", "head_dim"))
    if cfg.o_bias:
        layers["bo"] = ("layers", "norm")
    if cfg.mlp_bias:
        layers.update(b_gate=("layers", "mlp"), b_up=("layers", "mlp"), b_down=("layers", "norm"))
    if cfg.qk_norm:
        layers.update(q_norm=("layers", "head_dim"), k_norm=("layers", "head_dim"))
    if cfg.moe is not None:  # expert block; the dense MLP only where some layer is dense
        layers.update(moe.layer_axes(cfg))
        if all(cfg.sparse_layers):
            for name in ("w_gate", "w_up", "w_down"):
                del layers[name]
    axes: dict[str, Any] = {"embed": ("vocab", "embed"), "layers": layers, "final_norm": ("norm",)}
    if not cfg.tie_word_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """Shape of every parameter, in the layout of the params dict."""
    L, D, N, K, H, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.vocab_size)
    sizes = {"layers": L, "embed": D, "q_heads": N, "kv_heads": K, "head_dim": H, "mlp": F, "vocab": V,
             "norm": D, **(moe.axis_sizes(cfg) if cfg.moe is not None else {})}
    return jax.tree.map(lambda axes: tuple(sizes[a] for a in axes), param_axes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))


def init_params(cfg: ModelConfig, key: jax.Array | int, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random weights (normal(std)); norms start at one and biases at zero, as in HF.

    Drawn with NumPy from the key's bits: compiling a threefry sampler per tensor costs seconds
    on CPU, and initialization is not a hot path.
    """
    seed = int(key) if isinstance(key, int) else np.asarray(jax.random.key_data(key)).ravel().tolist()
    rng = np.random.default_rng(seed)
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    leaves = []
    for path, shape in flat:
        name = path[-1].key
        if name.endswith("norm"):
            value = np.ones(shape, np.float32)
        elif name.startswith("b"):
            value = np.zeros(shape, np.float32)
        else:
            value = rng.normal(0.0, std, size=shape).astype(np.float32)
        leaves.append(jnp.asarray(value, dtype=dtype))
    return jax.tree.unflatten(treedef, leaves)


# ---- building blocks ------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32 (as HF does), returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


class Rotary(NamedTuple):
    """cos and sin of position * inv_freq, `[B, T, 1, H/2]` each (fp32), for every layer's q and k.

    Computed once per forward: XLA CPU's cosine costs ~10x torch's per element, and left inside
    the layer it is fused into each rotation and re-evaluated for every head (and again in the
    backward pass), which cost more than the projections it rotates.
    """

    cos: jax.Array
    sin: jax.Array

    @classmethod
    def at(cls, cfg: ModelConfig, positions: jax.Array) -> "Rotary":
        inv_freq = jnp.asarray(np.asarray(rope_inverse_frequencies(cfg.rope, cfg.head_dim), np.float32))
        angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
        # The barrier makes XLA materialize the table; otherwise its fusion pass copies the
        # cosine back into every consumer.
        cos, sin = jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles)))
        return cls(cos[:, :, None, :], sin[:, :, None, :])


def rotary(x: jax.Array, rope: Rotary) -> jax.Array:
    """Rotates pairs (i, i + H/2) of `x [B, T, *, H]` by the table's angles (HF layout)."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * rope.cos - x2 * rope.sin, x2 * rope.cos + x1 * rope.sin], axis=-1).astype(x.dtype)


class KVCache(NamedTuple):
    """Keys and values of every layer: `k, v [L, B, K, S, H]` (B = decode slots, S = cache length).

    Heads precede positions so that attention reads a layer's cache as it lies, without a
    transposed copy. A decode loop carries the cache *per layer* instead (`per_layer()`: tuples
    of L `[B, K, S, H]` arrays), because XLA updates a whole buffer in place but copies a slice
    of a stacked one before writing into it; `stacked()` turns it back.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> "KVCache":
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def is_per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    def per_layer(self) -> "KVCache":
        if self.is_per_layer:
            return self
        return KVCache(tuple(self.k[i] for i in range(self.k.shape[0])), tuple(self.v[i] for i in range(self.v.shape[0])))

    def stacked(self) -> "KVCache":
        return KVCache(jnp.stack(self.k), jnp.stack(self.v)) if self.is_per_layer else self


def split_layers(params: Params) -> Params:
    """The same weights with `params["layers"]` as a tuple of per-layer dicts (what an unrolled
    decode step wants: slicing the stacked weights inside the step copies every layer's weights
    on every step). Only `forward` with a per-layer `KVCache` accepts this layout."""
    layers = params["layers"]
    if isinstance(layers, tuple):
        return params
    count = len(next(iter(layers.values())))
    return {**params, "layers": tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(count))}


def stack_layers(params: Params) -> Params:
    """The same weights with `params["layers"]` stacked on `L` again (`split_layers`' inverse)."""
    layers = params["layers"]
    if not isinstance(layers, tuple):
        return params
    return {**params, "layers": jax.tree.map(lambda *a: jnp.stack(a), *layers)}


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token within its segment: `[B, T] -> [B, T]` (padding gets 0)."""
    idx = jnp.arange(segment_ids.shape[1])
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return jnp.where(segment_ids > 0, idx - start_idx, 0)


def self_attention_mask(B: int, T: int, segment_ids: jax.Array | None, key_ends: jax.Array | None = None
                        ) -> jax.Array:
    """`[B, T, T]`: causal by array index, and within one non-zero segment when `segment_ids`; with
    `key_ends [B, T]` (a packed prefix trie, trainer/prefix_tree.py) key s is seen only by the
    queries before key_ends[s]: a trie token's ancestors."""
    idx = jnp.arange(T)
    mask = idx[None, :, None] >= idx[None, None, :]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = mask & same & (segment_ids[:, None, :] > 0)
    if key_ends is not None:
        mask = mask & (idx[None, :, None] < key_ends[:, None, :])
    return jnp.broadcast_to(mask, (B, T, T))


def embed_tokens(params: Params, input_ids: jax.Array, compute_dtype) -> jax.Array:
    """Token embeddings `[B, T, D]` in the compute dtype, pinned to the activation layout."""
    return constrain(params["embed"].astype(compute_dtype)[input_ids], ("batch", "seq", "act_embed"))


def project(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
    """`x [B, T, I] @ w [I, *O] -> [B, T, *O]` as one 2-D matmul over the B*T tokens.

    XLA CPU lowers a dot whose gradient contracts two axes (the weight gradient of a `btd,df`
    einsum sums over b and t) far slower than the same product on `[B*T, I]`: flattening the
    tokens makes the backward pass ~2x faster (bench/forward_throughput.py, training step).
    """
    B, T, I = x.shape
    out = jnp.dot(x.reshape(B * T, I), w.reshape(I, -1), preferred_element_type=preferred_element_type)
    return out.reshape(B, T, *w.shape[1:])


def attention_inputs(cfg: ModelConfig, rope: Rotary, x, p, compute_dtype):
    """Queries `[B, T, N, H]`, keys and values `[B, T, K, H]` of one layer (normed, biased, rotated)."""
    cast = lambda a: a.astype(compute_dtype)  # noqa: E731
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q = adapt(project(h, cast(p["wq"])), h, p, "wq")  # [B, T, N, H]
    k = adapt(project(h, cast(p["wk"])), h, p, "wk")  # [B, T, K, H]
    v = adapt(project(h, cast(p["wv"])), h, p, "wv")
    if cfg.qkv_bias:
        q, k, v = q + cast(p["bq"]), k + cast(p["bk"]), v + cast(p["bv"])
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = rotary(q, rope)
    k = rotary(k, rope)
    return constrain(q, ("batch", "seq", "act_heads", "head_dim")), k, v


def layer_output(cfg: ModelConfig, x, attn, p, compute_dtype, layer=0, forced=None, valid=None):
    """The rest of a layer after attention (`attn [B, T, N, H]`): output projection, residual, MLP.
    Returns x and, for a MoE model, the layer's `moe.LayerRouting` (else None); `layer` (int or
    traced), `forced` `[B, T, k]` (replayed experts) and `valid` `[B, T]` feed the expert block."""
    cast = lambda a: a.astype(compute_dtype)  # noqa: E731
    # One contraction axis (N*H): with two, XLA CPU transposes wo and the activations per call.
    attn = attn.reshape(*attn.shape[:2], -1)
    out = adapt(project(attn, cast(p["wo"]).reshape(-1, x.shape[-1])), attn, p, "wo")
    if cfg.o_bias:
        out = out + cast(p["bo"])
    x = x + out
    x = constrain(x, ("batch", "seq", "act_embed"))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)

    def dense(h):
        gate = adapt(project(h, cast(p["w_gate"])), h, p, "w_gate")
        up = adapt(project(h, cast(p["w_up"])), h, p, "w_up")
        if cfg.mlp_bias:
            gate, up = gate + cast(p["b_gate"]), up + cast(p["b_up"])
        act = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp"))
        down = adapt(project(act, cast(p["w_down"])), act, p, "w_down")
        return down + cast(p["b_down"]) if cfg.mlp_bias else down

    routing = None
    if cfg.moe is None:
        down = dense(h)
    else:
        down, routing = moe.mlp(cfg, h, p, compute_dtype, layer, dense, forced, valid)
    return constrain(x + down, ("batch", "seq", "act_embed")), routing


def decoder_layer(cfg: ModelConfig, rope: Rotary, x, p, mask, cache_kv, write_index, compute_dtype, attend=None,
           layer=0, forced=None, valid=None):
    """One decoder layer. x `[B, T, D]`; cache_kv = (k, v) `[B, K, S, H]` of this layer or None;
    with a cache, attention reads its first `mask.shape[-1]` positions. Returns the new x, the
    updated cache layer (or without a cache this layer's keys and values `[B, T, K, H]`) and the
    MoE routing (`_layer_output`). Without a cache, `attend(q, k, v)` (if given) replaces the
    blocked attention under `mask`."""
    q, k, v = attention_inputs(cfg, rope, x, p, compute_dtype)
    if cache_kv is None:
        attn = causal_attention(q, k, v, mask) if attend is None else attend(q, k, v)
        new_kv = (k, v)
    else:
        ck, cv = cache_kv  # [B, K, S, H]; write_index [B, T] puts token t of row b at [b, :, index]
        rows = jnp.arange(x.shape[0])[:, None]
        ck = ck.at[rows, :, write_index].set(k.astype(ck.dtype), mode="drop")
        cv = cv.at[rows, :, write_index].set(v.astype(cv.dtype), mode="drop")
        W = mask.shape[-1]  # keys past the window are never attended to: not read at all
        attn = cached_attention(q, ck[:, :, :W].astype(compute_dtype), cv[:, :, :W].astype(compute_dtype), mask)
        new_kv = (ck, cv)
    x, routing = layer_output(cfg, x, attn, p, compute_dtype, layer, forced, valid)
    return x, new_kv, routing


_REMAT_POLICIES = {
    "full": None,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def forward(
    params: Params,
    cfg: ModelConfig,
    input_ids: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    cache: KVCache | None = None,
    compute_dtype=None,
    remat: Remat = "none",
    return_hidden: bool = False,
    cache_window: int | None = None,
    scan_layers: bool = True,
    attention_impl: str = "blocked",
    moe_routing: jax.Array | None = None,
    return_routing: bool = False,
    key_ends: jax.Array | None = None,
):
    """Logits `[B, T, V]` (fp32) and the updated cache (and with `return_routing`, a third value:
    the pass's `moe.Routing`, None for a dense model).

    Without a cache: positions default to 0..T-1, or to the position within each segment when
    `segment_ids` is given; attention is causal within segments. With a cache: `positions [B, T]`
    are required and are also the cache indices written; a position < 0 marks a padding token
    whose key/value is not written (its logits are meaningless). A stacked cache runs the layers
    as a scan (prefill); a per-layer one (`KVCache.per_layer()`, returned per layer) unrolls them,
    and `params` may then hold per-layer weights (`split_layers`): the decode step's layout.
    Without a cache the layers run as one `lax.scan` (one compiled layer body), or unrolled with
    `scan_layers=False`: a longer compile, but under autodiff the scan stacks every layer's
    saved activations into `[L, ...]` buffers and slices them back, which XLA CPU pays for.
    `cache_window` (static) limits attention to the first cache positions: every position in
    `positions` must lie below it. Decoding short sequences in a long cache then reads only the
    part of the cache they use.
    `attention_impl` (no cache only; one of ATTENTION_IMPLS) picks the self-attention: "blocked",
    or flash attention ("auto", "reference", "pallas"; kernels/flash_attention.py).
    `moe_routing` `[L, B, T, k]` (MoE models): replay these experts instead of routing afresh
    (routing replay, e.g. the generation engine's choices; dense layers' entries are ignored).
    `key_ends [B, T]` (no cache only): rows hold prefix tries in depth-first order (shared-prefix
    training, trainer/prefix_tree.py); key s is seen only by the queries before key_ends[s], so a
    token attends to its ancestors. Positions must then be given (each token's depth).
    """
    B, T = input_ids.shape
    if key_ends is not None and (cache is not None or positions is None):
        raise ValueError("forward with key_ends (a packed prefix trie) needs explicit positions and no cache")
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    compute_dtype = compute_dtype or params["embed"].dtype
    if positions is None:
        if cache is not None:
            raise ValueError("forward with a KV cache needs explicit positions [B, T]")
        positions = (jnp.broadcast_to(jnp.arange(T), (B, T)) if segment_ids is None
                     else segment_positions(segment_ids))
    positions = positions.astype(jnp.int32)
    valid = (segment_ids > 0) if segment_ids is not None else (positions >= 0) if cache is not None else None

    attend = None
    if cache is None and attention_impl != "blocked":
        mask = write_index = None
        attend = lambda q, k, v: training_attention(q, k, v, segment_ids, attention_impl,  # noqa: E731
                                                    key_ends=key_ends)
    elif cache is None:
        mask = self_attention_mask(B, T, segment_ids, key_ends)
        write_index = None
    else:
        S = cache.k[0].shape[2] if cache.is_per_layer else cache.k.shape[3]
        if cache_window is not None and not 0 < cache_window <= S:
            raise ValueError(f"cache_window {cache_window} must be in [1, cache length {S}]")
        W = S if cache_window is None else cache_window
        valid = positions >= 0
        mask = (jnp.arange(W)[None, None, :] <= positions[:, :, None]) & valid[:, :, None]  # [B, T, W]
        write_index = jnp.where(valid, positions, S)  # index S is out of bounds: dropped
        positions = jnp.maximum(positions, 0)

    rope = Rotary.at(cfg, positions)
    x = embed_tokens(params, input_ids, compute_dtype)
    layer_fn = lambda x, p, kv, i, r: decoder_layer(cfg, rope, x, p, mask, kv, write_index, compute_dtype, attend,  # noqa: E731
                                             i, r, valid)
    if remat != "none":
        layer_fn = jax.checkpoint(layer_fn, policy=_REMAT_POLICIES[remat])
    forced = lambda i: None if moe_routing is None else moe_routing[i]  # noqa: E731
    xs_routing = None if moe_routing is None else moe_routing  # scanned beside the layers

    if cache is None and not scan_layers:
        routings = []
        for i, p in enumerate(split_layers(params)["layers"]):
            x, _, r = layer_fn(x, p, None, i, forced(i))
            routings.append(r)
        new_cache = None
    elif cache is None:
        def body(x, xs):
            p, i, r = xs
            x, _, routing = layer_fn(x, p, None, i, r)
            return x, routing

        x, routings = jax.lax.scan(body, x, (params["layers"], jnp.arange(cfg.num_layers), xs_routing))
        new_cache = None
    elif cache.is_per_layer:  # a decode step: layers unrolled, each cache layer updated in place
        layers = split_layers(params)["layers"]
        new_k, new_v, routings = [], [], []
        for i, (p, ck, cv) in enumerate(zip(layers, cache.k, cache.v, strict=True)):
            x, (ck, cv), r = layer_fn(x, p, (ck, cv), i, forced(i))
            new_k.append(ck)
            new_v.append(cv)
            routings.append(r)
        new_cache = KVCache(tuple(new_k), tuple(new_v))
    else:  # prefill: one compiled layer body, whatever the depth
        def body(carry, xs):
            x, ck, cv = carry
            p, i, r = xs
            x, (k_i, v_i), routing = layer_fn(x, p, (ck[i], cv[i]), i, r)
            ck = jax.lax.dynamic_update_index_in_dim(ck, k_i, i, 0)
            cv = jax.lax.dynamic_update_index_in_dim(cv, v_i, i, 0)
            return (x, ck, cv), routing

        (x, ck, cv), routings = jax.lax.scan(body, (x, cache.k, cache.v),
                                             (params["layers"], jnp.arange(cfg.num_layers), xs_routing))
        new_cache = KVCache(ck, cv)

    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    out = x if return_hidden else lm_head(params, cfg, x)
    if not return_routing:
        return out, new_cache
    if cfg.moe is None:
        return out, new_cache, None
    if isinstance(routings, list):
        routings = jax.tree.map(lambda *a: jnp.stack(a), *routings)
    return out, new_cache, moe.combine(cfg, routings)


def lm_head(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final-norm hidden states `[B, T, D]` -> fp32 logits `[B, T, V]`."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = project(hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", "act_vocab"))


# ---- the NNX module -------------------------------------------------------------------------------


class Transformer(nnx.Module):
    """The policy model. `model(input_ids, positions=None, segment_ids=None) -> logits [B, T, V]`.

    Holds its weights as `nnx.Param`s (with `axes` metadata) in the layout of `param_axes`;
    `model.params` gives the plain dict that `forward` takes.
    """

    def __init__(self, config: ModelConfig, params: Params | None = None, *, rngs: nnx.Rngs | None = None,
                 dtype=jnp.float32):
        self.config = config
        if params is None:
            key = (rngs or nnx.Rngs(0)).params()
            params = init_params(config, key, dtype)
        self._set(params)

    def _set(self, params: Params) -> None:
        axes = param_axes(self.config)
        _check_layout(params, axes)
        self.embed = nnx.Param(params["embed"], axes=axes["embed"])
        self.final_norm = nnx.Param(params["final_norm"], axes=axes["final_norm"])
        if "lm_head" in axes:
            self.lm_head = nnx.Param(params["lm_head"], axes=axes["lm_head"])
        self.layers = nnx.Dict({name: nnx.Param(params["layers"][name], axes=a)
                                for name, a in axes["layers"].items()})

    @property
    def params(self) -> Params:
        """The weights as a plain nested dict of arrays (what `forward` takes)."""
        out = {"embed": self.embed[...], "final_norm": self.final_norm[...],
               "layers": {name: p[...] for name, p in self.layers.items()}}
        if "lm_head" in param_axes(self.config):
            out["lm_head"] = self.lm_head[...]
        return out

    def replace_params(self, params: Params) -> None:
        """Swaps in new weights of the same layout (e.g. after a training step)."""
        self._set(params)

    def __call__(self, input_ids, positions=None, segment_ids=None, *, compute_dtype=None) -> jax.Array:
        logits, _ = forward(self.params, self.config, jnp.asarray(input_ids),
                            None if positions is None else jnp.asarray(positions),
                            None if segment_ids is None else jnp.asarray(segment_ids),
                            compute_dtype=compute_dtype)
        return logits


def _check_layout(params: Mapping[str, Any], axes: Mapping[str, Any], prefix: str = "") -> None:
    missing = set(axes) - set(params)
    extra = set(params) - set(axes)
    if missing or extra:
        raise ValueError(f"params{prefix}: missing {sorted(missing)}, unexpected {sorted(extra)}")
    for name, a in axes.items():
        if isinstance(a, Mapping):
            _check_layout(params[name], a, f"{prefix}[{name!r}]")
        elif np.ndim(params[name]) != len(a):
            raise ValueError(f"params{prefix}[{name!r}] has rank {np.ndim(params[name])}, expected {len(a)} {a}")
