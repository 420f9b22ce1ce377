"""Dynamic batching: pack variable-length sequences into fixed-shape rows.

Shapes: N = sequences, L_i = length of sequence i, R = packed rows, T = row length.

1. ffd_allocate groups sequence indices into bins under a token budget (never splitting a
   sequence), so each bin becomes one packed row (or one micro-batch).
2. pack_sequences lays each bin out as one row [T], concatenating its sequences and
   padding the tail, with segment_ids (1..k per row, 0 = padding) for a block-diagonal
   causal attention mask and positions that restart at 0 for every sequence.
3. unpack inverts the layout, so per-token outputs computed on rows map back to sequences.
4. bucket_length rounds row lengths up to a small set of sizes so that jit compiles a
   bounded number of shapes.

Host-side NumPy: packing runs on the trainer host before data is put on devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

RESERVED_KEYS = ("segment_ids", "positions")
DEFAULT_MIN_BUCKET = 128


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def ffd_allocate(lengths: Sequence[int], capacity: int, min_groups: int = 1) -> list[list[int]]:
    """First-fit-decreasing allocation of sequences to bins of at most `capacity` tokens.

    Sequences are visited longest first (ties: lower index first). Each goes into the bin,
    among those it fits in, holding the fewest sequences (ties: the earliest opened bin),
    which balances sequence counts across bins; if it fits nowhere, it opens a new bin.
    To guarantee at least `min_groups` bins, the first `min_groups` sequences visited
    (the longest ones) each open their own bin before any bin is shared, so every bin is
    non-empty and the longest sequences are spread out.

    Args:
        lengths: [N] token counts, each in [1, capacity].
        capacity: token budget per bin (>= 1).
        min_groups: least number of bins (>= 1, <= N).
    Returns:
        Bins in the order they were opened; each a list of indices into `lengths` in the
        order they were placed (non-increasing length). Every index appears exactly once.
    """
    capacity = _check_int("capacity", capacity, 1)
    min_groups = _check_int("min_groups", min_groups, 1)
    lengths = [_check_int(f"lengths[{i}]", n, 1) for i, n in enumerate(lengths)]
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sequence {i} has length {n} > capacity {capacity}")
    if len(lengths) < min_groups:
        raise ValueError(
            f"cannot fill min_groups={min_groups} non-empty bins with {len(lengths)} sequences"
        )

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for idx in order:
        n = lengths[idx]
        best = -1
        if len(bins) >= min_groups:
            for b, load in enumerate(loads):
                if load + n <= capacity and (best < 0 or len(bins[b]) < len(bins[best])):
                    best = b
        if best < 0:
            bins.append([idx])
            loads.append(n)
        else:
            bins[best].append(idx)
            loads[best] += n
    return bins


def pack_sequences(
    seqs: Sequence[Mapping[str, np.ndarray]],
    groups: Sequence[Sequence[int]],
    row_len: int,
    *,
    num_rows: int | None = None,
    pad_values: Mapping[str, float | int] | None = None,
) -> dict[str, np.ndarray]:
    """Lay sequences out in packed rows, one row per group.

    Args:
        seqs: N dicts with the same keys (e.g. input_ids, loss_mask, logprobs, versions);
            every array of sequence i has shape [L_i, ...] (per-token along axis 0).
        groups: R' lists of sequence indices (e.g. from ffd_allocate) covering 0..N-1
            exactly once; row r holds groups[r] in that order.
        row_len: T, tokens per row; must be >= every row's total length.
        num_rows: R >= R'; extra rows are all padding (to keep shapes in a small set).
            Default R = R'.
        pad_values: per-key fill value for padding; default 0.
    Returns:
        For every key, an array [R, T, ...] with the sequence's dtype; plus
        segment_ids [R, T] int32 (1..k for the k sequences of a row, 0 = padding) and
        positions [R, T] int32 (0..L_i-1 within each sequence, 0 on padding).
    """
    row_len = _check_int("row_len", row_len, 1)
    n = len(seqs)
    if n == 0:
        raise ValueError("pack_sequences needs at least one sequence")
    keys = list(seqs[0].keys())
    for key in RESERVED_KEYS:
        if key in keys:
            raise ValueError(f"key {key!r} is produced by pack_sequences; remove it from seqs")
    lengths = _sequence_lengths(seqs, keys)
    _check_cover(groups, n)
    rows = len(groups) if num_rows is None else _check_int("num_rows", num_rows, len(groups))
    pad_values = dict(pad_values or {})
    unknown = set(pad_values) - set(keys)
    if unknown:
        raise ValueError(f"pad_values has keys {sorted(unknown)} not in the sequences")

    for r, group in enumerate(groups):
        total = sum(lengths[i] for i in group)
        if total > row_len:
            raise ValueError(f"row {r} holds {total} tokens > row_len {row_len}")

    out: dict[str, np.ndarray] = {}
    for key in keys:
        arrays = [np.asarray(s[key]) for s in seqs]
        tail = arrays[0].shape[1:]
        dtype = np.result_type(*arrays)
        out[key] = np.full((rows, row_len, *tail), pad_values.get(key, 0), dtype=dtype)
    segment_ids = np.zeros((rows, row_len), np.int32)
    positions = np.zeros((rows, row_len), np.int32)
    for r, group in enumerate(groups):
        offset = 0
        for k, i in enumerate(group):
            span = slice(offset, offset + lengths[i])
            for key in keys:
                out[key][r, span] = seqs[i][key]
            segment_ids[r, span] = k + 1
            positions[r, span] = np.arange(lengths[i])
            offset += lengths[i]
    out["segment_ids"] = segment_ids
    out["positions"] = positions
    return out


def unpack(
    packed: Mapping[str, np.ndarray],
    groups: Sequence[Sequence[int]],
    keys: Sequence[str] | None = None,
) -> list[dict[str, np.ndarray]]:
    """Invert pack_sequences: per-sequence arrays from packed rows.

    Args:
        packed: arrays [R, T, ...] including segment_ids [R, T] (as built by
            pack_sequences; other per-token outputs computed on the rows, e.g. logprobs
            from the model, may be added).
        groups: the groups passed to pack_sequences.
        keys: which arrays to unpack; default every key except segment_ids/positions.
    Returns:
        N dicts, in sequence-index order, each key -> [L_i, ...].
    """
    if "segment_ids" not in packed:
        raise ValueError("packed has no 'segment_ids'; it must come from pack_sequences")
    segment_ids = np.asarray(packed["segment_ids"])
    n = _check_cover(groups, None)
    if segment_ids.shape[0] < len(groups):
        raise ValueError(f"packed has {segment_ids.shape[0]} rows, groups need {len(groups)}")
    if keys is None:
        keys = [k for k in packed if k not in RESERVED_KEYS]
    for key in keys:
        if key not in packed:
            raise ValueError(f"packed has no key {key!r}")
        if np.shape(packed[key])[:2] != segment_ids.shape:
            raise ValueError(
                f"packed[{key!r}] shape {np.shape(packed[key])} does not start with "
                f"segment_ids shape {segment_ids.shape}"
            )
    result: list[dict[str, np.ndarray] | None] = [None] * n
    for r, group in enumerate(groups):
        row = segment_ids[r]
        offset = 0
        for k, i in enumerate(group):
            length = int(np.sum(row == k + 1))
            span = slice(offset, offset + length)
            if length == 0 or not np.all(row[span] == k + 1):
                raise ValueError(f"row {r} segment {k + 1} does not match groups[{r}]")
            result[i] = {key: np.asarray(packed[key])[r, span] for key in keys}
            offset += length
        if np.any(row[offset:] != 0):
            raise ValueError(f"row {r} has more segments than groups[{r}] lists")
    return result  # type: ignore[return-value]


def default_buckets(max_len: int, min_bucket: int = DEFAULT_MIN_BUCKET) -> tuple[int, ...]:
    """min_bucket * 2**k for k = 0, 1, ... up to the first size >= max_len."""
    max_len = _check_int("max_len", max_len, 1)
    size = _check_int("min_bucket", min_bucket, 1)
    sizes = [size]
    while sizes[-1] < max_len:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def bucket_length(
    n: int, buckets: Sequence[int] | None = None, *, min_bucket: int = DEFAULT_MIN_BUCKET
) -> int:
    """Smallest allowed size >= n.

    With `buckets` (a configured list of sizes), the smallest of them >= n; a ValueError
    if n exceeds the largest. Without, the default policy min_bucket * 2**k, so at most
    log2(max / min_bucket) + 1 distinct shapes are ever compiled.
    """
    n = _check_int("n", n, 0)
    if buckets is None:
        return default_buckets(max(n, 1), min_bucket)[-1]
    sizes = sorted(_check_int(f"buckets[{i}]", b, 1) for i, b in enumerate(buckets))
    if not sizes:
        raise ValueError("buckets must not be empty")
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"length {n} exceeds the largest bucket {sizes[-1]}")


def _sequence_lengths(seqs: Sequence[Mapping[str, np.ndarray]], keys: list[str]) -> list[int]:
    if not keys:
        raise ValueError("sequences have no arrays to pack")
    tails = {k: np.shape(seqs[0][k])[1:] for k in keys}
    lengths = []
    for i, s in enumerate(seqs):
        if set(s.keys()) != set(keys):
            raise ValueError(f"sequence {i} has keys {sorted(s)}, expected {sorted(keys)}")
        shapes = {k: np.shape(s[k]) for k in keys}
        if any(len(shape) == 0 for shape in shapes.values()):
            raise ValueError(f"sequence {i} has a scalar array; per-token arrays need axis 0")
        first = {shape[0] for shape in shapes.values()}
        if len(first) != 1:
            raise ValueError(f"sequence {i} arrays disagree on length: {shapes}")
        length = first.pop()
        if length < 1:
            raise ValueError(f"sequence {i} is empty")
        for k in keys:
            if shapes[k][1:] != tails[k]:
                raise ValueError(
                    f"sequence {i} key {k!r} has trailing shape {shapes[k][1:]}, "
                    f"expected {tails[k]}"
                )
        lengths.append(length)
    return lengths


def _check_cover(groups: Sequence[Sequence[int]], n: int | None) -> int:
    """Groups must list 0..n-1 exactly once (n inferred when None); returns n."""
    flat = [i for g in groups for i in g]
    if any(len(g) == 0 for g in groups):
        raise ValueError("groups must not contain empty groups")
    expected = len(flat) if n is None else n
    if sorted(flat) != list(range(expected)):
        raise ValueError(f"groups must list every sequence index 0..{expected - 1} exactly once")
    return expected
