"""The seams of areal_jax/api/: the native engine, trainer and workflows implement the Protocols,
and a second, independent implementation of both engines (tests/seam_fixtures.py) runs the RL loop."""

import numpy as np
import pytest

from areal_jax import api
from areal_jax.generation.sampling import SamplingParams
from areal_jax.trainer.algorithm import ppo_objective, ppo_trainer
from areal_jax.trainer.config import PPOConfig
from tests.seam_fixtures import BigramEngine, BigramTrainEngine

V = 12  # the bigram policy's vocabulary


def test_native_engine_trainer_and_workflows_implement_the_protocols():
    import jax

    from areal_jax.generation import EngineConfig, GenerationEngine
    from areal_jax.models import ModelConfig, init_params
    from areal_jax.rollout.workflow import RLVRConfig, RLVRWorkflow, RolloutClient, missing_workflow_members
    from areal_jax.trainer import OptimizerConfig
    from areal_jax.workflows.multi_turn_math import MultiTurnMathWorkflow

    cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    params = init_params(cfg, 0)
    engine = GenerationEngine((cfg, params), EngineConfig(num_slots=2, max_seq_len=16, decode_chunk=2))
    trainer = ppo_trainer(cfg, params, OptimizerConfig(), PPOConfig(), mesh=None)
    assert isinstance(engine, api.InferenceEngine) and isinstance(trainer, api.TrainEngine)
    assert isinstance(RLVRWorkflow(RLVRConfig()), api.RolloutWorkflow)
    assert missing_workflow_members(MultiTurnMathWorkflow) == []
    assert isinstance(RolloutClient(engine, None), api.RolloutClient)  # what every workflow receives
    # The seams are structural: the bigram doubles share no code with the native classes.
    table = {"table": np.zeros((V, V), np.float32)}
    assert isinstance(BigramEngine(table, max_seq_len=8), api.InferenceEngine)
    assert isinstance(BigramTrainEngine(table, ppo_objective(PPOConfig()), lr=0.1), api.TrainEngine)
    # ...and they are checked: a trainer is no engine, an engine no trainer.
    assert not isinstance(trainer, api.InferenceEngine) and not isinstance(engine, api.TrainEngine)
    del jax


def test_bigram_engine_honours_the_engine_contract():
    """Per-token versions follow weight swaps, abort ends samples, the logprobs are the table's."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(V, V)).astype(np.float32)
    engine = BigramEngine({"table": table}, max_seq_len=64)
    engine.start()
    try:
        sp = SamplingParams(max_new_tokens=20, temperature=0.7)
        result = engine.submit([1, 2], sp, 3, seed=5).result(timeout=30)
        for c in result.completions:
            prev = np.concatenate([[2], c.tokens[:-1]])
            logp = table[prev] / 0.7
            logp = logp - logp.max(-1, keepdims=True)
            logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
            np.testing.assert_allclose(c.logprobs, logp[np.arange(len(prev)), c.tokens], rtol=1e-5, atol=1e-6)
            assert (c.versions == 0).all() and c.stop_reason == "length"
        assert engine.update_weights({"table": -table}, 3).result(timeout=30) is True
        assert engine.version == 3
        assert (engine.submit([1], sp).result(timeout=30).completions[0].versions == 3).all()
        engine.pause()
        handle = engine.submit([1], sp)
        engine.abort(handle.request_id)
        engine.resume()
        assert handle.result(timeout=30).completions[0].stop_reason == "aborted"
    finally:
        engine.stop()


def prompt_rows():
    import itertools

    from areal_jax.data.formats import PromptRow

    for i in itertools.count():
        row = PromptRow(query_id=f"q{i}", messages=[{"role": "user", "content": "go"}], answer="c", test_cases=None,
                        task="math", source=f"gen:{i}")
        yield {"prompt_ids": np.asarray([1 + i % 5, 1 + i % 3], np.int32), "row": row}


@pytest.mark.parametrize("objective, metric", [("decoupled", "train/clip_frac"),
                                               ("tests.seam_fixtures:reinforce_loss", "train/reinforce_ratio")])
def test_the_loop_runs_on_a_second_implementation_of_both_engines(objective, metric):
    """RLLoop over the bigram engine and trainer: versions advance on both sides, the engine ends
    serving the trainer's weights, staleness stays bounded, the hooks see every step (as data: the
    step, version, groups and metrics, never the loop), and the policy really learns (the reward,
    the share of the letter "c", rises from chance); with the built-in objective and with a user's
    loss named "module:function", whose own metric reaches the records under train/."""
    from areal_jax.ppo import AdvantageConfig
    from areal_jax.rollout.workflow import RLVRConfig, RLVRWorkflow
    from areal_jax.trainer.algorithm import PPOStep
    from areal_jax.trainer.cluster import RLCluster
    from areal_jax.trainer.config import RLConfig, TrainEngineConfig
    from areal_jax.api import Hook
    from areal_jax.trainer.loop import RLLoop
    from tests.seam_fixtures import LetterTokenizer

    steps = 12
    rl = RLConfig(steps=steps, batch_size=4, max_staleness=1, max_concurrent=8)
    rollout = RLVRConfig(n_samples=4, max_new_tokens=8, reward="tests.seam_fixtures:letter_reward")
    table = {"table": np.random.default_rng(1).normal(scale=0.1, size=(V, V)).astype(np.float32)}
    ppo = PPOConfig(objective=objective, num_minibatches=1, temperature=1.0)
    trainer = BigramTrainEngine(table, ppo_objective(ppo), lr=40.0, engine=TrainEngineConfig(max_tokens_per_microbatch=64))
    engine = BigramEngine(table, max_seq_len=32)
    cluster = RLCluster(trainer, engine, lambda p: {"table": np.asarray(p["table"])}, rl=rl)
    cluster.connect(RLVRWorkflow(rollout), prompt_rows(), tokenizer=LetterTokenizer())
    seen, infos = [], []
    hooks = [Hook(lambda info: seen.append(("update", info.step, info.version)), stage="update"),
             Hook(infos.append, stage="metrics"), Hook(infos.append, stage="end")]
    loop = RLLoop(cluster, PPOStep(trainer, AdvantageConfig(norm="group"), ppo), rl=rl, hooks=hooks)
    loop.add_hook(lambda info: seen.append(("record", info.step, info.metrics["version"])), stage="record", every=3)
    result = loop.run()

    assert result.steps == steps and result.version == steps and engine.version == steps
    assert engine.versions_served == sorted(engine.versions_served) and engine.versions_served[-1] == steps
    np.testing.assert_allclose(engine.params["table"], trainer.params["table"])  # the final push served
    assert [s for s in seen if s[0] == "update"] == [("update", i, i + 1) for i in range(steps)]
    assert [s for s in seen if s[0] == "record"] == [("record", i, i + 1) for i in (2, 5, 8, 11)]
    # What the hooks saw: each step's own batch and record, the run's token count so far, the last
    # step flagged; "end" once, with the last step's info, not stopped.
    *steps_seen, end = infos
    assert [i.step for i in steps_seen] == list(range(steps)) and [i.version for i in steps_seen] == [
        m["version"] for m in result.history]
    assert all(i.metrics is m for i, m in zip(steps_seen, result.history))
    assert all(len(i.groups) == rl.batch_size and i.metrics["reward/mean"] == pytest.approx(np.mean(
        [t.reward for g in i.groups for t in g.trajectories])) for i in steps_seen)
    assert [i.trained_tokens for i in steps_seen] == [m["train/trained_tokens_total"] for m in result.history]
    assert [i.last for i in steps_seen] == [False] * (steps - 1) + [True]
    assert end.step == steps - 1 and end.last and not end.stopped
    for m in result.history:
        assert m["staleness/max"] <= rl.max_staleness and m["train/trained_tokens"] > 0 and np.isfinite(m[metric])
    assert result.rollout_report.balanced
    # Chance is 1/12; the trained policy samples "c" most of the time (runs end near 0.97).
    first, last = result.history[0]["reward/mean"], np.mean([m["reward/mean"] for m in result.history[-3:]])
    assert first < 0.3 and last > 0.6, [m["reward/mean"] for m in result.history]


def test_hooks_receive_data_not_the_loop():
    """StepInfo is frozen data (step, version, groups, metrics, ...): no field reaches the loop, the
    cluster or an engine; a Hook's stage and cadence are checked when it is made."""
    import dataclasses

    from areal_jax.api import STAGES, Hook, StepInfo

    names = {f.name for f in dataclasses.fields(StepInfo)}
    assert {"step", "version", "groups", "metrics"} <= names and "loop" not in names
    assert names == {"step", "version", "groups", "metrics", "trained_tokens", "last", "stopped",
                     "counters"}
    info = StepInfo(3, 4, (), {}, 10.0, last=False)
    assert not hasattr(info, "loop")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.step = 5
    assert STAGES == ("update", "metrics", "record", "end")
    with pytest.raises(ValueError, match="hook stage must be one of"):
        Hook(print, stage="later")
    with pytest.raises(ValueError, match="hook every must be an int >= 1"):
        Hook(print, every=0)
