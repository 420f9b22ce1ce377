"""Re-prefill beside decode (EngineConfig.reprefill_in_decode_rows, generation/reprefill_rides.py).

The host plan, on random paused histories: every history token rides exactly once, in order, in a
row of its own slot on its own replica, a row's tokens consecutive. The model: a decode step
carrying ride rows gives the decode rows the logits of a step without them and writes the ride
tokens' keys and values as a packed re-prefill of those histories does (per-layer, stacked and FP8
pools). The engine: a run with a weight swap re-prefilling beside decode samples what the packed
re-prefill samples, with its tokens counted as carried by decode steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from areal_jax.generation import EngineConfig
from areal_jax.generation.paged import make_attend, make_ride_attend, zero_pools
from areal_jax.generation.reprefill_rides import plan_rides
from areal_jax.models import init_params
from areal_jax.models.decoding import RideRows, paged_decode_step, prefill_into_pages
from areal_jax.models.transformer import stack_layers
from tests.test_live_slots import BASE, CFG, _assert_same, _run
from tests.test_overlap_scheduling import NEW, OLD


@pytest.mark.parametrize("seed", range(8))
def test_every_history_token_rides_once_in_order_on_its_own_replica(seed):
    rng = np.random.default_rng(seed)
    data = int(rng.choice([1, 2]))
    per, rows, width, steps = 6, int(rng.integers(1, 4)), int(rng.choice([3, 8, 16])), int(rng.integers(1, 5))
    B, M = data * per, 9
    slots = sorted(rng.choice(B, size=int(rng.integers(1, B + 1)), replace=False).tolist())
    histories = {s: rng.integers(1, 60, int(rng.integers(1, 40))).astype(np.int32) for s in slots}
    cursors = {s: int(rng.integers(0, histories[s].size)) for s in slots}
    order = list(rng.permutation(slots))
    tables = rng.integers(0, 100, (B, M)).astype(np.int32)
    written = {s: list(range(cursors[s])) for s in slots}
    state = dict(cursors)
    for _ in range(40):  # chunk after chunk until every history is written
        plan = plan_rides(histories, state, order, data=data, slots_per_replica=per, rows=rows, width=width,
                          steps=steps, page_tables=tables)
        if plan.steps == 0:
            break
        assert plan.tokens.shape == (steps, data * rows, width)
        for step in range(steps):
            for row in range(data * rows):
                live = plan.positions[step, row] >= 0
                if not live.any():
                    continue
                assert step < plan.steps
                (slot,) = [s for s in slots if (tables[s] == plan.tables[step, row]).all()][:1]
                assert slot // per == row // rows  # its replica's share of the rows
                pos = plan.positions[step, row][live]
                assert live[:live.sum()].all() and list(pos) == list(range(pos[0], pos[0] + pos.size))
                assert pos[0] == len(written[slot])  # in order, after what earlier rows wrote
                np.testing.assert_array_equal(plan.tokens[step, row][live], histories[slot][pos])
                written[slot].extend(pos.tolist())
        # Oldest first: a slot rides only once every slot before it on its replica is done.
        for s in plan.done:
            assert plan.cursors[s] == histories[s].size
        state = plan.cursors
    assert all(written[s] == list(range(histories[s].size)) for s in slots)


def _pools(stacked, kv_dtype, num_pages, page):
    store = jnp.dtype(kv_dtype) if kv_dtype else jnp.float32
    return zero_pools(CFG, num_pages, page, store, SingleDeviceSharding(jax.devices()[0]), stacked=stacked)


@pytest.mark.parametrize("stacked, kv_dtype", [(False, None), (True, None), (True, "float8_e4m3fn")],
                         ids=["per-layer", "stacked", "stacked-fp8"])
def test_a_step_carrying_rides_decodes_as_without_and_writes_the_packed_reprefills_pages(stacked, kv_dtype):
    """Slots 0-1 decode (their prompts prefilled), slots 2-3 ride (histories of 11 and 6 tokens in
    rows of 4 over three steps): each step's decode logits equal a plain step's, and after the
    steps the ride slots' pages equal a packed re-prefill of their histories."""
    rng = np.random.default_rng(3)
    B, M, page = 4, 8, 4
    tables = np.arange(B * M, dtype=np.int32).reshape(B, M)
    params = init_params(CFG, 3, std=0.3)
    served = stack_layers(params) if stacked else params
    extra = dict(pages_per_replica=B * M) if stacked else {}
    prompts = {0: rng.integers(1, 60, 5), 1: rng.integers(1, 60, 9)}
    histories = {2: rng.integers(1, 60, 11).astype(np.int32), 3: rng.integers(1, 60, 6).astype(np.int32)}

    def packed(seqs):  # one sequence per row of 16
        ids, seg, dest = (np.zeros((len(seqs), 16), np.int32) for _ in range(3))
        for r, (slot, h) in enumerate(seqs.items()):
            ids[r, :h.size], seg[r, :h.size], dest[r, :h.size] = h, 1, slot
        return ids, seg, dest

    base = prefill_into_pages(served, CFG, *packed(prompts), _pools(stacked, kv_dtype, B * M, page), tables, **extra)
    want = prefill_into_pages(served, CFG, *packed(histories), base, tables, **extra)
    # The FP8 scales were set by the prompts' prefill: the ride writes (as decode's) never set them.
    placement = dict(page_size=page, impl="reference", platform="cpu", mesh=None, pages_per_replica=B * M,
                     quantized=kv_dtype is not None, num_layers=CFG.num_layers if stacked else None)
    attend, attend_ride = make_attend(jnp.asarray(tables[:2]), **placement), make_ride_attend(**placement)
    order = list(histories)
    plan_state = {s: 0 for s in histories}
    plain = with_rides = base
    done = []
    tokens = np.array([7, 9], np.int32)
    positions = np.array([prompts[0].size, prompts[1].size], np.int32)
    for step in range(3):
        plan = plan_rides(histories, plan_state, order, data=1, slots_per_replica=B, rows=2, width=4, steps=1,
                          page_tables=tables)
        plan_state = plan.cursors
        done += plan.done
        ride = RideRows(*(jnp.asarray(a[0]) for a in (plan.tokens, plan.positions, plan.tables)))
        want_logits, plain = paged_decode_step(served, CFG, jnp.asarray(tokens), jnp.asarray(positions), plain,
                                               attend)
        got_logits, with_rides = paged_decode_step(served, CFG, jnp.asarray(tokens), jnp.asarray(positions),
                                                   with_rides, attend, ride=ride, attend_ride=attend_ride)
        np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=2e-5)
        tokens, positions = np.asarray(jnp.argmax(got_logits, -1), np.int32), positions + 1
    assert done == [2, 3] and plan.cursors == {2: 11, 3: 6}
    # Every ride slot's pages as the packed re-prefill wrote them (decode slots' pages differ by
    # the decoded tokens only, which `plain` holds too).
    got_pool = with_rides
    want_pool = prefill_into_pages(served, CFG, *packed(histories), plain, tables, **extra)
    # FP8: a ride row attends to its own tokens' keys as stored (rounded to e4m3, as decode reads
    # every key), the packed call to them unrounded, so the first layer's pages are equal and later
    # layers' differ by that rounding (up to ~10% of the largest code in this random model).
    for g, w in zip(jax.tree.leaves(got_pool), jax.tree.leaves(want_pool), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, atol=3e-5 if kv_dtype is None else 0.15 * np.abs(w).max())
    pool = got_pool if stacked else got_pool[0]  # the comparison is not of empty pages
    assert np.count_nonzero(np.asarray(pool.k, np.float32)) > 0
    del want


@pytest.mark.parametrize("config", [dict(), dict(scan_layers=True), dict(scan_layers=True, kv_dtype="float8_e4m3fn"),
                                    dict(overlap=True, new_tokens=6)],
                         ids=["paged", "scanned", "scanned-fp8", "overlap"])
def test_an_engine_reprefilling_beside_decode_samples_as_the_packed_reprefill(config):
    """Three samples per request, a weight swap mid-run: the interrupted samples pause while the
    decode steps re-prefill them (rows of 4, one per step, so histories span several steps and
    chunks), and every token, log-prob, version and stop reason equals the packed re-prefill's."""
    packed, want = _run(OLD, swap=NEW, n=3, temperature=1.0, decode_min_rows=1, **config)
    rides, got = _run(OLD, swap=NEW, n=3, temperature=1.0, decode_min_rows=1, reprefill_in_decode_rows=1,
                      reprefill_in_decode_width=4, **config)
    if "kv_dtype" in config:
        # FP8: a ride row's queries read its own tokens' keys as stored (rounded to e4m3, one step
        # is 1/16 of a value), the packed call's unrounded, so the log-probs after the swap differ
        # by that rounding and a token drawn differently changes the rest of its sample: equal up
        # to the first token drawn differently, the log-probs there close.
        for (t1, l1, v1, _), (t2, l2, v2, _) in zip(got, want, strict=True):
            same = next((i for i, (a, b) in enumerate(zip(t1, t2)) if a != b), min(len(t1), len(t2)))
            assert same >= int((v2 == 0).sum())  # everything before the swap is the same
            np.testing.assert_allclose(l1[:same], l2[:same], atol=0.1)
            np.testing.assert_array_equal(v1[:same], v2[:same])
    else:
        _assert_same(got, want)
    assert {tuple(np.unique(v)) for _, _, v, _ in got} >= {(0, 1)}  # samples spanning the swap
    stats = rides.stats()
    assert stats.reprefill_tokens == packed.stats().reprefill_tokens > 0
    assert stats.reprefill_ride_tokens == stats.reprefill_tokens  # all of it carried by decode steps
    assert not rides.timings()["reprefill"] and rides.timings()["decode_ride"]
    assert any("ride_rows=1,ride_width=4" in n for n in rides._programs.traced)


@pytest.mark.parametrize("cap", [0, 12])
def test_a_capped_swap_rides_the_longest_histories_and_packs_the_rest(cap):
    """reprefill_in_decode_tokens: the decode steps take the longest histories that fit the cap
    (per replica), the packed calls the others, and the samples are those of the packed re-prefill."""
    packed, want = _run(OLD, swap=NEW, n=3, temperature=1.0, decode_min_rows=1)
    rides, got = _run(OLD, swap=NEW, n=3, temperature=1.0, decode_min_rows=1, reprefill_in_decode_rows=1,
                      reprefill_in_decode_width=4, reprefill_in_decode_tokens=cap)
    _assert_same(got, want)
    stats = rides.stats()
    assert stats.reprefill_tokens == packed.stats().reprefill_tokens
    if cap == 0:
        assert stats.reprefill_ride_tokens == stats.reprefill_tokens
    else:  # some rode, within the cap, and some went packed
        assert 0 < stats.reprefill_ride_tokens <= cap < stats.reprefill_tokens
        assert rides.timings()["reprefill"]


def test_on_a_mesh_the_engine_rides_as_one_device_and_its_widest_ride_program_is_specced():
    """(data=2, tensor=2), a group of four and a swap: the ride rows of each replica carry its own
    slots (one row of 8 per replica per step), the samples equal a single-device engine's packed
    re-prefill, and the planner's ride programs compile."""
    import dataclasses

    from areal_jax.generation import engine_program_specs
    from tests.test_engine_programs import CFG as MESH_CFG
    from tests.test_engine_programs import MESH_CONFIG, mesh_run_matching_one_device

    base = dataclasses.replace(MESH_CONFIG, kv_layout="paged", page_size=4, decode_min_rows=1)
    rides_cfg = dataclasses.replace(base, reprefill_in_decode_rows=1, reprefill_in_decode_width=8)
    sharded, mesh = mesh_run_matching_one_device(rides_cfg, base, [[1 + i] * n for i, n in enumerate([5, 9, 3])])
    assert sharded.stats().reprefill_ride_tokens == sharded.stats().reprefill_tokens > 0
    specs = {s.name.removeprefix("generation/"): s
             for s in engine_program_specs(MESH_CFG, rides_cfg, mesh=mesh, param_dtype=jnp.float32)}
    ride_specs = sorted(n for n in specs if "ride_rows" in n)
    assert ride_specs == ["decode[window=64,rows=2,ride_rows=1,ride_width=8]",
                          "decode[window=64,rows=4,ride_rows=1,ride_width=8]"]
    assert any("ride_rows=1,ride_width=8" in n for n in sharded._programs.traced), sharded._programs.traced
    for name in ride_specs:
        assert specs[name].lower().compile().memory_analysis() is not None


def test_the_ride_split_takes_the_longest_that_fit_per_replica():
    import types

    from areal_jax.generation.slots import SlotTable

    class Histories:  # what split_for_rides reads of a sample: a history of `size` tokens, its start
        def __init__(self, size, stamp):
            self.request, self.tokens, self.stamp = types.SimpleNamespace(prompt=np.zeros(size, np.int32)), [7], stamp

    class Cache:
        data, pages = 2, None

    table = SlotTable(EngineConfig(num_slots=8, max_seq_len=64, reprefill_in_decode_rows=1,
                                   reprefill_in_decode_tokens=40), Cache(), None, None, None)
    # replica 0 (slots 0-3): 30, 10, 25, 5; replica 1 (slots 4-7): 41, 40 (a tie broken by start), 40
    for slot, (size, stamp) in {0: (30, 0), 1: (10, 1), 2: (25, 2), 3: (5, 3), 4: (41, 4), 5: (40, 6),
                                6: (40, 5)}.items():
        table.samples[slot] = Histories(size, stamp)
    ride, rest = table.split_for_rides([0, 1, 2, 3, 4, 5, 6])
    assert ride == [6, 0, 1]  # longest first over the host: 40 (slot 6, started first), 30, 10
    assert rest == [2, 3, 4, 5]


def test_the_fields_are_validated():
    with pytest.raises(ValueError, match="reprefill_in_decode_rows must be an int >= 0"):
        EngineConfig(**BASE, reprefill_in_decode_rows=-1)
    with pytest.raises(ValueError, match="reprefill_in_decode_tokens must be an int >= 0"):
        EngineConfig(**BASE, reprefill_in_decode_tokens=-1)
    with pytest.raises(ValueError, match="reprefill_in_decode_width must be an int >= 1"):
        EngineConfig(**BASE, reprefill_in_decode_width=0)
    with pytest.raises(ValueError, match="needs the paged KV cache"):
        EngineConfig(**{**BASE, "kv_layout": "dense"}, reprefill_in_decode_rows=2)


def test_an_rl_loop_reports_the_tokens_its_decode_steps_reprefilled(tmp_path):
    """An async run (generation beside training, samples long enough to span pushes) with
    re-prefill beside decode: it trains, and each step's records say how many of the step's
    re-prefilled tokens rode the decode steps."""
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.parallel import MeshConfig
    from areal_jax.rollout.workflow import RLVRConfig
    from areal_jax.trainer.config import RLConfig
    from tests.test_rl_loop import REWARD, make_loop
    from tests.tokenizer_fixtures import build_tiny_tokenizer

    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "chatml"))
    loop = make_loop(tokenizer, rl=RLConfig(steps=4, batch_size=2, max_staleness=2, max_concurrent=6),
                     mesh=MeshConfig(num_generation_devices_per_host=2), devices=jax.devices()[:4],
                     workflow=RLVRConfig(n_samples=4, max_new_tokens=24, reward=REWARD, filter_all_equal_rewards=False),
                     engine=EngineConfig(num_slots=16, max_seq_len=64, decode_chunk=2, kv_layout="paged", page_size=4,
                                         reprefill_in_decode_rows=1, reprefill_in_decode_width=8))
    result = loop.run()
    assert result.steps == 4 and all(np.isfinite(m["train/loss"]) for m in result.history)
    # A history counts as re-prefilled at its swap and as ridden as its rows run, which may fall in
    # the next step's records: the totals, not each step, are ordered.
    rode = [m["rollout/reprefill_ride_tokens"] for m in result.history]
    assert min(rode) >= 0 and 0 < sum(rode) <= sum(m["rollout/reprefill_tokens"] for m in result.history)


def test_an_moe_engine_riding_records_the_new_policys_experts_after_the_swap():
    """MoE (routed layers beside a dense one): the ride rows go through the experts with the decode
    rows, and the experts recorded for the tokens decoded after the swap are the trainer's under the
    new weights over the ridden history, as with the packed re-prefill."""
    from tests.test_moe_engine_routing import _generate, _params, _trainer_routing

    old, new = _params(1), _params(2)
    engine, samples = _generate(old, swap=new, kv_layout="paged", page_size=4, decode_min_rows=1,
                                reprefill_in_decode_rows=1, reprefill_in_decode_width=4)
    assert engine.stats().reprefill_ride_tokens == engine.stats().reprefill_tokens > 0
    for prompt, c in samples:
        np.testing.assert_array_equal(c.versions, [0] * 9 + [1] * 7)
        seq = prompt + list(c.tokens)
        before = len(prompt) + 8  # input tokens fed under the old weights
        np.testing.assert_array_equal(c.moe_routing[:before], _trainer_routing(old, seq)[:before])
        np.testing.assert_array_equal(c.moe_routing[before:-1], _trainer_routing(new, seq)[before:-1])
