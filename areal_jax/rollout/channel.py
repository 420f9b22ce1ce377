"""The bounded, thread-safe hand-off of finished prompt groups from rollout to trainer.

Order: the trainer takes the *oldest* groups first, oldest meaning the smallest
`admitted_version`, ties broken by arrival order. Oldest-first is what lets the staleness
bound in areal_jax.rollout.controller hold at training time: a group can only be overtaken
by groups admitted no later than itself.

Backpressure: `put` blocks while `capacity_groups` groups are waiting, so a trainer that
falls behind slows the producer instead of growing memory without bound.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

from areal_jax.api import TrajectoryGroup

__all__ = ["ChannelClosed", "TrajectoryChannel"]


class ChannelClosed(RuntimeError):
    """The channel was closed: no more puts, and a get that cannot be served will not be."""


class TrajectoryChannel:
    """Bounded queue of `TrajectoryGroup`s, served oldest first (admitted_version, then arrival).

    Args:
        capacity_groups: most groups held at once (>= 1); `put` blocks beyond it.
    """

    def __init__(self, capacity_groups: int) -> None:
        if isinstance(capacity_groups, bool) or not isinstance(capacity_groups, int) or capacity_groups < 1:
            raise ValueError(f"TrajectoryChannel capacity_groups must be an int >= 1, got {capacity_groups!r}")
        self.capacity = capacity_groups
        self._heap: list[tuple[int, int, TrajectoryGroup]] = []  # (admitted_version, arrival, group)
        self._arrivals = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    # ---- producer side ------------------------------------------------------------------------

    def put(self, group: TrajectoryGroup, timeout: float | None = None) -> None:
        """Add `group`, waiting while the channel is full.

        Raises TimeoutError if still full after `timeout` seconds, ChannelClosed if closed.
        """
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"TrajectoryChannel.put takes a TrajectoryGroup, got {type(group).__name__}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and len(self._heap) >= self.capacity:
                if not self._wait(deadline):
                    raise TimeoutError(f"TrajectoryChannel full ({self.capacity} groups) for {timeout} s")
            if self._closed:
                raise ChannelClosed("put on a closed TrajectoryChannel")
            self._push(group)

    def try_put(self, group: TrajectoryGroup) -> bool:
        """Add `group` if there is room now; return whether it was added. ChannelClosed if closed."""
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"TrajectoryChannel.try_put takes a TrajectoryGroup, got {type(group).__name__}")
        with self._cond:
            if self._closed:
                raise ChannelClosed("put on a closed TrajectoryChannel")
            if len(self._heap) >= self.capacity:
                return False
            self._push(group)
            return True

    # ---- consumer side ------------------------------------------------------------------------

    def get_batch(self, batch_size: int, timeout: float | None = None) -> list[TrajectoryGroup]:
        """Remove and return the `batch_size` oldest groups, waiting until that many are queued.

        Raises TimeoutError after `timeout` seconds (nothing is removed then), ChannelClosed if
        the channel is closed while fewer than `batch_size` groups are queued (those stay
        available through `drain`).
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if batch_size > self.capacity:
            raise ValueError(f"batch_size {batch_size} exceeds the channel capacity {self.capacity}: "
                             "the batch could never fill")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._heap) < batch_size:
                if self._closed:
                    raise ChannelClosed(f"TrajectoryChannel closed with {len(self._heap)} groups queued, "
                                        f"fewer than the batch of {batch_size}")
                if not self._wait(deadline):
                    raise TimeoutError(f"{len(self._heap)}/{batch_size} groups after {timeout} s")
            batch = [heapq.heappop(self._heap)[2] for _ in range(batch_size)]
            self._cond.notify_all()  # room for blocked producers
            return batch

    def drain(self) -> list[TrajectoryGroup]:
        """Remove and return every queued group, oldest first (works after close too)."""
        with self._cond:
            out = [heapq.heappop(self._heap)[2] for _ in range(len(self._heap))]
            self._cond.notify_all()
            return out

    # ---- state --------------------------------------------------------------------------------

    def qsize(self) -> int:
        """Groups queued now."""
        with self._cond:
            return len(self._heap)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Refuse further puts and wake every waiter (they raise ChannelClosed)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _push(self, group: TrajectoryGroup) -> None:
        heapq.heappush(self._heap, (group.admitted_version, next(self._arrivals), group))
        self._cond.notify_all()

    def _wait(self, deadline: float | None) -> bool:
        """Wait for a notification; False once the deadline has passed."""
        if deadline is None:
            self._cond.wait()
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._cond.wait(remaining)
        return True

    def __repr__(self) -> str:
        return f"TrajectoryChannel(capacity_groups={self.capacity}, queued={self.qsize()}, closed={self._closed})"
