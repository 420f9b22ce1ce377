"""From trajectory groups to packed, fixed-shape micro-batches for the train step.

Shapes: N = sequences, L_i = tokens of sequence i, M = minibatches, R = rows per micro-batch,
T = row length (a bucket size).

1. `build_sequences`: one dict of per-token arrays `[L_i]` per trajectory (the alignment of
   `Trajectory.training_row`) plus `advantages [L_i]` from `compute_advantages` (nonzero only
   on loss-mask tokens, i.e. generated tokens).
2. `make_microbatches`: split the sequences into M token-balanced minibatches (one optimizer
   update each) by this project's own rule (`minibatch_indices`; AReaL's split differs, see
   there): the step's prompt groups in a seeded random order, cut where the running token count
   crosses each k/M of the total, so the stalest groups do not always share the first update;
   inside each, micro-batches (bins, never splitting a sequence) filled longest first: a bin takes
   the row length T (a bucket) of its longest sequence and holds at most `rows_for_bucket(T)`
   rows of it. The token budget `max_tokens_per_microbatch` is per training device: a device's
   share of the rows (R / row_multiple) holds at most budget // T rows of T, so a micro-batch of
   a process whose rows split over D devices carries up to D x budget tokens. Short sequences get
   many short rows (attention costs T^2 per row), long ones few long rows. R is the rows the bin
   fills, rounded up to a quarter of `rows_for_bucket(T)` (`rows_for_bin`): a bin smaller than
   the budget (the last of a minibatch, or a small batch) is not padded to the full budget, and
   at most four row counts per bucket compile.

   (Before issue 40 the budget was per process: a 17,408-token row on 8 devices with a
   32,768-token budget made 8 rows of 17,408 slots for at most 32,768 real tokens, 4.25x
   padding.)

Host-side NumPy, run once per training step on the trainer thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from areal_jax.packing import default_buckets, ffd_allocate, pack_sequences
from areal_jax.ppo import AdvantageConfig, compute_advantages
from areal_jax.api.batches import PAD_VALUES, SEQUENCE_KEYS, PackedBatch
from areal_jax.api.trajectories import TrajectoryGroup
from areal_jax.trainer.prefix_tree import pack_tree_bin, trie_units

def build_sequences(groups: Sequence[TrajectoryGroup], adv_cfg: AdvantageConfig, *,
                    logprobs: Sequence[np.ndarray] | None = None,
                    ref_logprobs: Sequence[np.ndarray] | None = None,
                    reduce_sum: Callable[[np.ndarray], np.ndarray] | None = None) -> list[dict[str, np.ndarray]]:
    """Per-token training arrays `[L_i]` of every trajectory, groups in order.

    The group id of each trajectory (for group-normalized advantages) is its group's index in
    `groups`. Keys: SEQUENCE_KEYS.

    Args:
        logprobs, ref_logprobs: with `adv_cfg.kl_coef > 0`, one `[L_i]` array per trajectory (in
            the order above, aligned like `behavior_logprobs`): the targets' log-probs under the
            policy and under the frozen reference (trainer/reference.py computes both).
        reduce_sum: cross-process float sum (`parallel.agree_sum_array`) when several processes
            each hold part of the step's groups: batch-level advantage statistics then cover the
            global batch (`compute_advantages`). Every process calls this at the same point.
    """
    if not groups:
        raise ValueError("build_sequences needs at least one trajectory group")
    if adv_cfg.kl_coef > 0 and (logprobs is None or ref_logprobs is None):
        raise ValueError("AdvantageConfig.kl_coef > 0 needs per-sequence logprobs and ref_logprobs; use "
                         "areal_jax.trainer.reference.sequences_with_kl (or kl_coef=0)")
    rows, rewards, group_ids, no_eos = [], [], [], []
    for g_index, group in enumerate(groups):
        for traj in group.trajectories:
            rows.append(traj.training_row())
            rewards.append(traj.reward)
            group_ids.append(g_index)
            no_eos.append(traj.stop_reason == "length")  # truncated at the length limit
    if not rows:
        raise ValueError("the trajectory groups hold no trajectories")
    lengths = [len(r["input_ids"]) for r in rows]
    mask = np.zeros((len(rows), max(lengths)), np.float32)  # [N, L_max]
    for i, row in enumerate(rows):
        mask[i, :lengths[i]] = row["loss_mask"]
    kl_inputs = {}
    if adv_cfg.kl_coef > 0:
        kl_inputs = {name: _padded_per_token(name, values, lengths)
                     for name, values in (("logprobs", logprobs), ("ref_logprobs", ref_logprobs))}
    adv = compute_advantages(np.asarray(rewards, np.float64), np.asarray(group_ids, np.int64), mask, adv_cfg,
                             no_eos=np.asarray(no_eos, bool), reduce_sum=reduce_sum, **kl_inputs)
    for i, row in enumerate(rows):
        row["advantages"] = adv[i, :lengths[i]].astype(np.float32)
    return rows


def rows_for_bucket(row_len: int, max_tokens_per_microbatch: int, row_multiple: int = 1) -> int:
    """R for row length T: budget // T rows (at least one) on each of the row_multiple devices
    the rows split over (the process's share of the data-parallel axis), so the budget is tokens
    per training device whatever the device count."""
    return max(1, max_tokens_per_microbatch // row_len) * row_multiple


def rows_for_bin(rows_used: int, max_rows: int, row_multiple: int = 1) -> int:
    """R for a micro-batch whose sequences fill `rows_used` rows, out of at most `max_rows`
    (`rows_for_bucket`): rounded up to a step of a quarter of max_rows (a multiple of
    row_multiple), so each row length compiles at most four row counts."""
    step = max(row_multiple, (max_rows // 4) // row_multiple * row_multiple)
    return min(max_rows, max(step, -(-rows_used // step) * step))


def make_microbatches(
    seqs: Sequence[Mapping[str, np.ndarray]],
    *,
    max_tokens_per_microbatch: int,
    num_minibatches: int,
    buckets: Sequence[int] | None = None,
    row_multiple: int = 1,
    agree_max: Callable[[int], int] | None = None,
    agree_sum: Callable[[int], int] | None = None,
    group_ids: Sequence[int] | None = None,
    shuffle_seed: int | Sequence[int] | None = None,
    share_prefixes: bool = False,
) -> list[list[PackedBatch]]:
    """Minibatches of packed micro-batches.

    Args:
        seqs: N per-token dicts (from `build_sequences`), in group order.
        max_tokens_per_microbatch: tokens of one micro-batch per training device (each of the
            row_multiple devices holds at most budget // T rows of T); a longer sequence is an error.
        num_minibatches: M optimizer updates per step; needs N >= M. Which sequences share a
            minibatch: `minibatch_indices(lengths, M, group_ids, shuffle_seed)`.
        buckets: allowed row lengths, none above the budget (`candidate_row_lengths`); default
            powers of two from 128 below the budget, and the budget.
        row_multiple: the devices a process's rows split over; R is always a multiple of it
            (see `rows_for_bucket`).
        agree_max: cross-process max (e.g. areal_jax.parallel.agree_max). When given, every
            process ends up with the same number of micro-batches per minibatch (padded with
            all-padding micro-batches) and the same shape per micro-batch index, as a global
            array built from process-local rows requires: the row length of each micro-batch is
            agreed before its bin is filled. Called the same number of times, in the same
            order, on every process.
        agree_sum: cross-process sum for the minibatch valid-token count (the loss
            denominator), so the loss is a token mean over the global minibatch.
        group_ids: [N] prompt group of each sequence (`sequence_group_ids`); a group's sequences
            share a minibatch. None: every sequence is its own group.
        shuffle_seed: seeds the order of the groups before the split (e.g. (seed, step)); None
            keeps the given order.
        share_prefixes: each group's sequences of a minibatch packed as a prefix trie, the
            budget counting trie tokens (trainer/prefix_tree.py; TrainEngineConfig.share_prefixes).
            One process only (no agree_max).
    Returns:
        M lists of PackedBatch.
    """
    budget = _positive_int("max_tokens_per_microbatch", max_tokens_per_microbatch)
    m = _positive_int("num_minibatches", num_minibatches)
    row_multiple = _positive_int("row_multiple", row_multiple)
    candidates = candidate_row_lengths(budget, buckets)
    lengths = [len(s["input_ids"]) for s in seqs]
    _check_lengths(lengths, budget, candidates)
    if len(seqs) < m:
        raise ValueError(f"num_minibatches={m} needs at least {m} sequences, got {len(seqs)}")
    if share_prefixes and agree_max is not None:
        raise ValueError("share_prefixes packs on one process only: several training processes (agree_max) "
                         "are not supported with TrainEngineConfig.share_prefixes")

    minibatches = []
    for index in minibatch_indices(lengths, m, group_ids, shuffle_seed):
        valid = int(sum(float(np.asarray(seqs[i]["loss_mask"]).sum()) for i in index))
        if agree_sum is not None:
            valid = agree_sum(valid)
        micro = []
        if share_prefixes:  # bins of whole tries, by trie tokens
            units = trie_units(seqs, index, group_ids, candidates[-1])
            for b, row_len, num_rows in _plan_bins([u[1].num_nodes for u in units], candidates, budget,
                                                   row_multiple, None):
                micro.append(pack_tree_bin(seqs, [units[j] for j in b], row_len, num_rows, valid, row_multiple))
        else:
            for b, row_len, num_rows in _plan_bins([lengths[i] for i in index], candidates, budget, row_multiple,
                                                   agree_max):
                micro.append(_pack_bin(seqs, [index[j] for j in b], lengths, row_len, num_rows, valid))
        minibatches.append(micro)
    return minibatches


def sequence_group_ids(groups: Sequence[TrajectoryGroup]) -> list[int]:
    """[N] the index of each trajectory's group, in `build_sequences` order."""
    return [g for g, group in enumerate(groups) for _ in group.trajectories]


def minibatch_indices(lengths: Sequence[int], num_minibatches: int, group_ids: Sequence[int] | None = None,
                      shuffle_seed: int | Sequence[int] | None = None) -> list[list[int]]:
    """The sequences (indices into `lengths`) of each minibatch `make_microbatches` forms: every
    sequence in exactly one.

    This rule is the project's own. The units are prompt groups (single sequences when there are
    fewer groups than minibatches, so M updates still happen): a group's answers, which share one
    baseline, then share one update. Their order is permuted by
    `np.random.default_rng(shuffle_seed)` (kept as given when None): the trainer receives groups
    oldest first, and an unshuffled cut would always put the stalest tokens in the first update,
    the one whose ratio to the proximal policy is exactly 1 and never clipped. The order is then
    cut into M non-empty contiguous runs whose token counts are nearest total * k / M; a run's
    tokens differ from total / M by at most the largest unit's tokens. (AReaL HEAD does neither:
    it keeps the batch's order and splits individual sequences, not whole groups, into minibatches
    of balanced size.)
    """
    n = len(lengths)
    m = _positive_int("num_minibatches", num_minibatches)
    if n < m:
        raise ValueError(f"num_minibatches={m} needs at least {m} sequences, got {n}")
    if group_ids is None:
        group_ids = range(n)
    elif len(group_ids) != n:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {n} sequences")
    units: dict[int, list[int]] = {}  # group -> its sequences, groups in first-appearance order
    for i, g in enumerate(group_ids):
        units.setdefault(int(g), []).append(i)
    members = list(units.values())
    if len(members) < m:
        members = [[i] for i in range(n)]
    if shuffle_seed is not None:
        order = np.random.default_rng(shuffle_seed).permutation(len(members))
        members = [members[k] for k in order]
    unit_tokens = [sum(lengths[i] for i in unit) for unit in members]
    return [[i for unit in members[lo:hi] for i in unit] for lo, hi in _balanced_chunks(unit_tokens, m)]


def microbatch_shapes_for_lengths(lengths: Sequence[int], *, max_tokens_per_microbatch: int,
                                  num_minibatches: int, buckets: Sequence[int] | None = None, row_multiple: int = 1,
                                  group_ids: Sequence[int] | None = None,
                                  shuffle_seed: int | Sequence[int] | None = None) -> list[list[tuple[int, int]]]:
    """(rows R, row length T) of each micro-batch of each minibatch that `make_microbatches` builds
    on one process from sequences of these lengths, without building any array (the simulator
    costs a training step from them)."""
    budget = _positive_int("max_tokens_per_microbatch", max_tokens_per_microbatch)
    row_multiple = _positive_int("row_multiple", row_multiple)
    candidates = candidate_row_lengths(budget, buckets)
    _check_lengths(lengths, budget, candidates)
    return [[(rows, row_len) for _, row_len, rows in _plan_bins([lengths[i] for i in index], candidates, budget,
                                                                 row_multiple, None)]
            for index in minibatch_indices(lengths, _positive_int("num_minibatches", num_minibatches), group_ids,
                                           shuffle_seed)]


# ---- helpers ---------------------------------------------------------------------------------------


def _padded_per_token(name: str, values: Sequence[np.ndarray], lengths: Sequence[int]) -> np.ndarray:
    """`[N, L_max]` float64 from N arrays `[L_i]` (zero padded), checking count and lengths."""
    if len(values) != len(lengths):
        raise ValueError(f"{name} has {len(values)} arrays for {len(lengths)} trajectories")
    out = np.zeros((len(lengths), max(lengths)), np.float64)
    for i, (v, n) in enumerate(zip(values, lengths)):
        v = np.asarray(v, np.float64)
        if v.shape != (n,):
            raise ValueError(f"{name}[{i}] has shape {v.shape}, trajectory {i} has {n} tokens")
        out[i, :n] = v
    return out


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def candidate_row_lengths(budget: int, buckets: Sequence[int] | None) -> list[int]:
    """Allowed row lengths, ascending (`buckets` None: powers of two from 128 below the budget,
    and the budget itself). The budget is per device and a row lives on one device, so a bucket
    above the budget is refused (ValueError naming it), as is a bad bucket."""
    if buckets is None:
        return [s for s in default_buckets(budget) if s < budget] + [budget]
    sizes = sorted(set(_positive_int(f"buckets[{i}]", b) for i, b in enumerate(buckets)))
    if not sizes:
        raise ValueError("buckets must not be empty")
    if sizes[-1] > budget:
        raise ValueError(f"the largest bucket ({sizes[-1]}) exceeds max_tokens_per_microbatch ({budget}), the "
                         "tokens of one training device's micro-batch: raise the budget or drop the bucket")
    return sizes


def _check_lengths(lengths: Sequence[int], budget: int, candidates: Sequence[int]) -> None:
    for i, n in enumerate(lengths):
        if n > budget:
            raise ValueError(f"sequence {i} has {n} tokens > max_tokens_per_microbatch {budget}; "
                             "raise the budget or cap generation length")
        if n > candidates[-1]:
            raise ValueError(f"sequence {i} has {n} tokens > the largest bucket {candidates[-1]}; "
                             "add a bucket that holds it")


def _balanced_chunks(lengths: Sequence[int], m: int) -> list[tuple[int, int]]:
    """m non-empty contiguous [lo, hi) ranges whose token sums are as close to total/m as possible."""
    n = len(lengths)
    cum = np.cumsum(lengths)  # cum[i] = tokens of sequences 0..i
    total = float(cum[-1])
    bounds = [0]
    for k in range(1, m):
        target = total * k / m
        # End (exclusive) e whose prefix sum cum[e - 1] is nearest the target.
        e = int(np.searchsorted(cum, target)) + 1  # cum[e - 1] >= target
        if e > 1 and target - cum[e - 2] <= cum[e - 1] - target:
            e -= 1
        e = min(max(e, bounds[-1] + 1), n - (m - k))
        bounds.append(e)
    bounds.append(n)
    return list(zip(bounds[:-1], bounds[1:]))


def _plan_bins(lengths: Sequence[int], candidates: Sequence[int], budget: int, row_multiple: int,
               agree_max: Callable[[int], int] | None) -> list[tuple[list[int], int, int]]:
    """The micro-batches of one minibatch as (bin, row length T, rows R); a bin lists positions
    into `lengths` and packs densely into rows of T.

    Each bin takes T from its longest remaining sequence (the smallest candidate that holds it)
    and fills up to rows_for_bucket(T) rows with the sequences that fit, longest first. Binning
    by tokens alone would let a bin of short sequences fragment so that it only fits a few long
    rows, where attention costs T^2 per row (e.g. 64 sequences of ~60 tokens in one 2048-token
    row instead of 16 rows of 128). Rows are opened and filled exactly as `ffd_allocate(bin, T)`
    would place the bin, so `_pack_bin` reproduces the same layout.

    With agree_max, processes agree on each bin's T before filling it (a process whose longest
    remaining sequence is shorter packs it into the longer rows; one with nothing left adds an
    empty, all-padding bin), then on its R; they stop together when every process is done. A
    T agreed first (rather than bins formed alone and their T agreed after) is what keeps each
    bin within the per-device budget: a bin of short rows would not fit a peer's long rows.
    """
    remaining = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[tuple[list[int], int, int]] = []
    while True:
        want = next(size for size in candidates if size >= lengths[remaining[0]]) if remaining else 0
        row_len = want if agree_max is None else agree_max(want)
        if row_len == 0:
            return bins
        max_rows = rows_for_bucket(row_len, budget, row_multiple)
        free: list[int] = []  # free tokens per opened row
        count: list[int] = []  # sequences per opened row
        members, deferred = [], []
        for i in remaining:
            n = lengths[i]
            fits = [r for r in range(len(free)) if free[r] >= n]
            if n > row_len or (not fits and len(free) == max_rows):
                deferred.append(i)
                continue
            if fits:  # ffd_allocate's rule: the fitting row holding the fewest sequences
                r = min(fits, key=lambda r: (count[r], r))
            else:
                free.append(row_len)
                count.append(0)
                r = len(free) - 1
            free[r] -= n
            count[r] += 1
            members.append(i)
        num_rows = rows_for_bin(len(free), max_rows, row_multiple)
        if agree_max is not None:
            num_rows = agree_max(num_rows)
        bins.append((members, row_len, num_rows))
        remaining = deferred


def _pack_bin(seqs, members: list[int], lengths, row_len: int, num_rows: int, valid: int) -> PackedBatch:
    """Pack the sequences `members` into `num_rows` rows of `row_len` tokens."""
    if not members:
        # Per-token arrays keep their trailing shape (a MoE record is `[L_i, L_moe, k]`).
        arrays = {k: np.full((num_rows, row_len, *np.shape(seqs[0][k])[1:]), PAD_VALUES.get(k, 0), _dtype_of(seqs, k))
                  for k in seqs[0]}
        arrays["segment_ids"] = np.zeros((num_rows, row_len), np.int32)
        arrays["positions"] = np.zeros((num_rows, row_len), np.int32)
        return PackedBatch(arrays, (), valid)
    local_rows = ffd_allocate([lengths[i] for i in members], row_len)  # the layout _rows_at checked
    subset = [seqs[i] for i in members]
    arrays = pack_sequences(subset, local_rows, row_len, num_rows=num_rows,
                            pad_values={k: v for k, v in PAD_VALUES.items() if k in subset[0]})
    rows = tuple(tuple(members[j] for j in row) for row in local_rows)
    return PackedBatch(arrays, rows, valid)


def _dtype_of(seqs, key: str) -> np.dtype:
    return np.asarray(seqs[0][key]).dtype
