"""TrajectoryChannel: oldest-first batches, backpressure, timeouts, close, and concurrent producers."""

import random
import threading
import time

import numpy as np
import pytest

from areal_jax.rollout import ChannelClosed, TrajectoryChannel
from areal_jax.rollout.types import Trajectory, TrajectoryGroup


def _group(query_id: str, admitted_version: int) -> TrajectoryGroup:
    traj = Trajectory(prompt_ids=np.array([1, 2]), completion_ids=np.array([3]), behavior_logprobs=np.array([-0.5]),
                      versions=np.array([admitted_version]), reward=1.0)
    return TrajectoryGroup(query_id=query_id, trajectories=(traj,), admitted_version=admitted_version)


def test_batches_are_oldest_first_with_arrival_order_breaking_ties():
    ch = TrajectoryChannel(10)
    order = [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2), ("f", 1)]
    for q, v in order:
        ch.put(_group(q, v))
    assert ch.qsize() == 6
    assert [g.query_id for g in ch.get_batch(3)] == ["b", "d", "c"]
    ch.put(_group("g", 0))  # arrives late but is older than everything left
    assert [g.query_id for g in ch.get_batch(2)] == ["g", "f"]
    assert [g.query_id for g in ch.drain()] == ["a", "e"]
    assert ch.qsize() == 0


def test_put_blocks_when_full_until_a_batch_is_taken():
    ch = TrajectoryChannel(2)
    ch.put(_group("a", 0))
    ch.put(_group("b", 0))
    assert ch.try_put(_group("x", 0)) is False
    with pytest.raises(TimeoutError):
        ch.put(_group("c", 0), timeout=0.05)
    assert ch.qsize() == 2
    done = threading.Event()

    def producer():
        ch.put(_group("c", 0))
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.05)
    assert not done.is_set()  # still blocked: backpressure
    assert [g.query_id for g in ch.get_batch(1)] == ["a"]
    t.join(2)
    assert done.is_set()
    assert [g.query_id for g in ch.get_batch(2)] == ["b", "c"]


def test_get_batch_waits_for_a_full_batch_and_times_out_without_removing():
    ch = TrajectoryChannel(4)
    ch.put(_group("a", 0))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        ch.get_batch(2, timeout=0.1)
    assert time.monotonic() - t0 >= 0.09
    assert ch.qsize() == 1
    threading.Timer(0.05, lambda: ch.put(_group("b", 0))).start()
    assert [g.query_id for g in ch.get_batch(2, timeout=5)] == ["a", "b"]


def test_close_wakes_waiters_with_channel_closed_and_keeps_groups_for_drain():
    waiting_get = TrajectoryChannel(2)
    waiting_get.put(_group("a", 0))
    waiting_put = TrajectoryChannel(1)
    waiting_put.put(_group("b", 0))
    errors = {}

    def call(name, fn):
        try:
            fn()
        except ChannelClosed as e:
            errors[name] = e

    threads = [threading.Thread(target=call, args=("get", lambda: waiting_get.get_batch(2))),
               threading.Thread(target=call, args=("put", lambda: waiting_put.put(_group("c", 0))))]
    for t in threads:
        t.start()
    time.sleep(0.1)
    assert not errors and all(t.is_alive() for t in threads)  # both blocked
    waiting_get.close()
    waiting_put.close()
    for t in threads:
        t.join(2)
        assert not t.is_alive()
    assert set(errors) == {"get", "put"}
    assert "fewer than the batch of 2" in str(errors["get"]) and "closed" in str(errors["put"])
    with pytest.raises(ChannelClosed):
        waiting_get.try_put(_group("d", 0))
    assert [g.query_id for g in waiting_get.drain()] == ["a"]
    assert [g.query_id for g in waiting_put.drain()] == ["b"]


def test_close_still_serves_a_batch_that_is_already_complete():
    ch = TrajectoryChannel(4)
    for i in range(3):
        ch.put(_group(str(i), i))
    ch.close()
    assert [g.query_id for g in ch.get_batch(2)] == ["0", "1"]
    with pytest.raises(ChannelClosed):
        ch.get_batch(2)
    assert [g.query_id for g in ch.drain()] == ["2"]


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="capacity_groups"):
        TrajectoryChannel(0)
    ch = TrajectoryChannel(2)
    with pytest.raises(ValueError, match="batch_size"):
        ch.get_batch(0)
    with pytest.raises(ValueError, match="exceeds the channel capacity"):
        ch.get_batch(3)
    with pytest.raises(TypeError, match="TrajectoryGroup"):
        ch.put("not a group")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_many_producers_one_consumer_random_timings(seed):
    """Every group arrives exactly once; each batch is the oldest of what was queued when taken."""
    rng = random.Random(seed)
    num_producers, per_producer, batch = 4, 30, 3
    ch = TrajectoryChannel(5)
    delays = [[rng.uniform(0, 0.002) for _ in range(per_producer)] for _ in range(num_producers)]
    versions = [[rng.randrange(4) for _ in range(per_producer)] for _ in range(num_producers)]

    def producer(p):
        for i in range(per_producer):
            time.sleep(delays[p][i])
            ch.put(_group(f"{p}-{i}", versions[p][i]))

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(num_producers)]
    for t in threads:
        t.start()
    got = []
    total = num_producers * per_producer
    while len(got) < total:
        b = ch.get_batch(batch, timeout=10)
        got.extend(b)
        # within a batch, versions never decrease (taken oldest first from one snapshot)
        assert [g.admitted_version for g in b] == sorted(g.admitted_version for g in b)
        time.sleep(rng.uniform(0, 0.003))
    for t in threads:
        t.join(5)
    ids = [g.query_id for g in got]
    assert sorted(ids) == sorted(f"{p}-{i}" for p in range(num_producers) for i in range(per_producer))
    assert ch.qsize() == 0
    # each producer's groups of equal version come out in that producer's put order (arrival ties)
    for p in range(num_producers):
        for v in range(4):
            mine = [int(q.split("-")[1]) for q, g in zip(ids, got) if q.startswith(f"{p}-") and g.admitted_version == v]
            assert mine == sorted(mine)


def test_oldest_first_against_a_reference_under_interleaving():
    """Random puts and gets on one thread compared with a sorted-list reference."""
    rng = random.Random(7)
    ch = TrajectoryChannel(8)
    reference, arrival = [], 0
    for step in range(400):
        if rng.random() < 0.55 and len(reference) < 8:
            v = rng.randrange(5)
            ch.put(_group(str(step), v))
            reference.append((v, arrival, str(step)))
            arrival += 1
        elif reference:
            k = rng.randint(1, len(reference))
            reference.sort()
            expected, reference = [q for _, _, q in reference[:k]], reference[k:]
            assert [g.query_id for g in ch.get_batch(k)] == expected
        assert ch.qsize() == len(reference)
