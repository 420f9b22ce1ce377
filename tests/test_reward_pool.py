"""RewardPool: results, timeouts, crashes, errors, concurrency, resolution of names."""

import asyncio
import concurrent.futures
import dataclasses
import time

import pytest

from areal_jax.reward.pool import RewardFunctionNotFound, RewardPool, RewardPoolConfig, RewardPoolStats

FIX = "tests.reward_fixtures"
TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def pool():
    with RewardPool(RewardPoolConfig(num_workers=2, timeout_s=TIMEOUT_S)) as p:
        # Let both workers come up so timing assertions measure calls, not start-up.
        assert p.map(f"{FIX}:add", [1, 2], [1, 2]) == [2.0, 4.0]
        yield p
    final = p.stats()
    assert final.submitted == final.calls  # nothing lost


def _delta(before: RewardPoolStats, after: RewardPoolStats) -> dict:
    return {f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(RewardPoolStats)}


def test_normal_results(pool):
    assert pool.submit(f"{FIX}:add", 2, 3).result(10) == 5.0
    assert pool.submit(f"{FIX}:scaled", 2, scale=1.5).result(10) == 3.0
    one = pool.submit(f"{FIX}:constant_one").result(10)
    assert one == 1.0 and type(one) is float  # ints are coerced to float
    assert pool.map(f"{FIX}:add", range(5), range(10, 15)) == [10.0, 12.0, 14.0, 16.0, 18.0]


def test_builtin_math_reward_through_pool(pool):
    results = pool.map("math", [r"so \boxed{0.5}", r"\boxed{\frac{1}{3}}", "no box: 0.5"], [r"\frac{1}{2}"] * 3)
    assert results == [1.0, 0.0, 0.0]


def test_concurrency_spreads_over_both_workers(pool):
    start = time.monotonic()
    futures = [pool.submit(f"{FIX}:sleep_then_pid", 0.3) for _ in range(4)]
    pids = {f.result(10) for f in futures}
    elapsed = time.monotonic() - start
    assert len(pids) == 2
    assert elapsed < 4 * 0.3  # serial would take 1.2 s; two workers take ~0.6 s
    values = pool.map(f"{FIX}:add", range(40), range(40))
    assert values == [2.0 * i for i in range(40)]


def test_hanging_call_times_out_others_unaffected(pool):
    before = pool.stats()
    start = time.monotonic()
    hung = pool.submit(f"{FIX}:hang")
    others = [pool.submit(f"{FIX}:add", i, 1) for i in range(6)]
    assert [f.result(10) for f in others] == [float(i + 1) for i in range(6)]
    assert hung.result(10) == 0.0
    elapsed = time.monotonic() - start
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 2.0
    assert pool.submit(f"{FIX}:add", 40, 2).result(10) == 42.0  # the replacement worker works
    delta = _delta(before, pool.stats())
    assert (delta["timeouts"], delta["succeeded"], delta["workers_started"]) == (1, 7, 1)


def test_per_call_timeout(pool):
    start = time.monotonic()
    assert pool.submit_call(f"{FIX}:hang", (), {}, timeout_s=0.3).result(10) == 0.0
    assert time.monotonic() - start < TIMEOUT_S
    assert pool.submit_call(f"{FIX}:hang", (0.05,), timeout_s=1.0).result(10) == 1.0


@pytest.mark.parametrize("crasher", ["exit_hard", "kill_self", "segfault"])
def test_crashing_call_yields_zero_and_pool_goes_on(pool, crasher):
    before = pool.stats()
    slow_ok = pool.submit(f"{FIX}:sleep_then_pid", 0.2)
    crashed = pool.submit(f"{FIX}:{crasher}")
    assert crashed.result(10) == 0.0
    assert slow_ok.result(10) > 0  # the call on the other worker is unaffected
    assert pool.submit(f"{FIX}:add", 1, 1).result(10) == 2.0
    delta = _delta(before, pool.stats())
    assert (delta["crashes"], delta["succeeded"], delta["workers_started"]) == (1, 2, 1)


@pytest.mark.parametrize(
    ("fn", "args"),
    [("boom", ()), ("boom", ("custom message",)), ("not_a_number", ()), ("nan", ()), ("add", (1, "x"))],
)
def test_errors_yield_zero(pool, fn, args, caplog):
    before = pool.stats()
    assert pool.submit(f"{FIX}:{fn}", *args).result(10) == 0.0
    delta = _delta(before, pool.stats())
    assert (delta["errors"], delta["crashes"], delta["workers_started"]) == (1, 0, 0)
    assert "Traceback" in caplog.text


@pytest.mark.parametrize(
    "bad",
    ["no_such_name", "tests.no_such_module:f", "no_such_package.mod:f", "tests.reward_fixtures", "a b:c", ":f", 7],
)
def test_bad_paths_fail_at_submit(pool, bad):
    with pytest.raises((ValueError, TypeError)):
        pool.submit(bad)


@pytest.mark.parametrize("attr", ["missing", "NOT_CALLABLE"])
def test_unloadable_function_raises_from_future(pool, attr):
    future = pool.submit(f"{FIX}:{attr}")
    with pytest.raises(RewardFunctionNotFound, match=attr):
        future.result(10)
    assert pool.submit(f"{FIX}:add", 1, 2).result(10) == 3.0


def test_asyncio_evaluate(pool):
    async def main():
        return await asyncio.gather(*(pool.evaluate(f"{FIX}:add", i, i) for i in range(5)))

    assert asyncio.run(main()) == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_cancelled_before_dispatch_is_counted(pool):
    before = pool.stats()
    blockers = [pool.submit(f"{FIX}:sleep_then_pid", 0.3) for _ in range(2)]
    queued = pool.submit(f"{FIX}:add", 1, 1)
    assert queued.cancel()
    [f.result(10) for f in blockers]
    assert pool.submit(f"{FIX}:add", 1, 1).result(10) == 2.0
    assert _delta(before, pool.stats())["cancelled"] == 1


def test_worker_recycling_and_close_without_wait():
    config = RewardPoolConfig(num_workers=1, timeout_s=5.0, max_tasks_per_worker=2, preload=())
    pool = RewardPool(config)
    pids = [pool.submit(f"{FIX}:worker_pid").result(30) for _ in range(4)]
    assert pids[0] == pids[1] != pids[2] == pids[3]
    hung = pool.submit(f"{FIX}:hang")
    queued = pool.submit(f"{FIX}:add", 1, 1)
    time.sleep(0.2)
    start = time.monotonic()
    pool.close(wait=False)
    assert time.monotonic() - start < 3.0
    for future in (hung, queued):
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(1)
    stats = pool.stats()
    assert (stats.submitted, stats.succeeded, stats.cancelled, stats.workers_started) == (6, 4, 2, 3)  # recycled after calls 2 and 4
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(f"{FIX}:add", 1, 1)


def test_spawn_start_method_works():
    with RewardPool(RewardPoolConfig(num_workers=1, start_method="spawn", preload=())) as pool:
        assert pool.submit(f"{FIX}:add", 20, 22).result(60) == 42.0


@pytest.mark.parametrize(
    ("kwargs", "culprit"),
    [
        ({"num_workers": 0}, "num_workers"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"max_tasks_per_worker": 0}, "max_tasks_per_worker"),
        ({"start_method": "fork"}, "start_method"),
        ({"preload": "areal_jax.reward.math"}, "preload"),
        ({"startup_timeout_s": -1}, "startup_timeout_s"),
    ],
)
def test_config_validation(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        RewardPoolConfig(**kwargs)


def test_workers_that_cannot_start_fail_the_pool_instead_of_respawning_forever(caplog):
    from tests.reward_fixtures import CRASH_ON_IMPORT

    pool = RewardPool(RewardPoolConfig(num_workers=1, start_method="spawn", preload=(CRASH_ON_IMPORT,)))
    future = pool.submit(f"{FIX}:add", 1, 1)
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(60)
    assert "giving up" in caplog.text
    pool.close()
    assert pool.stats().workers_started == 6  # 1 + 5 replacements, then it gives up
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(f"{FIX}:add", 1, 1)


def test_registered_short_name(pool):
    from areal_jax.reward.registry import REWARDS, register_reward

    register_reward("fixture_add", f"{FIX}:add")
    try:
        assert pool.submit("fixture_add", 4, 5).result(10) == 9.0
    finally:
        del REWARDS["fixture_add"]
    with pytest.raises(ValueError, match="function"):
        register_reward("bad", "not a path")


def test_importing_the_pool_does_not_import_sympy():
    import subprocess
    import sys

    code = ("import sys\nfrom areal_jax.reward import RewardPool, RewardPoolConfig, code_reward\n"
            "assert 'sympy' not in sys.modules and 'math_verify' not in sys.modules\n"
            "from areal_jax.reward import math_reward\nassert 'math_verify' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _sandbox_leftovers(worker_pid, run_dirs):
    """Processes of a worker's sandboxes: the private uids its runs draw from (root), or a working
    directory inside one of its run directories."""
    import psutil

    from areal_jax.reward.sandbox import _uid_range

    uids, found = _uid_range(worker_pid), []
    for proc in psutil.process_iter(["uids", "cwd", "status"]):
        info = proc.info
        if info["status"] == psutil.STATUS_ZOMBIE or info["uids"] is None:
            continue
        if info["uids"].real in uids or (info["cwd"] or "").startswith(tuple(run_dirs) or ("\0",)):
            found.append(proc.pid)
    return found


def test_deadline_kill_sweeps_the_sandboxes_of_the_killed_worker():
    """A worker killed at its deadline mid-sandbox cannot clean up: the supervisor removes the
    sandboxed program and its private directory before the call's 0.0 arrives."""
    import glob
    import tempfile

    with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=60.0, preload=())) as pool:
        worker = int(pool.submit(f"{FIX}:worker_pid").result(60))
        pattern = f"{tempfile.gettempdir()}/areal-sandbox-{worker}-*"
        future = pool.submit_call(f"{FIX}:sandboxed_sleep", (600,), timeout_s=4.0)
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline and not _sandbox_leftovers(worker, glob.glob(pattern)):
            time.sleep(0.05)
        run_dirs = glob.glob(pattern)
        running = _sandbox_leftovers(worker, run_dirs)
        assert run_dirs and running, "the sandboxed program never started"
        assert future.result(60) == 0.0
        assert pool.stats().timeouts == 1
        assert _sandbox_leftovers(worker, run_dirs) == []
        assert glob.glob(pattern) == []
