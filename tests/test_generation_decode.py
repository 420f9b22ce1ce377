"""The decode step's fast paths: per-layer KV cache with unrolled layers, greedy-only sampling, argmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.generation.sampling import first_argmax, sample_tokens
from areal_jax.models import KVCache, ModelConfig, forward, init_params
from areal_jax.models.transformer import split_layers

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, family="qwen2")


@pytest.mark.parametrize("seed", range(3))
def test_first_argmax_equals_numpy_argmax_with_ties_and_infinities(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 3, size=(40, 50)).astype(np.float32)  # many ties: the first index must win
    x[rng.random(x.shape) < 0.2] = -np.inf
    x[7] = -np.inf  # a row with no finite entry: index 0, as numpy
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(x)), x.argmax(-1))


def test_greedy_rows_take_the_argmax_and_its_tempered_logprob_in_any_batch():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 50)) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(0), 6)
    log_softmax = np.asarray(jax.nn.log_softmax(logits, -1))
    top_p, top_k = jnp.ones(6), jnp.zeros(6, jnp.int32)
    argmax = np.asarray(logits).argmax(-1)
    for temperature in (np.zeros(6), np.array([0, 1.0, 0, 0.5, 0, 2.0])):  # all greedy; mixed
        tokens, logprobs = jax.jit(sample_tokens)(logits, keys, jnp.asarray(temperature, jnp.float32), top_p, top_k)
        greedy = temperature == 0
        np.testing.assert_array_equal(np.asarray(tokens)[greedy], argmax[greedy])
        np.testing.assert_allclose(np.asarray(logprobs)[greedy], log_softmax[greedy, argmax[greedy]], rtol=1e-5)
        t = np.where(greedy, 1.0, temperature)[:, None]
        scaled = np.asarray(jax.nn.log_softmax(logits / t, -1))
        np.testing.assert_allclose(np.asarray(logprobs), scaled[np.arange(6), np.asarray(tokens)], rtol=1e-5)


def test_kv_cache_layouts_round_trip():
    cache = KVCache.zeros(CFG, batch=3, length=11)
    assert cache.k.shape == (CFG.num_layers, 3, CFG.num_kv_heads, 11, CFG.head_dim)
    filled = KVCache(*(jnp.asarray(np.random.default_rng(i).normal(size=cache.k.shape), jnp.float32) for i in (1, 2)))
    layers = filled.per_layer()
    assert layers.is_per_layer and len(layers.k) == CFG.num_layers
    assert layers.k[1].shape == (3, CFG.num_kv_heads, 11, CFG.head_dim)
    back = layers.stacked()
    np.testing.assert_array_equal(back.k, filled.k)
    np.testing.assert_array_equal(back.v, filled.v)
    params = init_params(CFG, 0)
    split = split_layers(params)
    assert len(split["layers"]) == CFG.num_layers and split_layers(split) is split
    np.testing.assert_array_equal(split["layers"][2]["wq"], params["layers"]["wq"][2])


@pytest.mark.parametrize("split_weights", [False, True])
def test_per_layer_cache_decode_equals_full_forward_and_stacked_cache(split_weights):
    """Prefill two ragged prompts into a stacked cache, then decode token by token with the
    per-layer cache (layers unrolled): logits equal a full causal forward over each sequence,
    and the cache equals the one a stacked-cache decode writes."""
    params = init_params(CFG, jax.random.key(3), std=0.3)
    rng = np.random.default_rng(4)
    lengths, S, steps = [5, 2], 12, 4
    seqs = [rng.integers(0, CFG.vocab_size, size=n + steps).tolist() for n in lengths]
    P = max(lengths)
    prompt = np.zeros((2, P), np.int32)
    pos = np.full((2, P), -1, np.int32)  # padding writes nothing
    for b, n in enumerate(lengths):
        prompt[b, :n], pos[b, :n] = seqs[b][:n], np.arange(n)
    _, stacked = forward(params, CFG, jnp.asarray(prompt), jnp.asarray(pos), cache=KVCache.zeros(CFG, 2, S))
    per_layer = stacked.per_layer()
    decode_params = split_layers(params) if split_weights else params
    for i in range(steps):
        tok = jnp.asarray([[s[n + i]] for s, n in zip(seqs, lengths)], jnp.int32)
        p = jnp.asarray([[n + i] for n in lengths], jnp.int32)
        logits, per_layer = forward(decode_params, CFG, tok, p, cache=per_layer)
        ref_logits, stacked = forward(params, CFG, tok, p, cache=stacked)
        assert per_layer.is_per_layer and not stacked.is_per_layer
        for b, n in enumerate(lengths):
            full, _ = forward(params, CFG, jnp.asarray([seqs[b][:n + i + 1]]))
            np.testing.assert_allclose(logits[b, 0], full[0, -1], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-4)
    back = per_layer.stacked()
    for b, n in enumerate(lengths):  # written positions agree; the rest was never written by either
        np.testing.assert_allclose(back.k[:, b, :, :n + steps], stacked.k[:, b, :, :n + steps], atol=1e-5)
        np.testing.assert_allclose(back.v[:, b, :, :n + steps], stacked.v[:, b, :, :n + steps], atol=1e-5)
        assert not np.any(back.k[:, b, :, n + steps:])


def test_unrolled_layers_equal_the_scan_in_values_and_gradients():
    params = init_params(CFG, jax.random.key(3), std=0.3)
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(3, 20)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 12 + [2] * 8], 3, axis=0), jnp.int32)

    def loss(p, scan):
        logits, _ = forward(p, CFG, ids, segment_ids=seg, scan_layers=scan)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * jnp.arange(20)), logits

    (v_scan, l_scan), g_scan = jax.jit(jax.value_and_grad(lambda p: loss(p, True), has_aux=True))(params)
    (v_unr, l_unr), g_unr = jax.jit(jax.value_and_grad(lambda p: loss(p, False), has_aux=True))(params)
    np.testing.assert_allclose(l_unr, l_scan, atol=1e-5)
    np.testing.assert_allclose(v_unr, v_scan, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_unr), jax.tree.leaves(g_scan)):
        # fp32 rounding of a different fusion order, relative to the leaf's scale
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max()))
    assert jax.tree.structure(g_unr) == jax.tree.structure(params)  # stacked layers, like the scan


@pytest.mark.parametrize("seed", range(3))
def test_packed_prefill_into_slots_equals_one_prefill_per_sequence(seed):
    """Random sequences packed several to a row land in their slots exactly as each one's own
    prefill puts them; slots not named keep their old contents."""
    from areal_jax.models.decoding import prefill_into_slots

    rng = np.random.default_rng(seed)
    params = init_params(CFG, seed, std=0.3)
    B, S, W = 6, 24, 16
    lengths = [int(n) for n in rng.integers(1, W // 2 + 1, size=4)]  # at least two to a row
    slots = rng.permutation(B)[:4]
    seqs = [rng.integers(0, CFG.vocab_size, size=n) for n in lengths]
    ids, seg, dest = (np.zeros((4, W), np.int32) for _ in range(3))
    fill = [0] * 4
    for i, s in enumerate(seqs):  # first row with room
        r = next(r for r in range(4) if fill[r] + s.size <= W)
        ids[r, fill[r]:fill[r] + s.size], seg[r, fill[r]:fill[r] + s.size] = s, i + 1
        dest[r, fill[r]:fill[r] + s.size] = slots[i]
        fill[r] += s.size
    assert len(set(seg[0].tolist()) - {0}) >= 2
    old = KVCache(*(jnp.asarray(rng.normal(size=(CFG.num_layers, B, CFG.num_kv_heads, S, CFG.head_dim)),
                                jnp.float32) for _ in range(2)))
    got = jax.jit(lambda c: prefill_into_slots(params, CFG, ids, seg, dest, c))(old.per_layer()).stacked()
    want_k, want_v = np.array(old.k), np.array(old.v)
    for s, slot in zip(seqs, slots):
        block = KVCache.zeros(CFG, 1, s.size)
        _, block = forward(params, CFG, jnp.asarray(s[None]), jnp.arange(s.size)[None], cache=block)
        want_k[:, slot, :, :s.size] = np.asarray(block.k)[:, 0]
        want_v[:, slot, :, :s.size] = np.asarray(block.v)[:, 0]
    np.testing.assert_allclose(np.asarray(got.k), want_k, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got.v), want_v, atol=2e-5)
