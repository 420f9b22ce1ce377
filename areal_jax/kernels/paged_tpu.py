"""Paged decode attention for TPUs: jax's Pallas `ragged_paged_attention` (the kernel tpu-inference
serves with), called with one query per slot.

It reads a "combined" pool (kernels/paged_attention.py): pages `[P, S, 2K, H]` with a token's key
and value of kv head j at 2j and 2j + 1, so one DMA brings a page of both. The pool is built in that
layout (`PagePool.zeros(..., platform="tpu")`), never converted per step.

Its block sizes are passed explicitly: the kernel would otherwise look them up from
`jax.devices()[0]`, which is the host's CPU when the planner compiles for a TPU target without one.
The kernel copies whole blocks of pages (past a sequence's end it copies the sequence's first page
again), so a block is kept short: about 256 tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

from areal_jax.kernels.paged_attention import PagePool, register_pallas_kernel

MiB = 1 << 20


def block_sizes(num_slots: int, page_size: int, pages_per_slot: int, combined_heads: int, head_dim: int,
                itemsize: int, tokens_per_block: int = 256) -> tuple[int, int, int]:
    """(num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes) for one decode call."""
    kv_pages = max(1, min(pages_per_slot, tokens_per_block // page_size))
    queries = max(1, min(num_slots, 32))
    # Two buffers of a block of pages, the fp32 accumulator and running max / sum, with room to spare.
    need = 2 * kv_pages * page_size * combined_heads * head_dim * itemsize + 3 * queries * combined_heads * 128 * 4
    return kv_pages, queries, int(min(96 * MiB, max(32 * MiB, 4 * need)))


def ragged_arguments(q: jax.Array, pool: PagePool, lengths: jax.Array, page_tables: jax.Array) -> tuple:
    """The decode step as `ragged_paged_attention`'s (and its `ref_ragged_paged_attention`'s)
    positional arguments: slot b is sequence b, its one query token at position lengths[b] - 1."""
    if pool.layout != "combined":
        raise ValueError(f"ragged_paged_attention reads a 'combined' pool, got {pool.layout!r}")
    B = q.shape[0]
    return (q, pool.k,
            jnp.maximum(lengths, 1).astype(jnp.int32),  # the kernel wants kv_len >= q_len; empty slots are zeroed after
            page_tables.astype(jnp.int32),
            jnp.arange(B + 1, dtype=jnp.int32),  # cu_q_lens: one query per slot
            jnp.array([B], jnp.int32))  # num_seqs


@functools.partial(jax.jit, static_argnames=("tokens_per_block",))
def ragged_paged_decode(q: jax.Array, pool: PagePool, lengths: jax.Array, page_tables: jax.Array, *,
                        tokens_per_block: int = 256) -> jax.Array:
    """`reference_paged_attention`'s semantics on a "combined" pool, by `ragged_paged_attention`."""
    B, N, H = q.shape
    args = ragged_arguments(q, pool, lengths, page_tables)
    _, S, C, _ = pool.k.shape
    kv_pages, queries, vmem = block_sizes(B, S, page_tables.shape[1], C, H, pool.k.dtype.itemsize, tokens_per_block)
    out = ragged_paged_attention(*args, sm_scale=H ** -0.5, num_kv_pages_per_block=kv_pages,
                                 num_queries_per_block=queries, vmem_limit_bytes=vmem)
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)


# Scalar memory per TensorCore, as libtpu reports it when a program overflows it (v5e, v5p).
SMEM_BYTES = 1 << 20


def limits(head_dim: int, page_size: int, slots: int = 0, pages_per_slot: int = 0) -> str | None:
    """The kernel's running max and sum are 128 lanes wide, broadcast over the head dim; and it
    prefetches its scalar operands (the page table, lengths, query offsets) into SMEM, which libtpu
    refuses to overflow (`RESOURCE_EXHAUSTED ... prefetched SMEM operand`). `slots` are those of
    one kernel call (one replica's shard)."""
    if head_dim % 128:
        return f"head_dim {head_dim} must be a multiple of 128 (ragged_paged_attention's lanes)"
    scalars = 4 * (slots * pages_per_slot + 2 * slots + 2)  # page table, kv lens, cu_q_lens, num_seqs
    if scalars > SMEM_BYTES:
        most = (SMEM_BYTES // 4 - 2) // (pages_per_slot + 2)
        return (f"its page table ({slots} slots x {pages_per_slot} pages of {page_size} tokens x 4 B = "
                f"{4 * slots * pages_per_slot:,} B) and lengths must fit the TPU's {SMEM_BYTES:,}-byte SMEM: "
                f"at most {most} slots per replica at this page_size (EngineConfig.num_slots), or larger pages "
                f"(EngineConfig.page_size)")
    return None


register_pallas_kernel("tpu", ragged_paged_decode, layout="combined", name="ragged_paged", limits=limits)
