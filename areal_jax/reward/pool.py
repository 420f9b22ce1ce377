"""A supervised pool of reward worker processes with per-call deadlines.

Rewards run off the generation path, in separate processes, because reward code is slow,
untrusted in its inputs and sometimes hangs or dies (sympy on a pathological expression,
a sandbox gone wrong). ``concurrent.futures.ProcessPoolExecutor`` marks the whole pool broken
when one worker dies and cannot kill one hung call, so this is a small supervisor instead:

- one duplex pipe per worker, at most one task in flight per worker;
- one dispatcher thread that waits on every pipe, every process sentinel and a wake-up pipe,
  with a timeout equal to the nearest task deadline;
- a call past its deadline: the worker is SIGKILLed and replaced, the call yields 0.0;
- a worker that dies mid-call: the call yields 0.0 and the worker is replaced;
- a worker killed or dead: the supervisor sweeps the code sandboxes it had running (their
  processes and private directories), before the call's future resolves;
- a function that raises or returns a non-number: 0.0, counted as an error, traceback logged;
- a function path that cannot be resolved: the future raises ``RewardFunctionNotFound``
  (a configuration bug should be loud, not a silent zero).

Start method: ``forkserver`` (default) or ``spawn``, never ``fork``. The parent is a JAX
process with XLA thread pools and our own threads; ``fork`` copies their locks in whatever
state they are in, and the child can deadlock on the first malloc or import. ``forkserver``
forks workers from a clean single-threaded server process that has already imported the
preload modules, so a replacement worker is ready in milliseconds. As with any spawn or
forkserver pool, the main script must be import-safe (an ``if __name__ == "__main__"`` guard).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import Any, Iterable

from areal_jax.reward.registry import resolve_reward_path
from areal_jax.reward.sandbox import SandboxLimits, sweep_orphaned_sandboxes, sweep_sandboxes_of
from areal_jax.reward.containment import kill_tree, own_pymp_dir, sweep_orphaned_pymp_dirs
from areal_jax.reward.guardian import guardian_main

__all__ = ["RewardCallFailed", "RewardFunctionNotFound", "RewardPool", "RewardPoolConfig", "RewardPoolStats"]

logger = logging.getLogger(__name__)

_START_METHODS = ("forkserver", "spawn")
_MAX_STARTUP_FAILURES = 5


class _PoolBroken(RuntimeError):
    """Workers cannot even start; respawning them forever would only burn CPU."""


class RewardFunctionNotFound(LookupError):
    """A worker could not import the reward function named by a task."""


class RewardCallFailed(RuntimeError):
    """A call submitted with `raise_errors=True` raised, returned no finite number, timed out or
    crashed its worker: one line saying which (the self-check's answer instead of a silent 0.0)."""


@dataclasses.dataclass(frozen=True)
class RewardPoolConfig:
    """Configuration of a ``RewardPool``.

    num_workers: worker processes (calls run concurrently up to this many).
    timeout_s: wall-clock limit of a call whose caller names none, measured from dispatch to a
        ready worker (rollouts use RLVRConfig.reward_timeout_s, eval EvalConfig.reward_timeout_s).
    max_tasks_per_worker: recycle a worker after this many calls (bounds leaks); None = never.
    start_method: "forkserver" or "spawn" (see module docstring for why not "fork").
    preload: modules every worker imports before it reports ready, so import time is not
        charged to the first call's deadline.
    startup_timeout_s: a worker that is not ready within this time is killed and replaced.
    memory_mb: address space of each worker (RLIMIT_AS, inherited by what it starts), in MiB; a reward
        past it fails (MemoryError: an error, or a crash) and scores 0.0, the trainer's memory untouched.
        None: no cap. Every process a reward starts is killed when its call ends (reward/containment.py).
    """

    num_workers: int = 2
    timeout_s: float = 5.0
    max_tasks_per_worker: int | None = None
    start_method: str = "forkserver"
    preload: tuple[str, ...] = ("areal_jax.reward.math",)
    startup_timeout_s: float = 120.0
    memory_mb: int | None = 4096

    def __post_init__(self) -> None:
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {self.num_workers!r}")
        if not _positive_finite(self.timeout_s):
            raise ValueError(f"timeout_s must be a positive finite number, got {self.timeout_s!r}")
        if self.max_tasks_per_worker is not None and (
            not isinstance(self.max_tasks_per_worker, int) or self.max_tasks_per_worker < 1
        ):
            raise ValueError(f"max_tasks_per_worker must be None or an int >= 1, got {self.max_tasks_per_worker!r}")
        if self.start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {self.start_method!r}")
        if isinstance(self.preload, str) or not all(isinstance(m, str) and m for m in self.preload):
            raise ValueError(f"preload must be a tuple of module names, got {self.preload!r}")
        if self.memory_mb is not None and (not isinstance(self.memory_mb, int) or isinstance(self.memory_mb, bool)
                                           or self.memory_mb < 256):
            raise ValueError(f"RewardPoolConfig.memory_mb must be None or an int >= 256 (MiB), got {self.memory_mb!r}")
        if not _positive_finite(self.startup_timeout_s):
            raise ValueError(f"startup_timeout_s must be a positive finite number, got {self.startup_timeout_s!r}")


def _positive_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@dataclasses.dataclass(frozen=True)
class RewardPoolStats:
    """Counters since the pool started. Every finished call is in exactly one of
    succeeded / timeouts / crashes / errors / cancelled."""

    submitted: int = 0
    succeeded: int = 0
    timeouts: int = 0
    crashes: int = 0
    errors: int = 0
    cancelled: int = 0
    workers_started: int = 0

    @property
    def calls(self) -> int:
        """Calls that finished (any outcome)."""
        return self.succeeded + self.timeouts + self.crashes + self.errors + self.cancelled


# ----------------------------------------------------------------------------- parent side


@dataclasses.dataclass
class _Task:
    task_id: int
    path: str
    args: tuple
    kwargs: dict
    timeout_s: float
    future: Future
    started: bool = False  # set_running_or_notify_cancel already called
    raise_errors: bool = False  # a failed call's future raises RewardCallFailed instead of giving 0.0


@dataclasses.dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    started_at: float
    ready: bool = False
    task: _Task | None = None
    deadline: float = math.inf
    tasks_done: int = 0
    pid: int | None = None  # of the process that runs the calls (below `process`, its guardian)


class RewardPool:
    """Evaluate reward functions in supervised worker processes.

    Thread-safe; ``submit`` never blocks on the workers. Every submitted call's future is
    resolved: with the reward, with 0.0 on timeout / crash / error (RewardCallFailed for a call
    submitted with raise_errors), by cancellation on
    ``close(wait=False)``, or with ``RewardFunctionNotFound``.
    """

    def __init__(self, config: RewardPoolConfig | None = None, *, sandbox: SandboxLimits | None = None) -> None:
        """sandbox: the code sandbox's limits in the workers (for code rewards that name none)."""
        self.config = config or RewardPoolConfig()
        self._sandbox = sandbox
        self._ctx = multiprocessing.get_context(self.config.start_method)
        if self.config.start_method == "forkserver":
            own_pymp_dir()  # the fork server's socket directory, attributable after a SIGKILL
            # Ignored if this process's fork server already runs; workers then import themselves.
            self._ctx.set_forkserver_preload(["__main__", __name__, *self.config.preload])
        self._lock = threading.Lock()
        self._inbox: collections.deque[_Task] = collections.deque()
        self._queue: collections.deque[_Task] = collections.deque()
        self._task_ids = itertools.count()
        self._counts = collections.Counter()
        self._checked_paths: dict[str, str] = {}
        self._closing = False
        self._cancel_on_close = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._workers: list[_Worker] = []
        self._startup_failures = 0
        self._thread = threading.Thread(target=self._supervise, name="reward-pool", daemon=True)
        self._thread.start()

    # -- public API -----------------------------------------------------------------------

    def submit(self, fn: str, *args: Any, **kwargs: Any) -> Future:
        """Schedule ``fn(*args, **kwargs)`` ("math", "code" or "module:function"); returns a Future[float].

        Raises ValueError at once if ``fn`` names no registered reward and no findable module.
        """
        return self.submit_call(fn, args, kwargs)

    def submit_call(
        self, fn: str, args: tuple = (), kwargs: dict | None = None, *, timeout_s: float | None = None,
        raise_errors: bool = False,
    ) -> Future:
        """Like ``submit`` with explicit args/kwargs and an optional per-call timeout.
        raise_errors: a call that fails (error, timeout, crash) raises RewardCallFailed from its
        future, one line and no logged traceback, instead of resolving to 0.0 (still counted)."""
        if timeout_s is not None and not _positive_finite(timeout_s):
            raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
        path = self._checked_paths.get(fn) if isinstance(fn, str) else None
        if path is None:
            path = resolve_reward_path(fn)
            self._checked_paths[fn] = path
        future: Future = Future()
        with self._lock:
            if self._closing:
                raise RuntimeError("RewardPool is closed")
            task = _Task(next(self._task_ids), path, tuple(args), dict(kwargs or {}),
                         timeout_s or self.config.timeout_s, future, raise_errors=raise_errors)
            self._inbox.append(task)
            self._counts["submitted"] += 1
        self._wake()
        return future

    async def evaluate(self, fn: str, *args: Any, **kwargs: Any) -> float:
        """Await one reward from asyncio code."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def map(self, fn: str, *iterables: Iterable[Any]) -> list[float]:
        """Evaluate ``fn`` over zipped argument iterables concurrently; results in input order."""
        futures = [self.submit(fn, *args) for args in zip(*iterables, strict=True)]
        return [f.result() for f in futures]

    def stats(self) -> RewardPoolStats:
        """A snapshot of the pool's counters."""
        with self._lock:
            return RewardPoolStats(**{f.name: self._counts[f.name] for f in dataclasses.fields(RewardPoolStats)})

    def close(self, wait: bool = True) -> None:
        """Stop the pool. ``wait=True`` finishes every submitted call first; ``wait=False``
        cancels queued calls and kills workers with calls in flight (their futures are cancelled)."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._cancel_on_close = not wait
        self._wake()
        self._thread.join()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(wait=exc_info[0] is None)

    # -- supervisor thread ----------------------------------------------------------------

    def _wake(self) -> None:
        # Under the lock so that _shutdown cannot close the fd (and the number be reused by
        # an unrelated file) between the check and the write.
        with self._lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:  # the pipe is full, so a wake-up is already pending
                pass

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def _supervise(self) -> None:
        try:
            sweep_orphaned_sandboxes()  # left by a pool whose process was SIGKILLed
            sweep_orphaned_pymp_dirs()
            self._workers = [self._start_worker() for _ in range(self.config.num_workers)]
            while self._step():
                pass
        except _PoolBroken as exc:
            logger.error("%s; closing the pool and cancelling every pending call", exc)
        except BaseException:
            logger.exception("reward pool supervisor failed; cancelling every pending call")
            raise
        finally:
            self._shutdown()

    def _step(self) -> bool:
        """One round of the supervisor loop; False when the pool is done."""
        with self._lock:
            self._queue.extend(self._inbox)
            self._inbox.clear()
            closing, cancel = self._closing, self._cancel_on_close
        if closing and cancel:
            return False
        self._dispatch()
        if closing and not self._queue and all(w.task is None for w in self._workers):
            return False
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.task is not None]
        deadlines += [w.started_at + self.config.startup_timeout_s for w in self._workers if not w.ready]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        waitables = [self._wake_r] + [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
        ready = set(multiprocessing.connection.wait(waitables, timeout))
        if self._wake_r in ready:
            os.read(self._wake_r, 65536)
        for i, worker in enumerate(list(self._workers)):
            if worker.conn in ready or worker.process.sentinel in ready:
                self._receive(i, worker, died=worker.process.sentinel in ready)
        now = time.monotonic()
        for i, worker in enumerate(list(self._workers)):
            if worker.task is not None and now >= worker.deadline:
                task, worker.task = worker.task, None
                logger.warning("reward call %s timed out after %.1fs; killing worker %d",
                               task.path, task.timeout_s, worker.process.pid)
                self._replace(i)  # killed and its sandboxes swept before the caller sees the 0.0
                self._finish(task, 0.0, "timeouts", f"took longer than {task.timeout_s:g} s")
            elif not worker.ready and now >= worker.started_at + self.config.startup_timeout_s:
                logger.warning("reward worker %d not ready after %.0fs; replacing it",
                               worker.process.pid, self.config.startup_timeout_s)
                self._replace(i)
        return True

    def _receive(self, index: int, worker: _Worker, died: bool) -> None:
        """Drain the worker's replies; handle its death (a call in flight yields 0.0)."""
        retiring = False
        try:
            while worker.conn.poll():
                kind_or_id, status, payload = worker.conn.recv()
                if kind_or_id == "ready":
                    worker.ready, worker.pid = True, status
                    self._startup_failures = 0
                    continue
                self._complete(worker, kind_or_id, status, payload)
                # A worker that ran out of memory exits after its reply (its heap may stay near the
                # cap): replaced now, so no task is sent to it while it exits.
                retiring = retiring or status == "out_of_memory"
        except (EOFError, OSError):
            died = True
        if retiring and worker.task is None:
            self._replace(index)
            return
        if not died:
            if self.config.max_tasks_per_worker is not None and worker.task is None \
                    and worker.tasks_done >= self.config.max_tasks_per_worker:
                self._replace(index, graceful=True)
            return
        if not worker.ready:
            worker.process.join(1.0)
            self._startup_failures += 1
            if self._startup_failures > _MAX_STARTUP_FAILURES:  # e.g. a preload that segfaults
                raise _PoolBroken(f"reward workers died during start-up {self._startup_failures} times in a row "
                                   f"(last exit code {worker.process.exitcode}); giving up")
        task, worker.task = worker.task, None
        if task is not None:
            worker.process.join(1.0)
            logger.warning("reward worker %d died (exit code %s) during %s; replacing it",
                           worker.process.pid, worker.process.exitcode, task.path)
        self._replace(index)
        if task is not None:
            self._finish(task, 0.0, "crashes", f"crashed its worker (exit code {worker.process.exitcode})")

    def _complete(self, worker: _Worker, task_id: int, status: str, payload: Any) -> None:
        task = worker.task
        if task is None or task.task_id != task_id:  # cannot happen with one task per worker
            logger.error("reward worker %d replied to unknown task %s", worker.process.pid, task_id)
            return
        worker.task, worker.deadline = None, math.inf
        worker.tasks_done += 1
        if status == "ok":
            self._finish(task, payload, "succeeded")
        elif status == "not_found":
            self._count("errors")
            task.future.set_exception(RewardFunctionNotFound(f"cannot load reward function {task.path!r}:\n{payload}"))
        else:  # "error" or "out_of_memory"
            if not task.raise_errors:
                logger.warning("reward function %s raised; reward 0.0\n%s", task.path, payload)
            self._finish(task, 0.0, "errors", "raised " + str(payload).strip().splitlines()[-1])

    def _finish(self, task: _Task, value: float, outcome: str, why: str = "") -> None:
        self._count(outcome)
        if task.raise_errors and outcome != "succeeded":
            task.future.set_exception(RewardCallFailed(why))
        else:
            task.future.set_result(value)

    def _dispatch(self) -> None:
        for worker in self._workers:
            if not self._queue:
                return
            if not worker.ready or worker.task is not None:
                continue
            task = self._queue.popleft()
            if not task.started:
                if not task.future.set_running_or_notify_cancel():  # cancelled by the caller
                    self._count("cancelled")
                    continue
                task.started = True
            try:
                worker.conn.send((task.task_id, task.path, task.args, task.kwargs))
            except (BrokenPipeError, EOFError, OSError):
                # The worker died before it saw the task: run the task elsewhere, not as a crash.
                self._queue.appendleft(task)
                continue
            except Exception as exc:  # unpicklable arguments: the caller's bug, reported to the caller
                self._count("errors")
                task.future.set_exception(TypeError(f"cannot send arguments of {task.path!r} to a worker: {exc}"))
                continue
            worker.task, worker.deadline = task, time.monotonic() + task.timeout_s

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=guardian_main, name="reward-worker", daemon=True,
                                    args=(child_conn, self.config.preload, self._sandbox, self.config.memory_mb))
        process.start()
        child_conn.close()
        self._count("workers_started")
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    def _replace(self, index: int, graceful: bool = False) -> None:
        old = self._workers[index]
        self._stop_worker(old, graceful)
        self._workers[index] = self._start_worker()

    @staticmethod
    def _stop_worker(worker: _Worker, graceful: bool) -> None:
        if graceful and worker.ready and worker.process.is_alive():
            try:
                worker.conn.send(None)
            except OSError:
                pass
            worker.process.join(2.0)
        if worker.process.is_alive():  # the worker, its guardian and all below them, frozen then killed
            kill_tree(worker.process.pid)
        worker.process.join(5.0)
        worker.conn.close()
        if worker.process.exitcode != 0:  # killed or died: its sandboxes had no chance to clean up
            sweep_sandboxes_of(worker.pid or worker.process.pid)

    def _shutdown(self) -> None:
        """Resolve every remaining future (cancelled) and stop all workers."""
        pending = list(self._queue)
        with self._lock:
            pending += list(self._inbox)
            self._inbox.clear()
            self._closing = True
        self._queue.clear()
        for worker in self._workers:
            busy = worker.task is not None
            if busy:
                pending.append(worker.task)
                worker.task = None
            self._stop_worker(worker, graceful=not busy)
        self._workers = []
        for task in pending:
            self._count("cancelled")
            if not task.future.cancel():  # already running: cancel() refuses, so report it as cancelled
                task.future.set_exception(CancelledError("RewardPool closed before this call finished"))
        with self._lock:
            os.close(self._wake_w)
            os.close(self._wake_r)
            self._wake_w = self._wake_r = -1
