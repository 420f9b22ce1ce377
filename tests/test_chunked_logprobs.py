"""ppo/logprobs.py: log-probs and entropy from hidden states, chunk by chunk along the sequence.

The reference is the dense computation: logits `[R, T, V]` of the whole micro-batch, then
`token_logprobs` / `token_entropy` (what the trainer computed before chunking).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from areal_jax.models import ModelConfig, forward, init_params
from areal_jax.models.sharding import TRAIN_RULES, activation_rules
from areal_jax.ppo import token_entropy, token_logprobs
from areal_jax.ppo.logprobs import chunk_layout, hidden_logprobs, hidden_logprobs_and_entropy, weight_head
from areal_jax.api import PackedBatch
from areal_jax.trainer.config import OptimizerConfig, TrainEngineConfig
from areal_jax.trainer.sft import sft_objective
from areal_jax.trainer.train_step import JaxTrainEngine

V = 1001  # a multiple of nothing convenient
TEMPERATURE = 0.7


def inputs(R, T, D=16, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(k[0], (R, T, D)).astype(dtype)
    w = 0.3 * jax.random.normal(k[1], (D, V))  # fp32 master weight, cast to the compute dtype inside
    targets = jax.random.randint(k[2], (R, T), 0, V)
    cot = jax.random.normal(k[3], (R, T))  # a random cotangent: every token's gradient counts
    return hidden, w, targets, cot


def dense(hidden, w, targets):
    logits = weight_head(w)(hidden)  # [R, T, V] fp32
    return token_logprobs(logits, targets, TEMPERATURE), token_entropy(jax.lax.stop_gradient(logits), TEMPERATURE)


def chunked(hidden, w, targets, chunk_tokens):
    return hidden_logprobs_and_entropy(hidden, w, targets, TEMPERATURE, chunk_tokens=chunk_tokens)


def values_and_grads(fn, hidden, w, targets, cot):
    def loss(h, w):
        logp, entropy = fn(h, w, targets)
        return jnp.sum(logp * cot) + jnp.sum(entropy), (logp, entropy)  # entropy adds no gradient

    (_, (logp, entropy)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, w)
    return logp, entropy, grads


def entropy_free_grads(hidden, w, targets, cot):
    """Gradients of sum(logp * cot) alone, densely: what the entropy must not change."""
    return jax.grad(lambda h, w: jnp.sum(dense(h, w, targets)[0] * cot), argnums=(0, 1))(hidden, w)


@pytest.mark.parametrize("R, T, chunk_tokens", [
    (3, 37, 20),   # 6 positions per chunk: 7 chunks, the last one padded
    (2, 64, 32),   # chunks divide the row exactly
    (4, 9, 3),     # fewer tokens per chunk than rows: one position of every row per chunk
    (1, 50, 49),   # one token over the chunk
])
def test_fp32_values_and_gradients_equal_dense(R, T, chunk_tokens):
    hidden, w, targets, cot = inputs(R, T)
    assert chunk_layout(R, T, chunk_tokens)[0] > 1  # really chunked
    ref_logp, ref_ent, _ = values_and_grads(lambda h, w, t: dense(h, w, t), hidden, w, targets, cot)
    ref_grads = entropy_free_grads(hidden, w, targets, cot)
    logp, ent, grads = values_and_grads(functools.partial(chunked, chunk_tokens=chunk_tokens), hidden, w, targets,
                                        cot)
    np.testing.assert_allclose(logp, ref_logp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=0, atol=1e-5)
    assert float(jnp.max(ent)) <= np.log(V) + 1e-4 and float(jnp.min(ent)) > 0
    for got, want, name in zip(grads, ref_grads, ("hidden", "head weight")):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale, err_msg=name)


def test_bf16_compute_equals_dense():
    R, T, chunk_tokens = 3, 45, 32
    hidden, w, targets, cot = inputs(R, T, dtype=jnp.bfloat16, seed=1)
    ref_logp, ref_ent, _ = values_and_grads(dense, hidden, w, targets, cot)
    ref_grads = entropy_free_grads(hidden, w, targets, cot)
    logp, ent, grads = values_and_grads(functools.partial(chunked, chunk_tokens=chunk_tokens), hidden, w, targets,
                                        cot)
    assert logp.dtype == ent.dtype == jnp.float32
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32  # like their primals
    # The same bf16 products accumulated in fp32: equal up to summation order.
    np.testing.assert_allclose(logp, ref_logp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=0, atol=1e-5)
    for got, want, name in zip(grads, ref_grads, ("hidden", "head weight")):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        # bf16 gradients round to 8 bits of mantissa (dense rounds the weight gradient once, the
        # chunks once per chunk before their fp32 sum): compare at about one bf16 ulp of the largest.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * np.abs(want).max(), err_msg=name)
        assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999, name


def test_small_micro_batch_runs_the_dense_computation_exactly():
    R, T = 2, 24
    hidden, w, targets, _ = inputs(R, T)
    head = weight_head(w)
    assert chunk_layout(R, T, R * T) == (1, T)
    logp, ent = jax.jit(lambda h: hidden_logprobs_and_entropy(h, head, targets, TEMPERATURE, chunk_tokens=R * T))(
        hidden)
    ref_logp, ref_ent = jax.jit(lambda h: dense(h, w, targets))(hidden)
    np.testing.assert_array_equal(logp, ref_logp)
    np.testing.assert_array_equal(ent, ref_ent)
    only = jax.jit(lambda h: hidden_logprobs(h, head, targets, TEMPERATURE, chunk_tokens=R * T))(hidden)
    np.testing.assert_array_equal(only, ref_logp)


@pytest.mark.parametrize("rows, length, chunk, want", [
    (2, 8, 16, (1, 8)), (2, 8, 100, (1, 8)), (3, 37, 20, (7, 6)), (1, 10, 4, (3, 4)), (1, 9, 4, (3, 3)),
    (4, 9, 3, (9, 1)), (2, 4096, 4096, (2, 2048)), (8, 2048, 4096, (4, 512)),
])
def test_chunk_layout(rows, length, chunk, want):
    n, tc = chunk_layout(rows, length, chunk)
    assert (n, tc) == want
    assert n * tc >= length and n * tc - length < n  # covers the row, padded by less than a chunk each
    assert rows * tc <= max(chunk, rows)  # a chunk's logits are within budget (one position at least)


@pytest.mark.parametrize("chunk", [0, -1, 2.0, True, None])
def test_chunk_layout_rejects_bad_chunk(chunk):
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_layout(2, 8, chunk)


def test_bad_shapes_are_reported():
    hidden, w, targets, _ = inputs(2, 8)
    with pytest.raises(ValueError, match="targets"):
        hidden_logprobs(hidden, w, targets[:, :4])


def test_sharded_mesh_equals_dense():
    """On a 2x2 ("fsdp", "tensor") mesh under the training rules: rows over fsdp, vocab over tensor."""
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    R, T, D = 4, 30, 16
    hidden, w, targets, cot = inputs(R, T, D, seed=2)
    hidden = jax.device_put(hidden, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    ref_logp, ref_ent, _ = values_and_grads(dense, hidden, w, targets, cot)
    ref_grads = entropy_free_grads(hidden, w, targets, cot)
    with activation_rules(TRAIN_RULES, mesh):
        logp, ent, grads = jax.jit(lambda h, w: values_and_grads(functools.partial(chunked, chunk_tokens=24), h, w,
                                                                  targets, cot))(hidden, w)
    np.testing.assert_allclose(logp, ref_logp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=0, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_chunked_gradient_temporaries_stay_below_one_logits_array():
    """Compiled memory of value-and-gradient: dense holds several [tokens, V] fp32 arrays, the
    chunked program a few chunk-sized ones."""
    R, T, D, vocab, chunk = 2, 1024, 64, 4096, 256
    args = (jax.ShapeDtypeStruct((R, T, D), jnp.float32), jax.ShapeDtypeStruct((D, vocab), jnp.float32),
            jax.ShapeDtypeStruct((R, T), jnp.int32))
    logits_bytes = R * T * vocab * 4  # one fp32 [tokens, V] array: 32 MiB

    def temporaries(chunk_tokens):
        def loss(h, w, t):
            logp, entropy = hidden_logprobs_and_entropy(h, w, t, chunk_tokens=chunk_tokens)
            return jnp.sum(logp) + jnp.sum(entropy)

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    dense_temp, chunked_temp = temporaries(R * T), temporaries(chunk)
    assert dense_temp > 1.5 * logits_bytes  # the dense backward keeps logits and softmax alike
    assert chunked_temp < 0.5 * logits_bytes
    # A chunk's logits are R * Tc * V fp32 with R * Tc = 256 tokens: 4 MiB; a few of them, plus
    # the fp32 head-weight gradient (1 MiB) and the hidden-state gradient.
    assert chunked_temp < 4 * chunk * vocab * 4


@pytest.mark.parametrize("tied", [False, True])
def test_sft_loss_chunked_equals_dense(tied):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, tie_word_embeddings=tied)
    params = init_params(cfg, 3, std=0.1)
    rng = np.random.default_rng(0)
    R, T = 3, 20
    segment_ids = np.repeat(np.array([[1] * 12 + [2] * 6 + [0] * 2]), R, axis=0).astype(np.int32)
    batch = {"input_ids": jnp.asarray(rng.integers(0, V, (R, T)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, V, (R, T)), jnp.int32),
             "loss_mask": jnp.asarray((rng.random((R, T)) < 0.6) * (segment_ids > 0), jnp.float32),
             "segment_ids": jnp.asarray(segment_ids)}

    def dense_loss(p):
        logits, _ = forward(p, cfg, batch["input_ids"], None, batch["segment_ids"])
        logp = token_logprobs(logits, batch["targets"])
        return -jnp.sum(logp * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])

    ref_loss, ref_grads = jax.value_and_grad(dense_loss)(params)
    # SFT's loss on the training engine, its log-probs 16 tokens at a time (3 x 20 tokens: chunked).
    trainer = JaxTrainEngine(cfg, params, OptimizerConfig(), sft_objective(),
                            engine=TrainEngineConfig(logit_chunk_tokens=16))
    arrays = {**{k: np.asarray(v) for k, v in batch.items()}, "positions": np.tile(np.arange(T, dtype=np.int32), (R, 1))}
    grads, stats = trainer.minibatch_gradients([PackedBatch(arrays, (), int(np.sum(arrays["loss_mask"])))])
    loss, n = stats["loss"], stats["n_valid"]
    assert float(n) == float(jnp.sum(batch["loss_mask"]))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for (path, got), want in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    # The head (lm_head, or the tied embedding) gets its gradient through the chunks.
    assert ("lm_head" in grads) != tied
    assert float(jnp.abs(grads["lm_head" if not tied else "embed"]).max()) > 0
