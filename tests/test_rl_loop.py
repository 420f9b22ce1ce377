"""The RL loop end to end: real trainer, engine, controller and weight transfer on fake CPU devices."""

import itertools
import pathlib

import jax
import numpy as np
import pytest

from areal_jax import config_system as cs
from areal_jax.data.formats import PromptRow
from areal_jax.generation import EngineConfig
from areal_jax.models import ModelConfig, init_params
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.parallel import MeshConfig
from areal_jax.ppo import AdvantageConfig
from areal_jax.rollout.workflow import RLVRConfig
from areal_jax.trainer import OptimizerConfig, PPOConfig, RLConfig, TrainEngineConfig
from areal_jax.jobs.rl_loop_builder import build_rl_loop
from tests.multiprocess import run_processes
from tests.tokenizer_fixtures import build_tiny_tokenizer

REWARD = "tests.rollout_fixtures:scripted_reward"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), "chatml"))


def rows(tokenizer, reward_script="text_hash", offset=0):
    for i in itertools.count(offset):
        question = f"What is {i % 50}+{i % 7}?"
        row = PromptRow(query_id=f"q{i}", messages=[{"role": "user", "content": question}], answer=reward_script,
                        test_cases=None, task="math", source=f"gen:{i}")
        yield {"prompt_ids": np.asarray(tokenizer.encode(question), np.int32), "row": row}


def make_loop(tokenizer, *, rl: RLConfig, mesh: MeshConfig, devices, reward_script="text_hash", row_offset=0,
              advantages=AdvantageConfig(norm="group"), workflow=None, data=None, max_seq_len=48, engine=None, **kw):
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    params = init_params(cfg, 0, std=0.3)
    return build_rl_loop(
        cfg, params, tokenizer=tokenizer, data_iter=data or rows(tokenizer, reward_script, row_offset), rl=rl,
        ppo=PPOConfig(num_minibatches=2), train_engine=TrainEngineConfig(max_tokens_per_microbatch=256),
        optimizer=OptimizerConfig(lr=1e-3), advantages=advantages,
        workflow=workflow or RLVRConfig(n_samples=4, max_new_tokens=6, reward=REWARD, filter_all_equal_rewards=False),
        engine=engine or EngineConfig(num_slots=8, max_seq_len=max_seq_len, decode_chunk=2), mesh=mesh, devices=devices,
        **kw)


def test_async_loop_bounds_staleness_and_keeps_versions(tokenizer):
    rl = RLConfig(steps=4, batch_size=2, max_staleness=1, max_concurrent=4, max_group_age=1)
    loop = make_loop(tokenizer, rl=rl, mesh=MeshConfig(num_generation_devices_per_host=2),
                     devices=jax.devices()[:4])
    assert loop.cluster.meshes.train.devices.size == 2 and loop.cluster.meshes.generation.devices.size == 2
    before = jax.tree.map(np.asarray, loop.cluster.trainer.params)
    engine = loop.cluster.engine
    result = loop.run()
    assert result.steps == 4 and result.version == 4 and engine.version == 4
    for m in result.history:
        assert m["staleness/max"] <= rl.max_staleness + rl.max_group_age
        assert np.isfinite(m["train/loss"]) and m["train/trained_tokens"] > 0
    report = result.rollout_report
    assert report.balanced
    after = jax.tree.map(np.asarray, result.final_params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    # The generator serves exactly the trainer's weights (bitwise: fp32 both sides).
    served = engine.params
    for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(after)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_sync_mode_trains_only_on_policy_tokens(tokenizer):
    rl = RLConfig(steps=3, batch_size=2, max_staleness=0, max_concurrent=4, mode="sync")
    loop = make_loop(tokenizer, rl=rl, mesh=MeshConfig(colocated=True), devices=jax.devices()[:2])
    result = loop.run()
    assert result.version == 3
    for m in result.history:
        assert m["staleness/max"] == 0 and m["staleness/hist"].keys() == {"0"}


def test_kl_penalty_against_the_initial_policy(tokenizer):
    rl = RLConfig(steps=2, batch_size=2, max_staleness=0, max_concurrent=4, mode="sync")
    loop = make_loop(tokenizer, rl=rl, mesh=MeshConfig(colocated=True), devices=jax.devices()[:1],
                     advantages=AdvantageConfig(norm="group", kl_coef=0.1, kl_estimator="k3"))
    result = loop.run()
    kl = [m["train/kl_to_reference"] for m in result.history]
    assert kl[0] == 0.0  # step 0 trains the initial policy itself
    assert kl[1] > 0.0  # after one update the policy has moved away from the reference


def test_bad_batch_split_is_reported_before_work_starts(tokenizer):
    with pytest.raises(ValueError, match="max_staleness = 0"):
        RLConfig(mode="sync", max_staleness=2)
    with pytest.raises(ValueError, match="batch_size"):
        RLConfig(batch_size=0)


def test_areal_eta_name_is_refused_with_a_pointer():
    # AReaL's max_head_offpolicyness is eta (our max_staleness), not the per-group age filter.
    with pytest.raises(ValueError, match="AReaL's name for eta: set RLConfig.max_staleness"):
        RLConfig(max_head_offpolicyness=4)
    cs.register(RLConfig)
    cs.parse(gin_params=["RLConfig.max_head_offpolicyness = 4"])
    try:
        with pytest.raises(cs.ConfigError, match="RLConfig.max_head_offpolicyness is AReaL's name for eta"):
            cs.build(RLConfig)
    finally:
        cs.parse()  # clear the bindings for later tests
    assert RLConfig(max_group_age=2).max_group_age == 2
    with pytest.raises(ValueError, match="RLConfig.max_group_age"):
        RLConfig(max_group_age=-1)


def test_sampling_and_training_temperatures_must_agree(tokenizer):
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"PPOConfig.temperature \(1.0\) is derived from RLVRConfig.temperature \(0.7\)"):
        build_rl_loop(cfg, init_params(cfg, 0), tokenizer=tokenizer, data_iter=rows(tokenizer), rl=RLConfig(),
                      ppo=PPOConfig(temperature=1.0), optimizer=OptimizerConfig(), advantages=AdvantageConfig(),
                      workflow=RLVRConfig(n_samples=2, max_new_tokens=4, reward=REWARD, temperature=0.7),
                      engine=EngineConfig(num_slots=4, max_seq_len=32), mesh=MeshConfig(colocated=True))


def test_two_processes_train_with_consistent_versions(tmp_path):
    """2 processes x 4 fake CPU devices over real jax.distributed: 2 train + 2 generation devices each."""
    tok_dir = build_tiny_tokenizer(tmp_path / "tok", "chatml")
    worker = pathlib.Path(__file__).parent / "multiprocess_rl_worker.py"
    results = run_processes(worker, lambda i: ("2", tok_dir, tmp_path), tmp_path, timeout=600)
    a, b = results
    assert a["versions"] == b["versions"] == [1, 2, 3]
    assert a["engine_version"] == b["engine_version"] == 3
    assert a["params_checksum"] == b["params_checksum"]  # one global model, seen alike by both
    assert a["served_equals_trained"] and b["served_equals_trained"]
    assert a["balanced"] and b["balanced"]
    assert max(a["staleness_max"], b["staleness_max"]) <= 2
