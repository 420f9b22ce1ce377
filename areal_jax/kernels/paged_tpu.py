"""Paged decode attention for TPUs: jax's Pallas `ragged_paged_attention` (the kernel tpu-inference
serves with), called with one query per slot.

It reads a "combined" pool (kernels/paged_attention.py): pages `[P, S, 2K, H]` with a token's key
and value of kv head j at 2j and 2j + 1, so one DMA brings a page of both. The pool is built in that
layout (`PagePool.zeros(..., platform="tpu")`), never converted per step.

Its block sizes are passed explicitly: the kernel would otherwise look them up from
`jax.devices()[0]`, which is the host's CPU when the planner compiles for a TPU target without one.
They come from the decode's own work (`block_sizes`):
- the query block: the kernel computes a whole query block against each sequence in it, so its
  default of 32 queries (sized for prefill) does 32x the work of a decode step's one query per
  sequence. A decode block holds the fewest queries whose query heads fill a sublane tile (8 rows):
  one sequence per block from 8 query heads per kv head, 8 at one.
- the kv block: whole pages, about 256 tokens (it copies whole blocks of pages, past a sequence's
  end the sequence's first page again, so a block is kept short); 64- to 256-token pages
  (`EngineConfig.page_size`) make it one to four DMAs and shrink the page table 4-16x from 16.
- `num_seqs`: the sequences up to the last live slot; the empty slots after it cost nothing (a
  live-slot batch, generation/live_slots.py, puts its padding rows last).
Its scalar operands live in the core's 1 MiB SMEM (`smem_bytes`, `limits`).

An FP8 pool: the kernel's `k_scale`/`v_scale` are one static float per call, so they are passed as
1.0 (which makes it upcast the e4m3 pages, via fp32, to the query's dtype in VMEM) and the pool's
per-kv-head scales are folded into the query and the output around it. Its e4m3 pages pack four to
a 32-bit word, so a call's combined heads 2K must be a multiple of 4 (XLA's tiling).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

from areal_jax.kernels.paged_attention import PagePool, fold_scales, register_pallas_kernel, unfold_scales

MiB = 1 << 20


SUBLANES = 8


def decode_queries_per_block(num_slots: int, q_heads_per_kv_head: int) -> int:
    """Queries (one per sequence) per block of a decode call: the fewest whose G query heads per kv
    head fill a sublane tile, at most the slots."""
    return max(1, min(num_slots, -(-SUBLANES // q_heads_per_kv_head)))


def block_sizes(num_slots: int, page_size: int, pages_per_slot: int, combined_heads: int, head_dim: int,
                itemsize: int, tokens_per_block: int = 256, q_heads_per_kv_head: int = 1) -> tuple[int, int, int]:
    """(num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes) for one decode call."""
    kv_pages = max(1, min(pages_per_slot, tokens_per_block // page_size))
    queries = decode_queries_per_block(num_slots, q_heads_per_kv_head)
    # Two buffers of a block of pages, the fp32 accumulator and running max / sum, with room to spare.
    need = 2 * kv_pages * page_size * combined_heads * head_dim * itemsize + 3 * queries * combined_heads * 128 * 4
    return kv_pages, queries, int(min(96 * MiB, max(32 * MiB, 4 * need)))


def ragged_arguments(q: jax.Array, pool: PagePool, lengths: jax.Array, page_tables: jax.Array) -> tuple:
    """The decode step as `ragged_paged_attention`'s (and its `ref_ragged_paged_attention`'s)
    positional arguments: slot b is sequence b, its one query token at position lengths[b] - 1. An
    FP8 pool's key scales are folded into the queries (`kernel_scales` gives the call's floats)."""
    if pool.layout != "combined":
        raise ValueError(f"ragged_paged_attention reads a 'combined' pool, got {pool.layout!r}")
    B = q.shape[0]
    live_end = jnp.max(jnp.where(lengths > 0, jnp.arange(1, B + 1, dtype=jnp.int32), 0))  # last live slot + 1
    return (fold_scales(q, pool), pool.k,
            jnp.maximum(lengths, 1).astype(jnp.int32),  # the kernel wants kv_len >= q_len; empty slots are zeroed after
            page_tables.astype(jnp.int32),
            jnp.arange(B + 1, dtype=jnp.int32),  # cu_q_lens: one query per slot
            live_end.reshape(1))  # num_seqs: the slots after the last live one are skipped


def kernel_scales(pool: PagePool) -> dict:
    """The kernel's k_scale / v_scale: 1.0 for an FP8 pool (upcast, the real scales folded), else none."""
    return dict(k_scale=1.0, v_scale=1.0) if pool.quantized else {}


@functools.partial(jax.jit, static_argnames=("tokens_per_block",))
def ragged_paged_decode(q: jax.Array, pool: PagePool, lengths: jax.Array, page_tables: jax.Array, *,
                        tokens_per_block: int = 256) -> jax.Array:
    """`reference_paged_attention`'s semantics on a "combined" pool, by `ragged_paged_attention`."""
    B, N, H = q.shape
    args = ragged_arguments(q, pool, lengths, page_tables)
    _, S, C, _ = pool.k.shape
    kv_pages, queries, vmem = block_sizes(B, S, page_tables.shape[1], C, H, pool.k.dtype.itemsize, tokens_per_block,
                                          q_heads_per_kv_head=N // (C // 2))
    out = ragged_paged_attention(*args, sm_scale=H ** -0.5, num_kv_pages_per_block=kv_pages,
                                 num_queries_per_block=queries, vmem_limit_bytes=vmem, **kernel_scales(pool))
    # Rows the kernel skipped (past num_seqs) hold whatever the output buffer held: zeroed here.
    return jnp.where((lengths > 0)[:, None, None], unfold_scales(out, pool), 0).astype(q.dtype)


# Scalar memory per TensorCore, as libtpu reports it when a program overflows it (v5e, v5p).
SMEM_BYTES = 1 << 20


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


# Page sizes for TPU pools: a page is one DMA of the kernel's kv block (256 tokens), and 16-token
# pages leave the page table 4-16x the SMEM of these.
PAGE_SIZES = (64, 128, 256)


def smem_bytes(slots: int, pages_per_slot: int) -> int:
    """SMEM the kernel's prefetched scalars take: the page table `[slots, pages]` padded to (8, 128)
    words, as libtpu allocates it (a deviceless v5e compile of 230 x 1,088 asked for 1,069,056 B =
    232 x 1,152 x 4; 262 x 1,000 for 264 x 1,024 x 4), the lengths and query offsets (1-D, taken as
    padded to 128 words) and two small scalars (128 words each, a bound: 256 x 1,000 overflowed by
    4.6 KB with its page table at exactly 1 MiB, and 1,000 x 250 fit)."""
    return 4 * (_up(slots, 8) * _up(pages_per_slot, 128) + _up(slots, 128) + _up(slots + 1, 128) + 2 * 128)


def most_slots(pages_per_slot: int) -> int:
    """The most slots per kernel call whose scalars fit SMEM at `pages_per_slot` pages each."""
    slots = max(0, (SMEM_BYTES // 4) // _up(pages_per_slot, 128) // 8 * 8)
    while slots > 0 and smem_bytes(slots, pages_per_slot) > SMEM_BYTES:
        slots -= 1
    return slots


def limits(head_dim: int, page_size: int, slots: int = 0, pages_per_slot: int = 0, kv_heads: int = 0,
           kv_itemsize: int = 0) -> str | None:
    """The kernel's running max and sum are 128 lanes wide, broadcast over the head dim; it
    prefetches its scalar operands (the page table, lengths, query offsets) into SMEM, which libtpu
    refuses to overflow (`RESOURCE_EXHAUSTED ... prefetched SMEM operand`); and its combined heads
    2K must tile whole 32-bit words (`get_min_heads_per_blk`). `slots` and `kv_heads` are those of
    one kernel call (one replica's, one tensor shard's)."""
    if head_dim % 128:
        return f"head_dim {head_dim} must be a multiple of 128 (ragged_paged_attention's lanes)"
    packing = 4 // kv_itemsize if kv_itemsize in (1, 2) else 1
    words = 2 * kv_heads // packing
    if kv_heads and ((2 * kv_heads) % packing or not (words in (1, 2, 4, 8) or words % 8 == 0)):
        return (f"{kv_heads} kv head(s) per call give {2 * kv_heads} combined heads of {kv_itemsize}-byte values, "
                f"which XLA cannot tile ({packing} to a 32-bit word; ragged_paged_attention's "
                "get_min_heads_per_blk): fewer tensor shards per replica (MeshConfig.generation_tensor) or "
                "EngineConfig.kv_dtype bfloat16")
    if slots and smem_bytes(slots, pages_per_slot) > SMEM_BYTES:
        table = 4 * _up(slots, 8) * _up(pages_per_slot, 128)
        larger = next((p for p in PAGE_SIZES if p > page_size
                       and smem_bytes(slots, -(-pages_per_slot * page_size // p)) <= SMEM_BYTES), None)
        return (f"its page table ({slots} slots x {pages_per_slot} pages of {page_size} tokens x 4 B, padded "
                f"to (8, 128) words: {table:,} B) and lengths must fit the TPU's {SMEM_BYTES:,}-byte SMEM: "
                f"at most {most_slots(pages_per_slot)} slots per replica at this page_size "
                "(EngineConfig.num_slots), or larger pages (EngineConfig.page_size"
                + (f" = {larger} fits {slots} slots)" if larger else ": none of 64-256 tokens fits these slots)"))
    return None


register_pallas_kernel("tpu", ragged_paged_decode, layout="combined", name="ragged_paged", limits=limits)
