"""One held-out evaluator (evaluation/held_out.py): RL's `eval/accuracy`, SFT's stopping probe and
`areal-jax eval` report the same accuracy of the same weights on the same rows, and it is the
accuracy of the greedy completions a separate generator writes, scored by the reward directly."""

import itertools

import jax
import pytest

from areal_jax.evaluation import EvalConfig, GreedyAccuracy, run_evaluation
from areal_jax.generation import EngineConfig
from areal_jax.generation.offline import generate
from areal_jax.models import ModelConfig, init_params
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.models.transformer import Transformer
from areal_jax.parallel import MeshConfig
from areal_jax.ppo import AdvantageConfig
from areal_jax.reward.pool import RewardPool, RewardPoolConfig
from areal_jax.reward.scoring import RewardScorer
from areal_jax.rollout.workflow import RLVRConfig
from areal_jax.trainer import OptimizerConfig, PPOConfig
from areal_jax.jobs.rl_loop_builder import build_rl_loop
from areal_jax.trainer.config import RLConfig
from areal_jax.trainer.hooks import EvaluationHook
from tests.rollout_fixtures import scripted_reward
from tests.test_rl_loop import REWARD, rows
from tests.tokenizer_fixtures import build_tiny_tokenizer

BUDGET = 8  # completion tokens of every held-out check


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), "chatml"))


@pytest.mark.parametrize("seed", [0, 1])
def test_rl_sft_and_eval_report_the_same_held_out_accuracy(tokenizer, seed):
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    params = init_params(cfg, seed, std=0.3)
    held_out = list(itertools.islice(rows(tokenizer, "coin", offset=100 * seed), 24))  # reward 1 for ~half the texts
    stop = tuple(tokenizer.stop_token_ids)

    # The reference: greedy completions of the offline generator, scored by calling the reward.
    completions = generate(Transformer(cfg, params), [r["prompt_ids"].tolist() for r in held_out],
                           max_new_tokens=BUDGET, temperature=0.0, stop_token_ids=stop)
    texts = [tokenizer.decode([int(t) for t in c[0].tokens], skip_special_tokens=True) for c in completions]
    want = sum(scripted_reward(text, "coin") >= 1.0 for text in texts) / len(texts)
    assert 0.0 < want < 1.0 and len(set(texts)) > 1  # the comparison can tell evaluators apart

    # SFT's stopping probe (and the job's accuracy before and after RL).
    probe = GreedyAccuracy(cfg, held_out, tokenizer, max_new_tokens=BUDGET,
                           reward_fn=RewardScorer(REWARD, None, timeout_s=10.0))
    assert probe(params) == want
    # `areal-jax eval`, greedy: accuracy and pass@1.
    report = run_evaluation((cfg, params), tokenizer, held_out,
                            EvalConfig(max_new_tokens=BUDGET, reward=REWARD, num_slots=8, max_seq_len=64))
    assert report.overall["accuracy"] == report.overall["pass@1"] == want
    # RL: the loop's own engine running on its thread, rewards in the rollouts' worker pool.
    with RewardPool(RewardPoolConfig(num_workers=2, preload=("tests.rollout_fixtures",))) as pool:
        rl = RLConfig(steps=1, batch_size=2, eval_max_new_tokens=BUDGET)
        rollout = RLVRConfig(n_samples=2, max_new_tokens=4, reward=REWARD, stop_token_ids=stop)
        loop = build_rl_loop(cfg, params, tokenizer=tokenizer, data_iter=rows(tokenizer), reward_pool=pool, rl=rl,
                             ppo=PPOConfig(), optimizer=OptimizerConfig(), advantages=AdvantageConfig(),
                             workflow=rollout, engine=EngineConfig(num_slots=8, max_seq_len=48, decode_chunk=2),
                             mesh=MeshConfig(colocated=True), devices=jax.devices()[:1])
        engine = loop.cluster.engine
        evaluation = EvaluationHook(engine, held_out, tokenizer=tokenizer, rl=rl, rollout=rollout, reward_pool=pool)
        engine.start()
        try:
            assert evaluation.accuracy() == want
        finally:
            engine.stop()
        assert pool.stats().succeeded == len(held_out)  # scored in the pool, not in this process


@pytest.mark.parametrize("data, eval_size, num_slots", [(1, 200, 48), (2, 5, 48), (4, 37, 8), (4, 300, 128)])
def test_the_planner_sizes_the_evaluation_engine_the_run_builds(data, eval_size, num_slots):
    # `areal-jax plan` accounts for the run's evaluation engine by the same sizing (once a copy of
    # it that rounded slots down where the engine's other uses round up): both are
    # generation.config.prompts_engine_config, capped by JobConfigs.eval_engine_slots.
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from areal_jax.data.examples import PromptExample
    from areal_jax.data.formats import PromptRow
    from areal_jax.generation.config import round_slots
    from areal_jax.job_config import JobConfigs, TaskSource
    from areal_jax.plan.job import eval_engine_config

    job = JobConfigs(task=TaskSource(eval_size=eval_size), engine=EngineConfig(num_slots=num_slots, max_seq_len=256),
                     rollout=RLVRConfig(max_new_tokens=40))
    longest = 23
    examples = [PromptExample(np.arange(1, longest + 1 - i % 3, dtype=np.int32), "1",
                              PromptRow(str(i), [], "1", None, "math", "t")) for i in range(eval_size)]
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    mesh = Mesh(np.asarray(jax.devices()[:data]), ("data",))  # the generation mesh's data replicas
    weights = {"embed": jax.device_put(np.zeros((64, 16), np.float32), NamedSharding(mesh, PartitionSpec()))}
    built = GreedyAccuracy(cfg, examples, None, max_new_tokens=job.rl.eval_max_new_tokens,
                           slots=job.eval_engine_slots(cfg, data))._engine_config_for(weights)  # as jobs/train.py
    planned = eval_engine_config(job, longest, data, hosts=1, model_cfg=cfg)
    assert (planned.num_slots * data, planned.max_seq_len) == (built.num_slots, built.max_seq_len)
    assert built.num_slots == round_slots(min(64, num_slots, eval_size), data) <= num_slots
    assert built.max_seq_len % 16 == 0 and built.max_seq_len >= longest + 40 + 1


def test_one_slot_rounding_rule():
    from areal_jax.generation.config import round_slots

    assert [round_slots(s, 4) for s in (1, 4, 5, 8, 63, 64)] == [4, 4, 8, 8, 64, 64]
    assert all(round_slots(s, 1) == s for s in range(1, 9))
