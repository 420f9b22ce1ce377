"""The plan of a train -> generation weight transfer: which layout each parameter takes on the
transfer view and on the generation mesh, and how the parameters are cut into groups of at most
`group_bytes` (runs of stacked layers, packs of the other leaves). Pure shape logic plus the
jitted reshard programs (cast, and with EngineConfig.weight_dtype quantize, where the weights lie,
then lay out on the view); `weight_sync.WeightSync` runs the plan."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from areal_jax.models import quantize
from areal_jax.parallel.meshes import GENERATION_AXES

PyTree = Any
VIEW_AXES = ("hosts",) + GENERATION_AXES
LAYERS = "layers"  # the params key whose leaves are stacked on a leading layer axis


# ---- specs and views ----------------------------------------------------------------------


def _spec_axes(spec: PartitionSpec) -> set[str]:
    names: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names


def check_specs(specs: PyTree, allowed: tuple[str, ...], what: str) -> None:
    for path, spec in jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    ):
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"{what} spec at {jax.tree_util.keystr(path)} is {spec!r}, not a PartitionSpec")
        unknown = _spec_axes(spec) - set(allowed)
        if unknown:
            raise ValueError(
                f"{what} spec at {jax.tree_util.keystr(path)} names axes {sorted(unknown)}; "
                f"the {what} mesh has axes {allowed}"
            )


def fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh | AbstractMesh) -> PartitionSpec:
    """`spec` with every dimension that `mesh` cannot split evenly left replicated.

    The view of the train devices can have a different "data" size than the generation
    mesh, so a dimension that divides there may not divide here.
    """
    if len(spec) > len(shape):
        raise ValueError(f"spec {spec} has more entries than the array has dimensions {shape}")
    fitted = []
    for dim, entry in zip(shape, spec):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        ways = math.prod(mesh.shape[n] for n in names)
        fitted.append(entry if dim % ways == 0 else None)
    return PartitionSpec(*fitted)


def copies_whole_buffers(src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...]) -> bool:
    """Whether `device_put` src -> dst can copy existing device buffers as they are.

    jax copies buffer by buffer when every block the target needs already exists as one
    source buffer; otherwise it gathers the whole array through host memory.
    """

    def blocks(sharding):
        return {
            tuple(sl.indices(n) for sl, n in zip(index, shape))
            for index in sharding.devices_indices_map(shape).values()
        }

    return blocks(dst) <= blocks(src)


def transfer_view(train_mesh: Mesh, num_hosts: int, generation_tensor: int, generation_expert: int = 1) -> Mesh:
    """The ("hosts", "data", "expert", "tensor") view of the train devices that step (a) writes to.

    Same devices in the same order as the train mesh (each host a contiguous block of it), so
    one jitted program may take inputs on the train mesh and produce outputs on the view. Its
    tensor and expert sizes divide both sides: any dimension the generation mesh splits over
    "tensor" or "expert" then also splits evenly on the view.
    """
    devices = np.asarray(train_mesh.devices, dtype=object).reshape(-1)
    if num_hosts < 1 or devices.size % num_hosts:
        raise ValueError(f"{devices.size} training devices do not split over {num_hosts} hosts")
    per_host = devices.size // num_hosts
    tensor = math.gcd(per_host, generation_tensor)
    expert = math.gcd(per_host // tensor, generation_expert)
    return Mesh(devices.reshape(num_hosts, per_host // (tensor * expert), expert, tensor), VIEW_AXES,
                axis_types=(AxisType.Auto,) * 4)


def model_partition_specs(model_cfg: Any, train_mesh: Mesh, generation_tensor: int, lora: Any = None,
                          generation_expert: int = 1) -> tuple[PyTree, PyTree]:
    """(train specs, generation specs) of a model's parameters by the two rule tables; with an
    enabled `lora` (models.lora.LoRAConfig), of its trainable adapters instead, as
    `{"layers": {weight: {"a", "b"}}}` (what parallel/adapter_sync.py moves per swap).

    Parameters never shard over the generation mesh's "data" axis, so only its tensor and
    expert sizes matter here (the planner has no generation mesh of this host to hand).
    """
    from areal_jax.models import lora as lora_lib
    from areal_jax.models.sharding import GENERATION_RULES, TRAIN_RULES, spec_for
    from areal_jax.models.transformer import param_axes, param_shapes

    generation = AbstractMesh((1, generation_expert, generation_tensor), GENERATION_AXES)
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    axes, shapes = param_axes(model_cfg), param_shapes(model_cfg)
    if lora is not None and lora.enabled:
        trainable = lambda tree: {LAYERS: {k: v for k, v in tree.items() if k != lora_lib.SCALE}}  # noqa: E731
        axes = trainable(lora_lib.adapter_axes(model_cfg, lora))
        shapes = trainable(lora_lib.adapter_shapes(model_cfg, lora))

    def specs(rules, mesh):
        return jax.tree.map(lambda a, shape: spec_for(a, rules, mesh, shape), axes, shapes, is_leaf=is_axes)

    return specs(TRAIN_RULES, train_mesh), specs(GENERATION_RULES, generation)


# ---- the plan of one parameter signature ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter as the trainer holds it, and what the generation side gets of it.

    A stacked leaf (`stacked`, shape [L, ...]) travels as L pieces of shape [...]; any other
    leaf as one piece. `generation_spec` is the layout of one piece. `quant_axes`: the axes a
    piece contracts over when it is served quantized (EngineConfig.weight_dtype), else None.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    out_dtype: np.dtype
    train_spec: PartitionSpec
    generation_spec: PartitionSpec
    stacked: bool
    quant_axes: tuple[int, ...] | None = None

    @property
    def piece_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape

    @property
    def piece_bytes(self) -> int:
        return math.prod(self.piece_shape) * self.out_dtype.itemsize


@dataclasses.dataclass(frozen=True)
class _Group:
    """One reshard program run: whole leaves, or layers [start, stop) of every stacked leaf."""

    leaves: tuple[int, ...]  # indices into the flat leaves it reads
    layers: tuple[int, int] | None
    program: Any  # jitted
    pieces: tuple[tuple[int, int | None], ...]  # (leaf, layer or None) of each output, in order


def served_sharding(sharding: NamedSharding, axes: tuple[int, ...] | None, weight_dtype: str | None,
                    shape: tuple[int, ...]) -> Any:
    """A piece of `shape` laid out by `sharding`, as served: a QuantizedWeight of the codes' and the
    scales' shardings (`quantize.quantized_sharding`) when quantized over `axes`, else `sharding`."""
    return sharding if axes is None else quantize.quantized_sharding(sharding, axes, weight_dtype, shape)


def cast(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return x if x.dtype == dtype else x.astype(dtype)


def _out_dtype(dtype: np.dtype, generation_dtype: np.dtype | None) -> np.dtype:
    # Integer buffers (e.g. step counters) keep their dtype; only weights are cast.
    if generation_dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(dtype)
    return np.dtype(generation_dtype)


def _cast_where_it_lies(x: jax.Array, dtype: np.dtype, sharding: NamedSharding) -> jax.Array:
    """`x` (a leaf, or a slice of layers) cast to `dtype` and pinned to its train layout: without
    the pin XLA may gather first (fp32, or the whole stack of layers) and cast or slice after,
    moving and holding several times the group's bytes."""
    return jax.lax.with_sharding_constraint(cast(x, dtype), sharding)


def _rounded_where_it_lies(x: jax.Array, dtype: np.dtype, sharding: NamedSharding) -> jax.Array:
    """`x` rounded to `dtype`, as fp32 values pinned to its train layout: what the quantizer reads.
    The rounding must survive compilation: with excess precision allowed XLA may fold
    convert(convert(x, bf16), f32) back into x (GPU's simplify-fp-conversions pass does), and the
    codes must be those of the rounded weights. No pass folds a reduce-precision, which rounds as
    the cast does where the exponent range is fp32's (bf16); another dtype's cast stays behind a
    barrier."""
    info = jnp.finfo(dtype)
    if info.nexp == jnp.finfo(jnp.float32).nexp:
        w = jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant)
    else:
        w = jax.lax.optimization_barrier(cast(x, dtype)).astype(jnp.float32)
    return jax.lax.with_sharding_constraint(w, sharding)


def _quantize_where_it_lies(x: jax.Array, dtype: np.dtype, sharding: NamedSharding, axes: tuple[int, ...],
                            weight_dtype: str) -> quantize.QuantizedWeight:
    """`x` rounded to `dtype` and quantized over `axes` on its train layout: each device makes the
    codes of its own shard (a contracted axis split over devices costs XLA a cross-device max of
    the scales' size), so the reshard after moves codes and scales."""
    q = quantize.quantize(_rounded_where_it_lies(x, dtype, sharding), axes, weight_dtype)
    scale_spec = fit_spec(sharding.spec, quantize.scale_shape(tuple(x.shape), axes, weight_dtype), sharding.mesh)
    return quantize.QuantizedWeight(jax.lax.with_sharding_constraint(q.q, sharding),
                                    jax.lax.with_sharding_constraint(q.scale, NamedSharding(sharding.mesh, scale_spec)))


def _served_where_it_lies(x: jax.Array, leaf: Leaf, sharding: NamedSharding, weight_dtype: str | None) -> Any:
    """Leaf `leaf`'s `x` (the leaf, or a slice of layers: its pieces with the layer axis in front)
    as served, made on its train layout: quantized if it is, else cast."""
    if leaf.quant_axes is None:
        return _cast_where_it_lies(x, leaf.out_dtype, sharding)
    lead = x.ndim - len(leaf.piece_shape)  # 1 for a slice of layers
    return _quantize_where_it_lies(x, leaf.out_dtype, sharding, tuple(a + lead for a in leaf.quant_axes),
                                   weight_dtype)


def _group_bounds(leaves: Sequence[Leaf], group_bytes: int) -> list[tuple[tuple[int, ...], tuple[int, int] | None]]:
    """(leaf indices, layer range) of each group, in the order every process runs them."""
    groups: list[tuple[tuple[int, ...], tuple[int, int] | None]] = []
    pack: list[int] = []
    size = 0
    for i, leaf in enumerate(leaves):
        if leaf.stacked:
            continue
        if pack and size + leaf.piece_bytes > group_bytes:
            groups.append((tuple(pack), None))
            pack, size = [], 0
        pack.append(i)
        size += leaf.piece_bytes
    if pack:
        groups.append((tuple(pack), None))
    stacked = tuple(i for i, leaf in enumerate(leaves) if leaf.stacked)
    if stacked:
        num_layers = leaves[stacked[0]].shape[0]
        layer_bytes = sum(leaves[i].piece_bytes for i in stacked)
        per_group = max(1, min(num_layers, group_bytes // max(layer_bytes, 1)))
        groups += [(stacked, (start, min(start + per_group, num_layers)))
                   for start in range(0, num_layers, per_group)]
    return groups


class TransferPlan:
    """The groups and reshard programs of one parameter signature (shapes and dtypes).

    Programs are shared between groups of equal shape (all full runs of layers are one
    program); nothing compiles before its first call. With `weight_dtype` ("int8" / "int4") the
    leaves with `quant_axes` come out of their program as QuantizedWeights (codes and scales on
    the view), quantized before the reshard: its collectives move codes, not the generation dtype.
    """

    def __init__(self, leaves: Sequence[Leaf], train_mesh: Mesh, view: Mesh, group_bytes: int,
                 weight_dtype: str | None = None):
        self.leaves = tuple(leaves)
        if weight_dtype is None and any(leaf.quant_axes is not None for leaf in self.leaves):
            raise ValueError("leaves with quant_axes need a weight_dtype")
        self.train_mesh, self.view = train_mesh, view
        self.weight_dtype = weight_dtype
        self.replicated = NamedSharding(train_mesh, PartitionSpec())
        programs: dict[tuple, Any] = {}
        self.groups: list[_Group] = []
        for idx, layers in _group_bounds(self.leaves, group_bytes):
            count = 1 if layers is None else layers[1] - layers[0]
            key = (idx, None if layers is None else count)
            if key not in programs:
                programs[key] = (self._whole_program(idx) if layers is None else self._layers_program(idx, count))
            pieces = tuple((i, None) for i in idx) if layers is None else tuple(
                (i, layer) for layer in range(*layers) for i in idx)
            self.groups.append(_Group(idx, layers, programs[key], pieces))
        self.programs = tuple(programs.values())

    def view_sharding(self, leaf: Leaf) -> NamedSharding:
        """The layout of one piece of `leaf` on the view (of its codes, when quantized)."""
        return NamedSharding(self.view, fit_spec(leaf.generation_spec, leaf.piece_shape, self.view))

    def _train_sharding(self, leaf: Leaf, shape: tuple[int, ...] | None = None) -> NamedSharding:
        return NamedSharding(self.train_mesh, fit_spec(leaf.train_spec, shape or leaf.shape, self.train_mesh))

    def _whole_program(self, idx: tuple[int, ...]):
        leaves = [self.leaves[i] for i in idx]
        train_sh = [self._train_sharding(leaf) for leaf in leaves]
        kind = self.weight_dtype

        def reshard(xs):
            return [_served_where_it_lies(x, leaf, sh, kind) for x, leaf, sh in zip(xs, leaves, train_sh)]

        out_sh = [served_sharding(self.view_sharding(leaf), leaf.quant_axes, kind, leaf.piece_shape)
                  for leaf in leaves]
        return jax.jit(reshard, in_shardings=(train_sh,), out_shardings=out_sh)

    def _layers_program(self, idx: tuple[int, ...], count: int):
        """Layers [start, start + count) of every stacked leaf, `start` an argument, as `count`
        per-layer outputs each (layer-major: all leaves of the first layer, then the next)."""
        leaves = [self.leaves[i] for i in idx]
        train_sh = [self._train_sharding(leaf) for leaf in leaves]
        slice_sh = [self._train_sharding(leaf, (count, *leaf.shape[1:])) for leaf in leaves]
        kind = self.weight_dtype
        out_sh = [served_sharding(self.view_sharding(leaf), leaf.quant_axes, kind, leaf.piece_shape)
                  for _ in range(count) for leaf in leaves]

        def reshard(xs, start):
            # Per leaf [count, ...] (codes and scales [count, ...] when quantized), then one output a layer.
            parts = [_served_where_it_lies(jax.lax.dynamic_slice_in_dim(x, start, count), leaf, sh, kind)
                     for x, leaf, sh in zip(xs, leaves, slice_sh)]
            return [jax.tree.map(lambda a, layer=layer: a[layer], part) for layer in range(count) for part in parts]

        return jax.jit(reshard, in_shardings=(train_sh, self.replicated), out_shardings=out_sh)

    def group_args(self, group: _Group, inputs: Sequence[Any], start: Any) -> tuple:
        """The program's positional arguments for `group` from the flat inputs (arrays or structs)."""
        xs = [inputs[i] for i in group.leaves]
        return (xs,) if group.layers is None else (xs, start)


def served_axes(names: Sequence[Any], stacked: Sequence[bool], weight_dtype: str | None
                ) -> list[tuple[int, ...] | None]:
    """Per leaf (its last key, whether stacked over layers): the axes its per-layer piece contracts
    over when served quantized (a `quantize.QUANTIZED` layer weight, with `weight_dtype` set), else None."""
    return [quantize.contracted_axes(name) if weight_dtype and is_stacked else None
            for name, is_stacked in zip(names, stacked)]


def describe_leaves(paths: Sequence[str], stacked: Sequence[bool], train_specs: Sequence[PartitionSpec],
                     generation_specs: Sequence[PartitionSpec], leaves: Sequence[Any],
                     generation_dtype: np.dtype | None,
                     quant_axes: Sequence[tuple[int, ...] | None] | None = None) -> list[Leaf]:
    """quant_axes: per leaf, the axes its piece contracts over when served quantized, else None."""
    out = []
    quant_axes = [None] * len(paths) if quant_axes is None else quant_axes
    for path, is_stacked, t_spec, g_spec, x, axes in zip(paths, stacked, train_specs, generation_specs, leaves,
                                                          quant_axes):
        shape = tuple(x.shape)
        if is_stacked:
            if not shape or shape[0] != leaves[stacked.index(True)].shape[0]:
                raise ValueError(f"{path} has shape {shape}: every leaf under params[{LAYERS!r}] must be stacked on "
                                 f"a leading layer axis of one length")
            g_spec = PartitionSpec(*tuple(g_spec)[1:])  # a piece is one layer
        out.append(Leaf(path, shape, np.dtype(x.dtype), _out_dtype(x.dtype, generation_dtype), t_spec, g_spec,
                         is_stacked, axes))
    return out
