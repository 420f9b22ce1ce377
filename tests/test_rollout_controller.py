"""RolloutController with a real GenerationEngine (tiny random model on its own thread), a real
StalenessManager, a real tokenizer, in-process rewards and a real RewardPool.

Rewards come from tests.rollout_fixtures.scripted_reward: each row's gold answer scripts the
reward (sleep, raise, constant, or a hash of the completion text), so behavior is chosen per
row and is the same in worker processes.
"""

import asyncio
import logging
import random
import threading
import time

import jax
import numpy as np
import pytest

from areal_jax.data import PromptRow
from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.models import ModelConfig, init_params
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.reward import RewardPool, RewardPoolConfig
from areal_jax.rollout import (
    RLVRConfig,
    RLVRWorkflow,
    RolloutController,
    RolloutWorkflow,
    StalenessManager,
    TrajectoryChannel,
    is_too_stale,
    load_workflow,
)
from areal_jax.rollout.controller import RolloutsFailed
from areal_jax.rollout.types import Trajectory, TrajectoryGroup
from tests.rollout_fixtures import scripted_reward
from tests.tokenizer_fixtures import build_tiny_tokenizer

REWARD = "tests.rollout_fixtures:scripted_reward"
N = 2  # samples per prompt


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), "chatml"))


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    return cfg, init_params(cfg, jax.random.key(0), std=0.3)


@pytest.fixture(scope="module")
def shared_engine(model):
    # One engine for the module: compiling its programs is most of the cost of a test.
    engine = GenerationEngine(model, EngineConfig(num_slots=4, max_seq_len=32, decode_chunk=4))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
def engine(shared_engine, model):
    """The shared engine, idle, serving the initial weights as version 0."""
    assert shared_engine.update_weights(model[1], 0).result(timeout=30) is True
    yield shared_engine
    deadline = time.monotonic() + 10
    while shared_engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not shared_engine.has_work(), "a test left requests in the engine"


def weights_for(model, version):
    """Distinct weights per version (the trainer's 'update')."""
    return jax.tree.map(lambda p: p * (1.0 + 0.01 * version), model[1])


def make_rows(tokenizer, answers):
    """Loader-style examples: {"prompt_ids", "row"} with the given gold answers (reward scripts)."""
    for i, answer in enumerate(answers):
        question = f"What is {i}+{i % 7}?"
        row = PromptRow(query_id=f"q{i}", messages=[{"role": "user", "content": question}], answer=answer,
                        test_cases=None, task="math", source=f"test.jsonl:{i + 1}")
        yield {"prompt_ids": np.asarray(tokenizer.encode(question), np.int32), "row": row}


def rlvr(**overrides):
    cfg = dict(n_samples=N, max_new_tokens=6, temperature=1.0, reward=REWARD, reward_timeout_s=10.0,
               filter_all_equal_rewards=False)
    cfg.update(overrides)
    return RLVRWorkflow(RLVRConfig(**cfg))


class Version:
    """The trainer's version, as the controller's version_fn sees it."""

    def __init__(self):
        self.value = 0

    def __call__(self):
        return self.value


def wait_until(predicate, timeout=90.0, interval=0.01):
    # A liveness bound, not a speed check: generous, because CI hosts can be loaded many times over.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def settled(controller):
    s = controller.stats()
    return s.in_flight == 0 and s.outbox == 0


def check_rewards(tokenizer, groups, answer_of):
    """Each trajectory's reward equals the reward function applied here to its decoded completion."""
    for g in groups:
        for t in g.trajectories:
            text = tokenizer.decode(t.completion_ids.tolist(), skip_special_tokens=True)
            script = ";".join(d for d in answer_of[g.query_id].split(";") if not d.startswith("sleep"))
            assert t.reward == scripted_reward(text, script)


def check_report(report, staleness):
    """Nothing dropped silently: the report and the staleness counters agree exactly."""
    assert report.balanced
    s = staleness.stats()
    assert s.running == 0
    assert s.submitted == report.admitted and s.accepted == report.accepted
    assert s.rejected == sum(report.rejected.values()) + report.failed + report.in_flight


# ---------------------------------------------------------------------------------------------


def test_admission_never_exceeds_capacity_and_advances_with_version(engine, tokenizer, model):
    eta, B, max_concurrent = 1, 2, 3
    staleness = StalenessManager(eta, B, max_concurrent=8)
    channel = TrajectoryChannel(32)
    version = Version()
    answers = ["sleep=0.3;text_hash"] * 40
    ctl = RolloutController(engine, rlvr(), staleness, channel, make_rows(tokenizer, answers), version_fn=version,
                            tokenizer=tokenizer, max_concurrent=max_concurrent)
    violations, stop = [], threading.Event()

    def watch():  # the bound must hold at every instant, not only at the end
        while not stop.is_set():
            s, v = staleness.stats(), version.value
            if s.running > max_concurrent or s.accepted + s.running > (eta + v + 1) * B:
                violations.append((s, v))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    ctl.start()
    try:
        assert wait_until(lambda: ctl.stats().admitted == (eta + 0 + 1) * B and settled(ctl))
        time.sleep(0.3)
        s = ctl.stats()
        assert s.admitted == 4 and s.accepted == 4 and channel.qsize() == 4
        assert s.peak_in_flight == max_concurrent  # reached, never exceeded
        version.value = 1
        ctl.notify()
        time.sleep(0.3)  # the engine still serves version 0: admission waits for the new weights
        assert ctl.stats().admitted == 4
        assert engine.update_weights(weights_for(model, 1), 1).result(timeout=30)
        assert wait_until(lambda: ctl.stats().admitted == (eta + 1 + 1) * B and settled(ctl))
        time.sleep(0.3)
        assert ctl.stats().admitted == 6
        assert engine.update_weights(weights_for(model, 5), 5).result(timeout=30)
        version.value = 5  # room for 8 more, but at most 3 at once
        ctl.notify()
        assert wait_until(lambda: ctl.stats().in_flight == max_concurrent)
    finally:
        report = ctl.shutdown(timeout=5)
        stop.set()
        watcher.join()
    assert not violations
    assert report.in_flight >= 1  # shut down mid-generation: cancelled, reported, engine requests aborted
    assert report.accepted >= 6 and report.queued == report.accepted == channel.qsize()
    check_report(report, staleness)
    groups = channel.drain()
    check_rewards(tokenizer, groups, {f"q{i}": a for i, a in enumerate(answers)})
    assert all(len(g.trajectories) == N and g.admitted_version in (0, 1, 5) for g in groups)


class SyncTrainer(threading.Thread):
    """Takes B groups, 'trains' at the current version, pushes new weights, bumps the version."""

    def __init__(self, channel, version, engine, model, B, steps, *, bump_first, delay=None, drop_stale=None,
                 controller=None, seed=0):
        super().__init__()
        self.channel, self.version, self.engine, self.model = channel, version, engine, model
        self.B, self.steps, self.bump_first, self.delay, self.drop_stale = B, steps, bump_first, delay, drop_stale
        self.controller = controller
        self.rng = random.Random(seed)
        self.trained: list[tuple[int, TrajectoryGroup]] = []  # (trainer version, group)
        self.dropped: list[tuple[int, TrajectoryGroup]] = []
        self.error = None

    def run(self):
        try:
            for _ in range(self.steps):
                batch = self.channel.get_batch(self.B, timeout=60)
                v = self.version.value
                for g in batch:
                    if self.drop_stale is not None and is_too_stale(g, v, self.drop_stale):
                        self.dropped.append((v, g))
                    else:
                        self.trained.append((v, g))
                if self.delay:
                    time.sleep(self.rng.uniform(0, self.delay))
                push = lambda: self.engine.update_weights(weights_for(self.model, v + 1), v + 1)  # noqa: E731
                if self.bump_first:  # the order the controller's min(version_fn, engine.version) protects
                    self.version.value = v + 1
                    push()
                else:
                    push().result(timeout=30)
                    self.version.value = v + 1
                if self.controller is not None:
                    self.controller.notify()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


@pytest.mark.parametrize("bump_first", [True, False])
def test_max_staleness_zero_is_synchronous(engine, tokenizer, model, bump_first):
    B, steps = 2, 4
    staleness = StalenessManager(0, B, max_concurrent=4)
    channel = TrajectoryChannel(8)
    version = Version()
    answers = ["text_hash" if i % 3 else "const=1" for i in range(100)]  # every third group is filtered out
    ctl = RolloutController(engine, rlvr(filter_all_equal_rewards=True), staleness, channel,
                            make_rows(tokenizer, answers), version_fn=version, tokenizer=tokenizer)
    trainer = SyncTrainer(channel, version, engine, model, B, steps, bump_first=bump_first, controller=ctl)
    ctl.start()
    trainer.start()
    trainer.join(90)
    report = ctl.shutdown(timeout=5)
    assert trainer.error is None and not trainer.is_alive()
    assert len(trainer.trained) == B * steps
    for v, g in trainer.trained:
        assert g.admitted_version == v == g.info["accepted_version"]
        for t in g.trajectories:
            assert len(t.versions) > 0 and (t.versions == v).all(), (v, t.versions)
    assert [v for v, _ in trainer.trained] == [k for k in range(steps) for _ in range(B)]
    assert report.rejected.get("all_equal_rewards", 0) >= steps  # filtered groups freed capacity
    assert report.queued == channel.qsize()
    check_report(report, staleness)
    check_rewards(tokenizer, [g for _, g in trainer.trained], {f"q{i}": a for i, a in enumerate(answers)})


@pytest.mark.parametrize("eta,K,seed", [(1, None, 0), (2, 1, 1), (1, 0, 2)])
def test_random_timings_keep_accounting_exact_and_the_staleness_bound(engine, tokenizer, model, eta, K, seed):
    B, steps = 2, 6
    rng = random.Random(seed)
    staleness = StalenessManager(eta, B, max_concurrent=4)
    channel = TrajectoryChannel(3)  # small: the pump meets backpressure
    version = Version()
    answers = [rng.choice(["sleep_rand=0.15;text_hash", "sleep_rand=0.02;text_hash", "sleep_rand=0.05;raise",
                           "sleep_rand=0.05;const=0"]) for _ in range(200)]
    ctl = RolloutController(engine, rlvr(filter_all_equal_rewards=True), staleness, channel,
                            make_rows(tokenizer, answers), version_fn=version, tokenizer=tokenizer,
                            max_group_age=K)
    trainer = SyncTrainer(channel, version, engine, model, B, steps, bump_first=bool(seed % 2), delay=0.1,
                          drop_stale=K, seed=seed)
    ctl.start()
    trainer.start()
    trainer.join(120)
    report = ctl.shutdown(timeout=5)
    assert trainer.error is None and not trainer.is_alive()
    taken = trainer.trained + trainer.dropped
    assert len(taken) == B * steps
    for v_t, g in taken:
        v_a = g.info["accepted_version"]
        assert v_a <= v_t <= v_a + eta  # the bound the controller guarantees (module docstring)
        for t in g.trajectories:
            assert (t.versions >= g.admitted_version).all() and (t.versions <= v_t).all()
        if K is not None:
            assert not is_too_stale(g, v_a, K)  # checked at acceptance
            assert v_t - g.oldest_version <= eta + K
    if K is not None:  # with the trainer-side check: exact per-token bound
        assert all(v_t - g.oldest_version <= K for v_t, g in trainer.trained)
        assert all(v_t - g.oldest_version > K for v_t, g in trainer.dropped)
    assert report.failed == report.failed_by_error.get("RewardError", 0) and report.failed >= 1
    assert report.queued == channel.qsize()
    assert report.accepted == len(taken) + report.queued
    check_report(report, staleness)
    check_rewards(tokenizer, [g for _, g in taken], {f"q{i}": a for i, a in enumerate(answers)})
    if eta >= 1:  # the run really trained off-policy data (the bounds above were not vacuous)
        assert max(v_t - g.admitted_version for v_t, g in taken) >= 1


def test_filter_rejection_frees_capacity_and_a_raising_reward_fails_the_group(engine, tokenizer, model, caplog):
    staleness = StalenessManager(0, 1, max_concurrent=1)  # one accepted group per version
    channel = TrajectoryChannel(4)
    version = Version()
    answers = ["const=1", "raise", "text_hash", "const=1", "text_hash", "text_hash"]
    ctl = RolloutController(engine, rlvr(filter_all_equal_rewards=True), staleness, channel,
                            make_rows(tokenizer, answers), version_fn=version, tokenizer=tokenizer)
    with caplog.at_level(logging.WARNING, logger="areal_jax.rollout.controller"):
        ctl.start()
        assert wait_until(lambda: ctl.stats().accepted == 1 and settled(ctl))
        time.sleep(0.2)
        s = ctl.stats()
        # the filtered and the failed group each freed their slot; the accepted one filled the version
        assert (s.admitted, s.accepted, s.rejected, s.failed) == (3, 1, {"all_equal_rewards": 1}, 1)
        assert s.failed_by_error == {"RewardError": 1}  # RewardError names the reward and the error
        (g,) = channel.get_batch(1)
        assert g.query_id == "q2" and g.info["source"] == "test.jsonl:3"
        assert len({t.reward for t in g.trajectories}) == N
        # the reward tally covers the filtered group (all 1.0) too, not the failed one
        assert s.finished_trajectories == 2 * N
        assert s.finished_reward_sum == pytest.approx(N * 1.0 + sum(t.reward for t in g.trajectories))
        assert engine.update_weights(weights_for(model, 1), 1).result(timeout=30)
        version.value = 1
        ctl.notify()
        assert wait_until(lambda: ctl.stats().accepted == 2 and settled(ctl))
        ctl.pause()  # pause: capacity is there, nothing is admitted
        assert ctl.wait_idle(timeout=5)
        (g,) = channel.get_batch(1)
        assert g.query_id == "q4" and all((t.versions == 1).all() for t in g.trajectories)
        assert engine.update_weights(weights_for(model, 2), 2).result(timeout=30)
        version.value = 2
        ctl.notify()
        time.sleep(0.2)
        assert ctl.stats().admitted == 5 and ctl.stats().paused
        ctl.resume()
        assert wait_until(lambda: ctl.stats().accepted == 3 and settled(ctl))
        assert not ctl.stats().data_exhausted  # no capacity at version 2 any more: no row read ahead
        report = ctl.shutdown(timeout=5)
    assert (report.admitted, report.accepted, report.failed, report.in_flight) == (6, 3, 1, 0)
    assert report.rejected == {"all_equal_rewards": 2} and report.queued == 1
    check_report(report, staleness)
    assert any("test.jsonl:2" in r.getMessage() and f"reward {REWARD!r} raised RuntimeError" in r.getMessage()
               for r in caplog.records)


def test_rewards_through_a_real_reward_pool(engine, tokenizer):
    staleness = StalenessManager(4, 1, max_concurrent=2)
    channel = TrajectoryChannel(8)
    answers = ["text_hash", "raise", "const=1", "text_hash", "sleep=0.05;const=0.25"]
    config = RewardPoolConfig(num_workers=2, timeout_s=10.0, preload=("tests.rollout_fixtures",))
    with RewardPool(config) as pool:
        ctl = RolloutController(engine, rlvr(filter_all_equal_rewards=True), staleness, channel,
                                make_rows(tokenizer, answers), version_fn=Version(), tokenizer=tokenizer,
                                reward_pool=pool)
        ctl.start()
        assert wait_until(lambda: ctl.stats().data_exhausted and settled(ctl), timeout=60)
        report = ctl.shutdown(timeout=5)
        pool_stats = pool.stats()
    # in the pool a raising reward yields 0.0 (the pool's contract), so that group is all-equal
    assert pool_stats.errors == N and pool_stats.succeeded == (len(answers) - 1) * N
    assert report.accepted == 2 and report.rejected == {"all_equal_rewards": 3} and report.failed == 0
    check_report(report, staleness)
    groups = channel.drain()
    assert sorted(g.query_id for g in groups) == ["q0", "q3"]
    check_rewards(tokenizer, groups, {f"q{i}": a for i, a in enumerate(answers)})


# ---- a user workflow plugged in by import path ----------------------------------------------


class TwoTurnWorkflow(RolloutWorkflow):
    """Answer, get a fixed feedback message, answer again; the group holds both turns."""

    def __init__(self, feedback: str, max_new_tokens: int, reward: str = REWARD):
        self.feedback, self.reward = feedback, reward
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)

    async def arun(self, engine_client, row, *, version):
        prompt = np.asarray(row["prompt_ids"], np.int32)
        (first,) = (await engine_client.generate(prompt, self.sampling, n=1)).completions
        feedback = np.asarray(engine_client.tokenizer.encode(self.feedback), np.int32)
        second_prompt = np.concatenate([prompt, first.tokens, feedback])
        (second,) = (await engine_client.generate(second_prompt, self.sampling, n=1)).completions
        reward = await engine_client.reward(self.reward, engine_client.decode(second.tokens), row["row"].answer,
                                            timeout_s=5.0)
        turns = tuple(Trajectory(p, c.tokens, c.logprobs, c.versions, reward, c.stop_reason)
                      for p, c in ((prompt, first), (second_prompt, second)))
        return TrajectoryGroup(row["row"].query_id, turns, admitted_version=version, info={"turns": 2})


class NotAWorkflow:
    def arun(self, engine_client, row, *, version):  # not async
        return None


def test_workflow_plugged_in_by_import_path(engine, tokenizer):
    workflow = load_workflow("tests.test_rollout_controller:TwoTurnWorkflow", feedback="Check again.",
                             max_new_tokens=4)
    assert isinstance(workflow, TwoTurnWorkflow)
    staleness = StalenessManager(1, 2, max_concurrent=2)
    channel = TrajectoryChannel(4)
    answers = ["text_hash"] * 4
    ctl = RolloutController(engine, workflow, staleness, channel, make_rows(tokenizer, answers),
                            version_fn=Version(), tokenizer=tokenizer)
    ctl.start()
    groups = channel.get_batch(4, timeout=60)
    report = ctl.shutdown(timeout=5)
    assert report.accepted == 4 and report.failed == 0
    check_report(report, staleness)
    feedback = tokenizer.encode("Check again.")
    for g in groups:
        first, second = g.trajectories
        expected = np.concatenate([first.prompt_ids, first.completion_ids, feedback])
        np.testing.assert_array_equal(second.prompt_ids, expected)
        text = tokenizer.decode(second.completion_ids.tolist(), skip_special_tokens=True)
        assert first.reward == second.reward == scripted_reward(text, "text_hash")
        assert g.info["turns"] == 2 and g.info["accepted_version"] == 0


class StubbornWorkflow(RolloutWorkflow):
    """Swallows cancellation: `swallow` times (None: forever), as an agent with a broad `except
    BaseException` or a library retrying on anything would."""

    def __init__(self, swallow):
        self.swallow, self.started = swallow, 0

    async def arun(self, engine_client, row, *, version):
        self.started += 1
        swallowed = 0
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if self.swallow is not None and swallowed > self.swallow:
                    raise


@pytest.mark.parametrize("swallow", [1, 3, None])
def test_shutdown_is_bounded_when_a_workflow_swallows_cancellation(engine, tokenizer, swallow):
    """Every in-flight group ends as cancelled within the grace (re-cancelled until it gives in, or
    left behind), the thread stops and nothing is unaccounted for."""
    workflow = StubbornWorkflow(swallow)
    staleness = StalenessManager(4, 2, max_concurrent=3)
    ctl = RolloutController(engine, workflow, staleness, TrajectoryChannel(4), make_rows(tokenizer, ["1"] * 8),
                            version_fn=Version(), tokenizer=tokenizer)
    ctl.start()
    assert wait_until(lambda: ctl.stats().in_flight == 3)
    t0 = time.monotonic()
    report = ctl.shutdown(timeout=1.0)
    assert time.monotonic() - t0 < 30  # the grace is 5 s; without it the thread never stops
    assert (report.admitted, report.accepted, report.in_flight) == (3, 0, 3)
    check_report(report, staleness)


def test_load_workflow_names_the_problem():
    with pytest.raises(ValueError, match="not of the form"):
        load_workflow("tests.test_rollout_controller.TwoTurnWorkflow")
    with pytest.raises(ValueError, match="cannot import"):
        load_workflow("tests.no_such_module:Flow")
    with pytest.raises(ValueError, match="has no attribute"):
        load_workflow("tests.test_rollout_controller:Missing")
    with pytest.raises(TypeError, match="not a class"):
        load_workflow("tests.test_rollout_controller:make_rows")
    with pytest.raises(TypeError, match="async def arun"):
        load_workflow("tests.test_rollout_controller:NotAWorkflow")
    with pytest.raises(ValueError, match="n_samples"):
        RLVRConfig(n_samples=0)
    with pytest.raises(ValueError, match="top_p"):
        RLVRConfig(top_p=0.0)


def test_is_too_stale_closed_form():
    def group(versions):
        t = Trajectory(np.array([1]), np.array(versions) * 0 + 3, np.zeros(len(versions), np.float32),
                       np.array(versions), 0.0)
        return TrajectoryGroup("q", (t,), admitted_version=min(versions, default=0))

    g = group([3, 4, 5])  # oldest token version 3
    assert [is_too_stale(g, v, 1) for v in (3, 4, 5, 6)] == [False, False, True, True]
    assert [is_too_stale(g, v, 0) for v in (3, 4)] == [False, True]
    with pytest.raises(ValueError):
        is_too_stale(g, 3, -1)


def test_data_error_stops_admission_loudly_and_drain_settles_in_flight_groups(engine, tokenizer):
    def rows_then_error():
        yield from make_rows(tokenizer, ["sleep=1.0;text_hash"] * 3)
        raise ValueError("corrupt shard")

    staleness = StalenessManager(4, 2, max_concurrent=4)
    channel = TrajectoryChannel(8)
    ctl = RolloutController(engine, rlvr(), staleness, channel, rows_then_error(), version_fn=Version(),
                            tokenizer=tokenizer)
    ctl.start()
    assert wait_until(lambda: ctl.stats().error is not None)
    with pytest.raises(RuntimeError, match="data iterator raised ValueError: corrupt shard"):
        ctl.check()
    assert ctl.stats().in_flight == 3  # the rows read before the error still run
    report = ctl.shutdown(timeout=10, drain=True, close_channel=True)
    assert (report.admitted, report.accepted, report.in_flight, report.queued) == (3, 3, 0, 3)
    assert "corrupt shard" in report.error
    check_report(report, staleness)
    assert len(channel.get_batch(3)) == 3 and channel.closed


@pytest.mark.parametrize("answer, error", [
    ("raise", f"reward {REWARD!r} raised RuntimeError: scripted reward failure"),
    ("const=nan", f"reward {REWARD!r} returned a non-finite value nan"),
])
def test_rollouts_that_all_fail_stop_admission_with_the_first_error(engine, tokenizer, answer, error):
    """A reward that fails on every row stops the run (RolloutsFailed, the first error named) instead
    of failing row after row until the trainer's batch deadline; a NaN is such a failure, named."""
    staleness = StalenessManager(0, 2, max_concurrent=2)
    channel = TrajectoryChannel(8)
    ctl = RolloutController(engine, rlvr(), staleness, channel, make_rows(tokenizer, [answer] * 1000),
                            version_fn=Version(), tokenizer=tokenizer, max_failures_in_a_row=6)
    ctl.start()
    assert wait_until(lambda: ctl.stats().error is not None)
    with pytest.raises(RolloutsFailed, match="the last 6 rollouts all failed; the first: test.jsonl:1: ") as info:
        ctl.check()
    assert error in str(info.value) and "\n" not in str(info.value)
    report = ctl.shutdown(timeout=10)
    assert report.admitted < 12 and report.accepted == 0  # admission stopped at once, not at a deadline
    check_report(report, staleness)


def test_rows_failing_now_and_then_do_not_stop_admission(engine, tokenizer):
    staleness = StalenessManager(100, 1, max_concurrent=2)
    channel = TrajectoryChannel(64)
    answers = ["raise", "raise", "text_hash"] * 8  # two failures in a row, then a success, ...
    ctl = RolloutController(engine, rlvr(), staleness, channel, make_rows(tokenizer, answers),
                            version_fn=Version(), tokenizer=tokenizer, max_failures_in_a_row=3)
    ctl.start()
    assert wait_until(lambda: ctl.stats().data_exhausted and settled(ctl))
    ctl.check()  # no error: never 3 failed in a row with nothing finishing in between
    report = ctl.shutdown(timeout=10)
    assert (report.admitted, report.accepted, report.failed) == (24, 8, 16) and report.error is None
