"""Shared prompt pages (generation/pages.py): a group's samples hold its prompt's full pages
together. The tokens are those of unshared pages, the pool counts the shared pages once, and the
page accounting stays exact under any sequence of admissions, growth, finishes, aborts, weight
swaps and preemptions."""

import numpy as np
import pytest

from areal_jax.generation.pages import PageAllocator, Prefix
from areal_jax.models import init_params
from tests.test_live_slots import CFG
from tests.test_live_slots import _assert_same as assert_same
from tests.test_live_slots import _run as run_engine

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9], [4, 4, 4, 4, 4, 4, 4, 4, 4]]
BASE = dict(num_slots=6, max_seq_len=32, decode_chunk=4, prefill_buckets=(16, 32), reprefill_pack_width=32,
            kv_layout="paged", page_size=4)


def _run(params, **kw):
    return run_engine(params, prompts=PROMPTS, n=3, new_tokens=4, base=BASE, **kw)


@pytest.mark.parametrize("case", ["swap", pytest.param("preempt", marks=pytest.mark.slow)])
def test_greedy_tokens_unchanged_by_shared_prompt_pages(case):
    """Groups of 3 on 6 slots (later samples start from the kept block) and either a swap that
    re-prefills into the shared pages, or a pool small enough to preempt (resumed samples share
    their group's pages again; greedy tokens do not depend on the schedule, which the shared pool
    changes): the tokens, log-probs and versions of unshared pages; every page free at the end."""
    old, new = init_params(CFG, 0, std=0.3), init_params(CFG, 1, std=0.3)
    kw = dict(swap=new, kv_pool_pages=100) if case == "swap" else dict(kv_pool_pages=10)
    _, want = _run(old, share_prompt_pages=False, **kw)
    engine, got = _run(old, **kw)
    assert_same(got, want)
    stats = engine.stats()
    assert stats.kv_pages_shared > 0
    assert stats.weight_swaps == 1 if case == "swap" else stats.preempted_samples > 0
    pages = engine._pages
    pages.check()
    assert pages.free_pages(0) == pages.pages_per_replica and not pages._prefixes


def test_a_group_takes_its_prompt_pages_once():
    pages = PageAllocator(num_slots=4, replicas=1, pages_per_replica=40, page_size=4, table_width=8)
    prefix = Prefix(("r", 0), 2)  # a 9-token prompt: 2 full pages, the third partial
    taken, left = pages.take_slots([0, 1, 2, 3], 3, 12, prefix)
    assert taken == [0, 1, 2] and left == [3]
    assert pages.free_pages(0) == 40 - 3 - 2 * 1  # 2 shared + 3 x 1 own pages
    assert (pages.tables[:3, :2] == pages.tables[0, :2]).all()  # the prompt's full pages, shared
    assert len({int(pages.tables[s, 2]) for s in range(3)}) == 3  # each its own partial page
    assert pages.shared_pages == 4
    pages.release(0)  # the first holder leaves: the prefix stays with the other two
    assert pages.free_pages(0) == 36 and pages.shareable(3, prefix) == 2
    pages.release(1)
    pages.release(2)
    pages.check()
    assert pages.free_pages(0) == 40 and pages.shareable(3, prefix) == 0


@pytest.mark.parametrize("seed", range(4))
def test_page_accounting_stays_exact_under_random_operations(seed):
    """Random admissions of groups (sharing their prompts, two replicas), growth before chunks with
    preemption when a replica runs dry, finishes, aborts of whole groups and weight swaps (a new
    version: new samples of a group no longer share the old prefix): after every operation each
    page is free or held by exactly the slots its count says, and all come back at the end."""
    rng = np.random.default_rng(seed)
    S, per_replica, slots, width = 4, 24, 8, 8
    pages = PageAllocator(slots, 2, per_replica, S, width)
    running: dict[int, tuple[str, int]] = {}  # slot -> (request, tokens it holds)
    version, shared_total = 0, 0
    for _ in range(300):
        op = rng.choice(["admit", "admit", "grow", "finish", "abort", "swap"])
        free = [s for s in range(slots) if s not in running]
        if op == "admit" and free:
            group = int(rng.integers(5))
            rid, prompt = f"g{group}", 3 + 4 * group  # one prompt per request
            tokens = min(prompt + int(rng.integers(0, 4)), width * S)
            prefix = Prefix((rid, version), prompt // S)
            taken, _ = pages.take_slots(free, int(rng.integers(1, 4)), tokens, prefix)
            running.update({s: (rid, tokens) for s in taken})
        elif op == "grow" and running:  # before a chunk, oldest first; the newest of a dry replica go
            order = sorted(running)
            grown = [(s, min(running[s][1] + int(rng.integers(0, 6)), width * S)) for s in order]
            emptied = pages.reserve(grown)
            for s, tokens in grown:
                running[s] = (running[s][0], tokens)
            for s in emptied:
                del running[s]
        elif op == "finish" and running:
            s = int(rng.choice(list(running)))
            pages.release(s)
            del running[s]
        elif op == "abort" and running:
            rid = running[int(rng.choice(list(running)))][0]
            for s in [s for s, (r, _) in running.items() if r == rid]:
                pages.release(s)
                del running[s]
        elif op == "swap":
            version += 1
        pages.check()
        held = {p for s in running for p in pages.tables[s, :pages.held(s)]}
        assert sum(pages.free_pages(r) for r in range(2)) + len(held) == 2 * per_replica
        assert all(pages.held(s) == pages.pages_for(t) for s, (_, t) in running.items())
        assert pages.shared_pages >= shared_total
        shared_total = pages.shared_pages
    for s in list(running):
        pages.release(s)
    pages.check()
    assert all(pages.free_pages(r) == per_replica for r in range(2)) and not pages._prefixes
    assert shared_total > 0
