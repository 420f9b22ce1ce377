"""A prefill block's rows written into their slots' pages (`generation/paged.insert_pages`): every
real placement lands at its slot's pages, padding anywhere in the index arrays writes nothing, FP8
scales come from every placed row at once, and the program's temporaries do not grow with the
slots the index arrays are padded to.

Letters: B slots, R block rows, K kv heads, Pb block positions, H head dim, P pages, S page size,
M page-table width."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.generation.paged import insert_pages
from areal_jax.kernels.paged_attention import FP8, FP8_HEADROOM, FP8_MAX, PagePool
from areal_jax.models.transformer import KVCache

B, R, K, PB, H, S, M, L = 6, 3, 2, 16, 8, 4, 4, 2
P = B * M  # every slot's pages distinct


def _pools(layout: str, dtype=jnp.float32) -> tuple[PagePool, ...]:
    scales = (jnp.zeros((K,), jnp.float32),) * 2 if dtype == FP8 else (None, None)
    if layout == "combined":
        return tuple(PagePool(jnp.zeros((P, S, 2 * K, H), dtype), None, "combined", *scales) for _ in range(L))
    return tuple(PagePool(jnp.zeros((K, P, S, H), dtype), jnp.zeros((K, P, S, H), dtype), "heads", *scales)
                 for _ in range(L))


def _stored(pool: PagePool) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values as `[P, S, K, H]` (FP8: dequantized)."""
    if pool.layout == "combined":
        kv = np.asarray(pool.k, np.float32).reshape(P, S, K, 2, H)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    else:
        k, v = (np.asarray(x, np.float32).transpose(1, 2, 0, 3) for x in (pool.k, pool.v))
    if pool.quantized:
        k, v = k * np.asarray(pool.k_scale)[:, None], v * np.asarray(pool.v_scale)[:, None]
    return k, v


def _case(seed: int):
    rng = np.random.default_rng(seed)
    block = KVCache(tuple(jnp.asarray(rng.normal(size=(R, K, PB, H)), jnp.float32) for _ in range(L)),
                    tuple(jnp.asarray(rng.normal(size=(R, K, PB, H)), jnp.float32) for _ in range(L)))
    tables = rng.permutation(P).reshape(B, M).astype(np.int32)
    # Row 0 twice (a group's samples share a prompt), padding (slot B) between real placements.
    rows = np.array([2, 0, 0, 0, 1, 0], np.int32)
    slots = np.array([4, 1, B, 3, 0, B], np.int32)
    lengths = np.array([5, 16, 9, 11, 1, 7], np.int32)
    return block, tables, rows, slots, lengths


@pytest.mark.parametrize("layout", ["heads", "combined"])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_placement_lands_in_its_slots_pages_and_nothing_else(layout, seed):
    block, tables, rows, slots, lengths = _case(seed)
    pools = jax.jit(insert_pages)(_pools(layout), block, rows, slots, lengths, tables)
    for layer, pool in enumerate(pools):
        want_k, want_v = np.zeros((P, S, K, H), np.float32), np.zeros((P, S, K, H), np.float32)
        for row, slot, n in zip(rows, slots, lengths, strict=True):
            if slot == B:
                continue
            for pos in range(n):
                page = tables[slot, pos // S]
                want_k[page, pos % S] = np.asarray(block.k[layer])[row, :, pos]
                want_v[page, pos % S] = np.asarray(block.v[layer])[row, :, pos]
        got_k, got_v = _stored(pool)
        np.testing.assert_array_equal(got_k, want_k)
        np.testing.assert_array_equal(got_v, want_v)


def test_fp8_scales_come_from_every_placed_rows_live_tokens():
    block, tables, rows, slots, lengths = _case(2)
    # A large key in row 1 past what its placement writes (length 1) must not set the scale, one
    # within row 2's five positions must; rows not placed at all never count.
    k = [np.array(x) for x in block.k]
    k[0][1, 0, 3, 0] = 100.0  # row 1, position 3: beyond its length
    k[0][2, 0, 4, 0] = 40.0  # row 2, position 4: written
    block = KVCache(tuple(jnp.asarray(x) for x in k), block.v)
    pools = jax.jit(insert_pages)(_pools("heads", FP8), block, rows, slots, lengths, tables)
    for layer, pool in enumerate(pools):
        for name, part, scale in (("k", block.k[layer], pool.k_scale), ("v", block.v[layer], pool.v_scale)):
            part = np.asarray(part)
            live = [part[r, :, :n] for r, s, n in zip(rows, slots, lengths, strict=True) if s < B]
            amax = np.max(np.abs(np.concatenate(live, axis=1)), axis=(1, 2))  # [K]
            np.testing.assert_allclose(np.asarray(scale), amax * FP8_HEADROOM / FP8_MAX, rtol=1e-6, err_msg=name)
    assert float(pools[0].k_scale[0]) == pytest.approx(40.0 * FP8_HEADROOM / FP8_MAX)
    got_k, _ = _stored(pools[0])  # dequantized within e4m3's rounding
    np.testing.assert_allclose(got_k[tables[4, 1], 0, 0, 0], 40.0, rtol=0.07)


def _temp_bytes(slots: int) -> int:
    pools = jax.eval_shape(lambda: _pools("heads", jnp.bfloat16))
    pools = tuple(jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0], slots * M) + a.shape[2:], a.dtype)
                               if a.ndim == 4 else a, p) for p in pools)
    block = KVCache(*((jax.ShapeDtypeStruct((1, K, 512, H), jnp.bfloat16),) * L,) * 2)
    index = jax.ShapeDtypeStruct((slots,), jnp.int32)
    tables = jax.ShapeDtypeStruct((slots, M), jnp.int32)
    compiled = jax.jit(insert_pages, donate_argnums=(0,)).lower(pools, block, index, index, index, tables).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temporaries_do_not_grow_with_the_slots_the_index_arrays_are_padded_to():
    # One block row of 512 positions placed into 8 or 256 slots' worth of index arrays: a scatter of
    # the padded arrays gathers slots x 512 tokens per layer (256 x 512 x 2 x 8 x 2 B = 4 MiB each).
    few, many = _temp_bytes(8), _temp_bytes(256)
    assert many <= few + 64 * 1024, (few, many)
