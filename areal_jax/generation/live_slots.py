"""Decode by live slots: a paged decode chunk's batch holds the live slots only.

A paged slot's keys and values live in pages named by its page table, so a decode step can run on
any subset of the slots in any order: the live slots' per-slot state and page-table rows are
gathered into a smaller batch (no KV moves) and the chunk's outputs are scattered back to their
slots. Each data replica's rows stay in its own share of the batch (its pages are local to it):
replica r's live slots fill rows [r * b, r * b + live_r), the rest repeat its first slot, inactive.

Shapes: B slots, b rows per replica (`EngineConfig.decode_rows`), B' = data x b, C decode chunk.
"""

from __future__ import annotations

import numpy as np

from areal_jax.generation.config import EngineConfig


def live_order(active: np.ndarray, config: EngineConfig, data: int) -> tuple[np.ndarray, np.ndarray]:
    """(order `[B']`: the slot each batch row reads, real `[B']`: whether that row is a live slot)
    for the live slots `active [B]`. B' == B with every slot in place when bucketing saves nothing."""
    B = active.shape[0]
    per = B // data
    live = [np.flatnonzero(active[r * per:(r + 1) * per]) + r * per for r in range(data)]
    b = config.decode_rows(max(len(x) for x in live), data)
    if b == per:
        return np.arange(B), active.copy()
    order = np.repeat(np.arange(data) * per, b)  # padding rows: the replica's first slot
    real = np.zeros(data * b, bool)
    for r, slots in enumerate(live):
        order[r * b:r * b + len(slots)] = slots
        real[r * b:r * b + len(slots)] = True
    return order, real


def gather_state(state: tuple[np.ndarray, ...], order: np.ndarray, real: np.ndarray) -> tuple[np.ndarray, ...]:
    """The decode chunk's inputs for batch rows `order`: per-slot arrays (state[:-1], active third)
    gathered, padding rows inactive; exit_free (last, "exit once this many slots are free") lowered
    by the slots left out of the batch, so the chunk exits when the full batch's would."""
    *per_slot, exit_free = state
    out = [a[order] for a in per_slot]
    out[2] = out[2] & real
    left_out = state[0].shape[0] - order.shape[0]
    return (*out, np.int32(exit_free - left_out))


def scatter_outputs(outputs: tuple, order: np.ndarray, real: np.ndarray, num_slots: int) -> tuple:
    """A chunk's per-row outputs `[B', C, ...]` (None passes) back to `[B, C, ...]` at their slots;
    slots outside the batch get zeros (their `valid` False, as an inactive slot's)."""
    def back(x):
        if x is None:
            return None
        full = np.zeros((num_slots, *x.shape[1:]), x.dtype)
        full[order[real]] = x[real]
        return full
    return tuple(back(x) for x in outputs)
