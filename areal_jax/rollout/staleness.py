"""Staleness-bounded admission control for asynchronous rollouts (AReaL's eta).

Units are prompt *groups* (one prompt and its n sampled answers), because the trainer
consumes groups: a batch is `batch_size` accepted groups.

Counters:
    submitted  groups ever admitted (on_submit)
    running    admitted and not yet finished
    accepted   finished and handed to the trainer
    rejected   finished but dropped (filtered, failed, timed out)
Invariant: submitted == accepted + rejected + running.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping

_COUNTER_KEYS = ("submitted", "running", "accepted", "rejected")


@dataclasses.dataclass(frozen=True)
class StalenessStats:
    """A consistent snapshot of the admission counters (all in prompt groups)."""

    submitted: int
    running: int
    accepted: int
    rejected: int


def _check_non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def admission_version(trainer_version: int, served_version: int) -> int:
    """The version a group is admitted at: the trainer's, but never ahead of the weights the engine
    serves, so every token of a group admitted at u has version >= u whatever the order of the
    trainer's "bump version" and "push weights"."""
    return min(int(trainer_version), int(served_version))


class StalenessManager:
    """Thread-safe admission control bounding how far rollouts run ahead of training.

    A new group may start only while `capacity(version) > 0`, where `version` is the
    current policy version (number of completed trainer updates) and

        capacity(v) = min(max_concurrent - running,
                          (max_staleness + v + 1) * batch_size - (accepted + running))

    What this guarantees (eta = max_staleness, B = batch_size, "admitted at u" = the
    policy version when on_submit was called, a lower bound of the versions of that
    group's tokens since interrupted generation only moves tokens to newer weights):

    * Volume bound: for every version u, at most (eta + u + 1) * B groups admitted at a
      version <= u are ever accepted. A trainer that consumes B accepted groups per
      version therefore trains, through version v, at most (v - eta) * B groups admitted
      before version v - eta; and the newest admission among all groups trained at
      versions <= v is at least v - eta.
    * Per-group bound: if groups are accepted in the order they were admitted (equal
      generation times, or the trainer consuming oldest-admitted first and groups
      finishing in order), every group trained at version v was admitted at a version
      >= v - eta.
    * eta = 0 is synchronous RL, unconditionally: every group trained at version v was
      admitted at version v (the trainer cannot reach v + 1 while any group admitted
      before it is still running).

    With eta >= 1 and out-of-order completion, one slow group can still be trained more
    than eta versions after its admission: admission control bounds the volume of stale
    data, not the age of a single straggler. Drop or down-weight such groups downstream
    (e.g. the decoupled loss's behavior-importance-weight cap) if that matters.

    Args:
        max_staleness: eta >= 0; 0 means synchronous training.
        batch_size: B >= 1, prompt groups per training step.
        max_concurrent: >= 1, most groups in flight at once (generation slots / group size).
    """

    def __init__(self, max_staleness: int, batch_size: int, max_concurrent: int) -> None:
        self.max_staleness = _check_non_negative_int("max_staleness", max_staleness)
        self.batch_size = _check_non_negative_int("batch_size", batch_size)
        self.max_concurrent = _check_non_negative_int("max_concurrent", max_concurrent)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self._lock = threading.Lock()
        self._submitted = 0
        self._running = 0
        self._accepted = 0
        self._rejected = 0

    def capacity(self, version: int) -> int:
        """Groups that may still be admitted at policy `version` (may be <= 0)."""
        _check_non_negative_int("version", version)
        with self._lock:
            by_concurrency = self.max_concurrent - self._running
            by_staleness = (self.max_staleness + version + 1) * self.batch_size - (
                self._accepted + self._running
            )
        return min(by_concurrency, by_staleness)

    def try_submit(self, version: int) -> bool:
        """Admit one group if capacity(version) > 0, atomically; return whether admitted.

        Use this (not capacity() followed by on_submit()) when several threads admit.
        """
        _check_non_negative_int("version", version)
        with self._lock:
            by_concurrency = self.max_concurrent - self._running
            by_staleness = (self.max_staleness + version + 1) * self.batch_size - (
                self._accepted + self._running
            )
            if min(by_concurrency, by_staleness) <= 0:
                return False
            self._submitted += 1
            self._running += 1
            return True

    def on_submit(self) -> None:
        """Record that a group was admitted and started generating."""
        with self._lock:
            self._submitted += 1
            self._running += 1

    def on_accept(self) -> None:
        """Record that a running group finished and was handed to the trainer."""
        with self._lock:
            if self._running <= 0:
                raise ValueError("on_accept called with no running group")
            self._running -= 1
            self._accepted += 1

    def on_reject(self) -> None:
        """Record that a running group finished but was dropped; frees its capacity."""
        with self._lock:
            if self._running <= 0:
                raise ValueError("on_reject called with no running group")
            self._running -= 1
            self._rejected += 1

    def stats(self) -> StalenessStats:
        """A consistent snapshot of all counters."""
        with self._lock:
            return StalenessStats(
                submitted=self._submitted,
                running=self._running,
                accepted=self._accepted,
                rejected=self._rejected,
            )

    def state_dict(self) -> dict[str, int]:
        """Counters as plain ints, for a checkpoint."""
        return dataclasses.asdict(self.stats())

    def load_state_dict(self, state: Mapping[str, int], *, drop_running: bool = True) -> None:
        """Restore counters saved by state_dict().

        A restored process has no in-flight generation, so by default groups that were
        running at save time are counted as rejected (they will never finish); otherwise
        they would hold capacity forever. Pass drop_running=False to restore verbatim
        (e.g. when the caller re-submits exactly those groups and calls on_accept/on_reject
        for each).
        """
        missing = [k for k in _COUNTER_KEYS if k not in state]
        if missing:
            raise ValueError(f"staleness state is missing keys {missing}")
        values = {k: _check_non_negative_int(f"state[{k!r}]", state[k]) for k in _COUNTER_KEYS}
        if values["submitted"] != values["accepted"] + values["rejected"] + values["running"]:
            raise ValueError(
                f"inconsistent staleness state {values}: submitted must equal "
                "accepted + rejected + running"
            )
        if drop_running:
            values["rejected"] += values["running"]
            values["running"] = 0
        with self._lock:
            self._submitted = values["submitted"]
            self._running = values["running"]
            self._accepted = values["accepted"]
            self._rejected = values["rejected"]

    def resume_at(self, version: int, state: Mapping[str, int] | None = None) -> int:
        """Counters of a run resumed at `version` (updates completed) from a checkpoint's state_dict().

        A restart keeps only what was trained: `version * batch_size` groups. Groups queued for the
        trainer or still generating at the save are gone with the old process, so `accepted` is set
        to the groups trained (as AReaL does), not to the saved count: counting the lost ones would
        cut capacity to `(eta + 1) * B - lost` for the rest of the run (synchronous at worst). The
        saved rejections stay for the record. Returns the number of groups lost (0 without `state`).
        """
        _check_non_negative_int("version", version)
        trained = version * self.batch_size
        rejected, lost = 0, 0
        if state is not None:
            missing = [k for k in _COUNTER_KEYS if k not in state]
            if missing:
                raise ValueError(f"staleness state is missing keys {missing}")
            values = {k: _check_non_negative_int(f"state[{k!r}]", state[k]) for k in _COUNTER_KEYS}
            if values["accepted"] < trained:
                raise ValueError(f"staleness state accepted {values['accepted']} groups, fewer than the "
                                 f"{trained} trained by version {version} at batch_size {self.batch_size}")
            rejected = values["rejected"]
            lost = values["accepted"] - trained + values["running"]
        with self._lock:
            self._submitted = trained + rejected
            self._running = 0
            self._accepted = trained
            self._rejected = rejected
        return lost

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"StalenessManager(max_staleness={self.max_staleness}, batch_size={self.batch_size}, "
            f"max_concurrent={self.max_concurrent}, running={s.running}, accepted={s.accepted}, "
            f"rejected={s.rejected})"
        )
