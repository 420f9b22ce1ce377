"""Re-prefill beside decode in the simulated engine (EngineConfig.reprefill_in_decode_rows), as
generation/slots.py and generation/reprefill_rides.py schedule it: at a swap the longest in-flight
histories per data replica (as many as fit reprefill_in_decode_tokens, 0: all) pause, their
histories cut into ceil(h / W) rows of W tokens that ride R to a step per replica in that order,
and each decodes again from the chunk after its last row ran. A chunk carrying rows pays for
R x W rows per replica every step (a fixed shape) over its window; while slots are pending,
segments are one chunk each (the joins change the batch after every chunk).

`RideChunks` is `SimEngine`'s share of it (simulate/generation.py holds the slot arrays it reads:
pending, ride_left, ride_order, ride_rows, prompt, generated, started, active). Shapes: B slots.
"""

from __future__ import annotations

import numpy as np

from areal_jax.generation.reprefill_rides import select_rides
from areal_jax.simulate.engine_state import Segment


class RideChunks:
    """The ride rows of a simulated engine: which slots pause at a swap, and the chunks carrying them."""

    def _select_rides(self, slots: np.ndarray) -> np.ndarray:
        """Of the in-flight `slots` (ascending), those whose histories ride the decode steps, in
        the order they ride: the engine's choice (`select_rides`) over histories h = prompt +
        generated - 1, ties to the earlier admitted."""
        history = self.prompt[slots] + self.generated[slots] - 1
        chosen = select_rides(slots.tolist(), history.tolist(), self.started[slots].tolist(),
                              slots_per_replica=self.config.num_slots // self.data,
                              cap=self.config.reprefill_in_decode_tokens)
        return np.asarray(chosen, np.int64)

    def _pend(self, slots: np.ndarray) -> None:
        """`slots` (in the order they ride) stop decoding until their histories (minus the last
        token, sampled but not yet written) have ridden the decode steps: ceil(h / W) rows each,
        from the first (a pending slot swapped again restarts)."""
        history = self.prompt[slots] + self.generated[slots] - 1
        self.active[slots], self.pending[slots] = False, True
        self.ride_left[slots] = -(-history // self.config.reprefill_in_decode_width)
        self.ride_order[slots] = np.arange(slots.size)

    def _plan_ride_chunk(self, start: float) -> None:
        """One decode chunk that carries ride rows: as many steps as its decoding slots take (the
        first chunk of their segment), or as its rides need if more (at most C); every step pays
        for R x W ride rows per replica over the chunk's window, which covers the decode rows'
        positions and the ride rows' (the rows that run are `_ride_progress`'s)."""
        ec = self.config
        C, R, W = ec.decode_chunk, self.ride_rows, ec.reprefill_in_decode_width
        active = np.flatnonzero(self.active)
        remaining = self.target[active] - self.generated[active]
        lengths = self.prompt[active] + self.generated[active]
        decode_steps, needed = 0, 0
        if active.size:
            chunks, last_steps = self._segment_steps(remaining)
            decode_steps, needed = (C if chunks > 1 else last_steps), int(lengths.max()) - 1 + C
        queues = self._ride_queues()
        rows_left = max(int(self.ride_left[q].sum()) for q in queues)  # the busiest replica's
        steps = np.asarray([max(decode_steps, min(C, -(-rows_left // R)))])
        left, tokens, reach = self._ride_progress(queues, int(steps[0]))
        window = self._windows[min(int(np.searchsorted(self._windows, max(needed, reach))), self._windows.size - 1)]
        slot_steps = np.asarray([int(np.minimum(remaining, steps[0]).sum())])
        live, read, busiest = self._live_tokens(lengths, remaining, steps, active)
        rows = np.asarray([ec.decode_rows(int(b), self.data) for b in busiest])
        seconds = np.zeros(1)
        seconds[:] = self.costs.decode_chunk_s(steps, slot_steps, 0, live_tokens=read, rows=rows, live_rows=busiest,
                                               ride_rows=self.data * R, ride_width=W, ride_window=int(window))
        seg = Segment(start, start + seconds, steps, slot_steps, np.asarray([window]), np.asarray([active.size]),
                       live=live, read=read, ride_left=left, ride_tokens=tokens)
        seg.event = self.clock.at(float(seg.ends[-1]), self._segment_end)
        self._segment = seg

    def _ride_queues(self) -> list[np.ndarray]:
        """Each data replica's pending slots in the order their rows ride (`_select_rides`)."""
        per = self.config.num_slots // self.data
        pending = np.flatnonzero(self.pending)
        order = pending[np.argsort(self.ride_order[pending], kind="stable")]
        return [order[order // per == r] for r in range(self.data)]

    def _ride_progress(self, queues: list[np.ndarray], steps: int) -> tuple[np.ndarray, int, int]:
        """Each replica's R x `steps` ride rows taken from its queue in order (a slot's rows
        consecutive, from where the last chunk left it): ([B] rows left per slot after them, the
        history tokens they hold, the largest position they reach + 1)."""
        R, W = self.ride_rows, self.config.reprefill_in_decode_width
        left, tokens, reach = self.ride_left.copy(), 0, 0
        for q in queues:
            if not q.size:
                continue
            history = self.prompt[q] + self.generated[q] - 1  # [n]
            pieces, rows = -(-history // W), left[q]  # [n] each slot's rows, those still to run
            ahead = np.cumsum(rows) - rows  # [n] rows of the queue before each slot's
            run = np.clip(R * steps - ahead, 0, rows)  # [n] rows of each slot this chunk runs
            done_before = (pieces - rows) * W  # [n] whole rows: fewer than `history` tokens
            done_after = np.minimum(history, (pieces - rows + run) * W)
            tokens += int((done_after - done_before).sum())
            reach = max(reach, int(done_after[run > 0].max()))
            left[q] = rows - run
        return left, tokens, reach

    def _rides_ran(self, seg: Segment) -> None:
        """A ride chunk's rows have run: slots with none left decode again (under the new weights)."""
        pending = self.pending
        self.ride_left[pending] = seg.ride_left[pending]
        joined = pending & (self.ride_left == 0)
        self.pending[joined], self.active[joined] = False, True
        self.counters.ride_tokens += seg.ride_tokens
