"""Paged decode attention for GPUs: a Pallas Triton kernel that reads each slot's pages by its page
table, only up to the slot's length, with an online softmax over blocks of pages.

Why our own kernel: in jax 0.12 every Triton kernel under `jax.experimental.pallas.ops.gpu` is
deprecated (`paged_attention`, `decode_attention`, `attention`), `decode_attention` is not paged
(a gather of pages first would read what paging saves), and the Mosaic GPU kernels offer no paged
decode. This one is small and does what the engine needs: one query per slot, GQA, pages in any
order, ragged lengths.

Dimension letters as in kernels/paged_attention.py, plus:
  Gp  query heads of one kv head, padded to a power of two >= 16 (Triton's dot wants M >= 16;
      the padding costs arithmetic only, the pages are read once per kv head either way)
  C   pages read per block of the online softmax     X  splits of a slot's pages (run in parallel)

Grid (B, K, X): one program per slot, kv head and split. Each reads the pages of its split up to the
slot's length and writes an unnormalised output with its running max and sum; the splits are merged
in jnp. X is chosen per call from its static shapes (`auto_splits`): when B x K programs would
leave SMs idle (a live-slot batch of 16 x 8 kv heads is 128 programs on an H200's 132 SMs), each
slot's pages are split so about two programs run per SM, as long as every split keeps a block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from areal_jax.kernels.paged_attention import PagePool, fold_scales, register_pallas_kernel, unfold_scales

_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(mask - max) is 0, never NaN


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _kernel(lengths_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, pages_per_block: int,
            pages_per_split: int, scale: float):
    # lengths_ref [1], tables_ref [pages_per_split], q_ref [Gp, H], k_ref/v_ref [P, S, H]
    split = pl.program_id(2)
    Gp, H = q_ref.shape
    S = k_ref.shape[1]
    C = pages_per_block
    length = lengths_ref[0]
    first_page = split * pages_per_split
    live_pages = jnp.clip(pl.cdiv(length, S) - first_page, 0, pages_per_split)
    q = q_ref[...]

    def block(i, carry):
        o, m, l = carry
        pages = tables_ref[pl.ds(i * C, C)]  # [C]
        k = k_ref[pages].reshape(C * S, H)
        v = v_ref[pages].reshape(C * S, H)
        if k.dtype == jnp.float8_e4m3fn:  # FP8 pages: upcast in registers (their scales are folded outside)
            v = v.astype(q.dtype)
        s = plgpu.dot(q, k.astype(q.dtype), trans_b=True) * scale  # [Gp, C*S] fp32
        position = (first_page + i * C) * S + jnp.arange(C * S)
        s = jnp.where((position < length)[None, :], s, _MASK)
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = l * correction + p.sum(axis=-1)
        o_new = o * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return o_new, m_new, l_new

    init = (jnp.zeros((Gp, H), jnp.float32), jnp.full((Gp,), _MASK, jnp.float32), jnp.zeros((Gp,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, pl.cdiv(live_pages, C), block, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def limits(head_dim: int, page_size: int, slots: int = 0, pages_per_slot: int = 0, kv_heads: int = 0,
           kv_itemsize: int = 0) -> str | None:
    """Triton loads blocks whose sizes are powers of two (the page table stays in HBM: any size)."""
    if not (_pow2(page_size) and _pow2(head_dim)):
        return f"page_size {page_size} and head_dim {head_dim} must be powers of two (Triton's loads)"
    return None


# SMs of the GPU the programs are for: the device's when one is attached, else an H100/H200's (132),
# the planner's deviceless targets.
DEFAULT_SM_COUNT = 132


def sm_count() -> int:
    try:
        return int(getattr(jax.devices("gpu")[0], "core_count", 0)) or DEFAULT_SM_COUNT
    except RuntimeError:  # no GPU backend: compiling for a target
        return DEFAULT_SM_COUNT


def auto_splits(slots: int, kv_heads: int, blocks_per_slot: int, sms: int) -> int:
    """Splits of each slot's page table: 1 when slots x kv_heads programs reach 2x the SMs, else
    enough to reach it, at most one per online-softmax block of the table (a split with no block
    would only add a merge)."""
    programs = slots * kv_heads
    if programs >= 2 * sms:
        return 1
    return max(1, min(-(-2 * sms // programs), blocks_per_slot))


@functools.partial(jax.jit, static_argnames=("pages_per_block", "splits", "num_warps", "num_stages", "interpret"))
def pallas_triton_paged_attention(q: jax.Array, pool: PagePool, lengths: jax.Array, page_tables: jax.Array, *,
                                  pages_per_block: int | None = None, splits: int | None = None, num_warps: int = 4,
                                  num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """`reference_paged_attention`'s semantics on a "heads" pool; reads only live pages. An FP8
    pool's pages are read as bytes and upcast in the kernel; its per-kv-head scales are folded into
    q (keys) and the output (values) around it.

    pages_per_block: pages per online-softmax block (a power of two; default: 128 tokens' worth).
    splits: programs per slot and kv head, each over a contiguous share of the page table (default:
    `auto_splits` for this call's shapes and the GPU's SMs).
    interpret: run the kernel in Pallas' interpreter (CPU, tests)."""
    if pool.layout != "heads":
        raise ValueError(f"pallas_triton_paged_attention reads a 'heads' pool, got {pool.layout!r}")
    B, N, H = q.shape
    K, P, S, _ = pool.k.shape
    M = page_tables.shape[1]
    if N % K:
        raise ValueError(f"paged attention: query heads {N} are not a multiple of kv heads {K}")
    unfit = limits(H, S)
    if unfit is not None:
        raise ValueError(f"pallas_triton_paged_attention: {unfit}")
    C = pages_per_block or max(1, 128 // S)
    if not _pow2(C):
        raise ValueError(f"pages_per_block must be a power of two, got {C}")
    G = N // K
    if splits is None:
        splits = auto_splits(B, K, -(-M // C), sm_count())
    Gp = max(16, 1 << (G - 1).bit_length())
    per_split = -(-M // splits)
    per_split = -(-per_split // C) * C  # whole blocks per split
    tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, per_split * splits - M)))  # padding: page 0, never live
    tables = tables.reshape(B, splits, per_split)
    qg = jnp.pad(fold_scales(q, pool).reshape(B, K, G, H), ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    kernel = functools.partial(_kernel, pages_per_block=C, pages_per_split=per_split, scale=H ** -0.5)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, K, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, x: (b,)),  # lengths
            pl.BlockSpec((None, None, per_split), lambda b, h, x: (b, x, 0)),  # this split's page table
            pl.BlockSpec((None, None, Gp, H), lambda b, h, x: (b, h, 0, 0)),  # q
            pl.BlockSpec((None, P, S, H), lambda b, h, x: (h, 0, 0, 0)),  # k pages of kv head h
            pl.BlockSpec((None, P, S, H), lambda b, h, x: (h, 0, 0, 0)),  # v pages
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, Gp, H), lambda b, h, x: (b, h, x, 0, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, h, x: (b, h, x, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, h, x: (b, h, x, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, Gp, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, Gp), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, splits, Gp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="pallas_triton_paged_attention",
    )(lengths.astype(jnp.int32), tables, qg, pool.k, pool.v)
    # Merge the splits: rescale each to the common max; a split with no live page has l = 0.
    m_all = m.max(axis=2, keepdims=True)
    w = jnp.exp(m - m_all)  # [B, K, X, Gp]
    l_all = (l * w).sum(axis=2)
    out = (o * w[..., None]).sum(axis=2) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return unfold_scales(out[:, :, :G].reshape(B, N, H), pool).astype(q.dtype)


# Also the planner's "cuda" targets: kernels.dispatch takes "cuda" for "gpu".
register_pallas_kernel("gpu", pallas_triton_paged_attention, layout="heads", name="pallas_triton_paged", limits=limits)
