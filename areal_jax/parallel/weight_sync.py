"""Train -> generation weight transfer ("pjit resharding" + host-local device_put), in groups.

JAX cannot `device_put` between differently sharded meshes across processes, and one
jitted program cannot read one mesh and write another. So moving one group of weights is
three steps:

  (a) reshard: one jitted program on the train devices. Its outputs live on a *view* of
      the train devices with axes ("hosts", "data", "expert", "tensor"): replicated over "hosts",
      laid out like the generation spec within a host. The dtype cast runs first, on the
      train layout (pinned there), so the gathers move generation-dtype bytes, not fp32. With
      EngineConfig.weight_dtype "int8" / "int4" each quantized weight is also quantized there,
      each training device its own shard (parallel/transfer_plan.py), so the gathers, across
      hosts too, move its codes and scales (about 1/2 or 1/4 of bf16's bytes).
  (b) re-wrap: each process wraps its addressable shards of that output as an array on a
      host-local mesh of its own training devices (no copy).
  (c) place: a host-local `jax.device_put` onto the generation mesh (codes and scales for a
      quantized weight: parallel/sender_quantize.py), then the staging buffers of (a) are freed
      before the next group starts.

Streaming: a transfer is a sequence of groups, so the training devices, which already hold
the fp32 weights and the optimizer state, never hold more than one group of generation
weights (as served: codes and scales when quantized) plus its program's temporaries. Groups
are runs of layers of the stacked `params["layers"]` leaves (one program per run length, the
first layer an argument: 28 layers in runs of 2 compile one program) and packs of the other
leaves (embedding, head, final norm), each up to `group_bytes` of generation weights (a single
leaf or layer larger than that is a group of its own).

Output layouts. "split" (default): `params["layers"]` becomes a tuple of per-layer dicts (the
`models.transformer.split_layers` layout); each piece lands as its own array, so the generation
devices hold the weights received so far plus the group in flight. "stacked": a dict of `[L, ...]`
arrays (the trainer's layout, which a forward scanning over the layers reads), each allocated
whole at the start of the transfer and written a layer at a time in place as its pieces land
(parallel/stacked_assembly.py): at its peak one copy of the weights plus one group's pieces.

Step (c) copies whole device buffers when every block of the generation layout exists on
some training device, i.e. when `generation_tensor` divides the training devices per host
and generation specs shard over "tensor" (not "data"). Otherwise jax stages those
parameters through host memory; `host_staged_leaves` names them and a warning is logged.

In colocated mode the view of each host *is* its generation mesh, so (c) is skipped and
each group is a single reshard (+ cast) on the same devices.

`WeightSync.transfer` is the one entry point: a params pytree in, this host's generation weights
out. Weights laid out on the train mesh take the steps above; that is a collective, so only the
trainer thread may call it and every process must issue the groups in the same order (the plan is
a function of the shapes). Weights one process holds whole (SFT's result on its default device) are
put onto the generation devices one piece at a time instead, with no collective.
`transfer_program_specs` describes the reshard programs for ahead-of-time planning.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from areal_jax.models import quantize
from areal_jax.parallel.meshes import GENERATION_AXES, TRAIN_AXES, Meshes
from areal_jax.parallel.sender_quantize import SenderQuantizer
from areal_jax.parallel.stacked_assembly import StackedAssembly
from areal_jax.parallel.transfer_plan import (
    LAYERS,
    Leaf,
    TransferPlan,
    cast,
    check_specs,
    describe_leaves,
    fit_spec,
    model_partition_specs,
    served_axes,
    transfer_view,
)

logger = logging.getLogger(__name__)

PyTree = Any
DEFAULT_GROUP_BYTES = 256 << 20  # ~2 layers of a 1.5B model in bf16 per group
Layout = Literal["split", "stacked"]
# Config fields that size the transfer programs (named by the planner when one does not fit).
TRANSFER_FIELDS = ("RLConfig.transfer_group_bytes", "RLConfig.generation_dtype", "MeshConfig.train_tensor",
                   "MeshConfig.generation_tensor", "MeshConfig.train_expert", "MeshConfig.generation_expert", "MeshConfig.generation_fraction",
                   "MeshConfig.num_generation_devices_per_host")


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """Timing of one transfer (seconds, wall clock on this process)."""

    index: int  # 1 for the first transfer of this WeightSync
    total_s: float
    reshard_s: float  # steps (a) of every group (with their quantization), including compilation when `compiled`
    place_s: float  # steps (b) + (c) of every group and the "stacked" in-place writes
    num_bytes: int  # bytes delivered to this host's generation devices: served weights (codes + scales if quantized)
    compiled: bool  # a new reshard program was compiled for this transfer
    groups: int = 1  # reshard programs run (one per group)
    max_group_bytes: int = 0  # bytes the largest group delivered to the generation devices (whole arrays)
    mode: str = "full"  # "full": every weight; "sparse": changed elements only (parallel/delta_sync.py)
    changed_elements: int | None = None  # with DeltaSync: elements whose generation-dtype bits changed


# ---- the transfer -------------------------------------------------------------------------------


class WeightSync:
    """Moves train-mesh parameters onto this host's generation mesh, in groups, compiling once.

    Args:
      meshes: from `build_meshes`.
      train_specs: pytree of PartitionSpecs over ("fsdp", "expert", "tensor"), one per parameter.
      generation_specs: same structure, PartitionSpecs over ("data", "expert", "tensor").
      generation_dtype: cast floating parameters to this dtype on the way (None: keep).
      group_bytes: generation-dtype bytes (whole arrays) one reshard group may stage; the
        training devices hold at most one group of staging buffers at a time (quantized: that
        group's codes and scales, less).
      layout: "split" gives `params["layers"]` as a tuple of per-layer dicts (a tree with a
        `"layers"` entry whose leaves are stacked on a leading axis; other trees keep their
        structure): the generation devices hold the pieces received so far plus the group in
        flight. "stacked" gives them stacked, `[L, ...]` arrays laid out by the generation specs
        (which may then shard the layer axis), allocated at the start and written in place layer
        by layer: at its peak one copy of the weights plus one group's pieces.
      weight_dtype: EngineConfig.weight_dtype. "int8" / "int4": each layer weight that
        models/quantize.py quantizes arrives as a QuantizedWeight (int8 codes and fp32
        per-output-channel scales, or int4 codes and bf16 scales per group of 128 inputs),
        quantized by the reshard program in the training layout (each device its own shard) from
        the generation-dtype weights, so the reshard's gathers across hosts and the put onto the
        generation devices move the codes and scales (about 1/2 or 1/4 of bf16's bytes) and no
        device holds a full-precision piece on the view or the generation side. Bit for bit what
        quantizing the generation-dtype weights gives. In the stacked layout the
        codes and scales are the per-layer ones with the layer axis in front. (Weights one
        process holds whole are still quantized on the generation devices, a piece at a time.)
    """

    def __init__(
        self,
        meshes: Meshes,
        train_specs: PyTree,
        generation_specs: PyTree,
        generation_dtype: jnp.dtype | None = None,
        *,
        group_bytes: int = DEFAULT_GROUP_BYTES,
        layout: Layout = "split",
        weight_dtype: str | None = None,
    ):
        check_specs(train_specs, TRAIN_AXES, "train")
        check_specs(generation_specs, GENERATION_AXES, "generation")
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        train_def = jax.tree.structure(train_specs, is_leaf=is_spec)
        generation_def = jax.tree.structure(generation_specs, is_leaf=is_spec)
        if train_def != generation_def:
            raise ValueError(
                f"train and generation spec trees differ:\n  {train_def}\n  {generation_def}"
            )
        if not isinstance(group_bytes, int) or isinstance(group_bytes, bool) or group_bytes < 1:
            raise ValueError(f"group_bytes must be an int >= 1, got {group_bytes!r}")
        if layout not in ("split", "stacked"):
            raise ValueError(f"layout must be 'split' or 'stacked', got {layout!r}")
        if weight_dtype is not None and weight_dtype not in quantize.WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be None or one of {quantize.WEIGHT_DTYPES}, got {weight_dtype!r}")
        self._meshes = meshes
        self._treedef = train_def
        self._train_specs = train_def.flatten_up_to(train_specs)
        self._generation_specs = generation_def.flatten_up_to(generation_specs)
        self._dtype = None if generation_dtype is None else np.dtype(generation_dtype)
        self._group_bytes = group_bytes
        self._layout = layout
        flat = jax.tree_util.tree_leaves_with_path(train_specs, is_leaf=is_spec)
        self._paths = [jax.tree_util.keystr(p) for p, _ in flat]
        has_layers = isinstance(train_specs, Mapping) and LAYERS in train_specs
        self._stacked = [has_layers and getattr(p[0], "key", None) == LAYERS for p, _ in flat]
        self._weight_dtype = weight_dtype
        # Per leaf: the axes its per-layer pieces contract over when quantized, else None.
        self._quant_axes = served_axes([getattr(p[-1], "key", None) for p, _ in flat], self._stacked, weight_dtype)
        self._sender = SenderQuantizer(self._quant_axes, weight_dtype)
        self._layers_def = (jax.tree.structure(train_specs[LAYERS], is_leaf=is_spec) if any(self._stacked)
                            else None)
        if layout == "split":
            for path, stacked, spec in zip(self._paths, self._stacked, self._generation_specs):
                if stacked and len(spec) and spec[0] is not None:
                    raise ValueError(f"generation spec {spec} at {path} shards the layer axis, which the split "
                                     "layout (one array per layer) cannot keep; use layout='stacked'")
        self._view = transfer_view(meshes.train, meshes.num_hosts, meshes.generation.shape["tensor"],
                                   meshes.generation.shape["expert"])
        self._local_view = self._build_local_view(meshes, self._view)
        self._plans: dict[tuple, tuple[TransferPlan, list[Any], dict]] = {}
        self._assembly = StackedAssembly(meshes.generation, self._generation_specs, self._quant_axes, weight_dtype)
        self._count = 0
        self.last_transfer_s: float | None = None
        self.last_stats: TransferStats | None = None
        # Parameters whose host-local put is staged through host memory (slow path).
        self.host_staged_leaves: tuple[str, ...] = ()
        # Called with the group's index after its reshard, while its staging buffers are alive
        # (tests measure the training devices' memory here).
        self.on_group_resharded: Callable[[int], None] | None = None

    @classmethod
    def for_model(cls, model_cfg: Any, meshes: Meshes, generation_dtype: jnp.dtype | None = None, *,
                  group_bytes: int = DEFAULT_GROUP_BYTES, layout: Layout = "split",
                  weight_dtype: str | None = None) -> WeightSync:
        """The transfer of a decoder's parameters, laid out by the train and generation rule tables."""
        train_specs, generation_specs = model_partition_specs(model_cfg, meshes.train,
                                                              meshes.generation.shape["tensor"],
                                                              generation_expert=meshes.generation.shape["expert"])
        return cls(meshes, train_specs, generation_specs, generation_dtype, group_bytes=group_bytes, layout=layout,
                   weight_dtype=weight_dtype)

    @property
    def meshes(self) -> Meshes:
        return self._meshes

    # What a wrapper of this transfer (parallel/delta_sync.py) reads: the tree, each leaf's path and
    # whether it is stacked over layers, the generation dtype and the output layout.
    @property
    def treedef(self):
        return self._treedef

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    @property
    def stacked_flags(self) -> list[bool]:
        return list(self._stacked)

    @property
    def generation_dtype(self) -> np.dtype | None:
        return self._dtype

    @property
    def layout(self) -> str:
        return self._layout

    @property
    def weight_dtype(self) -> str | None:
        return self._weight_dtype

    @staticmethod
    def _build_local_view(meshes: Meshes, view: Mesh) -> Mesh:
        """This host's row of the view (a host-local mesh of its training devices)."""
        row = view.devices[meshes.host_index]
        if meshes.colocated:
            if not np.array_equal(row, meshes.generation.devices):
                raise AssertionError("colocated generation mesh must match the train device order")
            return meshes.generation
        return Mesh(row, GENERATION_AXES, axis_types=(AxisType.Auto,) * 3)

    def _plan(self, leaves: list[Any]) -> tuple[TransferPlan, list[Any], dict]:
        """(plan, the start argument of each group, piece shardings), built on first use per signature."""
        signature = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves)
        if signature not in self._plans:
            described = describe_leaves(self._paths, self._stacked, self._train_specs, self._generation_specs,
                                         leaves, self._dtype, self._quant_axes)
            generation_mesh = self._meshes.generation
            for leaf in described:
                if fit_spec(leaf.generation_spec, leaf.piece_shape, generation_mesh) != leaf.generation_spec:
                    raise ValueError(
                        f"generation spec {leaf.generation_spec} at {leaf.path} does not split shape "
                        f"{leaf.piece_shape} evenly on the generation mesh {dict(generation_mesh.shape)}")
            plan = TransferPlan(described, self._meshes.train, self._view, self._group_bytes, self._weight_dtype)
            # The first layer of a group, as a replicated scalar on the train mesh (made once).
            starts = [None if g.layers is None else jax.make_array_from_callback(
                (), plan.replicated, lambda _, s=g.layers[0]: np.asarray(s, np.int32)) for g in plan.groups]
            shardings = {
                i: (NamedSharding(self._local_view, plan.view_sharding(leaf).spec),
                    NamedSharding(generation_mesh, leaf.generation_spec))
                for i, leaf in enumerate(described)}
            if not self._meshes.colocated:
                self._warn_host_staging(described, shardings)
            self._plans[signature] = (plan, starts, shardings)
        return self._plans[signature]

    def _warn_host_staging(self, leaves: Sequence[Leaf], shardings: dict) -> None:
        staged = tuple(leaf.path for i, leaf in enumerate(leaves)
                       if not self._sender.copies_whole_buffers(i, *shardings[i], leaf.piece_shape))
        self.host_staged_leaves = staged
        if staged:
            logger.warning(
                "weight transfer goes through host memory for %d parameter(s) (%s): the %d "
                "training device(s) per host cannot hold the generation layout's blocks "
                "(generation mesh %s). Prefer a generation_tensor that divides the training "
                "devices per host and generation specs without 'data'.",
                len(staged),
                ", ".join(staged[:4]) + (", ..." if len(staged) > 4 else ""),
                self._meshes.split.num_train,
                dict(self._meshes.generation.shape),
            )

    def compiled_programs(self) -> int:
        """Number of reshard executables compiled so far (one per distinct group shape)."""
        return sum(p._cache_size() for plan, _, _ in self._plans.values() for p in plan.programs)

    def transfer(self, params: PyTree) -> PyTree:
        """`params` laid out on this host's generation mesh with the generation specs, in the
        generation dtype and layout; the input is untouched.

        Weights on the train mesh (every leaf placed by its train spec) move in reshard groups
        (`_transfer_train`): a collective, called by every process at the same point of its
        trainer thread. Any other placement must be whole on this process (`_transfer_local`:
        no collective, any process may call it alone).
        """
        leaves = self._treedef.flatten_up_to(params)
        on_train = all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
                       and x.sharding.mesh == self._meshes.train
                       and x.sharding.is_equivalent_to(NamedSharding(self._meshes.train, spec), x.ndim)
                       for x, spec in zip(leaves, self._train_specs))
        return self._transfer_train(params) if on_train else self._transfer_local(params)

    def _transfer_train(self, train_params: PyTree) -> PyTree:
        """Steps (a)-(c) group by group; each group's staging buffers are freed before the next."""
        start = time.perf_counter()
        leaves = self._treedef.flatten_up_to(train_params)
        compiled_before = self.compiled_programs()
        plan, starts, shardings = self._plan(leaves)
        t_alloc = time.perf_counter()
        buffers = self._assembly.allocate(plan.leaves) if self._layout == "stacked" else {}
        pieces: dict[tuple[int, int | None], jax.Array] = {}
        reshard_s, place_s = 0.0, time.perf_counter() - t_alloc
        for g, (group, first) in enumerate(zip(plan.groups, starts)):
            t0 = time.perf_counter()
            # (a) one program over the train devices: cast (and quantize), replicate over hosts, lay
            # out like generation.
            on_view = group.program(*plan.group_args(group, leaves, first))
            jax.block_until_ready(on_view)
            reshard_s += time.perf_counter() - t0
            if self.on_group_resharded is not None:
                self.on_group_resharded(g)
            t1 = time.perf_counter()
            placed = self._send(on_view, [i for i, _ in group.pieces], shardings)
            del on_view
            for piece, x in zip(group.pieces, placed):
                self._keep(pieces, buffers, piece, x)
            del placed
            jax.block_until_ready(buffers)
            place_s += time.perf_counter() - t1
        out = self._assemble(plan, pieces, buffers)
        end = time.perf_counter()
        moved = [sum(self._sender.piece_bytes(i, plan.leaves[i]) for i, _ in g.pieces) for g in plan.groups]

        self._count += 1
        self.last_transfer_s = end - start
        self.last_stats = TransferStats(
            index=self._count,
            total_s=end - start,
            reshard_s=reshard_s,
            place_s=place_s,
            num_bytes=sum(moved),
            compiled=self.compiled_programs() > compiled_before,
            groups=len(plan.groups),
            max_group_bytes=max(moved),
        )
        return out

    def _send(self, on_view: list[Any], leaf_ids: list[int], shardings: dict) -> list[Any]:
        """Steps (b) and (c) for one group's outputs (pieces of leaves `leaf_ids`, as served: codes
        and scales of a quantized weight); frees the group's staging buffers and what was sent."""
        # (b) this host's copy as an array on its own training devices (no copy).
        local = [jax.tree.map(self._rewrap, x, self._sender.sharding(i, shardings[i][0], tuple(x.shape)))
                 for x, i in zip(on_view, leaf_ids)]
        if self._meshes.colocated:
            return local  # the local view is the generation mesh: already in place
        # (c) host-local copy onto the generation devices, then free what was sent explicitly
        # (donation does not free across devices on CPU).
        out = jax.device_put(local, [self._sender.sharding(i, shardings[i][1], tuple(x.shape))
                                     for i, x in zip(leaf_ids, on_view)])
        jax.block_until_ready(out)
        for x in (*jax.tree.leaves(local), *jax.tree.leaves(on_view)):
            x.delete()
        return out

    @staticmethod
    def _rewrap(x: jax.Array, sharding: NamedSharding) -> jax.Array:
        """This process's shards of `x` (on the view) as an array laid out by `sharding` (no copy)."""
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [s.data for s in x.addressable_shards])

    def _keep(self, pieces: dict, buffers: dict[int, Any], piece: tuple[int, int | None], x: Any) -> None:
        """A landed piece (this transfer's own array): in the stacked layout a layer piece is
        written into its leaf's buffer and freed; any other is kept for the output."""
        i, layer = piece
        if layer is not None and self._layout == "stacked":
            self._assembly.write(buffers, i, layer, x)
        else:
            pieces[piece] = x

    def _assemble(self, plan: TransferPlan, pieces: dict[tuple[int, int | None], jax.Array],
                  buffers: dict[int, Any]) -> PyTree:
        """The output tree from its pieces (and the stacked layout's filled buffers)."""
        stacked = [i for i, leaf in enumerate(plan.leaves) if leaf.stacked]
        flat = [buffers.get(i) if leaf.stacked else pieces[(i, None)] for i, leaf in enumerate(plan.leaves)]
        if not stacked or self._layout == "stacked":
            return self._treedef.unflatten(flat)
        num_layers = plan.leaves[stacked[0]].shape[0]
        tree = self._treedef.unflatten(flat)
        layers = tuple(self._layers_def.unflatten([pieces[(i, layer)] for i in stacked])
                       for layer in range(num_layers))
        return {**tree, LAYERS: layers}

    def _transfer_local(self, params: PyTree) -> PyTree:
        """Weights this process holds whole onto its generation mesh, in the same dtype and layout
        as `_transfer_train`. One piece (a leaf, or one layer of a stacked leaf) at a time is put
        onto the generation devices and cast there, so the source device holds one piece of extra
        bytes at most (and the stacked layout writes each layer piece into its buffer at once)."""
        leaves = self._treedef.flatten_up_to(params)
        for path, x in zip(self._paths, leaves):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                raise ValueError(f"{path} spans processes but is not laid out by its train spec on the train mesh")
        plan, _, shardings = self._plan(leaves)
        buffers = self._assembly.allocate(plan.leaves) if self._layout == "stacked" else {}
        pieces: dict[tuple[int, int | None], jax.Array] = {}
        for i, leaf in enumerate(plan.leaves):
            for layer in (range(leaf.shape[0]) if leaf.stacked else (None,)):
                put = jax.device_put(leaves[i] if layer is None else leaves[i][layer], shardings[i][1])
                # Not freed here: a put of an array already in place is the caller's array itself
                # (a layer piece never is: indexing made it, so the stacked layout frees it).
                piece = self._sender.quantize(i, cast(put, leaf.out_dtype), shardings[i][1])
                jax.block_until_ready(piece)
                del put
                self._keep(pieces, buffers, (i, layer), piece)
                del piece
        return self._assemble(plan, pieces, buffers)


# ---- ahead-of-time descriptions -----------------------------------------------------------------


def transfer_program_specs(model_cfg: Any, train_mesh: Mesh, *, num_hosts: int, generation_tensor: int,
                           dtype: Any, group_bytes: int = DEFAULT_GROUP_BYTES,
                           optimizer_state: PyTree | None = None, lora: Any = None,
                           generation_expert: int = 1, weight_dtype: str | None = None) -> list:
    """The reshard programs of one transfer of `model_cfg`'s weights, one spec per group run.

    Args:
      train_mesh: the ("fsdp", "expert", "tensor") train mesh, e.g. over a fake topology's devices; its
        devices in order, `num_hosts` contiguous blocks, one per host.
      generation_tensor, generation_expert: MeshConfig.generation_tensor, .generation_expert.
      dtype: the generation dtype (RLConfig.generation_dtype, or the weights' own).
      group_bytes: RLConfig.transfer_group_bytes.
      optimizer_state: ShapeDtypeStructs (sharded on `train_mesh`) of the optimizer state the
        training devices hold meanwhile; default: AdamW's two fp32 moments laid out like the
        trained weights.
      lora: with rank > 0 (models.lora.LoRAConfig), the transfers of parallel/adapter_sync.py:
        the frozen base once (in `lora.base_dtype`), and the adapters (fp32) at every swap,
        named "transfer/lora/...".
      weight_dtype: EngineConfig.weight_dtype: "int8" / "int4" quantize the layer weights in the
        programs, which then output their codes and scales (named "...[bfloat16->int8]"); not
        with LoRA (config.weight_dtype_conflict refuses it).

    Every spec runs on the training devices (role "transfer"): arguments are the weights it
    reads; resident are the other weights and the optimizer state. One spec per group run
    (runs of equal length lower to the same program), so the planner's sum over transfer
    specs is one whole transfer. In colocated mode the generation weights placed so far also
    stay on these devices; the planner adds the generation side's state there.
    """
    from areal_jax.models import lora as lora_lib
    from areal_jax.models.transformer import param_shapes

    enabled = lora is not None and lora.enabled
    if enabled and weight_dtype is not None:
        raise ValueError(f"weight_dtype {weight_dtype!r} with LoRA: a LoRA push serves full-precision merged "
                         "weights")
    base_dtype = jnp.dtype(lora.base_dtype) if enabled else jnp.float32
    view = (generation_tensor, generation_expert)
    base = _structs(model_partition_specs(model_cfg, train_mesh, generation_tensor, generation_expert=generation_expert),
                    param_shapes(model_cfg), base_dtype, train_mesh)
    if not enabled:
        moments = optimizer_state if optimizer_state is not None else (abstract_like(base), abstract_like(base))
        return _group_specs(base, model_cfg, train_mesh, num_hosts, view, dtype, group_bytes,
                            (moments,), "transfer/", weight_dtype)
    trainable = lambda t: {LAYERS: {k: v for k, v in t.items() if k != lora_lib.SCALE}}  # noqa: E731
    adapters = _structs(model_partition_specs(model_cfg, train_mesh, generation_tensor, lora, generation_expert),
                        trainable(lora_lib.adapter_shapes(model_cfg, lora)), jnp.float32, train_mesh)
    moments = optimizer_state if optimizer_state is not None else (abstract_like(adapters), abstract_like(adapters))
    return (_group_specs(base, model_cfg, train_mesh, num_hosts, view, dtype, group_bytes,
                         (jax.tree.leaves(adapters), moments), "transfer/")
            + _group_specs(adapters, model_cfg, train_mesh, num_hosts, view, dtype, group_bytes,
                           (jax.tree.leaves(base), moments), "transfer/lora/"))


def abstract_like(structs: list) -> list:
    """Fresh ShapeDtypeStructs like `structs` (e.g. an AdamW moment of each weight)."""
    return [jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=s.sharding) for s in structs]


def _structs(specs: tuple[PyTree, PyTree], shapes: PyTree, dtype: Any, train_mesh: Mesh):
    """(paths, stacked flags, train specs, generation specs, ShapeDtypeStructs) of a spec tree pair."""
    train_specs, generation_specs = specs
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    flat = jax.tree_util.tree_leaves_with_path(train_specs, is_leaf=is_spec)
    treedef = jax.tree.structure(train_specs, is_leaf=is_spec)
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(train_mesh, spec))
               for shape, (_, spec) in zip(treedef.flatten_up_to(shapes), flat)]
    return _Described([jax.tree_util.keystr(p) for p, _ in flat], [getattr(p[-1], "key", None) for p, _ in flat],
                      [getattr(p[0], "key", None) == LAYERS for p, _ in flat],
                      [s for _, s in flat], treedef.flatten_up_to(generation_specs), structs)


@dataclasses.dataclass(frozen=True)
class _Described:
    paths: list
    names: list  # each leaf's last key
    stacked: list
    train_specs: list
    generation_specs: list
    structs: list

    def __iter__(self):  # the structs, for residents
        return iter(self.structs)


def _group_specs(described: _Described, model_cfg: Any, train_mesh: Mesh, num_hosts: int,
                 generation: tuple[int, int], dtype: Any, group_bytes: int, resident: tuple, prefix: str,
                 weight_dtype: str | None = None) -> list:
    """generation: (tensor, expert) sizes of a generation replica."""
    from areal_jax.aot import ProgramSpec

    structs = described.structs
    quant_axes = served_axes(described.names, described.stacked, weight_dtype)
    leaves = describe_leaves(described.paths, described.stacked, described.train_specs, described.generation_specs,
                             structs, np.dtype(dtype), quant_axes)
    plan = TransferPlan(leaves, train_mesh, transfer_view(train_mesh, num_hosts, *generation), group_bytes,
                        weight_dtype)
    start = jax.ShapeDtypeStruct((), jnp.int32, sharding=plan.replicated)
    num_layers = model_cfg.num_layers
    specs = []
    for group in plan.groups:
        read = set(group.leaves)
        name = (prefix + "+".join(leaves[i].path.strip("[]'") for i in group.leaves) if group.layers is None
                else f"{prefix}layers[{group.layers[0]}:{group.layers[1]} of {num_layers}]")
        quantized = any(leaves[i].quant_axes is not None for i in group.leaves)
        served = np.dtype(dtype).name + (f"->{weight_dtype}" if quantized else "")  # what the group outputs
        specs.append(ProgramSpec(
            name=f"{name}[{served}]", role="transfer", fn=group.program,
            args=plan.group_args(group, structs, start),
            resident=(tuple(s for i, s in enumerate(structs) if i not in read), *resident),
            fields=TRANSFER_FIELDS))
    return specs
