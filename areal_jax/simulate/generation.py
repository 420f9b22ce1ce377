"""One host's generation engine, simulated round by round as `generation/engine.py` schedules:

    swap pending weights (interruptible: re-prefill every in-flight sample's history, unless
    EngineConfig.on_swap is "keep", or pend it to ride the decode steps (below); with weight_swap
    "evict" first wait out the transfer)
    -> admit from the queue head into free slots (one prefill call per bucket batch)
    -> decode chunks of `decode_chunk` steps over every slot, at the window of the longest sequence

With a paged KV cache (`pool_pages` > 0) as the paged engine schedules it: admission needs free pages
(a sample's prompt and its first chunk, leaving a 1% watermark), every slot's pages grow to cover
each chunk, and when the pool runs dry the sample admitted last is preempted (its KV dropped) and
resumed before new work by a prefill of its history (vLLM's recompute). A decode step then costs the
weights plus the cached tokens it reads, each slot's rounded up to the kernel's block of pages, and
computes the live slots only (decode by live slots: the busiest replica's live count rounded up to
`EngineConfig.decode_rows`); the replicas of a host share one pool here (the engine's per-replica
pools fragment slightly more).

Re-prefill beside decode (EngineConfig.reprefill_in_decode_rows, paged, an interrupting "recompute"
swap): the longest in-flight histories pause and ride the decode steps instead of the packed calls
(simulate/rides.py, `RideChunks`).

Rows, buckets, windows and pack widths come from the real `EngineConfig`; the costs from a cost
model (simulate/costs.py). A run of chunks in which no sample finishes is one event (a segment);
weights arriving mid-segment cut it at the next chunk boundary, as the engine swaps only there.
Every call is also recorded in a `CallTimings` of the same keys the real engine records, so a
simulated run can be fitted like a real one.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from areal_jax.generation.config import EngineConfig
from areal_jax.generation.reprefill_trie import trie_rows_by_length
from areal_jax.generation.timings import CallTimings, decode_key, shape_key
from areal_jax.packing import ffd_allocate
from areal_jax.simulate.events import EventQueue
from areal_jax.simulate.rides import RideChunks
from areal_jax.simulate.engine_state import EngineCounters, Segment, SimGroup

__all__ = ["EngineCounters", "SimEngine", "SimGroup"]


class SimEngine(RideChunks):
    """The engine of one host. `data`: its generation replicas (row counts are multiples of it)."""

    def __init__(self, config: EngineConfig, data: int, costs, clock: EventQueue, *,
                 on_group_done: Callable[[SimGroup], None], on_swap: Callable[[], None],
                 pool_pages: int = 0, page_size: int = 16, block_tokens: int = 128) -> None:
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
        self._segment: Segment | None = None
        self._round_scheduled = False
        self._in_round = False
        self._windows = np.asarray(config.decode_windows)
        # Paged KV cache (pool_pages 0: the dense cache). block_tokens: what the decode kernel reads
        # at a time (pages per block x page size), a slot's last block read whole.
        self.pool_pages, self.page_size, self.block_tokens = pool_pages, page_size, block_tokens
        if pool_pages and pool_pages * page_size < config.max_seq_len:
            raise ValueError(f"a pool of {pool_pages} pages of {page_size} holds less than one sequence of "
                             f"max_seq_len = {config.max_seq_len}")
        self.watermark = max(1, pool_pages // 100)
        self.started = np.zeros(B, np.int64)  # admission order (the last admitted is preempted first)
        self._starts = 0
        self.resumes: collections.deque[tuple[SimGroup, int, int, int]] = collections.deque()  # preempted samples
        self._pending_tokens: tuple[np.ndarray, np.ndarray] | None = None
        self._charged = 0.0  # seconds of other programs waiting for the devices (`charge`)
        self._held = 0.0  # seconds the trainer holds the shared devices (`hold`)
        self.push_held = False  # the trainer's hold covers the weight push (shared devices)
        self._setup_until = 0.0  # the end of the last round's setup work, counted in busy_s when it began
        # Re-prefill beside decode: R ride rows per replica and step (0: packed re-prefill calls at a swap).
        # Pending slots hold their slot and pages without decoding until their ride_left rows have run.
        on = self.paged and config.interruptible and config.on_swap == "recompute"
        self.ride_rows = config.reprefill_in_decode_rows if on else 0
        self.pending = np.zeros(B, bool)
        self.ride_left = np.zeros(B, np.int64)
        self.ride_order = np.zeros(B, np.int64)  # the order pending slots ride in (within their replica)

    @property
    def paged(self) -> bool:
        return self.pool_pages > 0

    def _pages(self, tokens) -> np.ndarray:
        return -(-np.minimum(tokens, self.config.max_seq_len) // self.page_size)

    def _pages_in_use(self, ahead: int) -> int:
        """Pages the active samples hold once grown to cover `ahead` more tokens each, and the
        pending ones their history's (they grow once they decode again)."""
        active, pending = self.active, self.pending
        held = self._pages(self.prompt[pending] + self.generated[pending]).sum()
        return int(self._pages(self.prompt[active] + self.generated[active] + ahead).sum() + held)

    @property
    def _occupied(self) -> np.ndarray:
        """[B] slots that hold a sample: decoding, or pending its re-prefill beside decode."""
        return self.active | self.pending

    def _room(self, prompt: int) -> int:
        """Samples of a `prompt`-token prompt the pool admits now (each: its prompt and first chunk)."""
        if not self.paged:
            return self.config.num_slots
        # The watermark keeps room for the running samples to grow; an empty engine admits without it.
        watermark = self.watermark if self._occupied.any() else 0
        free = self.pool_pages - watermark - self._pages_in_use(self.config.decode_chunk)
        return max(0, free // int(self._pages(prompt + self.config.decode_chunk)))

    # ---- inputs ---------------------------------------------------------------------------------

    def submit(self, group: SimGroup) -> None:
        group.segments = [[] for _ in range(group.n)]
        self.queue.append(group)
        if not self._occupied.all():  # free slots are refilled at the next chunk boundary
            self._end_at_next_boundary()
        self._kick()

    def charge(self, seconds: float) -> None:
        """Another program takes the engine's devices for `seconds` (a learned reward scoring
        beside the policy): it runs at the next chunk boundary, and the engine waits meanwhile."""
        self._charged += seconds
        self._end_at_next_boundary()
        self._kick()

    def busy_s_at(self, now: float) -> float:
        """Busy seconds up to `now` exactly: `counters.busy_s` counts a round's setup when it begins
        and a segment's decoding when it ends."""
        busy = self.counters.busy_s - max(0.0, self._setup_until - now)
        seg = self._segment
        return busy + (max(0.0, now - seg.start) if seg is not None else 0.0)

    def devices_free_at(self) -> float:
        """When the engine's devices finish the program they run: its next chunk boundary, where
        its running segment is cut (now when it runs nothing)."""
        self._end_at_next_boundary()
        seg = self._segment
        return float(seg.ends[-1]) if seg is not None else self.clock.now

    def hold(self, seconds: float) -> None:
        """The trainer takes the devices the engine shares with it (colocated async) for `seconds`
        from the engine's next chunk boundary (`devices_free_at`); the engine waits meanwhile. Unlike
        `charge`, the seconds are the trainer's, not the engine's busy time."""
        self._held += seconds
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
        held, self._held = self._held, 0.0  # the trainer's programs run first on shared devices
        t = self.clock.now + held
        setup, self._charged = self._charged, 0.0  # what other programs took of the devices first
        self.counters.charged_s += setup
        draining = False
        if self.pending_version is not None:
            if self.active_samples and not self.config.interruptible:
                draining = True
            else:
                setup += self._swap()
                self.on_swap()  # the controller admits at the new version: those groups start now
        if not draining:
            setup += self._admit(t + setup)
        self._make_room()
        self.counters.busy_s += setup
        self._setup_until = t + setup  # busy_s holds this round's work ahead of the clock
        self._in_round = False
        if self.active_samples or self.pending.any():
            self._plan_segment(t + setup)
        elif setup > 0 or held > 0:  # the devices are taken until then
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
        # weight_swap "evict": the engine dropped its weights for the push, so the devices wait out
        # the transfer (charged here, where the new version lands) instead of decoding beside it.
        cost = self.costs.transfer_s if ec.weight_swap == "evict" and not self.push_held else 0.0
        slots = np.flatnonzero(self._occupied)  # a slot pending from an earlier swap restarts
        histories = (self.prompt + self.generated - 1)[slots].tolist()
        if not histories or ec.on_swap == "keep":  # "keep": in-flight samples continue on their KV
            return cost
        self.counters.reprefill_tokens += sum(histories)
        if self.ride_rows:  # no call for these: their rows ride the decode steps from here (`_plan_ride_chunk`)
            ride = self._select_rides(slots)
            self._pend(ride)
            slots = np.setdiff1d(slots, ride)  # the rest: the packed calls, decoding again at once
            self.active[slots], self.pending[slots], self.ride_left[slots] = True, False, 0
            histories = (self.prompt + self.generated - 1)[slots].tolist()
        packed = [h for h in histories if h <= ec.pack_width]
        if packed:
            if ec.reprefill_share_prefixes:  # each group's prompt once per trie (generation/reprefill_trie.py)
                rows, tokens = trie_rows_by_length(self._live_groups(slots, ec.pack_width), ec.pack_width)
            else:
                rows, tokens = len(ffd_allocate(packed, ec.pack_width)), sum(packed)
            calls = -(-rows // ec.max_pack_rows(self.data))
            seconds = self.costs.reprefill_s(calls, tokens)
            self.timings.add("reprefill", shape_key(rows), calls=calls, tokens=tokens, s=seconds)
            cost += seconds
        cost += self._prefill_histories(sorted(h for h in histories if h > ec.pack_width))
        return cost

    def _live_groups(self, slots: np.ndarray, width: int) -> list[tuple[int, list[int]]]:
        """(prompt, [each packed history's tokens after it]) per group of the in-flight `slots`
        (ascending) re-prefilled by packed calls, in the order of their first slot, as the engine
        groups them at a swap."""
        groups: dict[int, tuple[int, list[int]]] = {}
        for slot in slots:
            history = int(self.prompt[slot] + self.generated[slot] - 1)
            if history <= width:
                group = self.slot_group[slot]
                groups.setdefault(group.group_id, (int(self.prompt[slot]), []))[1].append(history - int(self.prompt[slot]))
        return list(groups.values())

    def _prefill_histories(self, histories: list[int]) -> float:
        """Seconds of prefilling histories by length bucket (the long-history path)."""
        ec, cost = self.config, 0.0
        by_bucket: dict[int, list[int]] = collections.defaultdict(list)
        for h in histories:
            by_bucket[ec.bucket(h)].append(h)
        for bucket, lengths in by_bucket.items():
            most = ec.max_prefill_prompts(bucket, self.data)
            for start in range(0, len(lengths), most):
                part = lengths[start:start + most]
                rows = ec.prefill_rows(len(part), bucket, self.data)
                seconds = self.costs.reprefill_long_s(rows, bucket)
                self.timings.add("reprefill_long", shape_key(rows, bucket), calls=1, tokens=sum(part), s=seconds)
                cost += seconds
        return cost

    def _admit(self, t: float) -> float:
        """Fills free slots from the queue head as the engine does (preempted samples first, when
        paged); returns the calls' seconds. Samples that stop at their first token finish at `t`
        plus the calls so far."""
        ec, cost = self.config, 0.0
        free = np.flatnonzero(~self._occupied).tolist()
        if self.resumes:
            cost, free = self._resume(t, free)
        while free and self.queue and not self.resumes:
            head = self.queue[0]
            usable = free[:self._room(head.prompt)]
            if not usable:
                break
            if head.prefix_kept:
                seconds = self.costs.insert_s()
                self.timings.add("insert", shape_key(min(len(usable), head.n - head.next_sample)), calls=1, s=seconds)
                cost += seconds
                free = self._start(head, usable, t + cost) + free[len(usable):]
                continue
            bucket = ec.bucket(head.prompt)
            most = ec.max_prefill_prompts(head.prompt, self.data)
            batch, room = [], len(usable)
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
                usable = free[:self._room(group.prompt)]
                free = self._start(group, usable, t + cost) + free[len(usable):]
                if group.next_sample < group.n:
                    group.prefix_kept = True
        return cost

    def _resume(self, t: float, free: list[int]) -> tuple[float, list[int]]:
        """Restarts preempted samples (oldest first) while slots and pages allow, their histories
        prefilled by length bucket; returns (seconds, slots still free)."""
        started = []
        while self.resumes and free:
            group, index, generated, target = self.resumes[0]
            history = group.prompt + generated - 1
            if self._room(history + 1) < 1:
                break
            self.resumes.popleft()
            slot = free.pop(0)
            self.slot_group[slot], self.slot_index[slot] = group, index
            self.target[slot], self.generated[slot], self.since_swap[slot] = target, generated, generated
            self.prompt[slot], self.active[slot] = group.prompt, True
            self._starts += 1
            self.started[slot] = self._starts
            started.append(history)
        self.counters.recomputed_tokens += sum(started)
        return self._prefill_histories(started), free

    def _make_room(self) -> None:
        """Preempts the samples admitted last (a pending one too) until every active one's pages
        cover the next chunk."""
        while self.paged and self._pages_in_use(self.config.decode_chunk) > self.pool_pages:
            held = np.flatnonzero(self._occupied)
            slot = int(held[np.argmax(self.started[held])])
            self._close_segment(slot)
            self.resumes.append((self.slot_group[slot], int(self.slot_index[slot]), int(self.generated[slot]),
                                 int(self.target[slot])))
            self.slot_group[slot] = None
            self.active[slot] = self.pending[slot] = False
            self.counters.preemptions += 1

    def _start(self, group: SimGroup, free: list[int], t: float) -> list[int]:
        take = min(len(free), group.n - group.next_sample)
        for slot in free[:take]:
            index = group.next_sample
            group.next_sample += 1
            self.counters.generated_tokens += 1
            self.slot_group[slot], self.slot_index[slot] = group, index
            self.target[slot], self.generated[slot], self.since_swap[slot] = group.lengths[index], 1, 0
            self.prompt[slot] = group.prompt
            self._starts += 1
            self.started[slot] = self._starts
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
        if self.pending.any():
            self._plan_ride_chunk(start)
            return
        ec = self.config
        C = ec.decode_chunk
        active = np.flatnonzero(self.active)
        remaining = self.target[active] - self.generated[active]
        positions_max = int((self.prompt[active] + self.generated[active]).max()) - 1
        chunks, last_steps = self._segment_steps(remaining)
        lengths = self.prompt[active] + self.generated[active]
        if self.paged:  # end the segment before the chunk the pool cannot cover (preemption there)
            covered = self._chunks_covered(lengths, chunks)
            if covered < chunks:
                chunks, last_steps = covered, C
        steps = np.full(chunks, C, np.int64)
        steps[-1] = last_steps
        slot_steps = steps * len(active)
        slot_steps[-1] = int(np.minimum(remaining - (chunks - 1) * C, last_steps).sum())
        needed = positions_max + C * np.arange(1, chunks + 1)
        index = np.minimum(np.searchsorted(self._windows, needed, side="left"), self._windows.size - 1)
        windows = self._windows[index]
        seconds = np.zeros(chunks)
        if self.paged:
            live, read, busiest = self._live_tokens(lengths, remaining, steps, active)
            self._pending_tokens = (live, read)
            rows = np.asarray([self.config.decode_rows(int(b), self.data) for b in busiest])
            seconds[:] = self.costs.decode_chunk_s(steps, slot_steps, 0, live_tokens=read, rows=rows, live_rows=busiest)
        for w in np.unique(windows) if not self.paged else ():
            at = windows == w
            seconds[at] = self.costs.decode_chunk_s(steps[at], slot_steps[at], int(w))
        active_at_start = np.full(chunks, len(active))
        seg = Segment(start, start + np.cumsum(seconds), steps, slot_steps, windows, active_at_start)
        if self.paged:
            seg.live, seg.read = self._pending_tokens
        seg.event = self.clock.at(float(seg.ends[-1]), self._segment_end)
        self._segment = seg

    def _segment_steps(self, remaining: np.ndarray) -> tuple[int, int]:
        """(chunks, steps of the last) of the decode segment of active slots with `remaining`
        tokens to go: it ends with the chunk in which the first of them finishes."""
        ec = self.config
        C = ec.decode_chunk
        first_finish = int(remaining.min())
        k = (first_finish - 1) // C  # the chunk in which the first sample finishes
        last_steps = min(C, int(remaining.max()) - k * C)  # a chunk ends early once every slot is done
        if ec.refill_after and self.queue:
            left = np.sort(remaining - k * C)
            if ec.refill_after <= left.size:
                last_steps = min(last_steps, int(left[ec.refill_after - 1]))
        return k + 1, last_steps

    def _chunks_covered(self, lengths: np.ndarray, chunks: int) -> int:
        """How many of the next `chunks` chunks the pool covers with every active sample growing
        (the first is covered: `_make_room` saw to it)."""
        C = self.config.decode_chunk
        lo, hi = 1, chunks  # covered(lo) holds; find the largest
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if int(self._pages(lengths + mid * C).sum()) <= self.pool_pages:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _live_tokens(self, lengths: np.ndarray, remaining: np.ndarray, steps: np.ndarray, active: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per chunk: cached tokens the steps attend over (each active slot, each of its steps), the
        same with each slot's last kernel block read whole (half a block more per slot-step on
        average), and the live slots of the busiest replica at the chunk's start (slots
        [r * B / data, (r + 1) * B / data) are replica r's, as the engine's; its decode batch)."""
        C = self.config.decode_chunk
        offsets = C * np.arange(steps.size)
        # Slot i runs m = clip(remaining_i - offset, 0, steps) steps of the chunk at lengths
        # lengths_i + offset + 0 .. m - 1.
        m = np.clip(remaining[None, :] - offsets[:, None], 0, steps[:, None])  # [chunks, slots]
        live = (m * (lengths[None, :] + offsets[:, None]) + m * (m - 1) // 2).sum(axis=1)
        read = live + m.sum(axis=1) * (self.block_tokens // 2)
        replica = active // (self.config.num_slots // self.data)  # [slots]
        per_replica = np.stack([(m[:, replica == r] > 0).sum(axis=1) for r in range(self.data)], axis=1)
        return live.astype(np.float64), read.astype(np.float64), per_replica.max(axis=1)

    def _truncate(self, chunks: int) -> None:
        seg = self._segment
        for name in ("ends", "steps", "slot_steps", "windows", "active", "live", "read"):
            if getattr(seg, name) is not None:
                setattr(seg, name, getattr(seg, name)[:chunks])

    def _segment_end(self) -> None:
        seg, self._segment = self._segment, None
        t = self.clock.now
        total_steps = int(seg.steps.sum())
        self.counters.busy_s += t - seg.start
        self.counters.decode_steps += total_steps
        self.counters.slot_steps += int(seg.slot_steps.sum())
        if seg.live is not None:
            self.counters.live_tokens += int(seg.live.sum())
            self.counters.read_tokens += int(seg.read.sum())
        durations = np.diff(np.concatenate([[seg.start], seg.ends]))
        # A chunk carrying ride rows is timed as the engine times it: "decode_ride", the plain key,
        # plus ride_tokens (the engine records none): its rows' tokens over the host, padding included.
        kind, ride = ("decode", {}) if seg.ride_left is None else ("decode_ride", {
            "ride_tokens": int(seg.steps.sum()) * self.data * self.ride_rows * self.config.reprefill_in_decode_width})
        for w, a, st, ss, d in zip(seg.windows, seg.active, seg.steps, seg.slot_steps, durations):
            self.timings.add(kind, decode_key(int(w), int(a), self.config.num_slots), steps=int(st),
                             slot_steps=int(ss), s=float(d), **ride)
        active = np.flatnonzero(self.active)
        got = np.minimum(self.target[active] - self.generated[active], total_steps)
        self.generated[active] += got
        self.counters.generated_tokens += int(got.sum())
        for slot in active[self.generated[active] >= self.target[active]]:
            self._finish(int(slot), t)
        if seg.ride_left is not None:  # after the decoding slots' tokens: the joining ones decode from the next chunk
            self._rides_ran(seg)
        self._kick()
