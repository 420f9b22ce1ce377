"""What an engine hands back for one request: n `Completion`s in a `GroupResult`."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

__all__ = ["Completion", "GroupResult", "StopReason"]

StopReason = Literal["stop", "length", "aborted"]


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sample: generated `tokens [G]`, behavior `logprobs [G]`, policy `versions [G]`; for a
    MoE model `moe_routing [P + G, L_moe, k]` (uint8/uint16): the experts each input token (prompt
    then completion) was routed to when the engine fed it in, per sparse layer (the last generated
    token, never fed in, has zeros). Like the versions, it is the routing under which each token's
    successor was sampled: a weight swap or preemption re-prefills the cache but keeps the record."""

    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    stop_reason: StopReason
    moe_routing: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """The `n` samples of one request, in submission order of the samples."""

    request_id: str
    prompt_ids: np.ndarray
    completions: list[Completion]
