"""The Hopper grouped matmul (kernels/grouped_matmul_gpu.py): its backward's algebra, where it
refuses, and that it compiles for an H100 without a device in place of XLA:GPU's dense ragged dot."""

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.kernels import grouped_matmul_gpu as gpu
from areal_jax.kernels.dispatch import target_platform
from areal_jax.kernels.grouped_matmul import grouped_matmul

HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


def _ragged_reference(lhs, rhs, sizes, transpose_rhs):
    return jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, sizes)


def _transposed_reference(lhs, rhs, sizes):
    """Per group g: lhs_g^T rhs_g, by a one-hot of each row's group (rows past the groups in none)."""
    ends = jnp.cumsum(sizes)
    group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")  # [A]; G past the groups
    onehot = jax.nn.one_hot(group, sizes.shape[0], dtype=lhs.dtype)  # [A, G]
    return jnp.einsum("ag,am,an->gmn", onehot, lhs, rhs)


REFERENCE_OPS = gpu.RaggedOps(_ragged_reference, _transposed_reference)


@pytest.mark.parametrize("seed", range(4))
def test_custom_backward_equals_autodiff_of_ragged_dot(seed):
    # The kernels' contracts, met by references: the forward and both cotangents our backward
    # assembles from them equal jax's autodiff of lax.ragged_dot, with empty groups and rows past
    # the groups (masked, as expert_mlp masks them).
    rng = np.random.default_rng(seed)
    A, I, O, G = 37, 16, 24, 5
    sizes = rng.multinomial(int(rng.integers(20, A + 1)), np.ones(G) / G)
    sizes[rng.integers(G)] = 0
    sizes = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.normal(size=(A, I)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(G, I, O)), jnp.float32)
    covered = (jnp.arange(A) < jnp.sum(sizes))[:, None]
    target = jnp.asarray(rng.normal(size=(A, O)), jnp.float32)
    ours = gpu.make_grouped_matmul(REFERENCE_OPS)

    def loss(fn, x, w):
        return jnp.sum(jnp.where(covered, fn(x, w, sizes), 0.0) * target)

    want_val, want_grads = jax.value_and_grad(lambda x, w: loss(jax.lax.ragged_dot, x, w), (0, 1))(x, w)
    got_val, got_grads = jax.value_and_grad(lambda x, w: loss(ours, x, w), (0, 1))(x, w)
    np.testing.assert_allclose(got_val, want_val, rtol=1e-5)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.where(np.asarray(covered) if got.ndim == 2 else True, got, 0),
                                   np.where(np.asarray(covered) if want.ndim == 2 else True, want, 0),
                                   rtol=1e-4, atol=1e-4)
    empty = int(np.flatnonzero(np.asarray(sizes) == 0)[0])
    assert np.all(np.asarray(got_grads[1][empty]) == 0)  # an expert with no tokens gets no gradient


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_limits_name_dtype_architecture_and_feature_sizes():
    bf = jnp.bfloat16
    assert "bf16 or f16" in gpu.limits(_struct((8, 64), jnp.float32), _struct((4, 64, 128), jnp.float32))
    assert "bf16 or f16" in gpu.limits(_struct((8, 64), bf), _struct((4, 64, 128), jnp.float32))
    # Here (a CPU host, no abstract GPU mesh) the architecture is unknown: refused by name.
    assert "Hopper" in gpu.limits(_struct((8, 64), bf), _struct((4, 64, 128), bf))


def test_pallas_on_a_gpu_without_the_kernel_conditions_is_an_error_and_auto_falls_back():
    x = jnp.ones((6, 64), jnp.float32)
    w = jnp.ones((3, 64, 64), jnp.float32)
    sizes = jnp.asarray([2, 0, 4], jnp.int32)
    with target_platform("gpu"):
        with pytest.raises(ValueError, match=r"MoEConfig.grouped_matmul = 'gmm': .*bf16 or f16"):
            grouped_matmul(x, w, sizes, impl="gmm")
        np.testing.assert_allclose(grouped_matmul(x, w, sizes, impl="auto"), jax.lax.ragged_dot(x, w, sizes))


_COMPILE = """
import sys, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from areal_jax.aot import target_device_context
from areal_jax.models import moe
from areal_jax.plan.targets import parse_target, topology_devices
target = parse_target(sys.argv[1])
impl = sys.argv[2]
mesh = jax.sharding.Mesh(__import__("numpy").array(topology_devices(target, 1)).reshape(1), ("data",))
sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
E, k, D, Fe, M = 64, 4, 512, 256, int(sys.argv[3])
x = sd((M, D), jnp.bfloat16)
experts = sd((M, k), jnp.int32)
weights = sd((M, k), jnp.float32)
w_in, w_out = sd((E, D, Fe), jnp.bfloat16), sd((E, Fe, D), jnp.bfloat16)
def loss(x, wg, wu, wd, experts, weights):
    out, _ = moe.expert_mlp(x, experts, weights, wg, wu, wd, impl)
    return jnp.sum(out.astype(jnp.float32) ** 2)
fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))
with target_device_context((x,)):
    compiled = fn.lower(x, w_in, w_in, w_out, experts, weights).compile()
text = compiled.as_text()
print("RESULT", text.count('custom_call_target="mosaic_gpu'), compiled.memory_analysis().temp_size_in_bytes)
"""


def _compile(target, impl, tokens=4096):
    out = subprocess.run([sys.executable, "-c", _COMPILE, target, impl, str(tokens)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
    return tuple(int(n) for n in line.split()[1:])


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax-cuda12-plugin not installed (pip install 'areal-jax[plan]')")
def test_expert_mlp_gradient_compiles_for_h100_with_mosaic_kernels_and_without_dense_temporaries():
    kernel_calls, kernel_temp = _compile("1xh100", "auto")
    dense_calls, dense_temp = _compile("1xh100", "ragged_dot")
    # Three projections forward, and for each a dx and a dw kernel backward.
    assert kernel_calls == 9 and dense_calls == 0
    # XLA:GPU's ragged dot keeps [G, A, F] products: 64 experts x 16k assignments x 256 x 4 B = 1 GiB
    # per projection. The kernels keep only the [A, F] activations.
    assert dense_temp > 2 ** 30 and kernel_temp * 8 < dense_temp, (kernel_temp, dense_temp)
    # A decode step's few tokens (12 assignments) are padded to whole row tiles for the kernels.
    assert _compile("1xh100", "auto", tokens=3)[0] == 9


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax-cuda12-plugin not installed (pip install 'areal-jax[plan]')")
def test_a100_is_not_hopper_so_auto_keeps_ragged_dot():
    assert _compile("1xa100", "auto")[0] == 0
