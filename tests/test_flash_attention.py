"""kernels/flash_attention.py: the chunked reference and the Pallas kernels (interpreted) against
dense attention, values and gradients, on packed rows of ragged lengths; and the model's training
loss and gradients with flash attention against the blocked formula."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from areal_jax.kernels import flash_attention as fa
from areal_jax.models import ModelConfig, forward, init_params
from areal_jax.models import sharding as shd
from areal_jax.models.attention import causal_attention
from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
from tests.test_attention import causal_segment_mask, numpy_attention, packed_segments, random_qkv


def dense(q, k, v, seg):
    """Today's training attention: the blocked formula under the packed causal mask."""
    return causal_attention(q, k, v, jnp.asarray(causal_segment_mask(np.asarray(seg))))


def grads(fn, q, k, v, weights):
    """d/dq, d/dk, d/dv of sum(fn(q, k, v) * weights), compiled."""
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * weights),
                            argnums=(0, 1, 2)))(q, k, v)


def case(seed, B, T, N, K, H):
    rng = np.random.default_rng(seed)
    seg = packed_segments(rng, B, T)
    q, k, v = random_qkv(rng, B, T, N, K, H)
    weights = rng.normal(size=(B, T, N, H)).astype(np.float32)
    return seg, q, k, v, weights


# (T, block_q, block_k): one key block per query block; several (the loop); ragged last blocks.
SHAPES = [(1, 8, 8), (37, 8, 512), (64, 16, 16), (75, 8, 16), (130, 32, 48)]


@pytest.mark.parametrize("T,block_q,block_k", SHAPES)
@pytest.mark.parametrize("N,K", [(4, 4), (8, 2), (6, 1)])
def test_reference_matches_numpy_on_packed_rows(T, block_q, block_k, N, K):
    seg, q, k, v, _ = case(T * 10 + N + K, 3, T, N, K, 8)
    out = jax.jit(lambda q, k, v: fa.reference_flash_attention(q, k, v, seg, block_q=block_q, block_k=block_k))(q, k, v)
    want = numpy_attention(q, k, v, causal_segment_mask(seg))  # zeros where no key is allowed
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(out)[seg == 0], 0.0)


@pytest.mark.parametrize("T,block_q,block_k", SHAPES[1:])
def test_reference_gradients_match_dense(T, block_q, block_k):
    """dq, dk, dv equal autodiff of the blocked formula (padding queries' outputs weigh in too:
    both give them zeros, so neither passes a gradient through them)."""
    seg, q, k, v, weights = case(T, 2, T, 8, 2, 16)
    got = grads(lambda q, k, v: fa.reference_flash_attention(q, k, v, seg, block_q=block_q, block_k=block_k),
                q, k, v, weights)
    want = grads(lambda q, k, v: dense(q, k, v, seg), q, k, v, weights)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5, err_msg=f"d/d{name}")


def test_short_rows_forward_rounds_exactly_as_the_blocked_formula():
    """Rows up to KEY_BLOCK tokens meet all their keys at once: the same arithmetic, bit for bit."""
    seg, q, k, v, _ = case(1, 2, 200, 8, 2, 16)
    got = jax.jit(lambda q, k, v: fa.reference_flash_attention(q, k, v, seg))(q, k, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(lambda q, k, v: dense(q, k, v, seg))(q, k, v)))


def test_without_segments_is_plain_causal():
    _, q, k, v, _ = case(2, 2, 40, 4, 2, 8)
    got = fa.flash_attention(q, k, v, None, impl="reference", block_q=8, block_k=16)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, causal_segment_mask(np.ones((2, 40)))),
                               atol=2e-6, rtol=0)


def test_bfloat16_values_and_gradients_stay_close_to_float32():
    seg, q, k, v, weights = case(3, 2, 96, 8, 2, 16)
    fn = lambda q, k, v: fa.reference_flash_attention(q, k, v, seg, block_q=16, block_k=32)  # noqa: E731
    q16, k16, v16 = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    out16 = jax.jit(fn)(q16, k16, v16)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out16, np.float32), numpy_attention(q, k, v, causal_segment_mask(seg)),
                               atol=3e-2, rtol=0)
    got = grads(fn, q16, k16, v16, weights)
    want = grads(lambda q, k, v: dense(q, k, v, seg), q, k, v, weights)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == jnp.bfloat16
        w = np.asarray(w)
        err = np.abs(np.asarray(g, np.float32) - w).max() / np.abs(w).max()
        assert err < 2e-2, f"d/d{name}: relative error {err}"


def residual_bytes(fn, *args) -> int:
    """Bytes autodiff keeps between forward and backward: the leaves of the vjp closure (traced
    abstractly: nothing is computed)."""
    leaves = jax.eval_shape(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1]), *args)
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves)


def test_backward_keeps_no_scores():
    """What the reverse pass keeps grows linearly with T (q, k, v, out, lse, segments); the blocked
    formula's grows with T^2: at T = 1024 it is more than 4x flash's, at 2048 more than 8x."""
    B, N, K, H = 1, 4, 2, 16
    for T in (1024, 2048):
        seg, q, k, v, _ = case(T, B, T, N, K, H)
        flash = residual_bytes(lambda q, k, v: fa.reference_flash_attention(q, k, v, seg), q, k, v)
        linear = 4 * (q.nbytes + k.nbytes + v.nbytes) + B * N * T * 4 + seg.nbytes  # generous O(T) bound
        assert flash <= linear, (T, flash, linear)
        blocked = residual_bytes(lambda q, k, v: dense(q, k, v, seg), q, k, v)
        assert blocked > (T // 256) * flash, (T, blocked, flash)  # the bound above can fail


def test_sharded_gradients_match_single_device():
    """Batch over fsdp, heads over tensor (TRAIN_RULES) on 8 fake devices, under jax.checkpoint."""
    seg, q, k, v, weights = case(11, 4, 40, 8, 2, 8)
    fn = jax.checkpoint(lambda q, k, v: fa.reference_flash_attention(q, k, v, seg, block_q=8, block_k=16))
    grad_fn = jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * weights), argnums=(0, 1, 2))
    want_value, want = jax.jit(grad_fn)(q, k, v)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    heads = NamedSharding(mesh, PartitionSpec("fsdp", None, "tensor"))
    with shd.activation_rules(shd.TRAIN_RULES, mesh):
        value, got = jax.jit(grad_fn)(*(jax.device_put(a, heads) for a in (q, k, v)))
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


# ---- Pallas kernels, interpreted on CPU (slow: small shapes) -----------------------------------------


@pytest.mark.parametrize("platform,options", [
    ("gpu", dict(block_q=32, block_k=32, block_backward=16, interpret=True)),
    ("tpu", dict(block=128, interpret=True)),
])
@pytest.mark.parametrize("T,N,K", [(70, 4, 2), pytest.param(45, 2, 2, marks=pytest.mark.slow)])
def test_pallas_kernel_matches_reference(platform, options, T, N, K):
    """Triton `mha` (GPU) and splash (TPU) in interpret mode: values and gradients on packed rows
    with padding, rows padded to the kernel's block multiple, GQA. Splash wants H = 128."""
    H = 128 if platform == "tpu" else 16
    seg, q, k, v, weights = case(T + N, 2, T, N, K, H)
    kernel = lambda q, k, v: fa.flash_attention(q, k, v, seg, impl="pallas", platform=platform, **options)  # noqa: E731
    reference = lambda q, k, v: fa.reference_flash_attention(q, k, v, seg)  # noqa: E731
    np.testing.assert_allclose(np.asarray(kernel(q, k, v)), np.asarray(reference(q, k, v)), atol=1e-5, rtol=0)
    got = jax.grad(lambda q, k, v: jnp.sum(kernel(q, k, v) * weights), argnums=(0, 1, 2))(q, k, v)
    want = grads(reference, q, k, v, weights)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5, err_msg=f"d/d{name}")


# ---- dispatch and configuration ------------------------------------------------------------------------


def test_dispatch_by_platform():
    assert fa.resolve_impl("auto", "cpu") == "reference"
    assert fa.resolve_impl("auto", "gpu") == fa.resolve_impl("auto", "tpu") == "pallas"
    assert (fa.kernel_name("auto", "gpu"), fa.kernel_name("auto", "tpu"), fa.kernel_name("auto", "cpu")) == (
        "pallas_triton_flash", "splash", "reference")
    with pytest.raises(ValueError, match="no kernel for platform 'cpu'"):
        fa.flash_attention(*(jnp.zeros((1, 4, 2, 8)),) * 3, impl="pallas", platform="cpu")
    with pytest.raises(ValueError, match="must be one of"):
        fa.resolve_impl("cudnn")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        fa.flash_attention(jnp.zeros((1, 4, 3, 8)), jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)))


def test_config_fields_are_validated():
    assert TrainEngineConfig().attention_impl == "auto"  # RL's and SFT's trainer alike
    with pytest.raises(ValueError, match="TrainEngineConfig.attention_impl must be one of"):
        TrainEngineConfig(attention_impl="flash")
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        forward({}, None, jnp.zeros((1, 2), jnp.int32), attention_impl="dense")


# ---- the model ----------------------------------------------------------------------------------------------

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)


@pytest.mark.parametrize("remat,scan_layers,key_block", [
    ("none", True, 32),
    pytest.param("full", False, 512, marks=pytest.mark.slow),
    pytest.param("save_dots", True, 32, marks=pytest.mark.slow),
])
def test_model_loss_and_gradients_equal_the_blocked_formula(remat, scan_layers, key_block, monkeypatch):
    """A packed training batch (ragged sequences, padding) through the whole decoder: loss and
    every parameter's gradient with flash attention equal the blocked formula's, with the keys
    met at once or in blocks (the loop), under each rematerialization."""
    monkeypatch.setattr(fa, "KEY_BLOCK", key_block)
    params = init_params(CFG, 0, std=0.2)
    rng = np.random.default_rng(4)
    T = 100  # four query blocks
    seg = packed_segments(rng, 3, T)
    ids = rng.integers(0, CFG.vocab_size, size=seg.shape).astype(np.int32)
    targets = rng.integers(0, CFG.vocab_size, size=seg.shape).astype(np.int32)

    def loss(params, impl):
        logits, _ = forward(params, CFG, ids, segment_ids=seg, remat=remat, scan_layers=scan_layers,
                            attention_impl=impl)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(seg > 0, logp, 0.0)) / np.sum(seg > 0)

    want_loss, want = jax.jit(jax.value_and_grad(lambda p: loss(p, "blocked")))(params)
    got_loss, got = jax.jit(jax.value_and_grad(lambda p: loss(p, "reference")))(params)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for (path, g), w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("impl", ["blocked", "auto"])
def test_engine_config_reaches_the_training_forward(impl):
    """The trainer's log-prob and gradient programs run the attention TrainEngineConfig names:
    flash attention is the only custom_vjp in the decoder."""
    import optax

    from areal_jax.trainer.algorithm import ppo_objective
    from areal_jax.trainer.programs import build_train_programs

    programs = build_train_programs(CFG, TrainEngineConfig(attention_impl=impl), ppo_objective(PPOConfig()),
                                    optax.sgd(0.1))
    params = init_params(CFG, 0)
    batch = {name: jnp.ones((2, 16), jnp.int32) for name in ("input_ids", "targets", "segment_ids", "positions")}
    text = str(jax.make_jaxpr(programs.logprobs)(params, batch))
    assert ("custom_vjp_call" in text) == (impl != "blocked")


def test_pallas_kernel_runs_per_shard_under_a_mesh():
    """Under the train rules on 8 fake devices (rows over fsdp, heads over tensor) the kernel runs
    per shard (shard_map) and gives the single-device values and gradients."""
    from areal_jax.models.attention import training_attention

    seg, q, k, v, weights = case(13, 4, 40, 4, 2, 16)
    options = dict(impl="pallas", platform="gpu", block_q=16, block_k=16, block_backward=16, interpret=True)
    grad_fn = jax.value_and_grad(lambda q, k, v: jnp.sum(training_attention(q, k, v, seg, **options) * weights),
                                 argnums=(0, 1, 2))
    want_value, want = grad_fn(q, k, v)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    heads = NamedSharding(mesh, PartitionSpec("fsdp", None, "tensor"))
    with shd.activation_rules(shd.TRAIN_RULES, mesh):
        fn = jax.jit(grad_fn)
        value, got = fn(*(jax.device_put(a, heads) for a in (q, k, v)))
        assert "shard_map" in str(jax.make_jaxpr(grad_fn)(q, k, v))
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5)


def test_target_platform_chooses_the_kernel_for_a_deviceless_compile():
    """`plan` compiles for a target from a CPU host: kernels are chosen for the target, and the
    Triton kernel appears in the traced program."""
    from areal_jax.kernels.dispatch import target_platform

    seg, q, k, v, _ = case(5, 1, 32, 2, 1, 16)
    with target_platform("gpu"):
        assert fa.resolve_impl("auto") == "pallas" and fa.kernel_name("auto") == "pallas_triton_flash"
        text = str(jax.make_jaxpr(lambda q, k, v: fa.flash_attention(q, k, v, seg, interpret=True))(q, k, v))
    assert "mha_forward" in text
    assert fa.resolve_impl("auto") == "reference"
