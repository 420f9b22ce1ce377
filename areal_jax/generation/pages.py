"""Host-side page management of the paged KV cache: free lists, page tables, what a slot holds.

The pool of each layer has `replicas x pages_per_replica` pages; on a generation mesh with
`data` replicas the pool's page axis is sharded over "data", so replica r owns the global page ids
[r * pages_per_replica, (r + 1) * pages_per_replica) and the slots
[r * slots_per_replica, (r + 1) * slots_per_replica), and a slot's pages always come from its own
replica. Every layer's pool uses the same page ids, so one table serves all layers.

`tables [B, M]` (B slots, M = pages one max-length sequence holds) lists each slot's pages in
position order: page j holds positions [j * S, (j + 1) * S). Entries past a slot's last page
name its replica's first page (never read: attention stops at the slot's length, writes only go
to allocated positions). The table travels with every jitted call (a few KB).

Pages are taken as a sequence grows (`grow`, before each decode chunk) and all given back when
it finishes or is preempted (`release`). Freed pages are reused last-in first-out, so a slot's
pages end up anywhere in its replica's range, in any order.

Shared prompt pages: the samples of one group (same prompt, same weights version) on one replica
hold the prompt's *full* pages together: the first to take a slot registers them as the group's
prefix, later ones put the same page ids first in their tables and take their own pages only from
the prompt's partial last page on (each writes its own copy of it: copy on write, as decode writes
from the prompt's end). A page is reference-counted by the slots holding it and freed when the
last lets go; the prefix is forgotten with its last holder. Writes into a shared page (every
holder's prefill, re-prefill after a swap) write the same prompt under the same weights, so they
agree; a prefix written under other weights is never shared (its key carries the version).

The engine's policy over them lives here too: admission hands out slots with their pages while a
busy replica keeps a watermark free (`take_slots`), and before each chunk `reserve` grows the
running slots oldest first, emptying the newest of a dry replica (vLLM's recompute preemption).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prefix:
    """A group's shareable prompt: `key` names it (request and weights version), `pages` full pages."""

    key: Hashable
    pages: int


class PageAllocator:
    """Free pages per replica and the pages of every slot."""

    def __init__(self, num_slots: int, replicas: int, pages_per_replica: int, page_size: int, table_width: int):
        if num_slots % replicas:
            raise ValueError(f"num_slots {num_slots} must be a multiple of the replicas {replicas}")
        self.num_slots, self.replicas, self.page_size = num_slots, replicas, page_size
        self.pages_per_replica, self.table_width = pages_per_replica, table_width
        self._slots_per_replica = num_slots // replicas
        # Free lists as stacks, lowest ids on top at the start.
        self._free = [list(range((r + 1) * pages_per_replica - 1, r * pages_per_replica - 1, -1))
                      for r in range(replicas)]
        self._held: list[list[int]] = [[] for _ in range(num_slots)]
        self._refs = np.zeros(replicas * pages_per_replica, np.int32)  # slots holding each page
        self._prefixes: dict[tuple[Hashable, int], list[int]] = {}  # (key, replica) -> its shared pages
        self._slot_prefix: list[tuple[Hashable, int] | None] = [None] * num_slots
        self._holders: dict[tuple[Hashable, int], int] = {}  # slots holding each prefix
        self.shared_pages = 0  # page references that took no page (counted at each sharing)
        self.tables = np.zeros((num_slots, table_width), np.int32)
        for slot in range(num_slots):
            self.tables[slot] = self._first_page(slot)
        # Kept free for the sequences already running when admitting new ones (vLLM's watermark):
        # admission that would leave fewer would preempt a running sample at the next chunk.
        self.watermark = max(1, pages_per_replica // 100)

    def replica(self, slot: int) -> int:
        return slot // self._slots_per_replica

    def _first_page(self, slot: int) -> int:
        return self.replica(slot) * self.pages_per_replica

    def free_pages(self, replica: int) -> int:
        return len(self._free[replica])

    def held(self, slot: int) -> int:
        """Pages the slot holds."""
        return len(self._held[slot])

    def pages_for(self, tokens: int) -> int:
        """Pages that hold positions [0, tokens)."""
        return -(-tokens // self.page_size)

    def missing(self, slot: int, tokens: int) -> int:
        """Pages the slot still needs to hold positions [0, tokens)."""
        return max(0, self.pages_for(tokens) - self.held(slot))

    def grow(self, slot: int, tokens: int) -> bool:
        """Makes the slot hold positions [0, tokens): True, or False with nothing taken when its
        replica has too few free pages."""
        need = self.missing(slot, tokens)
        if need > self.table_width - self.held(slot):
            raise ValueError(f"{tokens} tokens need more than the {self.table_width} pages of a page table")
        free = self._free[self.replica(slot)]
        if need > len(free):
            return False
        for _ in range(need):
            self._hold(slot, free.pop())
        return True

    def _hold(self, slot: int, page: int) -> None:
        self.tables[slot, len(self._held[slot])] = page
        self._held[slot].append(page)
        self._refs[page] += 1

    def shareable(self, slot: int, prefix: Prefix | None) -> int:
        """Pages of `prefix` the slot would share on its replica (0: none registered there)."""
        if prefix is None:
            return 0
        return len(self._prefixes.get((prefix.key, self.replica(slot)), ()))

    def start(self, slot: int, tokens: int, prefix: Prefix | None = None) -> bool:
        """An empty slot's pages for positions [0, tokens): the prefix's pages shared where its group
        registered them on this replica, else taken (and registered for the group's later samples).
        False with nothing taken when the replica has too few free pages."""
        if self._held[slot]:
            raise ValueError(f"slot {slot} still holds pages")
        shared = self._prefixes.get((prefix.key, self.replica(slot))) if prefix is not None else None
        if shared is None:
            if not self.grow(slot, tokens):
                return False
            if prefix is not None and prefix.pages and self.held(slot) >= prefix.pages:
                name = (prefix.key, self.replica(slot))
                self._prefixes[name], self._holders[name] = list(self._held[slot][:prefix.pages]), 1
                self._slot_prefix[slot] = name
            return True
        if len(shared) != prefix.pages or self.pages_for(tokens) < prefix.pages:
            raise ValueError(f"prefix {prefix.key!r}: {prefix.pages} pages for {tokens} tokens, registered with "
                             f"{len(shared)}: one key, one prompt")
        if self.pages_for(tokens) - len(shared) > self.free_pages(self.replica(slot)):
            return False
        name = (prefix.key, self.replica(slot))
        for page in shared:
            self._hold(slot, page)
        self._slot_prefix[slot] = name
        self._holders[name] += 1
        self.shared_pages += len(shared)
        return self.grow(slot, tokens)

    def release(self, slot: int) -> None:
        """Lets go of every page of the slot: those no other slot holds are free again."""
        free = self._free[self.replica(slot)]
        for page in reversed(self._held[slot]):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                free.append(page)
        self._held[slot] = []
        self.tables[slot] = self._first_page(slot)
        name, self._slot_prefix[slot] = self._slot_prefix[slot], None
        if name is not None:
            self._holders[name] -= 1
            if self._holders[name] == 0:  # its pages went free with their last holder
                del self._holders[name], self._prefixes[name]

    # ---- the engine's policy over pages -----------------------------------------------------------

    def busy(self, replica: int) -> bool:
        """Whether any slot of the replica holds pages."""
        return self.free_pages(replica) < self.pages_per_replica

    def admission_budget(self) -> int:
        """Pages new samples may take now, over all replicas: a busy replica keeps its watermark."""
        return sum(max(0, self.free_pages(r) - (self.watermark if self.busy(r) else 0)) for r in range(self.replicas))

    def take_slots(self, free: list[int], count: int, tokens: int, prefix: Prefix | None = None
                   ) -> tuple[list[int], list[int]]:
        """Up to `count` of the `free` slots, each given the pages for positions [0, tokens) (sharing
        `prefix`'s full pages within a replica): (taken, left). Slots come from the replica with the
        most free pages after this sample; none is taken that would leave a busy replica with less
        than its watermark (an idle one may be filled)."""
        taken, left = [], list(free)
        full = self.pages_for(tokens)
        while len(taken) < count and left:
            slot = max(left, key=lambda s: self.free_pages(self.replica(s)) + self.shareable(s, prefix))
            r = self.replica(slot)
            if self.free_pages(r) - (full - self.shareable(slot, prefix)) < (self.watermark if self.busy(r) else 0):
                break
            self.start(slot, tokens, prefix)
            taken.append(slot)
            left.remove(slot)
        return taken, left

    def reserve(self, running: list[tuple[int, int]]) -> list[int]:
        """Grows every running slot, `running` = [(slot, tokens)] oldest first, to hold its tokens.
        Where a replica runs dry, the newest of its slots still running gives back its pages (the
        slot itself, when it is the newest) until the older one fits. Returns the slots emptied,
        in order. Each replica holds at least one full sequence, so its oldest slot always fits."""
        emptied: list[int] = []
        for slot, tokens in running:
            while slot not in emptied and not self.grow(slot, tokens):
                r = self.replica(slot)
                victim = [s for s, _ in running if s not in emptied and self.replica(s) == r][-1]
                self.release(victim)
                emptied.append(victim)
        return emptied

    def reserve_all(self, running: list[tuple[int, int]]) -> bool:
        """Grows every slot of `running` = [(slot, tokens)] to hold its tokens when every replica has
        the pages free; False with nothing taken otherwise (no slot is emptied)."""
        need = [0] * self.replicas
        for slot, tokens in running:
            need[self.replica(slot)] += self.missing(slot, tokens)
        if any(n > self.free_pages(r) for r, n in enumerate(need)):
            return False
        for slot, tokens in running:
            grown = self.grow(slot, tokens)
            assert grown, f"slot {slot}: pages counted free are not"
        return True

    def check(self) -> None:
        """Raises AssertionError unless every page is either free or held, by exactly as many slots
        of its replica as its count says (more than one only for a registered prefix's pages), the
        tables list exactly the held pages, and every prefix is the leading pages of its holders."""
        holders: dict[tuple, int] = {}
        for r in range(self.replicas):
            free = list(self._free[r])
            assert len(set(free)) == len(free) and all(self._refs[p] == 0 for p in free), f"replica {r}: free list"
            counts: dict[int, int] = {}
            for slot in range(r * self._slots_per_replica, (r + 1) * self._slots_per_replica):
                held = self._held[slot]
                assert list(self.tables[slot, :len(held)]) == held, f"slot {slot}: table differs from its pages"
                assert (self.tables[slot, len(held):] == self._first_page(slot)).all(), f"slot {slot}: stale entries"
                assert len(set(held)) == len(held), f"slot {slot}: a page twice"
                for page in held:
                    counts[page] = counts.get(page, 0) + 1
                name = self._slot_prefix[slot]
                if name is not None:
                    assert name[1] == r and held[:len(self._prefixes[name])] == self._prefixes[name], \
                        f"slot {slot}: its prefix is not its first pages"
                    holders[name] = holders.get(name, 0) + 1
            assert all(self._refs[p] == n for p, n in counts.items()), f"replica {r}: reference counts"
            shared = {p for pages in (v for (_, rr), v in self._prefixes.items() if rr == r) for p in pages}
            assert all(n == 1 or p in shared for p, n in counts.items()), f"replica {r}: a page shared unregistered"
            want = range(r * self.pages_per_replica, (r + 1) * self.pages_per_replica)
            assert sorted(free + list(counts)) == list(want), f"replica {r}: pages lost or owned twice"
        assert holders == self._holders and set(holders) == set(self._prefixes), "prefix holders"
