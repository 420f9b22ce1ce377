"""`plan` and `simulate` count the learned rewards (issue 43): their programs compiled for the
target, their weights and KV beside the programs that share their devices, their time per group."""

import dataclasses
import json
import pathlib

import pytest

from tests.test_plan import BASE, SMALL_MODEL, _plan, needs_gpu_compiler

RM = {**SMALL_MODEL, "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1, "pad_token_id": 0}
JUDGE = {**SMALL_MODEL, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4}


def _dirs(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {}
    for name, cfg in (("model", SMALL_MODEL), ("rm", RM), ("judge", JUDGE)):
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        out[name] = tmp_path / name
    return out


def _job(tmp_path, *extra: str, learned: bool = True):
    from areal_jax.jobs.configs import load_job_configs

    d = _dirs(tmp_path)
    gin = tmp_path / "run.gin"
    reward = f"(('math', 0.0), ('rm:{d['rm']}', 1.0), ('judge', 1.0))" if learned else "'math'"
    gin.write_text(BASE + f'ModelSource.path = "{d["model"]}"\n' + f"RLVRConfig.reward = {reward}\n"
                   + f"JudgeConfig.model = '{d['judge']}'\n" + "".join(e + "\n" for e in extra))
    return load_job_configs([str(gin)], [], run_dir="plan"), gin


def _inputs(job):
    from areal_jax.plan.config import PlanConfig
    from areal_jax.plan.fit import stand_in_devices
    from areal_jax.plan.job import plan_inputs
    from areal_jax.plan.targets import parse_target

    return plan_inputs(job, PlanConfig(), parse_target("8xh100"), devices=stand_in_devices)


def _rm_weight_bytes() -> int:
    D, V = SMALL_MODEL["hidden_size"], SMALL_MODEL["vocab_size"]
    from areal_jax.models.config import ModelConfig

    params = ModelConfig.from_hf(SMALL_MODEL).num_params() - V * D + D  # no lm_head; a one-label score head
    return 4 * params  # fp32, as the run loads reward models


@needs_gpu_compiler
def test_the_learned_rewards_programs_and_their_bytes_beside_the_policy(tmp_path):
    from areal_jax.aot import bytes_per_device

    job, _ = _job(tmp_path, "JudgeConfig.parse = 'regex'", "JudgeConfig.max_seq_len = 512")
    inputs = _inputs(job)
    by_name = {s.name: s for s in inputs.specs}
    rm = by_name["reward/rm/score[rows=16,len=512]"]  # 16 rows a call, the policy's max_seq_len bucket
    assert rm.role == "reward" and bytes_per_device(rm.args[0]) == _rm_weight_bytes()
    judge = [s for s in inputs.specs if s.name.startswith("reward/judge/")]
    assert any(s.name.startswith("reward/judge/decode[window=") for s in judge)
    assert any(s.name.startswith("reward/judge/prefill_start[rows=16,") for s in judge)
    # Shared devices (the default): every generation program carries both learned models' bytes, and
    # the RM's program the policy's engine and the judge's weights and cache.
    without = _inputs(_job(tmp_path / "plain", learned=False)[0])
    decode = next(s for s in inputs.specs if s.name.startswith("generation/decode"))
    extra = inputs.extra_resident(decode) - without.extra_resident(next(
        s for s in without.specs if s.name == decode.name))
    judge_bytes = max(bytes_per_device((s.args, s.resident)) for s in judge)
    rm_bytes = bytes_per_device((rm.args, rm.resident))
    assert extra == rm_bytes + judge_bytes
    assert inputs.extra_resident(rm) >= judge_bytes + bytes_per_device(decode.args[0])
    # Devices of their own: the generation programs carry none of it, the RM only the judge.
    own = _inputs(_job(tmp_path / "own", "JudgeConfig.parse = 'regex'", "JudgeConfig.max_seq_len = 512",
                       "MeshConfig.num_generation_devices_per_host = 7", "MeshConfig.reward_devices = 1")[0])
    own_decode = next(s for s in own.specs if s.name == decode.name)
    assert own.extra_resident(own_decode) == without.extra_resident(next(
        s for s in without.specs if s.name == decode.name))
    own_rm = next(s for s in own.specs if s.name == rm.name)
    assert own.extra_resident(own_rm) == judge_bytes


@pytest.mark.slow  # a plan subprocess compiling two programs (~1 min; 6 min on a loaded 2-core host)
@needs_gpu_compiler
def test_plan_json_names_the_compiled_rm_and_logprob_judge_programs(tmp_path):
    _, gin = _job(tmp_path, "JudgeConfig.parse = 'logprob'", "JudgeConfig.batch_size = 8")
    out = _plan(tmp_path, gin, "--target=8xh100", "--json", "--only=reward/")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    programs = {p["name"]: p for p in plan["programs"]}
    assert set(programs) == {"reward/rm/score[rows=16,len=512]", "reward/judge/choices[rows=8,len=1024]"}
    for p in programs.values():
        assert p["role"] == "reward" and p["source"] == "xla-gpu" and p["attention"] != "none"
        assert p["peak_bytes_per_device"] == p["program_bytes"] + p["resident_bytes"] and p["fits"]
        assert p["flops"] > 0
    assert programs["reward/rm/score[rows=16,len=512]"]["program_bytes"] >= _rm_weight_bytes()
    assert "rm:" in json.dumps(plan["prediction"]["learned_rewards"])
    # A step's 4 groups x 4 samples: one call of the RM's 16 rows, two of the judge's 8.
    assert plan["prediction"]["learned_reward_s_per_step"] == pytest.approx(
        programs["reward/rm/score[rows=16,len=512]"]["roofline_s"]
        + 2 * programs["reward/judge/choices[rows=8,len=1024]"]["roofline_s"], rel=1e-9)


def test_roofline_scoring_of_a_group_by_hand(tmp_path):
    """A reward model's call on one group: 2 x weights x tokens matmul FLOPs (+ attention over
    the causal half) against its weights read once, on one H100; the judge's logprob read adds
    the last position's logits."""
    from areal_jax.models.config import ModelConfig
    from areal_jax.plan.targets import parse_target
    from areal_jax.simulate.driver import learned_reward_costs

    job, _ = _job(tmp_path, "JudgeConfig.parse = 'logprob'")
    target = parse_target("8xh100")
    costs = learned_reward_costs(job, target)
    assert costs.shared and costs.data == 1 and [m.label for m in costs.models] == ["rm", "judge"]
    n, prompt, lengths = 4, 100, [50, 150, 20, 10]
    T = 256  # the bucket of the longest sample, 100 + 150 tokens
    total = 0.0
    for cfg, head, item in ((ModelConfig.from_hf(RM), 0, 4), (ModelConfig.from_hf(JUDGE), 1, 4)):
        D, F, L, N, K, H, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                               cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
        per_token = 2 * (L * (D * (N + 2 * K) * H + N * H * D + 3 * D * F))
        flops = n * T * per_token + 4 * L * N * H * (n * T) * (T / 2) + head * n * 2 * D * V
        weights = (cfg.num_params() - (0 if head else V * D)) * item
        total += max(flops / target.peak_flops_per_device, weights / target.bandwidth_per_device)
    assert costs.group_s(n, prompt, lengths) == pytest.approx(total, rel=1e-9)
    own = learned_reward_costs(_job(tmp_path / "own", "JudgeConfig.parse = 'logprob'",
                                    "MeshConfig.num_generation_devices_per_host = 7",
                                    "MeshConfig.reward_devices = 1")[0], target)
    assert not own.shared and own.data == 1


def test_plans_step_counts_the_scoring_where_it_shares_the_generation_devices(tmp_path):
    from areal_jax.plan.job import add_learned_reward_time
    from areal_jax.plan.planner import ProgramPlan

    def program(name, roofline_s):
        return ProgramPlan(name=name, role="reward", peak_bytes_per_device=1, capacity_bytes_per_device=2, fits=True,
                           flops=1.0, bytes_accessed=1.0, roofline_s=roofline_s, source="test", program_bytes=1,
                           resident_bytes=0, temp_bytes=0, compile_s=0.0, fields=())

    # A regex judge: per call its prefill, then 32 greedy tokens in chunks of 8 at its widest window.
    programs = [program("reward/rm/score[rows=16,len=512]", 0.5), program("reward/judge/prefill_start[rows=16,len=512]", 0.2),
                program("reward/judge/decode[window=256]", 0.01), program("reward/judge/decode[window=512]", 0.03)]
    pred = {"step_generation_s": 10.0, "step_train_s": 8.0, "step_s": 10.0, "trained_tokens_per_s": 100.0,
            "bound": "generation"}
    job, _ = _job(tmp_path, "JudgeConfig.parse = 'regex'", "JudgeConfig.max_new_tokens = 32")
    shared = dict(pred)
    add_learned_reward_time(shared, programs, job, colocated=False)
    calls = 1  # 4 groups x 4 samples: one call of 16 rows, for the RM and the judge alike
    seconds = calls * 0.5 + calls * (0.2 + 32 // 8 * 0.03)
    assert shared["learned_reward_s_per_step"] == pytest.approx(seconds)
    assert shared["step_s"] == pytest.approx(10.0 + seconds) == shared["step_generation_s"]
    assert shared["trained_tokens_per_s"] == pytest.approx(1000.0 / (10.0 + seconds))
    own = dict(pred)
    own_job, _ = _job(tmp_path / "own", "JudgeConfig.parse = 'regex'", "JudgeConfig.max_new_tokens = 32",
                      "MeshConfig.num_generation_devices_per_host = 7", "MeshConfig.reward_devices = 1")
    add_learned_reward_time(own, programs, own_job, colocated=False)
    assert own == {**pred, "learned_reward_s_per_step": pytest.approx(seconds)}


@needs_gpu_compiler
def test_a_likelihood_reward_is_planned_as_a_whole_lm_beside_the_policy(tmp_path):
    from areal_jax.aot import bytes_per_device
    from areal_jax.models.config import ModelConfig
    from areal_jax.plan.estimate import estimate_peak

    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "config.json").write_text(json.dumps(SMALL_MODEL))  # a *ForCausalLM: lm_head included
    from areal_jax.jobs.configs import load_job_configs

    d = _dirs(tmp_path)
    gin = tmp_path / "run.gin"
    gin.write_text(BASE + f'ModelSource.path = "{d["model"]}"\n' + f"RLVRConfig.reward = (('math', 0.0), ('lm:{lm}', 1.0))\n")
    inputs = _inputs(load_job_configs([str(gin)], [], run_dir="plan"))
    spec = next(s for s in inputs.specs if s.role == "reward")
    assert spec.name == "reward/lm/loglik[rows=16,len=512]"
    assert bytes_per_device(spec.args[0]) == 4 * ModelConfig.from_hf(SMALL_MODEL).num_params()
    decode = next(s for s in inputs.specs if s.name.startswith("generation/decode"))
    assert inputs.extra_resident(decode) >= bytes_per_device(spec.args[0])  # shared devices: beside the policy
    assert spec.args[1] is None  # no reference: a plain likelihood
    # The estimate holds every position's logits of one chunk (fp32, with their log-softmax).
    V = SMALL_MODEL["vocab_size"]
    assert estimate_peak(spec, inputs.ctx, ("pallas_triton_flash",)) >= bytes_per_device(spec.args) + 2 * 4 * 16 * 256 * V
    # With a reference/ subdirectory (an implicit reward model) its weights are the program's too.
    (lm / "reference").mkdir()
    small = {**SMALL_MODEL, "num_hidden_layers": 1}
    (lm / "reference" / "config.json").write_text(json.dumps(small))
    spec = next(s for s in _inputs(load_job_configs([str(gin)], [], run_dir="plan")).specs if s.role == "reward")
    assert bytes_per_device(spec.args[1]) == 4 * ModelConfig.from_hf(small).num_params()


def test_the_simulator_costs_a_likelihood_reward_as_the_whole_lm_with_every_positions_logits(tmp_path):
    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.models.config import ModelConfig
    from areal_jax.plan.planner import roofline_s
    from areal_jax.plan.targets import parse_target
    from areal_jax.simulate.driver import learned_reward_costs

    d = _dirs(tmp_path)
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "config.json").write_text(json.dumps(SMALL_MODEL))
    gin = tmp_path / "run.gin"
    gin.write_text(BASE + f'ModelSource.path = "{d["model"]}"\n'
                   + f"RLVRConfig.reward = (('math', 0.0), ('lm:{lm}', 1.0), ('rm:{d['rm']}', 1.0))\n")
    target = parse_target("8xh100")
    costs = learned_reward_costs(load_job_configs([str(gin)], [], run_dir="plan"), target)
    by_label = {m.label: m for m in costs.models}
    assert by_label["lm"].kind == "loglik" and by_label["rm"].kind == "score"
    cfg = ModelConfig.from_hf(SMALL_MODEL)
    V, D = SMALL_MODEL["vocab_size"], SMALL_MODEL["hidden_size"]
    assert by_label["lm"].weight_bytes == 4 * cfg.num_params()
    assert by_label["rm"].weight_bytes == 4 * (cfg.num_params() - V * D)
    # A group of 4 samples, 100-token prompt, longest 150: one call of 4 rows at the 256 bucket.
    # The LM's forward is the RM's plus the head at every position: 2 x 4 x 256 x D x V FLOPs more.
    lm_only = dataclasses.replace(costs, models=(by_label["lm"],))
    rm_only = dataclasses.replace(costs, models=(by_label["rm"],))
    from areal_jax.aot import ProgramSpec
    from areal_jax.plan.estimate import analytic_flops

    score = analytic_flops(ProgramSpec("generation/score[rows=4,len=256]", "generation", None), by_label["rm"].ctx, 1)
    assert rm_only.group_s(4, 100, [150, 120]) == pytest.approx(roofline_s(score, by_label["rm"].weight_bytes, target))
    assert lm_only.group_s(4, 100, [150, 120]) == pytest.approx(
        roofline_s(score + 2 * 4 * 256 * D * V, by_label["lm"].weight_bytes, target), rel=1e-9)
