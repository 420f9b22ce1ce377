"""The served storage of a weight transfer's pieces, made on the sending side (parallel/weight_sync.py).

With EngineConfig.weight_dtype "int8" or "int4", each layer weight that models/quantize.py
quantizes is quantized on the training devices: after the reshard (step (a)) has laid its piece
out on this host's view in the generation dtype, before the host-local put (step (c)) sends it to
the generation devices. The put so moves int8 codes + fp32 scales (about half of bf16's bytes) or
int4 codes + bf16 scales (about a quarter), and the generation devices never hold a full-precision
piece of a quantized weight.

Bit for bit what quantizing on the generation devices gave: the program reads the staged piece, a
real buffer in the generation dtype, with the same `quantize.quantize`. (A program that cast and
quantized in one could skip the rounding to bf16 where XLA allows excess precision.) The piece's
layout only places the work: a contracted axis split over devices gets a cross-device max from
XLA, and a max does not round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from areal_jax.aot import dtype_bits
from areal_jax.models import quantize
from areal_jax.parallel.transfer_plan import Leaf, copies_whole_buffers


class SenderQuantizer:
    """Per flat leaf of a transfer: the storage its pieces are served in, and the programs making it.

    Args:
      quant_axes: per flat leaf, the axes its per-layer piece contracts over when quantized, else None.
      weight_dtype: "int8" / "int4" (EngineConfig.weight_dtype), or None: every piece as it is.
    """

    def __init__(self, quant_axes: Sequence[tuple[int, ...] | None], weight_dtype: str | None):
        self._axes = list(quant_axes)
        self._kind = weight_dtype
        # (leaf, output sharding of the piece) -> its jitted quantize: one per device set it runs on.
        self._programs: dict[tuple[int, NamedSharding], Any] = {}

    def quantized(self, i: int) -> bool:
        return self._axes[i] is not None

    def sharding(self, i: int, sharding: NamedSharding, shape: tuple[int, ...]) -> Any:
        """Leaf i's piece of `shape` laid out by `sharding`, as served: a QuantizedWeight of the
        codes' and scales' shardings (`quantize.quantized_sharding`), else `sharding` itself."""
        axes = self._axes[i]
        return sharding if axes is None else quantize.quantized_sharding(sharding, axes, self._kind, shape)

    def quantize(self, i: int, x: jax.Array, sharding: NamedSharding) -> Any:
        """Leaf i's piece `x` (in the generation dtype) as served, on the devices of `sharding` (the
        piece's layout there): its codes and scales, else `x` itself. `x` is left alive."""
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
        shape = leaf.piece_shape
        codes = -(-math.prod(shape) * dtype_bits(quantize.CODE_DTYPES[self._kind]) // 8)
        scales = math.prod(quantize.scale_shape(shape, axes, self._kind))
        return codes + scales * np.dtype(quantize.SCALE_DTYPES[self._kind]).itemsize
