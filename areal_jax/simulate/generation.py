"""One host's generation engine, simulated round by round as `generation/engine.py` schedules:

    swap pending weights (interruptible: re-prefill every in-flight sample's history)
    -> admit from the queue head into free slots (one prefill call per bucket batch)
    -> decode chunks of `decode_chunk` steps over every slot, at the window of the longest sequence

Rows, buckets, windows and pack widths come from the real `EngineConfig`; the costs from a cost
model (simulate/costs.py). A run of chunks in which no sample finishes is one event (a segment);
weights arriving mid-segment cut it at the next chunk boundary, as the engine swaps only there.
Every call is also recorded in a `CallTimings` of the same keys the real engine records, so a
simulated run can be fitted like a real one.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import numpy as np

from areal_jax.generation.config import EngineConfig
from areal_jax.generation.timings import CallTimings, decode_key, shape_key
from areal_jax.packing import ffd_allocate
from areal_jax.simulate.events import Event, EventQueue


@dataclasses.dataclass(eq=False)
class SimGroup:
    """One admitted prompt group."""

    group_id: int
    admitted_version: int
    prompt: int
    lengths: np.ndarray  # [n] completion tokens each sample will generate
    next_sample: int = 0  # samples [0, next_sample) have started
    prefix_kept: bool = False  # a prefill block kept for samples that found no slot
    finished: int = 0
    # Per sample: [[version, tokens], ...] in generation order.
    segments: list[list[list[int]]] = dataclasses.field(default_factory=list)

    @property
    def n(self) -> int:
        return int(self.lengths.size)

    @property
    def completion_tokens(self) -> int:
        return int(self.lengths.sum())


@dataclasses.dataclass
class EngineCounters:
    busy_s: float = 0.0
    decode_steps: int = 0
    slot_steps: int = 0
    generated_tokens: int = 0
    reprefill_tokens: int = 0
    swaps: int = 0


@dataclasses.dataclass
class _Segment:
    """Decode chunks planned from `start`: chunk j ends at ends[j]; only the last may finish samples."""

    start: float
    ends: np.ndarray  # [chunks] absolute end times
    steps: np.ndarray  # [chunks]
    slot_steps: np.ndarray  # [chunks]
    windows: np.ndarray  # [chunks]
    active: np.ndarray  # [chunks] active slots at each chunk's start
    event: Event | None = None


class SimEngine:
    """The engine of one host. `data`: its generation replicas (row counts are multiples of it)."""

    def __init__(self, config: EngineConfig, data: int, costs, clock: EventQueue, *,
                 on_group_done: Callable[[SimGroup], None], on_swap: Callable[[], None]) -> None:
        self.config = config
        self.data = data
        self.costs = costs
        self.clock = clock
        self.on_group_done = on_group_done
        self.on_swap = on_swap
        # Slot state as arrays (a host has hundreds of slots and a segment ends thousands of times).
        B = config.num_slots
        self.slot_group: list[SimGroup | None] = [None] * B
        self.slot_index = np.zeros(B, np.int64)  # the sample of its group
        self.active = np.zeros(B, bool)
        self.target = np.zeros(B, np.int64)  # completion tokens the sample will have
        self.generated = np.zeros(B, np.int64)  # tokens so far (the first comes with admission)
        self.prompt = np.zeros(B, np.int64)
        self.since_swap = np.zeros(B, np.int64)  # `generated` when the served version last changed
        self.queue: collections.deque[SimGroup] = collections.deque()
        self.version = 0
        self.pending_version: int | None = None
        self.counters = EngineCounters()
        self.timings = CallTimings()
        self._segment: _Segment | None = None
        self._round_scheduled = False
        self._in_round = False
        self._windows = np.asarray(config.decode_windows)

    # ---- inputs ---------------------------------------------------------------------------------

    def submit(self, group: SimGroup) -> None:
        group.segments = [[] for _ in range(group.n)]
        self.queue.append(group)
        if not self.active.all():  # free slots are refilled at the next chunk boundary
            self._end_at_next_boundary()
        self._kick()

    def deliver_weights(self, version: int) -> None:
        """New weights reach the engine now; installed at its next chunk boundary."""
        self.pending_version = version
        self._end_at_next_boundary()
        self._kick()

    def _end_at_next_boundary(self) -> None:
        seg = self._segment
        if seg is None:
            return
        cut = int(np.searchsorted(seg.ends, self.clock.now, side="left"))
        if cut < seg.ends.size - 1:  # an earlier boundary than the segment's natural end
            seg.event.cancel()
            self._truncate(cut + 1)
            seg.event = self.clock.at(float(seg.ends[-1]), self._segment_end)

    @property
    def idle(self) -> bool:
        return self._segment is None and not self._round_scheduled and not self._in_round

    @property
    def active_samples(self) -> int:
        return int(self.active.sum())

    # ---- the scheduling round -------------------------------------------------------------------

    def _kick(self) -> None:
        if self.idle:
            self._round_scheduled = True
            self.clock.after(0.0, self._round)

    def _round(self) -> None:
        self._round_scheduled = False
        if self._segment is not None:
            return
        self._in_round = True
        t = self.clock.now
        setup = 0.0
        draining = False
        if self.pending_version is not None:
            if self.active_samples and not self.config.interruptible:
                draining = True
            else:
                setup += self._swap()
                self.on_swap()  # the controller admits at the new version: those groups start now
        if not draining:
            setup += self._admit(t + setup)
        self.counters.busy_s += setup
        self._in_round = False
        if self.active_samples:
            self._plan_segment(t + setup)
        elif setup > 0:
            self._round_scheduled = True
            self.clock.at(t + setup, self._round)

    def _swap(self) -> float:
        for slot in np.flatnonzero(self.active):  # tokens so far were sampled by the old weights
            self._close_segment(int(slot))
        self.version = self.pending_version
        self.pending_version = None
        self.counters.swaps += 1
        for group in self.queue:  # kept prefill blocks hold the old weights' keys and values
            group.prefix_kept = False
        ec = self.config
        histories = (self.prompt + self.generated - 1)[self.active].tolist()
        if not histories:
            return 0.0
        cost = 0.0
        packed = [h for h in histories if h <= ec.pack_width]
        if packed:
            rows = len(ffd_allocate(packed, ec.pack_width))
            calls = -(-rows // ec.max_pack_rows(self.data))
            seconds = self.costs.reprefill_s(calls, sum(packed))
            self.timings.add("reprefill", shape_key(rows), calls=calls, tokens=sum(packed), s=seconds)
            cost += seconds
        by_bucket: dict[int, list[int]] = collections.defaultdict(list)
        for h in sorted(h for h in histories if h > ec.pack_width):
            by_bucket[ec.bucket(h)].append(h)
        for bucket, lengths in by_bucket.items():
            most = ec.max_prefill_prompts(bucket, self.data)
            for start in range(0, len(lengths), most):
                part = lengths[start:start + most]
                rows = ec.prefill_rows(len(part), bucket, self.data)
                seconds = self.costs.reprefill_long_s(rows, bucket)
                self.timings.add("reprefill_long", shape_key(rows, bucket), calls=1, tokens=sum(part), s=seconds)
                cost += seconds
        self.counters.reprefill_tokens += sum(histories)
        return cost

    def _admit(self, t: float) -> float:
        """Fills free slots from the queue head as the engine does; returns the calls' seconds.
        Samples that stop at their first token finish at `t` plus the calls so far."""
        ec, cost = self.config, 0.0
        free = np.flatnonzero(~self.active).tolist()
        while free and self.queue:
            head = self.queue[0]
            if head.prefix_kept:
                seconds = self.costs.insert_s()
                self.timings.add("insert", shape_key(min(len(free), head.n - head.next_sample)), calls=1, s=seconds)
                cost += seconds
                free = self._start(head, free, t + cost)
                continue
            bucket = ec.bucket(head.prompt)
            most = ec.max_prefill_prompts(head.prompt, self.data)
            batch, room = [], len(free)
            for group in self.queue:
                if len(batch) == most or room <= 0 or group.prefix_kept or ec.bucket(group.prompt) != bucket:
                    break
                batch.append(group)
                room -= group.n - group.next_sample
            rows = ec.prefill_rows(len(batch), bucket, self.data)
            seconds = self.costs.prefill_s(rows, bucket)
            self.timings.add("prefill", shape_key(rows, bucket), calls=1, tokens=sum(g.prompt for g in batch),
                             s=seconds)
            cost += seconds
            for group in batch:
                free = self._start(group, free, t + cost)
                if group.next_sample < group.n:
                    group.prefix_kept = True
        return cost

    def _start(self, group: SimGroup, free: list[int], t: float) -> list[int]:
        take = min(len(free), group.n - group.next_sample)
        for slot in free[:take]:
            index = group.next_sample
            group.next_sample += 1
            self.counters.generated_tokens += 1
            self.slot_group[slot], self.slot_index[slot] = group, index
            self.target[slot], self.generated[slot], self.since_swap[slot] = group.lengths[index], 1, 0
            self.prompt[slot] = group.prompt
            if self.target[slot] <= 1:
                self._finish(slot, t)
            else:
                self.active[slot] = True
        if group.next_sample == group.n:
            group.prefix_kept = False
            if self.queue and self.queue[0] is group:
                self.queue.popleft()
        return free[take:]

    def _close_segment(self, slot: int) -> None:
        """Records the tokens `slot` generated since the version last changed, under that version."""
        got = int(self.generated[slot] - self.since_swap[slot])
        if got:
            self.slot_group[slot].segments[self.slot_index[slot]].append([self.version, got])
        self.since_swap[slot] = self.generated[slot]

    def _finish(self, slot: int, t: float) -> None:
        self._close_segment(slot)
        group = self.slot_group[slot]
        self.slot_group[slot] = None
        self.active[slot] = False
        group.finished += 1
        if group.finished == group.n:
            self.clock.at(t, lambda: self.on_group_done(group))

    # ---- decode segments ------------------------------------------------------------------------

    def _plan_segment(self, start: float) -> None:
        ec = self.config
        C = ec.decode_chunk
        active = np.flatnonzero(self.active)
        remaining = self.target[active] - self.generated[active]
        positions_max = int((self.prompt[active] + self.generated[active]).max()) - 1
        first_finish = int(remaining.min())
        k = (first_finish - 1) // C  # the chunk in which the first sample finishes
        last_steps = min(C, int(remaining.max()) - k * C)  # a chunk ends early once every slot is done
        if ec.refill_after and self.queue:
            left = np.sort(remaining - k * C)
            if ec.refill_after <= left.size:
                last_steps = min(last_steps, int(left[ec.refill_after - 1]))
        chunks = k + 1
        steps = np.full(chunks, C, np.int64)
        steps[-1] = last_steps
        slot_steps = steps * len(active)
        slot_steps[-1] = int(np.minimum(remaining - k * C, last_steps).sum())
        needed = positions_max + C * np.arange(1, chunks + 1)
        index = np.minimum(np.searchsorted(self._windows, needed, side="left"), self._windows.size - 1)
        windows = self._windows[index]
        seconds = np.zeros(chunks)
        for w in np.unique(windows):
            at = windows == w
            seconds[at] = self.costs.decode_chunk_s(steps[at], slot_steps[at], int(w))
        active_at_start = np.full(chunks, len(active))
        seg = _Segment(start, start + np.cumsum(seconds), steps, slot_steps, windows, active_at_start)
        seg.event = self.clock.at(float(seg.ends[-1]), self._segment_end)
        self._segment = seg

    def _truncate(self, chunks: int) -> None:
        seg = self._segment
        for name in ("ends", "steps", "slot_steps", "windows", "active"):
            setattr(seg, name, getattr(seg, name)[:chunks])

    def _segment_end(self) -> None:
        seg, self._segment = self._segment, None
        t = self.clock.now
        total_steps = int(seg.steps.sum())
        self.counters.busy_s += t - seg.start
        self.counters.decode_steps += total_steps
        self.counters.slot_steps += int(seg.slot_steps.sum())
        durations = np.diff(np.concatenate([[seg.start], seg.ends]))
        for w, a, st, ss, d in zip(seg.windows, seg.active, seg.steps, seg.slot_steps, durations):
            self.timings.add("decode", decode_key(int(w), int(a), self.config.num_slots), steps=int(st),
                             slot_steps=int(ss), s=float(d))
        active = np.flatnonzero(self.active)
        got = np.minimum(self.target[active] - self.generated[active], total_steps)
        self.generated[active] += got
        self.counters.generated_tokens += int(got.sum())
        for slot in active[self.generated[active] >= self.target[active]]:
            self._finish(int(slot), t)
        self._kick()
