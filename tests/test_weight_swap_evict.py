"""EngineConfig.weight_swap = "evict": the engine drops its weights before a push lands
(GenerationEngine.release_weights), so the generation devices never hold two copies.

A release between chunks followed by the push gives the tokens, log-probs and versions of a plain
swap at the same round; nothing decodes or admits while the engine holds no weights; a
non-interruptible engine lets its in-flight samples finish first; the colocated baseline's paused
engine releases too. The plan's programs hold no incoming copy under "evict", the simulator makes
the generation side wait out the transfer, and the pushes that read the served weights (delta,
LoRA) are refused by name."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.config_system import ConfigError
from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams, engine_program_specs
from areal_jax.trainer.config import RLConfig, weight_swap_conflict
from tests.test_engine_programs import MESH_CONFIG, _mesh
from tests.test_engine_programs import CFG as SPEC_CFG
from tests.test_live_slots import BASE, CFG, PROMPTS, _assert_same
from tests.test_overlap_scheduling import NEW, OLD


def _run(*, swap_after: int, evict: bool, idle_rounds: int = 3, **config):
    """Every sample's (tokens, logprobs, versions, stop reason), driving the engine round by round:
    after `swap_after` rounds version 1 is pushed; with `evict` the engine first releases its
    weights and `idle_rounds` rounds pass with none held, which must change nothing."""
    engine = GenerationEngine((CFG, OLD), EngineConfig(**{**BASE, **config}))
    handles = [engine.submit(p, SamplingParams(max_new_tokens=3 * (i + 1)), seed=i) for i, p in enumerate(PROMPTS)]
    rounds = 0
    while engine.step():
        rounds += 1
        if rounds == swap_after:
            if evict:
                released = engine.release_weights()
                assert released.done() and released.result() is True
                before = engine.stats()
                for _ in range(idle_rounds):
                    assert engine.step() is False  # nothing to do without weights
                after = engine.stats()
                assert (after.decode_steps, after.finished_samples) == (before.decode_steps, before.finished_samples)
                with pytest.raises(RuntimeError, match="holds no weights"):
                    engine.params  # noqa: B018
            engine.update_weights(NEW, version=1)
        if engine._pages is not None:
            engine._pages.check()
    return engine, [(c.tokens, c.logprobs, c.versions, c.stop_reason) for h in handles for c in h.result().completions]


@pytest.mark.parametrize("config", [dict(on_swap="recompute"), dict(on_swap="keep"),
                                    dict(on_swap="recompute", overlap=True), dict(kv_layout="dense")],
                         ids=["recompute", "keep", "overlap", "dense"])
def test_a_release_before_the_push_gives_the_tokens_of_a_plain_swap(config):
    plain, want = _run(swap_after=2, evict=False, decode_min_rows=1, **config)
    evicted, got = _run(swap_after=2, evict=True, decode_min_rows=1, **config)
    _assert_same(got, want)
    assert evicted.stats().weight_swaps == plain.stats().weight_swaps == 1
    assert {tuple(np.unique(v)) for _, _, v, _ in got} >= {(0, 1)}  # samples spanning the swap
    np.testing.assert_array_equal(evicted.params["embed"], np.asarray(NEW["embed"], evicted.params["embed"].dtype))


def test_a_non_interruptible_engine_releases_after_its_in_flight_samples_finish():
    engine = GenerationEngine((CFG, OLD), EngineConfig(**{**BASE, "interruptible": False}))
    first = [engine.submit(p, SamplingParams(max_new_tokens=6), seed=i) for i, p in enumerate(PROMPTS[:2])]
    engine.step()  # both admitted, decoding
    released = engine.release_weights()
    later = engine.submit(PROMPTS[2], SamplingParams(max_new_tokens=4), seed=9)
    for _ in range(50):
        if released.done():
            break
        engine.step()
    assert all(h.done() for h in first) and not later.done()  # finished on the old weights; none admitted
    assert all(set(c.versions) == {0} for h in first for c in h.result().completions)
    assert engine.step() is False  # the later request waits for weights
    engine.update_weights(NEW, version=1)
    engine.run_until_idle()
    assert all(set(c.versions) == {1} for c in later.result().completions)


def test_the_engine_thread_releases_and_takes_the_push():
    engine = GenerationEngine((CFG, OLD), EngineConfig(**BASE))
    engine.start()
    try:
        handles = [engine.submit(p, SamplingParams(max_new_tokens=12), seed=i) for i, p in enumerate(PROMPTS)]
        assert engine.release_weights().result(timeout=120) is True
        assert engine.update_weights(NEW, version=1).result(timeout=120) is True
        done = [c for h in handles for c in h.result(timeout=300).completions]
    finally:
        engine.stop()
    assert all(c.stop_reason != "aborted" and len(c.tokens) > 0 for c in done)
    assert all(v in (0, 1) for c in done for v in c.versions)


def test_a_paused_engine_releases_for_the_colocated_baselines_push():
    engine = GenerationEngine((CFG, OLD), EngineConfig(**BASE))
    engine.pause()
    assert engine.release_weights().result(timeout=1) is True
    engine.update_weights(NEW, version=1)
    engine.resume()
    handle = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=3), seed=0)
    engine.run_until_idle()
    assert set(handle.result().completions[0].versions) == {1}


def test_weight_swap_is_validated_and_conflicting_pushes_are_refused_by_name():
    with pytest.raises(ValueError, match="EngineConfig.weight_swap must be one of"):
        EngineConfig(weight_swap="drop")
    assert weight_swap_conflict("alongside", RLConfig(transfer_mode="delta"), lora_rank=8) is None
    assert weight_swap_conflict("evict", RLConfig(), lora_rank=0) is None
    assert "transfer_mode = 'delta'" in weight_swap_conflict("evict", RLConfig(transfer_mode="delta"), 0)
    assert "LoRAConfig.rank" in weight_swap_conflict("evict", RLConfig(), 8)
    from tests.test_config_system import _load

    assert _load('EngineConfig.weight_swap = "evict"').engine.weight_swap == "evict"
    with pytest.raises(ConfigError, match="weight_swap = 'evict' with RLConfig.transfer_mode = 'delta'"):
        _load('EngineConfig.weight_swap = "evict"', 'RLConfig.transfer_mode = "delta"')


def test_evicting_programs_hold_no_incoming_weight_copy():
    mesh = _mesh(2, 2)
    alongside = engine_program_specs(SPEC_CFG, MESH_CONFIG, mesh=mesh, param_dtype=jnp.float32)
    evict = engine_program_specs(SPEC_CFG, dataclasses.replace(MESH_CONFIG, weight_swap="evict"), mesh=mesh,
                                 param_dtype=jnp.float32)
    assert [s.name for s in alongside] == [s.name for s in evict]
    for a, e in zip(alongside, evict):
        assert len(a.resident) == len(e.resident) + 1, a.name  # exactly the incoming copy is gone
        assert isinstance(a.resident[-1], dict) and set(a.resident[-1]) >= {"embed", "layers"}


@pytest.mark.slow  # a whole (short) async run: about a minute on 2 cores
def test_an_async_run_with_evicting_swaps_trains_and_pushes(tmp_path):
    from areal_jax.cli import main
    from areal_jax.metrics import read_jsonl
    from tests.test_cli import SPLIT_8, _args

    assert main(_args(tmp_path, 'EngineConfig.weight_swap = "evict"', SPLIT_8)) == 0
    records = [r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["step"] >= 0]
    assert records and all(np.isfinite(m["train/loss"]) for m in records if "train/loss" in m)
    assert max(m["version"] for m in records) >= 2  # the pushes landed: later steps trained on them
    assert all(m["transfer/seconds"] > 0 for m in records)


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "split"])
def test_a_colocated_evicting_engine_holds_no_weights_while_the_trainer_updates(colocated, tmp_path):
    """Colocated, the update's programs share the engine's devices: with weight_swap "evict" the
    engine drops its weights before each update (RLCluster.begin_update), not only before the
    push, so nothing decodes during it and the update has the served copy's memory. On a split the
    engine keeps decoding through the update and releases just before the push. Either way every
    push lands and the engine ends serving the trainer's final weights."""
    import jax

    from tests.test_rl_loop import make_loop
    from tests.tokenizer_fixtures import build_tiny_tokenizer
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.parallel import MeshConfig

    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "chatml"))
    steps = 3
    rl = RLConfig(steps=steps, batch_size=2, max_staleness=1, max_concurrent=4)
    mesh = MeshConfig(colocated=True) if colocated else MeshConfig(num_generation_devices_per_host=2)
    loop = make_loop(tokenizer, rl=rl, mesh=mesh, devices=jax.devices()[:1] if colocated else jax.devices()[:4],
                     engine=EngineConfig(num_slots=8, max_seq_len=48, decode_chunk=2, weight_swap="evict"))
    engine = loop.cluster.engine
    assert loop.cluster.evict_for_update is colocated
    held_at_update = []  # the "update" hooks run after the step's programs, before its push
    loop.add_hook(lambda info: held_at_update.append(engine._params is not None), stage="update")
    result = loop.run()
    assert result.steps == steps and engine.version == steps
    assert held_at_update == [not colocated] * steps
    served = jax.tree.map(np.asarray, engine.params)
    trained = jax.tree.map(np.asarray, result.final_params)
    np.testing.assert_array_equal(served["embed"], trained["embed"])
    assert all(np.isfinite(m["train/loss"]) for m in result.history)
    assert all(0 <= m["rollout/reprefill_shared_tokens"] <= m["rollout/reprefill_tokens"] for m in result.history)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's own raise
def test_a_dead_engine_thread_fails_a_waiting_release_and_push_instead_of_hanging(monkeypatch):
    """The trainer blocks on `release_weights().result()` (a push under "evict", colocated before
    every update): if the engine thread dies, that wait, the pending push, and any asked later
    fail with the thread's error."""
    engine = GenerationEngine((CFG, OLD), EngineConfig(**BASE))

    def failing_round():  # the round's first step, before any release or swap
        raise RuntimeError("the round failed")

    monkeypatch.setattr(engine, "_apply_aborts", failing_round)
    engine.pause()  # the release and the push wait for a round, which fails
    engine.start()
    try:
        released, pushed = engine.release_weights(), engine.update_weights(NEW, version=1)
        handle = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=3), seed=0)
        engine.resume()
        for future in (released, pushed, handle):
            with pytest.raises(RuntimeError, match="the round failed"):
                future.result(timeout=60)
        with pytest.raises(RuntimeError, match="the round failed"):
            engine.release_weights().result(timeout=1)
        with pytest.raises(RuntimeError, match="the round failed"):
            engine.update_weights(NEW, version=2).result(timeout=1)
    finally:
        engine.stop(abort_pending=False)  # aborting would run the failing step again
