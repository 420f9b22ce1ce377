"""What XLA makes of the model: costs counted in the optimized program, not timed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import ModelConfig, init_params
from areal_jax.models.transformer import forward

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, family="qwen2")


@pytest.mark.parametrize("scan_layers", [True, False])
def test_rotary_angles_are_evaluated_once_per_training_step(scan_layers):
    """cos/sin of the RoPE angles: one [B, T, H/2] table per step, not one per layer, head or pass.

    XLA CPU's cosine costs ~10x torch's per element; fused into each rotation it was evaluated
    for every head of every layer, forward and backward (32 cosines in a 4-layer gradient).
    """
    params = init_params(CFG, jax.random.key(0), std=0.02)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 16)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 6], 2, axis=0), jnp.int32)

    def loss(p):
        return jnp.mean(jax.nn.logsumexp(forward(p, CFG, ids, segment_ids=seg, scan_layers=scan_layers)[0], -1))

    program = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    assert program.count(" cosine(") == 1
    assert program.count(" sine(") == 1
