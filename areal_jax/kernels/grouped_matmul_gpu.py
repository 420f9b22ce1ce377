"""Grouped matmul on Hopper GPUs: jax's Mosaic GPU ragged-dot kernels, with our backward.

Why: XLA:GPU rewrites `lax.ragged_dot` into a dense product over every group (each row times every
group's weights, then masked). For a layer of 128 experts that is 128x the FLOPs of the tokens'
own experts and a `[G, A, O]` temporary: on the Qwen3-30B-A3B plan one re-prefill program needed
32 GiB of it. The Mosaic GPU kernels (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`,
`transposed_ragged_dot_mgpu`, warpgroup MMA, sm_90 only) compute each row with its own group.

Backward of `y [A, O] = x [A, I] @ w[g] [I, O]` per group g: dx = dy @ w[g]^T (the same kernel,
reading w transposed) and dw[g] = x_g^T dy_g (the transposed kernel, ragged along the
contraction). Rows past sum(sizes) are left unwritten in y and dx, as `grouped_matmul` allows.

Taken where the arrays are bf16 or f16, the device is Hopper, and the feature sizes are multiples
of the kernel blocks (`limits`); "auto" falls back to `lax.ragged_dot` otherwise (with a warning).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from areal_jax.kernels.grouped_matmul import GROUPED_MATMUL

BLOCK_K = 64  # contraction block of every call (its sizes must be multiples)
BLOCK_M_WEIGHT = 64  # rows of dw's blocks (along I)
MAX_CONCURRENT_STEPS = 4  # TMA pipeline depth
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")  # device kinds of compute capability 9.0


def _block_n(n: int) -> int:
    return 128 if n % 128 == 0 else 64


class RaggedOps(NamedTuple):
    """The two products the forward and backward are made of (the Mosaic kernels, or in tests the
    references with the same contracts).
    ragged(lhs [A, K], rhs, sizes [G], transpose_rhs) -> [A, N]: rhs [G, K, N] or, transposed, [G, N, K];
    transposed(lhs [A, M], rhs [A, N], sizes [G]) -> [G, M, N]: per group g, lhs_g^T rhs_g."""

    ragged: Callable[..., jax.Array]
    transposed: Callable[..., jax.Array]


# Each kernel call is its own jit so that a program's many identical calls (every layer of a MoE
# model) share one lowering: Mosaic GPU's layout inference runs in Python, and lowered once per call
# site it made a 94-layer model's plan take hours.
@functools.partial(jax.jit, static_argnames="transpose_rhs")
def _mosaic_ragged(lhs, rhs, sizes, transpose_rhs):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # GPU-only package: imported on use
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=sizes, block_m=64, block_n=_block_n(n),
                                      block_k=BLOCK_K, max_concurrent_steps=MAX_CONCURRENT_STEPS,
                                      grid_block_n=1, transpose_rhs=transpose_rhs)


class _TargetJax:
    """`jax` as a kernel module sees it while compiling for an abstract target: `devices()` answers
    with the target's streaming-multiprocessor count, everything else is jax."""

    def __init__(self, core_count: int):
        self._device = types.SimpleNamespace(core_count=core_count)

    def __getattr__(self, name):
        return getattr(jax, name)

    def devices(self, *args, **kwargs):
        return [self._device]


@contextlib.contextmanager
def _sized_for_target(module) -> Iterator[None]:
    """The transposed kernel sizes its grid by `jax.devices()[0].core_count`, which a deviceless
    compile (the planner) cannot answer: there it reads the abstract target device's core count."""
    target = jax.sharding.get_abstract_mesh().abstract_device
    if target is None or target.num_cores is None or hasattr(jax.devices()[0], "core_count"):
        yield
        return
    module.jax = _TargetJax(target.num_cores)
    try:
        yield
    finally:
        module.jax = jax


@jax.jit
def _mosaic_transposed(lhs, rhs, sizes):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
    with _sized_for_target(transposed_ragged_dot_mgpu):
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            lhs, rhs, group_sizes=sizes, block_m=BLOCK_M_WEIGHT, block_n=_block_n(rhs.shape[1]), block_k=BLOCK_K,
            max_concurrent_steps=MAX_CONCURRENT_STEPS, grid_block_n=1)


MOSAIC = RaggedOps(_mosaic_ragged, _mosaic_transposed)


def make_grouped_matmul(ops: RaggedOps) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """`(x [A, I], w [G, I, O], sizes [G]) -> [A, O]` differentiable in x and w, built from `ops`."""

    @jax.custom_vjp
    def gmm(x, w, sizes):
        return ops.ragged(x, w, sizes, False)

    def fwd(x, w, sizes):
        return ops.ragged(x, w, sizes, False), (x, w, sizes)

    def bwd(res, dy):
        x, w, sizes = res
        dy = dy.astype(x.dtype)
        dx = ops.ragged(dy, w, sizes, True)  # [A, I]: dy @ w[g]^T, w read as [G, I, O] = transposed [G, N, K]
        dw = ops.transposed(x, dy, sizes)  # [G, I, O]
        return dx, dw.astype(w.dtype), None

    gmm.defvjp(fwd, bwd)

    def padded(x, w, sizes):
        # The kernels tile rows (the transposed one's contraction) by BLOCK_K: whole tiles only.
        A = x.shape[0]
        rows = -(-A // BLOCK_K) * BLOCK_K
        return gmm(jnp.pad(x, ((0, rows - A), (0, 0))), w, sizes)[:A]

    return padded


mosaic_grouped_matmul = make_grouped_matmul(MOSAIC)


def _arch_major() -> int | None:
    """Compute capability major of the device being traced for: the abstract mesh's (a deviceless
    compile), else the local GPU's; None when unknown."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None:
        local = jax.devices()[0]
        device = local if local.platform == "gpu" else None
    if device is None:
        return None
    capability = getattr(device, "compute_capability", None)
    if capability:
        return int(str(capability).split(".")[0]) if str(capability)[0].isdigit() else None
    return 9 if any(kind in device.device_kind for kind in HOPPER_KINDS) else None


def limits(x: jax.ShapeDtypeStruct, w: jax.ShapeDtypeStruct) -> str | None:
    """Why the Mosaic kernels cannot take `x [A, I] @ w [G, I, O]` here, or None."""
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the Mosaic GPU grouped matmul takes bf16 or f16 operands of one dtype, got {x.dtype} x {w.dtype}"
    arch = _arch_major()
    if arch != 9:
        return f"the Mosaic GPU grouped matmul needs a Hopper GPU (compute capability 9.x), got {arch}"
    I, O = w.shape[1], w.shape[2]
    for name, size in (("input", I), ("output", O)):
        if size % BLOCK_K:
            return f"the Mosaic GPU grouped matmul needs feature sizes in multiples of {BLOCK_K}, {name} is {size}"
    return None


GROUPED_MATMUL.register("gpu", mosaic_grouped_matmul, name="mosaic_gpu_ragged_dot",
                        limits=limits)
