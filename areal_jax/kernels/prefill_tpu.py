"""Prefill attention for TPUs (kernels/prefill_attention.py's semantics): a Pallas Mosaic flash kernel.

Dimension letters as in prefill_attention.py, plus:
  Q  query tokens per program (a multiple of 8, at most 128)   C  keys per block (128, or all S below 128)

Grid (R, K, G, T' / Q, S / C), the last axis sequential: one program per row, kv head, query head
and query block walks the key blocks, keeping the running max, sum and output in VMEM scratch. The
chunk's `start` is a scalar prefetched into SMEM: the key blocks' index map stops at the block of
the query block's last position (later steps re-name that block, so Pallas copies nothing new) and
their compute is skipped, so a chunk reads only the key blocks it can see. Each query head reads its kv
head's blocks itself (as splash does for a query head): VMEM holds [Q, C] scores per program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from areal_jax.kernels.prefill_attention import KERNELS

_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
LANES = 128


def _kernel(start_ref, q_ref, k_ref, v_ref, o_ref, m_scr, l_scr, acc_scr, *, block_q: int, block_k: int,
            scale: float):
    # start_ref [1] (SMEM); q_ref, o_ref [Q, H]; k_ref, v_ref [C, H]; m_scr, l_scr [Q, LANES] (lanes
    # equal); acc_scr [Q, H] fp32
    i, j = pl.program_id(3), pl.program_id(4)
    first = start_ref[0] + i * block_q  # position of this block's first query

    @pl.when(j == 0)
    def _():
        m_scr[...] = jnp.full(m_scr.shape, _MASK, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(j * block_k < first + block_q)  # a key block some query of this block sees
    def _():
        q = q_ref[...]
        s = jax.lax.dot_general(q, k_ref[...].astype(q.dtype), (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale  # [Q, C]
        q_pos = first + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        k_pos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(k_pos <= q_pos, s, _MASK)
        m_prev = jnp.max(m_scr[...], axis=1, keepdims=True)  # [Q, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        correction = jnp.exp(m_prev - m_new)
        l_new = jnp.max(l_scr[...], axis=1, keepdims=True) * correction + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc_scr[...] = acc_scr[...] * correction + pv
        m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
        l_scr[...] = jnp.broadcast_to(l_new, l_scr.shape)

    @pl.when(j == pl.num_programs(4) - 1)
    def _():
        l = jnp.max(l_scr[...], axis=1, keepdims=True)  # >= 1: key 0 is seen by every query
        o_ref[...] = (acc_scr[...] / l).astype(o_ref.dtype)


def key_block(block_len: int) -> int:
    return LANES if block_len >= LANES else block_len


def limits(head_dim: int, block_len: int, chunk: int = 0) -> str | None:
    """Mosaic's blocks tile (8, 128): key blocks of 128 positions (or all of a shorter block, a
    multiple of 8) and a head dim of whole lanes."""
    if head_dim % LANES:
        return f"head_dim {head_dim} must be a multiple of {LANES} (the TPU's lanes)"
    if block_len % key_block(block_len) or block_len % 8:
        return f"the prefill block's {block_len} positions must be a multiple of {LANES} (or of 8 below it)"
    return None


@functools.partial(jax.jit, static_argnames=("interpret",))
def pallas_mosaic_prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, *,
                                    interpret: bool = False) -> jax.Array:
    """`reference_prefill_attention`'s semantics on shapes `limits` takes (`prefill_attention` checks).
    interpret: run in Pallas' interpreter (CPU, tests)."""
    R, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    G = N // K
    C = key_block(S)
    Q = min(128, -(-T // 8) * 8)
    Tp = -(-T // Q) * Q
    qg = q.reshape(R, T, K, G, H).transpose(0, 2, 3, 1, 4)  # [R, K, G, T, H]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, Tp - T), (0, 0)))

    def kv_index(r, h, g, i, j, start_ref):  # past the query block's last position: the last block it sees
        return r, h, jax.lax.min(j, jax.lax.div(start_ref[0] + (i + 1) * Q - 1, C)), 0

    q_spec = pl.BlockSpec((None, None, None, Q, H), lambda r, h, g, i, j, s: (r, h, g, i, 0))
    kv_spec = pl.BlockSpec((None, None, C, H), kv_index)
    out = pl.pallas_call(
        functools.partial(_kernel, block_q=Q, block_k=C, scale=H ** -0.5),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(R, K, G, Tp // Q, S // C), in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((Q, LANES), jnp.float32), pltpu.VMEM((Q, LANES), jnp.float32),
                            pltpu.VMEM((Q, H), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((R, K, G, Tp, H), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="pallas_mosaic_prefill_attention",
    )(jnp.reshape(start, (1,)).astype(jnp.int32), qg, k, v)
    return out[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(R, T, N, H)


KERNELS.register("tpu", pallas_mosaic_prefill_attention, name="pallas_mosaic_prefill", limits=limits)
