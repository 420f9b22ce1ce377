"""Shared-prefix ("tree") packing: a group's rows as one prefix trie, each shared prefix computed once.

`TrainEngineConfig.share_prefixes`. The rows of one prompt group (an agent's sessions and their
turns, or n samples of one prompt) share a prefix: the prompt, and often the first sampled tokens.
Plain packing runs each row whole; here the rows of a group go into a trie of token ids, and the
forward runs each trie node (token) once.

Layout. A trie is laid out in depth-first pre-order, so a node's subtree is the contiguous range
[index, key_end) and its ancestors all come before it. Per packed trie token:
  tree_input_ids   the node's token
  tree_positions   its depth - 1 (positions restart at the branch point's depth in each branch)
  tree_segment_ids the trie's number in its row (1..k; 0 = padding)
  tree_key_ends    the end of the node's subtree (row index): key s is seen by the queries in
                   [s, key_ends[s]), i.e. a token attends exactly to its ancestors and itself
                   (`models.transformer.self_attention_mask`, kernels/flash_attention.py)
  tree_sources     flat index (into the micro-batch's trie rows) of the node's parent, whose
                   hidden state predicts this node's token (a root points at itself)
The log-prob of edge parent -> node (and the parent's entropy) is computed once per node. The
loss is not: the micro-batch also carries every row in the plain packed layout (the keys of
trainer/batching.py, `[R_plain, T]`, each row's own advantage, behaviour log-prob, version and
proximal log-prob), and `tree_index [R_plain, T]` maps each plain token to the trie node its
target is (flat, as tree_sources). The engine gathers the per-node log-probs onto the plain layout
and runs the objective there unchanged, so a shared trained token contributes one loss term per
row through it, each with its row's weights, and its gradient is their sum (the gather's
transpose adds them onto the node).

Budget: bins are filled by trie tokens (what the forward computes); a group whose trie exceeds
the longest row is split into several tries. The plain layout packs the same rows into rows of
the bin's length T, their count rounded up to a power of two (times the row multiple).

Host-side NumPy, as trainer/batching.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from areal_jax.api.batches import PAD_VALUES, PackedBatch
from areal_jax.packing import ffd_allocate, pack_sequences
from areal_jax.prefix_trie import PrefixTrie, place_trie

__all__ = ["TREE_INDEX_KEY", "TREE_KEYS", "PrefixTrie", "pack_tree_bin", "trie_units"]

TREE_KEYS = ("tree_input_ids", "tree_positions", "tree_segment_ids", "tree_key_ends", "tree_sources", "tree_index")
TREE_INDEX_KEY = "tree_index"


def trie_units(seqs: Sequence[dict], members: Sequence[int], group_ids: Sequence[int] | None,
               max_len: int) -> list[tuple[list[int], PrefixTrie]]:
    """The tries of one minibatch: its sequences `members` (indices into seqs) by group (every
    sequence its own group when group_ids is None), each group's rows in one trie, split where a
    trie would pass `max_len` nodes (the longest row)."""
    by_group: dict[int, list[int]] = {}
    for i in members:
        by_group.setdefault(i if group_ids is None else int(group_ids[i]), []).append(i)
    units = []
    for rows in by_group.values():
        trie, taken = PrefixTrie(), []
        for i in rows:
            ids = np.asarray(seqs[i]["input_ids"])
            if taken and trie.num_nodes + trie.new_nodes(ids) > max_len:
                units.append((taken, trie))
                trie, taken = PrefixTrie(), []
            trie.insert(ids)
            taken.append(i)
        units.append((taken, trie))
    return units


def _plain_rows(count: int, row_multiple: int) -> int:
    """Rows of the plain (loss) layout: a power of two, a multiple of row_multiple, so few shapes compile."""
    rows = 1 << max(count - 1, 0).bit_length()
    return -(-rows // row_multiple) * row_multiple


def pack_tree_bin(seqs: Sequence[dict], units: Sequence[tuple[list[int], PrefixTrie]], row_len: int,
                  num_rows: int, valid: int, row_multiple: int = 1) -> PackedBatch:
    """One shared-prefix micro-batch: the tries `units` in `num_rows` trie rows of `row_len` tokens
    (placed as `ffd_allocate` of their node counts), and their sequences in the plain layout (see
    the module docstring). `PackedBatch.rows` describes the plain layout."""
    tree = {k: np.zeros((num_rows, row_len), np.int32) for k in TREE_KEYS if k != TREE_INDEX_KEY}
    node_at: dict[int, np.ndarray] = {}  # sequence -> flat trie index of each of its prefixes [L_i]
    for r, row in enumerate(ffd_allocate([u[1].num_nodes for u in units], row_len)):
        offset = 0
        for k, u in enumerate(row):
            taken, trie = units[u]
            lay = place_trie(trie, tuple(tree[key][r] for key in TREE_KEYS[:4]), offset, k + 1)
            real = np.arange(1, len(lay["token"]))
            flat = r * row_len + offset + lay["order"]  # flat index per node id (the virtual root's unused)
            parent = lay["parent"][real]
            tree["tree_sources"][r, offset + lay["order"][real]] = np.where(parent > 0, flat[parent], flat[real])
            for i, path in zip(taken, trie.paths):
                node_at[i] = flat[path]
            offset += trie.num_nodes
    members = [i for taken, _ in units for i in taken]
    lengths = [len(seqs[i]["input_ids"]) for i in members]
    local_rows = ffd_allocate(lengths, row_len)
    subset = [seqs[i] for i in members]
    arrays = pack_sequences(subset, local_rows, row_len, num_rows=_plain_rows(len(local_rows), row_multiple),
                            pad_values={k: v for k, v in PAD_VALUES.items() if k in subset[0]})
    index = np.zeros(arrays["segment_ids"].shape, np.int32)
    for r, row in enumerate(local_rows):
        offset = 0
        for j in row:
            nodes = node_at[members[j]]
            n = len(nodes)
            # Position t's target is token t + 1: the node of the prefix one longer. The last
            # position has no target in the row (loss mask 0); it points at its own node.
            index[r, offset:offset + n] = np.concatenate([nodes[1:], nodes[-1:]])
            offset += n
    arrays.update(tree)
    arrays[TREE_INDEX_KEY] = index
    rows = tuple(tuple(members[j] for j in row) for row in local_rows)
    return PackedBatch(arrays, rows, valid)
