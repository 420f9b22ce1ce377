"""trainer/batching.py: trajectory groups -> per-token sequences -> packed micro-batches."""

import dataclasses
import itertools
import threading

import numpy as np
import pytest

from areal_jax.packing import unpack
from areal_jax.ppo import AdvantageConfig
from areal_jax.rollout.types import Trajectory, TrajectoryGroup
from areal_jax.trainer.batching import (
    SEQUENCE_KEYS,
    build_sequences,
    make_microbatches,
    microbatch_shapes_for_lengths,
    minibatch_indices,
    rows_for_bin,
    rows_for_bucket,
    sequence_group_ids,
)


def random_groups(rng, n_groups=5, per_group=3, max_prompt=6, max_completion=12, vocab=50):
    groups = []
    for g in range(n_groups):
        trajs = []
        for _ in range(per_group):
            p, c = int(rng.integers(1, max_prompt + 1)), int(rng.integers(0, max_completion + 1))
            trajs.append(Trajectory(
                prompt_ids=rng.integers(0, vocab, p), completion_ids=rng.integers(0, vocab, c),
                behavior_logprobs=-rng.random(c).astype(np.float32), versions=rng.integers(0, 4, c),
                reward=float(rng.choice([-5.0, 5.0]))))
        groups.append(TrajectoryGroup(query_id=f"q{g}", trajectories=tuple(trajs), admitted_version=0))
    return groups


def test_advantages_land_on_completion_tokens_only():
    rng = np.random.default_rng(0)
    groups = random_groups(rng)
    seqs = build_sequences(groups, AdvantageConfig(norm="none"))
    trajs = [t for g in groups for t in g.trajectories]
    assert len(seqs) == len(trajs)
    for seq, traj in zip(seqs, trajs):
        assert set(seq) == set(SEQUENCE_KEYS)
        P, G = len(traj.prompt_ids), len(traj.completion_ids)
        expected = np.zeros(P + G, np.float32)
        expected[P - 1:P + G - 1] = traj.reward  # targets that are completion tokens
        np.testing.assert_array_equal(seq["advantages"], expected)
        np.testing.assert_array_equal(seq["loss_mask"], expected != 0)


def test_group_normalized_advantages_match_numpy():
    rng = np.random.default_rng(1)
    groups = random_groups(rng, n_groups=3, per_group=4, max_completion=8)
    cfg = AdvantageConfig(norm="group", eps=1e-5)
    seqs = build_sequences(groups, cfg)
    i = 0
    for group in groups:
        # Token-weighted mean / biased std of the group's rewards, by hand.
        tokens = np.concatenate([np.full(len(t.completion_ids), t.reward) for t in group.trajectories])
        mean, std = (tokens.mean(), tokens.std()) if tokens.size else (0.0, 0.0)
        for traj in group.trajectories:
            mask = seqs[i]["loss_mask"] > 0
            np.testing.assert_allclose(seqs[i]["advantages"][mask], (traj.reward - mean) / (std + 1e-5), rtol=1e-5)
            assert np.all(seqs[i]["advantages"][~mask] == 0)
            i += 1


def test_truncated_trajectories_get_zero_reward_with_mask_no_eos():
    rng = np.random.default_rng(3)
    groups = random_groups(rng, n_groups=2, per_group=2, max_completion=6)
    g = groups[0]
    cut = dataclasses.replace(g.trajectories[1], stop_reason="length", completion_ids=np.arange(4),
                              behavior_logprobs=np.zeros(4, np.float32), versions=np.zeros(4, np.int64))
    groups[0] = dataclasses.replace(g, trajectories=(g.trajectories[0], cut))
    cfg = AdvantageConfig(norm="none", reward_bias=1.0)
    on = build_sequences(groups, dataclasses.replace(cfg, mask_no_eos_with_zero=True))
    off = build_sequences(groups, cfg)
    np.testing.assert_array_equal(on[1]["advantages"], 0.0)
    assert np.all(off[1]["advantages"][off[1]["loss_mask"] > 0] == cut.reward + 1.0)
    for i in (0, 2, 3):
        np.testing.assert_array_equal(on[i]["advantages"], off[i]["advantages"])


def test_build_sequences_rejects_kl_penalty_and_empty_input():
    with pytest.raises(ValueError, match="kl_coef"):
        build_sequences(random_groups(np.random.default_rng(0), 1), AdvantageConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="at least one"):
        build_sequences([], AdvantageConfig())


@pytest.mark.parametrize("seed", range(4))
def test_microbatches_cover_every_sequence_once_under_the_budget(seed):
    rng = np.random.default_rng(seed)
    groups = random_groups(rng, n_groups=8, per_group=4)
    seqs = build_sequences(groups, AdvantageConfig())
    gids = sequence_group_ids(groups)
    budget, buckets, m = 64, (8, 16, 32, 64), int(rng.integers(1, 5))
    row_multiple = int(rng.integers(1, 3))
    minibatches = make_microbatches(seqs, max_tokens_per_microbatch=budget, num_minibatches=m, buckets=buckets,
                                    row_multiple=row_multiple, group_ids=gids, shuffle_seed=(seed, 3))
    assert len(minibatches) == m
    lengths = np.array([len(s["input_ids"]) for s in seqs])
    expected = minibatch_indices(lengths, m, gids, (seed, 3))
    seen, chunk_tokens = [], []
    for mb, want in zip(minibatches, expected):
        indices = sorted(i for micro in mb for i in micro.sequence_indices)
        # The split minibatch_indices chose; denominator = the minibatch's loss-mask tokens.
        assert indices == sorted(want)
        valid = sum(seqs[i]["loss_mask"].sum() for i in indices)
        chunk_tokens.append(lengths[indices].sum())
        for micro in mb:
            R, T = micro.shape
            max_rows = rows_for_bucket(T, budget, row_multiple)
            assert T in buckets and R % row_multiple == 0 and len(micro.rows) <= R <= max_rows
            assert R == rows_for_bin(len(micro.rows), max_rows, row_multiple)
            assert R // row_multiple * T <= budget  # the budget holds per device
            assert micro.minibatch_valid_tokens == valid
            # Unpacking the rows gives back every sequence's arrays exactly.
            local = micro.sequence_indices
            position = {i: j for j, i in enumerate(local)}
            groups = [[position[i] for i in row] for row in micro.rows]
            for i, arrays in zip(local, unpack(micro.arrays, groups, SEQUENCE_KEYS)):
                for key in SEQUENCE_KEYS:
                    np.testing.assert_array_equal(arrays[key], seqs[i][key])
            pad = np.asarray(micro.arrays["segment_ids"]) == 0
            assert np.all(micro.arrays["loss_mask"][pad] == 0) and np.all(micro.arrays["versions"][pad] == -1)
        seen.extend(indices)
    assert sorted(seen) == list(range(len(seqs)))
    # Token balance: a minibatch is off the mean by at most one group.
    group_tokens = np.bincount(gids, weights=lengths)
    assert max(abs(t - lengths.sum() / m) for t in chunk_tokens) <= group_tokens.max()


def best_contiguous_split(tokens, m):
    """Reference: the least max |run - total / m| over every cut of `tokens` into m non-empty runs."""
    target, n = sum(tokens) / m, len(tokens)
    best = np.inf
    for cuts in itertools.combinations(range(1, n), m - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(abs(sum(tokens[a:b]) - target) for a, b in zip(bounds[:-1], bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_minibatch_split_is_seeded_group_whole_and_token_balanced(seed):
    rng = np.random.default_rng(seed)
    n_groups, m = int(rng.integers(4, 9)), int(rng.integers(2, 5))
    sizes = rng.integers(1, 5, n_groups)
    gids = np.repeat(np.arange(n_groups) * 10 + 3, sizes)  # arbitrary ids, groups contiguous
    lengths = rng.integers(5, 200, len(gids))
    split = minibatch_indices(lengths, m, gids, shuffle_seed=(7, seed))
    # Deterministic for a seed; every sequence once; every group whole in one minibatch.
    assert split == minibatch_indices(lengths, m, gids, shuffle_seed=(7, seed))
    assert sorted(i for mb in split for i in mb) == list(range(len(gids)))
    owner = {}
    for k, mb in enumerate(split):
        assert mb
        for i in mb:
            assert owner.setdefault(int(gids[i]), k) == k
    assert len(owner) == n_groups
    # Balance against the best split of the same group order: worse by at most one group.
    order, seen = [], set()
    for mb in split:
        for i in mb:
            if gids[i] not in seen:
                seen.add(gids[i])
                order.append(gids[i])
    group_tokens = {g: lengths[gids == g].sum() for g in order}
    tokens = [group_tokens[g] for g in order]
    ours = max(abs(lengths[mb].sum() - lengths.sum() / m) for mb in split)
    assert ours <= best_contiguous_split(tokens, m) + max(tokens)
    assert ours <= max(tokens)


def test_minibatch_split_shuffles_groups_and_falls_back_to_sequences():
    lengths = np.full(24, 10)
    gids = np.repeat(np.arange(8), 3)  # groups in admission order: group 0 is the stalest
    unshuffled = minibatch_indices(lengths, 4, gids)
    assert unshuffled == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17],
                          [18, 19, 20, 21, 22, 23]]
    firsts = {tuple(minibatch_indices(lengths, 4, gids, shuffle_seed=(0, step))[0]) for step in range(20)}
    assert len(firsts) > 5  # the first update sees different groups from step to step
    assert all(len(mb) == 6 for mb in minibatch_indices(lengths, 4, gids, shuffle_seed=1))  # 2 groups each
    # Fewer groups than minibatches: sequences are the units, so M updates still happen.
    few = minibatch_indices(np.full(6, 10), 4, np.array([0, 0, 0, 1, 1, 1]), shuffle_seed=2)
    assert len(few) == 4 and sorted(i for mb in few for i in mb) == list(range(6))
    with pytest.raises(ValueError, match="group_ids"):
        minibatch_indices(lengths, 4, gids[:-1])


def test_row_counts_per_bucket_are_few_and_within_the_budget():
    rng = np.random.default_rng(7)
    seqs = build_sequences(random_groups(rng, n_groups=10, per_group=4, max_completion=20), AdvantageConfig())
    budget, buckets = 64, (16, 32, 64)
    shapes = {micro.shape for mb in make_microbatches(seqs, max_tokens_per_microbatch=budget, num_minibatches=2,
                                                      buckets=buckets) for micro in mb}
    assert shapes <= {(1, 16), (2, 16), (3, 16), (4, 16), (1, 32), (2, 32), (1, 64)}
    # Per device: 64 // 16 = 4 rows of 16 on each of 2 devices; one row of 64 each.
    assert rows_for_bucket(16, 64, row_multiple=2) == 8 and rows_for_bucket(64, 64, row_multiple=2) == 2
    assert rows_for_bucket(17408, 32768, row_multiple=8) == 8 and rows_for_bucket(1024, 32768, row_multiple=8) == 256
    # Rounded up to a quarter of the budget's rows: at most four row counts per row length.
    assert [rows_for_bin(n, 64) for n in (0, 1, 16, 17, 35, 64)] == [16, 16, 16, 32, 48, 64]
    assert {rows_for_bin(n, 16, row_multiple=4) for n in range(17)} == {4, 8, 12, 16}
    assert {rows_for_bin(n, 6, row_multiple=2) for n in range(7)} == {2, 4, 6}


def test_a_small_batch_is_not_padded_to_the_whole_budget():
    """64 RL sequences of 30-60 tokens under an 8192-token budget fill about 20 rows of 128: the
    micro-batch holds 32 rows (a quarter-budget step), not the budget's 64."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(30, 61, size=64)
    seqs = [{"input_ids": np.zeros(n, np.int32), "targets": np.zeros(n, np.int32),
             "loss_mask": np.ones(n, np.float32), "behavior_logprobs": np.zeros(n, np.float32),
             "versions": np.zeros(n, np.int32), "advantages": np.zeros(n, np.float32)} for n in lengths]
    ((micro,),) = make_microbatches(seqs, max_tokens_per_microbatch=8192, num_minibatches=1)
    used = len(micro.rows)
    assert micro.shape == (rows_for_bin(used, 64), 128) and micro.shape[0] <= 32
    assert micro.num_tokens == lengths.sum()


@pytest.mark.parametrize("seed", range(3))
def test_short_sequences_get_short_rows(seed):
    """RL-sized sequences (40-75 tokens) under a 2048-token budget: every micro-batch uses
    128-token rows (a few sequences each), never a few long rows of many sequences."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(40, 76, size=int(rng.integers(60, 200)))
    seqs = [{"input_ids": np.zeros(n, np.int32), "targets": np.zeros(n, np.int32),
             "loss_mask": np.ones(n, np.float32), "behavior_logprobs": np.zeros(n, np.float32),
             "versions": np.zeros(n, np.int32), "advantages": np.zeros(n, np.float32)} for n in lengths]
    (mb,) = make_microbatches(seqs, max_tokens_per_microbatch=2048, num_minibatches=1)
    assert {micro.shape[1] for micro in mb} == {128} and all(m.shape[0] == 16 for m in mb[:-1])
    # dense packing: all micro-batches but the last hold at least 70% of their slots
    fills = [micro.num_tokens / 2048 for micro in mb]
    assert min(fills[:-1], default=1.0) >= 0.7
    assert sorted(i for micro in mb for i in micro.sequence_indices) == list(range(len(seqs)))


def test_oversize_sequence_is_named():
    rng = np.random.default_rng(3)
    seqs = build_sequences(random_groups(rng, n_groups=2, per_group=2, max_prompt=3, max_completion=3),
                           AdvantageConfig())
    long = dict(seqs[2])
    long = {k: np.concatenate([v] * 20) for k, v in long.items()}
    seqs[2] = long
    with pytest.raises(ValueError, match=r"sequence 2 has \d+ tokens > max_tokens_per_microbatch 32"):
        make_microbatches(seqs, max_tokens_per_microbatch=32, num_minibatches=1, buckets=(16, 32))


def test_argument_errors():
    seqs = build_sequences(random_groups(np.random.default_rng(0), 1, 2), AdvantageConfig())
    with pytest.raises(ValueError, match="at least 3 sequences"):
        make_microbatches(seqs, max_tokens_per_microbatch=64, num_minibatches=3, buckets=(64,))
    with pytest.raises(ValueError, match=r"largest bucket \(64\) exceeds max_tokens_per_microbatch \(32\)"):
        make_microbatches(seqs, max_tokens_per_microbatch=32, num_minibatches=1, buckets=(16, 64))
    long = [dict(seqs[0], input_ids=np.zeros(40, np.int32), loss_mask=np.ones(40, np.float32))]
    with pytest.raises(ValueError, match="sequence 0 has 40 tokens > the largest bucket 32"):
        make_microbatches(long, max_tokens_per_microbatch=64, num_minibatches=1, buckets=(16, 32))


class ThreadAgreement:
    """Cross-'process' max among threads (each thread plays one process), as jax collectives would."""

    def __init__(self, n):
        self.barrier = threading.Barrier(n)
        self.values = {}
        self.calls = {}

    def _agree(self, x, reduce):
        me = threading.get_ident()
        self.calls[me] = self.calls.get(me, 0) + 1
        self.values[me] = x
        self.barrier.wait()
        result = reduce(self.values.values())
        self.barrier.wait()
        return result

    def agree_max(self, x):
        return self._agree(x, max)

    def agree_sum(self, x):
        return self._agree(x, sum)


def in_threads(jobs):
    """Run each (name, fn) in its own thread (one 'process' each); {name: result}."""
    results = {}
    threads = [threading.Thread(target=lambda n=n, f=f: results.__setitem__(n, f())) for n, f in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert set(results) == {n for n, _ in jobs}
    return results


def test_padding_microbatches_up_to_the_agreed_count():
    """A process with fewer micro-batches than its peer adds all-padding ones of the agreed shapes;
    its real ones keep their sequences, and the loss denominator covers both processes."""
    rng = np.random.default_rng(4)
    few = build_sequences(random_groups(rng, 3, 3), AdvantageConfig())
    many = build_sequences(random_groups(rng, 9, 3), AdvantageConfig())
    agreement = ThreadAgreement(2)
    kw = dict(max_tokens_per_microbatch=32, num_minibatches=2, buckets=(16, 32))
    out = in_threads([(name, lambda s=s: make_microbatches(s, agree_max=agreement.agree_max,
                                                           agree_sum=agreement.agree_sum, **kw))
                      for name, s in (("few", few), ("many", many))])
    base, peer = make_microbatches(few, **kw), make_microbatches(many, **kw)
    for b, c, p, q in zip(base, peer, out["few"], out["many"]):
        assert len(p) == len(q) > len(b) and [m.shape for m in p] == [m.shape for m in q]
        assert sorted(i for m in p for i in m.sequence_indices) == sorted(i for m in b for i in m.sequence_indices)
        both = b[0].minibatch_valid_tokens + c[0].minibatch_valid_tokens
        assert {m.minibatch_valid_tokens for m in p + q} == {both}
        extra = [m for m in p if not m.rows]
        assert extra
        for m in extra:
            assert m.num_tokens == 0 and m.num_valid_tokens == 0
            assert np.all(m.arrays["versions"] == -1) and np.all(m.arrays["advantages"] == 0)


@pytest.mark.parametrize("row_multiple", [1, 2])
def test_processes_agree_on_microbatch_count_and_shapes(row_multiple):
    """Process A has short sequences, process B long ones: their natural shapes differ. The row
    length is agreed before each bin is filled, so A's short sequences pack into B's longer rows
    and every micro-batch stays within the per-device budget."""
    rng = np.random.default_rng(5)
    a = build_sequences(random_groups(rng, 6, 2, max_prompt=3, max_completion=4), AdvantageConfig())
    b = build_sequences(random_groups(rng, 3, 2, max_prompt=10, max_completion=20), AdvantageConfig())
    agreement = ThreadAgreement(2)
    kw = dict(max_tokens_per_microbatch=64, num_minibatches=2, buckets=(8, 16, 32, 64), row_multiple=row_multiple)
    results = in_threads([(name, lambda s=s: make_microbatches(s, agree_max=agreement.agree_max, **kw))
                          for name, s in (("a", a), ("b", b))])
    alone = make_microbatches(a, **kw)
    assert [[m.shape for m in mb] for mb in results["a"]] == [[m.shape for m in mb] for mb in results["b"]]
    assert [[m.shape for m in mb] for mb in alone] != [[m.shape for m in mb] for mb in results["a"]]
    for name, seqs in (("a", a), ("b", b)):
        covered = sorted(i for mb in results[name] for m in mb for i in m.sequence_indices)
        assert covered == list(range(len(seqs)))
        for m in (m for mb in results[name] for m in mb):
            rows, length = m.shape
            assert rows % row_multiple == 0 and rows // row_multiple * length <= 64


def _plain_seqs(lengths):
    return [{"input_ids": np.zeros(n, np.int32), "targets": np.zeros(n, np.int32),
             "loss_mask": np.ones(n, np.float32), "behavior_logprobs": np.zeros(n, np.float32),
             "versions": np.zeros(n, np.int32), "advantages": np.zeros(n, np.float32)} for n in lengths]


def test_the_budget_is_per_training_device():
    """8 sequences of 17,000 tokens and 64 of 1,000 on a process whose rows split over 8 devices,
    budget 32,768 per device (issue 40's case). By hand: each device holds 32,768 // 17,408 = 1 row
    of 17,408, so the 8 long sequences fill one micro-batch of 8 rows (8 x 408 slots of padding);
    the short ones take rows of 1,024, 32 per device, and fill 64 of the 256 rows allowed, a
    quarter step exactly. Slots 8 x 17,408 + 64 x 1,024 = 204,800 for 200,000 real tokens: 1.024x.
    (With the budget per process, every 17,408-token row took a micro-batch of 8 rows of its own.)"""
    lengths = [17_000] * 8 + [1_000] * 64
    kw = dict(max_tokens_per_microbatch=32_768, num_minibatches=1, row_multiple=8,
              buckets=(1024, 2048, 4096, 8192, 17408, 32768))
    (mb,) = make_microbatches(_plain_seqs(lengths), **kw)
    assert [m.shape for m in mb] == [(8, 17_408), (64, 1_024)]
    assert [sorted(len(r) for r in m.rows) for m in mb] == [[1] * 8, [1] * 64]
    padded = sum(r * t for m in mb for r, t in [m.shape])
    assert (padded, sum(lengths)) == (204_800, 200_000) and padded / sum(lengths) == pytest.approx(1.024)
    # The simulator's shapes (no arrays) are the trainer's.
    assert microbatch_shapes_for_lengths(lengths, **kw) == [[(8, 17_408), (64, 1_024)]]


def test_a_budget_below_the_longest_bucket_is_refused():
    from areal_jax.trainer import TrainEngineConfig

    with pytest.raises(ValueError, match=r"TrainEngineConfig\.max_tokens_per_microbatch \(16384\) is smaller than "
                                         r"the longest of TrainEngineConfig\.row_buckets \(17408\)"):
        TrainEngineConfig(max_tokens_per_microbatch=16384, row_buckets=(1024, 17408))
    assert TrainEngineConfig(max_tokens_per_microbatch=17408, row_buckets=(1024, 17408)).row_buckets == (1024, 17408)
