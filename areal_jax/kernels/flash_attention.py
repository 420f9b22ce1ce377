"""Flash attention for training and packed prefill: causal within segments, no `[T, T]` saved.

Dimension letters (declared once for this module):
  B  rows                 T  tokens per row          N  query heads
  K  kv heads (N = K * G) G  query heads per kv head H  head dim
  Q  queries in a block   S  keys in a block

`flash_attention(q [B, T, N, H], k [B, T, K, H], v, segment_ids [B, T] | None)` -> `[B, T, N, H]`:
token t attends to the tokens s <= t of its own non-zero segment (`segment_ids` 0 = padding, None
= one segment per row); a query with no allowed key (padding) gets zeros. These are the semantics
of `models.attention.causal_attention` under `models.transformer.self_attention_mask`.

`key_ends [B, T]` (optional; shared-prefix training, trainer/prefix_tree.py) narrows that further:
key s is seen only by the queries t < key_ends[s]. A prefix trie packed in depth-first order sets
it to the end of each token's subtree, so a token sees exactly its ancestors. Only the reference
takes it; `flash_attention` runs the reference for it whatever `impl` (and says so once).

`impl` chooses the kernel, as for paged decode attention:
  "reference"  chunked jnp with its own reverse rule (`reference_flash_attention`): CPU, and the
               semantics every kernel matches
  "pallas"     the platform's kernel: jax's Pallas Triton `mha` on GPU (flash_pallas.py), splash
               attention on TPU
  "auto"       "pallas" where a kernel is registered for the platform, else "reference"

The reference keeps for the backward only q, k, v, the output and the per-query log-sum-exp
(fp32): the backward recomputes each block's probabilities from the log-sum-exp, so autodiff
never holds the `[B, N, T, T]` scores that differentiating the blocked formula keeps.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp

from areal_jax.kernels import flash_pallas
from areal_jax.kernels.dispatch import IMPLS as FLASH_IMPLS
from areal_jax.kernels.dispatch import KernelTable

# Query blocks as models/attention.py chooses them (32 tokens, at most 32 blocks: the fastest
# on the 2-core CPU), so rows up to 512 tokens meet all their keys in one block and the
# forward rounds exactly as the blocked formula does. Longer rows read their keys in blocks
# of KEY_BLOCK inside a loop: no score tensor is larger than `[B, K, G*Q, KEY_BLOCK]`.
QUERY_BLOCK = 32
MAX_QUERY_BLOCKS = 32
KEY_BLOCK = 512

_NEG = float(jnp.finfo(jnp.float32).min)


def _fold(x: jax.Array, K: int) -> jax.Array:
    """`[B, Q, N, H]` -> `[B, K, G*Q, H]`: the G query heads of one kv head join the query axis."""
    B, Q, N, H = x.shape
    return x.reshape(B, Q, K, N // K, H).transpose(0, 2, 3, 1, 4).reshape(B, K, (N // K) * Q, H)


def _unfold(x: jax.Array, N: int) -> jax.Array:
    """Inverse of `_fold`: `[B, K, G*Q, H]` -> `[B, Q, N, H]`."""
    B, K, GQ, H = x.shape
    G = N // K
    return x.reshape(B, K, G, GQ // G, H).transpose(0, 3, 1, 2, 4).reshape(B, GQ // G, N, H)


class _Blocks:
    """The static block plan of one call: query blocks [start, end), how each meets its keys, and
    the keys heads-first `[B, K, T', H]` with their segments `[B, T']` and indices `[T']`, padded
    to whole key blocks (padding keys have segment 0: never attended to)."""

    def __init__(self, q, k, v, seg, ends, block_q: int, block_k: int):
        B, T, N, H = q.shape
        self.T, self.K, self.G, self.scale = T, k.shape[2], N // k.shape[2], H ** -0.5
        self.bq = max(block_q, math.ceil(T / MAX_QUERY_BLOCKS))
        self.bk = block_k
        self.queries = [(s, min(T, s + self.bq)) for s in range(0, T, self.bq)]
        self.padded = math.ceil(T / block_k) * block_k
        pad = self.padded - T
        kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if pad:
            kt = jnp.pad(kt, ((0, 0), (0, 0), (0, pad), (0, 0)))
            vt = jnp.pad(vt, ((0, 0), (0, 0), (0, pad), (0, 0)))
            seg = jnp.pad(seg, ((0, 0), (0, pad)))
            ends = None if ends is None else jnp.pad(ends, ((0, 0), (0, pad)))
        self.keys = (kt, vt, seg, jnp.arange(self.padded, dtype=jnp.int32), ends)

    def key_blocks(self, end: int) -> int:
        """Key blocks a query block ending at `end` meets: 1 = the keys [0, end) at once."""
        return math.ceil(end / self.bk)

    def all_keys(self, end: int):
        """The keys [0, end) as one block."""
        kt, vt, seg, pos, ends = self.keys
        return kt[:, :, :end], vt[:, :, :end], seg[:, :end], pos[:end], None if ends is None else ends[:, :end]

    def key_block(self, j):
        """Key block j (traced): `bk` tokens of each."""
        kt, vt, seg, pos, ends = self.keys
        at, size = j * self.bk, self.bk
        return (jax.lax.dynamic_slice_in_dim(kt, at, size, 2), jax.lax.dynamic_slice_in_dim(vt, at, size, 2),
                jax.lax.dynamic_slice_in_dim(seg, at, size, 1), jax.lax.dynamic_slice_in_dim(pos, at, size, 0),
                None if ends is None else jax.lax.dynamic_slice_in_dim(ends, at, size, 1))


def _scores(qb, kb, seg_q, seg_k, pos_q, pos_k, end_k, scale, G):
    """Masked scaled scores `[B, K, G, Q, S]` (fp32) and the mask `[B, 1, 1, Q, S]`.
    qb `[B, K, G*Q, H]`, kb `[B, K, S, H]`; seg_* `[B, Q|S]`, pos_* `[Q|S]` token indices,
    end_k `[B, S]` the keys' key_ends or None."""
    B, K, GQ, _ = qb.shape
    s = jnp.einsum("bkqh,bksh->bkqs", qb, kb, preferred_element_type=jnp.float32) * scale
    s = s.reshape(B, K, G, GQ // G, -1)
    mask = ((pos_k[None, None, :] <= pos_q[None, :, None]) & (seg_q[:, :, None] == seg_k[:, None, :])
            & (seg_k[:, None, :] > 0))
    if end_k is not None:
        mask = mask & (pos_q[None, :, None] < end_k[:, None, :])
    mask = mask[:, None, None]
    return jnp.where(mask, s, _NEG), mask


def _forward(q, k, v, seg, ends, block_q, block_k):
    """Output `[B, T, N, H]` and log-sum-exp `[B, K, G, T]` (fp32; +inf for a query with no key)."""
    B, T, N, H = q.shape
    blocks = _Blocks(q, k, v, seg, ends, block_q, block_k)
    K, G, scale = blocks.K, blocks.G, blocks.scale
    outs, lses = [], []
    for start, end in blocks.queries:
        qb = _fold(q[:, start:end], K)  # [B, K, G*Q, H]
        seg_q, pos_q = seg[:, start:end], jnp.arange(start, end, dtype=jnp.int32)
        Q = end - start

        def step(carry, kb, vb, seg_k, pos_k, end_k, qb=qb, seg_q=seg_q, pos_q=pos_q, Q=Q):
            peak, total, acc = carry  # [B, K, G, Q, 1] fp32 (x2), [B, K, G, Q, H] fp32
            s, mask = _scores(qb, kb, seg_q, seg_k, pos_q, pos_k, end_k, scale, G)
            new_peak = jnp.maximum(peak, jnp.max(s, axis=-1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - new_peak), 0.0)  # masked keys exactly 0, even in an all-masked block
            fade = jnp.exp(peak - new_peak)
            pv = jnp.einsum("bkqs,bksh->bkqh", p.astype(vb.dtype).reshape(B, K, G * Q, -1), vb,
                            preferred_element_type=jnp.float32).reshape(B, K, G, Q, H)
            return new_peak, total * fade + jnp.sum(p, axis=-1, keepdims=True), acc * fade + pv

        carry = (jnp.full((B, K, G, Q, 1), _NEG, jnp.float32), jnp.zeros((B, K, G, Q, 1), jnp.float32),
                 jnp.zeros((B, K, G, Q, H), jnp.float32))
        n_blocks = blocks.key_blocks(end)
        if n_blocks == 1:  # the keys [0, end) at once, as the blocked formula reads them
            carry = step(carry, *blocks.all_keys(end))
        else:
            carry = jax.lax.fori_loop(0, n_blocks, lambda j, c: step(c, *blocks.key_block(j)), carry)
        peak, total, acc = carry
        live = total > 0  # some key allowed
        out = jnp.where(live, acc / jnp.where(live, total, 1.0), 0.0)
        outs.append(_unfold(out.reshape(B, K, G * Q, H).astype(v.dtype), N))
        lses.append(jnp.where(live, peak + jnp.log(jnp.where(live, total, 1.0)), jnp.inf)[..., 0])
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=-1)


def _backward(q, k, v, seg, ends, out, lse, d_out, block_q, block_k):
    """dq, dk, dv of `_forward`'s output, each block's probabilities recomputed from the log-sum-exp:
    dS = P * (dP - rowsum(dO * O)), all in fp32; dk, dv accumulate over query blocks in fp32."""
    B, T, N, H = q.shape
    blocks = _Blocks(q, k, v, seg, ends, block_q, block_k)
    K, G, scale = blocks.K, blocks.G, blocks.scale
    # rowsum(dO * O) per query: [B, K, G, T, 1]
    delta = _fold(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True), K)
    delta = delta.reshape(B, K, G, T, 1)
    dk = jnp.zeros((B, K, blocks.padded, H), jnp.float32)
    dv = jnp.zeros((B, K, blocks.padded, H), jnp.float32)
    dqs = []
    for start, end in blocks.queries:
        Q = end - start
        qb = _fold(q[:, start:end], K)
        dob = _fold(d_out[:, start:end].astype(v.dtype), K)  # [B, K, G*Q, H]
        seg_q, pos_q = seg[:, start:end], jnp.arange(start, end, dtype=jnp.int32)
        lse_b, delta_b = lse[:, :, :, start:end, None], delta[:, :, :, start:end]

        def grads(kb, vb, seg_k, pos_k, end_k, qb=qb, dob=dob, seg_q=seg_q, pos_q=pos_q, lse_b=lse_b,
                  delta_b=delta_b, Q=Q):
            """This query block's dq and the key block's dk, dv contributions (fp32)."""
            s, mask = _scores(qb, kb, seg_q, seg_k, pos_q, pos_k, end_k, scale, G)
            p = jnp.where(mask, jnp.exp(s - lse_b), 0.0)  # [B, K, G, Q, S]
            dp = jnp.einsum("bkqh,bksh->bkqs", dob, vb, preferred_element_type=jnp.float32).reshape(p.shape)
            ds = (p * (dp - delta_b)).reshape(B, K, G * Q, -1)
            p = p.reshape(B, K, G * Q, -1)
            dv_j = jnp.einsum("bkqs,bkqh->bksh", p.astype(vb.dtype), dob, preferred_element_type=jnp.float32)
            dq_j = jnp.einsum("bkqs,bksh->bkqh", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32) * scale
            dk_j = jnp.einsum("bkqs,bkqh->bksh", ds.astype(qb.dtype), qb, preferred_element_type=jnp.float32) * scale
            return dq_j, dk_j, dv_j

        n_blocks = blocks.key_blocks(end)
        if n_blocks == 1:
            dq_b, dk_j, dv_j = grads(*blocks.all_keys(end))
            dk = dk.at[:, :, :end].add(dk_j)
            dv = dv.at[:, :, :end].add(dv_j)
        else:
            def body(j, carry):
                dq_b, dk, dv = carry
                dq_j, dk_j, dv_j = grads(*blocks.key_block(j))
                at = j * blocks.bk
                dk = jax.lax.dynamic_update_slice_in_dim(
                    dk, jax.lax.dynamic_slice_in_dim(dk, at, blocks.bk, 2) + dk_j, at, 2)
                dv = jax.lax.dynamic_update_slice_in_dim(
                    dv, jax.lax.dynamic_slice_in_dim(dv, at, blocks.bk, 2) + dv_j, at, 2)
                return dq_b + dq_j, dk, dv

            dq_b, dk, dv = jax.lax.fori_loop(0, n_blocks, body, (jnp.zeros((B, K, G * Q, H), jnp.float32), dk, dv))
        dqs.append(_unfold(dq_b, N))
    dq = jnp.concatenate(dqs, axis=1).astype(q.dtype)
    dk = dk[:, :, :T].transpose(0, 2, 1, 3).astype(k.dtype)
    dv = dv[:, :, :T].transpose(0, 2, 1, 3).astype(v.dtype)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, seg, ends, block_q, block_k):
    return _forward(q, k, v, seg, ends, block_q, block_k)[0]


def _flash_fwd(q, k, v, seg, ends, block_q, block_k):
    out, lse = _forward(q, k, v, seg, ends, block_q, block_k)
    return out, (q, k, v, seg, ends, out, lse)  # everything O(T): no [T, T] residual


def _flash_bwd(block_q, block_k, residuals, d_out):
    q, k, v, seg, ends, out, lse = residuals
    return (*_backward(q, k, v, seg, ends, out, lse, d_out, block_q, block_k), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check(q, k, v, segment_ids, key_ends=None) -> None:
    B, T, N, H = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != H:
        raise ValueError(f"flash_attention needs k, v [B, T, K, H] matching q [B, T, N, H]: q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if N % k.shape[2]:
        raise ValueError(f"query heads ({N}) must be a multiple of kv heads ({k.shape[2]})")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"segment_ids must be [B, T] = {(B, T)}, got {segment_ids.shape}")
    if key_ends is not None and key_ends.shape != (B, T):
        raise ValueError(f"key_ends must be [B, T] = {(B, T)}, got {key_ends.shape}")


def reference_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                              block_q: int | None = None, block_k: int | None = None,
                              key_ends: jax.Array | None = None) -> jax.Array:
    """Chunked flash attention in jnp: query blocks of `block_q` tokens (default QUERY_BLOCK,
    raised so there are at most MAX_QUERY_BLOCKS, unrolled at trace time) meet only the keys up
    to their own end, in key blocks of `block_k` (default KEY_BLOCK) with an online softmax in
    fp32; key blocks above the diagonal are never computed. Its reverse rule recomputes the
    probabilities from the saved log-sum-exp. `key_ends`: see the module docstring."""
    _check(q, k, v, segment_ids, key_ends)
    block_q = QUERY_BLOCK if block_q is None else block_q
    block_k = KEY_BLOCK if block_k is None else block_k
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q ({block_q}) and block_k ({block_k}) must be >= 1")
    seg = (jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32))
    ends = None if key_ends is None else key_ends.astype(jnp.int32)
    return _flash(q, k, v, seg, ends, block_q, block_k)


# Platform -> kernel with `reference_flash_attention`'s signature (plus keyword options).
KERNELS = KernelTable("flash attention")
KERNELS.register("gpu", flash_pallas.gpu_flash_attention, name="pallas_triton_flash")
KERNELS.register("tpu", flash_pallas.tpu_flash_attention, name="splash")
resolve_impl = KERNELS.resolve
# What `flash_attention` compiles for `impl` on a platform: "reference", "pallas_triton_flash" (GPU)
# or "splash" (TPU); the name `plan --json` reports.
kernel_name = KERNELS.kernel_name


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
                    impl: str = "auto", platform: str | None = None, key_ends: jax.Array | None = None,
                    **options) -> jax.Array:
    """Causal attention within segments; see the module docstring for shapes and semantics.
    `options` go to the chosen kernel (block sizes, `interpret=True` for a Pallas kernel on CPU).
    With `key_ends` (a prefix trie's mask) the reference runs: no Pallas kernel takes that mask."""
    resolved = resolve_impl(impl, platform)
    if key_ends is not None and resolved != "reference":
        _log_tree_fallback(kernel_name(impl, platform))
        resolved = "reference"
        options = {k: v for k, v in options.items() if k in ("block_q", "block_k")}
    if resolved == "reference":
        return reference_flash_attention(q, k, v, segment_ids, key_ends=key_ends, **options)
    _check(q, k, v, segment_ids)
    return KERNELS.kernel(platform)(q, k, v, segment_ids, **options)


_LOG = logging.getLogger(__name__)
_FALLBACKS_LOGGED: set[str] = set()


def _log_tree_fallback(kernel: str) -> None:
    """Says once per kernel that a prefix trie's attention runs the jnp reference instead."""
    if kernel not in _FALLBACKS_LOGGED:
        _FALLBACKS_LOGGED.add(kernel)
        _LOG.warning("flash attention: the %s kernel has no prefix-trie mask (key_ends); shared-prefix "
                     "training (TrainEngineConfig.share_prefixes) and the engine's trie re-prefill "
                     "(EngineConfig.reprefill_share_prefixes) run the jnp reference flash attention instead",
                     kernel)
