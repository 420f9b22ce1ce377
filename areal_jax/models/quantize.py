"""Weight-only int8 and int4 for the generation copy of the weights (EngineConfig.weight_dtype).

A quantized weight is a `QuantizedWeight(q, scale)`, `w ~= q * scale` (the scale broadcast over
the elements it covers), with symmetric absmax scales:

- "int8": `q` int8 of the weight's shape, in [-127, 127]; `scale` fp32 with the weight's rank and
  size 1 on the contracted (input) axes: one scale per output channel.
- "int4": `q` jnp.int4 of the weight's shape, in [-7, 7]; one bf16 scale per group of
  `INT4_GROUP` consecutive elements along the weight's last contracted axis (`group_axis`), so
  `scale` has the weight's shape with that axis divided by the group size. Per-channel scales
  are too coarse for 4 bits (one outlier in a 4,096-long row would set the step of all of it);
  groups along the contraction bound that to its 128 neighbours.

Its `astype(dtype)` dequantizes, so every place the forward reads a weight as
`p[name].astype(compute_dtype)` runs on it unchanged: the convert, the (free) reshape into groups
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
import ml_dtypes
import numpy as np

from areal_jax.aot import dtype_bits

WEIGHT_DTYPES = ("int8", "int4")
QMAX = 127  # symmetric: -128 is never produced, so negating a weight negates its code exactly
# The scale is amax times this (a multiply, not amax / 127: XLA turns a division by a constant
# into a multiply by its reciprocal, and the NumPy reference must round the same way).
INV_QMAX = np.float32(1.0 / QMAX)
INT4_QMAX = 7  # symmetric as int8's: -8 is never produced
INV_INT4_QMAX = np.float32(1.0 / INT4_QMAX)
# Elements per int4 scale along the contraction. 128 divides every contracted dim of the shipped
# models (hidden 1,536-8,192, MLP 6,144-28,672, experts 768 and 1,536, head_dim 128), so groups tile
# each weight exactly, and it is the group GPTQ's and AWQ's published int4 results use: one bf16
# scale per 128 codes is 1/64 byte a weight on top of the code's 1/2. A contracted dim of at most
# 128 that it does not divide (test models) is one group; a longer one is refused (`group_size`).
INT4_GROUP = 128
# jnp.int4 storage: XLA packs it two codes a byte in device memory (its compiled programs count
# half a byte an element, on CPU as on TPU), and device_put, shardings, jit and astype take it as
# any dtype, so no hand packing. NumPy's itemsize says 1 for it: count bytes with aot.dtype_bits.
CODE_DTYPES = {"int8": jnp.int8, "int4": jnp.int4}
SCALE_DTYPES = {"int8": jnp.float32, "int4": jnp.bfloat16}

# Layer weights quantized, each with the axes it contracts over in the per-layer layout (the
# stacked layout has the layer axis in front: one more).
QUANTIZED: dict[str, tuple[int, ...]] = {
    "wq": (0,), "wk": (0,), "wv": (0,),  # [D, N|K, H]
    "wo": (0, 1),  # [N, H, D]: one scale per output feature (int4: per head and group of head_dim)
    "w_gate": (0,), "w_up": (0,), "w_down": (0,),  # [D, F], [F, D]
    "we_gate": (1,), "we_up": (1,), "we_down": (1,),  # [E, D, Fe], [E, Fe, D]: per expert and output
    "ws_gate": (0,), "ws_up": (0,), "ws_down": (0,),  # the shared expert
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight's int8 or int4 codes and their scales (see the module docstring)."""

    q: Any  # int8 or int4, the weight's shape
    scale: Any  # the weight's rank: 1 on the contracted axes (int8), groups on the group axis (int4)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    def astype(self, dtype) -> jax.Array:
        """The dequantized weight in `dtype` (the product in fp32, rounded once). A scale axis of
        neither 1 nor the weight's size is the int4 group axis: the codes are viewed as
        (groups, group size) there so each group meets its scale."""
        q, scale = self.q, self.scale
        grouped = [a for a, (n, s) in enumerate(zip(q.shape, scale.shape)) if s not in (1, n)]
        if not grouped:
            return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)
        (a,) = grouped
        shape, groups = tuple(q.shape), scale.shape[a]
        codes = q.reshape(shape[:a] + (groups, shape[a] // groups) + shape[a + 1:]).astype(jnp.float32)
        return (codes * jnp.expand_dims(scale.astype(jnp.float32), a + 1)).reshape(shape).astype(dtype)


def contracted_axes(name: str, stacked: bool = False) -> tuple[int, ...] | None:
    """The axes weight `name` of a layer contracts over (None: not quantized)."""
    axes = QUANTIZED.get(name)
    return None if axes is None else tuple(a + int(stacked) for a in axes)


def group_axis(axes: tuple[int, ...]) -> int:
    """The axis int4 groups run along: the last contracted one (wo's head_dim, else the input)."""
    return max(axes)


def group_size(n: int) -> int:
    """int4 elements per scale along a contracted axis of size `n`."""
    if n % INT4_GROUP == 0:
        return INT4_GROUP
    if n <= INT4_GROUP:
        return n
    raise ValueError(f"int4 weights need each contracted dimension to be a multiple of INT4_GROUP = {INT4_GROUP} "
                     f"(or at most that), got {n}")


def _check(weight_dtype: str) -> None:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")


def scale_shape(shape: tuple[int, ...], axes: tuple[int, ...], weight_dtype: str = "int8") -> tuple[int, ...]:
    """The scales' shape of a weight of `shape` contracting over `axes`."""
    _check(weight_dtype)
    if weight_dtype == "int8":
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    a = group_axis(axes)
    return tuple(n // group_size(n) if i == a else n for i, n in enumerate(shape))


def quantize(w: jax.Array, axes: tuple[int, ...], weight_dtype: str = "int8") -> QuantizedWeight:
    """Symmetric absmax codes of `w` (see the module docstring); an all-zero slice or group gets
    scale 1 (codes 0)."""
    _check(weight_dtype)
    w32 = w.astype(jnp.float32)
    if weight_dtype == "int8":
        amax = jnp.max(jnp.abs(w32), axis=axes, keepdims=True)
        scale = jnp.where(amax > 0, amax * INV_QMAX, jnp.float32(1.0))
        # Times the reciprocal (one division per channel), as XLA would rewrite a division by a
        # broadcast anyway: written out, the NumPy reference rounds exactly the same way.
        q = jnp.clip(jnp.round(w32 * (jnp.float32(1.0) / scale)), -QMAX, QMAX).astype(jnp.int8)
        return QuantizedWeight(q, scale)
    a, shape = group_axis(axes), tuple(w.shape)
    g = group_size(shape[a])
    grouped = w32.reshape(shape[:a] + (shape[a] // g, g) + shape[a + 1:])
    amax = jnp.max(jnp.abs(grouped), axis=a + 1, keepdims=True)
    # The bf16 scale is rounded first and the codes divide by the rounded one, so the round trip
    # stays within half a step: amax / scale is at most 7 (1 + 2^-8), clipped to 7.
    scale = (amax * INV_INT4_QMAX).astype(jnp.bfloat16)
    scale = jnp.where(scale > 0, scale, jnp.bfloat16(1.0))
    codes = jnp.clip(jnp.round(grouped * (jnp.float32(1.0) / scale.astype(jnp.float32))), -INT4_QMAX, INT4_QMAX)
    return QuantizedWeight(codes.astype(jnp.int4).reshape(shape), jnp.squeeze(scale, a + 1))


def quantize_reference(w: np.ndarray, axes: tuple[int, ...], weight_dtype: str = "int8"
                       ) -> tuple[np.ndarray, np.ndarray]:
    """`quantize` in NumPy (q, scale): what the push must land, bit for bit."""
    _check(weight_dtype)
    w32 = np.asarray(w, np.float32)
    if weight_dtype == "int8":
        amax = np.max(np.abs(w32), axis=axes, keepdims=True)
        scale = np.where(amax > 0, amax * INV_QMAX, np.float32(1.0)).astype(np.float32)
        q = np.clip(np.round(w32 * (np.float32(1.0) / scale)), -QMAX, QMAX).astype(np.int8)
        return q, scale
    a, shape = group_axis(axes), w32.shape
    g = group_size(shape[a])
    grouped = w32.reshape(shape[:a] + (shape[a] // g, g) + shape[a + 1:])
    amax = np.max(np.abs(grouped), axis=a + 1, keepdims=True)
    scale = (amax * INV_INT4_QMAX).astype(ml_dtypes.bfloat16)
    scale = np.where(scale > 0, scale, ml_dtypes.bfloat16(1.0)).astype(ml_dtypes.bfloat16)
    codes = np.clip(np.round(grouped * (np.float32(1.0) / scale.astype(np.float32))), -INT4_QMAX, INT4_QMAX)
    return codes.astype(ml_dtypes.int4).reshape(shape), np.squeeze(scale, a + 1)


def weight_dtype_of(params: Any) -> str | None:
    """"int8" or "int4" where `params` holds QuantizedWeights (of that code dtype), else None."""
    for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight)):
        if isinstance(x, QuantizedWeight):
            return "int4" if np.dtype(x.q.dtype) == np.dtype(jnp.int4) else "int8"
    return None


def is_quantized(params: Any) -> bool:
    """Whether any weight of `params` is a QuantizedWeight."""
    return weight_dtype_of(params) is not None


def map_quantized(params: Mapping[str, Any], fn: Callable[[Any, tuple[int, ...], str], Any]) -> dict[str, Any]:
    """`params` (stacked or split layers) with every `QUANTIZED` layer weight w replaced by
    fn(w, its contracted axes in that layout, its name); other entries as they are. Works on
    arrays, ShapeDtypeStructs and shardings alike."""
    layers = params["layers"]

    def layer(d: Mapping[str, Any], stacked: bool) -> dict[str, Any]:
        return {k: (fn(v, contracted_axes(k, stacked), k) if k in QUANTIZED else v) for k, v in d.items()}

    out = dict(params)
    out["layers"] = (tuple(layer(d, False) for d in layers) if isinstance(layers, tuple) else layer(layers, True))
    return out


def scale_spec(spec: Any, axes: tuple[int, ...], weight_dtype: str = "int8", shape: tuple[int, ...] | None = None,
               mesh_shape: Mapping[str, int] | None = None) -> Any:
    """The PartitionSpec of a weight's scales. int8: the weight's, unsharded on the contracted
    axes (size 1). int4: the weight's; its group axis keeps the weight's split, which must leave
    whole groups on each shard (else refused: the dequantize would gather the weight)."""
    from jax.sharding import PartitionSpec

    entries = tuple(spec) + (None,) * max(0, max(axes) + 1 - len(spec))
    if weight_dtype == "int8":
        return PartitionSpec(*(None if i in axes else e for i, e in enumerate(entries)))
    a = group_axis(axes)
    entry = entries[a]
    if entry is not None:
        if shape is None or mesh_shape is None:
            raise ValueError("an int4 scale's spec needs the weight's shape and the mesh")
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        split = int(np.prod([mesh_shape[n] for n in names]))
        groups = shape[a] // group_size(shape[a])
        if groups > 1 and groups % split:
            raise ValueError(f"int4 groups of {group_size(shape[a])} along a dimension of {shape[a]} split {split} "
                             f"ways over {entry!r} leave part of a group on a shard ({groups} groups): choose a "
                             f"generation_tensor / generation_expert that divides {groups}")
        if groups == 1:
            entries = entries[:a] + (None,) + entries[a + 1:]
    return PartitionSpec(*entries)


def quantized_sharding(sharding: Any, axes: tuple[int, ...], weight_dtype: str = "int8",
                       shape: tuple[int, ...] | None = None) -> QuantizedWeight:
    """The (q, scale) shardings of a weight of `shape` laid out by the NamedSharding `sharding`."""
    from jax.sharding import NamedSharding

    spec = scale_spec(sharding.spec, axes, weight_dtype, shape, dict(sharding.mesh.shape))
    return QuantizedWeight(sharding, NamedSharding(sharding.mesh, spec))


def quantized_struct(struct: jax.ShapeDtypeStruct, axes: tuple[int, ...], weight_dtype: str = "int8"
                     ) -> QuantizedWeight:
    """ShapeDtypeStructs of a weight's codes and scales (for ahead-of-time programs)."""
    shape, sharding = tuple(struct.shape), getattr(struct, "sharding", None)
    shardings = (quantized_sharding(sharding, axes, weight_dtype, shape) if sharding is not None
                 else QuantizedWeight(None, None))
    return QuantizedWeight(jax.ShapeDtypeStruct(shape, CODE_DTYPES[weight_dtype], sharding=shardings.q),
                           jax.ShapeDtypeStruct(scale_shape(shape, axes, weight_dtype), SCALE_DTYPES[weight_dtype],
                                                sharding=shardings.scale))


_quantize_program = jax.jit(quantize, static_argnums=(1, 2))


def quantize_params(params: Mapping[str, Any], weight_dtype: str = "int8") -> dict[str, Any]:
    """`params` (stacked or split) with every `QUANTIZED` weight quantized where it lies, one
    weight at a time (the caller's arrays are untouched)."""
    _check(weight_dtype)
    return map_quantized(params, lambda w, axes, _: _quantize_program(w, axes, weight_dtype))


def quantized_bytes(shape: tuple[int, ...], axes: tuple[int, ...], weight_dtype: str) -> int:
    """Bytes of a weight of `shape` quantized over `axes`: its codes (int4 packed two a byte) and
    its scales."""
    codes = -(-int(np.prod(shape)) * dtype_bits(CODE_DTYPES[weight_dtype]) // 8)
    scales = int(np.prod(scale_shape(shape, axes, weight_dtype)))
    return codes + scales * np.dtype(SCALE_DTYPES[weight_dtype]).itemsize


def served_bytes(model_cfg: Any, itemsize: int, weight_dtype: str | None) -> int:
    """Bytes of one whole copy of the served weights: `itemsize` a weight (the generation dtype),
    with `weight_dtype` "int8" one byte a quantized weight plus its fp32 scales, with "int4" half a
    byte plus its bf16 scales."""
    from areal_jax.models.transformer import param_shapes

    shapes = param_shapes(model_cfg)
    total = model_cfg.num_params() * itemsize
    if weight_dtype is None:
        return total
    _check(weight_dtype)
    for name, shape in shapes["layers"].items():
        axes = contracted_axes(name, stacked=True)
        if axes is not None:
            total += quantized_bytes(shape, axes, weight_dtype) - int(np.prod(shape)) * itemsize
    return total
