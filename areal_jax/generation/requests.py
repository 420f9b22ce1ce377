"""What the engine hands out and keeps per request: results, stats, requests and their samples."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Literal

import jax
import numpy as np

from areal_jax.generation.sampling import SamplingParams

StopReason = Literal["stop", "length", "aborted"]


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
    # Samples preempted when the paged KV pool ran dry (recomputed later), counted at each preemption.
    preempted_samples: int = 0

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
    # (KV block [L, R, K, P, H], row of this prompt in it, last-position logits [R, V]): one
    # prefill shared by the group's samples (and by other prompts prefilled in the same call).
    prefix: tuple[Any, int, jax.Array] | None = None
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

    def history(self) -> np.ndarray:
        """Prompt + generated tokens but the last (the next decode input): what a re-prefill writes."""
        return np.concatenate([self.request.prompt, np.asarray(self.tokens[:-1], np.int32)])


class RequestHandle(concurrent.futures.Future):
    """A future for a `GroupResult` that also names its request (for `abort`)."""

    request_id: str


