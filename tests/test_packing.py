"""Packing: FFD allocation (hand cases, randomized invariants), pack/unpack round trip,
segment ids / positions, a segment-aware per-token computation on packed rows, buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.packing import (
    bucket_length,
    default_buckets,
    ffd_allocate,
    pack_sequences,
    unpack,
)

# --------------------------------------------------------------------------- ffd_allocate


def test_ffd_hand_case():
    # Visit order 8(i2) 5(i0) 4(i5) 3(i1) 2(i3) 2(i4):
    # 8 -> bin0; 5 -> new bin1; 4 -> bin1 (9); 3 fits nowhere -> bin2;
    # 2(i3) fits bin0 and bin2, both hold 1 -> first (bin0); 2(i4) fits only bin2.
    assert ffd_allocate([5, 3, 8, 2, 2, 4], capacity=10) == [[2, 3], [0, 5], [1, 4]]


def test_ffd_prefers_fewest_sequences_not_lowest_load():
    # After seeding bins with 6 and 1 (min_groups=2) the 1s alternate by count, even
    # though bin1 has far less load.
    assert ffd_allocate([6, 1, 1, 1, 1], capacity=10, min_groups=2) == [[0, 2, 4], [1, 3]]


def test_ffd_min_groups_seeds_longest():
    assert ffd_allocate([1, 1, 1, 1], capacity=100, min_groups=3) == [[0, 3], [1], [2]]
    assert ffd_allocate([3, 9, 4], capacity=100, min_groups=3) == [[1], [2], [0]]
    assert ffd_allocate([7], capacity=7) == [[0]]


def check_allocation(lengths, capacity, min_groups, bins):
    lengths = np.asarray(lengths)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # every index exactly once
    assert len(bins) >= min_groups and all(bins)
    loads = [int(lengths[b].sum()) for b in bins]
    assert max(loads) <= capacity
    assert len(bins) >= -(-lengths.sum() // capacity)
    for b in bins:  # placed longest first
        assert all(np.diff(lengths[b]) <= 0)
    # FFD: a bin opened after the seeds was opened because its first sequence fit in no
    # earlier bin; loads only grow, so it still does not fit their final loads.
    for k in range(min_groups, len(bins)):
        first = lengths[bins[k][0]]
        assert all(loads[j] + first > capacity for j in range(k)), (k, loads)
    if min_groups == 1:  # consequence: at most one bin is at most half full
        assert sum(2 * load <= capacity for load in loads) <= 1


@pytest.mark.parametrize("seed", range(40))
def test_ffd_randomized_invariants(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(8, 300))
    n = int(rng.integers(1, 60))
    lengths = rng.integers(1, capacity + 1, n)
    if seed % 3 == 0:
        lengths = np.minimum(lengths, capacity // 4 + 1)  # many small sequences
    min_groups = int(rng.integers(1, min(n, 6) + 1))
    bins = ffd_allocate(lengths.tolist(), capacity, min_groups)
    check_allocation(lengths, capacity, min_groups, bins)
    assert ffd_allocate(lengths.tolist(), capacity, min_groups) == bins  # deterministic


def test_ffd_accepts_numpy_ints():
    bins = ffd_allocate(np.array([3, 4, 5], np.int32), np.int64(8))
    check_allocation([3, 4, 5], 8, 1, bins)


@pytest.mark.parametrize(
    "args, err, match",
    [
        (([4, 11, 2], 10), ValueError, r"sequence 1 has length 11 > capacity 10"),
        (([4, 0, 2], 10), ValueError, r"lengths\[1\]"),
        (([4, 2], 10, 3), ValueError, "min_groups=3"),
        (([], 10), ValueError, "min_groups"),
        (([4], 0), ValueError, "capacity"),
        (([4], 10, 0), ValueError, "min_groups"),
        (([4.0], 10), TypeError, r"lengths\[0\]"),
        (([4], 10.5), TypeError, "capacity"),
    ],
)
def test_ffd_errors(args, err, match):
    with pytest.raises(err, match=match):
        ffd_allocate(*args)


# --------------------------------------------------------------------------- pack / unpack


def make_seqs(rng, lengths):
    return [
        {
            "input_ids": rng.integers(1, 1000, n).astype(np.int32),
            "loss_mask": rng.random(n) < 0.6,
            "logprobs": -rng.random(n).astype(np.float32),
            "versions": rng.integers(-1, 5, n).astype(np.int32),
            "features": rng.normal(size=(n, 3)),  # trailing dims travel along
        }
        for n in lengths
    ]


def test_pack_hand_case_layout():
    seqs = [{"input_ids": np.array([11, 12, 13])}, {"input_ids": np.array([21, 22])},
            {"input_ids": np.array([31])}]
    packed = pack_sequences(seqs, [[1, 2], [0]], row_len=4, num_rows=3,
                            pad_values={"input_ids": -1})
    np.testing.assert_array_equal(
        packed["input_ids"], [[21, 22, 31, -1], [11, 12, 13, -1], [-1, -1, -1, -1]]
    )
    np.testing.assert_array_equal(packed["segment_ids"], [[1, 1, 2, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(packed["positions"], [[0, 1, 0, 0], [0, 1, 2, 0], [0, 0, 0, 0]])
    assert packed["segment_ids"].dtype == np.int32 and packed["positions"].dtype == np.int32
    back = unpack(packed, [[1, 2], [0]])
    for s, b in zip(seqs, back):
        np.testing.assert_array_equal(s["input_ids"], b["input_ids"])


@pytest.mark.parametrize("seed", range(12))
def test_pack_unpack_round_trip_randomized(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 50, int(rng.integers(1, 25)))
    row_len = bucket_length(int(lengths.max()), min_bucket=16)
    groups = ffd_allocate(lengths.tolist(), row_len, min_groups=1)
    seqs = make_seqs(rng, lengths)
    extra = int(rng.integers(0, 3))
    packed = pack_sequences(seqs, groups, row_len, num_rows=len(groups) + extra)
    rows = len(groups) + extra
    assert packed["input_ids"].shape == (rows, row_len)
    assert packed["features"].shape == (rows, row_len, 3)
    for key in seqs[0]:
        assert packed[key].dtype == seqs[0][key].dtype
    # Segment ids and positions against an independent token-by-token expectation.
    for r, group in enumerate(groups):
        expect_seg = np.concatenate([np.full(lengths[i], k + 1) for k, i in enumerate(group)])
        expect_pos = np.concatenate([np.arange(lengths[i]) for i in group])
        used = len(expect_seg)
        np.testing.assert_array_equal(packed["segment_ids"][r, :used], expect_seg)
        np.testing.assert_array_equal(packed["positions"][r, :used], expect_pos)
        assert np.all(packed["segment_ids"][r, used:] == 0)
        assert np.all(packed["input_ids"][r, used:] == 0)
        assert not packed["loss_mask"][r, used:].any()
    assert np.all(packed["segment_ids"][len(groups):] == 0)
    # Token conservation, then the exact inverse.
    assert (packed["segment_ids"] > 0).sum() == lengths.sum()
    assert packed["loss_mask"].sum() == sum(s["loss_mask"].sum() for s in seqs)
    back = unpack(packed, groups)
    assert len(back) == len(seqs)
    for s, b in zip(seqs, back):
        assert s.keys() == b.keys()
        for key in s:
            np.testing.assert_array_equal(s[key], b[key])


def segment_cumsum(x, segment_ids):
    """Per-token running sum within each segment of a packed row: [R, T] -> [R, T].

    A stand-in for any causal per-token computation: it must not see across sequence
    boundaries. Computed as row cumsum minus the row cumsum just before the segment start.
    """
    total = jnp.cumsum(x, axis=-1)
    t = jnp.arange(x.shape[-1])
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], -1
    )
    start_idx = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    before = jnp.where(start_idx > 0, jnp.take_along_axis(total, jnp.maximum(start_idx - 1, 0), -1), 0)
    return jnp.where(segment_ids > 0, total - before, 0)


def test_per_token_quantity_on_packed_rows_equals_unpacked():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 20, 17)
    seqs = [{"x": rng.normal(size=n).astype(np.float32)} for n in lengths]
    groups = ffd_allocate(lengths.tolist(), 32, min_groups=2)
    packed = pack_sequences(seqs, groups, 32, num_rows=len(groups) + 1)
    assert max(len(g) for g in groups) > 1  # rows really hold several sequences
    packed["y"] = np.asarray(segment_cumsum(jnp.asarray(packed["x"]), jnp.asarray(packed["segment_ids"])))
    for s, b in zip(seqs, unpack(packed, groups, keys=["y"])):
        np.testing.assert_allclose(b["y"], np.cumsum(s["x"]), rtol=1e-5, atol=1e-5)
    # The same computation ignoring segments leaks across boundaries (test is sensitive).
    leaky = np.cumsum(packed["x"], axis=-1)
    assert not np.allclose(leaky[packed["segment_ids"] > 0], packed["y"][packed["segment_ids"] > 0])


def test_pack_errors():
    seqs = [{"a": np.arange(3)}, {"a": np.arange(2)}]
    with pytest.raises(ValueError, match="exactly once"):
        pack_sequences(seqs, [[0]], 8)
    with pytest.raises(ValueError, match="exactly once"):
        pack_sequences(seqs, [[0, 1], [1]], 8)
    with pytest.raises(ValueError, match="empty groups"):
        pack_sequences(seqs, [[0, 1], []], 8)
    with pytest.raises(ValueError, match="row 0 holds 5 tokens > row_len 4"):
        pack_sequences(seqs, [[0, 1]], 4)
    with pytest.raises(ValueError, match="num_rows"):
        pack_sequences(seqs, [[0], [1]], 4, num_rows=1)
    with pytest.raises(ValueError, match="segment_ids"):
        pack_sequences([{"a": np.arange(3), "segment_ids": np.arange(3)}], [[0]], 4)
    with pytest.raises(ValueError, match="disagree on length"):
        pack_sequences([{"a": np.arange(3), "b": np.arange(2)}], [[0]], 4)
    with pytest.raises(ValueError, match="sequence 1 has keys"):
        pack_sequences([{"a": np.arange(3)}, {"b": np.arange(2)}], [[0, 1]], 8)
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        pack_sequences([{"a": np.arange(0)}], [[0]], 4)
    with pytest.raises(ValueError, match="trailing shape"):
        pack_sequences([{"a": np.zeros((2, 3))}, {"a": np.zeros((2, 4))}], [[0], [1]], 4)
    with pytest.raises(ValueError, match="pad_values"):
        pack_sequences(seqs, [[0, 1]], 8, pad_values={"z": 1})
    with pytest.raises(ValueError, match="at least one"):
        pack_sequences([], [], 4)


def test_unpack_errors():
    seqs = [{"a": np.arange(3)}, {"a": np.arange(2)}, {"a": np.arange(1)}]
    packed = pack_sequences(seqs, [[0, 1], [2]], 6)
    with pytest.raises(ValueError, match="segment_ids"):
        unpack({"a": packed["a"]}, [[0, 1], [2]])
    with pytest.raises(ValueError, match="more segments"):
        unpack(packed, [[0], [1, 2]])
    with pytest.raises(ValueError, match="does not match"):
        unpack(packed, [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="no key"):
        unpack(packed, [[0, 1], [2]], keys=["b"])
    with pytest.raises(ValueError, match="shape"):
        unpack({**packed, "bad": np.zeros((2, 5))}, [[0, 1], [2]], keys=["bad"])


# --------------------------------------------------------------------------- buckets


def test_default_bucket_policy():
    assert default_buckets(1000) == (128, 256, 512, 1024)
    assert default_buckets(128) == (128,)
    assert default_buckets(100, min_bucket=32) == (32, 64, 128)
    cases = {0: 128, 1: 128, 128: 128, 129: 256, 1000: 1024, 1025: 2048}
    for n, want in cases.items():
        assert bucket_length(n) == want
    assert bucket_length(33, min_bucket=16) == 64
    sizes = {bucket_length(n) for n in range(1, 4097)}
    assert sizes == {128, 256, 512, 1024, 2048, 4096}  # bounded number of shapes


def test_configured_buckets():
    buckets = [256, 64, 100]
    assert bucket_length(1, buckets) == 64
    assert bucket_length(64, buckets) == 64
    assert bucket_length(65, buckets) == 100
    assert bucket_length(101, buckets) == 256
    with pytest.raises(ValueError, match="length 257 exceeds the largest bucket 256"):
        bucket_length(257, buckets)
    with pytest.raises(ValueError, match="empty"):
        bucket_length(3, [])
    with pytest.raises(ValueError, match=r"buckets\[1\]"):
        bucket_length(3, [8, 0])
    with pytest.raises(ValueError, match="n must be"):
        bucket_length(-1)
    with pytest.raises(ValueError, match="min_bucket"):
        bucket_length(3, min_bucket=0)
