"""The paged KV cache's device side: pools, the per-replica decode attention, and page writes.

Shapes (as kernels/paged_attention.py): B slots, L layers, K kv heads, N query heads, H head dim,
P pages in one layer's pool (all replicas), S tokens per page, M page-table width, R block rows.

Engine state is one `PagePool` per layer, or with EngineConfig.scan_layers one *stacked* pool
holding every layer's pages (`pool_structs(..., stacked=True)`): L x P pages ordered (replica, layer, page),
so each replica's block of the page axis still holds all of its own pages, and FP8 scales `[L, K]`.
Layer l's page g (a global id, as the page tables hold) is then page `stacked_page(g, l, ...)`,
and a layer is read and written through a `layer_view` (the same pages with that layer's scales):
the kernels see an ordinary pool whose page tables point into that layer's share, so the decode
step, the prefills and the inserts run as scans over the layers (one compiled layer body).
On a generation mesh the pool's pages lie over "data"
(replica r holds pages [r * P/data, (r + 1) * P/data), generation/pages.py hands its slots only
those) and its kv heads over "tensor". Decode attention runs under `shard_map` over the mesh:
each replica writes and reads only its own pages with page ids made local, so no page moves
between devices. Prefill writes (a prefill block into its slots' pages, packed re-prefill) use
global page ids on the whole pool, as the dense cache's inserts do; XLA routes them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.kernels.paged_attention import (FP8, PagePool, calibrate_pool, calibrated_scales,
                                               chunk_paged_attention, flat_index, from_layer_view, layer_view,
                                               paged_attention, pool_layout, scale_bytes, stacked_page, write_layer,
                                               write_tokens)
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoding import PagedAttend, RideAttend
from areal_jax.models.transformer import KVCache


def page_bytes(cfg: ModelConfig, page_size: int, dtype) -> int:
    """Bytes of one page over every layer, keys and values (1 per element for FP8)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * jnp.dtype(dtype).itemsize


def pool_scale_bytes(cfg: ModelConfig, dtype) -> int:
    """Bytes of every layer's FP8 scales (0 for other dtypes): what a pool holds besides pages."""
    return cfg.num_layers * scale_bytes(cfg.num_kv_heads, dtype)


def _axis(mesh: Mesh | None, name: str) -> str | None:
    """`name` where the mesh has that axis with more than one device, else None (whole)."""
    return name if mesh is not None and mesh.shape.get(name, 1) > 1 else None


def pool_spec(mesh: Mesh | None, layout: str = "heads", scaled: bool = False, *, stacked: bool = False) -> PagePool:
    """PartitionSpecs of one layer's pool: kv heads over "tensor", pages over "data" (FP8 scales:
    over "tensor", the same on every replica). `stacked`: a stacked pool's (scales `[L, K]`)."""
    spec = PagePool.partition_spec(heads=_axis(mesh, "tensor"), pages=_axis(mesh, "data"), layout=layout,
                                   scaled=scaled)
    if stacked and scaled:
        layer_scales = PartitionSpec(None, _axis(mesh, "tensor"))
        spec = dataclasses.replace(spec, k_scale=layer_scales, v_scale=layer_scales)
    return spec


def _zeros(cfg: ModelConfig, num_pages: int, page_size: int, dtype, impl: str, platform: str | None, *,
           stacked: bool = False) -> PagePool:
    """One layer's empty pool of `num_pages` pages (`stacked`: every layer's, L x `num_pages`
    pages and scales `[L, K]`), laid out for the kernel `impl` resolves to on `platform`."""
    pages = cfg.num_layers * num_pages if stacked else num_pages
    pool = PagePool.zeros(cfg.num_kv_heads, pages, page_size, cfg.head_dim, dtype, impl=impl, platform=platform)
    if stacked and pool.quantized:
        scales = jnp.zeros((cfg.num_layers, cfg.num_kv_heads), jnp.float32)
        pool = dataclasses.replace(pool, k_scale=scales, v_scale=scales)
    return pool


def pool_structs(cfg: ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh | None, *,
                 impl: str = "auto", platform: str | None = None, stacked: bool = False
                 ) -> tuple[PagePool, ...] | PagePool:
    """ShapeDtypeStructs of the L per-layer pools of `num_pages` pages, or (`stacked`:
    EngineConfig.scan_layers) of the one stacked pool of `num_pages` per layer (laid out on `mesh`)."""
    shape = jax.eval_shape(lambda: _zeros(cfg, num_pages, page_size, dtype, impl, platform, stacked=stacked))
    if mesh is not None:
        spec = pool_spec(mesh, shape.layout, shape.quantized, stacked=stacked)
        shape = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                             shape, spec)
    return shape if stacked else (shape,) * cfg.num_layers


def zero_pools(cfg: ModelConfig, num_pages: int, page_size: int, dtype, sharding, *, impl: str = "auto",
               platform: str | None = None, stacked: bool = False) -> tuple[PagePool, ...] | PagePool:
    """L per-layer pools of zeros, or (`stacked`) the one stacked pool of `num_pages` pages per
    layer. `sharding`: a Mesh (laid out by `pool_spec`) or one Sharding."""
    layout, scaled = pool_layout(impl, platform), jnp.dtype(dtype) == FP8
    spec = pool_spec(sharding if isinstance(sharding, Mesh) else None, layout, scaled, stacked=stacked)
    out = jax.tree.map(lambda s: NamedSharding(sharding, s) if isinstance(sharding, Mesh) else sharding, spec)
    make = jax.jit(lambda: _zeros(cfg, num_pages, page_size, dtype, impl, platform, stacked=stacked),
                   out_shardings=out)
    return make() if stacked else tuple(make() for _ in range(cfg.num_layers))


def make_attend(page_tables: jax.Array, *, page_size: int, impl: str, platform: str | None, mesh: Mesh | None,
                pages_per_replica: int, quantized: bool = False, num_layers: int | None = None) -> PagedAttend:
    """The decode step's write-and-attend for one call: `page_tables [B, M]` (global page ids).
    `quantized`: FP8 pools (their scales, set by the prefills, are read here, never set).
    `num_layers`: the pool is stacked (`attend(pool, q, k, v, positions, layer)` reads and writes
    layer `layer`'s pages); None: one pool per layer (`layer` is ignored)."""
    stacked = num_layers is not None

    def local(pool, q, k, v, positions, tables, layer):
        tables, view = _local_view(pool, tables, layer, mesh, pages_per_replica, stacked)
        view = write_tokens(view, k, v, flat_index(tables, positions[:, None], page_size)[:, 0])
        lengths = jnp.where(positions >= 0, positions + 1, 0)
        out = paged_attention(q, view, lengths, tables, impl=impl, platform=platform)
        return view if not stacked else from_layer_view(pool, view, layer), out

    if mesh is None:
        return lambda pool, q, k, v, positions, layer=0: local(pool, q, k, v, positions, page_tables, layer)
    data, tensor = _axis(mesh, "data"), _axis(mesh, "tensor")
    heads = PartitionSpec(data, tensor, None)  # q, k, v [B, *, H]: slots over "data", heads over "tensor"
    spec = pool_spec(mesh, pool_layout(impl, platform), quantized, stacked=stacked)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec, heads, heads, heads, PartitionSpec(data),
                                                        PartitionSpec(data, None), PartitionSpec()),
                            out_specs=(spec, heads), check_vma=False)
    return lambda pool, q, k, v, positions, layer=0: sharded(pool, q, k, v, positions, page_tables,
                                                             jnp.asarray(layer, jnp.int32))


def _local_view(pool: PagePool, tables: jax.Array, layer, mesh: Mesh | None, pages_per_replica: int,
                stacked: bool) -> tuple[jax.Array, PagePool]:
    """Page tables made local to the replica running (under shard_map) and to `layer`'s share of a
    stacked pool, and the pool as the kernels read that layer."""
    if _axis(mesh, "data") is not None:  # this replica's pages, ids from 0
        tables = tables - jax.lax.axis_index("data") * pages_per_replica
    if stacked:  # this replica's share of the stacked pool holds its pages layer after layer
        tables = tables + layer * pages_per_replica
    return tables, layer_view(pool, layer) if stacked else pool


def make_ride_attend(*, page_size: int, impl: str, platform: str | None, mesh: Mesh | None, pages_per_replica: int,
                     quantized: bool = False, num_layers: int | None = None) -> RideAttend:
    """The write-and-attend of the re-prefill rows a decode step carries (`RideRows`):
    `attend(pool, q [R, W, N, H], k, v [R, W, K, H], positions [R, W], tables [R, M], layer)`
    writes each row's keys and values at its slot's positions, then attends each query causally
    over its slot's pages (`chunk_paged_attention`, jnp on every platform). Rows lie over "data"
    (row r of a replica's share is one of its slots), heads over "tensor", as the decode rows."""
    stacked = num_layers is not None

    def local(pool, q, k, v, positions, tables, layer):
        tables, view = _local_view(pool, tables, layer, mesh, pages_per_replica, stacked)
        R, W = positions.shape
        index = flat_index(tables, positions, page_size).reshape(R * W)
        view = write_tokens(view, k.reshape(R * W, *k.shape[2:]), v.reshape(R * W, *v.shape[2:]), index)
        out = chunk_paged_attention(q, view, positions, tables)
        return view if not stacked else from_layer_view(pool, view, layer), out

    if mesh is None:
        return lambda pool, q, k, v, positions, tables, layer=0: local(pool, q, k, v, positions, tables, layer)
    data, tensor = _axis(mesh, "data"), _axis(mesh, "tensor")
    heads = PartitionSpec(data, None, tensor, None)  # q, k, v [R, W, *, H]
    rows = PartitionSpec(data, None)
    spec = pool_spec(mesh, pool_layout(impl, platform), quantized, stacked=stacked)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec, heads, heads, heads, rows, rows, PartitionSpec()),
                            out_specs=(spec, heads), check_vma=False)
    return lambda pool, q, k, v, positions, tables, layer=0: sharded(pool, q, k, v, positions, tables,
                                                                     jnp.asarray(layer, jnp.int32))


def insert_pages(pools: tuple[PagePool, ...], block: KVCache, rows: jax.Array, slots: jax.Array,
                 lengths: jax.Array, page_tables: jax.Array) -> tuple[PagePool, ...]:
    """Block row rows[i] (positions [0, lengths[i])) into the pages of slot slots[i]: block layers
    `[R, K, Pb, H]`, index arrays `[B']` padded with slot B (out of range: nothing written).

    One placement at a time, in a loop that runs only for the real placements: the index arrays
    are padded to every slot, and writing them in one scatter gathered B' block rows per layer
    (5.4 GiB of temporaries at 160 slots x 17,408 positions on a v5p, and B' / placements times
    the work). FP8 scales are first calibrated from every placed row's live tokens at once, as
    that single write did."""
    B, S = page_tables.shape[0], pools[0].page_size
    R, Pb = block.k[0].shape[0], block.k[0].shape[2]
    placed = slots < B
    order = jnp.argsort(~placed, stable=True)  # the real placements first, in their order
    count = jnp.sum(placed)
    if pools[0].quantized:
        # The positions each block row writes at most: the longest of its placements (0: none).
        row_len = jnp.zeros((R,), jnp.int32).at[jnp.clip(rows, 0, R - 1)].max(jnp.where(placed, lengths, 0))
        live = (jnp.arange(Pb)[None, :] < row_len[:, None]).reshape(-1)  # [R * Pb]

        def every_row(part):  # [R, K, Pb, H] -> [R * Pb, K, H]
            return part.transpose(0, 2, 1, 3).reshape(R * Pb, part.shape[1], part.shape[3])

        pools = tuple(calibrate_pool(pool, every_row(k), every_row(v), live)
                      for pool, k, v in zip(pools, block.k, block.v, strict=True))

    def place(i, pools):
        j = order[i]
        row, slot = jnp.clip(rows[j], 0, R - 1), slots[j]
        positions = jnp.where(jnp.arange(Pb) < lengths[j], jnp.arange(Pb), -1)  # [Pb]
        index = flat_index(jax.lax.dynamic_index_in_dim(page_tables, slot, keepdims=True), positions[None], S)[0]

        def tokens(part):  # [R, K, Pb, H] -> the row's tokens [Pb, K, H]
            return jax.lax.dynamic_index_in_dim(part, row, keepdims=False).transpose(1, 0, 2)

        return tuple(write_tokens(pool, tokens(k), tokens(v), index)
                     for pool, k, v in zip(pools, block.k, block.v, strict=True))

    return jax.lax.fori_loop(0, count, place, pools)


def insert_pages_stacked(pool: PagePool, block: KVCache, rows: jax.Array, slots: jax.Array, lengths: jax.Array,
                         page_tables: jax.Array, pages_per_replica: int) -> PagePool:
    """`insert_pages` into a stacked pool from a stacked block (`[L, R, K, Pb, H]`): the same
    placements, each a loop over the layers (one compiled layer write, whatever the depth)."""
    B, S = page_tables.shape[0], pool.page_size
    L, R, _, Pb, _ = block.k.shape
    placed = slots < B
    order = jnp.argsort(~placed, stable=True)  # the real placements first, in their order
    count = jnp.sum(placed)
    if pool.quantized:  # every placed row's live tokens calibrate each layer's unset scales at once
        row_len = jnp.zeros((R,), jnp.int32).at[jnp.clip(rows, 0, R - 1)].max(jnp.where(placed, lengths, 0))
        live = (jnp.arange(Pb)[None, :] < row_len[:, None]).reshape(-1)  # [R * Pb]

        def every_row(part):  # [L, R, K, Pb, H] -> [L, R * Pb, K, H]
            return part.transpose(0, 1, 3, 2, 4).reshape(L, R * Pb, part.shape[2], part.shape[4])

        calibrate = jax.vmap(lambda scale, x: calibrated_scales(scale, x, live))
        pool = dataclasses.replace(pool, k_scale=calibrate(pool.k_scale, every_row(block.k)),
                                   v_scale=calibrate(pool.v_scale, every_row(block.v)))

    def place(i, pool):
        j = order[i]
        row, slot = jnp.clip(rows[j], 0, R - 1), slots[j]
        positions = jnp.where(jnp.arange(Pb) < lengths[j], jnp.arange(Pb), -1)  # [Pb]
        table = jax.lax.dynamic_index_in_dim(page_tables, slot, keepdims=True)  # [1, M]

        def write(layer, pool):
            index = flat_index(stacked_page(table, layer, L, pages_per_replica), positions[None], S)[0]

            def tokens(part):  # [L, R, K, Pb, H] -> this layer's row tokens [Pb, K, H]
                return part[layer, row].transpose(1, 0, 2)

            return write_layer(pool, layer, tokens(block.k), tokens(block.v), index)

        return jax.lax.fori_loop(0, L, write, pool)

    return jax.lax.fori_loop(0, count, place, pool)
