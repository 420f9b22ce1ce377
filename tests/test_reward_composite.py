"""Composite rewards (reward/composite.py): weighted verifier, reward-model and judge terms scored
by RLVRWorkflow against each term computed on its own, failed terms counted, and the per-term
metrics of a step's record."""

import asyncio
import math

import numpy as np
import pytest

from areal_jax.data.formats import PromptRow
from areal_jax.generation.config import EngineConfig
from areal_jax.generation.engine import GenerationEngine
from areal_jax.models import init_params
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.reward.composite import LearnedRewards, normalize_reward, term_metrics
from areal_jax.reward.judge import Judge, JudgeConfig
from areal_jax.reward.reward_model import RewardModel
from areal_jax.rollout.workflow import RLVRConfig, RLVRWorkflow, RolloutClient
from areal_jax.tasks.reward import arithmetic_reward
from tests.learned_reward_fixtures import CFG, build_rm_and_judge

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy params, tokenizer, rm directory, judge directory)."""
    tok_dir, rm_dir, judge_dir = build_rm_and_judge(tmp_path_factory.mktemp("composite"))
    return init_params(CFG, 5, std=0.3), Tokenizer.from_pretrained(tok_dir), rm_dir, judge_dir


def test_reward_terms_are_checked():
    assert normalize_reward("math") == "math"
    assert normalize_reward([("math", 1), ["rm:/x", 0.5]]) == (("math", 1.0), ("rm:/x", 0.5))
    for bad, match in [((), "no terms"), ((("math", "1"),), "finite number"), ((("math", math.inf),), "finite"),
                       ((("math", 1.0), ("math", 2.0)), "named twice"), ((("rm:", 1.0),), "directory"),
                       ((("", 1.0),), "non-empty"), (("math",), "pairs")]:
        with pytest.raises(ValueError, match=match):
            normalize_reward(bad)
    assert RLVRConfig(reward=(("rm:/x", 1.0),)).verifier is None  # no accuracy, only its reward
    with pytest.raises(ValueError, match="RLVRConfig.judge"):
        RLVRConfig(reward=(("math", 0.0), ("judge", 1.0)))
    cfg = RLVRConfig(reward=(("rm:/x", 1.0), ("arithmetic", 0.0)))
    assert cfg.verifier == "arithmetic" and cfg.learned_terms == ("rm:/x",) and cfg.verifier_terms == ("arithmetic",)
    assert RLVRConfig(reward="math").reward_terms == (("math", 1.0),)


def test_term_metrics_average_over_completions_and_sum_failures():
    infos = [{"reward_terms": {"math": [1.0, 4, 0], "judge": [2.0, 4, 1]}}, {"source": "x"},
             {"reward_terms": {"math": [3.0, 4, 0], "judge": [0.0, 4, 3]}}]
    assert term_metrics(infos) == {"reward/math/mean": 0.5, "reward/math/failed": 0,
                                   "reward/judge/mean": 0.25, "reward/judge/failed": 4}
    assert term_metrics([{"source": "x"}]) == {}


def _one_group(params, tok, workflow, question, gold):
    """One group of `workflow` on a policy engine of `params` for the chat [user: question]; the
    workflow is closed after. Returns the group and the rollout client."""
    engine = GenerationEngine((CFG, params), EngineConfig(num_slots=4, max_seq_len=128))
    engine.start()
    client = RolloutClient(engine, tok)
    messages = [{"role": "user", "content": question}]
    row = {"prompt_ids": np.asarray(tok.apply_chat_template(messages, add_generation_prompt=True), np.int32),
           "row": PromptRow("q0", messages, gold, None, "math", "test:0")}
    try:
        return asyncio.run(workflow.arun(client, row, version=0)), client
    finally:
        engine.stop()
        client.close()
        workflow.close()


def test_workflow_scores_the_weighted_terms(models):
    params, tok, rm_dir, judge_dir = models
    judge_cfg = JudgeConfig(model=str(judge_dir), parse="logprob", choices=("1", "2", "3"))
    terms = (("arithmetic", 1.0), ("tests.reward_fixtures:constant_one", 0.25), (f"rm:{rm_dir}", 0.5),
             ("judge", 2.0), ("tests.reward_fixtures:boom", 3.0))
    cfg = RLVRConfig(n_samples=3, max_new_tokens=6, reward=terms, judge=judge_cfg, reward_timeout_s=60.0)
    workflow = RLVRWorkflow(cfg, learned=LearnedRewards(cfg.learned_terms, judge=judge_cfg, warmup_tokens=16))
    question = "What is 3 + 4?"
    group, client = _one_group(params, tok, workflow, question, "7")
    texts = [client.decode(t.completion_ids) for t in group.trajectories]
    rm = RewardModel.from_pretrained(rm_dir).score_chats(
        [[{"role": "user", "content": question}, {"role": "assistant", "content": t}] for t in texts])
    judge = Judge(judge_cfg)
    verdicts = judge.score([(question, t) for t in texts])
    for i, traj in enumerate(group.trajectories):
        expected = (arithmetic_reward(texts[i], "7") + 0.25 + 0.5 * rm[i] + 2.0 * verdicts[i].score
                    + 3.0 * 0.0)  # boom raises: 0.0, counted
        assert traj.reward == pytest.approx(expected, abs=1e-4)
    recorded = group.info["reward_terms"]
    assert recorded[f"rm:{rm_dir}"][0] == pytest.approx(float(np.sum(rm)), abs=1e-4)
    assert recorded["judge"][0] == pytest.approx(sum(v.score for v in verdicts), abs=1e-4)
    assert recorded["tests.reward_fixtures:constant_one"] == [3.0, 3, 0]
    assert recorded["tests.reward_fixtures:boom"] == [0.0, 3, 3]
    metrics = term_metrics([group.info])
    assert metrics["reward/judge/failed"] == 0 and metrics["reward/tests.reward_fixtures:boom/failed"] == 3
    assert len(set(np.round(rm, 5))) == 3  # the rm term saw three different completions


def test_a_learned_term_past_the_deadline_scores_zero_and_is_counted(models):
    params, tok, rm_dir, judge_dir = models
    judge_cfg = JudgeConfig(model=str(judge_dir), parse="regex", max_new_tokens=32, timeout_s=1e-4)
    cfg = RLVRConfig(n_samples=2, max_new_tokens=4, reward=(("tests.reward_fixtures:constant_one", 1.0),
                                                            ("judge", 1.0)), judge=judge_cfg)
    workflow = RLVRWorkflow(cfg, learned=LearnedRewards(cfg.learned_terms, judge=judge_cfg))
    group, _ = _one_group(params, tok, workflow, "1 + 1", "2")
    assert [t.reward for t in group.trajectories] == [1.0, 1.0]
    assert group.info["reward_terms"]["judge"] == [0.0, 2, 2]
    assert workflow.learned.judge.stats.timeouts == 2


def test_gin_binds_a_composite_reward_and_its_judge(models, tmp_path):
    from areal_jax.config_system import ConfigError
    from areal_jax.jobs.configs import load_job_configs
    from tests.test_config_system import QUICKSTART

    _, _, rm_dir, judge_dir = models
    reward = f"RLVRConfig.reward = (('arithmetic', 0.0), ('rm:{rm_dir}', 1.0), ('judge', 0.5))"
    cfg = load_job_configs([QUICKSTART], [reward, f"JudgeConfig.model = '{judge_dir}'", "JudgeConfig.parse = 'regex'"],
                           run_dir=str(tmp_path))
    assert cfg.rollout.reward == (("arithmetic", 0.0), (f"rm:{rm_dir}", 1.0), ("judge", 0.5))
    assert cfg.rollout.judge == JudgeConfig(model=str(judge_dir), parse="regex")
    assert cfg.rollout.verifier == "arithmetic"
    with pytest.raises(ConfigError, match=r"term 'rm:/nowhere'"):
        load_job_configs([QUICKSTART], ["RLVRConfig.reward = (('arithmetic', 0.0), ('rm:/nowhere', 1.0))"],
                         run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="name no reward model"):  # a causal LM is no reward model
        load_job_configs([QUICKSTART], [f"RLVRConfig.reward = (('arithmetic', 0.0), ('rm:{judge_dir}', 1.0))"],
                         run_dir=str(tmp_path))


def test_reward_devices_are_set_apart_from_generation(models):
    import jax

    from areal_jax.parallel.meshes import MeshConfig, build_meshes

    _, _, rm_dir, _ = models
    devices = jax.devices()[:8]
    shared = build_meshes(MeshConfig(num_generation_devices_per_host=4), devices)
    assert shared.reward_devices_local == () and shared.learned_reward_devices == shared.generation_devices_local[:1]
    apart = build_meshes(MeshConfig(num_generation_devices_per_host=4, reward_devices=2), devices)
    assert apart.train_devices_local == tuple(devices[:4])
    assert apart.generation_devices_local == tuple(devices[4:6]) and apart.generation.devices.size == 2
    assert apart.learned_reward_devices == apart.reward_devices_local == tuple(devices[6:])
    with pytest.raises(ValueError, match="reward_devices"):
        MeshConfig(colocated=True, reward_devices=1)
    with pytest.raises(ValueError, match="reward_devices=4 taken from generation"):
        build_meshes(MeshConfig(num_generation_devices_per_host=4, reward_devices=4), devices)
    # The reward model on its two devices (rows split over them) scores as on one.
    texts = ["2 + 2 = 4", "2 + 2 = 5", "seven", "1 + 1 = 2", "a longer answer of several words"]
    learned = LearnedRewards([f"rm:{rm_dir}"], devices=apart.learned_reward_devices, warmup_tokens=16)
    try:
        futures = [learned.submit(f"rm:{rm_dir}", "q", t) for t in texts]
        scores = [f.result(timeout=120)[0] for f in futures]
    finally:
        learned.close()
    assert set(learned.mesh.devices.flat) == set(devices[6:])
    one = RewardModel.from_pretrained(rm_dir).score_chats(
        [[{"role": "user", "content": "q"}, {"role": "assistant", "content": t}] for t in texts])
    np.testing.assert_allclose(scores, one, atol=1e-5, rtol=0)


def test_learned_reward_memory_counts_weights_and_the_judges_kv_cache(models):
    from areal_jax.reward.composite import learned_reward_memory

    _, _, rm_dir, judge_dir = models
    regex = JudgeConfig(model=str(judge_dir), parse="regex", batch_size=4, max_seq_len=256, dtype="bfloat16")
    got = learned_reward_memory(((f"rm:{rm_dir}", 1.0), ("math", 0.0), ("judge", 1.0)), regex)
    rm_params = CFG.num_params() - CFG.vocab_size * CFG.hidden_size + CFG.hidden_size  # no lm_head; + score
    assert got == {f"rm:{rm_dir}": {"weights_bytes": 4 * rm_params, "kv_bytes": 0},
                   "judge": {"weights_bytes": 2 * CFG.num_params(),
                             "kv_bytes": 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4 * 256 * 2}}
    # The saved reward model holds exactly that many parameters.
    from safetensors import safe_open

    with safe_open(str(rm_dir / "model.safetensors"), framework="numpy") as f:
        assert sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()) == rm_params
    logprob = learned_reward_memory((("judge", 1.0),), JudgeConfig(model=str(judge_dir)))
    assert logprob["judge"]["kv_bytes"] == 0


def test_the_plan_report_names_the_learned_rewards_bytes():
    from areal_jax.parallel.meshes import DeviceSplit
    from areal_jax.plan.planner import Plan, ProgramPlan
    from areal_jax.plan.report import format_plan
    from areal_jax.plan.targets import parse_target

    pred = {"learned_rewards": {"rm:/m/rm": {"weights_bytes": 3 << 30, "kv_bytes": 0},
                                "judge": {"weights_bytes": 1 << 30, "kv_bytes": 1 << 29}},
            "learned_rewards_devices": "first generation device"}
    plan = Plan(target=parse_target("2xh100"), split=DeviceSplit(2, 1, 1, False), train_devices=1, generation_devices=1,
                programs=(ProgramPlan(name="generation/decode", role="generation", peak_bytes_per_device=1,
                                      capacity_bytes_per_device=2, fits=True, flops=1e9, bytes_accessed=1e9,
                                      roofline_s=0.01, source="test", program_bytes=1, resident_bytes=0, temp_bytes=0,
                                      compile_s=0.0, fields=()),),
                prediction=pred, headroom=0.1)
    assert ("learned rewards (first generation device; their reward/ programs above, their bytes in the peaks of the "
            "programs sharing their devices): rm:/m/rm 3.00 GiB, judge 1.00 GiB + KV 0.50 GiB") in format_plan(plan)
