"""Decode attention over a paged KV cache: the pool layout, token writes, and one attention entry point.

Dimension letters (declared once for this module):
  B  decode slots          N  query heads          K  kv heads (N = K * G)
  H  head dim              P  pages in the pool    S  tokens per page (`page_size`)
  M  entries of a slot's page table (pages a slot may hold at most)
  T  tokens written in one call

One layer's pool holds keys and values as `[K, P, S, H]` each: kv heads first, as the KV cache
was before paging (attention reads one head's pages as they lie) and as the GPU paged kernel takes
them. A token's place in the pool is its *flat index* `page * S + offset`. A slot's page table
`[M]` lists the pages holding its positions 0, S, 2S, ... in order; entries past the slot's last
page are ignored (any value in [0, P)). Pages of different slots may lie anywhere in the pool and
in any order.

`paged_attention` is the one function the engine calls; `impl` chooses the kernel:
  "reference"  a gather of each slot's pages in jnp (CPU, and the semantics every kernel matches)
  "pallas"     the accelerator's Pallas kernel (areal_jax/kernels/ registers them by platform)
  "auto"       "pallas" where a kernel is registered for the default backend, else "reference"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

ATTENTION_IMPLS = ("auto", "reference", "pallas")

_NEG = float(jnp.finfo(jnp.float32).min)


class PagePool(NamedTuple):
    """One layer's pages: k, v `[K, P, S, H]`."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int, dtype) -> "PagePool":
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @staticmethod
    def partition_spec(heads: str | None = None, pages: str | None = None) -> "PagePool":
        """PartitionSpecs of a pool with its kv heads over mesh axis `heads` and its pages over mesh
        axis `pages` (None: whole), in this layout's axis order."""
        spec = PartitionSpec(heads, pages, None, None)
        return PagePool(spec, spec)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


def flat_index(page_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat pool index of each position: page_tables `[B, M]`, positions `[B, T]` -> `[B, T]`.
    A position < 0 (padding) maps to -1, which `write_tokens` drops."""
    page = jnp.take_along_axis(page_tables, jnp.clip(positions // page_size, 0, page_tables.shape[1] - 1), axis=1)
    return jnp.where(positions >= 0, page * page_size + positions % page_size, -1)


def write_tokens(pool: PagePool, k: jax.Array, v: jax.Array, index: jax.Array) -> PagePool:
    """Stores token keys/values `k, v [T, K, H]` at flat indices `index [T]`; an index outside
    [0, P * S) (e.g. -1 for padding) writes nothing."""
    K, P, S, H = pool.k.shape
    index = jnp.where((index >= 0) & (index < P * S), index, P * S)  # P * S is out of bounds: dropped

    def put(pages, x):
        flat = pages.reshape(K, P * S, H).at[:, index].set(x.transpose(1, 0, 2).astype(pages.dtype), mode="drop")
        return flat.reshape(K, P, S, H)

    return PagePool(put(pool.k, k), put(pool.v, v))


def reference_paged_attention(q: jax.Array, pool: PagePool, lengths: jax.Array, page_tables: jax.Array) -> jax.Array:
    """q `[B, N, H]` (one query per slot, at position lengths - 1), lengths `[B]` (tokens in the
    cache, the query's own included), page_tables `[B, M]` -> `[B, N, H]`.

    Gathers all M pages of every slot, so it reads B * M pages whatever the lengths: the reference
    semantics and the CPU path, not the cost the kernels have. A slot with length 0 gets zeros.
    """
    B, N, H = q.shape
    K, _, S, _ = pool.k.shape
    G = N // K
    M = page_tables.shape[1]
    keys = pool.k[:, page_tables].reshape(K, B, M * S, H)  # [K, B, M*S, H]
    values = pool.v[:, page_tables].reshape(K, B, M * S, H)
    qg = q.reshape(B, K, G, H)
    scores = jnp.einsum("bkgh,kbsh->bkgs", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32) * (H ** -0.5)
    live = jnp.arange(M * S)[None, :] < lengths[:, None]  # [B, M*S]
    scores = jnp.where(live[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgs,kbsh->bkgh", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    out = jnp.where((lengths > 0)[:, None, None, None], out, 0.0)
    return out.reshape(B, N, H).astype(q.dtype)


# Platform -> kernel with `reference_paged_attention`'s signature (plus keyword options). Kernel
# modules register themselves here; the engine never imports a kernel directly.
_PALLAS_KERNELS: dict[str, Callable[..., jax.Array]] = {}


def register_pallas_kernel(platform: str, kernel: Callable[..., jax.Array]) -> None:
    _PALLAS_KERNELS[platform] = kernel


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """"auto" -> "pallas" where a kernel is registered for `platform` (default: jax's default
    backend), else "reference"; "pallas" with none registered is a one-line error."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    platform = platform or jax.default_backend()
    if impl == "auto":
        return "pallas" if platform in _PALLAS_KERNELS else "reference"
    if impl == "pallas" and platform not in _PALLAS_KERNELS:
        raise ValueError(f"attention_impl 'pallas': no paged attention kernel for platform {platform!r} "
                         f"(have: {sorted(_PALLAS_KERNELS) or 'none'}); use 'reference' or 'auto'")
    return impl


def paged_attention(q: jax.Array, pool: PagePool, lengths: jax.Array, page_tables: jax.Array, *,
                    impl: str = "auto", platform: str | None = None, **options) -> jax.Array:
    """Decode attention by live tokens; see `reference_paged_attention` for shapes and semantics."""
    if resolve_impl(impl, platform) == "reference":
        return reference_paged_attention(q, pool, lengths, page_tables)
    return _PALLAS_KERNELS[platform or jax.default_backend()](q, pool, lengths, page_tables, **options)
