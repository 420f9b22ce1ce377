"""Re-prefilled histories packed as prefix tries: after a weight swap the samples of one group in
flight share their prompt (and sometimes their first sampled tokens), and recomputing each
history whole would run that prefix once per sample. Here each group's histories form a trie
(`areal_jax.prefix_trie`) whose nodes run once, and every node's keys and values are then written
to each slot whose history passes through it (`models.decoding.TrieRows`). Host-side NumPy.

Budget per row: `width` trie nodes (what the layers compute) and `writes` (slot, position) entries
(what is written, 2 x width by default: a row computing W nodes fills up to 2W cache positions).
A group whose trie passes either is split into several tries; tries go into rows first-fit by
decreasing node count.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np

from areal_jax.prefix_trie import PrefixTrie, place_trie

__all__ = ["TRIE_WRITES_PER_NODE", "TriePacking", "pack_trie_rows", "trie_rows_by_length"]

# Write entries per trie node of a row: a row's histories hold at most this many times its nodes.
TRIE_WRITES_PER_NODE = 2


class TriePacking:
    """Rows of tries: `rows[r]` the (slots, trie) units of row r, and the row arrays (`arrays`)."""

    def __init__(self, rows: list[list[tuple[list[int], PrefixTrie]]], width: int, writes: int) -> None:
        self.rows, self.width, self.writes = rows, width, writes

    @property
    def nodes(self) -> int:
        """Tokens the layers compute (every row's trie nodes)."""
        return sum(trie.num_nodes for row in self.rows for _, trie in row)

    def arrays(self, rows: list[int], num_rows: int) -> tuple[np.ndarray, ...]:
        """`models.decoding.TrieRows` fields of rows `rows` (indices into `self.rows`), padded to
        `num_rows`: input_ids, positions, segment_ids, key_ends `[num_rows, width]`; write_node,
        write_slot, write_pos `[num_rows, writes]` (write_pos -1: no write)."""
        W, E = self.width, self.writes
        ids, positions, segments, ends = (np.zeros((num_rows, W), np.int32) for _ in range(4))
        node, slot = np.zeros((num_rows, E), np.int32), np.zeros((num_rows, E), np.int32)
        pos = np.full((num_rows, E), -1, np.int32)
        for r, row in enumerate(self.rows[i] for i in rows):
            offset = written = 0
            for k, (slots, trie) in enumerate(row):
                lay = place_trie(trie, (ids[r], positions[r], segments[r], ends[r]), offset, k + 1)
                for s, path in zip(slots, trie.paths, strict=True):
                    n = path.size
                    node[r, written:written + n] = offset + lay["order"][path]
                    slot[r, written:written + n] = s
                    pos[r, written:written + n] = np.arange(n)
                    written += n
                offset += trie.num_nodes
        return ids, positions, segments, ends, node, slot, pos


def _units(histories: Mapping[int, np.ndarray], groups: Mapping[int, Hashable], width: int, writes: int
           ) -> list[tuple[list[int], PrefixTrie]]:
    """Each group's histories as tries of at most `width` nodes and `writes` tokens; slots in
    increasing order within a group, groups in order of their first slot."""
    by_group: dict[Hashable, list[int]] = {}
    for slot in sorted(histories):
        by_group.setdefault(groups.get(slot, ("slot", slot)), []).append(slot)
    units = []
    for slots in by_group.values():
        trie, taken, tokens = PrefixTrie(), [], 0
        for slot in slots:
            h = histories[slot]
            if taken and (trie.num_nodes + trie.new_nodes(h) > width or tokens + h.size > writes):
                units.append((taken, trie))
                trie, taken, tokens = PrefixTrie(), [], 0
            trie.insert(h)
            taken.append(slot)
            tokens += h.size
        units.append((taken, trie))
    return units


def pack_trie_rows(histories: Mapping[int, np.ndarray], groups: Mapping[int, Hashable], width: int,
                   writes: int | None = None) -> TriePacking:
    """Histories (slot -> tokens, each at most `width`) of groups (slot -> key; a slot without one is
    its own group) as rows of prefix tries. `writes`: write entries per row (default
    TRIE_WRITES_PER_NODE x width)."""
    writes = TRIE_WRITES_PER_NODE * width if writes is None else writes
    too_long = [slot for slot, h in histories.items() if not 0 < h.size <= min(width, writes)]
    if too_long:
        raise ValueError(f"histories of slots {too_long[:8]} are empty or longer than a packed row ({width})")
    units = _units(histories, groups, width, writes)
    sizes = [(trie.num_nodes, sum(histories[s].size for s in slots)) for slots, trie in units]
    rows = [[units[u] for u in row] for row in _first_fit(sizes, width, writes)]
    return TriePacking(rows, width, writes)


def _first_fit(sizes: list[tuple[int, int]], width: int, writes: int) -> list[list[int]]:
    """Units of (nodes, writes) into rows holding at most `width` nodes and `writes` writes,
    first-fit by decreasing node count: each row's unit indices."""
    rows: list[list[int]] = []
    room: list[list[int]] = []  # per row: [nodes left, writes left]
    for u in sorted(range(len(sizes)), key=lambda u: -sizes[u][0]):
        nodes, tokens = sizes[u]
        for r, (nodes_left, writes_left) in enumerate(room):
            if nodes <= nodes_left and tokens <= writes_left:
                rows[r].append(u)
                room[r] = [nodes_left - nodes, writes_left - tokens]
                break
        else:
            rows.append([u])
            room.append([width - nodes, writes - tokens])
    return rows


def trie_rows_by_length(groups: list[tuple[int, list[int]]], width: int, writes: int | None = None
                        ) -> tuple[int, int]:
    """(rows, nodes) `pack_trie_rows` gives for groups of (prompt length, [each history's tokens
    after the prompt]) whose histories share only their group's prompt: the simulator's count,
    from lengths alone (no tokens, no tries)."""
    writes = TRIE_WRITES_PER_NODE * width if writes is None else writes
    units: list[tuple[int, int]] = []  # (nodes, writes) of each trie
    for prompt, tails in groups:
        nodes = tokens = 0
        for tail in tails:
            h = prompt + tail
            if tokens and (nodes + tail > width or tokens + h > writes):
                units.append((nodes, tokens))
                nodes = tokens = 0
            nodes += h if not tokens else tail
            tokens += h
        units.append((nodes, tokens))
    return len(_first_fit(units, width, writes)), sum(u[0] for u in units)
