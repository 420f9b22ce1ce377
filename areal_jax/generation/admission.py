"""Admission: the engine's queue head into free decode slots, on the host.

One prefill call prefills the prompts of the queue's head requests (one row each, one length
bucket per call), copies each into the slots of its samples and samples their first tokens
(`EngineCache.prefill_start`). A group that found too few free slots keeps its prefill block, and
its later samples start from it (`EngineCache.start_from_block`) as slots free up. Paged: only as
many samples start as the pool has pages for (prompt and first chunk, plus a watermark), the
group's samples sharing its prompt's full pages (generation/pages.py).

The queue is the engine's (generation/engine.py), shared with its `submit` and `abort` under its
lock; the slots and what happens to a started sample are generation/slots.py's.
"""

from __future__ import annotations

import collections
import threading

from areal_jax.generation.config import EngineConfig
from areal_jax.generation.engine_cache import EngineCache
from areal_jax.generation.requests import Request
from areal_jax.generation.slots import SlotTable, Start
from areal_jax.models.transformer import Params


class Admission:
    """Starts queued requests' samples in free slots."""

    def __init__(self, config: EngineConfig, slots: SlotTable, kv: EngineCache, queue: collections.deque[Request],
                 lock: threading.Condition):
        self.config, self._slots, self._kv, self._queue, self._lock = config, slots, kv, queue, lock

    def admit(self, params: Params, version: int) -> None:
        """Fills free slots from the queue head, under weights `params` of `version`."""
        free = self._slots.free()
        while free:
            with self._lock:
                if not self._queue:
                    break
                head = self._queue[0]
            before = len(free)
            if head.prefix is None:
                free = self._prefill_and_start(params, version, free)
            else:  # samples left of a group prefilled when too few slots were free
                free = self._start_from_prefix(head, version, free)
            if len(free) == before:  # nothing started: the pool has no room now
                break

    def _assign(self, req: Request, free: list[int], version: int
                ) -> tuple[list[tuple[int, Request, int]], list[int]]:
        """Gives the request's next samples free slots (and their pages): ([(slot, request, sample
        index)], slots left)."""
        slots, free = self._slots.take(free, req.n - req.next_sample,
                                       self.config.chunk_tokens(req.prompt.size, req.sampling.max_new_tokens - 1),
                                       req, version)
        started = [(slot, req, req.next_sample + j) for j, slot in enumerate(slots)]
        for slot, _, index in started:
            self._slots.set_key(slot, req.seed, index)
        req.next_sample += len(slots)
        if req.next_sample == req.n:
            req.prefix = None  # the group's prefill block is no longer needed
            with self._lock:
                if self._queue and self._queue[0] is req:
                    self._queue.popleft()
        return started, free

    def queue_head_batch(self, free_slots: int, version: int) -> list[Request]:
        """The queued requests, from the head, to prefill in one call: while their samples fit in
        the free slots (and pages), up to the first whose prompt falls in another length bucket (a
        call pads every row to its longest prompt) or that holds a prefill already."""
        pages = self._kv.pages
        budget = pages.admission_budget() if pages is not None else 0
        with self._lock:
            batch, room = [], free_slots
            most = self.config.max_prefill_prompts(self._queue[0].prompt.size, self._kv.data) if self._queue else 0
            for req in self._queue:
                if len(batch) == most or room <= 0 or req.prefix is not None:
                    break
                if batch and self.config.bucket(req.prompt.size) != self.config.bucket(batch[0].prompt.size):
                    break
                want = req.n - req.next_sample
                if pages is not None:  # samples the free pages can start (later ones share the prompt's)
                    need = self._slots.admission_pages(req)
                    prefix = self._slots.prefix(req, version)
                    later = max(1, need - (prefix.pages if prefix is not None else 0))
                    if budget < need:
                        break
                    budget -= need + (min(want, 1 + (budget - need) // later) - 1) * later
                batch.append(req)
                room -= want
        return batch

    def _prefill_and_start(self, params: Params, version: int, free: list[int]) -> list[int]:
        batch = self.queue_head_batch(len(free), version)
        if not batch:
            return free
        plan: list[Start] = []
        for row, req in enumerate(batch):
            started, free = self._assign(req, free, version)
            plan += [(slot, r, index, row) for slot, r, index in started]
        block, logits, tokens, logprobs, routing = self._kv.prefill_start(
            params, [req.prompt for req in batch], self._slots.start_arrays(plan))
        for row, req in enumerate(batch):
            if req.next_sample < req.n:
                req.prefix = (block, row, logits, routing[row])
        for (slot, req, index, row), token, logprob in zip(plan, tokens, logprobs):
            self._slots.start(slot, req, index, int(token), float(logprob), version, routing[row])
        return free

    def _start_from_prefix(self, req: Request, version: int, free: list[int]) -> list[int]:
        block, row, logits, routing = req.prefix
        started, free = self._assign(req, free, version)
        if not started:
            return free
        plan = [(slot, r, index, row) for slot, r, index in started]
        tokens, logprobs = self._kv.start_from_block(block, logits, self._slots.start_arrays(plan), len(plan))
        for (slot, _, index, _), token, logprob in zip(plan, tokens, logprobs):
            self._slots.start(slot, req, index, int(token), float(logprob), version, routing)
        return free
