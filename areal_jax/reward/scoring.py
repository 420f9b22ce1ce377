"""A job's reward, run where its registration allows: the pool a job opens for it, and a scorer
that the job's evaluations share with its rollouts.

`open_reward_pool` is the one place that decides: a reward declared in-process
(`registry.RewardSpec.in_process`) gets no pool; every other reward gets worker processes with
deadlines, and a reward that runs model-written code is refused up front when the sandbox could
not cut it off the network.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from areal_jax.reward.pool import RewardCallFailed, RewardPool, RewardPoolConfig, RewardPoolStats
from areal_jax.reward.registry import load_reward_function, resolve_reward_path, reward_spec, reward_value
from areal_jax.reward.sandbox import SandboxLimits, check_network_isolation

__all__ = ["RewardCheckFailed", "RewardScorer", "open_reward_pool", "pool_totals", "score_all"]


class RewardCheckFailed(ValueError):
    """A call of `RewardScorer.checked_map` failed: one line naming the reward and what happened."""


def open_reward_pool(reward: str | Sequence[str], config: RewardPoolConfig, sandbox: SandboxLimits
                     ) -> RewardPool | None:
    """The worker pool `reward` (one name, or the verifier terms of a composite reward) runs in, or
    None when every one is declared in-process.

    Raises SandboxUnavailable (one line) for a code-running reward on a host where the sandbox
    cannot make a network namespace and `sandbox.allow_network` is off; ValueError for a name
    that resolves to nothing. The caller closes the pool.
    """
    specs = [reward_spec(name) for name in ([reward] if isinstance(reward, str) else reward)]
    if all(spec.in_process for spec in specs):
        return None
    if any(spec.runs_code for spec in specs):
        check_network_isolation(sandbox)
    return RewardPool(config, sandbox=sandbox)


class RewardScorer:
    """`scorer(text, gold) -> float` for one reward: in `pool` under `timeout_s` (a call past it
    scores 0.0 and is counted by the pool), or in this process when `pool` is None (what
    `open_reward_pool` gives only rewards declared in-process)."""

    def __init__(self, reward: str, pool: RewardPool | None, *, timeout_s: float) -> None:
        self.name, self.path = reward, resolve_reward_path(reward)
        self.pool = pool
        self.timeout_s = timeout_s
        self._fn = load_reward_function(self.path) if pool is None else None

    def submit(self, *args: Any) -> Future:
        if self.pool is not None:
            return self.pool.submit_call(self.path, args, timeout_s=self.timeout_s)
        future: Future = Future()
        future.set_result(reward_value(self._fn(*args), self.name))
        return future

    def __call__(self, *args: Any) -> float:
        return float(self.submit(*args).result())

    def map(self, calls: Sequence[tuple]) -> list[float]:
        """Every call submitted before any is awaited, so the pool's workers share them."""
        futures = [self.submit(*args) for args in calls]
        return [float(f.result()) for f in futures]


    def checked_map(self, calls: Sequence[tuple]) -> list[float]:
        """`map` for a self-check: the first call that raises, returns no finite number or runs
        past `timeout_s` raises RewardCheckFailed (one line: the reward and its error), with no
        traceback logged per call. An in-process call runs on a daemon thread under the deadline:
        one that never returns is left there, and the check refuses instead of hanging."""
        if self.pool is not None:
            futures = [self.pool.submit_call(self.path, args, timeout_s=self.timeout_s, raise_errors=True)
                       for args in calls]
            try:
                return [float(f.result()) for f in futures]
            except RewardCallFailed as e:
                for f in futures:
                    f.cancel()
                raise RewardCheckFailed(f"reward {self.name!r} {_said(e)}") from None
        return [self._call_by_deadline(args) for args in calls]

    def _call_by_deadline(self, args: tuple) -> float:
        done: list[Any] = []

        def call() -> None:
            try:
                done.append(reward_value(self._fn(*args), self.name))
            except BaseException as e:  # noqa: BLE001 - reported below, on the caller's thread
                done.append(e)

        thread = threading.Thread(target=call, name="reward-check", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not done:
            raise RewardCheckFailed(f"reward {self.name!r} took longer than {self.timeout_s:g} s "
                                    "(RLVRConfig.reward_timeout_s)")
        if isinstance(done[0], (TypeError, ValueError)) and str(done[0]).startswith(f"reward {self.name!r}"):
            raise RewardCheckFailed(str(done[0])) from None  # reward_value's own line
        if isinstance(done[0], BaseException):
            raise RewardCheckFailed(f"reward {self.name!r} raised {_said(done[0])}") from None
        return done[0]


def _said(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if isinstance(e, RewardCallFailed) else f"{type(e).__name__}: {text}"


def score_all(reward_fn: Callable[..., float], calls: Sequence[tuple]) -> list[float]:
    """`reward_fn` over `calls`: concurrently for a `RewardScorer`, one by one for a plain function."""
    if isinstance(reward_fn, RewardScorer):
        return reward_fn.map(calls)
    return [float(reward_fn(*args)) for args in calls]


def pool_totals(pool: RewardPool | None) -> dict[str, int]:
    """The pool's outcome counters (all zero without a pool), for a run's summary."""
    stats = pool.stats() if pool is not None else RewardPoolStats()
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name != "workers_started"}
