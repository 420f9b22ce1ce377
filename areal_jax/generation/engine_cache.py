"""The engine's KV cache on its devices and every compiled call that writes or reads it.

`EngineCache` holds the cache (dense: L per-layer `[B, K, S, H]` buffers; paged: L page pools and,
on the host, the page allocator of generation/pages.py), the engine's compiled programs
(generation/programs.py) and the way host inputs reach the devices. Its methods are the engine's
device calls in host terms (prompts, histories, slots), each padded to a compiled shape, timed into
the engine's stats and per-shape timings. Which slot gets which sample, and when, is the
scheduler's business (generation/engine.py).

Decode chunks are dispatched (`dispatch_decode`) and read back (`read_decode`) apart, so the host
can dispatch the next one before reading the last (EngineConfig.overlap, generation/slots.py).

Shapes: B slots, B' a decode chunk's batch rows, R prefill rows, P prompt bucket, C decode chunk, V vocab.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from areal_jax.generation.config import EngineConfig
from areal_jax.generation.live_slots import gather_state, live_order, scatter_outputs
from areal_jax.generation.paged import page_bytes, pool_scale_bytes, zero_pools
from areal_jax.generation.pages import PageAllocator
from areal_jax.generation.programs import EnginePrograms, build_programs, cache_sharding, mesh_sizes
from areal_jax.generation.reprefill_rides import RidePlan
from areal_jax.generation.reprefill_trie import pack_trie_rows
from areal_jax.generation.requests import EngineStats
from areal_jax.generation.timings import CallTimings, shape_key
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoding import RideRows, TrieRows
from areal_jax.models.transformer import KVCache, Params
from areal_jax.packing import ffd_allocate


class EngineCache:
    """The KV cache and the programs over it, for one engine."""

    def __init__(self, cfg: ModelConfig, ec: EngineConfig, dtype, *, mesh: Mesh | None, device, counts,
                 stats: EngineStats, timings: CallTimings):
        self.config = ec
        self.data = mesh_sizes(mesh)[0]  # prefill and re-prefill rows are multiples of it
        self._stats, self._timings = stats, timings
        if mesh is not None:
            self.inputs_sharding = NamedSharding(mesh, PartitionSpec())
            layer_sharding = cache_sharding(cfg, ec, mesh)
        else:
            self.inputs_sharding = layer_sharding = SingleDeviceSharding(device)
        self.programs: EnginePrograms = build_programs(cfg, ec, dtype, mesh=mesh, counts=counts,
                                                       platform=device.platform)
        # The cache lives per layer, the layout the unrolled decode loop updates in place (a stacked
        # cache would be split and re-stacked, copied, on every chunk); a scanned engine's pages
        # are one stacked pool, which its layer scan carries and writes in place.
        self.pages: PageAllocator | None = None
        if self.programs.layout == "paged":
            store = jnp.dtype(ec.storage_dtype(dtype))  # FP8 pages with kv_dtype float8_e4m3fn
            per_replica = ec.pool_pages(page_bytes(cfg, ec.page_size, store), self.data, pool_scale_bytes(cfg, store))
            self.pages = PageAllocator(ec.num_slots, self.data, per_replica, ec.page_size, ec.pages_per_sequence)
            self.cache = zero_pools(cfg, self.data * per_replica, ec.page_size, store,
                                    mesh if mesh is not None else layer_sharding, impl=ec.attention_impl,
                                    platform=device.platform, stacked=self.programs.scan_layers)
        else:
            layer_shape = (ec.num_slots, cfg.num_kv_heads, ec.max_seq_len, cfg.head_dim)  # [B, K, S, H]
            zeros = jax.jit(lambda: jnp.zeros(layer_shape, dtype), out_shardings=layer_sharding)
            self.cache = KVCache(tuple(zeros() for _ in range(cfg.num_layers)),
                                 tuple(zeros() for _ in range(cfg.num_layers)))

    def put(self, *arrays):
        return jax.device_put(arrays, self.inputs_sharding)

    def tables(self, width: int | None = None) -> tuple[np.ndarray, ...]:
        """The page tables (their first `width` columns) as the paged programs' last argument; ()
        for the dense layout."""
        if self.pages is None:
            return ()
        return (self.pages.tables[:, :width].copy(),)

    # ---- admission -----------------------------------------------------------------------------

    def prefill_start(self, params: Params, prompts: list[np.ndarray], starts: tuple[np.ndarray, ...]):
        """Prefills `prompts` (one row each), writes row starts[0][i] into slot starts[1][i] and samples
        each started sample's first token (`starts`: the engine's per-sample arrays, padded to B).
        Returns (KV block, last-position logits `[R, V]`, first tokens `[B]`, their log-probs `[B]`,
        each prompt's experts `[P_i, L_moe, k]` (MoE; else None per prompt))."""
        t0 = time.perf_counter()
        padded, lengths = self.padded_rows(prompts)
        self.cache, block, logits, tokens, logprobs, chosen = self.programs.prefill_start(
            params, self.cache, *self.put(padded, lengths, *starts, *self.tables()))
        tokens, logprobs, chosen = jax.device_get((tokens, logprobs, chosen))
        routing = [None if chosen is None else chosen[i, :p.size].copy() for i, p in enumerate(prompts)]
        elapsed = time.perf_counter() - t0
        self._stats.prefill_s += elapsed
        self._stats.prefill_tokens += sum(p.size for p in prompts)
        self._timings.add("prefill", shape_key(padded.shape[0], padded.shape[1]), calls=1,
                          tokens=sum(p.size for p in prompts), s=elapsed)
        return block, logits, tokens, logprobs, routing

    def start_from_block(self, block: KVCache, logits: jax.Array, starts: tuple[np.ndarray, ...], started: int):
        """Later samples of a group from its kept prefill: writes their rows into their slots and
        samples their first tokens. Returns (tokens `[B]`, log-probs `[B]`)."""
        rows, slots, keys, positions, temperature, top_p, top_k = starts
        t0 = time.perf_counter()
        lengths = (positions + 1,) if self.pages is not None else ()
        self.cache = self.programs.insert(self.cache, block, *self.put(rows, slots, *lengths, *self.tables()))
        out = jax.device_get(self.programs.first_tokens(logits, *self.put(rows, keys, positions, temperature,
                                                                          top_p, top_k)))
        self._timings.add("insert", shape_key(started), calls=1, s=time.perf_counter() - t0)
        return out

    def padded_rows(self, seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Prefill inputs for `seqs`: tokens `[R, P]` (P the longest one's length bucket, zero-padded;
        R a row count for that bucket, a multiple of the data size) and lengths `[R]` (unused rows:
        one dummy token)."""
        width = self.config.bucket(max(s.size for s in seqs))
        rows = self.config.prefill_rows(len(seqs), width, self.data)
        padded = np.zeros((rows, width), np.int32)
        lengths = np.ones(rows, np.int32)
        for i, s in enumerate(seqs):
            padded[i, :s.size] = s
            lengths[i] = s.size
        return padded, lengths

    # ---- re-prefill ----------------------------------------------------------------------------

    def recompute(self, params: Params, histories: dict[int, np.ndarray],
                  groups: Mapping[int, Hashable] | None = None) -> None:
        """Writes the KV cache of slots (slot -> history) under `params`: after a weight swap, and
        for preempted samples resuming. `groups` (slot -> key): slots whose histories share a
        prompt, run once per packed row with reprefill_share_prefixes."""
        # Histories that fit a packed row go several to a row, straight into their slots.
        ec = self.config
        packed = {slot: h for slot, h in histories.items() if h.size <= ec.pack_width}
        if ec.reprefill_share_prefixes:
            self._reprefill_tries(params, packed, groups or {})
        else:
            self._reprefill_packed(params, packed)
        # Longer ones: each call holds histories of one length bucket (a call pads every row to
        # its longest, so mixed lengths would pad the short ones to a straggler's length).
        by_bucket: dict[int, list[int]] = {}
        for slot in sorted((s for s, h in histories.items() if h.size > ec.pack_width),
                           key=lambda s: histories[s].size):
            by_bucket.setdefault(ec.bucket(histories[slot].size), []).append(slot)
        for bucket, slots in by_bucket.items():
            most = ec.max_prefill_prompts(bucket, self.data)
            for start in range(0, len(slots), most):
                part = slots[start:start + most]
                self._insert(self._prefill(params, [histories[slot] for slot in part]), list(enumerate(part)),
                             [histories[slot].size for slot in part])
        self._stats.reprefill_tokens += sum(h.size for h in histories.values())

    def _prefill(self, params: Params, seqs: list[np.ndarray]) -> KVCache:
        """KV block (per layer `[R, K, P, H]`) of `seqs` (row i = seqs[i]); R and P bucketed."""
        t0 = time.perf_counter()
        padded, lengths = self.padded_rows(seqs)
        block = self.programs.prefill(params, *self.put(padded, lengths))
        jax.block_until_ready(block)
        elapsed = time.perf_counter() - t0
        self._stats.prefill_s += elapsed
        self._stats.prefill_tokens += sum(s.size for s in seqs)
        self._timings.add("reprefill_long", shape_key(padded.shape[0], padded.shape[1]), calls=1,
                          tokens=sum(s.size for s in seqs), s=elapsed)
        return block

    def _reprefill_packed(self, params: Params, histories: dict[int, np.ndarray]) -> None:
        """Recomputes the cache of slots from their histories (slot -> tokens), packed first-fit-
        decreasing into rows of `pack_width` tokens, `max_pack_rows` rows per call."""
        if not histories:
            return
        t0 = time.perf_counter()
        ec = self.config
        slots = sorted(histories)
        bins = ffd_allocate([histories[slot].size for slot in slots], ec.pack_width)
        most = ec.max_pack_rows(self.data)
        for start in range(0, len(bins), most):
            part = bins[start:start + most]
            rows = ec.pack_rows(len(part), self.data)
            ids, segments, dest = (np.zeros((rows, ec.pack_width), np.int32) for _ in range(3))
            for r, members in enumerate(part):
                at = 0
                for j, i in enumerate(members):
                    h = histories[slots[i]]
                    ids[r, at:at + h.size], segments[r, at:at + h.size], dest[r, at:at + h.size] = h, j + 1, slots[i]
                    at += h.size
            self.cache = self.programs.reprefill(params, self.cache, *self.put(ids, segments, dest, *self.tables()))
        jax.block_until_ready(self.cache)
        elapsed = time.perf_counter() - t0
        self._stats.prefill_s += elapsed
        self._stats.prefill_tokens += sum(h.size for h in histories.values())
        self._timings.add("reprefill", shape_key(len(bins)), calls=-(-len(bins) // most),
                          tokens=sum(h.size for h in histories.values()), s=elapsed)

    def _reprefill_tries(self, params: Params, histories: dict[int, np.ndarray],
                         groups: Mapping[int, Hashable]) -> None:
        """`_reprefill_packed` with each group's histories as one prefix trie per row (split where
        a row's nodes or writes run out): a shared prompt is computed once per row."""
        if not histories:
            return
        t0 = time.perf_counter()
        ec = self.config
        packing = pack_trie_rows(histories, groups, ec.pack_width)
        most = ec.max_pack_rows(self.data)
        for start in range(0, len(packing.rows), most):
            part = list(range(start, min(start + most, len(packing.rows))))
            trie = TrieRows(*self.put(*packing.arrays(part, ec.pack_rows(len(part), self.data))))
            self.cache = self.programs.reprefill(params, self.cache, trie, *self.put(*self.tables()))
        jax.block_until_ready(self.cache)
        elapsed = time.perf_counter() - t0
        tokens = sum(h.size for h in histories.values())
        self._stats.prefill_s += elapsed
        self._stats.prefill_tokens += tokens
        self._stats.reprefill_shared_tokens += tokens - packing.nodes
        self._timings.add("reprefill", shape_key(len(packing.rows)), calls=-(-len(packing.rows) // most),
                          tokens=packing.nodes, s=elapsed)

    def _insert(self, block: KVCache, placements: list[tuple[int, int]], lengths: list[int]) -> None:
        """Copies block rows into cache slots, `placements` = [(row, slot)] of rows holding
        `lengths` tokens, in one call."""
        B = self.config.num_slots
        rows, slots, sizes = np.zeros(B, np.int32), np.full(B, B, np.int32), np.zeros(B, np.int32)
        for i, ((row, slot), size) in enumerate(zip(placements, lengths, strict=True)):
            rows[i], slots[i], sizes[i] = row, slot, size
        extra = (sizes, *self.tables()) if self.pages is not None else ()
        self.cache = self.programs.insert(self.cache, block, *self.put(rows, slots, *extra))

    # ---- decoding ------------------------------------------------------------------------------

    def dispatch_decode(self, params: Params, state: tuple[np.ndarray, ...], window: int, sampler: str,
                        last: DecodeChunk | None = None, fresh: np.ndarray | None = None,
                        ride: RidePlan | None = None) -> DecodeChunk:
        """Dispatches one decode chunk over every slot (`state`: the per-slot host arrays and
        exit_free) attending over `window` positions (paged: the page tables cut to the window's
        pages, and the batch only the live slots', generation/live_slots.py); `sampler`: the live
        rows' `sampler_kind`. With `last` (a chunk not yet read back) the slots' tokens, positions,
        active and remaining come from its final state on the device, except the slots `fresh [B]`
        the host changed since then. With `ride` (generation/reprefill_rides.py) its steps also
        re-prefill those history rows. Returns without waiting for the device."""
        t0 = time.perf_counter()
        B = self.config.num_slots
        tables = self.tables(self.config.decode_pages(window))
        if self.pages is not None:
            order, real = live_order(state[2], self.config, self.data)
        else:
            order, real = np.arange(B), state[2].copy()
        if order.shape[0] < B:
            tables = (tables[0][order],)
        gathered = gather_state(state, order, real)
        if last is None:
            inputs = self.put(*gathered, *tables)
        else:
            head = self.programs.carry(last.final, last.slots, *self.put(state[:4], fresh, order, real))
            inputs = (*head, *self.put(*gathered[4:], *tables))
        if ride is None:
            self.cache, (tokens, logprobs, valid, steps, chosen, final) = self.programs.decode(
                params, self.cache, *inputs, window=window, sampler=sampler)
        else:
            rows = RideRows(*self.put(ride.tokens, ride.positions, ride.tables))
            self.cache, (tokens, logprobs, valid, steps, chosen, final) = self.programs.decode_ride(
                params, self.cache, *inputs, rows, *self.put(np.int32(ride.steps)), window=window, sampler=sampler)
        return DecodeChunk((tokens, logprobs, valid, steps, chosen), final, np.where(real, order, B), order, real, t0)

    def read_decode(self, chunk: DecodeChunk):
        """Waits for a dispatched chunk: host (tokens, logprobs, valid) `[B, C]` each, steps taken and
        (MoE; else None) the experts of each step's input token `[B, C, L_moe, k]`."""
        B = self.config.num_slots
        tokens, logprobs, valid, steps, chosen = jax.device_get(chunk.out)
        if chunk.order.shape[0] < B:
            tokens, logprobs, valid, chosen = scatter_outputs((tokens, logprobs, valid, chosen), chunk.order,
                                                              chunk.real, B)
        return np.asarray(tokens), np.asarray(logprobs), np.asarray(valid), int(steps), chosen


@dataclasses.dataclass(frozen=True)
class DecodeChunk:
    """A dispatched decode chunk: its outputs and final slot state on the device, its batch rows."""

    out: tuple  # tokens, logprobs, valid `[B', C]`, steps, experts `[B', C, L_moe, k]` or None
    final: tuple  # tokens, positions, active, remaining `[B']` after the chunk
    slots: np.ndarray  # `[B']` the slot of each row, B for a padding row
    order: np.ndarray  # `[B']` the slot each row reads (padding rows repeat one)
    real: np.ndarray  # `[B']` whether the row is a live slot
    t0: float  # when it was dispatched (perf_counter)
