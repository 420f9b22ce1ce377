"""Train -> generation weights that send only what changed: sparse bit-deltas, or the full push.

Where generation and training do not share an ICI domain (several GPU nodes, TPU slices joined by
DCN) the push is bound by the slow network, and between two optimizer steps most generation-dtype
weights often do not change at all: an update smaller than half a bf16 ulp rounds back to the same
bits. `DeltaSync` wraps a `WeightSync` and, from the second push on, measures per step how many
elements' generation-dtype bits changed since the previous push:

  - sparse: every changed element as (position, new value): 4 bytes of offset (+ 2 of layer for a
    stacked leaf) and the value in the generation dtype. The values are the new weights' own bits,
    so the generation copy after the push is bit-identical to a full push (no arithmetic delta,
    which would round).
  - full: the `WeightSync` push of every weight, when the sparse payload is not smaller
    (`sparse_fraction`: sparse bytes must be at most that share of the full bytes).

The choice is made per step from the measured counts (`last_stats.mode`, `num_bytes` the bytes
sent). The sparse payload is gathered replicated over the train mesh (a collective: every process
calls `transfer` at the same point, as for `WeightSync`), so each host holds all of it and puts it
onto its own generation devices, where one jitted scatter per leaf (per layer of a stacked leaf)
writes it into a copy of the weights being served (the engine keeps serving the old ones until it
swaps, as with a full push).

Costs: the training devices keep the last pushed weights in the generation dtype, laid out like the
trained weights (2 bytes per parameter over the train mesh in bf16), and the extraction of a leaf
holds its changed-mask; the generation side holds the served weights and the new copy, as a full
push does. Only the "split" layout (the engine's) is supported.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from areal_jax.parallel.transfer_plan import LAYERS, cast
from areal_jax.parallel.weight_sync import TransferStats, WeightSync

PyTree = Any
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
OFFSET_BYTES, LAYER_BYTES = 4, 2  # int32 position within a layer (or leaf), int16 layer of a stacked leaf


def sparse_bytes(changed: int, itemsize: int, stacked: bool) -> int:
    """Bytes of a leaf's sparse payload: per changed element its position and new value."""
    return changed * (OFFSET_BYTES + (LAYER_BYTES if stacked else 0) + itemsize)


def choose(changed: list[int], sizes: list[int], itemsizes: list[int], stacked: list[bool],
           sparse_fraction: float = 1.0) -> tuple[str, int]:
    """("sparse" or "full", bytes sent): sparse when its payload is at most `sparse_fraction` of
    the full weights' bytes."""
    full = sum(n * b for n, b in zip(sizes, itemsizes))
    sparse = sum(sparse_bytes(c, b, s) for c, b, s in zip(changed, itemsizes, stacked))
    return ("sparse", sparse) if sparse <= sparse_fraction * full else ("full", full)


def sent_fraction(changed_fraction: float, itemsize: int, sparse_fraction: float = 1.0) -> float:
    """Share of the full push's bytes a delta push sends when `changed_fraction` of the elements
    changed, every leaf costed as stacked (the layers hold nearly all weights): what the
    simulator charges for RLConfig.transfer_mode = "delta"."""
    sparse = changed_fraction * (OFFSET_BYTES + LAYER_BYTES + itemsize) / itemsize
    return sparse if sparse <= sparse_fraction else 1.0


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])


def _bucket(n: int) -> int:
    """Payload capacity for n changed elements: a power of two (few distinct programs)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class _LeafInfo:
    path: str
    shape: tuple[int, ...]
    stacked: bool
    out_dtype: np.dtype

    @property
    def per_layer(self) -> int:
        return int(np.prod(self.shape[1:] if self.stacked else self.shape, dtype=np.int64))


class DeltaSync:
    """`WeightSync`'s interface (`transfer`, `last_stats`, `last_transfer_s`, `meshes`); sends
    sparse bit-deltas when they are smaller than the weights (module docstring).

    Args:
      sync: the full transfer (its specs, generation dtype and groups); layout "split".
      sparse_fraction: send sparse when its bytes are at most this share of the full push's.
    """

    def __init__(self, sync: WeightSync, *, sparse_fraction: float = 1.0):
        if sync.layout != "split":
            raise ValueError(f"DeltaSync needs the 'split' layout (the engine's), got {sync.layout!r}")
        if sync.weight_dtype is not None:
            raise ValueError(f"DeltaSync writes changed elements into the served weights, which weight_dtype "
                             f"{sync.weight_dtype!r} quantizes: use a full push (RLConfig.transfer_mode 'full')")
        if not 0.0 < sparse_fraction <= 1.0:
            raise ValueError(f"sparse_fraction must lie in (0, 1], got {sparse_fraction}")
        self.sync = sync
        self.sparse_fraction = sparse_fraction
        self._prev: list[jax.Array] | None = None  # last pushed weights, generation dtype, train layout
        self._served: PyTree | None = None  # what the last push delivered
        self._programs: dict[tuple, Any] = {}
        self.last_transfer_s: float | None = None
        self.last_stats: TransferStats | None = None
        self._count = 0

    @property
    def meshes(self):
        return self.sync.meshes

    # ---- programs (one per leaf signature; jit caches per shape) ----

    def _cast_program(self, leaves: list[jax.Array], infos: list[_LeafInfo]):
        key = ("cast", tuple((x.shape, x.dtype, x.sharding) for x in leaves))
        if key not in self._programs:
            shardings = [x.sharding for x in leaves]
            dtypes = [i.out_dtype for i in infos]
            self._programs[key] = jax.jit(lambda xs: [cast(x, d) for x, d in zip(xs, dtypes)],
                                          out_shardings=shardings)
        return self._programs[key]

    def _count_program(self):
        if ("count",) not in self._programs:
            replicated = NamedSharding(self.meshes.train, PartitionSpec())
            self._programs[("count",)] = jax.jit(
                lambda new, old: [jnp.sum(_bits(a) != _bits(b), dtype=jnp.int32) for a, b in zip(new, old)],
                out_shardings=replicated)
        return self._programs[("count",)]

    def _extract_program(self, info: _LeafInfo, capacity: int):
        key = ("extract", info.path, capacity)
        if key not in self._programs:
            replicated = NamedSharding(self.meshes.train, PartitionSpec())
            per_layer = info.per_layer

            def extract(new, old):
                changed = (_bits(new) != _bits(old)).reshape(-1)  # [n]
                # Padding entries point one past the end: the scatter drops them.
                (flat,) = jnp.nonzero(changed, size=capacity, fill_value=changed.shape[0])
                values = jnp.take(new.reshape(-1), flat, mode="fill", fill_value=0)
                if not info.stacked:
                    return flat.astype(jnp.int32), None, values
                layer = flat // per_layer  # == number of layers for padding: no layer takes it
                return (flat % per_layer).astype(jnp.int32), layer.astype(jnp.int16), values

            self._programs[key] = jax.jit(extract, out_shardings=replicated)
        return self._programs[key]

    def _apply_program(self, sharding: NamedSharding, stacked: bool):
        key = ("apply", sharding, stacked)
        if key not in self._programs:
            def apply(piece, offsets, layers, values, layer):
                if stacked:  # entries of other layers point past the end: dropped
                    offsets = jnp.where(layers == layer, offsets, piece.size)
                flat = piece.reshape(-1).at[offsets].set(values, mode="drop")
                return flat.reshape(piece.shape)

            self._programs[key] = jax.jit(apply, out_shardings=sharding)
        return self._programs[key]

    # ---- the transfer ----

    def _infos(self, leaves: list[jax.Array]) -> list[_LeafInfo]:
        s = self.sync
        out = []
        for path, stacked, x in zip(s.paths, s.stacked_flags, leaves):
            out_dtype = np.dtype(x.dtype)
            if s.generation_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
                out_dtype = s.generation_dtype
            out.append(_LeafInfo(path, tuple(x.shape), stacked, out_dtype))
        return out

    def transfer(self, params: PyTree) -> PyTree:
        """The generation weights of `params` (bit-identical to `WeightSync.transfer`'s)."""
        start = time.perf_counter()
        leaves = self.sync.treedef.flatten_up_to(params)
        infos = self._infos(leaves)
        on_train = all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
                       and x.sharding.mesh == self.meshes.train for x in leaves)
        new = self._cast_program(leaves, infos)(leaves) if on_train else None
        if self._prev is None or not on_train or [x.shape for x in self._prev] != [x.shape for x in new]:
            return self._full(params, new, start)
        counts = [int(c) for c in self._count_program()(new, self._prev)]
        mode, _ = choose(counts, [int(np.prod(i.shape, dtype=np.int64)) for i in infos],
                         [i.out_dtype.itemsize for i in infos], [i.stacked for i in infos], self.sparse_fraction)
        if mode == "full":
            return self._full(params, new, start)
        served = self._served
        flat_served = self.sync.treedef.flatten_up_to(self._as_train_tree(served))
        sent = 0
        generation_replicated = NamedSharding(self.meshes.generation, PartitionSpec())
        updates: dict[int, Any] = {}
        for i, (info, count) in enumerate(zip(infos, counts)):
            if count == 0:
                continue
            payload = self._extract_program(info, _bucket(count))(new[i], self._prev[i])
            sent += sparse_bytes(count, info.out_dtype.itemsize, info.stacked)
            # This host's copy of the replicated payload, onto its generation devices.
            local = [None if p is None else jax.device_put(p.addressable_shards[0].data, generation_replicated)
                     for p in payload]
            offsets, layers, values = local
            if info.stacked:
                pieces = flat_served[i]  # tuple of per-layer arrays
                program = self._apply_program(pieces[0].sharding, True)
                updates[i] = tuple(program(piece, offsets, layers, values, jnp.int16(j))
                                   for j, piece in enumerate(pieces))
            else:
                program = self._apply_program(flat_served[i].sharding, False)
                updates[i] = program(flat_served[i], offsets, None, values, None)
        out = self._rebuild(served, updates, infos)
        jax.block_until_ready(out)
        for x in self._prev:
            x.delete()
        self._prev, self._served = new, out
        self._record(start, sent, "sparse", counts)
        return out

    @staticmethod
    def _as_train_tree(served: PyTree) -> PyTree:
        """The served tree in the train tree's shape: its per-layer dicts as one dict whose
        leaves are tuples of per-layer arrays (a leaf of the train tree per stacked weight)."""
        if not isinstance(served, dict) or LAYERS not in served:
            return served
        layers = served[LAYERS]
        return {**served, LAYERS: jax.tree.map(lambda *xs: tuple(xs), *layers) if layers else {}}

    def _rebuild(self, served: PyTree, updates: dict[int, Any], infos: list[_LeafInfo]) -> PyTree:
        treedef = self.sync.treedef
        flat = [updates.get(i, x) for i, x in enumerate(treedef.flatten_up_to(self._as_train_tree(served)))]
        if not isinstance(served, dict) or LAYERS not in served:
            return treedef.unflatten(flat)
        tree = treedef.unflatten(flat)
        num_layers = len(served[LAYERS])
        layers_def = jax.tree.structure(served[LAYERS][0])
        per_leaf = layers_def.flatten_up_to(tree[LAYERS])  # each a tuple of per-layer arrays
        layers = tuple(layers_def.unflatten([leaf[j] for leaf in per_leaf]) for j in range(num_layers))
        return {**tree, LAYERS: layers}

    def _full(self, params: PyTree, new: list[jax.Array] | None, start: float) -> PyTree:
        out = self.sync.transfer(params)
        if self._prev is not None:
            for x in self._prev:
                x.delete()
        self._prev, self._served = new, out
        self._count += 1
        self.last_transfer_s = time.perf_counter() - start
        full = self.sync.last_stats if new is not None else None  # a local push leaves no stats
        sent = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(out))
        self.last_stats = (dataclasses.replace(full, index=self._count, total_s=self.last_transfer_s, mode="full")
                           if full is not None else
                           TransferStats(index=self._count, total_s=self.last_transfer_s, reshard_s=0.0,
                                         place_s=self.last_transfer_s, num_bytes=sent, compiled=False))
        return out

    def _record(self, start: float, sent: int, mode: str, counts: list[int]) -> None:
        self._count += 1
        self.last_transfer_s = time.perf_counter() - start
        self.last_stats = TransferStats(index=self._count, total_s=self.last_transfer_s, reshard_s=0.0,
                                        place_s=self.last_transfer_s, num_bytes=sent, compiled=False,
                                        groups=sum(1 for c in counts if c), max_group_bytes=0, mode=mode,
                                        changed_elements=sum(counts))
