"""The rollout controller: staleness-bounded admission, workflows as asyncio tasks, hand-off.

One thread runs an asyncio event loop. It admits prompt rows from `data_iter` while the
StalenessManager has capacity (`try_submit`, so check and count are one atomic step), runs
each admitted row's `workflow.arun` as a task (generation happens on the engine's own
thread, rewards in the reward pool or a small thread pool: the loop only awaits), and
settles every finished group exactly once:

    accepted  kept by every filter; `on_accept`, then queued for the channel in acceptance order
    rejected  workflow returned None ("workflow"), a filter named a reason, or "stale"; `on_reject`
    failed    the workflow raised (reward error, aborted generation...); logged with the
              row's source, `on_reject`. `max_failures_in_a_row` failures with nothing else
              finishing in between stop admission: `check()` raises RolloutsFailed naming the
              first one
    in flight still running at shutdown: cancelled (engine request aborted), `on_reject`

so `admitted == accepted + sum(rejected) + failed + in_flight` holds exactly in the
ShutdownReport. Accepted groups wait in an outbox until the (bounded) channel has room; one
pump moves them in acceptance order without ever blocking the loop.

Versions. The admission version is `min(version_fn(), engine.version)`: the trainer's
version, but never ahead of the weights the engine actually serves, so every token of a
group admitted at u has version >= u whatever the order of "bump version" and "push
weights" in the trainer. Give the engine the right starting version when resuming.

What bounds the age of trained tokens (eta = staleness.max_staleness, B = its batch_size).
Assume the trainer takes groups only from this channel (oldest first), and that its version
when it takes a batch is at most (groups it took before) / B, as with one version bump per
batch of B. Let G be accepted when `version_fn()` read v_a, and taken at trainer version v_t.

* v_t <= v_a + eta. Proof: admissions keep accepted + running <= (eta + u + 1) * B at the
  admission version u <= v_a, and neither accepting nor a later version raises the left
  side beyond that; so when G is accepted, (groups accepted before G) + (groups still
  running) <= (eta + v_a + 1) * B - 1. A group taken before G either reached the channel
  before G (accepted before G: the pump keeps acceptance order) or sorted before G when
  taken, i.e. was admitted before G and so was running when G was accepted. Hence
  v_t * B <= (eta + v_a + 1) * B - 1.
* With `max_group_age = K`, a group is accepted only if its oldest token has
  version >= v_a - K (`is_too_stale(group, v_a, K)` is False). Then every trained token
  lags at most v_t - oldest <= eta + K versions. Without K, a straggler (admitted long ago,
  finished late) has no per-group bound: admission limits the volume of stale data only.
* eta = 0: v_t = v_a and every token of every trained group has version v_t (synchronous).
* The trainer (`trainer/loop.py`) does not check again when it takes a batch: staleness is
  controlled where AReaL controls it, at admission and (with K) at acceptance, and eta + K is
  the bound a run guarantees. Dropping groups at training time would throw away finished
  generation and give the processes of a run batches of different sizes. `is_too_stale` is
  pure, so a trainer that wants the exact bound K can apply `is_too_stale(group, v_t, K)` to
  each batch it takes (tests/test_rollout_controller.py does, to check both bounds).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from areal_jax import api
from areal_jax.rollout.channel import ChannelClosed, TrajectoryChannel
from areal_jax.rollout.filters import GroupFilter, is_too_stale
from areal_jax.rollout.staleness import StalenessManager, admission_version
from areal_jax.api import TrajectoryGroup
from areal_jax.rollout.workflow import (Detokenizer, RolloutClient, RolloutWorkflow, missing_workflow_members,
                                       row_source)

__all__ = ["ControllerStats", "RolloutController", "RolloutsFailed", "ShutdownReport"]

logger = logging.getLogger(__name__)

# While the channel is full the pump retries a blocking put with this timeout, so that a
# shutdown is noticed quickly and a put never completes after the pump gave up on it.
_PUT_RETRY_S = 0.05
# Shutdown: how long cancelled groups get to end, and how often one that swallowed it is cancelled again.
_CANCEL_GRACE_S = 5.0
_RECANCEL_S = 0.5
# Groups failed in a row (none finished otherwise in between) that stop admission: at least a
# step's worth, and enough that rows failing now and then (1 in 2 would make a streak this long
# once in 4e9) never stop a run that learns.
_MIN_FAILURE_STREAK = 32


class RolloutsFailed(RuntimeError):
    """Every rollout of at least a step's worth failed in a row: the message names the first error."""


@dataclasses.dataclass(frozen=True)
class ControllerStats:
    """A snapshot of the controller's counters (all in prompt groups)."""

    admitted: int
    accepted: int
    rejected: dict[str, int]
    failed: int
    failed_by_error: dict[str, int]
    in_flight: int
    peak_in_flight: int
    outbox: int  # accepted, waiting for room in the channel
    channel_depth: int
    paused: bool
    data_exhausted: bool
    admission_version: int  # version used by the latest admission (-1: none yet)
    generation_tokens_per_s: float
    error: str | None
    # Over every finished group, accepted or rejected by a filter (the accepted ones alone are
    # biased: the all-equal filter drops groups that are all right or all wrong).
    finished_trajectories: int = 0
    finished_reward_sum: float = 0.0
    # Samples the engine preempted so far (paged KV pool dry; recomputed later).
    generation_preempted_samples: int = 0
    # History tokens the engine re-prefilled so far (weight swaps under on_swap "recompute", resumed
    # preemptions).
    generation_reprefill_tokens: int = 0
    # Of those, tokens a shared prefix spared recomputing (EngineConfig.reprefill_share_prefixes).
    generation_reprefill_shared_tokens: int = 0
    # Of those, tokens the decode steps carried (EngineConfig.reprefill_in_decode_rows).
    generation_reprefill_ride_tokens: int = 0
    # KV pages the engine's groups shared so far (their prompts' full pages, paged layout).
    generation_kv_pages_shared: int = 0

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


@dataclasses.dataclass(frozen=True)
class ShutdownReport:
    """Where every admitted group ended: accepted (of which `queued` were not yet taken by
    the trainer: in the outbox or the channel), rejected by reason, failed, or in flight."""

    admitted: int
    accepted: int
    rejected: dict[str, int]
    failed: int
    in_flight: int
    queued: int
    failed_by_error: dict[str, int]
    error: str | None = None

    @property
    def balanced(self) -> bool:
        """admitted == accepted + rejected + failed + in_flight."""
        return self.admitted == self.accepted + sum(self.rejected.values()) + self.failed + self.in_flight


class RolloutController:
    """Keeps the generation engine busy with admitted prompt groups and feeds the channel.

    Args:
        engine: a started api.InferenceEngine (its own thread drives it), e.g. GenerationEngine.
        workflow: RLVRWorkflow or any object with `async def arun(client, row, *, version)`
            (optionally `reject_reason(group) -> str | None`).
        staleness: admission control; its counters are updated here.
        channel: where accepted groups go (the trainer reads it).
        data_iter: iterator of loader examples ({"prompt_ids", "row"}).
        version_fn: the trainer's current policy version (thread-safe, non-decreasing).
        tokenizer: decodes completions for rewards (may be None if the workflow never decodes).
        reward_pool: a RewardPool, or None for in-process rewards.
        max_concurrent: most groups in flight (default: staleness.max_concurrent).
        filters: extra group filters, `group -> reason | None`, applied after the workflow's.
        max_group_age: K; reject at acceptance groups whose oldest token is more than
            K versions behind `version_fn()` (reason "stale"). None: no such check.
        max_failures_in_a_row: stop admitting (and `check()` raises RolloutsFailed with the
            first one's error) once this many groups in a row failed with none accepted or
            rejected in between: a reward or workflow that fails on every row would otherwise be
            retried on row after row until the trainer's batch deadline. None: the larger of
            the staleness batch size and 32.
        poll_interval_s: how often the loop re-reads version_fn when nothing else wakes it
            (`notify()` wakes it at once).
    """

    def __init__(self, engine: api.InferenceEngine, workflow: api.RolloutWorkflow, staleness: StalenessManager,
                 channel: TrajectoryChannel, data_iter: Iterator[Any], *, version_fn: Callable[[], int],
                 tokenizer: Detokenizer | None = None, reward_pool: Any = None, max_concurrent: int | None = None,
                 filters: Sequence[GroupFilter] = (), max_group_age: int | None = None,
                 poll_interval_s: float = 0.02, reward_threads: int = 4,
                 max_failures_in_a_row: int | None = None) -> None:
        if not inspect.iscoroutinefunction(getattr(workflow, "arun", None)):
            raise TypeError(f"workflow {type(workflow).__name__} has no `async def arun(client, row, *, version)`")
        missing = missing_workflow_members(workflow)
        if missing:
            raise TypeError(f"workflow {type(workflow).__name__} lacks {', '.join(missing)} of api.RolloutWorkflow: "
                            "subclass areal_jax.RolloutWorkflow (it has their defaults) or define them")
        if max_concurrent is None:
            max_concurrent = staleness.max_concurrent
        if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"max_concurrent must be an int >= 1, got {max_concurrent!r}")
        if max_group_age is not None and (isinstance(max_group_age, bool) or not isinstance(max_group_age, int)
                                          or max_group_age < 0):
            raise ValueError(f"max_group_age must be None or an int >= 0, got {max_group_age!r}")
        if max_failures_in_a_row is None:
            max_failures_in_a_row = max(staleness.batch_size, _MIN_FAILURE_STREAK)
        if isinstance(max_failures_in_a_row, bool) or not isinstance(max_failures_in_a_row, int) \
                or max_failures_in_a_row < 1:
            raise ValueError(f"max_failures_in_a_row must be None or an int >= 1, got {max_failures_in_a_row!r}")
        self.max_failures_in_a_row = max_failures_in_a_row
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self.engine = engine
        self.workflow = workflow
        self.staleness = staleness
        self.channel = channel
        self.max_concurrent = max_concurrent
        self.max_group_age = max_group_age
        self.poll_interval_s = float(poll_interval_s)
        self._data_iter = iter(data_iter)
        self._version_fn = version_fn
        self._filters = tuple(filters)
        self._client = RolloutClient(engine, tokenizer, reward_pool, reward_threads=reward_threads)

        # Counters: written on the loop thread, read anywhere, under the condition's lock.
        self._cond = threading.Condition()
        self._admitted = 0
        self._accepted = 0
        self._rejected: collections.Counter[str] = collections.Counter()
        self._failed: collections.Counter[str] = collections.Counter()
        self._in_flight = 0
        self._peak_in_flight = 0
        self._cancelled = 0
        self._admission_version = -1
        self._finished_trajectories = 0
        self._finished_reward_sum = 0.0
        self._error: str | None = None
        self._exhausted = False
        self._failed_in_a_row = 0
        self._first_failure: str | None = None  # of the current run of failures
        self._all_failing = False  # the error is RolloutsFailed's

        self._paused = threading.Event()
        self._stop_requested = False
        self._drain_deadline: float | None = None  # monotonic time; None: cancel at once
        self._outbox: collections.deque[TrajectoryGroup] = collections.deque()
        self._outbox_ready: asyncio.Event | None = None
        self._pump_stop = False
        self._next_row: Any = None
        self._tasks: set[asyncio.Task] = set()
        self._put_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-put")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._report: ShutdownReport | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the controller's thread and event loop."""
        if self._thread is not None:
            raise RuntimeError("RolloutController already started")
        self._thread = threading.Thread(target=self._thread_main, name="rollout-controller", daemon=True)
        self._thread.start()
        self._started.wait()

    def shutdown(self, timeout: float = 30.0, *, drain: bool = False, close_channel: bool = False) -> ShutdownReport:
        """Stop admitting, end in-flight groups, stop the thread; report where every group ended.

        drain: first let in-flight groups finish (up to `timeout` s), then cancel the rest.
        close_channel: close the channel afterwards (wakes a trainer waiting on it).
        The engine and the reward pool belong to the caller and are left running.
        """
        if self._report is not None:
            return self._report
        if self._thread is not None:
            self._drain_deadline = time.monotonic() + timeout if drain else None
            self._stop_requested = True
            self.notify()
            self._thread.join(timeout + 10.0)  # cancellation itself takes milliseconds
            if self._thread.is_alive():
                raise TimeoutError(f"rollout controller thread did not stop within {timeout + 10.0} s")
        self._client.close()
        if isinstance(self.workflow, RolloutWorkflow):  # the base class's optional release
            self.workflow.close()
        self._put_executor.shutdown(wait=True)
        if close_channel:
            self.channel.close()
        with self._cond:
            self._report = ShutdownReport(
                admitted=self._admitted, accepted=self._accepted, rejected=dict(self._rejected),
                failed=sum(self._failed.values()), in_flight=self._cancelled,
                queued=len(self._outbox) + self.channel.qsize(), failed_by_error=dict(self._failed),
                error=self._error)
        if self._outbox:
            logger.warning("rollout shutdown: %d accepted groups never reached the full channel", len(self._outbox))
        return self._report

    @property
    def unsent(self) -> list[TrajectoryGroup]:
        """Accepted groups still waiting for room in the channel (after shutdown: left there)."""
        return list(self._outbox)

    def pause(self) -> None:
        """Stop admitting new groups (in-flight ones continue); for colocated synchronous runs.

        The engine has no pause of its own: to keep it off the devices, `wait_idle()` after
        pausing, which returns once every admitted group has finished generating and scoring.
        """
        self._paused.set()

    def resume(self) -> None:
        """Admit again after `pause()`."""
        self._paused.clear()
        self.notify()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no group is in flight; return False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)

    def notify(self) -> None:
        """Wake the loop now (e.g. right after the trainer bumped its version)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed in between
                pass

    def check(self) -> None:
        """Raise if the controller hit a fatal error (data iterator or version_fn raised)."""
        if self._error is not None:
            raise (RolloutsFailed if self._all_failing else RuntimeError)(
                f"rollout controller stopped admitting: {self._error}")

    def stats(self) -> ControllerStats:
        """Counters now, plus the channel depth and the engine's generation throughput."""
        engine = self.engine.stats()
        tokens_per_s = engine.tokens_per_s
        with self._cond:
            return ControllerStats(
                admitted=self._admitted, accepted=self._accepted, rejected=dict(self._rejected),
                failed=sum(self._failed.values()), failed_by_error=dict(self._failed), in_flight=self._in_flight,
                peak_in_flight=self._peak_in_flight, outbox=len(self._outbox), channel_depth=self.channel.qsize(),
                paused=self._paused.is_set(), data_exhausted=self._exhausted,
                admission_version=self._admission_version, generation_tokens_per_s=tokens_per_s, error=self._error,
                finished_trajectories=self._finished_trajectories, finished_reward_sum=self._finished_reward_sum,
                generation_preempted_samples=engine.preempted_samples,
                generation_reprefill_tokens=engine.reprefill_tokens,
                generation_reprefill_shared_tokens=getattr(engine, "reprefill_shared_tokens", 0),
                generation_reprefill_ride_tokens=getattr(engine, "reprefill_ride_tokens", 0),
                generation_kv_pages_shared=engine.kv_pages_shared)

    # ---- the loop -----------------------------------------------------------------------------

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        finally:
            self._loop = None
            loop.close()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake = asyncio.Event()
        outbox_ready = asyncio.Event()
        self._outbox_ready = outbox_ready
        self._loop = loop
        self._started.set()
        pump = asyncio.create_task(self._pump(loop, outbox_ready))
        try:
            while not self._stop_requested:
                self._admit()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)
                except TimeoutError:
                    pass
                self._wake.clear()
        except Exception as exc:  # noqa: BLE001 - a bug here must still settle every group below
            self._fatal(f"admission loop raised {type(exc).__name__}: {exc}")
            while not self._stop_requested:  # in-flight groups finish; shutdown() ends the rest
                await asyncio.sleep(self.poll_interval_s)
        if self._drain_deadline is not None and self._tasks:
            await asyncio.wait(set(self._tasks), timeout=max(0.0, self._drain_deadline - time.monotonic()))
        await self._cancel_in_flight()
        self._pump_stop = True
        outbox_ready.set()
        await pump

    async def _cancel_in_flight(self) -> None:
        """Cancel every in-flight group and wait for them to end, within _CANCEL_GRACE_S.

        A group ends at its next await once cancelled, unless its workflow swallows the
        cancellation (an agent with a broad `except BaseException`, a library that retries on
        anything): such a group is cancelled again every _RECANCEL_S, and past the grace it is
        left behind, counted as cancelled, so that shutdown stays bounded."""
        pending = set(self._tasks)
        deadline = time.monotonic() + _CANCEL_GRACE_S
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=_RECANCEL_S)
            if pending and time.monotonic() >= deadline:
                logger.error("rollout shutdown: %d group(s) ignored cancellation for %.0f s (their workflow "
                             "swallows asyncio.CancelledError); left behind, counted as cancelled",
                             len(pending), _CANCEL_GRACE_S)
                for _ in pending:
                    self.staleness.on_reject()
                    self._settle(cancelled=True)
                self._tasks.difference_update(pending)
                return

    def _admit(self) -> None:
        """Start groups while capacity allows; only this thread admits."""
        while not self._paused.is_set() and not self._exhausted and len(self._tasks) < self.max_concurrent:
            try:
                version = admission_version(self._version_fn(), self.engine.version)
            except Exception as exc:  # noqa: BLE001 - a broken version source stops admission loudly
                self._fatal(f"version_fn raised {type(exc).__name__}: {exc}")
                return
            if self.staleness.capacity(version) <= 0:
                return
            if self._next_row is None:  # read a row only when it can be admitted
                try:
                    self._next_row = next(self._data_iter)
                except StopIteration:
                    with self._cond:
                        self._exhausted = True
                    logger.info("rollout data exhausted after %d admitted groups", self._admitted)
                    return
                except Exception as exc:  # noqa: BLE001
                    self._fatal(f"data iterator raised {type(exc).__name__}: {exc}")
                    return
            if not self.staleness.try_submit(version):  # another admitter took the capacity
                return
            row, self._next_row = self._next_row, None
            with self._cond:
                self._admitted += 1
                self._in_flight += 1
                self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
                self._admission_version = version
            task = asyncio.create_task(self._run_group(row, version))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _fatal(self, message: str, exc_info: bool = True) -> None:
        logger.error("rollout controller stops admitting: %s", message, exc_info=exc_info)
        with self._cond:
            self._error = message
            self._exhausted = True

    async def _run_group(self, row: Any, version: int) -> None:
        source = row_source(row)
        try:
            group = await self.workflow.arun(self._client, row, version=version)
            if group is not None and not isinstance(group, TrajectoryGroup):
                raise TypeError(f"workflow returned {type(group).__name__}, expected TrajectoryGroup or None")
            trainer_version = int(self._version_fn())
            reason = self._reject_reason(group, trainer_version)
            if group is not None:
                self._tally_rewards(group)
        except asyncio.CancelledError:
            self.staleness.on_reject()
            self._settle(cancelled=True)
            raise
        except Exception as exc:  # noqa: BLE001 - one bad row must not stop the run
            logger.warning("rollout of %s failed: %s: %s", source, type(exc).__name__, exc,
                           exc_info=logger.isEnabledFor(logging.DEBUG))
            self.staleness.on_reject()
            self._settle(failed=type(exc).__name__, why=f"{source}: {type(exc).__name__}: {exc}")
            return
        if reason is not None:
            self.staleness.on_reject()
            self._settle(rejected=reason)
            return
        # The controller owns admission: it stamps the admission version whatever the workflow set.
        group = dataclasses.replace(group, admitted_version=version,
                                    info={**group.info, "source": source, "accepted_version": trainer_version})
        self.staleness.on_accept()
        self._outbox.append(group)
        self._outbox_ready.set()
        self._settle(accepted=True)

    def _tally_rewards(self, group: TrajectoryGroup) -> None:
        rewards = [float(t.reward) for t in group.trajectories]
        with self._cond:
            self._finished_trajectories += len(rewards)
            self._finished_reward_sum += sum(rewards)

    def _reject_reason(self, group: TrajectoryGroup | None, trainer_version: int) -> str | None:
        if group is None:
            return "workflow"
        for check in (self.workflow.reject_reason, *self._filters):
            reason = check(group)
            if reason is not None:
                return str(reason)
        if self.max_group_age is not None and is_too_stale(group, trainer_version, self.max_group_age):
            return "stale"
        return None

    def _settle(self, *, accepted: bool = False, rejected: str | None = None, failed: str | None = None,
                cancelled: bool = False, why: str = "") -> None:
        streak = None
        with self._cond:
            if failed is not None:
                self._failed_in_a_row += 1
                self._first_failure = self._first_failure or why
                if self._failed_in_a_row == self.max_failures_in_a_row and self._error is None:
                    streak = self._first_failure
            elif not cancelled:
                self._failed_in_a_row, self._first_failure = 0, None
            self._in_flight -= 1
            if accepted:
                self._accepted += 1
            elif rejected is not None:
                self._rejected[rejected] += 1
            elif failed is not None:
                self._failed[failed] += 1
            elif cancelled:
                self._cancelled += 1
            self._cond.notify_all()
        if streak is not None:
            self._all_failing = True
            self._fatal(f"the last {self.max_failures_in_a_row} rollouts all failed; the first: {streak}",
                        exc_info=False)
        self.notify()  # capacity may have been freed

    async def _pump(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Event) -> None:
        """Move accepted groups to the channel in acceptance order, never blocking the loop."""
        while True:
            await ready.wait()
            ready.clear()
            while self._outbox:
                group = self._outbox[0]
                try:
                    if not self.channel.try_put(group):
                        # Not cancelled mid-call: a put that succeeds is always recorded.
                        await loop.run_in_executor(self._put_executor, self.channel.put, group, _PUT_RETRY_S)
                except TimeoutError:
                    if self._pump_stop:
                        return
                    continue
                except ChannelClosed:
                    logger.warning("trajectory channel closed: %d accepted groups stay unsent", len(self._outbox))
                    return
                self._outbox.popleft()
            if self._pump_stop:
                return
