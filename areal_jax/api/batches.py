"""A packed micro-batch (`PackedBatch`): what the algorithm hands the training engine.

R = rows of the micro-batch, T = row length (a bucket size); several sequences share a row,
told apart by `segment_ids` (0 = padding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

__all__ = ["PAD_VALUES", "SEQUENCE_KEYS", "PackedBatch"]

# Per-token keys of a sequence dict and of a packed micro-batch (plus segment_ids, positions).
SEQUENCE_KEYS = ("input_ids", "targets", "loss_mask", "behavior_logprobs", "versions", "advantages")
# Padding values that differ from 0: padding tokens carry no policy version.
PAD_VALUES = {"versions": -1}


@dataclasses.dataclass(frozen=True, eq=False)
class PackedBatch:
    """One micro-batch: `[R, T]` arrays plus what the loss needs beyond them.

    Attributes:
        arrays: input_ids, targets, segment_ids (0 = padding), positions, loss_mask,
            behavior_logprobs, advantages, versions (-1 on padding / prompt targets); the
            trainer adds proximal_logprobs. All `[R, T]`.
        rows: for each packed row, the indices (into the sequence list given to
            `make_microbatches`) of its sequences in packing order; empty rows are omitted,
            so a padding micro-batch has `rows == ()`.
        minibatch_valid_tokens: loss-mask tokens of the whole minibatch this micro-batch
            belongs to (over all processes when agreed): the loss denominator that makes
            micro-batch losses sum to the minibatch token mean.
    """

    arrays: Mapping[str, np.ndarray]
    rows: tuple[tuple[int, ...], ...]
    minibatch_valid_tokens: int

    @property
    def shape(self) -> tuple[int, int]:
        """(R, T)."""
        return tuple(np.shape(self.arrays["segment_ids"]))  # type: ignore[return-value]

    @property
    def sequence_indices(self) -> list[int]:
        return [i for row in self.rows for i in row]

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens."""
        return int(np.count_nonzero(np.asarray(self.arrays["segment_ids"])))

    @property
    def num_valid_tokens(self) -> int:
        """Loss-mask tokens of this micro-batch."""
        return int(np.asarray(self.arrays["loss_mask"]).sum())

    def with_arrays(self, **arrays) -> PackedBatch:
        """A copy with arrays added or replaced (e.g. proximal_logprobs)."""
        return dataclasses.replace(self, arrays={**self.arrays, **arrays})
