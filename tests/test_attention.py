"""models/attention.py: causal-blocked attention against a NumPy reference and the dense formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from areal_jax.models import ModelConfig, forward, init_params
from areal_jax.models import sharding as shd
from areal_jax.models.attention import attention, block_size_for, causal_attention


def packed_segments(rng: np.random.Generator, B: int, T: int) -> np.ndarray:
    """Random `[B, T]` segment ids: runs of lengths 1..T/2 (many of length 1), padding zeros
    at the start, middle and end of rows, ids restarting per row."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        pos, k = int(rng.integers(0, 3)), 1  # maybe leading padding
        while pos < T:
            n = 1 if rng.random() < 0.25 else int(rng.integers(1, max(2, T // 2)))
            seg[b, pos:pos + n] = k if rng.random() > 0.1 else 0
            pos, k = pos + n, k + 1
    return seg


def causal_segment_mask(seg: np.ndarray) -> np.ndarray:
    """`[B, T, T]`: key s is allowed for query t iff s <= t, same segment, not padding."""
    T = seg.shape[1]
    causal = np.tril(np.ones((T, T), bool))
    return causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)


def numpy_attention(q, k, v, mask):
    """Per query and head: softmax over the allowed keys (float64); zeros when there are none."""
    B, T, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for n in range(N):
            scores = q[b, :, n].astype(np.float64) @ k[b, :, n // G].T.astype(np.float64) / np.sqrt(H)
            for t in range(T):
                keys = np.flatnonzero(mask[b, t])
                if keys.size:
                    w = np.exp(scores[t, keys] - scores[t, keys].max())
                    out[b, t, n] = (w / w.sum()) @ v[b, keys, n // G]
    return out


def blocked(block):
    """causal_attention with query blocks of `block` tokens, compiled (eager dispatch of the
    unrolled block loop is slow)."""
    return jax.jit(lambda q, k, v, mask: causal_attention(q, k, v, mask, block_size=block))


def random_qkv(rng, B, T, N, K, H):
    return tuple(rng.normal(size=shape).astype(np.float32) for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))


@pytest.mark.parametrize("T,block", [(1, 8), (7, 8), (50, 8), (64, 16), (37, 16)])
@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (8, 2), (6, 1)])
def test_matches_numpy_reference_on_packed_rows(T, block, N, K):
    rng = np.random.default_rng(T * 100 + N * 10 + K)
    seg = packed_segments(rng, 3, T)
    mask = causal_segment_mask(seg)
    q, k, v = random_qkv(rng, 3, T, N, K, 8)
    out = np.asarray(blocked(block)(q, k, v, jnp.asarray(mask)))
    np.testing.assert_allclose(out, numpy_attention(q, k, v, mask), atol=1e-5, rtol=0)


def test_equals_dense_formula_and_its_gradients_on_real_queries():
    rng = np.random.default_rng(7)
    B, T, N, K, H = 3, 45, 8, 2, 16  # 45 = 2 full blocks of 16 and a short one
    seg = packed_segments(rng, B, T)
    mask = jnp.asarray(causal_segment_mask(seg))
    q, k, v = random_qkv(rng, B, T, N, K, H)
    real = (seg > 0)[:, :, None, None]  # padding queries: dense gives a meaningless mean, ours zeros
    weights = rng.normal(size=(B, T, N, H)).astype(np.float32) * real

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, mask) * weights)

    out = np.asarray(blocked(16)(q, k, v, mask))
    dense = np.asarray(attention(q, k, v, mask))
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, dense, 0), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(out[seg == 0], 0.0)
    got = jax.jit(jax.grad(loss(blocked(16)), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(attention), argnums=(0, 1, 2)))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5, err_msg=f"d/d{name}")


def test_bfloat16_inputs_stay_close_to_float32():
    rng = np.random.default_rng(3)
    seg = packed_segments(rng, 2, 40)
    mask = jnp.asarray(causal_segment_mask(seg))
    q, k, v = random_qkv(rng, 2, 40, 4, 2, 8)
    out16 = blocked(16)(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), mask)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out16, np.float32), numpy_attention(q, k, v, np.asarray(mask)),
                               atol=5e-2, rtol=0)


def test_sharded_and_rematerialized_gradients_match_single_device():
    """Batch over fsdp, heads over tensor (TRAIN_RULES) on 8 fake devices, under jax.checkpoint."""
    rng = np.random.default_rng(11)
    B, T, N, K, H = 4, 40, 8, 2, 8
    seg = packed_segments(rng, B, T)
    mask = jnp.asarray(causal_segment_mask(seg))
    q, k, v = random_qkv(rng, B, T, N, K, H)
    weights = rng.normal(size=(B, T, N, H)).astype(np.float32)

    def loss(q, k, v, mask):
        return jnp.sum(jax.checkpoint(lambda *a: causal_attention(*a, block_size=16))(q, k, v, mask) * weights)

    grad_fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    want_value, want = jax.jit(grad_fn)(q, k, v, mask)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    heads = NamedSharding(mesh, PartitionSpec("fsdp", None, "tensor"))
    q_s, k_s, v_s = (jax.device_put(a, heads) for a in (q, k, v))
    mask_s = jax.device_put(mask, NamedSharding(mesh, PartitionSpec("fsdp")))
    with shd.activation_rules(shd.TRAIN_RULES, mesh):
        value, got = jax.jit(grad_fn)(q_s, k_s, v_s, mask_s)
    assert not got[0].sharding.is_fully_replicated
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


def test_packed_forward_equals_each_sequence_alone():
    """The decoder over packed rows longer than a block (several blocks, segments crossing their
    boundaries) gives every sequence the logits it gets alone."""
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    params = init_params(cfg, 0, std=0.2)
    rng = np.random.default_rng(5)
    T = 3 * block_size_for(1) + 5
    seg = packed_segments(rng, 2, T)
    ids = rng.integers(0, cfg.vocab_size, size=seg.shape).astype(np.int32)
    logits = jax.jit(lambda i, s: forward(params, cfg, i, segment_ids=s)[0])
    packed = np.asarray(logits(ids, seg))
    spans = [(b, np.flatnonzero(seg[b] == s)) for b in range(seg.shape[0]) for s in set(seg[b].tolist()) - {0}]
    assert any(cols[-1] - cols[0] >= block_size_for(T) for _, cols in spans)
    alone_ids = np.zeros((len(spans), T), np.int32)  # each sequence at the start of its own row
    alone_seg = np.zeros((len(spans), T), np.int32)
    for r, (b, cols) in enumerate(spans):
        alone_ids[r, :cols.size] = ids[b, cols]
        alone_seg[r, :cols.size] = 1
    alone = np.asarray(logits(alone_ids, alone_seg))
    for r, (b, cols) in enumerate(spans):
        np.testing.assert_allclose(packed[b, cols], alone[r, :cols.size], atol=1e-5, rtol=0)


def test_block_size_grows_to_bound_the_block_count():
    assert block_size_for(1) == block_size_for(512) == 32
    assert block_size_for(4096) == 128
    assert block_size_for(4097) == 129
    with pytest.raises(ValueError, match="block_size"):
        block_size_for(64, block_size=0)


def test_rejects_cross_attention_shapes():
    q = jnp.zeros((1, 4, 2, 8))
    kv = jnp.zeros((1, 6, 2, 8))
    with pytest.raises(ValueError, match="T == S"):
        causal_attention(q, kv, kv, jnp.ones((1, 4, 6), bool))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        causal_attention(jnp.zeros((1, 4, 3, 8)), jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)),
                         jnp.ones((1, 4, 4), bool))
