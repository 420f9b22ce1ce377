"""Continuous-batching generation over fixed decode slots, with interruptible weight swaps.

Vocabulary (after JetStream): *prefill* a prompt into a fresh KV block, *insert* that block into
free slots (one prefill shared by the `n` samples of a group), *generate* a chunk of decode
steps for all slots at once. Between chunks the host frees finished slots, refills them from
the queue (continuous batching), applies aborts and swaps weights.

Interruptible swap (AReaL): `update_weights(params, version)` may be called from any thread and
takes effect at the next chunk boundary. In-flight samples keep their tokens, logprobs and
versions; their KV cache is recomputed from prompt + tokens so far under the new weights, and
later tokens carry the new version (histories are packed several to a row and written straight
into their slots, `reprefill_pack_width`). With `interruptible=False` the engine instead stops
admitting, lets in-flight samples finish on the old weights, then swaps (the ablation).

Device state is the KV cache, one `[B, K, S, H]` buffer per layer (B = slots, S = max_seq_len),
and the weights, also held per layer (split once per weight swap); per-slot scalars live on the
host and travel with each chunk call (a few hundred bytes). Prefill and decode run the layers
unrolled over those pieces, so each cache layer is updated in place and each weight is read
where it lies (over stacked layers XLA copies every layer's weights and cache, per step in a
scan, per call when splitting inside the program). A chunk attends over the smallest cache
window holding its sequences (`decode_windows`) and ends early when a slot frees up while
requests wait (`refill_after`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from areal_jax.generation.sampling import MAX_STOP_IDS, SamplingParams, sample_tokens
from areal_jax.models.config import ModelConfig
from areal_jax.models.sharding import GENERATION_RULES, activation_rules, sharding_for
from areal_jax.models.transformer import (KVCache, Params, Transformer, forward, lm_head, prefill_into_slots,
                                          split_layers)
from areal_jax.packing import ffd_allocate

StopReason = Literal["stop", "length", "aborted"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine shape. Compiled programs: one decode chunk, one prefill and one insert per bucket."""

    num_slots: int = 8
    max_seq_len: int = 512  # prompt + completion tokens of one sample; the KV cache length S
    decode_chunk: int = 8  # decode steps per jitted chunk at most: the granularity of refills and swaps
    # A chunk ends early once this many slots have finished while requests wait in the queue, so
    # freed slots are refilled without idling to the chunk's end. 0 (default): chunks run in full
    # unless every slot is done. Early refills mean more, smaller prefill calls: on the 2-core CPU
    # benchmark (16 slots, chunk 16) 2, 4 or 8 were within noise of 0 (docs/benchmarks.md).
    refill_after: int = 0
    # Cache lengths a decode chunk may attend over (one compiled chunk each): a chunk reads only
    # the smallest window that holds every active slot's sequence, not the whole cache. Default:
    # powers of two from 128 below max_seq_len, then max_seq_len.
    decode_windows: tuple[int, ...] = ()
    prefill_buckets: tuple[int, ...] = ()  # default: powers of two from 16, capped by max_seq_len
    # Most prompts prefilled together in one call. A call's rows are the next power of four (at
    # most this), so each prompt length bucket compiles a few row counts. Large calls matter when
    # many slots free at once (the start, a static batch): 64 prompts in calls of 32 rows instead
    # of 8 took ~30% less prefill time on the 2-core CPU benchmark (bench/generation_throughput.py).
    max_prefill_batch: int = 32
    # After a weight swap, in-flight histories up to this many tokens are re-prefilled packed
    # several to a row of this width (at most max_seq_len), written straight into their slots:
    # one call for a whole swap instead of a prefill and an insert per length bucket. Longer
    # histories are prefilled by length bucket (a wide packed row would attend over all of it).
    reprefill_pack_width: int = 512
    interruptible: bool = True
    cache_dtype: str | None = None  # default: the dtype of the weights
    seed: int = 0

    def __post_init__(self):
        for name in ("num_slots", "max_seq_len", "decode_chunk", "max_prefill_batch", "reprefill_pack_width"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.refill_after, int) or self.refill_after < 0:
            raise ValueError(f"EngineConfig.refill_after must be an int >= 0, got {self.refill_after!r}")
        if self.max_seq_len < 2:
            raise ValueError("EngineConfig.max_seq_len must be >= 2 (one prompt token and one generated)")
        buckets = tuple(sorted(set(self.prefill_buckets))) or _default_buckets(self.max_seq_len)
        if buckets[-1] < self.max_seq_len - 1 or any(b < 1 for b in buckets):
            raise ValueError(f"prefill_buckets {buckets} must be >= 1 and cover max_seq_len - 1 = "
                             f"{self.max_seq_len - 1}")
        object.__setattr__(self, "prefill_buckets", tuple(b for b in buckets if b < self.max_seq_len)
                           + ((self.max_seq_len,) if buckets[-1] >= self.max_seq_len else ()))
        windows = tuple(sorted(set(self.decode_windows))) or _default_buckets(self.max_seq_len, start=128)
        if any(not isinstance(w, int) or not 0 < w <= self.max_seq_len for w in windows):
            raise ValueError(f"decode_windows {windows} must be ints in [1, max_seq_len = {self.max_seq_len}]")
        object.__setattr__(self, "decode_windows", tuple(w for w in windows if w < self.max_seq_len)
                           + (self.max_seq_len,))

    def bucket(self, length: int) -> int:
        return next(b for b in self.prefill_buckets if b >= length)

    def decode_window(self, needed: int) -> int:
        """Cache positions a decode chunk attends over when its sequences need `needed` of them."""
        return next((w for w in self.decode_windows if w >= needed), self.max_seq_len)

    def batch_bucket(self, n: int) -> int:
        """Rows of a prefill call for n prompts: the next power of four (1, 4, 16, ...), at most
        max_prefill_batch. Padding rows cost little next to the programs finer steps would compile."""
        if not 1 <= n <= self.max_prefill_batch:
            raise ValueError(f"a prefill call takes 1 to max_prefill_batch = {self.max_prefill_batch} prompts, got {n}")
        rows = 1
        while rows < n:
            rows *= 4
        return min(rows, self.max_prefill_batch)

    @property
    def pack_width(self) -> int:
        """Row width of packed re-prefill calls."""
        return min(self.reprefill_pack_width, self.max_seq_len)

    def pack_rows_bucket(self, n: int) -> int:
        """Rows of a packed re-prefill call holding n packed rows: the next power of two, at most
        max_prefill_batch (packed rows are full, so finer steps than prefill's pay)."""
        if not 1 <= n <= self.max_prefill_batch:
            raise ValueError(f"a packed call takes 1 to max_prefill_batch = {self.max_prefill_batch} rows, got {n}")
        return min(1 << (n - 1).bit_length(), self.max_prefill_batch)

    @property
    def prefill_batch_buckets(self) -> tuple[int, ...]:
        """Every row count `batch_bucket` can return."""
        return tuple(sorted({self.batch_bucket(n) for n in range(1, self.max_prefill_batch + 1)}))


def _default_buckets(max_seq_len: int, start: int = 16) -> tuple[int, ...]:
    out, b = [], start
    while b < max_seq_len:
        out.append(b)
        b *= 2
    return tuple(out) + (max_seq_len,)


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sample: generated `tokens [G]`, behavior `logprobs [G]`, policy `versions [G]`."""

    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    stop_reason: StopReason


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """The `n` samples of one request, in submission order of the samples."""

    request_id: str
    prompt_ids: np.ndarray
    completions: list[Completion]


@dataclasses.dataclass
class EngineStats:
    generated_tokens: int = 0
    prefill_tokens: int = 0
    reprefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    busy_slot_steps: int = 0  # sum over decode steps of slots that were generating
    chunks: int = 0
    weight_swaps: int = 0
    finished_samples: int = 0
    aborted_samples: int = 0
    queued_requests: int = 0
    active_slots: int = 0

    @property
    def tokens_per_s(self) -> float:
        busy = self.prefill_s + self.decode_s
        return self.generated_tokens / busy if busy else 0.0

    @property
    def slot_occupancy(self) -> float:
        return self.busy_slot_steps / self.decode_steps if self.decode_steps else 0.0


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: np.ndarray  # [P] int32
    sampling: SamplingParams
    n: int
    future: concurrent.futures.Future
    results: list[Completion | None]
    next_sample: int = 0  # samples [0, next_sample) have been inserted
    # (KV block [L, R, K, P, H], row of this prompt in it, last-position logits [R, V]): one
    # prefill shared by the group's samples (and by other prompts prefilled in the same call).
    prefix: tuple[Any, int, jax.Array] | None = None
    aborted: bool = False
    seed: int = 0


@dataclasses.dataclass
class _Sample:
    request: _Request
    index: int
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]


class RequestHandle(concurrent.futures.Future):
    """A future for a `GroupResult` that also names its request (for `abort`)."""

    request_id: str


class GenerationEngine:
    """Generates for many requests at once over `config.num_slots` decode slots.

    Thread model: any thread may `submit`, `abort` and `update_weights`; one thread drives the
    engine, either the engine's own (`start()`/`stop()`) or the caller (`step()`/`run_until_idle()`).
    """

    def __init__(self, model: Transformer | tuple[ModelConfig, Params], config: EngineConfig = EngineConfig(),
                 *, version: int = 0):
        self.model_config, params = (model.config, model.params) if isinstance(model, Transformer) else model
        self.config = config
        self._version = version
        cfg, ec = self.model_config, config
        # The engine runs where its weights live: on their generation mesh (slots over "data",
        # kv heads over "tensor") or on their single device. Host inputs are put there too.
        home = params["embed"].sharding
        self._mesh = home.mesh if isinstance(home, NamedSharding) else None
        dtype = jnp.dtype(ec.cache_dtype) if ec.cache_dtype else params["embed"].dtype
        layer_shape = (ec.num_slots, cfg.num_kv_heads, ec.max_seq_len, cfg.head_dim)  # [B, K, S, H]
        if self._mesh is not None:
            self._inputs_sharding = NamedSharding(self._mesh, PartitionSpec())
            cache_sharding = sharding_for(("cache_slots", "kv_heads", "cache_seq", "head_dim"),
                                          GENERATION_RULES, self._mesh, layer_shape)
        else:
            self._inputs_sharding = cache_sharding = SingleDeviceSharding(next(iter(home.device_set)))
        # The cache lives per layer (tuples of L `[B, K, S, H]` buffers), the layout the decode loop
        # updates in place: a stacked cache would be split and re-stacked (copied) on every chunk.
        zeros = jax.jit(lambda: jnp.zeros(layer_shape, dtype), out_shardings=cache_sharding)
        self._cache = KVCache(tuple(zeros() for _ in range(cfg.num_layers)),
                              tuple(zeros() for _ in range(cfg.num_layers)))
        B = ec.num_slots
        self._slot_sample: list[_Sample | None] = [None] * B
        self._tokens = np.zeros(B, np.int32)  # next input token of each slot
        self._positions = np.zeros(B, np.int32)  # its position (= sequence length - 1)
        self._remaining = np.zeros(B, np.int32)  # tokens the slot may still generate
        self._temperature = np.ones(B, np.float32)
        self._top_p = np.ones(B, np.float32)
        self._top_k = np.zeros(B, np.int32)
        self._stop_ids = np.full((B, MAX_STOP_IDS), -1, np.int32)
        self._slot_keys = np.zeros((B, 2), np.uint32)  # threefry key data of each slot's sample
        self._lock = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._requests: dict[str, _Request] = {}
        self._aborts: set[str] = set()
        self._pending_weights: tuple[Params, int, concurrent.futures.Future] | None = None
        self._ids = itertools.count()
        self._seeds = itertools.count()
        self._stats = EngineStats()
        self.compile_counts: collections.Counter[str] = collections.Counter()
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._paused = False
        self._build_programs()
        self._params = self._split_fn(params)

    # ---- public API ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, n: int = 1,
               request_id: str | None = None, seed: int | None = None) -> RequestHandle:
        """Queues a prompt for `n` samples; returns a future of its `GroupResult`.

        Sample i draws its randomness from (engine seed, `seed`, i, token position) alone, so the
        same request with the same seed and weights gives the same tokens however the engine
        happens to batch it. Without `seed`, a per-engine counter is used.

        Invalid requests raise here (ValueError naming the problem) and never reach the engine.
        """
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError("empty prompt: at least one prompt token is needed")
        if prompt.size >= self.config.max_seq_len:
            raise ValueError(f"prompt of {prompt.size} tokens does not fit: max_seq_len is "
                             f"{self.config.max_seq_len} (prompt + at least one generated token)")
        if prompt.min() < 0 or prompt.max() >= self.model_config.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size}), "
                             f"got range [{prompt.min()}, {prompt.max()}]")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        future = RequestHandle()
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in flight")
            future.request_id = rid
            request = _Request(rid, prompt.astype(np.int32), sampling, n, future, [None] * n,
                               seed=next(self._seeds) if seed is None else int(seed))
            self._requests[rid] = request
            self._queue.append(request)
            self._lock.notify_all()
        return future

    def abort(self, request_id: str) -> None:
        """Stops a request: its unfinished samples end with stop_reason 'aborted' (tokens so far kept)."""
        with self._lock:
            if request_id in self._requests:
                self._aborts.add(request_id)
                self._lock.notify_all()

    def update_weights(self, params: Params, version: int) -> concurrent.futures.Future:
        """Hands new weights to the engine; the returned future resolves once they are in use."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._pending_weights is not None:  # a newer push supersedes one not yet applied
                self._pending_weights[2].set_result(False)
            self._pending_weights = (params, int(version), done)
            self._lock.notify_all()
        return done

    def pause(self) -> None:
        """Stops scheduling after the current chunk (in-flight samples keep their slots and cache).

        Used by the colocated synchronous baseline, where generation and training take turns on
        the same devices.
        """
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    @property
    def params(self) -> Params:
        """The weights being served, in the usual stacked layout (a copy; for inspection)."""
        layers = self._params["layers"]
        return {**self._params, "layers": jax.tree.map(lambda *a: jnp.stack(a), *layers)}

    def stats(self) -> EngineStats:
        with self._lock:
            s = dataclasses.replace(self._stats)
            s.queued_requests = len(self._queue)
        s.active_slots = sum(x is not None for x in self._slot_sample)
        return s

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._queue or self._aborts or self._pending_weights
                        or any(s is not None for s in self._slot_sample))

    def run_until_idle(self) -> None:
        """Drives the engine from the calling thread until nothing is queued or running."""
        while self.step():
            pass

    def start(self) -> None:
        """Runs the engine on its own thread until `stop()`."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._loop, name="generation-engine", daemon=True)
        self._thread.start()

    def stop(self, abort_pending: bool = True) -> None:
        """Stops the engine thread; with `abort_pending`, every unfinished request ends 'aborted'."""
        self._stop_event.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if abort_pending:
            with self._lock:
                self._aborts.update(self._requests)
            self._apply_aborts()

    # ---- the scheduling loop ------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop_event.is_set():
            try:
                busy = self.step()
            except BaseException as e:  # noqa: BLE001 - fail every waiter rather than hang them
                self._fail_all(e)
                raise
            if not busy:
                with self._lock:
                    idle = not (self._queue or self._aborts or self._pending_weights)
                    if (idle or self._paused) and not self._stop_event.is_set():
                        self._lock.wait(timeout=0.1)

    def step(self) -> bool:
        """One scheduling round: aborts, weight swap, refill free slots, one decode chunk.

        Returns whether work remains (False while paused).
        """
        if self._paused:
            return False
        with self._placement():
            self._apply_aborts()
            draining = self._maybe_swap_weights()
            if not draining:
                self._admit()
            if any(s is not None for s in self._slot_sample):
                self._decode_chunk()
        return self.has_work()

    def _placement(self):
        """Activation sharding rules of the generation mesh (traced into the programs)."""
        return activation_rules(GENERATION_RULES, self._mesh) if self._mesh is not None else contextlib.nullcontext()

    def _put(self, *arrays):
        return jax.device_put(arrays, self._inputs_sharding)

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            for rid in aborts:
                req = self._requests.get(rid)
                if req is not None:
                    req.aborted = True
                    if req in self._queue:
                        self._queue.remove(req)
        for slot, sample in enumerate(self._slot_sample):
            if sample is not None and sample.request.aborted:
                self._finish(slot, "aborted")
        for rid in aborts:
            req = self._requests.get(rid)
            if req is None:
                continue
            empty = np.zeros(0, np.int32)
            for i in range(req.next_sample, req.n):
                req.results[i] = Completion(empty, np.zeros(0, np.float32), empty, "aborted")
                self._stats.aborted_samples += 1
            req.next_sample = req.n
            self._maybe_complete(req)

    def _maybe_swap_weights(self) -> bool:
        """Applies pending weights if allowed now; returns True while draining for a non-interruptible swap."""
        with self._lock:
            pending = self._pending_weights
        if pending is None:
            return False
        active = [i for i, s in enumerate(self._slot_sample) if s is not None]
        if active and not self.config.interruptible:
            return True  # let in-flight samples finish on the old weights first
        params, version, done = pending
        with self._lock:
            self._pending_weights = None
        self._params, self._version = self._split_fn(params), version
        self._stats.weight_swaps += 1
        # Interrupted samples: recompute their KV cache from prompt + tokens so far (all but the
        # last token, which is the next decode input) under the new weights, in batched calls.
        histories = {slot: np.concatenate([self._slot_sample[slot].request.prompt,
                                           np.asarray(self._slot_sample[slot].tokens[:-1], np.int32)])
                     for slot in active}
        # Histories that fit a packed row go several to a row, straight into their slots.
        width = self.config.pack_width
        self._reprefill_packed({slot: h for slot, h in histories.items() if h.size <= width})
        # Longer ones: each call holds histories of one length bucket (a call pads every row to
        # its longest, so mixed lengths would pad the short ones to a straggler's length).
        by_bucket: dict[int, list[int]] = collections.defaultdict(list)
        for slot in sorted((s for s in active if histories[s].size > width), key=lambda s: histories[s].size):
            by_bucket[self.config.bucket(histories[slot].size)].append(slot)
        for slots in by_bucket.values():
            for start in range(0, len(slots), self.config.max_prefill_batch):
                part = slots[start:start + self.config.max_prefill_batch]
                block, _ = self._prefill([histories[slot] for slot in part])
                self._insert(block, list(enumerate(part)))
        self._stats.reprefill_tokens += sum(h.size for h in histories.values())
        with self._lock:  # queued groups' prefill blocks hold old-weight keys and values
            for req in self._queue:
                req.prefix = None
        done.set_result(True)
        return False

    def _admit(self) -> None:
        """Fills free slots from the queue head: one program per prefill call prefills the prompts,
        copies each into the slots of its samples and samples their first tokens."""
        free = [i for i, s in enumerate(self._slot_sample) if s is None]
        while free:
            with self._lock:
                if not self._queue:
                    break
                head = self._queue[0]
            if head.prefix is None:
                free = self._prefill_and_start(free)
            else:  # samples left of a group prefilled when too few slots were free
                free = self._start_from_prefix(head, free)

    def _assign(self, req: _Request, free: list[int]) -> tuple[list[tuple[int, _Request, int]], list[int]]:
        """Gives the request's next samples free slots: ([(slot, request, sample index)], slots left)."""
        take = min(len(free), req.n - req.next_sample)
        slots, free = free[:take], free[take:]
        started = [(slot, req, req.next_sample + j) for j, slot in enumerate(slots)]
        for slot, _, index in started:
            self._slot_keys[slot] = self._sample_key(req.seed, index)
        req.next_sample += take
        if req.next_sample == req.n:
            req.prefix = None  # the group's prefill block is no longer needed
            with self._lock:
                if self._queue and self._queue[0] is req:
                    self._queue.popleft()
        return started, free

    def _queue_head_batch(self, free_slots: int) -> list[_Request]:
        """The queued requests, from the head, to prefill in one call: while their samples fit in
        the free slots, up to the first whose prompt falls in another length bucket (a call pads
        every row to its longest prompt) or that holds a prefill already."""
        with self._lock:
            batch, room = [], free_slots
            for req in self._queue:
                if len(batch) == self.config.max_prefill_batch or room <= 0 or req.prefix is not None:
                    break
                if batch and self.config.bucket(req.prompt.size) != self.config.bucket(batch[0].prompt.size):
                    break
                batch.append(req)
                room -= req.n - req.next_sample
        return batch

    def _prefill_and_start(self, free: list[int]) -> list[int]:
        batch = self._queue_head_batch(len(free))
        plan: list[tuple[int, _Request, int, int]] = []  # slot, request, sample index, prefill row
        for row, req in enumerate(batch):
            started, free = self._assign(req, free)
            plan += [(slot, r, index, row) for slot, r, index in started]
        t0 = time.perf_counter()
        padded, lengths = self._padded_rows([req.prompt for req in batch])
        self._cache, block, logits, tokens, logprobs = self._prefill_start_fn(
            self._params, self._cache, *self._put(padded, lengths, *self._start_arrays(plan)))
        tokens, logprobs = jax.device_get((tokens, logprobs))
        self._stats.prefill_s += time.perf_counter() - t0
        self._stats.prefill_tokens += sum(req.prompt.size for req in batch)
        for row, req in enumerate(batch):
            if req.next_sample < req.n:
                req.prefix = (block, row, logits)
        for (slot, req, index, _), token, logprob in zip(plan, tokens, logprobs):
            self._start_sample(slot, req, index, int(token), float(logprob))
        return free

    def _start_from_prefix(self, req: _Request, free: list[int]) -> list[int]:
        block, row, logits = req.prefix
        started, free = self._assign(req, free)
        plan = [(slot, r, index, row) for slot, r, index in started]
        rows, slots, keys, positions, temperature, top_p, top_k = self._start_arrays(plan)
        self._cache = self._insert_fn(self._cache, block, *self._put(rows, slots))
        tokens, logprobs = jax.device_get(self._first_tokens_fn(
            logits, *self._put(rows, keys, positions, temperature, top_p, top_k)))
        for (slot, _, index, _), token, logprob in zip(plan, tokens, logprobs):
            self._start_sample(slot, req, index, int(token), float(logprob))
        return free

    def _start_arrays(self, plan: list[tuple[int, _Request, int, int]]) -> tuple[np.ndarray, ...]:
        """Per started sample (slot, request, index, prefill row), padded to num_slots: prefill rows,
        cache slots (padding: num_slots, dropped), key data, prompt's last position, temperature,
        top_p, top_k (padding: greedy, no filter). One compiled program per prefill row count."""
        B = self.config.num_slots
        rows, slots = np.zeros(B, np.int32), np.full(B, B, np.int32)
        positions, top_k = np.zeros(B, np.int32), np.zeros(B, np.int32)
        keys = np.zeros((B, 2), np.uint32)
        temperature, top_p = np.zeros(B, np.float32), np.ones(B, np.float32)
        for i, (slot, req, _, row) in enumerate(plan):
            sp = req.sampling
            rows[i], slots[i], positions[i], keys[i] = row, slot, req.prompt.size - 1, self._slot_keys[slot]
            temperature[i], top_p[i], top_k[i] = sp.temperature, sp.top_p, sp.top_k
        return rows, slots, keys, positions, temperature, top_p, top_k

    def _start_sample(self, slot: int, req: _Request, index: int, token: int, logprob: float) -> None:
        sp = req.sampling
        sample = _Sample(req, index, [token], [logprob], [self._version])
        self._slot_sample[slot] = sample
        self._stats.generated_tokens += 1
        self._tokens[slot] = token
        self._positions[slot] = req.prompt.size
        self._remaining[slot] = sp.max_new_tokens - 1
        self._temperature[slot] = sp.temperature
        self._top_p[slot] = sp.top_p
        self._top_k[slot] = sp.top_k
        self._stop_ids[slot] = -1
        self._stop_ids[slot, :len(sp.stop_token_ids)] = sp.stop_token_ids
        if token in sp.stop_token_ids:
            self._finish(slot, "stop")
        elif self._remaining[slot] <= 0 or self._positions[slot] >= self.config.max_seq_len - 1:
            self._finish(slot, "length")

    def _decode_chunk(self) -> None:
        active = np.array([s is not None for s in self._slot_sample])
        with self._lock:
            waiting = bool(self._queue)
        # Exit early once `refill_after` more slots are free, but only if there is work to refill them with.
        ec = self.config
        exit_free = (int((~active).sum()) + ec.refill_after if waiting and ec.refill_after
                     else ec.num_slots + 1)
        # Positions reached by the end of the chunk: the attention window must hold them.
        window = ec.decode_window(int(self._positions[active].max()) + ec.decode_chunk)
        t0 = time.perf_counter()
        self._cache, out = self._decode_fn(self._params, self._cache, *self._put(
            self._tokens, self._positions, active, self._remaining, self._temperature, self._top_p, self._top_k,
            self._stop_ids, self._slot_keys, np.int32(exit_free)), window=window)
        tokens, logprobs, valid, steps = (np.asarray(x) for x in jax.device_get(out))  # [B, C] each; steps []
        self._stats.decode_s += time.perf_counter() - t0
        self._stats.chunks += 1
        self._stats.decode_steps += int(steps)
        self._stats.busy_slot_steps += int(valid.sum())
        for slot in np.flatnonzero(active):
            sample = self._slot_sample[slot]
            got = int(valid[slot].sum())  # valid steps form a prefix of the chunk
            if got == 0:
                continue
            new = tokens[slot, :got]
            sample.tokens.extend(new.tolist())
            sample.logprobs.extend(logprobs[slot, :got].tolist())
            sample.versions.extend([self._version] * got)
            self._stats.generated_tokens += got
            self._tokens[slot] = new[-1]
            self._positions[slot] += got
            self._remaining[slot] -= got
            if new[-1] in sample.request.sampling.stop_token_ids:
                self._finish(slot, "stop")
            elif self._remaining[slot] <= 0 or self._positions[slot] >= self.config.max_seq_len - 1:
                self._finish(slot, "length")

    def _finish(self, slot: int, reason: StopReason) -> None:
        sample = self._slot_sample[slot]
        self._slot_sample[slot] = None
        req = sample.request
        req.results[sample.index] = Completion(
            np.asarray(sample.tokens, np.int32), np.asarray(sample.logprobs, np.float32),
            np.asarray(sample.versions, np.int32), reason)
        if reason == "aborted":
            self._stats.aborted_samples += 1
        else:
            self._stats.finished_samples += 1
        self._maybe_complete(req)

    def _maybe_complete(self, req: _Request) -> None:
        if any(r is None for r in req.results):
            return
        with self._lock:
            self._requests.pop(req.request_id, None)
        try:
            req.future.set_result(GroupResult(req.request_id, req.prompt, list(req.results)))
        except concurrent.futures.InvalidStateError:
            pass  # the caller cancelled the future; the samples are simply dropped

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            requests = list(self._requests.values())
            self._requests.clear()
            self._queue.clear()
        for req in requests:
            try:
                req.future.set_exception(error)
            except concurrent.futures.InvalidStateError:
                pass

    # ---- compiled programs --------------------------------------------------------------------

    def _build_programs(self) -> None:
        cfg, ec = self.model_config, self.config
        counts = self.compile_counts

        def prefill(params, tokens, lengths):
            R, P = tokens.shape
            idx = jnp.arange(P)[None, :]
            positions = jnp.where(idx < lengths[:, None], idx, -1)  # padding writes nothing
            block = KVCache.zeros(cfg, R, P, self._cache.k[0].dtype).per_layer()
            hidden, block = forward(params, cfg, tokens, positions, cache=block, return_hidden=True)
            # Only the last prompt position needs logits: the LM head over all P would be ~40% of
            # a small model's prefill FLOPs.
            last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)  # [R, 1, D]
            return block, lm_head(params, cfg, last)[:, 0]  # [R, V]

        def insert(cache, block, rows, slots):
            """Block row rows[i] into cache slot slots[i], positions [0, P); `[num_slots]` index
            arrays, padded with slot num_slots (out of range: dropped), so one program per block shape."""

            def put(layers, src):  # each block layer `[R, K, P, H]`, each cache layer `[B, K, S, H]`
                return tuple(dst.at[slots, :, :part.shape[2]].set(part[rows], mode="drop")
                             for dst, part in zip(layers, src))

            return KVCache(put(cache.k, block.k), put(cache.v, block.v))

        def first_tokens(all_logits, rows, key_data, positions, temperature, top_p, top_k):
            keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data), positions)
            return sample_tokens(all_logits[rows], keys, temperature, top_p, top_k)

        def prefill_start(params, cache, tokens, lengths, rows, slots, key_data, positions, temperature, top_p,
                          top_k):
            """Prefill, copy row rows[i] into slot slots[i] and sample that sample's first token:
            admission in one program (three calls and host round trips otherwise)."""
            counts["prefill"] += 1  # runs once per trace, i.e. per compilation
            block, logits = prefill(params, tokens, lengths)
            first, logprobs = first_tokens(logits, rows, key_data, positions, temperature, top_p, top_k)
            return insert(cache, block, rows, slots), block, logits, first, logprobs

        def counted(name, fn):
            def run(*args):
                counts[name] += 1
                return fn(*args)
            return run

        def decode(params, cache, tokens, positions, active, remaining, temperature, top_p, top_k, stop_ids,
                   key_data, exit_free, *, window):
            """Up to `decode_chunk` steps for all slots; stops after the step that leaves every slot
            done or at least `exit_free` slots free. Outputs `[B, C]`; steps past the exit are invalid.
            Attention reads cache positions [0, window) (static; every position reached is below it)."""
            counts["decode"] += 1
            B, C, S = tokens.shape[0], ec.decode_chunk, cache.k[0].shape[2]
            slot_keys = jax.random.wrap_key_data(key_data)

            def step(carry):
                cache, tokens, positions, active, remaining, i, out = carry
                pos = jnp.where(active, positions, -1)
                logits, cache = forward(params, cfg, tokens[:, None], pos[:, None], cache=cache,
                                        cache_window=window)
                # The token sampled from the input at position p uses the slot's key folded with p.
                keys = jax.vmap(jax.random.fold_in)(slot_keys, positions)
                new, lp = sample_tokens(logits[:, 0], keys, temperature, top_p, top_k)
                valid = active
                positions = positions + valid
                remaining = remaining - valid
                hit_stop = jnp.any(new[:, None] == stop_ids, axis=-1)
                done = hit_stop | (remaining <= 0) | (positions >= S - 1)
                tokens = jnp.where(valid, new, tokens)
                out = tuple(jax.lax.dynamic_update_index_in_dim(buf, x, i, axis=0)
                            for buf, x in zip(out, (new, lp, valid)))
                return cache, tokens, positions, active & ~done, remaining, i + 1, out

            def keep_going(carry):
                active, i = carry[3], carry[5]
                return (i < C) & jnp.any(active) & (jnp.sum(~active) < exit_free)

            out = (jnp.zeros((C, B), jnp.int32), jnp.zeros((C, B), jnp.float32), jnp.zeros((C, B), bool))
            carry = (cache, tokens, positions, active, remaining, jnp.int32(0), out)
            cache, *_, steps, (new, lp, valid) = jax.lax.while_loop(keep_going, step, carry)
            return cache, (new.T, lp.T, valid.T, steps)  # [B, C] each, []

        # Weights are held per layer (`split_layers`), as the unrolled prefill and decode read
        # them: split once per weight swap instead of once per call.
        self._split_fn = jax.jit(split_layers)
        self._prefill_fn = jax.jit(counted("prefill", prefill))  # long histories after a swap
        self._prefill_start_fn = jax.jit(prefill_start, donate_argnums=(1,))
        self._insert_fn = jax.jit(counted("insert", insert), donate_argnums=(0,))
        self._first_tokens_fn = jax.jit(counted("first_tokens", first_tokens))
        self._decode_fn = jax.jit(decode, donate_argnums=(1,), static_argnames=("window",))

        def reprefill(params, cache, tokens, segment_ids, slot_ids):
            counts["reprefill"] += 1
            return prefill_into_slots(params, cfg, tokens, segment_ids, slot_ids, cache)

        self._reprefill_fn = jax.jit(reprefill, donate_argnums=(1,))

    def _prefill(self, seqs: list[np.ndarray]) -> tuple[KVCache, jax.Array]:
        """KV block (per layer `[R, K, P, H]`) and last-position logits `[R, V]` of `seqs` (row i = seqs[i]).

        R and P are bucketed (powers of two rows, prefill_buckets lengths): few compiled programs.
        """
        t0 = time.perf_counter()
        block, logits = self._prefill_fn(self._params, *self._put(*self._padded_rows(seqs)))
        jax.block_until_ready(logits)
        self._stats.prefill_s += time.perf_counter() - t0
        self._stats.prefill_tokens += sum(s.size for s in seqs)
        return block, logits

    def _padded_rows(self, seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Prefill inputs for `seqs`: tokens `[R, P]` (R a row bucket, P the longest one's length
        bucket, zero-padded) and lengths `[R]` (unused rows: one dummy token)."""
        rows, width = self.config.batch_bucket(len(seqs)), self.config.bucket(max(s.size for s in seqs))
        padded = np.zeros((rows, width), np.int32)
        lengths = np.ones(rows, np.int32)
        for i, s in enumerate(seqs):
            padded[i, :s.size] = s
            lengths[i] = s.size
        return padded, lengths

    def _reprefill_packed(self, histories: dict[int, np.ndarray]) -> None:
        """Recomputes the cache of slots from their histories (slot -> tokens), packed first-fit-
        decreasing into rows of `pack_width` tokens, max_prefill_batch rows per call."""
        if not histories:
            return
        t0 = time.perf_counter()
        ec = self.config
        slots = sorted(histories)
        bins = ffd_allocate([histories[slot].size for slot in slots], ec.pack_width)
        for start in range(0, len(bins), ec.max_prefill_batch):
            part = bins[start:start + ec.max_prefill_batch]
            rows = ec.pack_rows_bucket(len(part))
            ids, segments, dest = (np.zeros((rows, ec.pack_width), np.int32) for _ in range(3))
            for r, members in enumerate(part):
                at = 0
                for j, i in enumerate(members):
                    h = histories[slots[i]]
                    ids[r, at:at + h.size], segments[r, at:at + h.size], dest[r, at:at + h.size] = h, j + 1, slots[i]
                    at += h.size
            self._cache = self._reprefill_fn(self._params, self._cache, *self._put(ids, segments, dest))
        jax.block_until_ready(self._cache.k[0])
        self._stats.prefill_s += time.perf_counter() - t0
        self._stats.prefill_tokens += sum(h.size for h in histories.values())

    def _insert(self, block: KVCache, placements: list[tuple[int, int]]) -> None:
        """Copies block rows into cache slots, `placements` = [(row, slot)], in one call."""
        B = self.config.num_slots
        rows, slots = np.zeros(B, np.int32), np.full(B, B, np.int32)
        for i, (row, slot) in enumerate(placements):
            rows[i], slots[i] = row, slot
        self._cache = self._insert_fn(self._cache, block, *self._put(rows, slots))

    def _sample_key(self, request_seed: int, index: int) -> np.ndarray:
        return np.random.SeedSequence([self.config.seed, request_seed & 0xFFFFFFFF, request_seed >> 32, index]
                                      ).generate_state(2, np.uint32)
