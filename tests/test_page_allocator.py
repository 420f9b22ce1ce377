"""The paged cache's host-side page allocator: invariants under randomized grow/release sequences."""

import numpy as np
import pytest

from areal_jax.generation import EngineConfig
from areal_jax.generation.pages import PageAllocator


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("replicas", [1, 2])
def test_random_grow_and_release_never_lose_or_share_a_page(seed, replicas):
    """Slots grow by random amounts (failing cleanly when their replica is dry), finish or are
    preempted at random: after every operation each page is free or held by one slot of its own
    replica, tables list the held pages; at the end everything is free again."""
    rng = np.random.default_rng(seed)
    B, per_replica, S, M = 8, 12, 4, 10
    pages = PageAllocator(B, replicas, per_replica, S, M)
    tokens = np.zeros(B, int)
    failures = 0
    for _ in range(400):
        slot = int(rng.integers(B))
        if rng.random() < 0.7:
            want = min(tokens[slot] + int(rng.integers(1, 9)), M * S)
            r = pages.replica(slot)
            free_before, held_before = pages.free_pages(r), pages.held(slot)
            ok = pages.grow(slot, want)
            if ok:
                tokens[slot] = max(tokens[slot], want)
                assert pages.held(slot) == -(-tokens[slot] // S)
                assert pages.free_pages(r) == free_before - (pages.held(slot) - held_before)
            else:  # nothing taken
                failures += 1
                assert pages.free_pages(r) == free_before and pages.held(slot) == held_before
                assert pages.missing(slot, want) > free_before
        else:
            pages.release(slot)
            tokens[slot] = 0
        pages.check()
        held = pages.tables[slot, :pages.held(slot)]
        r = pages.replica(slot)
        assert ((held >= r * per_replica) & (held < (r + 1) * per_replica)).all()
    assert failures > 0  # the pool ran dry at times
    for slot in range(B):
        pages.release(slot)
    pages.check()
    assert all(pages.free_pages(r) == per_replica for r in range(replicas))


def test_freed_pages_are_reused_out_of_order():
    pages = PageAllocator(2, 1, 8, 2, 8)
    assert pages.grow(0, 6) and pages.grow(1, 4)  # slot 0: pages 0 1 2, slot 1: 3 4
    pages.release(0)
    assert pages.grow(1, 12)  # slot 1 grows into the pages slot 0 gave back
    assert list(pages.tables[1, :6]) == [3, 4, 0, 1, 2, 5]
    pages.check()
    with pytest.raises(ValueError, match="page table"):
        pages.grow(0, 17)


@pytest.mark.parametrize("seed", range(6))
def test_reserve_preempts_the_newest_of_a_dry_replica_and_keeps_the_oldest(seed):
    """Random running slots (random start order, random growth): after `reserve` every slot left
    holds its tokens, the emptied ones hold nothing, and in each replica the survivors are its
    oldest slots (a prefix of its start order), never fewer than one."""
    rng = np.random.default_rng(seed)
    B, replicas, per_replica, S = 8, 2, 10, 4  # a full sequence: 40 tokens
    pages = PageAllocator(B, replicas, per_replica, S, per_replica)
    tokens = {}
    for slot in rng.permutation(B)[:int(rng.integers(3, B + 1))]:
        t = int(rng.integers(1, 13))
        if pages.grow(int(slot), t):
            tokens[int(slot)] = t
    order = list(tokens)  # start order: oldest first
    running = [(slot, min(tokens[slot] + int(rng.integers(0, 30)), per_replica * S)) for slot in order]
    emptied = pages.reserve(running)
    pages.check()
    for slot, want in running:
        assert pages.held(slot) == (0 if slot in emptied else pages.pages_for(want))
    for r in range(replicas):
        mine = [slot for slot in order if pages.replica(slot) == r]
        alive = [slot not in emptied for slot in mine]
        assert alive == sorted(alive, reverse=True)  # survivors first, then the emptied
        assert not mine or alive[0]


def test_take_slots_keeps_a_busy_replica_s_watermark():
    pages = PageAllocator(4, 2, 200, 4, 100)  # watermark: 2 pages per replica
    taken, left = pages.take_slots([0, 1, 2, 3], 4, 4 * 100)  # 100 pages each
    assert sorted(taken) == [0, 2] and sorted(left) == [1, 3]  # one per replica: a second would dip below
    assert pages.admission_budget() == 2 * (100 - 2)
    taken, _ = pages.take_slots(left, 2, 4 * 98)  # leaves exactly the watermark
    assert sorted(taken) == [1, 3] and pages.admission_budget() == 0
    pages.check()


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(kv_layout="sparse"), "kv_layout"),
    (dict(attention_impl="triton"), "attention_impl"),
    (dict(page_size=0), "page_size"),
    (dict(kv_pool_pages=-1), "kv_pool_pages"),
    (dict(kv_pool_pages=64, kv_pool_bytes=1 << 20), "both set"),
    (dict(max_seq_len=64, page_size=16, kv_pool_pages=3), "less than one sequence"),
    (dict(kv_dtype="float16"), "kv_dtype must be None"),
    (dict(kv_dtype="float8_e4m3fn", kv_layout="dense"), "needs the paged KV cache"),
    (dict(kv_dtype="bfloat16", cache_dtype="float32"), "set one"),
    (dict(on_swap="drop"), "on_swap must be one of"),
])
def test_paged_config_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_pool_size_by_pages_bytes_or_default():
    ec = EngineConfig(num_slots=8, max_seq_len=100, page_size=16)
    assert ec.pages_per_sequence == 7 and ec.pool_pages(page_bytes=1000) == 8 * 7
    assert ec.pool_pages(page_bytes=1000, data=2) == 4 * 7  # per replica
    assert EngineConfig(max_seq_len=100, page_size=16, kv_pool_pages=9).pool_pages(1000) == 9
    assert EngineConfig(max_seq_len=100, page_size=16, kv_pool_bytes=12_999).pool_pages(1000) == 12
    with pytest.raises(ValueError, match="kv_pool_bytes"):
        EngineConfig(max_seq_len=100, page_size=16, kv_pool_bytes=6_999).pool_pages(1000)
    assert EngineConfig(kv_layout="auto").layout("cpu") == "dense"
    assert EngineConfig(kv_layout="auto").layout("tpu") == "paged"
    assert EngineConfig(kv_layout="paged").layout("cpu") == "paged"


def test_fp8_kv_counts_one_byte_per_element_plus_scales():
    """kv_dtype float8_e4m3fn: 1 byte per stored element, 2 x layers x kv heads fp32 scales besides
    the pages; a pool of the same bytes holds about twice a bf16 pool's pages (exactly: the bytes
    less the scales over the FP8 page). Default (None): today's cache_dtype or the weights'."""
    L, K, H, S = 28, 4, 128, 16
    fp8 = EngineConfig(max_seq_len=1024, page_size=S, kv_pool_bytes=1 << 30, kv_dtype="float8_e4m3fn")
    bf16 = EngineConfig(max_seq_len=1024, page_size=S, kv_pool_bytes=1 << 30, kv_dtype="bfloat16")
    default = EngineConfig(max_seq_len=1024, page_size=S, kv_pool_bytes=1 << 30)
    assert (fp8.kv_itemsize("bfloat16"), bf16.kv_itemsize("float32"), default.kv_itemsize("float32")) == (1, 2, 4)
    assert (fp8.storage_dtype("bfloat16"), fp8.block_dtype("bfloat16"), bf16.block_dtype("float32")) == \
        ("float8_e4m3fn", "bfloat16", "bfloat16")
    assert fp8.kv_scale_bytes(L, K, "bfloat16") == 2 * 4 * L * K and bf16.kv_scale_bytes(L, K, "bfloat16") == 0
    page = lambda ec: 2 * L * K * H * S * ec.kv_itemsize("bfloat16")  # noqa: E731
    pages_fp8 = fp8.pool_pages(page(fp8), 1, fp8.kv_scale_bytes(L, K, "bfloat16"))
    pages_bf16 = bf16.pool_pages(page(bf16))
    assert pages_fp8 == ((1 << 30) - 2 * 4 * L * K) // (2 * L * K * H * S) and pages_bf16 == (1 << 30) // page(bf16)
    assert 2 * pages_bf16 - 1 <= pages_fp8 <= 2 * pages_bf16
    assert EngineConfig(kv_dtype="float8_e4m3fn").layout("cpu") == "paged"  # only the paged cache holds FP8
    assert EngineConfig().on_swap == "recompute" and EngineConfig().kv_dtype is None
