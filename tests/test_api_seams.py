"""The seams of areal_jax/api.py: the native engine, trainer and workflows implement the Protocols,
and a second, independent implementation of both engines (tests/seam_fixtures.py) runs the RL loop."""

import numpy as np
import pytest

from areal_jax import api
from areal_jax.generation.sampling import SamplingParams
from areal_jax.trainer.config import PPOConfig
from tests.seam_fixtures import BigramEngine, BigramTrainer

V = 12  # the bigram policy's vocabulary


def test_native_engine_trainer_and_workflows_implement_the_protocols():
    import jax

    from areal_jax.generation import EngineConfig, GenerationEngine
    from areal_jax.models import ModelConfig, init_params
    from areal_jax.rollout.workflow import RLVRConfig, RLVRWorkflow
    from areal_jax.trainer import OptimizerConfig, PolicyTrainer
    from areal_jax.workflows.multi_turn_math import MultiTurnMathWorkflow

    cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    params = init_params(cfg, 0)
    engine = GenerationEngine((cfg, params), EngineConfig(num_slots=2, max_seq_len=16, decode_chunk=2))
    trainer = PolicyTrainer(cfg, params, OptimizerConfig(), PPOConfig(), mesh=None)
    assert isinstance(engine, api.InferenceEngine) and isinstance(trainer, api.TrainEngine)
    assert isinstance(RLVRWorkflow(RLVRConfig()), api.RolloutWorkflow)
    assert issubclass(MultiTurnMathWorkflow, api.RolloutWorkflow)
    # The seams are structural: the bigram doubles share no code with the native classes.
    table = {"table": np.zeros((V, V), np.float32)}
    assert isinstance(BigramEngine(table, max_seq_len=8), api.InferenceEngine)
    assert isinstance(BigramTrainer(table, PPOConfig(), lr=0.1), api.TrainEngine)
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

