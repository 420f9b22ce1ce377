"""The engine's per-program timings, which the simulator's calibration fits, agree with its stats."""

import dataclasses

import jax
import pytest

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.generation.timings import CallTimings, decode_key, timings_delta
from areal_jax.models import ModelConfig, Transformer, init_params
from tests.test_rl_loop import make_loop, tokenizer  # noqa: F401 - tokenizer is a fixture

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)


def test_engine_timings_account_for_every_call():
    model = Transformer(CFG, init_params(CFG, jax.random.key(0), std=0.3))
    engine = GenerationEngine(model, EngineConfig(num_slots=4, max_seq_len=64, decode_chunk=4))
    handles = [engine.submit([1, 2, 3, 4 + i], SamplingParams(max_new_tokens=20), n=3, seed=i) for i in range(3)]
    for _ in range(3):  # a few chunks, then a swap with samples in flight (re-prefilled)
        engine.step()
    engine.update_weights(model.params, version=1)
    engine.run_until_idle()
    assert all(len(h.result().completions) == 3 for h in handles)
    stats, t = engine.stats(), engine.timings()
    assert sum(v["steps"] for v in t["decode"].values()) == stats.decode_steps
    assert sum(v["slot_steps"] for v in t["decode"].values()) == stats.busy_slot_steps
    # The packed calls' tokens are what they computed: a group's shared prompt once per trie.
    assert 0 < stats.reprefill_shared_tokens < stats.reprefill_tokens
    assert sum(v["tokens"] for v in t["reprefill"].values()) == stats.reprefill_tokens - stats.reprefill_shared_tokens
    timed = sum(v["s"] for kind in ("prefill", "reprefill", "reprefill_long") for v in t[kind].values())
    assert timed == pytest.approx(stats.prefill_s)
    assert all(k.startswith("len") for k in t["prefill"]) and t["insert"]  # 9 samples on 4 slots: a group split over a kept block


def test_delta_and_keys():
    timings = CallTimings()
    timings.add("decode", decode_key(128, 3, 12), steps=8, slot_steps=20, s=0.5)
    before = timings.snapshot()
    timings.add("decode", decode_key(128, 12, 12), steps=4, slot_steps=48, s=0.25)
    timings.add("decode", decode_key(128, 3, 12), steps=8, slot_steps=16, s=0.5)
    assert decode_key(128, 3, 12) == "w128_q1" and decode_key(128, 12, 12) == "w128_q4"
    assert timings_delta(timings.snapshot(), before) == {
        "decode": {"w128_q1": {"steps": 8, "slot_steps": 16, "s": 0.5}, "w128_q4": {"steps": 4, "slot_steps": 48,
                                                                                   "s": 0.25}}}
    with pytest.raises(ValueError, match="unknown call kind"):
        timings.add("train", "x", s=1.0)


def test_rl_loop_records_what_the_calibration_fits(tokenizer):
    from areal_jax.parallel import MeshConfig
    from areal_jax.trainer.config import RLConfig

    rl = RLConfig(steps=2, batch_size=2, max_staleness=0, max_concurrent=4, mode="sync")
    records = []
    loop = make_loop(tokenizer, rl=dataclasses.replace(rl, dump_rollouts_every=1), mesh=MeshConfig(colocated=True),
                     devices=jax.devices()[:2], on_rollouts=lambda step, recs: records.extend(recs))
    history = loop.run().history
    for m in history:
        t = m["timings"]
        assert t["train"]["s"] == m["time/train_step_s"] and t["train"]["minibatches"] == 2
        assert t["train"]["microbatches"] >= 2 and t["train"]["padded_tokens"] >= m["train/trained_tokens"]
        assert sum(v["steps"] for v in t["decode"].values()) > 0
    # A batch's admission may land in the previous step's record (it follows the weight swap).
    assert any(m["timings"].get("prefill") for m in history)
    assert records and all(r["prompt_tokens"] > 0 for r in records)
