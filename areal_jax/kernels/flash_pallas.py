"""jax's Pallas flash-attention kernels behind `flash_attention`'s signature (kernels/flash_attention.py).

Dimension letters as in flash_attention.py; T' is T padded to the kernel's block multiple.

GPU: `jax.experimental.pallas.ops.gpu.attention.mha`, the Triton flash attention with its own
backward (dq, dk, dv kernels recomputing from the log-sum-exp). Chosen over cuDNN through
`jax.nn.dot_product_attention(implementation="cudnn")` because it takes segment ids, i.e. packed
rows, directly: cuDNN's path there takes per-row sequence lengths, not segments. It wants as many
kv heads as query heads, so each kv head is repeated G times (autodiff sums the G gradients back).
jax 0.12 marks the module deprecated in favour of tokamax (not a dependency here); it still ships
and compiles for H100 (DESIGN.md section 7).

TPU: splash attention (`make_splash_mha`) with a causal mask and `SegmentIds`; it takes GQA
as it is. It has no softmax scale, so q is scaled first.

Both kernels mask by segment equality only: padding tokens (segment 0) attend to earlier padding,
which keeps every row of the mask non-empty (the kernels need that); their outputs are zeroed
here, which also stops any gradient flowing through them. Rows are padded at the end to whole
blocks with segment 0, which a real query never meets.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp


def _pad_tokens(T: int, block: int) -> int:
    """T' >= T: a multiple of `block`, or for a short row the next power of two (>= 16)."""
    if T >= block:
        return math.ceil(T / block) * block
    return max(16, 1 << (T - 1).bit_length())


def _padded(q, k, v, segment_ids, Tp):
    B, T = q.shape[:2]
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    if Tp == T:
        return q, k, v, seg
    pad = ((0, 0), (0, Tp - T), (0, 0), (0, 0))
    return jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad), jnp.pad(seg, ((0, 0), (0, Tp - T)))


def _real_only(out, seg, T):
    """`[B, T', N, H]` kernel output -> `[B, T, N, H]`, zeros at padding queries."""
    return jnp.where((seg[:, :T] > 0)[:, :, None, None], out[:, :T], 0).astype(out.dtype)


def gpu_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                        block_q: int = 128, block_k: int = 128, block_backward: int = 32,
                        interpret: bool = False) -> jax.Array:
    """The Pallas Triton `mha` (forward and backward). `interpret=True` runs it on CPU."""
    with warnings.catch_warnings():  # deprecated in jax 0.12 for tokamax (module docstring)
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as triton_attention

    B, T, N, H = q.shape
    G = N // k.shape[2]
    Tp = _pad_tokens(T, max(block_q, block_k))
    qp, kp, vp, seg = _padded(q, k, v, segment_ids, Tp)
    kp, vp = jnp.repeat(kp, G, axis=2), jnp.repeat(vp, G, axis=2)  # query head n reads kv head n // G
    bq, bk, bb = min(block_q, Tp), min(block_k, Tp), min(block_backward, Tp)
    sizes = triton_attention.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=bb, block_kv_dkv=bb,
                                        block_q_dq=bb, block_kv_dq=bb)
    out = triton_attention.mha(qp, kp, vp, seg, sm_scale=H ** -0.5, causal=True, block_sizes=sizes,
                               interpret=interpret)
    return _real_only(out, seg, T)


@functools.lru_cache(maxsize=64)
def _splash_kernel(N: int, Tp: int, block: int, interpret: bool):
    """One splash kernel per (heads, padded length, block): its mask tables are built in NumPy."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((Tp, Tp)) for _ in range(N)])
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def tpu_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                        block: int = 128, interpret: bool = False) -> jax.Array:
    """Splash attention, one row at a time under `vmap`. `interpret=True` runs it on CPU."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, T, N, H = q.shape
    Tp = math.ceil(T / block) * block  # splash's blocks are whole lanes (128): no shorter rows
    qp, kp, vp, seg = _padded(q, k, v, segment_ids, Tp)
    qp = (qp.astype(jnp.float32) * H ** -0.5).astype(q.dtype)
    kernel = _splash_kernel(N, Tp, block, interpret)

    def row(q1, k1, v1, s1):  # [T', N, H] x3, [T'] -> [T', N, H]
        heads_first = lambda a: a.transpose(1, 0, 2)  # noqa: E731
        out = kernel(heads_first(q1), heads_first(k1), heads_first(v1), segment_ids=splash.SegmentIds(s1, s1))
        return out.transpose(1, 0, 2)

    out = jax.vmap(row)(qp, kp, vp, seg)
    return _real_only(out, seg, T)
