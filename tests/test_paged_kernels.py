"""The paged decode kernels against `reference_paged_attention`.

GPU: our Pallas Triton kernel, interpreted on CPU (values) and compiled deviceless for H100 (lowering).
TPU: jax's `ragged_paged_attention` does not run interpreted here, so the arguments our wrapper builds
are checked through its module's `ref_ragged_paged_attention` (semantics) and the kernel is compiled
deviceless for v5e (lowering). Both pool layouts are written by the same `write_tokens`.
"""

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.kernels.paged_attention import (FP8, FP8_HEADROOM, FP8_MAX, PagePool, flat_index, kernel_name,
                                               paged_attention, pool_layout, reference_paged_attention, write_tokens)

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
# The GPU kernel runs natively on a GPU (bench/accelerator_check.sh runs this file there), else interpreted.
INTERPRET = jax.default_backend() != "gpu"
HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None or \
    importlib.util.find_spec("jax_cuda12_plugin") is not None


def _case(seed, *, B, N, K, H, S, P, M, lengths=None, dtype=jnp.float32, layout="heads", kv_dtype=None,
          garbage=50.0):
    """A pool filled through write_tokens: every slot's pages drawn without replacement from a
    shuffled pool (so out of order), lengths random in [0, M*S] unless given. kv_dtype: the pool's
    dtype (default `dtype`; FP8 pools calibrate their scales on this one write)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths if lengths is not None else rng.integers(0, M * S + 1, B), np.int32)
    tables = rng.permutation(P)[:B * M].reshape(B, M).astype(np.int32)
    pool = PagePool.zeros(K, P, S, H, kv_dtype or dtype, impl="auto" if layout == "combined" else "reference",
                          platform="tpu")
    assert pool.layout == layout
    pool = write_tokens(pool, *_fill(rng, pool, tables, lengths, S, K, H, dtype, garbage), calibrate=True)
    # Garbage in the pages past each length: a kernel that reads them shows it.
    q = jnp.asarray(rng.normal(size=(B, N, H)), dtype)
    return q, pool, jnp.asarray(lengths), jnp.asarray(tables)


def _fill(rng, pool, tables, lengths, S, K, H, dtype, garbage=50.0):
    B, M = tables.shape
    positions = np.broadcast_to(np.arange(M * S), (B, M * S))
    index = flat_index(jnp.asarray(tables), jnp.asarray(positions), S).reshape(-1)  # every page, live or not
    T = index.shape[0]
    k = rng.normal(size=(T, K, H)) * np.where(positions.reshape(-1) < np.repeat(lengths, M * S), 1.0, garbage)[:, None, None]
    v = rng.normal(size=(T, K, H))
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), index


@pytest.mark.parametrize("seed, B, N, K, H, S, M, splits, block", [
    (0, 5, 8, 2, 32, 8, 4, 1, 1),  # GQA 4
    (1, 4, 4, 4, 16, 4, 6, 2, 2),  # no grouping, two splits, a ragged last split
    (2, 3, 12, 2, 64, 16, 3, 3, None),  # Qwen2-1.5B's grouping (6), one page per split
    (3, 6, 2, 1, 32, 8, 5, 1, 4),  # one kv head; blocks longer than some slots
])
def test_gpu_kernel_matches_the_reference_on_random_lengths(seed, B, N, K, H, S, M, splits, block):
    q, pool, lengths, tables = _case(seed, B=B, N=N, K=K, H=H, S=S, P=B * M + 3, M=M)
    want = reference_paged_attention(q, pool, lengths, tables)
    got = paged_attention(q, pool, lengths, tables, impl="pallas", platform="gpu", interpret=INTERPRET,
                          splits=splits, pages_per_block=block)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_gpu_kernel_on_page_boundaries_length_one_and_empty_slots():
    S, M = 8, 4
    lengths = [1, S, 2 * S, M * S, 0, S + 1, 2 * S - 1]
    q, pool, lengths, tables = _case(7, B=len(lengths), N=4, K=2, H=32, S=S, P=40, M=M, lengths=lengths)
    want = reference_paged_attention(q, pool, lengths, tables)
    for splits in (1, 2):
        got = paged_attention(q, pool, lengths, tables, impl="pallas", platform="gpu", interpret=INTERPRET, splits=splits)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert not np.any(np.asarray(got[4])), "an empty slot attends to nothing"
    # A slot of length 1 sees exactly its one value (softmax over one key).
    k_heads, v_heads = pool.heads_first()
    np.testing.assert_allclose(got[0].reshape(2, 2, 32), np.repeat(v_heads[:, tables[0, 0], 0][:, None], 2, 1),
                               atol=1e-6)


def test_gpu_kernel_in_bfloat16_stays_within_bfloat16_of_the_fp32_reference():
    q, pool, lengths, tables = _case(11, B=4, N=8, K=2, H=64, S=16, P=20, M=4, dtype=jnp.bfloat16)
    want = reference_paged_attention(q.astype(jnp.float32), jax.tree.map(lambda x: x.astype(jnp.float32), pool),
                                     lengths, tables)
    got = paged_attention(q, pool, lengths, tables, impl="pallas", platform="gpu", interpret=INTERPRET)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)


def _unquantized(pool):
    """An FP8 pool's tokens as they were written, before rounding: rebuilt from the f32 case of the same seed."""
    return jax.tree.map(lambda x: x.astype(jnp.float32), pool)


def _fp8_bound(q, k, v, lengths, tables, k_scale, v_scale):
    """Per (slot, query head) bound on |attention over FP8 keys/values - attention over the exact ones|.

    e4m3 keeps 3 mantissa bits: a normal value x is stored within |x| 2^-4 (half an ulp), a
    subnormal one within 2^-10 x scale. So each score q.k / sqrt(H) moves by at most
    d = sum_i |q_i| (2^-4 |k_i| + 2^-10 s_k) / sqrt(H), the softmax weights by a factor within
    e^(+-2d), and the output by at most (e^(2 d_max) - 1) max|v| + max(2^-4 |v| + 2^-10 s_v) over
    the slot's live tokens. q `[B, N, H]`, k, v `[K, P, S, H]` exact (fp32)."""
    B, N, H = q.shape
    K, _, S, _ = k.shape
    out = np.zeros((B, N))
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        for h in range(N):
            j = h // (N // K)
            keys = np.asarray(k[j, tables[b]]).reshape(-1, H)[:n]
            vals = np.asarray(v[j, tables[b]]).reshape(-1, H)[:n]
            d = (np.abs(np.asarray(q[b, h]))[None] * (2 ** -4 * np.abs(keys) + 2 ** -10 * float(k_scale[j]))).sum(1)
            d = d.max() / np.sqrt(H)
            out[b, h] = (np.expm1(2 * d) * np.abs(vals).max()
                         + (2 ** -4 * np.abs(vals) + 2 ** -10 * float(v_scale[j])).max())
    return out


@pytest.mark.parametrize("layout", ["heads", "combined"])
def test_fp8_pool_stays_within_fp8_error_of_the_exact_reference(layout):
    """FP8 pages (calibrated on their first write) read by the reference: within the bound above of
    attention over the exact fp32 tokens, every (slot, head), and clearly off it (it is rounded)."""
    shape = dict(B=6, N=8, K=2, H=32, S=8, P=30, M=4, layout=layout, garbage=2.0)
    q, exact, lengths, tables = _case(3, **shape)
    _, pool, _, _ = _case(3, **shape, kv_dtype=FP8)
    assert pool.k.dtype == FP8 and pool.quantized and pool.k_scale.shape == (2,)
    k, v = exact.heads_first()
    # The scales map the largest magnitude written (live or not) to 448 / headroom.
    np.testing.assert_allclose(pool.k_scale, np.abs(k).max(axis=(1, 2, 3)) * FP8_HEADROOM / FP8_MAX, rtol=1e-6)
    want = np.asarray(reference_paged_attention(q, exact, lengths, tables))
    got = np.asarray(reference_paged_attention(q, pool, lengths, tables))
    err = np.abs(got - want).max(axis=-1)  # [B, N]
    bound = _fp8_bound(q, k, v, np.asarray(lengths), np.asarray(tables), pool.k_scale, pool.v_scale)
    assert (err <= bound + 1e-6).all(), (err / np.maximum(bound, 1e-9)).max()
    assert err.max() > 1e-3  # the values really went through e4m3
    # The stored pages are the exact tokens rounded: dequantized, within 2^-4 relative (+ subnormals).
    kq, vq = pool.dequantized()
    for x, y, scale in ((kq, k, pool.k_scale), (vq, v, pool.v_scale)):
        assert (np.abs(x - y) <= 2 ** -4 * np.abs(y) + 2 ** -10 * np.asarray(scale)[:, None, None, None]).all()


@pytest.mark.parametrize("seed, B, N, K, H, S, M, splits, block, dtype", [
    (0, 5, 8, 2, 32, 8, 4, 1, 1, jnp.float32),
    (1, 4, 4, 4, 16, 4, 6, 2, 2, jnp.float32),  # two splits, a ragged last split
    (2, 3, 12, 2, 64, 16, 3, 3, None, jnp.bfloat16),  # Qwen2-1.5B's grouping in bf16
])
def test_gpu_kernel_reads_fp8_pages_as_the_reference_does(seed, B, N, K, H, S, M, splits, block, dtype):
    """The Triton kernel on FP8 pages (ragged lengths, pages out of order, garbage past each length):
    the reference over the same FP8 pool, to fp32 (bf16) rounding; its scales are folded, not applied."""
    q, pool, lengths, tables = _case(seed, B=B, N=N, K=K, H=H, S=S, P=B * M + 3, M=M, dtype=dtype, kv_dtype=FP8)
    want = reference_paged_attention(q, pool, lengths, tables)
    got = paged_attention(q, pool, lengths, tables, impl="pallas", platform="gpu", interpret=INTERPRET,
                          splits=splits, pages_per_block=block)
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", [0, 1])
def test_tpu_wrapper_reads_fp8_pages_as_the_reference_does(seed):
    """ragged_paged_decode's arguments on an FP8 "combined" pool (scales folded into q, k_scale =
    v_scale = 1.0 so the kernel upcasts), through jax's ref_ragged_paged_attention, then the value
    scales: the reference over the same pool."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    from areal_jax.kernels.paged_attention import unfold_scales
    from areal_jax.kernels.paged_tpu import kernel_scales, ragged_arguments

    q, pool, lengths, tables = _case(seed, B=5, N=8, K=2, H=32, S=8, P=24, M=4, layout="combined", kv_dtype=FP8)
    lengths = lengths.at[0].set(0).at[1].set(1).at[2].set(16)
    want = reference_paged_attention(q, pool, lengths, tables)
    assert kernel_scales(pool) == dict(k_scale=1.0, v_scale=1.0)
    got = ref_ragged_paged_attention(*ragged_arguments(q, pool, lengths, tables), sm_scale=32 ** -0.5,
                                     **kernel_scales(pool))
    got = jnp.where((lengths > 0)[:, None, None], unfold_scales(got, pool), 0)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_fp8_scales_come_from_the_first_live_write_and_stay():
    """Calibration: padding (index -1) neither sets nor moves a scale; the first live write sets
    them, later writes (calibrating or not) keep them and saturate at +-448 instead of overflowing;
    a decode-style write (no calibration) into a fresh pool stores nothing usable until then."""
    K, P, S, H = 2, 4, 4, 8
    pool = PagePool.zeros(K, P, S, H, FP8, impl="reference")
    x = jnp.ones((3, K, H)) * jnp.asarray([1.0, 3.0])[None, :, None]
    padded = write_tokens(pool, x * 100, x * 100, jnp.asarray([-1, -1, -1]), calibrate=True)
    assert not padded.k_scale.any()
    first = write_tokens(pool, x, 2 * x, jnp.asarray([0, 1, -1]), calibrate=True)
    np.testing.assert_allclose(first.k_scale, np.asarray([1.0, 3.0]) * FP8_HEADROOM / FP8_MAX, rtol=1e-6)
    np.testing.assert_allclose(first.v_scale, 2 * first.k_scale, rtol=1e-6)
    later = write_tokens(first, 1000 * x, x, jnp.asarray([5, 6, 7]), calibrate=True)
    np.testing.assert_array_equal(later.k_scale, first.k_scale)
    k, v = later.dequantized()
    np.testing.assert_allclose(k[:, 0, 0, 0], [1.0, 3.0], rtol=2 ** -4)  # the first write, unchanged
    np.testing.assert_allclose(k[:, 1, 1, 0], np.asarray(first.k_scale) * FP8_MAX)  # saturated, finite
    assert np.isfinite(np.asarray(k)).all() and np.isfinite(np.asarray(v)).all()
    uncalibrated = write_tokens(pool, x, x, jnp.asarray([0, 1, 2]))
    assert not uncalibrated.k_scale.any() and not np.asarray(uncalibrated.dequantized()[0]).any()
    assert later.nbytes == 2 * K * P * S * H + 2 * K * 4  # 1 byte per element + the scales
    with pytest.raises(ValueError, match="need k_scale and v_scale"):
        PagePool(pool.k, pool.v)


def test_tpu_kernel_refuses_fp8_heads_xla_cannot_tile():
    from areal_jax.kernels import paged_attention as pa

    assert pa.KERNELS.unfit("tpu", 128, 16, 8, 8, 2, 1) is None  # 4 combined heads of e4m3: one word
    why = pa.KERNELS.unfit("tpu", 128, 16, 8, 8, 1, 1)  # 2 combined heads cannot fill a 4-byte word
    assert "cannot tile" in why and "kv_dtype bfloat16" in why
    assert pa.KERNELS.unfit("tpu", 128, 16, 8, 8, 1, 2) is None and pa.KERNELS.unfit("gpu", 128, 16, 8, 8, 1, 1) is None
    combined = _case(0, B=2, N=4, K=1, H=128, S=8, P=8, M=2, layout="combined", kv_dtype=FP8)
    np.testing.assert_array_equal(paged_attention(*combined, impl="auto", platform="tpu"),
                                  reference_paged_attention(*combined))


def test_gpu_kernel_refuses_what_triton_cannot_load():
    q, pool, lengths, tables = _case(0, B=2, N=4, K=2, H=24, S=8, P=8, M=2)
    with pytest.raises(ValueError, match="powers of two"):
        paged_attention(q, pool, lengths, tables, impl="pallas", platform="gpu", interpret=INTERPRET)
    # "auto" takes the reference where the kernel cannot (and on TPU below 128 lanes of head dim).
    want = reference_paged_attention(q, pool, lengths, tables)
    np.testing.assert_array_equal(paged_attention(q, pool, lengths, tables, impl="auto", platform="gpu"), want)
    combined = _case(0, B=2, N=4, K=2, H=32, S=8, P=8, M=2, layout="combined")
    np.testing.assert_array_equal(paged_attention(*combined, impl="auto", platform="tpu"),
                                  reference_paged_attention(*combined))
    with pytest.raises(ValueError, match="multiple of 128"):
        paged_attention(*combined, impl="pallas", platform="tpu")


def test_both_layouts_hold_the_same_tokens_and_the_layout_follows_the_kernel():
    a = _case(5, B=3, N=4, K=2, H=16, S=4, P=16, M=4)
    b = _case(5, B=3, N=4, K=2, H=16, S=4, P=16, M=4, layout="combined")
    for x, y in zip(a[1].heads_first(), b[1].heads_first()):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(reference_paged_attention(*b), reference_paged_attention(*a), atol=1e-6)
    assert b[1].k[1, 2, 2].tolist() == a[1].k[1, 1, 2].tolist()  # kv head 1's key sits at combined head 2
    assert (pool_layout("auto", "tpu"), pool_layout("auto", "cuda"), pool_layout("reference", "tpu")) == \
        ("combined", "heads", "heads")
    assert (kernel_name("auto", "tpu"), kernel_name("pallas", "gpu"), kernel_name("auto", "cpu")) == \
        ("ragged_paged", "pallas_triton_paged", "reference")
    pool = PagePool.zeros(2, 16, 4, 16, jnp.bfloat16, impl="auto", platform="tpu")
    assert (pool.layout, pool.k.shape, pool.num_pages, pool.page_size, pool.num_kv_heads, pool.nbytes) == \
        ("combined", (16, 4, 4, 16), 16, 4, 2, 16 * 4 * 4 * 16 * 2)
    with pytest.raises(ValueError, match="'combined' pool"):
        paged_attention(*a, impl="pallas", platform="tpu")
    # "auto" on a pool not laid out for the platform's kernel: the reference, not an error.
    np.testing.assert_array_equal(paged_attention(*a, impl="auto", platform="tpu"), reference_paged_attention(*a))


def test_flash_and_paged_kernels_are_chosen_by_one_dispatch():
    from areal_jax.kernels import dispatch
    from areal_jax.kernels import flash_attention as fa
    from areal_jax.kernels import paged_attention as pa

    for table, names in ((fa.KERNELS, {"gpu": "pallas_triton_flash", "tpu": "splash"}),
                         (pa.KERNELS, {"gpu": "pallas_triton_paged", "tpu": "ragged_paged"})):
        assert isinstance(table, dispatch.KernelTable)
        assert {p: table.kernel_name("auto", p) for p in names} == names
        assert table.kernel_name("pallas", "cuda") == names["gpu"]  # the planner's GPU targets say "cuda"
        assert table.resolve("auto", "cpu") == "reference" and table.kernel_name("auto", "cpu") == "reference"
        with dispatch.target_platform("tpu"):  # a deviceless compile for TPU chooses TPU kernels for both
            assert table.resolve("auto") == "pallas" and table.kernel_name("auto") == names["tpu"]
        with pytest.raises(ValueError, match="no kernel for platform 'cpu'"):
            table.resolve("pallas", "cpu")
        with pytest.raises(ValueError, match="must be one of"):
            table.resolve("cudnn", "gpu")
    with dispatch.target_platform("tpu"):
        assert pool_layout("auto") == "combined"
    assert (pa.KERNELS.entry("tpu").layout, pa.KERNELS.entry("cuda").layout) == ("combined", "heads")
    assert "multiple of 128" in pa.KERNELS.unfit("tpu", 64, 16) and pa.KERNELS.unfit("tpu", 128, 16) is None
    assert "powers of two" in pa.KERNELS.unfit("gpu", 96, 16) and pa.KERNELS.unfit("gpu", 128, 16) is None


def test_a_tpu_page_table_past_smem_is_refused_by_name_and_auto_falls_back():
    # ragged_paged_attention prefetches the page table into the TPU's 1 MiB SMEM; libtpu refused the
    # 7B v5p engine at 240 slots x 1,152 pages (1,105,920 B). Say so before compiling, and how many fit.
    from areal_jax.kernels import paged_attention as pa

    why = pa.KERNELS.unfit("tpu", 128, 16, 240, 1152)
    assert "1,105,920 B" in why and "SMEM" in why and "at most 224 slots" in why and "EngineConfig.num_slots" in why
    assert "EngineConfig.page_size = 64 fits 240 slots" in why  # 288 pages of 64: 240 x 384 words, 368,640 B
    # By hand: 224 x 1,152 x 4 = 1,032,192 B of table + 4 x (256 + 256 + 256) = 3,072 B of scalars fit;
    # 225 slots pad to 232 rows, 1,069,056 B of table alone.
    assert pa.KERNELS.unfit("tpu", 128, 16, 224, 1152) is None and pa.KERNELS.unfit("tpu", 128, 16, 225, 1152)
    assert pa.KERNELS.unfit("gpu", 128, 16, 4096, 4096) is None  # Triton reads the table from HBM

    B, M, S, K, N, H = 240, 1152, 16, 2, 4, 128  # traced abstractly: no 1 MB table is materialised
    q = jax.ShapeDtypeStruct((B, N, H), jnp.bfloat16)
    pool = PagePool(jax.ShapeDtypeStruct((64, S, 2 * K, H), jnp.bfloat16), None, "combined")
    lengths, tables = jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, M), jnp.int32)
    with pytest.raises(ValueError, match="SMEM"):
        jax.eval_shape(lambda *a: paged_attention(*a, impl="pallas", platform="tpu"), q, pool, lengths, tables)
    out = jax.eval_shape(lambda *a: paged_attention(*a, impl="auto", platform="tpu"), q, pool, lengths, tables)
    assert out.shape == (B, N, H)  # the reference gather, with a warning naming the limit


def test_tpu_smem_and_decode_block_sizes_by_hand():
    from areal_jax.kernels.paged_tpu import SMEM_BYTES, block_sizes, most_slots, smem_bytes

    # libtpu's page-table allocations (deviceless v5e compiles): 230 x 1,088 -> 1,069,056 B (232 x 1,152
    # words), 262 x 1,000 -> 1,081,344 B (264 x 1,024); the lengths, offsets and scalars on top.
    assert smem_bytes(230, 1088) == 1_069_056 + 4 * (256 + 256 + 256)
    assert smem_bytes(262, 1000) == 1_081_344 + 4 * (384 + 384 + 256)
    assert smem_bytes(256, 1000) > SMEM_BYTES >= smem_bytes(1000, 250)  # refused / compiled by libtpu
    assert most_slots(1152) == 224
    # The v5p 7B engine: 17,408 positions in 128-token pages, 136 per slot (padded to 256 words):
    # 1 KiB of table per slot, so 1,008 slots fit where 16-token pages allowed 224: 1,008 x 256 + 1,024 +
    # 1,024 + 256 = 260,352 words of 262,144; 1,016 slots need 262,400.
    assert smem_bytes(160, 136) == 4 * (160 * 256 + 256 + 256 + 256) and most_slots(136) == 1008
    # Decode blocks: 2 pages of 128 tokens (256 tokens), the fewest queries whose 7 query heads per kv
    # head fill 8 sublanes (2), not 32; VMEM: 4x two page blocks and the accumulators, at least 32 MiB.
    assert block_sizes(160, 128, 136, 4, 128, 2, q_heads_per_kv_head=7) == (2, 2, 32 << 20)
    assert block_sizes(160, 16, 1088, 4, 128, 2, q_heads_per_kv_head=8)[:2] == (16, 1)
    assert block_sizes(4, 64, 272, 2, 128, 2, q_heads_per_kv_head=1)[:2] == (4, 4)  # 8 queries, capped by slots


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tpu_wrapper_arguments_give_the_reference_through_jax_ref_ragged_paged_attention(seed):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    from areal_jax.kernels.paged_tpu import ragged_arguments

    q, pool, lengths, tables = _case(seed, B=5, N=8, K=2, H=32, S=8, P=24, M=4, layout="combined")
    lengths = lengths.at[0].set(0).at[1].set(1).at[2].set(16)  # empty, one token, a page boundary
    want = reference_paged_attention(q, pool, lengths, tables)
    got = ref_ragged_paged_attention(*ragged_arguments(q, pool, lengths, tables), sm_scale=32 ** -0.5)
    got = jnp.where((lengths > 0)[:, None, None], got, 0)  # what ragged_paged_decode does after the kernel
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


_COMPILE = """
import sys, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from areal_jax.aot import ProgramSpec
from areal_jax.kernels.paged_attention import PagePool, paged_attention
from areal_jax.plan.targets import parse_target, topology_devices
target, tensor, kv = parse_target(sys.argv[1]), int(sys.argv[2]), jnp.dtype(sys.argv[3])
mesh = jax.sharding.Mesh(__import__("numpy").array(topology_devices(target, tensor)).reshape(1, tensor), ("data", "tensor"))
sd = lambda shape, dt, spec=PartitionSpec(): jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
B, N, K, H, S, P, M = 32, 12, 2, 128, 16, 1024, 32
platform = target.platform
layout = "combined" if platform == "tpu" else "heads"
scaled = kv == jnp.float8_e4m3fn
specs = PagePool.partition_spec("tensor", layout=layout, scaled=scaled)
scales = (sd((K,), jnp.float32, specs.k_scale), sd((K,), jnp.float32, specs.v_scale)) if scaled else (None, None)
if layout == "combined":
    pool = PagePool(sd((P, S, 2 * K, H), kv, specs.k), None, "combined", *scales)
else:
    pool = PagePool(sd((K, P, S, H), kv, specs.k), sd((K, P, S, H), kv, specs.v), "heads", *scales)
fn = jax.jit(lambda q, pool, l, t: paged_attention(q, pool, l, t, impl="pallas", platform=platform,
                                                   heads_axis="tensor", replica_axis="data"))
q = sd((B, N, H), jnp.bfloat16, PartitionSpec(None, "tensor"))
spec = ProgramSpec("decode_attention", "generation", fn, (q, pool, sd((B,), jnp.int32), sd((B, M), jnp.int32)))
from areal_jax.plan.measure import attention_kernels
lowered = spec.lower()
print("ATTENTION", *attention_kernels(lowered.as_text()))
compiled = lowered.compile()
text = compiled.as_text()
print("CUSTOM_CALLS", text.count("tpu_custom_call"), text.count("__gpu$xla.gpu.triton"),
      text.count("all-gather"), compiled.memory_analysis().argument_size_in_bytes)
"""


def _compile_for(target, tensor, kv="bfloat16"):
    out = subprocess.run([sys.executable, "-c", _COMPILE, target, str(tensor), kv], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1"})
    if "in use by another process" in out.stderr or "lockfile" in out.stderr:
        pytest.skip("another process holds libtpu (one at a time)")
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("CUSTOM_CALLS"))
    attention = next(x for x in out.stdout.splitlines() if x.startswith("ATTENTION")).split()[1:]
    return tuple(int(n) for n in line.split()[1:]) + (attention,)


POOL_BYTES = 2 * 2 * 1024 * 16 * 128 * 2  # k and v, K=2, P, S, H, bf16


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax-cuda12-plugin not installed (pip install 'areal-jax[plan]')")
def test_gpu_kernel_compiles_for_h100_without_a_device_and_runs_per_head_shard():
    # ProgramSpec.lower traces under the abstract mesh of its arguments' devices, which names the
    # H100: without it Pallas would ask the host's CPU for a compute capability and fail.
    tpu_calls, triton_calls, gathers, arg_bytes, attention = _compile_for("8xh100", 2)
    assert triton_calls >= 1 and tpu_calls == 0 and attention == ["pallas_triton_paged"]  # as `plan --json` names it
    assert gathers == 0 and arg_bytes < POOL_BYTES * 0.6  # each device keeps its kv head's pages


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax-cuda12-plugin not installed (pip install 'areal-jax[plan]')")
def test_gpu_kernel_compiles_fp8_pages_for_h100_without_a_device():
    tpu_calls, triton_calls, gathers, arg_bytes, attention = _compile_for("8xh100", 2, "float8_e4m3fn")
    assert triton_calls >= 1 and attention == ["pallas_triton_paged"] and gathers == 0
    assert arg_bytes < POOL_BYTES * 0.3  # half the bf16 pool's bytes per device, plus scales


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install 'areal-jax[plan]')")
def test_tpu_kernel_compiles_for_v5e_without_a_device_and_runs_per_head_shard():
    tpu_calls, triton_calls, gathers, arg_bytes, attention = _compile_for("v5e-4", 2)
    assert tpu_calls >= 1 and triton_calls == 0 and attention == ["ragged_paged"]
    assert gathers == 0 and arg_bytes < POOL_BYTES * 0.6


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install 'areal-jax[plan]')")
def test_tpu_kernel_compiles_fp8_pages_for_v5e_without_a_device():
    # K = 2 over tensor 1 here: 4 combined e4m3 heads fill one 32-bit word (tensor 2 would leave 2).
    tpu_calls, triton_calls, gathers, arg_bytes, attention = _compile_for("v5e-4", 1, "float8_e4m3fn")
    assert tpu_calls >= 1 and attention == ["ragged_paged"] and gathers == 0
    assert arg_bytes < POOL_BYTES * 0.6  # the whole pool on one device, at 1 byte per element
