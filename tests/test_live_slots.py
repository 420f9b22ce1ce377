"""Decode by live slots (generation/live_slots.py): a paged decode chunk's batch holds only the live
slots, each replica's in its own share; tokens, log-probs and versions are those of the full batch."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.generation.live_slots import gather_state, live_order, scatter_outputs
from areal_jax.generation.programs import param_shardings, placed_like
from areal_jax.kernels.paged_attention import paged_attention, reference_paged_attention
from areal_jax.kernels.paged_gpu import auto_splits
from areal_jax.models import ModelConfig, init_params
from tests.test_paged_kernels import INTERPRET, _case

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, family="qwen2")
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 8, 7, 6, 5], [3, 3], [7, 1, 2, 9], [2], [6, 6, 6]]
BASE = dict(num_slots=8, max_seq_len=32, decode_chunk=4, prefill_buckets=(8, 32), reprefill_pack_width=32,
            kv_layout="paged", page_size=4)


def _run(params, *, temperature=0.0, swap=None, prompts=PROMPTS, n=1, new_tokens=3, base=BASE, **config):
    """Every sample's (tokens, logprobs, versions, stop reason); request i asks for `new_tokens` x
    (i + 1) new tokens, so the live slots thin out chunk by chunk; `swap`: weights of version 1
    installed after two engine steps."""
    engine = GenerationEngine((CFG, params), EngineConfig(**{**base, **config}))
    handles = [engine.submit(p, SamplingParams(max_new_tokens=new_tokens * (i + 1), temperature=temperature), n=n,
                             seed=i) for i, p in enumerate(prompts)]
    if swap is not None:
        for _ in range(2):
            engine.step()
        engine.update_weights(swap, version=1)
    engine.run_until_idle()
    out = [(c.tokens, c.logprobs, c.versions, c.stop_reason) for h in handles for c in h.result().completions]
    return engine, out


def _assert_same(got, want):
    for (t1, l1, v1, r1), (t2, l2, v2, r2) in zip(got, want, strict=True):
        np.testing.assert_array_equal(t1, t2)
        np.testing.assert_allclose(l1, l2, atol=2e-5)
        np.testing.assert_array_equal(v1, v2)
        assert r1 == r2


def _bucketed(engine):
    return sorted(n for n in engine._programs.traced if n.startswith("decode[") and "rows=" in n)


def test_decode_rows_are_powers_of_two_from_the_minimum_to_the_replicas_slots():
    ec = EngineConfig(num_slots=240, max_seq_len=64, decode_min_rows=16)
    assert [ec.decode_rows(n) for n in (0, 1, 16, 17, 100, 129, 240)] == [16, 16, 16, 32, 128, 240, 240]
    assert ec.decode_row_counts() == (16, 32, 64, 128, 240)
    assert EngineConfig(num_slots=8, max_seq_len=64, decode_min_rows=2).decode_row_counts(data=2) == (2, 4)
    assert EngineConfig(num_slots=8, max_seq_len=64).decode_row_counts() == (8,)  # 16 >= 8: off
    with pytest.raises(ValueError, match="decode_min_rows"):
        EngineConfig(decode_min_rows=0)


def test_live_order_keeps_each_replicas_slots_in_its_share_and_round_trips():
    ec = EngineConfig(num_slots=8, max_seq_len=64, decode_min_rows=1)
    active = np.array([0, 1, 0, 0, 1, 0, 1, 0], bool)  # replica 0: slot 1; replica 1: slots 4, 6
    order, real = live_order(active, ec, data=2)  # 2 rows per replica
    assert order.tolist() == [1, 0, 4, 6] and real.tolist() == [1, 0, 1, 1]
    state = (np.arange(8), np.arange(8) * 10, active, np.full(8, 5), np.int32(6))
    tokens, positions, act, remaining, exit_free = gather_state(state, order, real)
    assert act.tolist() == real.tolist() and positions[real].tolist() == [10, 40, 60]
    assert exit_free == 2  # 4 slots left out of the batch: free there, so the batch needs 4 fewer
    out = np.arange(4)[:, None] * np.ones((1, 3), int) + 1  # [B', C]
    back, none = scatter_outputs((out, None), order, real, 8)
    assert none is None and back[:, 0].tolist() == [0, 1, 0, 0, 3, 0, 4, 0]
    busy = np.array([1, 1, 1, 0, 0, 0, 0, 0], bool)  # 3 live of replica 0's 4: every slot, in place
    assert live_order(busy, ec, data=2)[0].tolist() == list(range(8))


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_tokens_unchanged_by_live_slot_bucketing(temperature):
    """Greedy and sampled, across a weight swap (re-prefill) and a pool small enough to preempt:
    batches of 1, 2 and 4 live slots give the full batch's tokens, log-probs and versions."""
    old, new = init_params(CFG, 0, std=0.3), init_params(CFG, 1, std=0.3)
    kw = dict(temperature=temperature, swap=new, kv_pool_pages=10)
    full, want = _run(old, decode_min_rows=8, **kw)
    live, got = _run(old, decode_min_rows=1, **kw)
    _assert_same(got, want)
    assert _bucketed(full) == [] and len(_bucketed(live)) >= 2, _bucketed(live)
    assert live.stats().preempted_samples > 0 and live.stats().weight_swaps == 1
    live._pages.check()


def test_live_slot_batches_on_data_replicas_equal_one_device():
    """(data=2): each replica's live slots fill its share of the batch, reading only its pages."""
    mesh = jax.make_mesh((2, 1), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:2])
    params = init_params(CFG, 3, std=0.3)
    placed = placed_like(params, param_shardings(CFG, mesh, split=False))
    sharded, got = _run(placed, temperature=1.0, decode_min_rows=1)
    _, want = _run(params, temperature=1.0, decode_min_rows=8)
    _assert_same(got, want)
    assert any("rows=2]" in n or "rows=4]" in n for n in _bucketed(sharded)), _bucketed(sharded)


def test_gpu_kernel_splits_few_programs_and_matches_the_reference():
    assert auto_splits(240, 4, 64, 132) == 1  # enough programs already
    assert auto_splits(16, 4, 64, 132) == 5  # 64 programs: ~2 per SM with 5 splits
    assert auto_splits(1, 1, 3, 132) == 3  # never more splits than blocks
    q, pool, lengths, tables = _case(4, B=2, N=4, K=1, H=16, S=4, P=40, M=16)
    lengths = lengths.at[0].set(61)
    want = reference_paged_attention(q, pool, lengths, tables)
    got = paged_attention(q, pool, lengths, tables, impl="pallas", platform="gpu", interpret=INTERPRET,
                          pages_per_block=2)  # splits from auto_splits: 8 blocks of 2 pages, 2 programs
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
