"""The simulator's paged KV cache: decode costed by live tokens, admission by pool pages,
preemption and resume when the pool runs dry (areal_jax/simulate/generation.py)."""

import dataclasses

import numpy as np
import pytest

from areal_jax.generation.config import EngineConfig
from areal_jax.simulate.config import RowConfig, Workload
from areal_jax.simulate.costs import LinearCosts
from areal_jax.simulate.events import EventQueue
from areal_jax.simulate.generation import SimEngine, SimGroup
from areal_jax.simulate.lengths import LengthSampler, parse_length_spec
from areal_jax.simulate.system import Simulation

ENGINE = EngineConfig(num_slots=48, max_seq_len=432, decode_chunk=8)
WORKLOAD = Workload(hosts=1, devices_per_host=4, batch_groups=8, samples_per_group=4, max_concurrent=8,
                    channel_capacity=32, engine=ENGINE, generation_tensor=1, train_tensor=1,
                    config_generation_devices=2, max_tokens_per_microbatch=1024, num_minibatches=2,
                    max_new_tokens=384, kv_pool_pages=10_000, page_size=16, block_tokens=32)
PROMPT = 16


def simulate(row, spec, workload, costs):
    sampler = LengthSampler(parse_length_spec(spec), cap=workload.max_new_tokens, prompt=PROMPT, seed=row.seed)
    return Simulation(workload, row, costs, sampler, scale_engine=False).run()


def test_equal_lengths_cost_the_weights_per_step_and_the_live_tokens_read():
    # eta 0, one batch at a time, a pool that holds everything: each of the N samples decodes L - 1
    # steps attending over PROMPT + 1 .. PROMPT + L - 1 cached tokens, its kernel reading half a
    # block more per step on average.
    L, d, c, t0 = 100, 1e-3, 2e-7, 0.05
    costs = LinearCosts(decode_step=d, decode_token=c, train_step=t0)
    row = RowConfig(mode="async", eta=0, generation_devices=2, steps=8, warmup_steps=2)
    result = simulate(row, f"constant:length={L}", WORKLOAD, costs)
    N = WORKLOAD.batch_groups * WORKLOAD.samples_per_group
    live = (L - 1) * PROMPT + L * (L - 1) // 2
    read = live + (L - 1) * WORKLOAD.block_tokens // 2
    generation = (L - 1) * d + N * read * c
    assert result.trained_tokens_per_s == pytest.approx(N * L / (generation + t0), rel=1e-9)
    assert result.decode_read_over_live == pytest.approx(read / live, rel=1e-9)
    assert result.preempted_per_step == 0.0


def _run_engine(pool_pages, lengths_per_group, prompt=PROMPT, chunk=8):
    clock = EventQueue()
    done = []
    engine = SimEngine(EngineConfig(num_slots=16, max_seq_len=432, decode_chunk=chunk), 1, LinearCosts(decode_step=1e-3),
                       clock, on_group_done=done.append, on_swap=lambda: None, pool_pages=pool_pages, page_size=16)
    groups = [SimGroup(i, 0, prompt, np.asarray(lengths)) for i, lengths in enumerate(lengths_per_group)]
    peak = [0]
    plan = engine._plan_segment

    def watched(start):  # the pages the active samples hold never exceed the pool
        peak[0] = max(peak[0], engine._pages_in_use(0))
        plan(start)

    engine._plan_segment = watched
    for g in groups:
        engine.submit(g)
    clock.run(lambda: len(done) == len(groups))
    return engine, groups, done, peak[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_small_pool_preempts_and_every_sample_still_generates_exactly_its_tokens(seed):
    rng = np.random.default_rng(seed)
    lengths = [rng.integers(2, 400, 4) for _ in range(10)]
    pool = 60  # 960 tokens: a few long samples at a time (a 432-token sequence needs 27 pages)
    engine, groups, done, peak = _run_engine(pool, lengths)
    assert len(done) == len(groups)
    assert engine.counters.preemptions > 0 and engine.counters.recomputed_tokens > 0
    assert peak <= pool
    for g in groups:  # tokens per sample, over the segments of every version, preempted or not
        assert [sum(n for _, n in segs) for segs in g.segments] == g.lengths.tolist()


def test_a_pool_that_holds_everything_never_preempts_and_admits_by_slots():
    lengths = [[300, 20, 20, 20]] * 4
    engine, groups, done, _ = _run_engine(10_000, lengths)
    assert engine.counters.preemptions == 0 and len(done) == 4


def test_paged_decode_beats_the_dense_window_on_long_tails_at_the_same_per_token_cost():
    # The dense engine reads every slot up to the window of its longest sequence each step
    # (decode_window is per window position over all slots); paged reads each slot's own tokens.
    per_token = 1e-6  # KV traffic dominates the step, as at reasoning lengths
    dense_costs = LinearCosts(decode_step=1e-3, decode_window=per_token * ENGINE.num_slots, train_step=0.01)
    paged_costs = LinearCosts(decode_step=1e-3, decode_token=per_token, train_step=0.01)
    row = RowConfig(mode="async", eta=2, generation_devices=2, steps=10, warmup_steps=2)
    spec = "lognormal:mean=60,sigma=1"
    dense = simulate(row, spec, dataclasses.replace(WORKLOAD, kv_pool_pages=0), dense_costs)
    paged = simulate(row, spec, WORKLOAD, paged_costs)
    assert paged.trained_tokens_per_s > 1.2 * dense.trained_tokens_per_s
    assert dense.decode_read_over_live == 0.0 and 1.0 < paged.decode_read_over_live < 1.5


def test_paged_workload_fields_are_validated():
    with pytest.raises(ValueError, match="kv_pool_pages"):
        dataclasses.replace(WORKLOAD, kv_pool_pages=-1)
    with pytest.raises(ValueError, match="page_size"):
        dataclasses.replace(WORKLOAD, page_size=0)
    with pytest.raises(ValueError, match="holds less than one sequence"):
        SimEngine(ENGINE, 1, LinearCosts(), EventQueue(), on_group_done=lambda g: None, on_swap=lambda: None,
                  pool_pages=5, page_size=16)


def test_keep_swaps_reprefill_nothing_and_recompute_swaps_reprefill_every_history():
    """EngineConfig.on_swap in the simulator: async with eta 2 swaps weights under in-flight samples;
    "recompute" re-prefills their histories (and pays for it), "keep" re-prefills nothing and so
    trains at least as fast at the same decode costs."""
    costs = LinearCosts(decode_step=1e-3, decode_token=2e-7, reprefill_call=5e-3, reprefill_token=1e-5, train_step=0.05)
    row = RowConfig(mode="async", eta=2, generation_devices=2, steps=8, warmup_steps=2)
    out = {}
    for on_swap in ("recompute", "keep"):
        workload = dataclasses.replace(WORKLOAD, engine=dataclasses.replace(ENGINE, on_swap=on_swap))
        out[on_swap] = simulate(row, "uniform:lo=50,hi=380", workload, costs)
    assert out["recompute"].reprefill_per_trained_token > 0.0
    assert out["keep"].reprefill_per_trained_token == 0.0
    assert out["keep"].trained_tokens_per_s >= out["recompute"].trained_tokens_per_s


def test_decode_chunks_are_costed_at_the_busiest_replicas_live_batch():
    # 2 replicas of 32 slots; both groups (8 + 12 samples) take the lowest free slots, as the
    # engine does: all 20 live in replica 0, so its batch is 32 rows; once the 12 short ones finish,
    # 8 live give 16 rows (decode_min_rows). Replica 1 stays empty.
    calls = []

    class Recording(LinearCosts):
        def decode_chunk_s(self, steps, slot_steps, window, live_tokens=None, rows=None, live_rows=None):
            calls.append((np.asarray(rows).tolist(), np.asarray(live_rows).tolist()))
            return super().decode_chunk_s(steps, slot_steps, window, live_tokens=live_tokens)

    clock = EventQueue()
    done = []
    engine = SimEngine(EngineConfig(num_slots=64, max_seq_len=432, decode_chunk=8), 2, Recording(decode_step=1e-3),
                       clock, on_group_done=done.append, on_swap=lambda: None, pool_pages=1000, page_size=16)
    groups = [SimGroup(0, 0, PROMPT, np.full(8, 40)), SimGroup(1, 0, PROMPT, np.full(12, 20))]
    for g in groups:
        engine.submit(g)
    clock.run(lambda: len(done) == len(groups))
    rows, live = calls[0]
    assert live[0] == 20 and rows[0] == 32  # both groups live in replica 0's 32 slots
    last_rows, last_live = calls[-1]
    assert last_live[-1] == 8 and last_rows[-1] == 16  # the 40-token group alone after the 20s finish
    assert all(r == EngineConfig(num_slots=64, max_seq_len=432).decode_rows(n, 2)
               for rs, ls in calls for r, n in zip(rs, ls))


def test_evict_swaps_wait_out_the_transfer_on_the_generation_side():
    """EngineConfig.weight_swap "evict": the engine holds no weights during a push, so each swap
    costs the generation side the transfer's seconds; at a free transfer nothing changes."""
    row = RowConfig(mode="async", eta=2, generation_devices=2, steps=8, warmup_steps=2)
    out = {}
    for transfer_s in (0.0, 0.2):
        costs = LinearCosts(decode_step=1e-3, decode_token=2e-7, reprefill_call=5e-3, reprefill_token=1e-5,
                            train_step=0.05, transfer_s=transfer_s)
        for swap in ("alongside", "evict"):
            workload = dataclasses.replace(WORKLOAD, engine=dataclasses.replace(ENGINE, weight_swap=swap))
            out[transfer_s, swap] = simulate(row, "uniform:lo=50,hi=380", workload, costs)
    assert out[0.0, "evict"].trained_tokens_per_s == pytest.approx(out[0.0, "alongside"].trained_tokens_per_s)
    assert out[0.2, "evict"].trained_tokens_per_s < out[0.2, "alongside"].trained_tokens_per_s
