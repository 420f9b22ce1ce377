"""kernels/prefill_attention.py: the prefill kernels (Triton on GPU, Mosaic on TPU) interpreted on CPU
against the reference and against the engine's CPU path (`chunk_attention`), at chunk offsets, ragged
tails and GQA; a whole prefill (`prefill_block`) and a packed re-prefill (`prefill_into_slots`) through
the kernels against the reference path; and both kernels compiled without a device for their
targets, named as `plan --json` names them."""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.kernels import flash_attention as fa
from areal_jax.kernels import prefill_attention as pa
from areal_jax.kernels.dispatch import target_platform
from areal_jax.models import ModelConfig, init_params
from areal_jax.models.attention import chunk_attention
from areal_jax.models.decoding import prefill_block, prefill_into_slots
from areal_jax.models.transformer import KVCache

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None or \
    importlib.util.find_spec("jax_cuda12_plugin") is not None

# Each platform's kernel (the TPU kernel wants whole 128-lane heads), natively on its own backend
# (bench/accelerator_check.sh runs this file on a GPU), else interpreted.
KERNELS = [("gpu", 16), ("tpu", 128)]


def interpret(platform: str) -> bool:
    return jax.default_backend() != platform


def _case(seed, R, T, N, K, H, S):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(R, T, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(R, K, S, H)), jnp.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("platform,H", KERNELS)
@pytest.mark.parametrize("T,start,S,N,K", [
    (32, 0, 128, 4, 4),     # the first chunk: causal within itself
    (32, 64, 128, 6, 2),    # a later chunk over earlier keys, G = 3 (padded to 4 on GPU)
    (24, 96, 128, 7, 1),    # a ragged tail chunk, G = 7
    (16, 240, 256, 8, 2),   # the last positions of a longer block
])
def test_kernel_matches_the_reference_at_chunk_offsets(platform, H, T, start, S, N, K):
    q, k, v = _case(T + start + N, 2, T, N, K, H, S)
    want = pa.reference_prefill_attention(q, k, v, start)
    got = pa.prefill_attention(q, k, v, jnp.int32(start), impl="pallas", platform=platform,
                               interpret=interpret(platform))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6, rtol=0)
    # ... which is what the engine's CPU path computes from the chunk's keys and the earlier ones.
    own = lambda a: a[:, :, start:start + T].transpose(0, 2, 1, 3)  # noqa: E731
    cpu = chunk_attention(q, own(k), own(v), k, v, start, 16 if start else T)
    np.testing.assert_allclose(np.asarray(got), np.asarray(cpu), atol=3e-6, rtol=0)


def test_key_blocks_past_the_chunk_are_never_read():
    # Garbage (NaN) in the key blocks (64 positions) past the one holding the chunk's last
    # position (47) must not reach any output: the kernel stops before them.
    q, k, v = _case(0, 1, 16, 4, 2, 16, 128)
    k, v = (a.at[:, :, 64:].set(jnp.nan) for a in (k, v))
    got = pa.prefill_attention(q, k, v, jnp.int32(32), impl="pallas", platform="gpu", interpret=interpret("gpu"))
    assert np.isfinite(np.asarray(got)).all()


def test_dispatch_names_and_limits():
    assert pa.kernel_name("auto", "cpu") == "reference"
    assert pa.kernel_name("auto", "gpu") == "pallas_triton_prefill"
    assert pa.kernel_name("auto", "cuda") == "pallas_triton_prefill"
    assert pa.kernel_name("auto", "tpu") == "pallas_mosaic_prefill"
    assert pa.kernel_fits("auto", "gpu", 128, 512, 512) and not pa.kernel_fits("reference", "gpu", 128, 512, 512)
    assert not pa.kernel_fits("auto", "gpu", 96, 512, 512)  # Triton: powers of two
    assert not pa.kernel_fits("auto", "tpu", 64, 512, 512)  # Mosaic: whole lanes
    assert pa.kernel_fits("auto", "tpu", 128, 64, 64) and not pa.kernel_fits("auto", "tpu", 128, 320, 64)
    with pytest.raises(ValueError, match="power of two"):
        pa.prefill_attention(*_case(0, 1, 8, 2, 2, 24, 64), 0, impl="pallas", platform="gpu", interpret=True)


CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_position_embeddings=512)


def _params():
    return init_params(CFG, jax.random.key(0), dtype=jnp.float32)


def _interpreted(monkeypatch, table, platform, **options):
    """`table`'s kernel for `platform`, run by Pallas' interpreter off its own backend."""
    entry = table.entry(platform)
    monkeypatch.setitem(table.kernels, platform, dataclasses.replace(
        entry, fn=lambda *a, **o: entry.fn(*a, interpret=interpret(platform), **options, **o)))


def _gpu_kernel_prefill_matches_cpu(monkeypatch, ids, lengths, chunk):
    """Chunked prefill through the GPU kernel (interpreted) against the CPU path; its KV block."""
    params = _params()
    want_kv, want_last = prefill_block(params, CFG, ids, lengths, chunk=chunk, cache_dtype=jnp.float32)
    _interpreted(monkeypatch, pa.KERNELS, "gpu")
    with target_platform("gpu"):
        got_kv, got_last = prefill_block(params, CFG, ids, lengths, chunk=chunk, cache_dtype=jnp.float32,
                                         attention_impl="pallas")
    np.testing.assert_allclose(np.asarray(got_last), np.asarray(want_last), atol=2e-5, rtol=0)
    for g, w in zip(got_kv.k + got_kv.v, want_kv.k + want_kv.v):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=0)
    return got_kv


def test_a_chunked_prefill_through_the_gpu_kernel_equals_the_cpu_path(monkeypatch):
    # Rows of ragged lengths over two 48-token chunks and a 32-token tail: the same KV block and
    # last hidden states as the CPU path (`chunk_attention`).
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(1, 64, size=(3, 128)), jnp.int32)
    _gpu_kernel_prefill_matches_cpu(monkeypatch, ids, jnp.array([120, 5, 49], jnp.int32), chunk=48)


def test_a_block_length_the_kernel_refuses_is_padded_to_one_it_takes(monkeypatch):
    # 200 positions: not a multiple of the GPU kernel's 64-key blocks. The prefill runs a 256-position
    # block through the kernel and returns the 200 asked for, equal to the CPU path's.
    assert pa.kernel_block_len("auto", "gpu", 16, 200, 64) == 256 and pa.kernel_block_len("auto", "cpu", 16, 200, 64) == 200
    assert pa.kernel_block_len("auto", "tpu", 128, 17424, 512) == 17536 and pa.kernel_block_len("auto", "gpu", 128, 17408, 512) == 17408
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(1, 64, size=(2, 200)), jnp.int32)
    got_kv = _gpu_kernel_prefill_matches_cpu(monkeypatch, ids, jnp.array([200, 7], jnp.int32), chunk=64)
    assert got_kv.k[0].shape == (2, 2, 200, 16)


def test_a_packed_reprefill_through_the_flash_kernel_equals_the_cpu_path(monkeypatch):
    # Two histories packed in a row and one alone, into their slots: the flash kernel (segments)
    # writes the same cache as the blocked formula under the packed mask.
    params, rng = _params(), np.random.default_rng(2)
    ids = jnp.asarray(rng.integers(1, 64, size=(2, 32)), jnp.int32)
    seg = jnp.asarray(np.array([[1] * 12 + [2] * 15 + [0] * 5, [1] * 30 + [0] * 2]), jnp.int32)
    slots = jnp.asarray(np.array([[0] * 12 + [2] * 15 + [0] * 5, [1] * 32]), jnp.int32)
    cache = KVCache.zeros(CFG, 3, 64, jnp.float32).per_layer()
    want = prefill_into_slots(params, CFG, ids, seg, slots, cache)
    _interpreted(monkeypatch, fa.KERNELS, "gpu", block_q=16, block_k=16)
    got = prefill_into_slots(params, CFG, ids, seg, slots, cache, attention_impl="pallas", platform="gpu")
    for g, w in zip(got.k + got.v, want.k + want.v):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=0)


_COMPILE = """
import sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from areal_jax.aot import ProgramSpec
from areal_jax.models import sharding as shd
from areal_jax.models.attention import prefill_kernel_attention
from areal_jax.plan.measure import attention_kernels
from areal_jax.plan.targets import parse_target, topology_devices
target = parse_target(sys.argv[1])
mesh = jax.sharding.Mesh(np.array(topology_devices(target, 4)).reshape(2, 2), ("data", "tensor"))
sd = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
R, T, N, K, H, S = 4, 512, 8, 2, 128, 2048
fn = jax.jit(lambda q, k, v, s: prefill_kernel_attention(q, k, v, s, "pallas", platform=target.platform))
block = sd((R, K, S, H), PartitionSpec("data", "tensor"))
q = sd((R, T, N, H), PartitionSpec("data", None, "tensor"))
start = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
context = lambda: shd.activation_rules(shd.GENERATION_RULES, mesh)
spec = ProgramSpec("prefill_attention", "generation", fn, (q, block, block, start), context=context)
lowered = spec.lower()
print("ATTENTION", *attention_kernels(lowered.as_text()))
text = lowered.compile().as_text()
print("CUSTOM_CALLS", text.count("tpu_custom_call"), text.count("__gpu$xla.gpu.triton"), text.count("all-gather"))
"""


def _compile_for(target):
    out = subprocess.run([sys.executable, "-c", _COMPILE, target], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1"})
    if "in use by another process" in out.stderr or "lockfile" in out.stderr:
        pytest.skip("another process holds libtpu (one at a time)")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {x.split()[0]: x.split()[1:] for x in out.stdout.splitlines() if x.split()}
    return [int(n) for n in lines["CUSTOM_CALLS"]], lines["ATTENTION"]


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax-cuda12-plugin not installed (pip install 'areal-jax[plan]')")
def test_gpu_kernel_compiles_for_h100_without_a_device_per_shard():
    (tpu, triton, gathers), attention = _compile_for("8xh100")
    assert triton >= 1 and tpu == 0 and gathers == 0 and attention == ["pallas_triton_prefill"]


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install 'areal-jax[plan]')")
def test_tpu_kernel_compiles_for_v5e_without_a_device_per_shard():
    (tpu, triton, gathers), attention = _compile_for("v5e-4")
    assert tpu >= 1 and triton == 0 and gathers == 0 and attention == ["pallas_mosaic_prefill"]
