"""Attention in plain JAX: dense GQA for decoding against a cache, causal-blocked for self-attention.

Shapes: q `[B, T, N, H]`, k/v `[B, S, K, H]`, mask `[B, T, S]` (True = may attend), N = K * G.

`cached_attention` is the dense formula, one `[B, K, G*T, S]` score tensor, over keys stored
heads-first `[B, K, S, H]` as in the KV cache; it serves decoding, where T is a few tokens and S
the cache length. `attention` is the same formula for `[B, S, K, H]` keys.

`chunk_attention` serves the engine's prefill, which runs a prompt in query chunks: a chunk
attends to its own keys (causal) and to the earlier keys already in its KV block, read in blocks
with an online softmax, so no score tensor is larger than `[B, K, G*T, block]`.

`prefill_kernel_attention` is the same chunk's attention by a Pallas kernel
(kernels/prefill_attention.py) on GPU and TPU, over the KV block with the chunk's keys already
written; the engine's prefill takes it where `prefill.kernel_fits`, else `chunk_attention`.

`training_attention` is the training forward's flash attention (kernels/flash_attention.py: no
`[T, T]` saved for the backward; `causal_attention` under autodiff is the "blocked" alternative).
Under a mesh a Pallas kernel runs per shard (`shard_map` over rows and heads): XLA cannot split
a kernel's custom call, and would otherwise gather every row onto every device.

`causal_attention` serves training and packed prefill (T == S, causal mask). On CPU the dense score
tensor of a 512-token row is tens of MB per layer and every softmax pass over it is memory-bound,
while half of it lies above the diagonal. Here query block [i, e) only meets keys [0, e): about
half the work of the dense product for 16 blocks, and each block's scores are small enough to
stay in cache. The block loop is unrolled at trace time, so all shapes are static and the
function is differentiable and shardable like any jnp code.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from areal_jax.kernels import flash_attention as flash
from areal_jax.kernels import prefill_attention as prefill
from areal_jax.models import sharding as shd

# Query block of 32 tokens: the fastest of 16/32/64/128 for 512-token rows on the 2-core CPU
# benchmark machine (bench/forward_throughput.py). Longer rows get longer blocks so that the
# unrolled loop (and the compiled program) stays at most MAX_BLOCKS blocks long.
BLOCK_SIZE = 32
MAX_BLOCKS = 32

_NEG = float(jnp.finfo(jnp.float32).min)


def _fold_heads(x: jax.Array, K: int) -> jax.Array:
    """`[B, T, N, H]` -> `[B, K, G*T, H]`: the G query heads of one kv head join the query axis."""
    B, T, N, H = x.shape
    G = N // K
    return x.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)


def _unfold_heads(x: jax.Array, N: int) -> jax.Array:
    """Inverse of `_fold_heads`: `[B, K, G*T, H]` -> `[B, T, N, H]`."""
    B, K, GT, H = x.shape
    G = N // K
    return x.reshape(B, K, G, GT // G, H).transpose(0, 3, 1, 2, 4).reshape(B, GT // G, N, H)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Dense GQA attention over heads-first keys. q `[B, T, N, H]`, k/v `[B, K, S, H]` (the KV
    cache's layout), mask `[B, T, S]` -> `[B, T, N, H]`.

    The G = N/K query heads sharing a kv head are folded into the query axis, so both products
    are plain batched matmuls over (B, K) that read k/v as they lie: on XLA CPU that is ~15%
    faster than contracting the 5-D layout directly. A query with no allowed key gets the mean
    of all values (meaningless, but finite).
    """
    B, T, N, H = q.shape
    K = k.shape[1]
    G = N // K
    scores = jnp.einsum("bkqh,bksh->bkqs", _fold_heads(q, K), k, preferred_element_type=jnp.float32) * (H ** -0.5)
    scores = scores.reshape(B, K, G, T, -1)
    scores = jnp.where(mask[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(B, K, G * T, -1)
    out = jnp.einsum("bkqs,bksh->bkqh", probs, v)
    return _unfold_heads(out, N)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Dense GQA attention. q `[B, T, N, H]`, k/v `[B, S, K, H]`, mask `[B, T, S]` -> `[B, T, N, H]`
    (`cached_attention` on k/v moved heads-first)."""
    return cached_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask)


def _block(qt: jax.Array, kt: jax.Array, vt: jax.Array, mask: jax.Array, G: int) -> jax.Array:
    """One query block against its keys. qt `[B, K, G*Tq, H]`, kt/vt `[B, K, Sk, H]`,
    mask `[B, Tq, Sk]` -> `[B, K, G*Tq, H]`; a query with no allowed key gets zeros."""
    B, K, GT, H = qt.shape
    Tq = GT // G
    s = jnp.einsum("bkqh,bksh->bkqs", qt, kt, preferred_element_type=jnp.float32) * (H ** -0.5)
    s = jnp.where(mask[:, None, None], s.reshape(B, K, G, Tq, -1), _NEG)
    peak = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - peak)
    total = jnp.sum(p, axis=-1, keepdims=True)  # >= 1: the peak itself contributes exp(0)
    # Normalizing the [.., Tq, H] output instead of the [.., Tq, Sk] probabilities saves a pass
    # over the scores.
    out = jnp.einsum("bkqs,bksh->bkqh", p.astype(vt.dtype).reshape(B, K, GT, -1), vt,
                     preferred_element_type=jnp.float32).reshape(B, K, G, Tq, H) / total
    out = jnp.where(peak > _NEG, out, 0.0)  # peak == _NEG: every key masked
    return out.reshape(B, K, GT, H).astype(vt.dtype)


def block_size_for(T: int, block_size: int = BLOCK_SIZE, max_blocks: int = MAX_BLOCKS) -> int:
    """Query block length used for T tokens: `block_size`, raised so at most `max_blocks` blocks."""
    if block_size < 1 or max_blocks < 1:
        raise ValueError(f"block_size ({block_size}) and max_blocks ({max_blocks}) must be >= 1")
    return max(block_size, math.ceil(T / max_blocks))


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                     block_size: int = BLOCK_SIZE, max_blocks: int = MAX_BLOCKS) -> jax.Array:
    """Exact GQA self-attention under a causal mask, skipping the key blocks above the diagonal.

    q `[B, T, N, H]`, k/v `[B, T, K, H]`, mask `[B, T, T]` -> `[B, T, N, H]`. The mask must allow
    no key after its query (`mask[b, t, s]` only where s <= t, e.g. causal within packed
    segments): keys past the end of a query's block are not looked at. Equals `attention` on
    every query with at least one allowed key; a query with none (padding) gets zeros.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    if k.shape[1] != T or v.shape[1] != T or mask.shape[-2:] != (T, T):
        raise ValueError(f"causal_attention needs T == S: q {q.shape}, k {k.shape}, v {v.shape}, "
                         f"mask {mask.shape}")
    if N % K:
        raise ValueError(f"query heads ({N}) must be a multiple of kv heads ({K})")
    G = N // K
    bq = block_size_for(T, block_size, max_blocks)
    if bq >= T:  # one block: nothing to skip, so the dense formula (and its exact rounding)
        return jnp.where(jnp.any(mask, axis=-1)[:, :, None, None], attention(q, k, v, mask), 0).astype(q.dtype)
    kt = k.transpose(0, 2, 1, 3)  # [B, K, T, H]
    vt = v.transpose(0, 2, 1, 3)
    outs = []
    for start in range(0, T, bq):
        end = min(T, start + bq)
        qb = _fold_heads(q[:, start:end], K)
        outs.append(_unfold_heads(_block(qb, kt[:, :, :end], vt[:, :, :end], mask[:, start:end, :end], G), N))
    return jnp.concatenate(outs, axis=1)


def chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, ck: jax.Array, cv: jax.Array, start: jax.Array | int,
                    block: int) -> jax.Array:
    """Causal attention of a query chunk over its own keys and every earlier key of its rows.

    q `[B, T, N, H]` at positions [start, start + T); k/v `[B, T, K, H]` the chunk's own keys;
    ck/cv `[B, K, S, H]` (heads-first, the KV cache layout) hold the keys of positions [0, start),
    read in `block`-long slices (`start` a multiple of `block`, traced or static) with an online
    softmax in fp32. -> `[B, T, N, H]`. Equals dense attention over positions [0, start + t] for
    query t, within fp32 rounding. Every query sees at least itself, so no row is empty.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    qf = _fold_heads(q, K)  # [B, K, G*T, H]
    scale = H ** -0.5

    def scores(keys):  # keys [B, K, Sk, H] -> [B, K, G, T, Sk] fp32
        s = jnp.einsum("bkqh,bksh->bkqs", qf, keys.astype(q.dtype), preferred_element_type=jnp.float32) * scale
        return s.reshape(B, K, G, T, -1)

    def accumulate(s, values):  # (unnormalized probabilities, their row max) and p @ values
        peak = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - peak)
        out = jnp.einsum("bkqs,bksh->bkqh", p.astype(v.dtype).reshape(B, K, G * T, -1), values.astype(v.dtype),
                         preferred_element_type=jnp.float32).reshape(B, K, G, T, H)
        return peak, jnp.sum(p, axis=-1, keepdims=True), out

    causal = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]  # [T, T]: key j <= query i
    s = jnp.where(causal, scores(k.transpose(0, 2, 1, 3)), _NEG)
    peak, total, out = accumulate(s, v.transpose(0, 2, 1, 3))

    def earlier(i, carry):  # merge key block i (positions [i*block, (i+1)*block), all before the chunk)
        peak, total, out = carry
        kb = jax.lax.dynamic_slice_in_dim(ck, i * block, block, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(cv, i * block, block, axis=2)
        b_peak, b_total, b_out = accumulate(scores(kb), vb)
        new_peak = jnp.maximum(peak, b_peak)
        old, new = jnp.exp(peak - new_peak), jnp.exp(b_peak - new_peak)
        return new_peak, total * old + b_total * new, out * old + b_out * new

    if not (isinstance(start, int) and start == 0):
        peak, total, out = jax.lax.fori_loop(0, start // block, earlier, (peak, total, out))
    return _unfold_heads((out / total).reshape(B, K, G * T, H).astype(v.dtype), N)


def _shard_specs(q: jax.Array, k: jax.Array) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec] | None:
    """Specs of q, k/v and segment ids for running attention per shard under the active rules, or
    None without a mesh. Heads are split only where q and kv heads split alike (query head n meets
    kv head n // G within each shard); otherwise they stay whole."""
    active = shd.active()
    if active is None:
        return None
    rules, mesh = active
    q_spec = tuple(shd.spec_for(("batch", "seq", "act_heads", "head_dim"), rules, mesh, q.shape))
    kv_spec = tuple(shd.spec_for(("batch", "seq", "kv_heads", "head_dim"), rules, mesh, k.shape))
    q_spec, kv_spec = (tuple(s) + (None,) * (4 - len(s)) for s in (q_spec, kv_spec))
    heads = q_spec[2] if q_spec[2] == kv_spec[2] else None
    rows = q_spec[0]
    return PartitionSpec(rows, None, heads, None), PartitionSpec(rows, None, heads, None), PartitionSpec(rows, None)


def training_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, impl: str, *,
                       platform: str | None = None, key_ends: jax.Array | None = None, **options) -> jax.Array:
    """Flash attention (kernels/flash_attention.py: causal within segments, padding queries get
    zeros) for the no-cache forward, per shard under the active mesh when the impl is a Pallas
    kernel. q `[B, T, N, H]`, k/v `[B, T, K, H]`, segment_ids `[B, T]` (0 = padding) or None ->
    `[B, T, N, H]`. impl: "auto", "reference" or "pallas"; platform and options as there.
    `key_ends [B, T]`: a prefix trie's mask (shared-prefix training), which only the jnp reference
    takes: it then runs whatever `impl`."""
    if key_ends is not None:  # jnp: XLA partitions it like any other code
        return flash.flash_attention(q, k, v, segment_ids, impl=impl, platform=platform, key_ends=key_ends)
    call = lambda q, k, v, s: flash.flash_attention(q, k, v, s, impl=impl, platform=platform, **options)  # noqa: E731
    specs = _shard_specs(q, k) if flash.resolve_impl(impl, platform) == "pallas" else None
    if specs is None:  # jnp: XLA partitions it like any other code
        return call(q, k, v, segment_ids)
    seg = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids
    q_spec, kv_spec, seg_spec = specs
    run = jax.shard_map(call, mesh=shd.active()[1], in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                        check_vma=False)
    return run(q, k, v, seg)


def prefill_kernel_attention(q: jax.Array, ck: jax.Array, cv: jax.Array, start: jax.Array | int, impl: str, *,
                             platform: str | None = None, **options) -> jax.Array:
    """`chunk_attention` by the platform's prefill kernel: q `[R, T, N, H]` at positions
    [start, start + T), ck/cv `[R, K, S, H]` the KV block already holding the chunk's own keys ->
    `[R, T, N, H]`. Per shard under the active mesh (rows and heads), as `training_attention`."""
    call = lambda q, k, v, s: prefill.prefill_attention(q, k, v, s, impl=impl, platform=platform, **options)  # noqa: E731
    R, _, _, H = q.shape
    specs = _shard_specs(q, jax.ShapeDtypeStruct((R, ck.shape[2], ck.shape[1], H), ck.dtype))
    start = jnp.asarray(start, jnp.int32)
    if specs is None:
        return call(q, ck, cv, start)
    q_spec, kv_spec, _ = specs
    block_spec = PartitionSpec(kv_spec[0], kv_spec[2], None, None)
    run = jax.shard_map(call, mesh=shd.active()[1], in_specs=(q_spec, block_spec, block_spec, PartitionSpec()),
                        out_specs=q_spec, check_vma=False)
    return run(q, ck, cv, start)
