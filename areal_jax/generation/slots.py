"""The engine's decode slots on the host: the sample each slot holds, the per-slot scalars that
travel with every chunk call, and what happens to a sample once it has a slot.

`SlotTable` starts samples in slots, runs a decode chunk and folds its tokens into the samples,
finishes them (stop token, length, abort), and in the paged layout gives every running sample the
pages its next chunk may write, preempting the newest when a replica's pool runs dry and resuming
preempted samples, oldest first, by re-prefill. With `EngineConfig.overlap` a chunk is dispatched
before the last one is read back (`InFlight`): its tokens are folded in one chunk late, into the
samples it ran, and the slots the host changed meanwhile (`_fresh`) start the next chunk from the
host's state instead of the device's. Its device calls go through generation/engine_cache.py;
the queue, the requests' futures and the weights are the engine's (generation/engine.py), told of
each finished sample through `on_done`.

Shapes: B slots, C decode chunk, X stop ids per slot.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

import numpy as np

from areal_jax.generation.config import EngineConfig
from areal_jax.generation.engine_cache import DecodeChunk, EngineCache
from areal_jax.generation.pages import Prefix
from areal_jax.generation.reprefill_rides import RidePlan, plan_rides, select_rides
from areal_jax.generation.requests import EngineStats, Request, Sample, StopReason
from areal_jax.generation.sampling import MAX_STOP_IDS, sampler_kind
from areal_jax.generation.timings import CallTimings, decode_key
from areal_jax.models.transformer import Params

# A started sample: (slot, request, sample index, prefill row).
Start = tuple[int, Request, int, int]


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A decode chunk dispatched and not yet read back, with what the host knew at its dispatch."""

    chunk: DecodeChunk
    samples: list[Sample | None]  # `[B]` each slot's sample: its tokens go to that sample only
    active: np.ndarray  # `[B]` the slots it ran
    version: int  # the weights it ran: its tokens' version
    window: int
    rides: bool = False  # its steps carried re-prefill rows (timed as "decode_ride")


class SlotTable:
    """The B decode slots of one engine and the samples preempted out of them."""

    def __init__(self, config: EngineConfig, kv: EngineCache, stats: EngineStats, timings: CallTimings,
                 on_done: Callable[[Sample, StopReason], None]):
        self.config, self._kv, self._stats, self._timings, self._on_done = config, kv, stats, timings, on_done
        B = config.num_slots
        self.samples: list[Sample | None] = [None] * B
        self.tokens = np.zeros(B, np.int32)  # next input token of each slot
        self.positions = np.zeros(B, np.int32)  # its position (= sequence length - 1)
        self.remaining = np.zeros(B, np.int32)  # tokens the slot may still generate
        self.temperature = np.ones(B, np.float32)
        self.top_p = np.ones(B, np.float32)
        self.top_k = np.zeros(B, np.int32)
        self.stop_ids = np.full((B, MAX_STOP_IDS), -1, np.int32)  # [B, X]
        self.keys = np.zeros((B, 2), np.uint32)  # threefry key data of each slot's sample
        self.preempted: list[Sample] = []  # out of the pool, oldest first: resumed before new admissions
        self.in_flight: InFlight | None = None  # the decode chunk dispatched and not yet read back
        # Slots paused after a swap while decode steps re-prefill their histories (EngineConfig.
        # reprefill_in_decode_rows): slot -> history tokens written so far (generation/reprefill_rides.py).
        self.pending: dict[int, int] = {}
        self._paused_histories: dict[int, np.ndarray] = {}  # theirs, fixed while paused (none decode)
        self._fresh = np.ones(B, bool)  # slots the host changed since the last dispatch
        self._last_read = 0.0  # when the last chunk was read back (perf_counter)
        self._stamps = itertools.count()  # start order of samples

    def idle(self) -> bool:
        """Nothing running, preempted or in flight."""
        return not self.busy() and not self.preempted and self.in_flight is None

    def free(self) -> list[int]:
        return [i for i, s in enumerate(self.samples) if s is None]

    def running(self) -> list[int]:
        """Slots holding a sample: decoding, or paused for re-prefill beside decode."""
        return [i for i, s in enumerate(self.samples) if s is not None]

    def decoding(self) -> np.ndarray:
        """`[B]` the slots a decode chunk advances: holding a sample and not paused."""
        out = np.array([s is not None for s in self.samples])
        out[list(self.pending)] = False
        return out

    def split_for_rides(self, slots: list[int]) -> tuple[list[int], list[int]]:
        """At an interrupting swap, the in-flight `slots` -> (those the decode steps re-prefill, in
        the order they ride; the rest, for the packed calls). Per data replica the longest
        histories that fit EngineConfig.reprefill_in_decode_tokens (`select_rides`)."""
        samples = [self.samples[s] for s in slots]
        sizes = [x.request.prompt.size + len(x.tokens) - 1 for x in samples]  # each `history()`'s
        ride = select_rides(slots, sizes, [x.stamp for x in samples],
                            slots_per_replica=self.config.num_slots // self._kv.data,
                            cap=self.config.reprefill_in_decode_tokens)
        chosen = set(ride)
        return ride, [s for s in slots if s not in chosen]

    def pause_for_reprefill(self, slots: list[int]) -> None:
        """After an interrupting swap: `slots` (in the order they ride) keep their samples and pages
        but stop decoding until the decode steps have re-prefilled their histories under the new
        weights; any other slot still paused from an earlier swap is the packed calls' now."""
        self.pending = {}
        self._paused_histories = {s: self.samples[s].history() for s in slots}
        for slot in slots:
            self.pending[slot] = 0
            self._fresh[slot] = True
        self._stats.reprefill_tokens += sum(h.size for h in self._paused_histories.values())

    def busy(self) -> bool:
        return any(s is not None for s in self.samples)

    # ---- starting samples ----------------------------------------------------------------------

    def take(self, free: list[int], count: int, tokens: int, req: Request | None = None, version: int = 0
             ) -> tuple[list[int], list[int]]:
        """Up to `count` free slots for samples holding `tokens` positions: (taken, left); paged,
        only with their pages (`PageAllocator.take_slots`), samples of `req` sharing its prompt's
        full pages written under weights `version`."""
        if self._kv.pages is None:
            return free[:count], free[count:]
        return self._kv.pages.take_slots(free, count, tokens, self.prefix(req, version))

    def prefix(self, req: Request | None, version: int) -> Prefix | None:
        """The shareable prompt of `req`'s samples under weights `version` (None: nothing to share)."""
        if req is None or not self.config.share_prompt_pages:
            return None
        return Prefix((req.request_id, version), req.prompt.size // self.config.page_size)

    def admission_pages(self, req: Request) -> int:
        """Pages a new sample of `req` takes: its prompt and first decode chunk."""
        return self._kv.pages.pages_for(self.config.chunk_tokens(req.prompt.size, req.sampling.max_new_tokens - 1))

    def set_key(self, slot: int, request_seed: int, index: int) -> None:
        """The slot's key data: sample `index` of a request draws from (engine seed, request seed,
        index) alone, however the engine batches it."""
        self.keys[slot] = np.random.SeedSequence(
            [self.config.seed, request_seed & 0xFFFFFFFF, request_seed >> 32, index]).generate_state(2, np.uint32)

    def start_arrays(self, plan: list[Start]) -> tuple[np.ndarray, ...]:
        """Per started sample, padded to B: prefill rows, cache slots (padding: B, dropped), key
        data, prompt's last position, temperature, top_p, top_k (padding: greedy, no filter). One
        compiled program per prefill row count."""
        B = self.config.num_slots
        rows, slots = np.zeros(B, np.int32), np.full(B, B, np.int32)
        positions, top_k = np.zeros(B, np.int32), np.zeros(B, np.int32)
        keys = np.zeros((B, 2), np.uint32)
        temperature, top_p = np.zeros(B, np.float32), np.ones(B, np.float32)
        for i, (slot, req, _, row) in enumerate(plan):
            sp = req.sampling
            rows[i], slots[i], positions[i], keys[i] = row, slot, req.prompt.size - 1, self.keys[slot]
            temperature[i], top_p[i], top_k[i] = sp.temperature, sp.top_p, sp.top_k
        return rows, slots, keys, positions, temperature, top_p, top_k

    def start(self, slot: int, req: Request, index: int, token: int, logprob: float, version: int,
              prompt_routing: np.ndarray | None = None) -> None:
        """Puts a new sample with its first token into `slot` (finished at once by a stop token or
        its length); `prompt_routing` `[P, L_moe, k]`: its prompt's experts (MoE)."""
        self._stats.generated_tokens += 1
        routing = None if prompt_routing is None else [prompt_routing]
        self._bind(slot, Sample(req, index, [token], [logprob], [version], stamp=next(self._stamps),
                                routing=routing))
        self._finish_if_done(slot, token)

    def _bind(self, slot: int, sample: Sample) -> None:
        """Puts a sample (its key already set) into a slot: its next input token is its last
        generated one."""
        sp = sample.request.sampling
        self.samples[slot] = sample
        self._fresh[slot] = True
        self.tokens[slot] = sample.tokens[-1]
        self.positions[slot] = sample.request.prompt.size + len(sample.tokens) - 1
        self.remaining[slot] = sp.max_new_tokens - len(sample.tokens)
        self.temperature[slot] = sp.temperature
        self.top_p[slot] = sp.top_p
        self.top_k[slot] = sp.top_k
        self.stop_ids[slot] = -1
        self.stop_ids[slot, :len(sp.stop_token_ids)] = sp.stop_token_ids

    # ---- pages (paged layout) ------------------------------------------------------------------

    def reserve_chunk(self) -> None:
        """Paged: gives every running sample the pages the next chunk may write, oldest first; when
        a replica runs dry, preempts its most recently started samples (recomputed later)."""
        if self._kv.pages is None:
            return
        running = sorted(self.running(), key=lambda s: self.samples[s].stamp)
        for slot in self._kv.pages.reserve([(s, self.config.chunk_tokens(int(self.positions[s]),
                                                                         int(self.remaining[s]))) for s in running]):
            self._preempt(slot)

    def _preempt(self, slot: int) -> None:
        """Takes a running sample out of its slot (its pages already given back), keeping what it
        generated."""
        sample = self.samples[slot]
        self.samples[slot] = None
        self._fresh[slot] = True
        self.pending.pop(slot, None)  # resumed later by a packed re-prefill of its whole history
        self.preempted.append(sample)
        self.preempted.sort(key=lambda x: x.stamp)
        self._stats.preempted_samples += 1

    def resume_preempted(self, params: Params, version: int) -> None:
        """Puts preempted samples back into free slots, oldest first, while the pool has room:
        their KV cache is recomputed from prompt + generated tokens (under the current weights,
        `version`, sharing the prompt pages a sibling holds under them; the tokens keep their
        versions)."""
        free = self.free()
        histories, groups = {}, {}
        while self.preempted and free:
            sample = self.preempted[0]
            position = sample.request.prompt.size + len(sample.tokens) - 1
            remaining = sample.request.sampling.max_new_tokens - len(sample.tokens)
            taken, free = self.take(free, 1, self.config.chunk_tokens(position, remaining), sample.request, version)
            if not taken:
                break
            self.preempted.pop(0)
            self.set_key(taken[0], sample.request.seed, sample.index)
            self._bind(taken[0], sample)
            histories[taken[0]] = sample.history()
            groups[taken[0]] = sample.request.request_id
        if histories:
            self._kv.recompute(params, histories, groups)

    # ---- decoding ------------------------------------------------------------------------------

    def decode_chunk(self, params: Params, version: int, waiting: bool) -> None:
        """One decode chunk over every running slot; its tokens carry `version`. With requests
        `waiting`, the chunk ends early once `refill_after` more slots are free.

        Overlapped (`EngineConfig.overlap`): while the last chunk is still in flight, this one is
        dispatched from its final state on the device (pages reserved for both chunks' tokens), then
        the last one is read back and folded in; this one stays in flight. When the pool cannot hold
        both chunks' pages, the last chunk is read first and this one reserved exactly (preempting
        as without overlap)."""
        ec = self.config
        if self.pending:  # a chunk carrying re-prefill rows starts from the host's state, read back at once
            self.drain()
        if self.in_flight is not None and not self._reserve_ahead():
            self.drain()
        if self.in_flight is None:
            self.reserve_chunk()
        active = self.decoding()
        if not active.any() and not self.pending:
            self.drain()
            return
        exit_free = (int((~active).sum()) + ec.refill_after if waiting and ec.refill_after
                     else ec.num_slots + 1)
        # Positions reached by the end of the chunk: the attention window (paged: the pages of the
        # page tables) must hold them, and the re-prefill rows' positions too.
        reached = int(self._ahead()[0][active].max()) + ec.decode_chunk if active.any() else 0
        ride = self._plan_rides()
        if ride is not None:
            reached = max(reached, ride.last_position + 1)
        window = ec.decode_window(reached)
        if ride is not None:
            ride = dataclasses.replace(ride, tables=ride.tables[:, :, :ec.decode_pages(window)])
        last = self.in_flight
        chunk = self._kv.dispatch_decode(params, (
            self.tokens, self.positions, active, self.remaining, self.temperature, self.top_p, self.top_k,
            self.stop_ids, self.keys, np.int32(exit_free)), window,
            sampler_kind(self.temperature[active], self.top_p[active], self.top_k[active]),
            None if last is None else last.chunk, self._fresh, ride)
        self._fresh[:] = False
        self.in_flight = InFlight(chunk, list(self.samples), active, version, window, ride is not None)
        if last is not None:
            self._stats.overlapped_chunks += 1
            self._fold(last)
        if not ec.overlap or ride is not None:
            self.drain()
        if ride is not None:
            self._rode(ride)

    def _plan_rides(self) -> RidePlan | None:
        """The next chunk's re-prefill rows from the paused slots, in their order (None: none
        paused), with whole page tables: the caller cuts them to the chunk's window."""
        if not self.pending:
            return None
        ec, kv = self.config, self._kv
        order = list(self.pending)  # as `split_for_rides` chose them
        return plan_rides(self._paused_histories, self.pending, order, data=kv.data,
                          slots_per_replica=ec.num_slots // kv.data, rows=ec.reprefill_in_decode_rows,
                          width=ec.reprefill_in_decode_width, steps=ec.decode_chunk,
                          page_tables=kv.tables()[0])

    def _rode(self, ride: RidePlan) -> None:
        """After a chunk carrying `ride` ran (every planned row runs): the paused slots' progress;
        those whose histories are written decode from the next chunk."""
        for slot, cursor in ride.cursors.items():
            if slot in self.pending:  # not finished or preempted meanwhile
                self.pending[slot] = cursor
        for slot in ride.done:
            if self.pending.pop(slot, None) is not None:
                self._fresh[slot] = True
        self._stats.prefill_tokens += ride.tokens_carried
        self._stats.reprefill_ride_tokens += ride.tokens_carried

    def drain(self) -> None:
        """Reads back and folds in the chunk in flight, if any."""
        if self.in_flight is not None:
            last, self.in_flight = self.in_flight, None
            self._fold(last)

    def _ahead(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions, remaining) `[B]` every slot may have reached once the chunk in flight ends:
        a bound for the slots in it (each may have taken its whole chunk), the host's for the others."""
        pos, rem = self.positions, self.remaining
        if self.in_flight is None:
            return pos, rem
        steps = np.where(self.in_flight.active & ~self._fresh, np.minimum(self.config.decode_chunk, rem), 0)
        return np.minimum(pos + steps, self.config.max_seq_len - 1), rem - steps

    def _reserve_ahead(self) -> bool:
        """Paged, with a chunk in flight: gives every running sample the pages of the in-flight
        chunk and the next one, when every replica has them free; False (nothing taken) otherwise."""
        if self._kv.pages is None:
            return True
        pos, rem = self._ahead()
        running = sorted(self.running(), key=lambda s: self.samples[s].stamp)
        return self._kv.pages.reserve_all([(s, self.config.chunk_tokens(int(pos[s]), int(rem[s]))) for s in running])

    def _fold(self, flight: InFlight) -> None:
        """Reads back a dispatched chunk and folds its tokens into the samples it ran: a sample
        taken out of its slot since (finished, aborted) keeps none of them."""
        ec = self.config
        tokens, logprobs, valid, steps, chosen = self._kv.read_decode(flight.chunk)
        now = time.perf_counter()
        elapsed = now - max(flight.chunk.t0, self._last_read)  # from when the device could start it
        self._last_read = now
        self._stats.decode_s += elapsed
        self._stats.chunks += 1
        self._stats.decode_steps += steps
        self._stats.busy_slot_steps += int(valid.sum())
        self._timings.add("decode_ride" if flight.rides else "decode", decode_key(flight.window, int(flight.active.sum()), ec.num_slots), steps=steps,
                          slot_steps=int(valid.sum()), s=elapsed)
        for slot in np.flatnonzero(flight.active):
            sample = flight.samples[slot]
            got = int(valid[slot].sum())  # valid steps form a prefix of the chunk
            if got == 0 or self.samples[slot] is not sample:
                continue
            new = tokens[slot, :got]
            sample.tokens.extend(new.tolist())
            sample.logprobs.extend(logprobs[slot, :got].tolist())
            sample.versions.extend([flight.version] * got)
            if sample.routing is not None:  # the experts of the chunk's input tokens [got, L_moe, k]
                sample.routing.append(chosen[slot, :got].copy())  # a copy: the chunk's [B, C, ..] is freed
            self._stats.generated_tokens += got
            self.tokens[slot] = new[-1]
            self.positions[slot] += got
            self.remaining[slot] -= got
            self._finish_if_done(slot, int(new[-1]))

    # ---- finishing -----------------------------------------------------------------------------

    def _finish_if_done(self, slot: int, last: int) -> None:
        if last in self.samples[slot].request.sampling.stop_token_ids:
            self.finish(slot, "stop")
        elif self.remaining[slot] <= 0 or self.positions[slot] >= self.config.max_seq_len - 1:
            self.finish(slot, "length")

    def finish(self, slot: int, reason: StopReason) -> None:
        """Frees the slot (and its pages) and hands its sample to the engine."""
        sample = self.samples[slot]
        self.samples[slot] = None
        self._fresh[slot] = True
        self.pending.pop(slot, None)
        if self._kv.pages is not None:
            self._kv.pages.release(slot)
        self._on_done(sample, reason)

    def abort_requests(self) -> None:
        """Ends, 'aborted', every running or preempted sample of an aborted request."""
        for slot, sample in enumerate(self.samples):
            if sample is not None and sample.request.aborted:
                self.finish(slot, "aborted")
        for sample in [s for s in self.preempted if s.request.aborted]:
            self.preempted.remove(sample)
            self._on_done(sample, "aborted")
