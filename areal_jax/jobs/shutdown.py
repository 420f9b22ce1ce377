"""A preemption notice (SIGTERM on TPU VMs and SLURM, or SIGINT) turned into a clean stop of the RL
loop: the step in progress finishes (or, still waiting for its batch, is abandoned), a save in
flight completes, the last completed step is checkpointed, then the signal takes its usual course
(`areal-jax` exits 143 / 130), all within CheckpointConfig.save_on_signal_s.

Until `StopRequest.arm` (loading, SFT, held-out checks) a signal acts as before: it is raised at once.
Inside, the first signal only sets the request; a second one, or the deadline, raises the signal at
once (every `finally` still runs), and if the main thread is stuck in native code past the
deadline by HARD_EXIT_GRACE_S, the process ends with os._exit (the reward pool's processes die with
it: parent-death signals and the subreapers of reward/containment.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

HARD_EXIT_GRACE_S = 15.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Set by the first SIGTERM/SIGINT inside `graceful_stop`; the loop polls `requested`."""

    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._timers: list[threading.Timer] = []

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _on_signal(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: stop now
            self._restore()
            signal.raise_signal(signum)
            return
        self.signum = signum
        print(f"areal-jax: {signal.Signals(signum).name}: finishing the current step and saving a checkpoint "
              f"(within {self.deadline_s:.0f} s; a second signal stops at once)", file=sys.stderr, flush=True)
        self._timers = [threading.Timer(self.deadline_s, self._deadline),
                        threading.Timer(self.deadline_s + HARD_EXIT_GRACE_S, os._exit, (128 + signum,))]
        for t in self._timers:
            t.daemon = True
            t.start()

    def _deadline(self) -> None:
        print(f"areal-jax: no checkpoint within CheckpointConfig.save_on_signal_s = {self.deadline_s:.0f} s: "
              "stopping without it", file=sys.stderr, flush=True)
        signal.raise_signal(self.signum)  # handled on the main thread as a second signal (handlers are set there)

    def arm(self) -> None:
        """From now on until the `stop_on_signal` block ends, a signal is a stop request."""
        for s in _SIGNALS:
            self._previous[s] = signal.signal(s, self._on_signal)

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def finish(self) -> None:
        """After the stop's checkpoint: the signal takes its course as if it came now (the CLI's
        handlers turn it into exit 143 / 130)."""
        for t in self._timers:
            t.cancel()
        self._restore()
        if self.signum is not None:
            signal.raise_signal(self.signum)


@contextlib.contextmanager
def stop_on_signal(deadline_s: float | None) -> Iterator[StopRequest | None]:
    """A StopRequest to `arm` within the body (its handlers are removed when the body ends); None
    (signals act as before) when `deadline_s` is None or this is not the main thread (only it may
    set handlers)."""
    if deadline_s is None or threading.current_thread() is not threading.main_thread():
        yield None
        return
    stop = StopRequest(deadline_s)
    try:
        yield stop
    finally:
        for t in stop._timers:
            t.cancel()
        if stop._previous:
            stop._restore()
