"""The "stacked" output layout of a weight transfer (parallel/weight_sync.py), written in place.

In that layout each leaf of `params["layers"]` arrives as one `[L, ...]` array on the generation
mesh (the trainer's layout, which a forward that scans over the layers reads). The transfer moves
it one layer at a time, so `StackedAssembly` allocates each such leaf's output once, at the start
of a transfer, laid out by its generation spec (a quantized leaf: its codes and scales, laid out
as `quantize.quantized_sharding` says for the stacked weight), and writes every layer piece into
it as the piece lands: a jitted `dynamic_update_slice` that donates the buffer, so XLA aliases the
output to it and the write is in place, after which the piece is freed. The generation devices so
hold one copy of the weights plus the group in flight, never every piece beside a stacked copy.
One write program per leaf, the layer index a traced argument: it compiles once whatever L.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models import quantize
from areal_jax.parallel.transfer_plan import Leaf


def _write(buffer: Any, piece: Any, layer: jax.Array) -> Any:
    """`buffer` (an [L, ...] array, or a QuantizedWeight of them) with `piece` at index `layer`."""
    return jax.tree.map(lambda b, p: jax.lax.dynamic_update_index_in_dim(b, p, layer, 0), buffer, piece)


class StackedAssembly:
    """Output buffers of the stacked leaves of a transfer, filled layer by layer in place.

    Args:
      mesh: the generation mesh.
      generation_specs: per flat leaf, its generation spec (a stacked leaf's over [L, ...]).
      quant_axes: per flat leaf, the axes its per-layer piece contracts over when quantized, else None.
      weight_dtype: "int8" / "int4" where quantized leaves arrive as QuantizedWeights, else None.
    """

    def __init__(self, mesh: Mesh, generation_specs: Sequence[PartitionSpec],
                 quant_axes: Sequence[tuple[int, ...] | None], weight_dtype: str | None):
        self._mesh = mesh
        self._specs = list(generation_specs)
        self._quant_axes = list(quant_axes)
        self._weight_dtype = weight_dtype
        self._writes: dict[int, Any] = {}

    def output_struct(self, i: int, leaf: Leaf) -> Any:
        """Leaf i's stacked output as ShapeDtypeStructs with their shardings (a QuantizedWeight of
        two when quantized: the layer axis in front of the piece's contracted axes)."""
        struct = jax.ShapeDtypeStruct(leaf.shape, leaf.out_dtype, sharding=NamedSharding(self._mesh, self._specs[i]))
        axes = self._quant_axes[i]
        if axes is None:
            return struct
        return quantize.quantized_struct(struct, tuple(a + 1 for a in axes), self._weight_dtype)

    def allocate(self, leaves: Sequence[Leaf]) -> dict[int, Any]:
        """Zeroed outputs of the stacked leaves, by leaf index: one copy of the layer weights."""
        return {i: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), self.output_struct(i, leaf))
                for i, leaf in enumerate(leaves) if leaf.stacked}

    def write(self, buffers: dict[int, Any], i: int, layer: int, piece: Any) -> None:
        """Writes `piece` (layer `layer` of leaf i, in its served storage and generation piece
        layout) into `buffers[i]` in place, then frees the piece: it must be this transfer's own."""
        if i not in self._writes:
            shardings = jax.tree.map(lambda x: x.sharding, buffers[i])
            self._writes[i] = jax.jit(_write, donate_argnums=0, out_shardings=shardings)
        buffers[i] = self._writes[i](buffers[i], piece, np.int32(layer))
        for x in jax.tree.leaves(piece):
            x.delete()
