"""The simulated clock: callbacks ordered by time, ties in the order they were scheduled."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class Event:
    """A scheduled callback; `cancel()` makes the queue skip it."""

    __slots__ = ("time", "callback", "cancelled")

    def __init__(self, time: float, callback: Callable[[], None]) -> None:
        self.time = time
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventQueue:
    """Discrete-event loop. `now` is the time of the callback running (seconds from the start)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Event]] = []
        self._order = itertools.count()

    def at(self, time: float, callback: Callable[[], None]) -> Event:
        if time < self.now:
            raise ValueError(f"cannot schedule at {time} before now ({self.now})")
        event = Event(time, callback)
        heapq.heappush(self._heap, (time, next(self._order), event))
        return event

    def after(self, delay: float, callback: Callable[[], None]) -> Event:
        return self.at(self.now + max(0.0, delay), callback)

    def run(self, done: Callable[[], bool]) -> None:
        """Runs callbacks until `done()`; a RuntimeError if nothing is left to run before that."""
        while not done():
            if not self._heap:
                raise RuntimeError("the simulated system stalled: no event left and the run is not finished")
            time, _, event = heapq.heappop(self._heap)
            if event.cancelled:
                continue
            self.now = time
            event.callback()
