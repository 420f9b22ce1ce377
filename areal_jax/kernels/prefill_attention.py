"""Prefill attention of one query chunk over a KV block that already holds it: what a chunked prefill runs.

Dimension letters (declared once for this module):
  R  rows (prompts)        T  query tokens of the chunk     N  query heads
  K  kv heads (N = K * G)  G  query heads per kv head       H  head dim
  S  positions of the KV block (heads-first `[R, K, S, H]`, the layout of a prefill's block)

`prefill_attention(q [R, T, N, H], k [R, K, S, H], v, start)` -> `[R, T, N, H]`: query t of every
row sits at position start + t and attends to the block's keys at positions <= start + t (the
chunk's own keys are written into the block first). `start` is one int32 scalar for all rows (a
traced one: the prefill scans its chunks). Every query sees at least key 0, so no row is empty; a
row's padding queries (past its length) see zeros or stale keys and are dropped by the caller.

`impl` chooses the kernel, as for flash and paged attention (kernels/dispatch.py):
  "reference"  a dense masked softmax in jnp (`reference_prefill_attention`): the semantics every
               kernel matches. The engine's CPU path keeps models/attention.py's `chunk_attention`
               (the same values, the keys read in blocks) instead.
  "pallas"     the platform's kernel: a Pallas Triton flash kernel on GPU (prefill_gpu.py), a
               Pallas Mosaic one on TPU (prefill_tpu.py). Both skip the key blocks past a query
               block's last position, so a chunk reads only the key blocks it can see.
  "auto"       "pallas" where a kernel is registered for the platform, else "reference"

Why our own kernels: jax's flash kernels (Triton `mha`, splash) put query t at position t, with
the mask fixed when the kernel is built, so a chunk at a traced offset into a longer block is
outside what they take.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.kernels.dispatch import KernelTable

_NEG = float(jnp.finfo(jnp.float32).min)


def check(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    R, T, N, H = q.shape
    if k.shape != v.shape or k.ndim != 4 or k.shape[0] != R or k.shape[3] != H:
        raise ValueError(f"prefill_attention needs k, v [R, K, S, H] matching q [R, T, N, H]: q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if N % k.shape[1]:
        raise ValueError(f"query heads ({N}) must be a multiple of kv heads ({k.shape[1]})")


def reference_prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array | int) -> jax.Array:
    """Dense masked attention over the whole block (fp32 scores): the semantics, not a fast path."""
    check(q, k, v)
    R, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    G = N // K
    qg = q.reshape(R, T, K, G, H)
    s = jnp.einsum("rtkgh,rksh->rkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * H ** -0.5
    seen = jnp.arange(S)[None, :] <= (start + jnp.arange(T))[:, None]  # [T, S]
    p = jax.nn.softmax(jnp.where(seen, s, _NEG), axis=-1)
    out = jnp.einsum("rkgts,rksh->rtkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(R, T, N, H).astype(q.dtype)


# Platform -> kernel with `reference_prefill_attention`'s signature (plus keyword options) and
# `limits(head_dim, block_len, chunk)`. Kernel modules register themselves, imported on first use.
KERNELS = KernelTable("prefill attention", modules={"gpu": "areal_jax.kernels.prefill_gpu",
                                                    "tpu": "areal_jax.kernels.prefill_tpu"})
resolve_impl = KERNELS.resolve
# What `prefill_attention` compiles for `impl`: "reference", "pallas_triton_prefill" (GPU) or
# "pallas_mosaic_prefill" (TPU); the name `plan --json` reports.
kernel_name = KERNELS.kernel_name


def kernel_fits(impl: str, platform: str | None, head_dim: int, block_len: int, chunk: int) -> bool:
    """Whether `impl` resolves to a kernel on the platform that takes these shapes (`limits`)."""
    return resolve_impl(impl, platform) == "pallas" and KERNELS.unfit(platform, head_dim, block_len, chunk) is None


def kernel_block_len(impl: str, platform: str | None, head_dim: int, block_len: int, chunk: int) -> int:
    """`block_len`, or where the platform's kernel refuses it but takes a longer block (a multiple of
    128 positions), that length: a prefill pads its block to it. No kernel: `block_len`."""
    if resolve_impl(impl, platform) != "pallas" or kernel_fits(impl, platform, head_dim, block_len, chunk):
        return block_len
    padded = -(-block_len // 128) * 128
    return padded if kernel_fits(impl, platform, head_dim, padded, min(chunk, padded)) else block_len


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array | int, *, impl: str = "auto",
                      platform: str | None = None, **options) -> jax.Array:
    """See the module docstring. `options` go to the kernel (block sizes, `interpret=True` on CPU)."""
    if resolve_impl(impl, platform) == "reference":
        return reference_prefill_attention(q, k, v, start)
    check(q, k, v)
    unfit = KERNELS.unfit(platform, q.shape[3], k.shape[2], q.shape[1])
    if unfit is not None:
        raise ValueError(f"prefill_attention: {unfit}")
    return KERNELS.kernel(platform)(q, k, v, jnp.asarray(start, jnp.int32), **options)
