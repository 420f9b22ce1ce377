"""The served storage of a weight transfer's pieces (parallel/weight_sync.py), on the sending side.

With EngineConfig.weight_dtype "int8" or "int4", each layer weight that models/quantize.py
quantizes is served as int8 codes + fp32 scales (about half of bf16's bytes) or int4 codes + bf16
scales (about a quarter). The reshard program of step (a) makes them in the training layout
(parallel/transfer_plan.py, `_quantize_where_it_lies`: each training device quantizes its own
shard) and then lays them out on the view, so its inter-host gathers, the host-local put (c) and
the generation devices all carry codes and scales, never a full-precision piece. This module says
what a served piece is: its shardings, its bytes, whether the put copies whole buffers, and, for
weights one process holds whole (no reshard), the program quantizing a piece on the generation
devices. Bit for bit `quantize.quantize` of the generation-dtype weights either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from areal_jax.models import quantize
from areal_jax.parallel.transfer_plan import Leaf, copies_whole_buffers, served_sharding


class SenderQuantizer:
    """Per flat leaf of a transfer: the storage its pieces are served in (shardings, bytes), and the
    programs quantizing a piece of weights held whole (the reshard quantizes the others itself).

    Args:
      quant_axes: per flat leaf, the axes its per-layer piece contracts over when quantized, else None.
      weight_dtype: "int8" / "int4" (EngineConfig.weight_dtype), or None: every piece as it is.
    """

    def __init__(self, quant_axes: Sequence[tuple[int, ...] | None], weight_dtype: str | None):
        self._axes = list(quant_axes)
        self._kind = weight_dtype
        # (leaf, output sharding of the piece) -> its jitted quantize: one per device set it runs on.
        self._programs: dict[tuple[int, NamedSharding], Any] = {}

    def sharding(self, i: int, sharding: NamedSharding, shape: tuple[int, ...]) -> Any:
        """Leaf i's piece of `shape` laid out by `sharding`, as served: a QuantizedWeight of the
        codes' and scales' shardings (`quantize.quantized_sharding`), else `sharding` itself."""
        return served_sharding(sharding, self._axes[i], self._kind, shape)

    def quantize(self, i: int, x: jax.Array, sharding: NamedSharding) -> Any:
        """Leaf i's piece `x` (in the generation dtype, a real buffer: the rounding to it is done) as
        served, on the devices of `sharding` (the piece's layout there): its codes and scales, else
        `x` itself. `x` is left alive. For weights held whole; the reshard quantizes its own."""
        axes = self._axes[i]
        if axes is None:
            return x
        key = (i, sharding)
        if key not in self._programs:
            kind = self._kind
            self._programs[key] = jax.jit(lambda w: quantize.quantize(w, axes, kind),
                                          out_shardings=self.sharding(i, sharding, tuple(x.shape)))
        return self._programs[key](x)

    def copies_whole_buffers(self, i: int, src: NamedSharding, dst: NamedSharding, shape: tuple[int, ...]) -> bool:
        """Whether putting leaf i's served piece of `shape` from layout `src` to `dst` copies device
        buffers as they are (the codes' and the scales' alike when quantized)."""
        axes = self._axes[i]
        if axes is None:
            return copies_whole_buffers(src, dst, shape)
        src_q, dst_q = self.sharding(i, src, shape), self.sharding(i, dst, shape)
        return (copies_whole_buffers(src_q.q, dst_q.q, shape)
                and copies_whole_buffers(src_q.scale, dst_q.scale, quantize.scale_shape(shape, axes, self._kind)))

    def piece_bytes(self, i: int, leaf: Leaf) -> int:
        """Bytes of leaf i's piece as it crosses to the generation devices (whole arrays): codes
        (int4 packed two a byte) plus scales, else the piece in the generation dtype."""
        axes = self._axes[i]
        if axes is None:
            return leaf.piece_bytes
        return quantize.quantized_bytes(leaf.piece_shape, axes, self._kind)
