"""A trie of token sequences, one node per distinct prefix: what shared-prefix packing lays out.

Training (trainer/prefix_tree.py) packs a group's rows as one trie so each shared prefix runs
once; the engine's re-prefill after a weight swap (generation/reprefill_trie.py) does the same
with the histories of a group's samples in flight, which share their prompt. Host-side NumPy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["PrefixTrie", "place_trie"]


class PrefixTrie:
    """A trie of token sequences, one node per distinct prefix.

    Attributes (after `freeze`): tokens, depth (1-based), parent (-1 for a root), order (the
    node's pre-order index), end (pre-order index past its subtree), all `[nodes]` int arrays,
    indexed by node id; `paths[i]` the node ids of sequence i's prefixes `[L_i]`.
    """

    def __init__(self) -> None:
        self._children: list[dict[int, int]] = [{}]  # node 0 is a virtual root above every first token
        self._token: list[int] = [-1]
        self._parent: list[int] = [-1]
        self.paths: list[np.ndarray] = []

    @property
    def num_nodes(self) -> int:
        return len(self._token) - 1

    def new_nodes(self, seq: Sequence[int]) -> int:
        """How many nodes inserting `seq` would add."""
        node = 0
        for depth, tok in enumerate(seq):
            nxt = self._children[node].get(int(tok))
            if nxt is None:
                return len(seq) - depth
            node = nxt
        return 0

    def insert(self, seq: Sequence[int]) -> None:
        path = np.empty(len(seq), np.int64)
        node = 0
        for depth, tok in enumerate(seq):
            tok = int(tok)
            nxt = self._children[node].get(tok)
            if nxt is None:
                nxt = len(self._token)
                self._children[node][tok] = nxt
                self._children.append({})
                self._token.append(tok)
                self._parent.append(node)
            node = nxt
            path[depth] = nxt
        self.paths.append(path)

    def layout(self) -> dict[str, np.ndarray]:
        """Per node id (0 = the virtual root, unused): token, depth, parent (0 = none), pre-order
        index `order` and subtree end `end` over the real nodes (0-based, children in insertion
        order). Iterative: a sequence thousands of tokens deep must not recurse."""
        n = len(self._token)
        order = np.zeros(n, np.int64)
        size = np.ones(n, np.int64)
        for node in range(n - 1, 0, -1):  # a parent is created before its children
            size[self._parent[node]] += size[node]
        depth = np.zeros(n, np.int64)
        stack = list(reversed(self._children[0].values()))
        at = 0
        while stack:
            node = stack.pop()
            order[node] = at
            depth[node] = depth[self._parent[node]] + 1
            at += 1
            stack.extend(reversed(self._children[node].values()))
        return {"token": np.asarray(self._token, np.int64), "depth": depth, "parent": np.asarray(self._parent),
                "order": order, "end": order + size}


def place_trie(trie: PrefixTrie, row: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], offset: int,
               segment: int) -> dict[str, np.ndarray]:
    """Lays `trie` out in one packed row from index `offset`: `row` = (input_ids, positions,
    segment_ids, key_ends), each `[W]`, get every real node's token, depth - 1, `segment` and its
    subtree's end (row indices). Returns `trie.layout()` for the caller's own per-node arrays."""
    ids, positions, segments, ends = row
    lay = trie.layout()
    real = np.arange(1, len(lay["token"]))
    at = offset + lay["order"][real]  # the row index of each real node
    ids[at] = lay["token"][real]
    positions[at] = lay["depth"][real] - 1
    segments[at] = segment
    ends[at] = offset + lay["end"][real]
    return lay

