"""Grouped matmul for mixture-of-experts layers: rows of `x [A, I]` grouped consecutively (group g
holds `sizes[g]` rows) times their group's `w [G, I, O]` -> `[A, O]`.

The reference is `jax.lax.ragged_dot` (on CPU and on GPU it becomes a masked dense product over
all groups; libtpu has a ragged dot of its own). Kernels: on TPU the megablox `gmm` Pallas kernel
(jax's, with its own backward); on Hopper GPUs jax's Mosaic GPU ragged dots
(kernels/grouped_matmul_gpu.py). Rows past sum(sizes) are unspecified in all: callers mask them.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from areal_jax.kernels.dispatch import KernelTable

logger = logging.getLogger(__name__)
# The GPU kernel's module registers itself on first use (it imports this one).
GROUPED_MATMUL = KernelTable("MoEConfig.grouped_matmul", modules={"gpu": "areal_jax.kernels.grouped_matmul_gpu"})
# MoEConfig.grouped_matmul's names for the table's implementations ("gmm": the platform's kernel).
IMPL_NAMES = {"auto": "auto", "ragged_dot": "reference", "gmm": "pallas"}
TILE = 128  # megablox tile along rows, contraction and output (the TPU's lane width)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, impl: str = "auto") -> jax.Array:
    """`x [A, I]`, `w [G, I, O]`, `sizes [G]` int32 -> `[A, O]` in x's dtype (see module docstring)."""
    if GROUPED_MATMUL.resolve(IMPL_NAMES[impl]) == "pallas":
        unfit = GROUPED_MATMUL.unfit(None, x, w)
        if unfit is None:
            return GROUPED_MATMUL.kernel()(x, w, sizes)
        if impl != "auto":
            raise ValueError(f"MoEConfig.grouped_matmul = {impl!r}: {unfit}")
        logger.warning("grouped_matmul: %s; using lax.ragged_dot", unfit)  # while tracing, not per step
    return jax.lax.ragged_dot(x, w, sizes)


def _megablox_gmm(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """megablox `gmm` with rows padded to a whole number of tiles (the padding lies past every group)."""
    # Imported here, not with the model: the Pallas TPU package is only needed when tracing for TPU.
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    A, I = x.shape
    tm = TILE if A >= TILE else max(8, -(-A // 8) * 8)
    padded = -(-A // tm) * tm
    xp = jnp.pad(x, ((0, padded - A), (0, 0)))
    out = megablox.gmm(xp, w, sizes.astype(jnp.int32), x.dtype, (tm, min(TILE, I), min(TILE, w.shape[2])))
    return out[:A]


GROUPED_MATMUL.register("tpu", _megablox_gmm, name="megablox_gmm")
