"""Re-prefill beside decode, on the host: which history tokens ride in which decode step.

After an interrupting swap with EngineConfig.reprefill_in_decode_rows, the in-flight samples keep
their slots and pages but pause; their histories (prompt + tokens but the last, what a packed
re-prefill would write) are recomputed by the decode steps themselves, R rows of W tokens per data
replica per step (models/decoding.py `RideRows`). `plan_rides` lays out one decode chunk's rows:
each replica takes its own paused slots in the order given (oldest first), a slot's tokens in
order over consecutive rows, so a row's queries find every earlier position of their slot already
written (by an earlier step, or by an earlier row of the same step: a layer writes all of a step's
rows before any attends). A slot whose last token rode in the chunk decodes again from the next.

Shapes: C decode chunk steps, R rows per replica (data x R in all), W row width, M page-table width.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class RidePlan:
    """One decode chunk's re-prefill rows, ordered by replica like the decode batch."""

    tokens: np.ndarray  # [C, data * R, W] int32
    positions: np.ndarray  # [C, data * R, W] int32, -1 for padding
    tables: np.ndarray  # [C, data * R, M] int32: each row's slot's page table (zeros for padding)
    steps: int  # steps holding any row: the chunk runs at least these
    cursors: dict[int, int]  # slot -> history tokens written once the chunk has run
    done: list[int]  # slots whose whole history is written once the chunk has run

    @property
    def last_position(self) -> int:
        """The largest position a row writes (-1: none): the chunk's attention window must hold it."""
        return int(self.positions.max(initial=-1))

    @property
    def tokens_carried(self) -> int:
        return int((self.positions >= 0).sum())


def select_rides(slots: list[int], sizes: list[int], starts: list[int], *, slots_per_replica: int, cap: int
                 ) -> list[int]:
    """Of the in-flight `slots` (histories of `sizes` tokens, started in the order of `starts`),
    those whose histories ride the decode steps, in the order they ride: per data replica the
    longest first (the earlier started on a tie), each taken while the replica's total stays within
    `cap` (EngineConfig.reprefill_in_decode_tokens, 0: all; one that does not fit is passed over, a
    shorter one after it may fit). The fewest samples pause for the tokens they carry."""
    taken: collections.Counter = collections.Counter()
    ride = []
    for slot, size, _ in sorted(zip(slots, sizes, starts), key=lambda x: (-x[1], x[2])):
        if not cap or taken[slot // slots_per_replica] + size <= cap:
            ride.append(slot)
            taken[slot // slots_per_replica] += size
    return ride


def plan_rides(histories: dict[int, np.ndarray], cursors: dict[int, int], order: list[int], *, data: int,
               slots_per_replica: int, rows: int, width: int, steps: int, page_tables: np.ndarray) -> RidePlan:
    """Rows for one chunk of `steps` decode steps from the paused slots `order` (oldest first):
    slot s still has `histories[s][cursors[s]:]` to write; `page_tables [B, M]` the chunk's tables
    (cut to its window)."""
    M = page_tables.shape[1]
    tokens = np.zeros((steps, data * rows, width), np.int32)
    positions = np.full((steps, data * rows, width), -1, np.int32)
    tables = np.zeros((steps, data * rows, M), np.int32)
    cursors = dict(cursors)
    done: list[int] = []
    used = 0
    for replica in range(data):
        queue = [s for s in order if s // slots_per_replica == replica and cursors[s] < histories[s].size]
        at = 0  # the row being filled, counted over the chunk's steps
        while queue and at < steps * rows:
            slot = queue[0]
            history, start = histories[slot], cursors[slot]
            n = min(width, history.size - start)
            step, row = divmod(at, rows)
            row += replica * rows
            tokens[step, row, :n] = history[start:start + n]
            positions[step, row, :n] = np.arange(start, start + n)
            tables[step, row] = page_tables[slot]
            cursors[slot] = start + n
            if cursors[slot] == history.size:
                done.append(queue.pop(0))
            at += 1
            used = max(used, step + 1)
    return RidePlan(tokens, positions, tables, used, cursors, done)
