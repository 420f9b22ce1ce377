"""Wall time of the engine's calls by program and shape, for fitting the simulator's cost model.

Keys are short strings that say the shape ("w128_q2": decode window 128, second quarter of the
slots active at the chunk's start; "len16_rows4": a prefill of 4 rows of 16 tokens). Each key
accumulates plain numbers only, so a snapshot is a valid metrics record:

    decode[key]         = {"steps", "slot_steps", "s"}   (slot_steps: active slots summed over steps)
    decode_ride[key]    = {"steps", "slot_steps", "s"}   decode chunks carrying re-prefill rows
    prefill[key]        = {"calls", "tokens", "s"}       admission: prefill + scatter + first tokens
    insert[key]         = {"calls", "s"}                 later samples of a group from its kept block
    reprefill[key]      = {"calls", "tokens", "s"}       packed re-prefill after a swap ("rows4")
    reprefill_long[key] = {"calls", "tokens", "s"}       long histories by length bucket

Recording is a dictionary update per call: nothing here touches a device.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Mapping

KINDS = ("decode", "decode_ride", "prefill", "insert", "reprefill", "reprefill_long")


def decode_key(window: int, active: int, num_slots: int) -> str:
    """Window and the quarter of the slots (1..4) that were active when the chunk started."""
    quarter = min(4, max(1, -(-4 * active // max(num_slots, 1))))
    return f"w{window}_q{quarter}"


def shape_key(rows: int, length: int | None = None) -> str:
    return f"rows{rows}" if length is None else f"len{length}_rows{rows}"


class CallTimings:
    """Thread-safe accumulator of (kind, key) -> {field: sum}."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: dict[str, dict[str, collections.Counter]] = {k: {} for k in KINDS}

    def add(self, kind: str, key: str, **amounts: float) -> None:
        if kind not in self._table:
            raise ValueError(f"unknown call kind {kind!r}; one of {KINDS}")
        with self._lock:
            self._table[kind].setdefault(key, collections.Counter()).update(amounts)

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        with self._lock:
            return {kind: {key: dict(c) for key, c in rows.items()} for kind, rows in self._table.items()}


def timings_delta(now: Mapping, before: Mapping | None) -> dict:
    """`now - before` of two snapshots, keys whose counts did not change left out."""
    out: dict = {}
    for kind, rows in now.items():
        prev = (before or {}).get(kind, {})
        kept = {}
        for key, fields in rows.items():
            old = prev.get(key, {})
            diff = {f: v - old.get(f, 0) for f, v in fields.items()}
            if any(diff.values()):
                kept[key] = diff
        if kept:
            out[kind] = kept
    return copy.deepcopy(out)
