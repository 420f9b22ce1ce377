"""A stop request (jobs/shutdown.py turns SIGTERM/SIGINT into one) as the RL loop polls it: between
steps, where every process must agree, and, with one process, while the trainer waits for a batch
(the step, not yet begun, is then abandoned). The loop then ends early; its "end" hooks write the
last completed step's checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from areal_jax.parallel.distributed import agree_max

__all__ = ["StopPolling"]


class StopPolling:
    """Polls `requested()` (None: a run that never stops early); `stopped` once a poll said stop."""

    def __init__(self, requested: Callable[[], bool] | None = None):
        self.requested = requested
        self.stopped = False

    def between_steps(self) -> bool:
        """Whether to stop now; with several processes all agree (a collective: call it on every one)."""
        if self.requested is None:
            return False
        stop = bool(self.requested())
        if jax.process_count() > 1:
            stop = bool(agree_max(int(stop)))
        self.stopped = self.stopped or stop
        return stop

    def while_waiting(self) -> bool:
        """Whether to give up the batch being waited for: with one process only (several agree
        between steps only, where every one polls)."""
        return jax.process_count() == 1 and self.between_steps()
