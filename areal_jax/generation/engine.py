"""Continuous-batching generation over fixed decode slots, with interruptible weight swaps.

Vocabulary (after JetStream): *prefill* a prompt into a fresh KV block, *insert* that block into
free slots (one prefill shared by the `n` samples of a group), *generate* a chunk of decode
steps for all slots at once. Between chunks the host frees finished slots, refills them from
the queue (continuous batching), applies aborts and swaps weights.

Interruptible swap (AReaL): `update_weights(params, version)` may be called from any thread and
takes effect at the next chunk boundary. In-flight samples keep their tokens, logprobs and
versions; their KV cache is recomputed from prompt + tokens so far under the new weights, and
later tokens carry the new version (histories are packed several to a row and written straight
into their slots, `reprefill_pack_width`; with `reprefill_in_decode_rows` the longest pause instead
and the decode steps re-prefill them beside their decode rows, generation/reprefill_rides.py). With `on_swap="keep"` (PipelineRL's in-flight update)
they continue on the KV cache the old weights wrote instead: no re-prefill. With `interruptible=False` the engine instead stops
admitting, lets in-flight samples finish on the old weights, then swaps (the ablation).
`release_weights()` drops the served weights at the next chunk boundary (in-flight samples keep
their slots and cache) and generation waits for the next `update_weights`: the push of
`EngineConfig.weight_swap = "evict"` lands in their place, never beside them.

Device state is the KV cache, one `[B, K, S, H]` buffer per layer (B = slots, S = max_seq_len) or,
paged (`kv_layout`), one pool of pages per layer with the page tables on the host (pages.py):
admission then waits for free pages, a chunk first gives every running sample the pages it may
write, and a dry pool preempts the newest sample, resumed later by re-prefill. Also the
weights, held per layer (given split, or split once per weight swap); per-slot scalars live on
the host and travel with each chunk call (a few hundred bytes). Prefill and
decode run the layers unrolled over those pieces, so each cache layer is updated in place and
each weight is read where it lies (over stacked layers XLA copies every layer's weights and
cache, per step in a scan, per call when splitting inside the program). A chunk attends over the
smallest cache window holding its sequences (`decode_windows`) and ends early when a slot frees
up while requests wait (`refill_after`).

The compiled programs are built in generation/programs.py (which also describes them for
ahead-of-time planning) and called, on the cache they write, by generation/engine_cache.py. The
slots, what each holds and the decode chunk over them are generation/slots.py's, admission from the
queue into free slots generation/admission.py's; this module is the engine's front (requests,
threads, weights, aborts) and its scheduling round (`step`). On a generation
mesh every batch dimension is a multiple of its "data" size (EngineConfig's row counts).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.generation.admission import Admission
from areal_jax.generation.config import EngineConfig
from areal_jax.generation.engine_cache import EngineCache
from areal_jax.generation.pages import PageAllocator
from areal_jax.generation.programs import (EnginePrograms, check_mesh, layout_mismatch, mesh_of,
                                           param_shardings, placed_like, weight_layout)
from areal_jax.generation.requests import (Completion, EngineStats, GroupResult, Request, RequestHandle, Sample,
                                           StopReason)
from areal_jax.generation.sampling import SamplingParams
from areal_jax.generation.slots import SlotTable
from areal_jax.generation.timings import CallTimings
from areal_jax.models import quantize
from areal_jax.models.config import ModelConfig
from areal_jax.models.sharding import GENERATION_RULES, activation_rules
from areal_jax.models.transformer import Params, Transformer, stack_layers

__all__ = ["Completion", "EngineConfig", "EngineStats", "GenerationEngine", "GroupResult", "RequestHandle"]

class GenerationEngine:
    """Generates for many requests at once over `config.num_slots` decode slots.

    Thread model: any thread may `submit`, `abort` and `update_weights`; one thread drives the
    engine, either the engine's own (`start()`/`stop()`) or the caller (`step()`/`run_until_idle()`).
    """

    def __init__(self, model: Transformer | tuple[ModelConfig, Params], config: EngineConfig = EngineConfig(),
                 *, version: int = 0):
        """`model`: a Transformer, or (config, params) with params stacked (`params["layers"]` a
        dict of `[L, ...]` arrays) or split (a tuple of L per-layer dicts, `split_layers`'s
        layout: installed as given when already laid out as the engine holds them, no copy)."""
        self.model_config, params = (model.config, model.params) if isinstance(model, Transformer) else model
        if config.weight_dtype is None and quantize.is_quantized(params):
            # Weights a push already quantized (an evaluation engine given the run's served ones).
            config = dataclasses.replace(config, weight_dtype=quantize.weight_dtype_of(params))
        self.config = config
        self._version = version
        cfg, ec = self.model_config, config
        # The engine runs where its weights live: on their generation mesh (slots over "data",
        # kv heads over "tensor") or on their single device. Host inputs are put there too.
        home = params["embed"].sharding
        self._mesh = mesh_of(params)
        check_mesh(cfg, ec, self._mesh)
        dtype = jnp.dtype(ec.block_dtype(params["embed"].dtype))  # prefill blocks (and a dense cache)
        # Scanned programs read the weights stacked, unrolled ones per layer (EngineConfig.scan_layers).
        self._stacked = ec.serves_stacked(next(iter(home.device_set)).platform)
        self._param_shardings = (param_shardings(cfg, self._mesh, split=not self._stacked,
                                                 weight_dtype=ec.weight_dtype)
                                 if self._mesh is not None else None)
        params = self._as_served(params)
        self.compile_counts: collections.Counter[str] = collections.Counter()
        self._stats = EngineStats()
        self._timings = CallTimings()  # seconds per program and shape, for the simulator's cost fit
        self._kv = EngineCache(cfg, ec, dtype, mesh=self._mesh, device=next(iter(home.device_set)),
                               counts=self.compile_counts, stats=self._stats, timings=self._timings)
        self._slots = SlotTable(ec, self._kv, self._stats, self._timings, on_done=self._complete_sample)
        self._rides = self._programs.decode_ride is not None  # swaps re-prefill beside decode
        self._lock = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._admission = Admission(ec, self._slots, self._kv, self._queue, self._lock)
        self._requests: dict[str, Request] = {}
        self._aborts: set[str] = set()
        self._pending_weights: tuple[Params, int, concurrent.futures.Future] | None = None
        self._release: concurrent.futures.Future | None = None  # asked for, not yet done
        self._failure: BaseException | None = None  # what stopped the engine thread, if anything
        self._released = False  # no weights held: nothing decodes or admits until the next swap
        self._ids = itertools.count()
        self._seeds = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._paused = False
        # Shapes and dtypes of the per-layer weights: every later swap must match them (a mismatch
        # would silently compile every program again, at other sizes).
        self._param_avals = weight_layout(params)
        self._params: Params | None = None
        with self._placement():
            self._install_weights(params)

    # ---- public API ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def seed(self) -> int:
        """The base of the per-sample randomness (EngineConfig.seed)."""
        return self.config.seed

    # The cache, its programs and its pages live in `self._kv` (generation/engine_cache.py).
    @property
    def _cache(self):
        return self._kv.cache

    @property
    def _programs(self) -> EnginePrograms:
        return self._kv.programs

    @_programs.setter
    def _programs(self, programs: EnginePrograms) -> None:
        self._kv.programs = programs

    @property
    def _pages(self) -> PageAllocator | None:
        return self._kv.pages

    # The slots and the samples in them live in `self._slots` (generation/slots.py).
    @property
    def _slot_sample(self) -> list[Sample | None]:
        return self._slots.samples

    @property
    def _preempted(self) -> list[Sample]:
        return self._slots.preempted

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
        if prompt.size > self.config.prompt_limit:
            raise ValueError(f"prompt of {prompt.size} tokens is longer than EngineConfig.max_prompt_len = "
                             f"{self.config.max_prompt_len}")
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
            request = Request(rid, prompt.astype(np.int32), sampling, n, future, [None] * n,
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
        """Hands new weights to the engine; the returned future resolves once they are in use.

        `params` stacked or split (see the constructor), of the served weights' shapes and dtypes.
        At the swap the old weights are dropped before the new ones are installed: split weights
        laid out as the engine holds them are used as they are, so a swap holds the old copy and the
        incoming one, never more; stacked weights are split after the old copy is gone (the engine
        then holds the split copy while the caller may still hold the stacked one). With
        EngineConfig.weight_dtype set, weights not yet quantized are quantized here, on the
        caller's thread (a push quantizes them on the way instead: parallel/weight_sync.py)."""
        params = self._as_served(params)
        problem = layout_mismatch(weight_layout(params), self._param_avals)
        if problem:  # here, on the caller's thread: the engine thread would fail every request
            raise ValueError(f"new weights do not match the served ones ({problem}); stacked or split weights "
                             "of the same model and dtype are expected")
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._failure is not None:  # nothing would ever install them
                done.set_exception(self._failure)
                return done
            if self._pending_weights is not None:  # a newer push supersedes one not yet applied
                self._pending_weights[2].set_result(False)
            self._pending_weights = (params, int(version), done)
            self._lock.notify_all()
        return done

    def release_weights(self) -> concurrent.futures.Future:
        """Drops the served weights at the next chunk boundary; the future resolves once they are gone.

        In-flight samples keep their slots and cache; nothing is admitted or decoded until the next
        `update_weights` installs weights (then, as after any swap, in-flight histories are
        re-prefilled or kept by `on_swap`). A non-interruptible engine lets its in-flight samples
        finish first. Without a driving thread this call runs one scheduling round (`step`), which
        drops them at once unless in-flight samples must finish first (later rounds then do)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._failure is not None:  # nothing would ever drop them
                done.set_exception(self._failure)
                return done
            if self._release is not None:
                self._release.set_result(False)  # superseded by this call
            self._release = done
            self._lock.notify_all()
        if self._thread is None:
            self.step()
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
        if self._params is None:
            raise RuntimeError("the engine holds no weights: released for a push (release_weights) "
                               "and not yet given new ones (update_weights)")
        return stack_layers(self._params) if not self._stacked else jax.tree.map(jnp.copy, self._params)

    def stats(self) -> EngineStats:
        with self._lock:
            s = dataclasses.replace(self._stats)
            s.queued_requests = len(self._queue)
        s.kv_pages_shared = self._pages.shared_pages if self._pages is not None else 0
        s.active_slots = sum(x is not None for x in self._slot_sample)
        return s

    def timings(self) -> dict:
        """Wall time of every call so far by program and shape (generation/timings.py)."""
        return self._timings.snapshot()

    def has_work(self) -> bool:
        with self._lock:
            if self._released and self._pending_weights is None:  # waiting for weights: only aborts to do
                return bool(self._aborts)
            return bool(self._queue or self._aborts or self._pending_weights or self._release
                        or not self._slots.idle())

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
            self._slots.drain()
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
                    idle = not (self._queue or self._aborts or self._pending_weights or self._release)
                    if (idle or self._paused or self._released) and not self._stop_event.is_set():
                        self._lock.wait(timeout=0.1)

    def step(self) -> bool:
        """One scheduling round: aborts, weight swap, refill free slots, one decode chunk.

        Returns whether work remains (False while paused).
        """
        if self._paused:
            self._slots.drain()
            self._maybe_release_weights()  # a push of the colocated baseline lands while paused
            return False
        with self._placement():
            with self._lock:
                sync = bool(self._aborts) or self._pending_weights is not None or self._release is not None
            if sync:  # aborts and swaps act on every token dispatched so far (the chunk in flight read first)
                self._slots.drain()
            self._apply_aborts()
            # A release before a swap: weights pushed after a release land after it, never dropped by it.
            draining = self._maybe_release_weights() or self._maybe_swap_weights()
            if self._released:
                return self.has_work()
            self._slots.resume_preempted(self._params, self._version)  # in flight already: resumed even while draining for a swap
            if not draining and not self._preempted:
                self._admit()
            if self._slots.busy():
                self._decode_chunk()
            else:
                self._slots.drain()
        return self.has_work()

    def _placement(self):
        """Activation sharding rules of the generation mesh (traced into the programs)."""
        return activation_rules(GENERATION_RULES, self._mesh) if self._mesh is not None else contextlib.nullcontext()

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            for rid in aborts:
                req = self._requests.get(rid)
                if req is not None:
                    req.aborted = True
                    if req in self._queue:
                        self._queue.remove(req)
        self._slots.abort_requests()
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
        active = self._slots.running()
        if (active or self._preempted) and not self.config.interruptible:
            return True  # let in-flight samples finish on the old weights first
        params, version, done = pending
        with self._lock:
            self._pending_weights = None
            for req in self._queue:  # queued groups' prefill blocks hold old-weight keys and values
                req.prefix = None
        del pending
        self._install_weights(params)
        self._released = False
        del params  # the caller's reference, if any, is the only one left
        self._version = version
        self._stats.weight_swaps += 1
        # Interrupted samples: recompute their KV cache from prompt + tokens so far (all but the
        # last token, which is the next decode input) under the new weights, in batched calls;
        # with on_swap "keep" they continue on the KV the old weights wrote.
        # With re-prefill beside decode, the decode steps carry the longest histories instead.
        if self.config.on_swap == "recompute":
            ride, packed = self._slots.split_for_rides(active) if self._rides else ([], active)
            self._slots.pause_for_reprefill(ride)
            if packed:
                self._kv.recompute(self._params, {slot: self._slot_sample[slot].history() for slot in packed},
                                   {slot: self._slot_sample[slot].request.request_id for slot in packed})
        done.set_result(True)
        return False

    def _maybe_release_weights(self) -> bool:
        """Drops the weights if asked and allowed now; returns True while draining to release them."""
        with self._lock:
            release = self._release
        if release is None:
            return False
        if (self._slots.running() or self._preempted) and not self.config.interruptible:
            return True  # in-flight samples finish on the old weights first, as for a swap
        self._params = None  # a running program keeps its own reference until it ends
        self._released = True
        with self._lock:
            self._release = None
            for req in self._queue:  # their prefill blocks hold the dropped weights' keys and values
                req.prefix = None
        release.set_result(True)
        return False

    def _as_served(self, params: Params) -> Params:
        """`params` in the served weights' storage (EngineConfig.weight_dtype)."""
        quantized = quantize.is_quantized(params)
        if self.config.weight_dtype and not quantized:
            return quantize.quantize_params(params, self.config.weight_dtype)
        return params

    def _install_weights(self, params: Params) -> None:
        """Makes `params` (stacked or split) the served weights, holding at most two copies: the
        old weights are released first (a running program keeps its own reference until it ends)."""
        if self._mesh is None:  # on the engine's device (a put only if they are elsewhere)
            params = placed_like(params, jax.tree.map(lambda _: self._kv.inputs_sharding, params))
        self._params = None
        if isinstance(params["layers"], tuple) != self._stacked:  # already served so: used as they lie
            self._params = params if self._mesh is None else placed_like(params, self._param_shardings)
        else:
            self._params = self._programs.split(params)

    # ---- admission (generation/admission.py) ---------------------------------------------------

    def _admit(self) -> None:
        self._admission.admit(self._params, self._version)

    # ---- decoding ------------------------------------------------------------------------------

    def _decode_chunk(self) -> None:
        with self._lock:
            waiting = bool(self._queue)
        self._slots.decode_chunk(self._params, self._version, waiting)

    # ---- finishing -----------------------------------------------------------------------------

    def _complete_sample(self, sample: Sample, reason: StopReason) -> None:
        """Records a sample the slots are done with; its request completes with its last sample."""
        req = sample.request
        req.results[sample.index] = Completion(
            np.asarray(sample.tokens, np.int32), np.asarray(sample.logprobs, np.float32),
            np.asarray(sample.versions, np.int32), reason, sample.moe_routing())
        if reason == "aborted":
            self._stats.aborted_samples += 1
        else:
            self._stats.finished_samples += 1
        self._maybe_complete(req)

    def _maybe_complete(self, req: Request) -> None:
        if any(r is None for r in req.results):
            return
        with self._lock:
            self._requests.pop(req.request_id, None)
        try:
            req.future.set_result(GroupResult(req.request_id, req.prompt, list(req.results)))
        except concurrent.futures.InvalidStateError:
            pass  # the caller cancelled the future; the samples are simply dropped

    def _fail_all(self, error: BaseException) -> None:
        """The engine thread died: every request, and a push or release waiting for a chunk
        boundary (a trainer blocks on those), fails with `error`, and so does any asked later."""
        with self._lock:
            self._failure = error
            futures = [req.future for req in self._requests.values()]
            self._requests.clear()
            self._queue.clear()
            if self._pending_weights is not None:
                futures.append(self._pending_weights[2])
                self._pending_weights = None
            if self._release is not None:
                futures.append(self._release)
                self._release = None
        for future in futures:
            try:
                future.set_exception(error)
            except concurrent.futures.InvalidStateError:
                pass
