"""Prefill attention for GPUs (kernels/prefill_attention.py's semantics): a Pallas Triton flash kernel.

Dimension letters as in prefill_attention.py, plus:
  Gp  query heads of one kv head, padded to a power of two (Triton's blocks are powers of two)
  Q   query tokens per program (Q x Gp = 64 rows: Triton's dot wants M >= 16)
  C   keys per online-softmax block

Grid (R, K, T' / Q): one program per row, kv head and query block. Its Q x Gp query rows (token
t, head g at row t * Gp + g) share their kv head's keys, so a block of keys is read once for the G
heads; it loops over the key blocks up to its last query's position (a traced bound: the chunk's
`start` arrives as a scalar), masks keys past each query, and normalises at the end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from areal_jax.kernels.prefill_attention import KERNELS

_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(mask - max) is 0, never NaN
ROWS = 64  # query rows (tokens x padded heads) per program
KEY_BLOCK = 64


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _kernel(start_ref, q_ref, k_ref, v_ref, o_ref, *, block_q: int, block_k: int, heads: int, scale: float):
    # start_ref [1]; q_ref, o_ref [Q * Gp, H]; k_ref, v_ref [S, H] (one row's kv head)
    i = pl.program_id(2)
    rows, H = q_ref.shape
    S = k_ref.shape[0]
    first = start_ref[0] + i * block_q  # position of this block's first query
    q = q_ref[...]
    q_pos = first + jnp.arange(rows) // heads  # [rows]
    n_blocks = jnp.minimum(pl.cdiv(first + block_q, block_k), S // block_k)

    def block(j, carry):
        o, m, l = carry
        k = k_ref[pl.ds(j * block_k, block_k), :]
        v = v_ref[pl.ds(j * block_k, block_k), :]
        s = plgpu.dot(q, k.astype(q.dtype), trans_b=True) * scale  # [rows, C] fp32
        k_pos = j * block_k + jnp.arange(block_k)
        s = jnp.where(k_pos[None, :] <= q_pos[:, None], s, _MASK)
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        return (o * correction[:, None] + plgpu.dot(p.astype(v.dtype), v),
                m_new, l * correction + p.sum(axis=-1))

    init = (jnp.zeros((rows, H), jnp.float32), jnp.full((rows,), _MASK, jnp.float32), jnp.zeros((rows,), jnp.float32))
    o, _, l = jax.lax.fori_loop(0, n_blocks, block, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)  # l >= 1: key 0 is seen by every query


def limits(head_dim: int, block_len: int, chunk: int = 0) -> str | None:
    """Triton loads blocks whose sizes are powers of two: the head dim, and the block's keys read
    KEY_BLOCK (or all S when shorter) at a time."""
    if not _pow2(head_dim):
        return f"head_dim {head_dim} must be a power of two (Triton's loads)"
    block_k = min(KEY_BLOCK, block_len)
    if block_len % block_k or not _pow2(block_k) or block_k < 16:
        return f"the prefill block's {block_len} positions must be a multiple of {block_k} (at least 16, a power of two)"
    return None


@functools.partial(jax.jit, static_argnames=("block_k", "num_warps", "num_stages", "interpret"))
def pallas_triton_prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, *,
                                    block_k: int | None = None, num_warps: int = 4, num_stages: int = 2,
                                    interpret: bool = False) -> jax.Array:
    """`reference_prefill_attention`'s semantics on shapes `limits` takes (`prefill_attention`
    checks). block_k: keys per online-softmax block (default KEY_BLOCK, or S when shorter).
    interpret: run in Pallas' interpreter (CPU, tests)."""
    R, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    G = N // K
    C = block_k or min(KEY_BLOCK, S)
    Gp = 1 << (G - 1).bit_length()
    Q = max(1, ROWS // Gp)
    Tp = -(-T // Q) * Q
    qg = q.reshape(R, T, K, G, H).transpose(0, 2, 1, 3, 4)  # [R, K, T, G, H]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Tp - T), (0, Gp - G), (0, 0))).reshape(R, K, Tp * Gp, H)
    kernel = functools.partial(_kernel, block_q=Q, block_k=C, heads=Gp, scale=H ** -0.5)
    out = pl.pallas_call(
        kernel,
        grid=(R, K, Tp // Q),
        in_specs=[
            pl.BlockSpec((1,), lambda r, h, i: (0,)),  # start
            pl.BlockSpec((None, None, Q * Gp, H), lambda r, h, i: (r, h, i, 0)),
            pl.BlockSpec((None, None, S, H), lambda r, h, i: (r, h, 0, 0)),  # this row's kv head, whole
            pl.BlockSpec((None, None, S, H), lambda r, h, i: (r, h, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, Q * Gp, H), lambda r, h, i: (r, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((R, K, Tp * Gp, H), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="pallas_triton_prefill_attention",
    )(jnp.reshape(start, (1,)).astype(jnp.int32), qg, k, v)
    out = out.reshape(R, K, Tp, Gp, H)[:, :, :T, :G]
    return out.transpose(0, 2, 1, 3, 4).reshape(R, T, N, H)


# Also the planner's "cuda" targets: kernels.dispatch takes "cuda" for "gpu".
KERNELS.register("gpu", pallas_triton_prefill_attention, name="pallas_triton_prefill", limits=limits)
