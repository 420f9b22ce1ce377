"""Train -> generation weight transfer ("pjit resharding" + host-local device_put).

JAX cannot `device_put` between differently sharded meshes across processes, and one
jitted program cannot read one mesh and write another. So a transfer is three steps:

  (a) reshard: one jitted program on the train devices. Its outputs live on a *view* of
      the train devices with axes ("hosts", "data", "tensor"): replicated over "hosts",
      laid out like the generation spec within a host. The optional dtype cast is fused.
  (b) re-wrap: each process wraps its addressable shards of that output as an array on a
      host-local mesh of its own training devices (no copy).
  (c) place: a host-local `jax.device_put` onto the generation mesh.

Step (c) copies whole device buffers when every block of the generation layout exists on
some training device, i.e. when `generation_tensor` divides the training devices per host
and generation specs shard over "tensor" (not "data"). Otherwise jax stages those
parameters through host memory; `host_staged_leaves` names them and a warning is logged.

In colocated mode the view of each host *is* its generation mesh, so (c) is skipped and
the transfer is a single reshard (+ cast) on the same devices.

Only the trainer thread may call `transfer`: step (a) spans every process, so all
processes must issue it in the same order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from areal_jax.parallel.meshes import GENERATION_AXES, TRAIN_AXES, Meshes

logger = logging.getLogger(__name__)

PyTree = Any
VIEW_AXES = ("hosts",) + GENERATION_AXES


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """Timing of one transfer (seconds, wall clock on this process)."""

    index: int  # 1 for the first transfer of this WeightSync
    total_s: float
    reshard_s: float  # step (a), including compilation when `compiled`
    place_s: float  # steps (b) + (c)
    num_bytes: int  # size of this host's generation parameters
    compiled: bool  # a new reshard program was compiled for this transfer


def _spec_axes(spec: PartitionSpec) -> set[str]:
    names: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names


def _check_specs(specs: PyTree, allowed: tuple[str, ...], what: str) -> None:
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


def _fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
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


def _copies_whole_buffers(src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...]) -> bool:
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


def _cast(x: jax.Array, dtype: jnp.dtype | None) -> jax.Array:
    # Integer buffers (e.g. step counters) keep their dtype; only weights are cast.
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(dtype)


class WeightSync:
    """Moves train-mesh parameters onto this host's generation mesh, compiling once.

    Args:
      meshes: from `build_meshes`.
      train_specs: pytree of PartitionSpecs over ("fsdp", "tensor"), one per parameter.
      generation_specs: same structure, PartitionSpecs over ("data", "tensor").
      generation_dtype: cast floating parameters to this dtype on the way (None: keep).
    """

    def __init__(
        self,
        meshes: Meshes,
        train_specs: PyTree,
        generation_specs: PyTree,
        generation_dtype: jnp.dtype | None = None,
    ):
        _check_specs(train_specs, TRAIN_AXES, "train")
        _check_specs(generation_specs, GENERATION_AXES, "generation")
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        train_def = jax.tree.structure(train_specs, is_leaf=is_spec)
        generation_def = jax.tree.structure(generation_specs, is_leaf=is_spec)
        if train_def != generation_def:
            raise ValueError(
                f"train and generation spec trees differ:\n  {train_def}\n  {generation_def}"
            )
        self._meshes = meshes
        self._treedef = train_def
        self._train_specs = train_def.flatten_up_to(train_specs)
        self._generation_specs = generation_def.flatten_up_to(generation_specs)
        self._dtype = None if generation_dtype is None else jnp.dtype(generation_dtype)
        self._view, self._local_view = self._build_views(meshes)
        self._programs: dict[tuple, tuple[Any, list[NamedSharding]]] = {}
        self._count = 0
        self.last_transfer_s: float | None = None
        self.last_stats: TransferStats | None = None
        # Parameters whose host-local put is staged through host memory (slow path).
        self.host_staged_leaves: tuple[str, ...] = ()

    @staticmethod
    def _build_views(meshes: Meshes) -> tuple[Mesh, Mesh]:
        """The ("hosts", "data", "tensor") view of the train devices, and this host's row of it.

        Same devices in the same order as the train mesh, so one jitted program may take
        inputs on the train mesh and produce outputs on the view.
        """
        num_train = meshes.split.num_train
        generation_tensor = meshes.generation.shape["tensor"]
        # A tensor size that divides both sides: any dimension the generation mesh splits
        # over "tensor" then also splits evenly on the view.
        view_tensor = math.gcd(num_train, generation_tensor)
        grid = np.array(meshes.train_devices_by_host, dtype=object)
        grid = grid.reshape(meshes.num_hosts, num_train // view_tensor, view_tensor)
        view = Mesh(grid, VIEW_AXES, axis_types=(AxisType.Auto,) * 3)
        if meshes.colocated:
            local_view = meshes.generation
            if not np.array_equal(grid[meshes.host_index], local_view.devices):
                raise AssertionError("colocated generation mesh must match the train device order")
        else:
            local_view = Mesh(grid[meshes.host_index], GENERATION_AXES, axis_types=(AxisType.Auto,) * 2)
        return view, local_view

    def _program(self, leaves: list[jax.Array]):
        """The jitted reshard (+ cast) for these shapes/dtypes, built on first use."""
        signature = tuple((x.shape, x.dtype) for x in leaves)
        if signature not in self._programs:
            for path, spec, x in zip(self._paths(), self._generation_specs, leaves):
                if _fit_spec(spec, x.shape, self._meshes.generation) != spec:
                    raise ValueError(
                        f"generation spec {spec} at {path} does not split shape {x.shape} "
                        f"evenly on the generation mesh {dict(self._meshes.generation.shape)}"
                    )
            train_sh = [NamedSharding(self._meshes.train, s) for s in self._train_specs]
            view_specs = [
                _fit_spec(s, x.shape, self._view) for s, x in zip(self._generation_specs, leaves)
            ]
            view_sh = [NamedSharding(self._view, s) for s in view_specs]
            local_sh = [NamedSharding(self._local_view, s) for s in view_specs]
            if not self._meshes.colocated:
                self._warn_host_staging(leaves, local_sh)
            dtype = self._dtype
            reshard = jax.jit(
                lambda xs: [_cast(x, dtype) for x in xs],
                in_shardings=(train_sh,),
                out_shardings=view_sh,
            )
            self._programs[signature] = (reshard, local_sh)
        return self._programs[signature]

    def _warn_host_staging(self, leaves: list[jax.Array], local_sh: list[NamedSharding]) -> None:
        generation_mesh = self._meshes.generation
        staged = tuple(
            path
            for path, x, src, spec in zip(self._paths(), leaves, local_sh, self._generation_specs)
            if not _copies_whole_buffers(src, NamedSharding(generation_mesh, spec), x.shape)
        )
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
                dict(generation_mesh.shape),
            )

    def _paths(self) -> list[str]:
        dummy = self._treedef.unflatten(range(self._treedef.num_leaves))
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(dummy)]

    def compiled_programs(self) -> int:
        """Number of reshard executables compiled so far (one per parameter signature)."""
        return sum(p[0]._cache_size() for p in self._programs.values())

    def transfer(self, train_params: PyTree) -> PyTree:
        """Returns `train_params` laid out on this host's generation mesh with the generation specs.

        Every process must call this at the same point of its trainer thread. The input is
        untouched; all intermediates are freed before returning.
        """
        start = time.perf_counter()
        leaves = self._treedef.flatten_up_to(train_params)
        compiled_before = self.compiled_programs()
        reshard, local_shardings = self._program(leaves)

        # (a) one program over the train devices: replicate over hosts, lay out like generation.
        on_view = reshard(leaves)
        jax.block_until_ready(on_view)
        resharded = time.perf_counter()

        # (b) this host's copy as an array on its own training devices (no copy).
        local = [
            jax.make_array_from_single_device_arrays(
                x.shape, sharding, [shard.data for shard in x.addressable_shards]
            )
            for x, sharding in zip(on_view, local_shardings)
        ]
        if self._meshes.colocated:
            # The local view is the generation mesh: the buffers are already in place.
            out = local
        else:
            # (c) host-local copy onto the generation devices, then free the staging
            # buffers explicitly (donation does not free across devices on CPU).
            generation_sh = [
                NamedSharding(self._meshes.generation, s) for s in self._generation_specs
            ]
            out = jax.device_put(local, generation_sh)
            jax.block_until_ready(out)
            for x in local:
                x.delete()
            for x in on_view:
                x.delete()
        del on_view, local
        end = time.perf_counter()

        self._count += 1
        self.last_transfer_s = end - start
        self.last_stats = TransferStats(
            index=self._count,
            total_s=end - start,
            reshard_s=resharded - start,
            place_s=end - resharded,
            num_bytes=sum(x.size * x.dtype.itemsize for x in out),
            compiled=self.compiled_programs() > compiled_before,
        )
        return self._treedef.unflatten(out)
