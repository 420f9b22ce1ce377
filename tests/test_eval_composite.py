"""The held-out evaluation (`EvaluationHook`) and `areal-jax eval` (`run_evaluation`) score a
composite reward as the rollouts do: each sample's reward is the weighted sum of its terms
(computed here term by term on the same completions), each term's mean and failures are
reported, accuracy comes from the verifier term, and a reward of learned terms alone has no
accuracy but still its reward."""

import json

import numpy as np
import pytest

from areal_jax.data.formats import PromptRow
from areal_jax.evaluation import EvalConfig, run_evaluation
from areal_jax.generation.config import EngineConfig
from areal_jax.generation.engine import GenerationEngine
from areal_jax.models import init_params
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.reward.reward_model import RewardModel
from areal_jax.rollout.workflow import RLVRConfig
from areal_jax.trainer.config import RLConfig
from areal_jax.trainer.hooks import EvaluationHook
from tests.learned_reward_fixtures import CFG, build_rm_and_judge
from tests.rollout_fixtures import scripted_reward

COIN = "tests.rollout_fixtures:scripted_reward"  # gold "coin": 1.0 for about half the texts
BOOM = "tests.reward_fixtures:boom"  # raises: 0.0, counted as failed
BUDGET = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(policy params, tokenizer, rm directory, held-out rows)."""
    tok_dir, rm_dir, _ = build_rm_and_judge(tmp_path_factory.mktemp("eval_composite"))
    tok = Tokenizer.from_pretrained(tok_dir)
    rows = []
    for i in range(16):
        messages = [{"role": "user", "content": f"What is {i}+{i % 7}?"}]
        rows.append({"prompt_ids": np.asarray(tok.apply_chat_template(messages, add_generation_prompt=True), np.int32),
                     "row": PromptRow(f"q{i}", messages, "coin", None, "math", f"held_out.jsonl:{i}")})
    return init_params(CFG, 5, std=0.3), tok, rm_dir, rows


def _terms_by_hand(tok, rm_dir, rows, texts):
    """(coin verifier, rm score) of each greedy completion, each term called on its own."""
    coin = np.array([scripted_reward(t, "coin") for t in texts])
    rm = RewardModel.from_pretrained(rm_dir).score_chats(
        [[r["row"].messages[-1], {"role": "assistant", "content": t}] for r, t in zip(rows, texts)])
    return coin, rm


def test_eval_and_the_held_out_hook_score_the_composite_reward(setup, tmp_path):
    params, tok, rm_dir, rows = setup
    rm_name = f"rm:{rm_dir}"
    terms = ((COIN, 1.0), (rm_name, 0.5), (BOOM, 2.0))
    report = run_evaluation((CFG, params), tok, rows, EvalConfig(max_new_tokens=BUDGET, reward=terms, num_slots=8,
                                                                max_seq_len=64), out_path=tmp_path / "samples.jsonl")
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    texts = [s["completion"] for s in samples]
    coin, rm = _terms_by_hand(tok, rm_dir, rows, texts)
    assert 0.0 < coin.mean() < 1.0 and len(set(np.round(rm, 5))) > 1  # the terms tell completions apart
    for s, c, r in zip(samples, coin, rm):
        assert s["reward"] == pytest.approx(c + 0.5 * r, abs=1e-4)  # boom: 0.0
        assert s["correct"] == (c >= 1.0) and s["failed_terms"] == [BOOM]
        assert s["terms"][rm_name] == pytest.approx(r, abs=1e-4)
    overall = report.overall
    assert overall["accuracy"] == overall["pass@1"] == pytest.approx(coin.mean())  # by the verifier term
    assert overall["mean_reward"] == pytest.approx(float(np.mean(coin + 0.5 * rm)), abs=1e-4)
    assert overall[f"reward/{COIN}/mean"] == pytest.approx(coin.mean())
    assert overall[f"reward/{rm_name}/mean"] == pytest.approx(float(rm.mean()), abs=1e-4)
    assert overall[f"reward/{BOOM}/failed"] == len(rows) and overall[f"reward/{rm_name}/failed"] == 0
    assert report.per_dataset["held_out.jsonl"][f"reward/{COIN}/mean"] == overall[f"reward/{COIN}/mean"]

    # RL's held-out evaluation: the same greedy completions on the loop's running engine.
    engine = GenerationEngine((CFG, params), EngineConfig(num_slots=8, max_seq_len=64))
    rl = RLConfig(steps=1, batch_size=1, eval_every=1, eval_max_new_tokens=BUDGET)
    engine.start()
    try:
        for reward in (terms, ((rm_name, 1.0),)):
            rollout = RLVRConfig(n_samples=1, max_new_tokens=BUDGET, reward=reward,
                                 stop_token_ids=tuple(tok.stop_token_ids))
            hook = EvaluationHook(engine, rows, tokenizer=tok, rl=rl, rollout=rollout)
            try:
                metrics = hook.evaluate()
            finally:
                hook.close()
            if reward is terms:
                assert metrics["eval/accuracy"] == pytest.approx(coin.mean())
                assert metrics["eval/reward/mean"] == pytest.approx(overall["mean_reward"], abs=1e-4)
                assert metrics[f"eval/reward/{BOOM}/failed"] == len(rows)
                assert metrics[f"eval/reward/{COIN}/mean"] == pytest.approx(coin.mean())
            else:  # learned terms alone: no accuracy, the reward still
                assert "eval/accuracy" not in metrics
                assert metrics["eval/reward/mean"] == pytest.approx(float(rm.mean()), abs=1e-4)
            assert metrics[f"eval/reward/{rm_name}/mean"] == pytest.approx(float(rm.mean()), abs=1e-4)
    finally:
        engine.stop()


def test_eval_of_learned_terms_alone_reports_the_reward_without_accuracy(setup):
    params, tok, rm_dir, rows = setup
    report = run_evaluation((CFG, params), tok, rows[:4], EvalConfig(max_new_tokens=BUDGET, reward=((f"rm:{rm_dir}", 2.0),),
                                                                    num_slots=4, max_seq_len=64))
    assert not {"accuracy", "pass@1", "maj@1"} & set(report.overall)
    assert report.overall["mean_reward"] == pytest.approx(2.0 * report.overall[f"reward/rm:{rm_dir}/mean"], abs=1e-4)


def test_eval_config_takes_a_composite_reward_and_its_judge():
    cfg = EvalConfig(reward=[["math", 1], ["rm:/x", 0.5]])  # as a run's config.json holds it
    assert cfg.reward == (("math", 1.0), ("rm:/x", 0.5)) and cfg.verifier == "math"
    assert EvalConfig(reward=(("rm:/x", 1.0),)).verifier is None
    with pytest.raises(ValueError, match="EvalConfig.judge"):
        EvalConfig(reward=(("math", 1.0), ("judge", 1.0)))
    judged = EvalConfig(reward=(("judge", 1.0),), judge={"model": "/j", "parse": "logprob", "choices": ["Yes", "No"]})
    assert judged.judge.model == "/j" and tuple(judged.judge.choices) == ("Yes", "No")
    with pytest.raises(ValueError, match="EvalConfig.reward"):
        EvalConfig(reward=())


def test_sft_stopping_on_accuracy_needs_a_verifier_term(setup):
    from areal_jax.config_system import ConfigError
    from areal_jax.job_config import check_cross_fields
    from areal_jax.python_api import load_config

    rm_dir = setup[2]
    base = ["SFTConfig.eval_every = 20", "TaskSource.validation_size = 10"]
    check_cross_fields(load_config(overrides=base + [f"RLVRConfig.reward = (('rm:{rm_dir}', 1.0), ('arithmetic', 0.0))"]))
    with pytest.raises(ConfigError, match="SFTConfig.eval_every"):
        check_cross_fields(load_config(overrides=base + [f"RLVRConfig.reward = (('rm:{rm_dir}', 1.0),)"]))
