"""Weight-only int8 for the generation copy of the weights (EngineConfig.weight_dtype = "int8").

A quantized weight is a `QuantizedWeight(q, scale)`: `q` int8 of the weight's shape, `scale` fp32
with the weight's rank and size 1 on the contracted (input) axes: one symmetric absmax scale per
output channel, `w ~= q * scale`, q in [-127, 127]. Its `astype(dtype)` dequantizes, so every place
the forward reads a weight as `p[name].astype(compute_dtype)` runs on it unchanged: the convert
and the multiply are elementwise on the matmul's operand, which XLA fuses into it, and with the
layers unrolled or scanned the dequantized transient is one weight at a time, not a second copy.

What is quantized (`QUANTIZED`): the large matmul weights of every layer, i.e. the attention
projections, the dense MLP, the routed experts and the shared expert: >99% of a 235B MoE's
bytes. What stays in the served dtype: the embedding (a gather: one row per token, nothing to
save in bytes read), the LM head (under 0.3% of a 235B model's bytes, and it sets the recorded
log-probs and the sampling distribution directly), norms, biases and the MoE routers (small;
the router's top-k is a discrete choice that a rounding can flip).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

WEIGHT_DTYPES = ("int8",)
QMAX = 127  # symmetric: -128 is never produced, so negating a weight negates its code exactly
# The scale is amax times this (a multiply, not amax / 127: XLA turns a division by a constant
# into a multiply by its reciprocal, and the NumPy reference must round the same way).
INV_QMAX = np.float32(1.0 / QMAX)

# Layer weights quantized, each with the axes it contracts over in the per-layer layout (the
# stacked layout has the layer axis in front: one more).
QUANTIZED: dict[str, tuple[int, ...]] = {
    "wq": (0,), "wk": (0,), "wv": (0,),  # [D, N|K, H]
    "wo": (0, 1),  # [N, H, D]: one scale per output feature
    "w_gate": (0,), "w_up": (0,), "w_down": (0,),  # [D, F], [F, D]
    "we_gate": (1,), "we_up": (1,), "we_down": (1,),  # [E, D, Fe], [E, Fe, D]: per expert and output
    "ws_gate": (0,), "ws_up": (0,), "ws_down": (0,),  # the shared expert
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """An int8 weight and its per-output-channel scales (see the module docstring)."""

    q: Any  # int8, the weight's shape
    scale: Any  # fp32, the weight's shape with 1 on the contracted axes

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    def astype(self, dtype) -> jax.Array:
        """The dequantized weight in `dtype` (the product in fp32, rounded once)."""
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)


def contracted_axes(name: str, stacked: bool = False) -> tuple[int, ...] | None:
    """The axes weight `name` of a layer contracts over (None: not quantized)."""
    axes = QUANTIZED.get(name)
    return None if axes is None else tuple(a + int(stacked) for a in axes)


def quantize(w: jax.Array, axes: tuple[int, ...]) -> QuantizedWeight:
    """Symmetric absmax int8 of `w` with one scale per slice over `axes` (the contracted ones).
    An all-zero slice gets scale 1 (codes 0)."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax * INV_QMAX, jnp.float32(1.0))
    # Times the reciprocal (one division per channel), as XLA would rewrite a division by a
    # broadcast anyway: written out, the NumPy reference rounds exactly the same way.
    q = jnp.clip(jnp.round(w32 * (jnp.float32(1.0) / scale)), -QMAX, QMAX).astype(jnp.int8)
    return QuantizedWeight(q, scale)


def quantize_reference(w: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """`quantize` in NumPy (q, scale): what the push must land, bit for bit."""
    w32 = np.asarray(w, np.float32)
    amax = np.max(np.abs(w32), axis=axes, keepdims=True)
    scale = np.where(amax > 0, amax * INV_QMAX, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.round(w32 * (np.float32(1.0) / scale)), -QMAX, QMAX).astype(np.int8)
    return q, scale


def is_quantized(params: Any) -> bool:
    """Whether any weight of `params` is a QuantizedWeight."""
    return any(isinstance(x, QuantizedWeight) for x in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, QuantizedWeight)))


def map_quantized(params: Mapping[str, Any], fn: Callable[[Any, tuple[int, ...]], Any]) -> dict[str, Any]:
    """`params` (stacked or split layers) with every `QUANTIZED` layer weight w replaced by
    fn(w, its contracted axes in that layout); other entries as they are. Works on arrays,
    ShapeDtypeStructs and shardings alike."""
    layers = params["layers"]

    def layer(d: Mapping[str, Any], stacked: bool) -> dict[str, Any]:
        return {k: (fn(v, contracted_axes(k, stacked)) if k in QUANTIZED else v) for k, v in d.items()}

    out = dict(params)
    out["layers"] = (tuple(layer(d, False) for d in layers) if isinstance(layers, tuple) else layer(layers, True))
    return out


def scale_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


def scale_spec(spec: Any, axes: tuple[int, ...]) -> Any:
    """The PartitionSpec of a weight's scales: the weight's, unsharded on the contracted axes."""
    from jax.sharding import PartitionSpec

    entries = tuple(spec) + (None,) * max(0, max(axes) + 1 - len(spec))
    return PartitionSpec(*(None if i in axes else e for i, e in enumerate(entries)))


def quantized_sharding(sharding: Any, axes: tuple[int, ...]) -> QuantizedWeight:
    """The (q, scale) shardings of a weight laid out by the NamedSharding `sharding`."""
    from jax.sharding import NamedSharding

    return QuantizedWeight(sharding, NamedSharding(sharding.mesh, scale_spec(sharding.spec, axes)))


def quantized_struct(struct: jax.ShapeDtypeStruct, axes: tuple[int, ...]) -> QuantizedWeight:
    """ShapeDtypeStructs of a weight's int8 codes and scales (for ahead-of-time programs)."""
    shape, sharding = tuple(struct.shape), getattr(struct, "sharding", None)
    shardings = (quantized_sharding(sharding, axes) if sharding is not None
                 else QuantizedWeight(None, None))
    return QuantizedWeight(jax.ShapeDtypeStruct(shape, jnp.int8, sharding=shardings.q),
                           jax.ShapeDtypeStruct(scale_shape(shape, axes), jnp.float32, sharding=shardings.scale))


_quantize_program = jax.jit(quantize, static_argnums=1)


def quantize_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` (stacked or split) with every `QUANTIZED` weight quantized where it lies, one
    weight at a time (the caller's arrays are untouched)."""
    return map_quantized(params, lambda w, axes: _quantize_program(w, axes))


def served_bytes(model_cfg: Any, itemsize: int, weight_dtype: str | None) -> int:
    """Bytes of one whole copy of the served weights: `itemsize` a weight (the generation dtype),
    with `weight_dtype` "int8" one byte a quantized weight plus its fp32 scales."""
    from areal_jax.models.transformer import param_shapes

    shapes = param_shapes(model_cfg)
    total = model_cfg.num_params() * itemsize
    if weight_dtype is None:
        return total
    for name, shape in shapes["layers"].items():
        axes = contracted_axes(name, stacked=True)
        if axes is not None:
            total += -int(np.prod(shape)) * (itemsize - 1) + 4 * int(np.prod(scale_shape(shape, axes)))
    return total
