"""Decode attention over a paged KV cache: the pool layout, token writes, and one attention entry point.

Dimension letters (declared once for this module):
  B  decode slots          N  query heads          K  kv heads (N = K * G)
  H  head dim              P  pages in the pool    S  tokens per page (`page_size`)
  M  entries of a slot's page table (pages a slot may hold at most)
  T  tokens written in one call

One layer's pool holds keys and values in one of two layouts, chosen by the kernel that reads it
(`pool_layout(impl, platform)`); only this module looks inside a pool:
  "heads"     k, v `[K, P, S, H]` each: kv heads first, as the KV cache was before paging (attention
              reads one head's pages as they lie) and as the GPU kernel takes them. The reference's.
  "combined"  k `[P, S, 2K, H]`, keys and values of a token side by side (kv head j's key at 2j, its
              value at 2j + 1) and v None: jax's TPU `ragged_paged_attention` reads a page of both
              in one copy. Converting per step would read the whole pool, so the pool is built so.
An FP8 pool (dtype float8_e4m3fn) also holds one scale per kv head for keys and one for values,
`k_scale, v_scale [K]` fp32: a stored element is `x / scale` rounded to e4m3 and saturated at
+-448, and reads take `stored * scale`. The scales are set by the first write that carries live
tokens of a head (`write_tokens(..., calibrate=True)`: the prefills), so that write's largest
magnitude lands at 448 / FP8_HEADROOM, and are fixed from then on: every token of a head shares
them, so a kernel folds them into its query (keys) and output (values) instead of scaling pages,
which is also how jax's TPU kernel (one float per call) can take them.
A token's place in the pool is its *flat index* `page * S + offset`. A slot's page table
`[M]` lists the pages holding its positions 0, S, 2S, ... in order; entries past the slot's last
page are ignored (any value in [0, P)). Pages of different slots may lie anywhere in the pool and
in any order.

`paged_attention` is the one function the engine calls; `impl` chooses the kernel (through
`KERNELS`, a kernels.dispatch table, as flash attention chooses its own):
  "reference"  a gather of each slot's pages in jnp (CPU, and the semantics every kernel matches)
  "pallas"     the accelerator's Pallas kernel (paged_gpu.py, paged_tpu.py register theirs)
  "auto"       "pallas" where a kernel is registered for the platform, else "reference"
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from areal_jax.kernels.dispatch import KernelTable, current_platform

logger = logging.getLogger(__name__)

LAYOUTS = ("heads", "combined")
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
# A calibrating write maps its largest magnitude to FP8_MAX / FP8_HEADROOM: later tokens up to 4x
# larger still fit unsaturated, and the smallest normal e4m3 value (2^-6) stays ~2^-15 of the largest.
FP8_HEADROOM = 4.0

_NEG = float(jnp.finfo(jnp.float32).min)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagePool:
    """One layer's pages: k, v `[K, P, S, H]` ("heads") or k `[P, S, 2K, H]`, v None ("combined");
    FP8 pages with per-kv-head scales k_scale, v_scale `[K]` fp32 (0 until calibrated), else None."""

    k: jax.Array
    v: jax.Array | None
    layout: str = dataclasses.field(default="heads", metadata=dict(static=True))
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"PagePool.layout must be one of {LAYOUTS}, got {self.layout!r}")
        # Specs and tree-map placeholders have no dtype; FP8 pages without scales could not be read.
        if getattr(self.k, "dtype", None) == FP8 and (self.k_scale is None or self.v_scale is None):
            raise ValueError("PagePool: float8_e4m3fn pages need k_scale and v_scale (PagePool.zeros makes them)")

    @classmethod
    def zeros(cls, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int, dtype, *,
              impl: str = "auto", platform: str | None = None) -> "PagePool":
        """An empty pool laid out for the kernel `impl` resolves to on `platform`."""
        layout = pool_layout(impl, platform)
        scales = ((jnp.zeros((num_kv_heads,), jnp.float32),) * 2) if jnp.dtype(dtype) == FP8 else (None, None)
        if layout == "combined":
            return cls(jnp.zeros((num_pages, page_size, 2 * num_kv_heads, head_dim), dtype), None, layout, *scales)
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), layout, *scales)

    def __iter__(self):  # k, v as the NamedTuple this class replaced unpacked (v None when "combined")
        return iter((self.k, self.v))

    @staticmethod
    def partition_spec(heads: str | None = None, pages: str | None = None, *, layout: str = "heads",
                       scaled: bool = False) -> "PagePool":
        """PartitionSpecs of a pool with its kv heads over mesh axis `heads` and its pages over mesh
        axis `pages` (None: whole), in `layout`'s axis order; `scaled`: an FP8 pool's scales, over
        `heads`. Sharding the combined heads `2K` in contiguous blocks keeps each kv head's key and
        value on one device."""
        scales = (PartitionSpec(heads),) * 2 if scaled else (None, None)
        if layout == "combined":
            return PagePool(PartitionSpec(pages, None, heads, None), None, "combined", *scales)
        spec = PartitionSpec(heads, pages, None, None)
        return PagePool(spec, spec, "heads", *scales)

    @property
    def quantized(self) -> bool:
        """FP8 pages with per-kv-head scales."""
        return self.k_scale is not None

    @property
    def num_pages(self) -> int:
        return self.k.shape[0] if self.layout == "combined" else self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[1] if self.layout == "combined" else self.k.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2] // 2 if self.layout == "combined" else self.k.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1]

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in (self.k, self.v, self.k_scale, self.v_scale) if x is not None)

    def heads_first(self) -> tuple[jax.Array, jax.Array]:
        """k, v `[K, P, S, H]` as stored, whatever the layout (a copy for "combined": the reference's view)."""
        if self.layout == "heads":
            return self.k, self.v
        return self.k[:, :, 0::2].transpose(2, 0, 1, 3), self.k[:, :, 1::2].transpose(2, 0, 1, 3)

    def dequantized(self) -> tuple[jax.Array, jax.Array]:
        """k, v `[K, P, S, H]` as values: `heads_first` times the scales (fp32) for an FP8 pool."""
        k, v = self.heads_first()
        if not self.quantized:
            return k, v
        return (k.astype(jnp.float32) * self.k_scale[:, None, None, None],
                v.astype(jnp.float32) * self.v_scale[:, None, None, None])


def pool_bytes_per_token(num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes one token's keys and values take in one layer's pool (either layout; an FP8 pool's
    scales, `scale_bytes`, are per layer, not per token)."""
    return 2 * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def scale_bytes(num_kv_heads: int, dtype) -> int:
    """Bytes of one layer's key and value scales: 2 x K fp32 for an FP8 pool, else 0."""
    return 2 * num_kv_heads * 4 if jnp.dtype(dtype) == FP8 else 0


def _scale_per_kv_head(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`x [B, N, H]` times `scale [K]` of each query head's kv head (N = K x query heads per kv head)."""
    B, N, H = x.shape
    K = scale.shape[0]
    scaled = x.reshape(B, K, N // K, H).astype(jnp.float32) * scale[None, :, None, None]
    return scaled.reshape(B, N, H).astype(x.dtype)


def fold_scales(q: jax.Array, pool: PagePool) -> jax.Array:
    """q `[B, N, H]` times its kv head's key scale (an FP8 pool; else q): scores over the stored
    keys then equal scores over the dequantized ones. Kernels take this instead of scaling pages."""
    return _scale_per_kv_head(q, pool.k_scale) if pool.quantized else q


def unfold_scales(out: jax.Array, pool: PagePool) -> jax.Array:
    """An attention output `[B, N, H]` over the stored values, times its kv head's value scale (FP8)."""
    return _scale_per_kv_head(out, pool.v_scale) if pool.quantized else out


def calibrated_scales(scale: jax.Array, x: jax.Array, live: jax.Array) -> jax.Array:
    """`scale [K]`, with each head not yet calibrated (0) set from the live tokens of `x [T, K, H]`
    (`live [T]`) so their largest magnitude maps to FP8_MAX / FP8_HEADROOM; a head with no live
    token (or only zeros) stays 0."""
    amax = jnp.max(jnp.where(live[:, None, None], jnp.abs(x.astype(jnp.float32)), 0.0), axis=(0, 2))  # [K]
    return jnp.where((scale == 0) & (amax > 0), amax * FP8_HEADROOM / FP8_MAX, scale)


def calibrate_pool(pool: PagePool, k: jax.Array, v: jax.Array, live: jax.Array) -> PagePool:
    """An FP8 pool with each head's unset scales taken from the live tokens of `k, v [T, K, H]`
    (`live [T]`), as a `write_tokens(..., calibrate=True)` of those tokens would set them (the
    pool unchanged otherwise): for writes split into several calls that must calibrate as one."""
    if not pool.quantized:
        return pool
    return dataclasses.replace(pool, k_scale=calibrated_scales(pool.k_scale, k, live),
                               v_scale=calibrated_scales(pool.v_scale, v, live))


def _quantize(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`x [T, K, H]` over its head's scale `[K]`, saturated at +-448, as e4m3 (a 0 scale stores 0)."""
    safe = jnp.where(scale > 0, scale, 1.0)[None, :, None]
    y = jnp.clip(x.astype(jnp.float32) / safe, -FP8_MAX, FP8_MAX)
    return jnp.where((scale > 0)[None, :, None], y, 0.0).astype(FP8)


def flat_index(page_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat pool index of each position: page_tables `[B, M]`, positions `[B, T]` -> `[B, T]`.
    A position < 0 (padding) maps to -1, which `write_tokens` drops."""
    page = jnp.take_along_axis(page_tables, jnp.clip(positions // page_size, 0, page_tables.shape[1] - 1), axis=1)
    return jnp.where(positions >= 0, page * page_size + positions % page_size, -1)


def write_tokens(pool: PagePool, k: jax.Array, v: jax.Array, index: jax.Array, *,
                 calibrate: bool = False) -> PagePool:
    """Stores token keys/values `k, v [T, K, H]` at flat indices `index [T]`; an index outside
    [0, P * S) (e.g. -1 for padding) writes nothing. An FP8 pool stores them over its scales; with
    `calibrate`, heads whose scales are unset take them from this write's live tokens first. Only
    writes that see the whole pool's replicas calibrate (the prefills'; a decode step writes per
    replica under shard_map and would set different scales on each)."""
    P, S = pool.num_pages, pool.page_size
    live = (index >= 0) & (index < P * S)
    index = jnp.where(live, index, P * S)  # P * S is out of bounds: dropped
    k_scale, v_scale = pool.k_scale, pool.v_scale
    if pool.quantized:
        if calibrate:
            k_scale, v_scale = calibrated_scales(k_scale, k, live), calibrated_scales(v_scale, v, live)
        k, v = _quantize(k, k_scale), _quantize(v, v_scale)
    if pool.layout == "combined":
        _, _, C, H = pool.k.shape
        kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], C, H)  # [T, 2K, H]: key j at 2j, value at 2j + 1
        flat = pool.k.reshape(P * S, C, H).at[index].set(kv.astype(pool.k.dtype), mode="drop")
        return PagePool(flat.reshape(P, S, C, H), None, "combined", k_scale, v_scale)
    K, _, _, H = pool.k.shape

    def put(pages, x):
        flat = pages.reshape(K, P * S, H).at[:, index].set(x.transpose(1, 0, 2).astype(pages.dtype), mode="drop")
        return flat.reshape(K, P, S, H)

    return PagePool(put(pool.k, k), put(pool.v, v), "heads", k_scale, v_scale)


# ---- a stacked pool: every layer's pages in one pool (a scanned engine's) ------------------------
# Layer l's share of a stacked pool of L x P pages, ordered (replica, layer, page) so that each
# data replica's block of the page axis holds all of its own pages, is reached by mapping page ids
# (`stacked_page`); FP8 scales are then `[L, K]` and a layer is read and written through
# `layer_view`, which the kernels take as an ordinary pool.


def stacked_page(pages: jax.Array, layer: jax.Array | int, num_layers: int, pages_per_replica: int) -> jax.Array:
    """Global page ids (as page tables hold them, any shape) of layer `layer` -> pages of the
    stacked pool, ordered (replica, layer, page)."""
    replica, page = pages // pages_per_replica, pages % pages_per_replica
    return (replica * num_layers + layer) * pages_per_replica + page


def layer_view(pool: PagePool, layer: jax.Array | int) -> PagePool:
    """Layer `layer` of a stacked pool as the kernels take a pool: every page, that layer's scales."""
    if not pool.quantized:
        return pool
    return dataclasses.replace(pool, k_scale=pool.k_scale[layer], v_scale=pool.v_scale[layer])


def from_layer_view(pool: PagePool, view: PagePool, layer: jax.Array | int) -> PagePool:
    """The stacked pool after a write through `layer_view(pool, layer)` returned `view`."""
    if not pool.quantized:
        return view
    return dataclasses.replace(view, k_scale=pool.k_scale.at[layer].set(view.k_scale),
                               v_scale=pool.v_scale.at[layer].set(view.v_scale))


def write_layer(pool: PagePool, layer, k: jax.Array, v: jax.Array, index: jax.Array, *,
                calibrate: bool = False) -> PagePool:
    """`write_tokens` into layer `layer` of a stacked pool (`index`: flat indices of its pages)."""
    return from_layer_view(pool, write_tokens(layer_view(pool, layer), k, v, index, calibrate=calibrate), layer)


def gathered_pages(pool: PagePool, page_tables: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values `[K, B, M*S, H]` of every slot's M pages, dequantized (fp32) for an FP8 pool.
    Only the listed pages are read and scaled: a pool holding every layer's pages (a scanned
    engine's) is never converted whole."""
    B, M = page_tables.shape
    K, S, H = pool.num_kv_heads, pool.page_size, pool.head_dim
    if pool.layout == "combined":
        kv = pool.k[page_tables]  # [B, M, S, 2K, H]
        k, v = (kv[:, :, :, j::2].transpose(3, 0, 1, 2, 4).reshape(K, B, M * S, H) for j in (0, 1))
    else:
        k, v = (x[:, page_tables].reshape(K, B, M * S, H) for x in (pool.k, pool.v))
    if not pool.quantized:
        return k, v
    return (k.astype(jnp.float32) * pool.k_scale[:, None, None, None],
            v.astype(jnp.float32) * pool.v_scale[:, None, None, None])


def reference_paged_attention(q: jax.Array, pool: PagePool, lengths: jax.Array, page_tables: jax.Array) -> jax.Array:
    """q `[B, N, H]` (one query per slot, at position lengths - 1), lengths `[B]` (tokens in the
    cache, the query's own included), page_tables `[B, M]` -> `[B, N, H]`.

    Gathers all M pages of every slot, so it reads B * M pages whatever the lengths: the reference
    semantics and the CPU path, not the cost the kernels have. A slot with length 0 gets zeros.
    An FP8 pool's pages are dequantized (times their scales) first.
    """
    B, N, H = q.shape
    K, S = pool.num_kv_heads, pool.page_size
    G = N // K
    M = page_tables.shape[1]
    keys, values = gathered_pages(pool, page_tables)  # [K, B, M*S, H]
    qg = q.reshape(B, K, G, H)
    scores = jnp.einsum("bkgh,kbsh->bkgs", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32) * (H ** -0.5)
    live = jnp.arange(M * S)[None, :] < lengths[:, None]  # [B, M*S]
    scores = jnp.where(live[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    values = values.astype(q.dtype) if pool.quantized else values
    out = jnp.einsum("bkgs,kbsh->bkgh", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    out = jnp.where((lengths > 0)[:, None, None, None], out, 0.0)
    return out.reshape(B, N, H).astype(q.dtype)


def chunk_paged_attention(q: jax.Array, pool: PagePool, positions: jax.Array, page_tables: jax.Array) -> jax.Array:
    """Attention of rows of consecutive queries over their slots' pages, causal: q `[R, W, N, H]`
    (row r holds W tokens of one slot, query j at `positions[r, j]`, < 0 for padding), page_tables
    `[R, M]` (each row's slot's pages) -> `[R, W, N, H]`; a query attends to its slot's positions
    up to its own (its row's keys already written), a padding query gets zeros.

    Gathers each row's M pages once for all its W queries (a decode kernel would read them once
    per query): the re-prefill rows a decode step carries (models/decoding.py `RideRows`), jnp on
    every platform."""
    R, W, N, H = q.shape
    K, S = pool.num_kv_heads, pool.page_size
    G, M = N // K, page_tables.shape[1]
    keys, values = gathered_pages(pool, page_tables)  # [K, R, M*S, H]
    qg = q.reshape(R, W, K, G, H)
    scores = jnp.einsum("rwkgh,krsh->rkgws", qg, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32) * (H ** -0.5)  # [R, K, G, W, M*S]
    seen = jnp.arange(M * S)[None, None, :] <= positions[:, :, None]  # [R, W, M*S]
    scores = jnp.where(seen[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    values = values.astype(q.dtype) if pool.quantized else values
    out = jnp.einsum("rkgws,krsh->rwkgh", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    out = jnp.where((positions >= 0)[:, :, None, None, None], out, 0.0)
    return out.reshape(R, W, N, H).astype(q.dtype)


# Platform -> kernel with `reference_paged_attention`'s signature (plus keyword options), the pool
# layout it reads (`Kernel.layout`) and `limits(head_dim, page_size)`. Kernel modules register
# themselves here, imported on first use (they import this one); the engine never imports a kernel.
KERNELS = KernelTable("paged attention", modules={"gpu": "areal_jax.kernels.paged_gpu",
                                                  "tpu": "areal_jax.kernels.paged_tpu"})
resolve_impl = KERNELS.resolve
# What `paged_attention` compiles into a program: "reference", "pallas_triton_paged", "ragged_paged".
kernel_name = KERNELS.kernel_name


def register_pallas_kernel(platform: str, kernel: Callable[..., jax.Array], *, layout: str = "heads",
                           name: str = "pallas", limits: Callable[[int, int], str | None] | None = None) -> None:
    """`limits(head_dim, page_size, slots, pages_per_slot, kv_heads, kv_itemsize)` (per kernel call;
    later ones may be left out): why the kernel cannot take those shapes, or None."""
    if layout not in LAYOUTS:
        raise ValueError(f"register_pallas_kernel: layout must be one of {LAYOUTS}, got {layout!r}")
    KERNELS.register(platform, kernel, name=name, limits=limits, layout=layout)


def pool_layout(impl: str, platform: str | None = None) -> str:
    """The pool layout the kernel `impl` resolves to on `platform` reads."""
    return "heads" if resolve_impl(impl, platform) == "reference" else KERNELS.entry(platform).layout


def paged_attention(q: jax.Array, pool: PagePool, lengths: jax.Array, page_tables: jax.Array, *,
                    impl: str = "auto", platform: str | None = None, heads_axis: str | None = None,
                    replica_axis: str | None = None, **options) -> jax.Array:
    """Decode attention by live tokens; see `reference_paged_attention` for shapes and semantics.
    Any pool layout works with "reference"; a kernel wants the layout `pool_layout` names and shapes
    it can take ("auto" otherwise takes the reference; "pallas" is then an error saying why).

    heads_axis, replica_axis: mesh axes (of the mesh being traced under) that shard the heads (q's
    N, the pool's kv heads) and the replicas (slots, page tables and pages together: each replica's
    tables index its own pages). A Pallas kernel is a custom call the partitioner cannot split, so
    it runs per shard (shard_map) instead of on gathered operands; the reference needs neither."""
    if resolve_impl(impl, platform) == "reference":
        return reference_paged_attention(q, pool, lengths, page_tables)
    entry = KERNELS.entry(platform)
    mesh = jax.sharding.get_abstract_mesh()
    heads_axis, replica_axis = (a if a is not None and not mesh.empty and mesh.shape.get(a, 1) > 1 else None
                                for a in (heads_axis, replica_axis))
    slots_per_call = page_tables.shape[0] // (mesh.shape[replica_axis] if replica_axis is not None else 1)
    heads_per_call = pool.num_kv_heads // (mesh.shape[heads_axis] if heads_axis is not None else 1)
    unfit = KERNELS.unfit(platform, q.shape[-1], pool.page_size, slots_per_call, page_tables.shape[1],
                          heads_per_call, jnp.dtype(pool.k.dtype).itemsize)
    if pool.layout != entry.layout:
        unfit = (f"the {current_platform(platform)} kernel reads a {entry.layout!r} pool, got {pool.layout!r}: "
                 "build it with PagePool.zeros(..., impl=, platform=) as attention runs")
    if unfit is not None:
        if impl == "auto":  # the best this pool and these shapes allow, said once per trace
            logger.warning("paged_attention: the %s kernel cannot serve this engine, decoding with the "
                           "reference gather: %s", entry.name, unfit)
            return reference_paged_attention(q, pool, lengths, page_tables)
        raise ValueError(f"paged_attention: {unfit}")
    kernel = functools.partial(entry.fn, **options)  # an FP8 pool's scales travel in the pool
    if heads_axis is None and replica_axis is None:
        return kernel(q, pool, lengths, page_tables)
    slots = PartitionSpec(replica_axis)
    return jax.shard_map(
        kernel, mesh=mesh, check_vma=False, out_specs=PartitionSpec(replica_axis, heads_axis, None),
        in_specs=(PartitionSpec(replica_axis, heads_axis, None),
                  PagePool.partition_spec(heads_axis, replica_axis, layout=pool.layout, scaled=pool.quantized),
                  slots, slots),
    )(q, pool, lengths, page_tables)
