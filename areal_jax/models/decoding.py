"""The decoder's generation entry points: what the engine runs over a KV cache, dense or paged.

The layers are models/transformer.py's (the same weights and numerics as `forward`); here they
are driven the ways decoding needs: packed prefills written straight into cache slots or pages,
one decode step over paged pools, and a chunked prefill into a fresh block whose intermediates
never exceed one chunk. Dimension letters as in ModelConfig.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from areal_jax.kernels.paged_attention import PagePool, flat_index, stacked_page, write_layer, write_tokens
from areal_jax.models import moe
from areal_jax.kernels import flash_attention as flash
from areal_jax.kernels import prefill_attention as prefill
from areal_jax.models.attention import chunk_attention, prefill_kernel_attention, training_attention
from areal_jax.models.config import ModelConfig
from areal_jax.models.sharding import constrain
from areal_jax.models.transformer import (KVCache, Params, Rotary, attention_inputs, decoder_layer, embed_tokens,
                                          layer_output, lm_head, rms_norm, segment_positions, self_attention_mask,
                                          split_layers)


def _packed_inputs(params: Params, cfg: ModelConfig, input_ids: jax.Array, segment_ids: jax.Array, compute_dtype,
                   attention_impl: str, platform: str | None, *, positions: jax.Array | None = None,
                   key_ends: jax.Array | None = None):
    """What every layer of a packed prefill shares: positions `[R, W]` (within segments unless
    given: a trie's nodes' depths), the rotary table, the attention (a flash kernel's closure, or
    None and the packed mask; with a trie's `key_ends` the kernel runs the jnp reference, as
    shared-prefix training does) and the embedded tokens."""
    R, W = input_ids.shape
    positions = segment_positions(segment_ids) if positions is None else positions
    attend = None
    if flash.resolve_impl(attention_impl, platform) == "pallas":
        attend = lambda q, k, v: training_attention(q, k, v, segment_ids, attention_impl,  # noqa: E731
                                                    platform=platform, key_ends=key_ends)
    mask = self_attention_mask(R, W, segment_ids, key_ends) if attend is None else None
    return positions, Rotary.at(cfg, positions), attend, mask, embed_tokens(params, input_ids, compute_dtype)


def packed_kv(params: Params, cfg: ModelConfig, input_ids: jax.Array, segment_ids: jax.Array, compute_dtype, *,
              attention_impl: str = "reference", platform: str | None = None, positions: jax.Array | None = None,
              key_ends: jax.Array | None = None) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
    """Positions within each segment `[R, W]` and every layer's keys and values `[R, W, K, H]` of
    packed rows (attention causal within each segment). `attention_impl` resolving to a flash
    kernel on `platform` (kernels/flash_attention.py: GPU, TPU) attends by it; else the blocked
    formula under the packed mask. `positions`, `key_ends`: rows of prefix tries (`TrieRows`)."""
    positions, rope, attend, mask, x = _packed_inputs(params, cfg, input_ids, segment_ids, compute_dtype,
                                                      attention_impl, platform, positions=positions,
                                                      key_ends=key_ends)
    out = []
    # The last layer's attention output and MLP feed nothing returned, so XLA drops them.
    for i, p in enumerate(split_layers(params)["layers"]):
        x, kv, _ = decoder_layer(cfg, rope, x, p, mask, None, None, compute_dtype, attend=attend, layer=i,
                                 valid=segment_ids > 0)
        out.append(kv)
    return positions, out


def prefill_into_slots(params: Params, cfg: ModelConfig, input_ids: jax.Array, segment_ids: jax.Array,
                       slot_ids: jax.Array, cache: KVCache, *, compute_dtype=None, attention_impl: str = "reference",
                       platform: str | None = None) -> KVCache:
    """Writes the keys and values of packed sequences straight into a per-layer decode cache.

    input_ids, segment_ids, slot_ids `[R, W]`: rows of several sequences each (segment 0 =
    padding); every token of a segment goes to cache slot `slot_ids` at its position within the
    segment, so a sequence must start at position 0 of its slot. Attention is causal within each
    segment, so each slot receives what a prefill of its sequence alone would give. No logits:
    this recomputes the cache of sequences already being decoded (after a weight swap), whose
    next input token is known. cache: `KVCache.per_layer()`, L x `[B, K, S, H]`. attention_impl,
    platform: the packed rows' attention (`packed_kv`).
    """
    positions, kvs = packed_kv(params, cfg, input_ids, segment_ids, compute_dtype or params["embed"].dtype,
                               attention_impl=attention_impl, platform=platform)
    B = cache.k[0].shape[0]
    dest = jnp.where(segment_ids > 0, slot_ids, B)  # slot B is out of range: padding writes nothing
    new_k, new_v = [], []
    for (k, v), ck, cv in zip(kvs, cache.k, cache.v, strict=True):  # k, v [R, W, K, H]
        new_k.append(ck.at[dest, :, positions].set(k.astype(ck.dtype), mode="drop"))
        new_v.append(cv.at[dest, :, positions].set(v.astype(cv.dtype), mode="drop"))
    return KVCache(tuple(new_k), tuple(new_v))


def prefill_into_pages(params: Params, cfg: ModelConfig, input_ids: jax.Array, segment_ids: jax.Array,
                       slot_ids: jax.Array, pools: tuple[PagePool, ...] | PagePool, page_tables: jax.Array, *,
                       compute_dtype=None, attention_impl: str = "reference", platform: str | None = None,
                       pages_per_replica: int | None = None) -> tuple[PagePool, ...] | PagePool:
    """`prefill_into_slots` for a paged cache: each token goes to its slot's page for its position.
    pools: L per-layer `PagePool`s, or one stacked pool (generation/paged.py; `pages_per_replica`
    given), which the layers then fill as a scan, each writing its keys and values as it goes;
    page_tables `[B, M]` (every slot's pages, global ids)."""
    R, W = input_ids.shape
    compute_dtype = compute_dtype or params["embed"].dtype
    tables = page_tables[jnp.clip(slot_ids, 0, page_tables.shape[0] - 1)].reshape(R * W, -1)  # [R*W, M]
    if isinstance(pools, PagePool):
        positions, rope, attend, mask, x = _packed_inputs(params, cfg, input_ids, segment_ids, compute_dtype,
                                                          attention_impl, platform)
        write_at = jnp.where(segment_ids > 0, positions, -1).reshape(R * W, 1)

        def layer(carry, xs):
            x, pool = carry
            p, i = xs
            x, (k, v), _ = decoder_layer(cfg, rope, x, p, mask, None, None, compute_dtype, attend=attend, layer=i,
                                         valid=segment_ids > 0)
            index = flat_index(stacked_page(tables, i, cfg.num_layers, pages_per_replica), write_at, pool.page_size)
            pool = write_layer(pool, i, k.reshape(R * W, *k.shape[2:]), v.reshape(R * W, *v.shape[2:]), index[:, 0],
                               calibrate=True)
            return (x, pool), None

        (_, pools), _ = jax.lax.scan(layer, (x, pools), (params["layers"], jnp.arange(cfg.num_layers)))
        return pools
    positions, kvs = packed_kv(params, cfg, input_ids, segment_ids, compute_dtype,
                               attention_impl=attention_impl, platform=platform)
    index = flat_index(tables, jnp.where(segment_ids > 0, positions, -1).reshape(R * W, 1), pools[0].page_size)
    return tuple(write_tokens(pool, k.reshape(R * W, *k.shape[2:]), v.reshape(R * W, *v.shape[2:]), index[:, 0],
                              calibrate=True)
                 for (k, v), pool in zip(kvs, pools, strict=True))


class TrieRows(NamedTuple):
    """Packed re-prefill rows laid out as prefix tries (generation/reprefill_trie.py), so a prefix
    that several histories share (a group's prompt) is computed once. Per row r (W = pack width,
    E = write entries per row):
      input_ids, positions, segment_ids, key_ends `[R, W]`: each trie node's token, its position
        in the sequences through it, its trie's number in the row (0 = padding) and the end of its
        subtree, so a node attends exactly to its ancestors (`models.transformer.self_attention_mask`);
      write_node, write_slot, write_pos `[R, E]`: every (slot, position) a history fills, from the
        node of row r holding that token (write_pos < 0: no write)."""

    input_ids: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    key_ends: jax.Array
    write_node: jax.Array
    write_slot: jax.Array
    write_pos: jax.Array


def _trie_kv(params: Params, cfg: ModelConfig, trie: TrieRows, compute_dtype, **attention):
    """Every layer's keys and values `[R, W, K, H]` of the trie rows' nodes."""
    return packed_kv(params, cfg, trie.input_ids, trie.segment_ids, compute_dtype, positions=trie.positions,
                     key_ends=trie.key_ends, **attention)[1]


def _written(trie: TrieRows, x: jax.Array) -> jax.Array:
    """Node values `[R, W, ...]` -> the write entries' `[R * E, ...]` (a gather within each row,
    so rows sharded over "data" stay on their devices)."""
    R, E = trie.write_node.shape
    node = jnp.clip(trie.write_node, 0, x.shape[1] - 1).reshape(R, E, *(1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, node, axis=1).reshape(R * E, *x.shape[2:])


def prefill_trie_into_slots(params: Params, cfg: ModelConfig, trie: TrieRows, cache: KVCache, *,
                            compute_dtype=None, attention_impl: str = "reference",
                            platform: str | None = None) -> KVCache:
    """`prefill_into_slots` of histories packed as prefix tries: each node is computed once and
    its keys and values go to every slot whose history holds it."""
    kvs = _trie_kv(params, cfg, trie, compute_dtype or params["embed"].dtype, attention_impl=attention_impl,
                   platform=platform)
    B = cache.k[0].shape[0]
    pos = trie.write_pos.reshape(-1)
    dest = jnp.where(pos >= 0, trie.write_slot.reshape(-1), B)  # slot B is out of range: writes nothing
    pos = jnp.maximum(pos, 0)
    new_k, new_v = [], []
    for (k, v), ck, cv in zip(kvs, cache.k, cache.v, strict=True):
        new_k.append(ck.at[dest, :, pos].set(_written(trie, k).astype(ck.dtype), mode="drop"))
        new_v.append(cv.at[dest, :, pos].set(_written(trie, v).astype(cv.dtype), mode="drop"))
    return KVCache(tuple(new_k), tuple(new_v))


def prefill_trie_into_pages(params: Params, cfg: ModelConfig, trie: TrieRows,
                            pools: tuple[PagePool, ...] | PagePool, page_tables: jax.Array, *, compute_dtype=None,
                            attention_impl: str = "reference", platform: str | None = None,
                            pages_per_replica: int | None = None) -> tuple[PagePool, ...] | PagePool:
    """`prefill_into_pages` of histories packed as prefix tries (`prefill_trie_into_slots` for a
    paged cache): per-layer pools, or one stacked pool filled as a scan of the layers."""
    R, E = trie.write_slot.shape
    compute_dtype = compute_dtype or params["embed"].dtype
    tables = page_tables[jnp.clip(trie.write_slot, 0, page_tables.shape[0] - 1)].reshape(R * E, -1)  # [R*E, M]
    write_at = trie.write_pos.reshape(R * E, 1)
    if isinstance(pools, PagePool):
        _, rope, attend, mask, x = _packed_inputs(params, cfg, trie.input_ids, trie.segment_ids, compute_dtype,
                                                  attention_impl, platform, positions=trie.positions,
                                                  key_ends=trie.key_ends)

        def layer(carry, xs):
            x, pool = carry
            p, i = xs
            x, (k, v), _ = decoder_layer(cfg, rope, x, p, mask, None, None, compute_dtype, attend=attend, layer=i,
                                         valid=trie.segment_ids > 0)
            index = flat_index(stacked_page(tables, i, cfg.num_layers, pages_per_replica), write_at, pool.page_size)
            pool = write_layer(pool, i, _written(trie, k), _written(trie, v), index[:, 0], calibrate=True)
            return (x, pool), None

        (_, pools), _ = jax.lax.scan(layer, (x, pools), (params["layers"], jnp.arange(cfg.num_layers)))
        return pools
    kvs = _trie_kv(params, cfg, trie, compute_dtype, attention_impl=attention_impl, platform=platform)
    index = flat_index(tables, write_at, pools[0].page_size)
    return tuple(write_tokens(pool, _written(trie, k), _written(trie, v), index[:, 0], calibrate=True)
                 for (k, v), pool in zip(kvs, pools, strict=True))


# (pool, q [B, N, H], k [B, K, H], v [B, K, H], positions [B], layer) -> (pool, attention [B, N, H]):
# writes each slot's new token at its position (< 0: inactive, nothing written) and attends over
# its pages; `layer` picks the layer's pages of a stacked pool (ignored for a per-layer one).
PagedAttend = Callable[..., tuple[PagePool, jax.Array]]
# (pool, q [R, W, N, H], k, v [R, W, K, H], positions [R, W], tables [R, M], layer) -> (pool,
# attention [R, W, N, H]): the same for the re-prefill rows a decode step carries (`RideRows`).
RideAttend = Callable[..., tuple[PagePool, jax.Array]]


class RideRows(NamedTuple):
    """Re-prefill rows one decode step carries beside its decode rows (EngineConfig.
    reprefill_in_decode_rows): row r holds W consecutive tokens of one slot's history.
      tokens, positions `[R, W]`: the tokens and their positions (< 0: padding, nothing written);
      tables `[R, M]`: the row's slot's page table (global page ids).
    Rows are ordered by data replica like the decode rows (a replica's rows are its own slots')."""

    tokens: jax.Array
    positions: jax.Array
    tables: jax.Array


def _merged(decode: jax.Array, ride: jax.Array, replicas: int) -> jax.Array:
    """Decode rows `[B, ...]` and ride tokens `[R*W, ...]` as one batch `[B + R*W, ...]` in which
    each replica's share holds its own decode rows then its own ride tokens, so rows sharded over
    "data" stay on their replica."""
    def per(x):
        return x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])
    both = jnp.concatenate([per(decode), per(ride)], axis=1)
    return both.reshape(decode.shape[0] + ride.shape[0], *decode.shape[1:])


def _parted(x: jax.Array, decode_rows: int, replicas: int) -> tuple[jax.Array, jax.Array]:
    """`_merged`'s inverse: `[B + R*W, ...]` -> (decode rows `[B, ...]`, ride tokens `[R*W, ...]`)."""
    per = x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])
    b = decode_rows // replicas
    flat = lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])  # noqa: E731
    return flat(per[:, :b]), flat(per[:, b:])


def paged_decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                      pools: tuple[PagePool, ...] | PagePool, attend: PagedAttend, *, compute_dtype=None,
                      return_routing: bool = False, ride: RideRows | None = None, attend_ride: RideAttend | None = None,
                      replicas: int = 1):
    """One decode step over a paged cache: tokens, positions `[B]` (position < 0: an inactive slot)
    -> logits `[B, V]` (fp32) and the pools with each token's key and value written. Over per-layer
    pools the layers run unrolled (each pool updated in place, weights split per layer or
    stacked); over one stacked pool (stacked weights) they run as a scan, the pool carried and
    written in place. `attend` writes and reads a layer's pages (generation/ builds it from the
    page tables, per data replica on a mesh). With `return_routing` (MoE models) a third value:
    the tokens' experts `[B, L_moe, k]` (`moe.record`).

    With `ride` (`RideRows`, attended by `attend_ride`; `replicas`: the data replicas both sets of
    rows lie over) the step also writes the keys and values of those history tokens, in the same
    pass: every projection and MLP runs once over the B decode rows and the R*W ride tokens
    together, so the weights are read once for both. Ride tokens get no logits."""
    compute_dtype = compute_dtype or params["embed"].dtype
    B = tokens.shape[0]
    if ride is not None:
        R, W = ride.tokens.shape
        tokens = _merged(tokens, ride.tokens.reshape(R * W), replicas)
        every_position = _merged(positions, ride.positions.reshape(R * W), replicas)
    else:
        every_position = positions
    rope = Rotary.at(cfg, jnp.maximum(every_position, 0)[:, None])
    x = embed_tokens(params, tokens[:, None], compute_dtype)
    valid = (every_position >= 0)[:, None]

    def attention(pool, q, k, v, i):  # q [T, N, H], k, v [T, K, H] over every row of the step
        if ride is None:
            return attend(pool, q, k, v, positions, i)
        (qd, qr), (kd, kr), (vd, vr) = (_parted(a, B, replicas) for a in (q, k, v))
        pool, decoded = attend(pool, qd, kd, vd, positions, i)
        rows = lambda a: a.reshape(R, W, *a.shape[1:])  # noqa: E731
        pool, ridden = attend_ride(pool, rows(qr), rows(kr), rows(vr), ride.positions, ride.tables, i)
        return pool, _merged(decoded, ridden.reshape(R * W, *ridden.shape[2:]), replicas)

    def layer(x, p, pool, i):
        q, k, v = attention_inputs(cfg, rope, x, p, compute_dtype)
        pool, attn = attention(pool, q[:, 0], k[:, 0], v[:, 0], i)
        x, routing = layer_output(cfg, x, attn[:, None].astype(compute_dtype), p, compute_dtype, i, valid=valid)
        if routing is None:
            return x, pool, None
        experts = routing.experts[:, 0]  # [T, k]
        return x, pool, experts if ride is None else _parted(experts, B, replicas)[0]

    if isinstance(pools, PagePool):
        def body(carry, xs):
            (x, pool), (p, i) = carry, xs
            x, pool, experts = layer(x, p, pool, i)
            return (x, pool), experts

        (x, new), experts = jax.lax.scan(body, (x, pools), (params["layers"], jnp.arange(cfg.num_layers)))
    else:
        new, experts = [], []
        for i, (p, pool) in enumerate(zip(split_layers(params)["layers"], pools, strict=True)):
            x, pool, chosen = layer(x, p, pool, i)
            new.append(pool)
            experts.append(chosen)
        new = tuple(new)
    if ride is not None:
        x = _parted(x, B, replicas)[0]
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    out = lm_head(params, cfg, x)[:, 0], new
    if not return_routing:
        return out
    return (*out, moe.record(cfg, experts) if cfg.moe is not None else None)


def prefill_block(params: Params, cfg: ModelConfig, input_ids: jax.Array, lengths: jax.Array, *, chunk: int,
                  cache_dtype, compute_dtype=None, return_routing: bool = False, attention_impl: str = "reference",
                  platform: str | None = None, scan_layers: bool = False):
    """Prefills rows into a fresh per-layer KV block, `chunk` query tokens at a time.

    input_ids `[R, P]` (row r holds `lengths[r]` tokens at positions 0.. and padding after) ->
    (KVCache of L `[R, K, P, H]` blocks holding each row's keys and values, zeros past its length;
    final-norm hidden state of each row's last token `[R, D]`). Chunk c (a `lax.scan` step; a
    shorter last chunk runs after the scan) writes its keys into the block and attends to itself
    and to the earlier positions already there (`chunk_attention`), so no intermediate is larger
    than `[R, chunk, ...]` activations and `[R, K, G*chunk, chunk]` scores: a dense prefill's
    `[R, K, G*P, P]` fp32 scores are tens of GB for a 16k-token history. Equals the cached
    `forward` over the whole row (cache and last-token hidden state) within fp32 rounding.
    With `return_routing` (MoE models) a third value: the experts of every token `[R, P, L_moe, k]`
    (`moe.record`; zeros past a row's length), what the engine records for routing replay.
    `attention_impl` resolving to a prefill kernel on `platform` that takes these shapes
    (kernels/prefill_attention.py: GPU, TPU): each chunk's keys go into the block first and the
    kernel attends over the block; else `chunk_attention`. `scan_layers` (stacked weights): each
    chunk runs the layers as a scan and the block is stacked, `[L, R, K, P, H]` keys and values.
    """
    R, P_out = input_ids.shape
    compute_dtype = compute_dtype or params["embed"].dtype
    L = cfg.num_layers
    # A kernel that cannot take the block's length (a long-history bucket of max_seq_len, say
    # 17,424) runs on a block padded to one it takes; the padding positions are past every row's
    # length and are cut off the result.
    P = prefill.kernel_block_len(attention_impl, platform, cfg.head_dim, P_out, min(chunk, P_out))
    if P != P_out:
        input_ids = jnp.pad(input_ids, ((0, 0), (0, P - P_out)))
    C = min(chunk, P)
    full, tail = divmod(P, C)
    kernel = prefill.kernel_fits(attention_impl, platform, cfg.head_dim, P, C)
    shape = (R, cfg.num_kv_heads, P, cfg.head_dim)
    axes = ("batch", "kv_heads", None, "head_dim")
    if scan_layers:
        shape, axes = (L, *shape), (None, *axes)
    zeros = lambda: constrain(jnp.zeros(shape, cache_dtype), axes)  # noqa: E731

    record = return_routing and cfg.moe is not None

    def run(carry, ids, start):
        """One chunk `ids [R, Cq]` at positions [start, start + Cq) (start: int or traced)."""
        block_k, block_v, last, chosen = carry
        Cq = ids.shape[1]
        positions = jnp.broadcast_to(start + jnp.arange(Cq, dtype=jnp.int32), (R, Cq))
        valid = (positions < lengths[:, None])[:, :, None, None]
        rope = Rotary.at(cfg, positions)
        x = embed_tokens(params, ids, compute_dtype)

        def layer(x, p, ck, cv, i):
            """Layer i over the chunk, its block ck, cv `[R, K, P, H]`: the chunk's keys and values
            `[R, K, Cq, H]`, the block with them written, and the layer's experts `[R, Cq, k]`."""
            q, k, v = attention_inputs(cfg, rope, x, p, compute_dtype)
            # Rounded to the cache dtype first: the chunk attends to its keys as they will be stored.
            k, v = (jnp.where(valid, a, 0).astype(cache_dtype) for a in (k, v))  # padding stores zeros
            nk = jax.lax.dynamic_update_slice_in_dim(ck, k.transpose(0, 2, 1, 3), start, axis=2)
            nv = jax.lax.dynamic_update_slice_in_dim(cv, v.transpose(0, 2, 1, 3), start, axis=2)
            if kernel:
                attn = prefill_kernel_attention(q, nk, nv, start, attention_impl, platform=platform)
            else:
                attn = chunk_attention(q, k.astype(compute_dtype), v.astype(compute_dtype), ck, cv, start, C)
            x, routing = layer_output(cfg, x, attn, p, compute_dtype, i, valid=valid[:, :, 0, 0])
            written = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
            return x, written, (nk, nv), None if routing is None else routing.experts

        if scan_layers:
            def body(carry, xs):
                x, blocks_k, blocks_v = carry
                p, i = xs
                x, (k, v), _, experts = layer(x, p, blocks_k[i], blocks_v[i], i)
                # The chunk goes into the stacked block in place (the layer's slice read above is
                # a copy, which only the layer's own attention reads).
                at = (i, 0, 0, start, 0)
                return (x, jax.lax.dynamic_update_slice(blocks_k, k[None], at),
                        jax.lax.dynamic_update_slice(blocks_v, v[None], at)), experts

            (x, new_k, new_v), experts = jax.lax.scan(body, (x, block_k, block_v),
                                                      (params["layers"], jnp.arange(L)))
        else:
            new_k, new_v, experts = [], [], []
            for i, (p, ck, cv) in enumerate(zip(split_layers(params)["layers"], block_k, block_v, strict=True)):
                x, _, (nk, nv), layer_experts = layer(x, p, ck, cv, i)
                new_k.append(nk)
                new_v.append(nv)
                experts.append(layer_experts)
            new_k, new_v = tuple(new_k), tuple(new_v)
        at = lengths - 1 - start  # the row's last token, if this chunk holds it
        here = (at >= 0) & (at < Cq)
        picked = jnp.take_along_axis(x, jnp.clip(at, 0, Cq - 1)[:, None, None], axis=1)[:, 0]
        if record:  # padding positions record zeros
            part = jnp.where(valid[:, :, :, :1], moe.record(cfg, experts), 0).astype(chosen.dtype)  # [R, Cq, L_moe, k]
            chosen = jax.lax.dynamic_update_slice_in_dim(chosen, part, start, axis=1)
        return new_k, new_v, jnp.where(here[:, None], picked, last), chosen

    chosen = (jnp.zeros((R, P, len(moe.sparse_layer_ids(cfg)), cfg.moe.num_experts_per_tok), moe.record_dtype(cfg))
              if record else None)  # [R, P, L_moe, k]
    blocks = ((zeros(), zeros()) if scan_layers
              else (tuple(zeros() for _ in range(L)), tuple(zeros() for _ in range(L))))
    carry = (*blocks, jnp.zeros((R, cfg.hidden_size), compute_dtype), chosen)
    if full == 1:
        carry = run(carry, input_ids[:, :C], 0)
    else:  # one compiled chunk, whatever the length
        chunks = input_ids[:, :full * C].reshape(R, full, C).transpose(1, 0, 2)  # [chunks, R, C]

        def body(carry, xs):
            ids, c = xs
            return run(carry, ids, c * C), None

        carry, _ = jax.lax.scan(body, carry, (chunks, jnp.arange(full, dtype=jnp.int32)))
    if tail:
        carry = run(carry, input_ids[:, full * C:], full * C)
    block_k, block_v, last, chosen = carry
    if P != P_out and scan_layers:
        block_k, block_v = block_k[:, :, :, :P_out], block_v[:, :, :, :P_out]
    elif P != P_out:
        block_k, block_v = (tuple(b[:, :, :P_out] for b in blocks) for blocks in (block_k, block_v))
        chosen = chosen[:, :P_out] if record else chosen
    out = KVCache(block_k, block_v), rms_norm(last, params["final_norm"], cfg.rms_norm_eps)
    return (*out, chosen) if return_routing else out
