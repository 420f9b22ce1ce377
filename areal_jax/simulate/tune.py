"""The search of `areal-jax simulate --tune`, apart from what it searches: candidate points, a
memory verdict for each (`fits`) and a score for those that fit (`evaluate`, trained tokens/s).

Two stages, because the knobs are not equally coupled: the split and the micro-batch budget
decide between them how training and generation share the devices (each changes which side
bounds the step), so every fitting pair of them is simulated (stage one); the engine's slots and
KV pool and eta then refine the best few pairs (stage two), each pair against its own options.
A point is simulated at most once; a point that does not fit is never simulated.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class Knobs:
    """One candidate point.

    Attributes:
        generation_devices: generation devices per host (the split); with `colocated` every
            device does both and this is the host's devices.
        colocated: the sides share the devices (MeshConfig.colocated), a split the tune also tries.
        budget: the trainer's max_tokens_per_microbatch (its meaning, per process or per
            device, is the trainer's: the simulator and the planner batch with the trainer's code).
        slots: EngineConfig.num_slots per host.
        pool_bytes: EngineConfig.kv_pool_bytes per generation replica (0: the engine's default).
        eta: RLConfig.max_staleness.
        max_concurrent: RLConfig.max_concurrent (groups in flight per host).
        kv_dtype: EngineConfig.kv_dtype ("": the config's own).
    """

    generation_devices: int
    budget: int
    slots: int
    pool_bytes: int
    eta: int
    max_concurrent: int
    colocated: bool = False
    kv_dtype: str = ""

    def __post_init__(self):
        if not isinstance(self.kv_dtype, str):
            raise ValueError(f"Knobs.kv_dtype must be a str ('' for the config's), got {self.kv_dtype!r}")
        for name in ("generation_devices", "budget", "slots", "max_concurrent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Knobs.{name} must be an int >= 1, got {value!r}")
        for name in ("pool_bytes", "eta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Knobs.{name} must be an int >= 0, got {value!r}")


class FitLike(Protocol):
    fits: bool
    peak_fraction: float
    tightest: str
    source: str


@dataclasses.dataclass(frozen=True)
class Point:
    """A simulated point: its score (trained tokens/s), what its memory verdict rests on, and the
    simulator's row."""

    knobs: Knobs
    trained_tokens_per_s: float
    fit: FitLike
    stage: int
    row: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass(frozen=True)
class SearchResult:
    points: tuple[Point, ...]  # best first
    refused: tuple[tuple[Knobs, FitLike], ...]  # did not fit: never simulated
    seconds: float

    @property
    def best(self) -> Point | None:
        return self.points[0] if self.points else None


def search(first: Iterable[Knobs], refine: Callable[[Knobs], Iterable[Knobs]], *,
           fits: Callable[[Knobs], FitLike], evaluate: Callable[[Knobs], tuple[float, dict[str, Any]]],
           keep: int = 3) -> SearchResult:
    """Stage one: every fitting point of `first`. Stage two: every fitting point of `refine(k)`
    for the `keep` best of stage one. Returns every simulated point, best first (ties: the
    earlier candidate)."""
    t0 = time.monotonic()
    verdicts: dict[Knobs, FitLike] = {}
    scored: dict[Knobs, Point] = {}

    def consider(k: Knobs, stage: int) -> None:
        if k in verdicts:
            return
        verdicts[k] = fit = fits(k)
        if fit.fits:
            score, row = evaluate(k)
            scored[k] = Point(k, float(score), fit, stage, row)

    for k in first:
        consider(k, 1)
    leaders = _ranked(scored.values())[:keep]
    for leader in leaders:
        for k in refine(leader.knobs):
            consider(k, 2)
    refused = tuple((k, f) for k, f in verdicts.items() if not f.fits)
    return SearchResult(points=tuple(_ranked(scored.values())), refused=refused, seconds=time.monotonic() - t0)


def _ranked(points: Iterable[Point]) -> list[Point]:
    points = list(points)
    order = {id(p): i for i, p in enumerate(points)}
    return sorted(points, key=lambda p: (-p.trained_tokens_per_s, order[id(p)]))


def powers_of_two_between(low: int, high: int) -> list[int]:
    out, v = [], 1
    while v <= high:
        if v >= low:
            out.append(v)
        v *= 2
    return out


def budget_candidates(longest_row: int, configured: int, *, span: int = 8) -> list[int]:
    """Micro-batch budgets from the row holding the longest sequence (a smaller budget never
    trains one) to `span` times it: that row, the powers of two between, and the config's own."""
    values = {longest_row, configured, *powers_of_two_between(longest_row, span * longest_row)}
    return sorted(v for v in values if v >= longest_row)


def distinct(items: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out
