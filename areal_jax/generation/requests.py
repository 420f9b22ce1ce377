"""What the engine hands out and keeps per request: results, stats, requests and their samples."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import jax
import numpy as np

from areal_jax.api.completions import Completion, GroupResult, StopReason
from areal_jax.api.sampling import SamplingParams

__all__ = ["Completion", "EngineStats", "GroupResult", "Request", "RequestHandle", "Sample", "StopReason"]


@dataclasses.dataclass
class EngineStats:
    generated_tokens: int = 0
    prefill_tokens: int = 0
    reprefill_tokens: int = 0
    # Re-prefilled history tokens computed once for several samples (reprefill_share_prefixes):
    # reprefill_tokens less the trie nodes the packed calls ran.
    reprefill_shared_tokens: int = 0
    # Re-prefilled history tokens the decode steps carried (EngineConfig.reprefill_in_decode_rows).
    reprefill_ride_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    busy_slot_steps: int = 0  # sum over decode steps of slots that were generating
    chunks: int = 0
    # Chunks dispatched while the last one was still in flight (EngineConfig.overlap).
    overlapped_chunks: int = 0
    weight_swaps: int = 0
    finished_samples: int = 0
    aborted_samples: int = 0
    queued_requests: int = 0
    active_slots: int = 0
    # Samples preempted when the paged KV pool ran dry (recomputed later), counted at each preemption.
    preempted_samples: int = 0
    # Page references a group's samples shared instead of taking pages (paged; a prompt's full pages).
    kv_pages_shared: int = 0

    @property
    def tokens_per_s(self) -> float:
        busy = self.prefill_s + self.decode_s
        return self.generated_tokens / busy if busy else 0.0

    @property
    def slot_occupancy(self) -> float:
        return self.busy_slot_steps / self.decode_steps if self.decode_steps else 0.0


@dataclasses.dataclass
class Request:
    """A queued or running prompt of `n` samples."""

    request_id: str
    prompt: np.ndarray  # [P] int32
    sampling: SamplingParams
    n: int
    future: concurrent.futures.Future
    results: list[Completion | None]
    next_sample: int = 0  # samples [0, next_sample) have been inserted
    # (KV block [L, R, K, P, H], row of this prompt in it, last-position logits [R, V], the prompt's
    # experts [P, L_moe, k] or None): one prefill shared by the group's samples (and by other
    # prompts prefilled in the same call).
    prefix: tuple[Any, int, jax.Array, np.ndarray | None] | None = None
    aborted: bool = False
    seed: int = 0


@dataclasses.dataclass
class Sample:
    """An in-flight sample: what it generated so far, and when it first started (its priority:
    the most recently started is preempted first, preempted ones resume oldest first)."""

    request: Request
    index: int
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    stamp: int = 0
    # MoE: the experts of the input tokens fed in so far, in order (`[n_i, L_moe, k]` pieces: the
    # prompt's from its prefill, then each decode chunk's); None for a dense model.
    routing: list[np.ndarray] | None = None

    def moe_routing(self) -> np.ndarray | None:
        """The record `[P + G, L_moe, k]`: every input token but the last generated one (never fed
        in: zeros) was routed once, by the program that sampled its successor."""
        if self.routing is None:
            return None
        fed = np.concatenate(self.routing)
        expected = self.request.prompt.size + len(self.tokens) - 1
        if len(fed) != expected:
            raise AssertionError(f"sample {self.request.request_id}/{self.index} recorded the routing of "
                                 f"{len(fed)} input tokens, {expected} were fed in")
        return np.concatenate([fed, np.zeros((1, *fed.shape[1:]), fed.dtype)])

    def history(self) -> np.ndarray:
        """Prompt + generated tokens but the last (the next decode input): what a re-prefill writes."""
        return np.concatenate([self.request.prompt, np.asarray(self.tokens[:-1], np.int32)])


class RequestHandle(concurrent.futures.Future):
    """A future for a `GroupResult` that also names its request (for `abort`)."""

    request_id: str


