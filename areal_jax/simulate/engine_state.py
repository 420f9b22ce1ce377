"""What the simulated engine (simulate/generation.py) keeps: its admitted groups, its counters and its
run of decode chunks planned at once."""

from __future__ import annotations

import dataclasses

import numpy as np

from areal_jax.simulate.events import Event


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
    preemptions: int = 0  # paged: samples whose KV was dropped for want of pages
    recomputed_tokens: int = 0  # paged: history tokens prefilled again when they resumed
    live_tokens: int = 0  # paged: cached tokens the decode steps attended over (sum over steps and slots)
    read_tokens: int = 0  # paged: the same rounded up to the kernel's block per slot (what it reads)
    charged_s: float = 0.0  # other programs on these devices (learned rewards beside the engine), in busy_s
    ride_tokens: int = 0  # history tokens re-prefilled beside decode, padding left out (reprefill_tokens: at the swap)


@dataclasses.dataclass
class Segment:
    """Decode chunks planned from `start`: chunk j ends at ends[j]; only the last may finish samples."""

    start: float
    ends: np.ndarray  # [chunks] absolute end times
    steps: np.ndarray  # [chunks]
    slot_steps: np.ndarray  # [chunks]
    windows: np.ndarray  # [chunks]
    active: np.ndarray  # [chunks] active slots at each chunk's start
    event: Event | None = None
    live: np.ndarray | None = None  # [chunks] paged: cached tokens attended over
    read: np.ndarray | None = None  # [chunks] paged: cached tokens the kernel reads
    ride_left: np.ndarray | None = None  # [B] a ride chunk (one chunk): each slot's ride rows left after it
    ride_tokens: int = 0  # a ride chunk: history tokens its rows hold (padding left out)
