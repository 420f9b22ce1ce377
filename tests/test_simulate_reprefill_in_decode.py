"""The simulator's re-prefill beside decode (EngineConfig.reprefill_in_decode_rows): after a swap the
in-flight samples pause (all of them, or with reprefill_in_decode_tokens the longest histories that
fit), their histories ride the decode steps R rows of W tokens at a time, and they decode again from
the chunk after their last row (areal_jax/simulate/generation.py)."""

import dataclasses

import numpy as np
import pytest

from areal_jax.generation.config import EngineConfig
from areal_jax.simulate.config import RowConfig
from areal_jax.simulate.costs import LinearCosts, RooflineCosts
from areal_jax.simulate.events import EventQueue
from areal_jax.simulate.generation import SimEngine, SimGroup
from tests.test_simulate_paged import ENGINE, WORKLOAD, simulate

PROMPT = 16


def _engine(config, costs, pool_pages=1000, data=1):
    clock, done = EventQueue(), []
    engine = SimEngine(config, data, costs, clock, on_group_done=done.append, on_swap=lambda: None,
                       pool_pages=pool_pages, page_size=16, block_tokens=32)
    return engine, clock, done


def _run(engine, clock, done, groups, swaps):
    """Submits `groups` at 0, delivers weights version i + 1 at swaps[i], runs until all finish."""
    for g in groups:
        engine.submit(g)
    for version, at in enumerate(swaps, 1):
        clock.at(at, lambda v=version: engine.deliver_weights(v))
    clock.run(lambda: len(done) == len(groups))


@pytest.mark.parametrize("changed", [dict(reprefill_in_decode_width=64),
                                     dict(reprefill_in_decode_rows=4, on_swap="keep"),
                                     dict(reprefill_in_decode_rows=4, interruptible=False)])
def test_rides_off_or_not_applicable_leave_every_figure_unchanged(changed):
    # Rows 0 (any width), "keep" swaps (nothing re-prefilled) or swaps that wait for the batch to
    # drain: the same run, records included, as the config without the fields.
    costs = LinearCosts(decode_step=1e-3, decode_token=2e-7, reprefill_call=5e-3, reprefill_token=1e-5,
                        prefill_call=1e-3, prefill_token=1e-6, train_step=0.05)
    row = RowConfig(mode="async", eta=2, generation_devices=2, steps=8, warmup_steps=2)
    base_engine = dataclasses.replace(ENGINE, **{k: v for k, v in changed.items() if not k.startswith("reprefill")})
    base = simulate(row, "uniform:lo=50,hi=380", dataclasses.replace(WORKLOAD, engine=base_engine), costs)
    other = simulate(row, "uniform:lo=50,hi=380", dataclasses.replace(WORKLOAD, engine=dataclasses.replace(
        ENGINE, **changed)), costs)
    assert dataclasses.asdict(other) == dataclasses.asdict(base)
    assert not any(r["timings"].get("decode_ride") for r in base.records)


def test_rides_on_a_dense_cache_change_nothing():
    # The simulator's dense cache (no pool) has no pages to ride into: the packed calls stay.
    costs = LinearCosts(decode_step=1e-3, decode_window=1e-6, reprefill_call=5e-3, reprefill_token=1e-5,
                        train_step=0.05)
    row = RowConfig(mode="async", eta=2, generation_devices=2, steps=6, warmup_steps=2)
    dense = dataclasses.replace(WORKLOAD, kv_pool_pages=0)
    base = simulate(row, "uniform:lo=50,hi=380", dense, costs)
    rides = simulate(row, "uniform:lo=50,hi=380", dataclasses.replace(dense, engine=dataclasses.replace(
        ENGINE, reprefill_in_decode_rows=4)), costs)
    assert dataclasses.asdict(rides) == dataclasses.asdict(base)


def test_ride_arguments_at_zero_cost_what_a_decode_chunk_costs_without_them():
    linear = LinearCosts(decode_step=1e-3, decode_slot=1e-5, decode_token=2e-7, reprefill_token=1e-5)
    steps, slots, live = np.asarray([16, 7]), np.asarray([100, 40]), np.asarray([5e4, 1e4])
    assert np.array_equal(linear.decode_chunk_s(steps, slots, 0, live_tokens=live),
                          linear.decode_chunk_s(steps, slots, 0, live_tokens=live, ride_rows=0, ride_width=128,
                                                ride_window=512))
    roofline = _roofline()
    rows, live_rows = np.asarray([64, 32]), np.asarray([50, 20])
    assert np.array_equal(roofline.decode_chunk_s(steps, slots, 0, live_tokens=live, rows=rows, live_rows=live_rows),
                          roofline.decode_chunk_s(steps, slots, 0, live_tokens=live, rows=rows, live_rows=live_rows,
                                                  ride_rows=0, ride_width=128, ride_window=512))


def test_one_pending_pair_rides_two_chunks_and_its_first_slot_decodes_in_the_second():
    """Two samples of one group (slots 0, 1, admitted in that order), chunks of C = 4 steps of d
    seconds, R = 2 ride rows of W = 4 tokens. Weights arrive during chunk 3 (of 4 d each), so the
    swap comes after 3 chunks: 1 + 12 tokens each, histories h = 16 + 13 - 1 = 28 = 7 rows each.
    Ride chunk 1: no slot decodes; 14 rows need 7 steps, so it runs C = 4 (8 rows: slot 0's 7 and
    slot 1's first). Ride chunk 2: slot 0 decodes (C steps, its segment goes on), slot 1's 6 rows
    need 3 steps, so 4 (2 padding rows). Slot 1 decodes from chunk 3."""
    d, c, q = 1e-3, 1e-6, 1e-5
    C, R, W, window = 4, 2, 4, 128  # 128: the smallest decode window, holding every position here
    config = EngineConfig(num_slots=4, max_seq_len=432, decode_chunk=C, reprefill_in_decode_rows=R,
                          reprefill_in_decode_width=W)
    engine, clock, done = _engine(config, LinearCosts(decode_step=d, decode_token=c, ride_token=q))
    group = SimGroup(0, 0, PROMPT, np.asarray([100, 100]))
    chunks = []
    plan = engine._plan_segment

    def watched(start):
        plan(start)
        seg = engine._segment
        chunks.append((seg.ends[0] - start, int(seg.steps[0]), int(seg.slot_steps[0]),
                       engine.pending.tolist()[:2], seg.ride_left))

    engine._plan_segment = watched
    block = engine.block_tokens
    decode_chunk = C * d + (C * (PROMPT + 1) + C * (C - 1) // 2 + C * block // 2) * c * 2  # the first, both slots
    _run(engine, clock, done, [group], swaps=[2.5 * decode_chunk])
    assert engine.counters.swaps == 1
    assert engine.counters.reprefill_tokens == engine.counters.ride_tokens == 2 * 28
    first, ride1, ride2, after = chunks[0], chunks[1], chunks[2], chunks[3]
    assert first[0] == pytest.approx(decode_chunk, rel=1e-12)
    # Each ride step: R rows of W tokens at the ride rate, each reading the window.
    ride_step = R * (W * q + window * c)
    assert ride1[1:4] == (C, 0, [True, True]) and ride1[4][:2].tolist() == [0, 6]
    assert ride1[0] == pytest.approx(C * d + C * ride_step, rel=1e-12)
    # Slot 0 decodes 4 steps from length 29 (its token at 28 written by the chunk's first step).
    live = C * 29 + C * (C - 1) // 2
    assert ride2[1:4] == (C, C, [False, True]) and ride2[4][:2].tolist() == [0, 0]
    assert ride2[0] == pytest.approx(C * d + (live + C * block // 2) * c + C * ride_step, rel=1e-12)
    assert after[3] == [False, False] and after[4] is None  # no rides: a plain segment again
    timings = engine.timings.snapshot()
    keys, rides = timings["decode"], timings["decode_ride"]  # the engine's kinds: plain decode keys
    assert list(rides) == [f"w{window}_q1"] and rides[f"w{window}_q1"]["ride_tokens"] == 2 * C * R * W
    assert rides[f"w{window}_q1"]["steps"] == 2 * C and rides[f"w{window}_q1"]["slot_steps"] == C
    # Tokens: 13 under version 0, the rest under version 1, slot 1 one chunk behind slot 0.
    assert group.segments == [[[0, 13], [1, 87]], [[0, 13], [1, 87]]]
    assert engine.counters.slot_steps == engine.counters.generated_tokens - 2  # first tokens come with admission
    assert engine.counters.decode_steps == sum(v["steps"] for v in [*keys.values(), *rides.values()])


def test_rides_of_equal_histories_take_the_oldest_first_and_a_replicas_own_slots():
    # 2 replicas of 4 slots; group 0 (2 samples) in replica 0's slots 0, 1, group 1 (5 samples)
    # fills slots 2, 3 of replica 0 and 4, 5, 6 of replica 1. After the swap replica 0 rides
    # slots 0, 1, 2, 3 in that order, replica 1 slots 4, 5, 6: each replica's rows are its own.
    config = EngineConfig(num_slots=8, max_seq_len=432, decode_chunk=4, reprefill_in_decode_rows=1,
                          reprefill_in_decode_width=16)
    engine, clock, done = _engine(config, LinearCosts(decode_step=1e-3), data=2)
    groups = [SimGroup(0, 0, PROMPT, np.full(2, 200)), SimGroup(1, 0, PROMPT, np.full(5, 200))]
    for g in groups:
        engine.submit(g)
    clock.at(0.0025, lambda: engine.deliver_weights(1))  # during the first chunk: 1 + 4 tokens each
    clock.run(lambda: engine.pending.any())
    # h = 16 + 5 - 1 = 20: 2 rows of 16 each; one row a step, 4 steps a chunk.
    left = engine._segment.ride_left
    assert left.tolist() == [0, 0, 2, 2, 0, 0, 2, 0]
    clock.run(lambda: not engine.pending.any())
    assert engine.counters.ride_tokens == engine.counters.reprefill_tokens == 7 * 20
    clock.run(lambda: len(done) == 2)
    assert [sum(n for _, n in s) for g in groups for s in g.segments] == [200] * 7


@pytest.mark.parametrize("seed", [0, 1])
def test_a_small_pool_with_many_swaps_still_generates_every_token(seed):
    # Swaps every few chunks restart pending slots; a small pool preempts pending slots too.
    rng = np.random.default_rng(seed)
    config = EngineConfig(num_slots=16, max_seq_len=432, decode_chunk=8, reprefill_in_decode_rows=2,
                          reprefill_in_decode_width=32)
    engine, clock, done = _engine(config, LinearCosts(decode_step=1e-3, ride_token=1e-6), pool_pages=60)
    groups = [SimGroup(i, 0, PROMPT, rng.integers(2, 400, 4)) for i in range(10)]
    _run(engine, clock, done, groups, swaps=np.arange(1, 40) * 0.05)
    assert len(done) == len(groups) and engine.counters.swaps > 5
    assert engine.counters.preemptions > 0 and 0 < engine.counters.ride_tokens <= engine.counters.reprefill_tokens
    for g in groups:
        assert [sum(n for _, n in segs) for segs in g.segments] == g.lengths.tolist()
    timings = engine.timings.snapshot()
    chunks = [*timings["decode"].values(), *timings["decode_ride"].values()]
    assert engine.counters.decode_steps == sum(v["steps"] for v in chunks)
    assert engine.counters.slot_steps == sum(v["slot_steps"] for v in chunks)


def test_calibration_fits_the_ride_tokens_rate_from_ride_chunks():
    import json

    from areal_jax.simulate.calibrate import fit_costs

    costs = LinearCosts(decode_step=1e-3, decode_slot=2e-6, ride_token=3e-7, prefill_call=1e-3, prefill_token=1e-6,
                        train_step=0.05)
    row = RowConfig(mode="async", eta=2, generation_devices=2, steps=10, warmup_steps=2)
    R, W = 2, 32
    workload = dataclasses.replace(WORKLOAD, engine=dataclasses.replace(ENGINE, reprefill_in_decode_rows=R,
                                                                        reprefill_in_decode_width=W))
    data = workload.generation_replicas(row.generation_devices)
    result = simulate(row, "uniform:lo=50,hi=380", workload, costs)
    records = json.loads(json.dumps(list(result.records)))
    assert any(r["timings"].get("decode_ride") for r in records) and any(r["timings"].get("decode") for r in records)
    assert not any("reprefill" in r["timings"] or "reprefill_long" in r["timings"] for r in records)
    fit = fit_costs(records, skip_steps=0)  # the simulator's records: their ride_tokens
    for name in ("decode_step", "decode_slot", "ride_token"):
        assert getattr(fit.costs, name) == pytest.approx(getattr(costs, name), rel=1e-6), name
    # The engine records steps, slot_steps and s only: its steps' tokens come from its config.
    engine_like = json.loads(json.dumps(records))
    for r in engine_like:
        for v in r["timings"].get("decode_ride", {}).values():
            del v["ride_tokens"]
    assert fit_costs(engine_like, skip_steps=0).costs.ride_token is None  # tokens unknown: the packed rate
    refit = fit_costs(engine_like, skip_steps=0, ride_tokens_per_step=data * R * W)
    assert refit.costs.ride_token == pytest.approx(costs.ride_token, rel=1e-6)
    assert dataclasses.replace(refit.costs, ride_token=None) == dataclasses.replace(fit.costs, ride_token=None)
    # Records with no ride chunk (older runs, rides off): ride_token None, the rest as fitted.
    plain = [{**r, "timings": {k: v for k, v in r["timings"].items() if k != "decode_ride"}} for r in records]
    assert fit_costs(plain, skip_steps=0).costs == dataclasses.replace(fit.costs, ride_token=None)


def _swap_engine(histories, *, cap, data=1, share=False, admitted=None):
    """An engine of len(histories) slots whose samples (one group per replica, prompts of 4) are in
    flight with those histories (prompt + generated - 1), admitted in `admitted` order (default:
    slot order); weights version 1 waiting. Packed re-prefill at 1 s a call and 1 ms a token."""
    config = EngineConfig(num_slots=len(histories), max_seq_len=432, decode_chunk=4, reprefill_in_decode_rows=2,
                          reprefill_in_decode_width=16, reprefill_in_decode_tokens=cap,
                          reprefill_share_prefixes=share)
    costs = LinearCosts(decode_step=1e-3, reprefill_call=1.0, reprefill_token=1e-3)
    engine, _, _ = _engine(config, costs, data=data)
    per, prompt = len(histories) // data, 4
    groups = [SimGroup(r, 0, prompt, np.full(per, 400)) for r in range(data)]
    for slot, h in enumerate(histories):
        group = groups[slot // per]
        group.segments = [[] for _ in range(per)]
        engine.slot_group[slot], engine.slot_index[slot] = group, slot % per
        engine.prompt[slot], engine.generated[slot], engine.target[slot] = prompt, h - prompt + 1, 400
        engine.since_swap[slot] = engine.generated[slot]
        engine.active[slot] = True
    engine.started[:] = np.arange(len(histories)) if admitted is None else admitted
    engine.pending_version = 1
    return engine


def test_a_token_cap_rides_the_longest_histories_that_fit_and_packs_the_rest():
    """Histories [30, 10, 25, 5], cap 40: longest first, 30 fits (30), 25 does not (55), 10 fits
    (40), 5 does not (45). Slots 0 and 1 ride, 0 first; slots 2 and 3 (25 + 5 tokens) are
    re-prefilled at the swap by one packed call, and decode at once."""
    engine = _swap_engine([30, 10, 25, 5], cap=40)
    seconds = engine._swap()
    assert engine.pending.tolist() == [True, True, False, False]
    assert engine.active.tolist() == [False, False, True, True]
    assert engine.ride_left.tolist() == [2, 1, 0, 0]  # ceil(h / 16) rows
    assert [q.tolist() for q in engine._ride_queues()] == [[0, 1]]
    assert engine.timings.snapshot()["reprefill"] == {"rows1": {"calls": 1, "tokens": 30, "s": 1.0 + 30e-3}}
    assert seconds == pytest.approx(1.0 + 30e-3)
    assert engine.counters.reprefill_tokens == 70  # every history, ridden or packed

    # Longest first, not oldest: slot 1 (10) admitted before slot 0 (30) still rides after it.
    engine = _swap_engine([30, 10, 25, 5], cap=40, admitted=[1, 0, 2, 3])
    engine._swap()
    assert [q.tolist() for q in engine._ride_queues()] == [[0, 1]]
    # Ties go to the earlier admitted: of two 30s under a cap of 40 the earlier rides, then the 10.
    engine = _swap_engine([30, 30, 10, 5], cap=40, admitted=[3, 2, 1, 0])
    engine._swap()
    assert engine.pending.tolist() == [False, True, True, False]
    # Prefix tries over the packed samples only: one group's prompt (4) once, then 21 + 1 tokens.
    engine = _swap_engine([30, 10, 25, 5], cap=40, share=True)
    engine._swap()
    assert engine.timings.snapshot()["reprefill"] == {"rows1": {"calls": 1, "tokens": 4 + 21 + 1, "s": 1.0 + 26e-3}}


def test_the_token_cap_is_per_replica_and_a_pending_slot_restarts_in_the_selection():
    # Replica 0: [30, 10, 25, 5] as above; replica 1: [35, 20, 3, 2]: 35 (35), 20 (55 no), 3 (38), 2 (40).
    engine = _swap_engine([30, 10, 25, 5, 35, 20, 3, 2], cap=40, data=2)
    engine._swap()
    assert np.flatnonzero(engine.pending).tolist() == [0, 1, 4, 6, 7]
    assert [q.tolist() for q in engine._ride_queues()] == [[0, 1], [4, 6, 7]]
    assert engine.timings.snapshot()["reprefill"]["rows1"]["tokens"] == 25 + 5 + 20
    # A second swap before any ride ran: the pending slots count with their whole histories again,
    # and a cap of 20 now packs slot 0 (30), rides 10 and 5 in replica 0, 20 in replica 1.
    engine.config = dataclasses.replace(engine.config, reprefill_in_decode_tokens=20)
    engine.pending_version = 2
    engine._swap()
    assert np.flatnonzero(engine.pending).tolist() == [1, 3, 5]
    assert engine.active.tolist() == [True, False, True, False, True, False, True, True]
    assert engine.ride_left[[0, 2, 4, 6, 7]].tolist() == [0] * 5
    assert engine.counters.reprefill_tokens == 2 * 130


def test_a_cap_no_history_fits_is_the_packed_re_prefill_bit_for_bit():
    # Every history longer than the cap: nothing rides, the run is the rides-off run's.
    costs = LinearCosts(decode_step=1e-3, decode_token=2e-7, reprefill_call=5e-3, reprefill_token=1e-5,
                        prefill_call=1e-3, prefill_token=1e-6, train_step=0.05)
    row = RowConfig(mode="async", eta=2, generation_devices=2, steps=8, warmup_steps=2)
    base = simulate(row, "uniform:lo=50,hi=380", WORKLOAD, costs)
    capped = simulate(row, "uniform:lo=50,hi=380", dataclasses.replace(WORKLOAD, engine=dataclasses.replace(
        ENGINE, reprefill_in_decode_rows=4, reprefill_in_decode_tokens=PROMPT - 1)), costs)
    assert base.records[-1]["timings"].get("reprefill")
    assert dataclasses.asdict(capped) == dataclasses.asdict(base)


def test_a_cap_every_history_fits_pends_every_sample_longest_first():
    # Cap 0 rides every sample, as does a cap holding every history: longest first (the engine's
    # order), with no packed call.
    for cap, order in ((0, [0, 2, 1, 3]), (70, [0, 2, 1, 3])):
        engine = _swap_engine([30, 10, 25, 5], cap=cap)
        assert engine._swap() == 0.0 and engine.pending.all()
        assert [q.tolist() for q in engine._ride_queues()] == [order]
        assert not engine.timings.snapshot()["reprefill"]


def _roofline(slots=64):
    from areal_jax.models.config import ModelConfig
    from areal_jax.plan import estimate as est
    from areal_jax.plan.targets import parse_target

    # Qwen2.5-0.5B's shape on one H100, an FP8-sized cache (1 B per element).
    model = ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                        num_kv_heads=2, head_dim=64)
    return RooflineCosts(model=model, target=parse_target("1xh100"), estimate_context=est.EstimateContext(model=model),
                         replicas=1, generation_tensor=1, slots_per_replica=slots, train_devices=1, hosts=1,
                         generation_weight_bytes=2 * model.num_params(),
                         kv_bytes_per_token=2 * model.num_layers * model.num_kv_heads * model.head_dim,
                         separate_proximal=False, transfer_bytes_per_s=1e10, pack_width=512)


def test_a_ride_steps_roofline_is_the_decode_step_plus_its_rows():
    costs = _roofline()
    m, peak, bw = costs.model, costs.target.peak_flops_per_device, costs.target.bandwidth_per_device
    steps, live, rows, live_rows, R, W, window = 8, 8 * 40 * 300, 64, 40, 4, 128, 512
    flops = steps * (rows * costs._row_flops + 4.0 * m.num_layers * m.num_heads * m.head_dim * live / steps)
    # Ride tokens: a decode row's FLOPs less the head and its attention over half a key.
    layers = costs._row_flops - 2 * m.hidden_size * m.vocab_size - 2.0 * m.num_layers * m.num_heads * m.head_dim
    flops += steps * R * W * (layers + 4.0 * m.num_layers * m.num_heads * m.head_dim * window)
    accessed = steps * costs.weights_read(live_rows + R * W) + (live + steps * R * window) * costs.kv_bytes_per_token
    got = costs.decode_chunk_s(steps, 320, 0, live_tokens=live, rows=rows, live_rows=live_rows, ride_rows=R,
                               ride_width=W, ride_window=window)
    assert got == pytest.approx(max(flops / peak, accessed / bw), rel=1e-9)


def test_riding_beside_a_memory_bound_decode_reprefills_the_same_tokens_in_less_time():
    """Three samples are in flight at the swap; a group of 60 arrives with it and decodes
    (memory-bound at 63 rows of a 0.5B model on an H100). Packed, the swap's re-prefill stops every
    slot for a call; riding, the same tokens go through the decode steps' idle compute: the group
    decoding beside them finishes earlier by nearly the whole call, while the three re-prefilled
    samples, paused for a chunk instead of a call, finish later."""
    out = {}
    for rows in (0, 2):
        config = EngineConfig(num_slots=64, max_seq_len=2048, decode_chunk=16, reprefill_in_decode_rows=rows,
                              reprefill_in_decode_width=128, reprefill_share_prefixes=False)
        engine, clock, done = _engine(config, _roofline(), pool_pages=20_000)
        ends = {}
        engine.on_group_done = lambda g: (done.append(g), ends.setdefault(g.group_id, clock.now))
        groups = [SimGroup(0, 0, 512, np.full(3, 300)), SimGroup(1, 1, 256, np.full(60, 1000))]
        engine.submit(groups[0])
        clock.at(0.05, lambda: engine.deliver_weights(1))
        clock.at(0.05, lambda: engine.submit(groups[1]))
        clock.run(lambda: len(done) == 2)
        timings = engine.timings.snapshot()
        out[rows] = (engine.counters, ends, sum(v["s"] for k in ("reprefill", "reprefill_long")
                                                for v in timings[k].values()))
        for g in groups:
            assert [sum(n for _, n in segs) for segs in g.segments] == g.lengths.tolist()
    (packed, packed_ends, packed_s), (ridden, ridden_ends, ridden_s) = out[0], out[2]
    assert packed.swaps == ridden.swaps == 1
    assert packed.reprefill_tokens == ridden.reprefill_tokens == ridden.ride_tokens > 3 * 512
    assert packed_s > 0 and ridden_s == 0
    assert packed_ends[1] - ridden_ends[1] > 0.8 * packed_s
    assert ridden_ends[0] > packed_ends[0]


def test_the_token_cap_is_validated():
    assert EngineConfig(reprefill_in_decode_tokens=0).reprefill_in_decode_tokens == 0
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="reprefill_in_decode_tokens"):
            EngineConfig(reprefill_in_decode_tokens=bad)


def test_calibration_takes_the_ride_rows_of_the_recorded_runs_config(tmp_path):
    import json
    import types

    from areal_jax.simulate.driver import _ride_tokens_per_step

    job = types.SimpleNamespace(engine=EngineConfig(reprefill_in_decode_rows=4, reprefill_in_decode_width=64))
    workload = dataclasses.replace(WORKLOAD, config_generation_devices=2)  # 2 data replicas a host
    assert _ride_tokens_per_step(str(tmp_path), job, workload) == 2 * 4 * 64  # no config.json: this config's
    (tmp_path / "config.json").write_text(json.dumps({"engine": {"reprefill_in_decode_rows": 2,
                                                                 "reprefill_in_decode_width": 128}}))
    assert _ride_tokens_per_step(str(tmp_path), job, workload) == 2 * 2 * 128
