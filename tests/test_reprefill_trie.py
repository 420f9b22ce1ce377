"""Re-prefill packed as prefix tries (EngineConfig.reprefill_share_prefixes, generation/reprefill_trie.py).

The packing, on random groups of histories sharing prompts: every (slot, position) is written once,
from a node holding that token whose ancestors are exactly the history before it, within each row's
node and write budgets, with fewer nodes than tokens whenever a prompt is shared. The model: a trie
re-prefill writes the same pages and slots as the plain packed one (dense, paged, stacked and FP8
pools). The engine: a run with a weight swap gives the same tokens, log-probs and versions with and
without sharing, and counts the tokens it shared.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from areal_jax.generation import EngineConfig
from areal_jax.generation.reprefill_trie import TRIE_WRITES_PER_NODE, pack_trie_rows
from areal_jax.kernels.paged_attention import gathered_pages, layer_view
from areal_jax.models import init_params
from areal_jax.models.decoding import (TrieRows, prefill_into_pages, prefill_into_slots, prefill_trie_into_pages,
                                       prefill_trie_into_slots)
from areal_jax.models.transformer import KVCache, stack_layers
from tests.test_live_slots import BASE, CFG, _assert_same, _run
from tests.test_overlap_scheduling import NEW, OLD


def _groups(rng, *, num_groups, width, vocab=CFG.vocab_size):
    """slot -> history and slot -> group: each group's samples share a prompt, then diverge (the
    first sampled token is sometimes shared too)."""
    histories, groups, slot = {}, {}, 0
    for g in range(num_groups):
        prompt = rng.integers(1, vocab, rng.integers(1, width // 2))
        first = rng.integers(1, vocab)
        for _ in range(rng.integers(1, 5)):
            tail = rng.integers(1, vocab, rng.integers(0, width - prompt.size))
            if tail.size and rng.random() < 0.3:
                tail[0] = first
            histories[slot] = np.concatenate([prompt, tail]).astype(np.int32)
            groups[slot] = f"g{g}"
            slot += 1
    return histories, groups


@pytest.mark.parametrize("seed", range(6))
def test_every_position_is_written_once_from_the_node_of_its_history(seed):
    rng = np.random.default_rng(seed)
    width = int(rng.choice([16, 32, 64]))
    histories, groups = _groups(rng, num_groups=int(rng.integers(1, 7)), width=width)
    packing = pack_trie_rows(histories, groups, width)
    ids, positions, segments, ends, node, slot, pos = packing.arrays(list(range(len(packing.rows))), len(packing.rows))
    assert node.shape[1] == TRIE_WRITES_PER_NODE * width
    written = set()
    for r in range(len(packing.rows)):
        assert (segments[r] > 0).sum() <= width and (pos[r] >= 0).sum() <= node.shape[1]
        for e in np.flatnonzero(pos[r] >= 0):
            s, p, n = int(slot[r, e]), int(pos[r, e]), int(node[r, e])
            assert (s, p) not in written
            written.add((s, p))
            assert ids[r, n] == histories[s][p] and positions[r, n] == p and segments[r, n] > 0
            # The nodes node n attends to (same trie, before it, their subtree holding it): its
            # ancestors and itself, i.e. the history up to p, one node per position.
            seen = [m for m in range(n + 1) if segments[r, m] == segments[r, n] and ends[r, m] > n]
            assert list(positions[r, seen]) == list(range(p + 1))
            np.testing.assert_array_equal(ids[r, seen], histories[s][:p + 1])
    assert written == {(s, p) for s, h in histories.items() for p in range(h.size)}
    # A trie holding several histories shares at least their prompt's first token.
    tries = [slots for row in packing.rows for slots, _ in row]
    assert all(len({groups[s] for s in slots}) == 1 for slots in tries)
    shares = any(len(slots) > 1 for slots in tries)
    total = sum(h.size for h in histories.values())
    assert packing.nodes < total if shares else packing.nodes == total


def test_a_history_longer_than_a_row_is_refused_by_slot():
    with pytest.raises(ValueError, match=r"slots \[3\].*longer than a packed row \(8\)"):
        pack_trie_rows({1: np.arange(1, 5), 3: np.arange(1, 10)}, {}, 8)


def _plain_rows(histories, width):
    """The same histories packed plainly, one per row: tokens, segment ids, slot ids `[R, W]`."""
    R = len(histories)
    ids, seg, dest = (np.zeros((R, width), np.int32) for _ in range(3))
    for r, (s, h) in enumerate(sorted(histories.items())):
        ids[r, :h.size], seg[r, :h.size], dest[r, :h.size] = h, 1, s
    return ids, seg, dest


@pytest.mark.parametrize("seed", range(3))
def test_a_trie_reprefill_writes_the_dense_slots_of_a_plain_one(seed):
    rng = np.random.default_rng(seed)
    W, B, S = 16, 16, 16
    histories, groups = _groups(rng, num_groups=4, width=W)
    histories = dict(list(histories.items())[:B])
    params = init_params(CFG, seed, std=0.3)
    layer = jnp.zeros((B, CFG.num_kv_heads, S, CFG.head_dim), jnp.float32)
    cache = KVCache((layer,) * CFG.num_layers, (layer,) * CFG.num_layers)
    want = prefill_into_slots(params, CFG, *_plain_rows(histories, W), cache)
    packing = pack_trie_rows(histories, groups, W)
    trie = TrieRows(*packing.arrays(list(range(len(packing.rows))), len(packing.rows)))
    got = jax.jit(lambda c, t: prefill_trie_into_slots(params, CFG, t, c))(cache, trie)
    for a, b in zip(got.k + got.v, want.k + want.v, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


@pytest.mark.parametrize("stacked, kv_dtype", [(False, None), (True, None), (True, "float8_e4m3fn")],
                         ids=["per-layer", "stacked", "stacked-fp8"])
def test_a_trie_reprefill_writes_the_pages_of_a_plain_one(stacked, kv_dtype):
    from areal_jax.generation.paged import zero_pools

    rng = np.random.default_rng(7)
    W, page, M = 16, 4, 4  # M pages of `page` tokens per slot
    histories, groups = _groups(rng, num_groups=3, width=W)
    B = len(histories)
    tables = np.arange(B * M, dtype=np.int32).reshape(B, M)  # slot b owns pages [b*M, (b+1)*M)
    params = init_params(CFG, 3, std=0.3)
    store = jnp.dtype(kv_dtype) if kv_dtype else jnp.float32
    pools = zero_pools(CFG, B * M, page, store, SingleDeviceSharding(jax.devices()[0]), stacked=stacked)
    served = stack_layers(params) if stacked else params
    extra = dict(pages_per_replica=B * M) if stacked else {}
    want = prefill_into_pages(served, CFG, *_plain_rows(histories, W), pools, tables, **extra)
    packing = pack_trie_rows(histories, groups, W)
    trie = TrieRows(*packing.arrays(list(range(len(packing.rows))), len(packing.rows)))
    got = prefill_trie_into_pages(served, CFG, trie, pools, tables, **extra)
    assert packing.nodes < sum(h.size for h in histories.values())
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-5)
    pool = layer_view(got, 0) if stacked else got[0]  # the comparison is not of empty pools
    k, _ = gathered_pages(pool, jnp.asarray(tables))
    assert np.count_nonzero(np.asarray(k)) > 0


@pytest.mark.parametrize("config", [dict(), dict(scan_layers=True), dict(kv_layout="dense"),
                                    dict(scan_layers=True, kv_dtype="float8_e4m3fn")],
                         ids=["paged", "scanned", "dense", "scanned-fp8"])
def test_an_engine_sharing_prompts_at_a_swap_samples_as_one_that_does_not(config):
    """Three samples per request, a weight swap mid-run: the interrupted samples of one request
    re-prefill their prompt once, and nothing they sample changes."""
    plain, want = _run(OLD, swap=NEW, n=3, temperature=1.0, decode_min_rows=1, reprefill_share_prefixes=False, **config)
    shared, got = _run(OLD, swap=NEW, n=3, temperature=1.0, decode_min_rows=1, reprefill_share_prefixes=True, **config)
    _assert_same(got, want)
    assert {tuple(np.unique(v)) for _, _, v, _ in got} >= {(0, 1)}  # samples spanning the swap
    assert shared.stats().reprefill_tokens == plain.stats().reprefill_tokens > 0
    assert plain.stats().reprefill_shared_tokens == 0
    assert shared.stats().reprefill_shared_tokens > 0
    # What the packed calls ran: the trie nodes, the re-prefilled tokens less those shared.
    ran = sum(t.get("tokens", 0) for t in shared.timings()["reprefill"].values())
    assert ran == shared.stats().reprefill_tokens - shared.stats().reprefill_shared_tokens


def test_the_flag_is_validated():
    with pytest.raises(ValueError, match="reprefill_share_prefixes must be a bool"):
        EngineConfig(**BASE, reprefill_share_prefixes=1)


def test_on_a_mesh_the_engine_runs_the_specced_trie_program_and_samples_as_one_device():
    """(data=2, tensor=2), a group of four and a swap: the trie re-prefill program the engine
    compiles is the planner's spec (which compiles), and the samples equal a single-device
    engine's that re-prefills plainly."""
    import dataclasses

    from areal_jax.generation import engine_program_specs
    from tests.test_engine_programs import CFG as MESH_CFG
    from tests.test_engine_programs import MESH_CONFIG, mesh_run_matching_one_device

    # A row of 32 holds two histories' trie.
    plain_cfg = dataclasses.replace(MESH_CONFIG, reprefill_pack_width=32, reprefill_share_prefixes=False)
    shared_cfg = dataclasses.replace(plain_cfg, reprefill_share_prefixes=True)
    prompts = [[1 + i] * n for i, n in enumerate([5, 9, 3])]  # the group of four first: every slot
    sharded, mesh = mesh_run_matching_one_device(shared_cfg, plain_cfg, prompts)
    assert sharded.stats().reprefill_shared_tokens > 0
    specs = {s.name.removeprefix("generation/"): s
             for s in engine_program_specs(MESH_CFG, shared_cfg, mesh=mesh, param_dtype=jnp.float32)}
    traced = set(sharded._programs.traced)
    assert traced <= set(specs), traced - set(specs)
    (name,) = {n for n in traced if n.startswith("reprefill_packed")}
    assert specs[name].lower().compile().memory_analysis() is not None


@pytest.mark.parametrize("seed", range(8))
def test_the_simulators_count_from_lengths_is_the_packings(seed):
    """Histories sharing only their group's prompt: rows and nodes from lengths alone equal the
    packing of the tokens."""
    from areal_jax.generation.reprefill_trie import trie_rows_by_length

    rng = np.random.default_rng(seed)
    width = int(rng.choice([16, 64, 256]))
    histories, groups, lengths, slot, token = {}, {}, [], 0, 1000
    for g in range(int(rng.integers(1, 12))):
        prompt = rng.integers(1, 50, rng.integers(1, width // 2))
        tails = []
        for _ in range(int(rng.integers(1, 9))):
            n = int(rng.integers(0, width - prompt.size + 1))
            tail = np.arange(token, token + n)  # tokens no other history has: only the prompt is shared
            token += n
            histories[slot], groups[slot] = np.concatenate([prompt, tail]).astype(np.int32), g
            tails.append(n)
            slot += 1
        lengths.append((prompt.size, tails))
    packing = pack_trie_rows(histories, groups, width)
    rows, nodes = trie_rows_by_length(lengths, width)
    assert nodes == packing.nodes
    assert rows == len(packing.rows)
