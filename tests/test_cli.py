"""`areal-jax train` end to end in a shortened form, and configuration errors caught up front."""

import json
import os
import pathlib
import sys

import pytest

from areal_jax.cli import main
from areal_jax.metrics import read_jsonl
from tests.multiprocess import run_cli_processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.gin")
SHORT = [  # the quickstart, shrunk to seconds
    "ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "TaskSource.train_size = 300",
    "TaskSource.eval_size = 8", "SFTConfig.steps = 10", "SFTConfig.warmup_steps = 2", "RLConfig.steps = 2",
    "RLConfig.batch_size = 2", "RLConfig.max_concurrent = 4", "RLConfig.eval_every = 1",
    "RLVRConfig.n_samples = 2", "RLVRConfig.max_new_tokens = 8", "RLVRConfig.filter_all_equal_rewards = False",
    "RLConfig.eval_max_new_tokens = 8", "EngineConfig.num_slots = 8", "EngineConfig.max_seq_len = 64",
    "SFTConfig.eval_from = 5", "SFTConfig.eval_every = 5", "TaskSource.validation_size = 6",
]
# In this process's 8 fake devices: 4 train, 4 generate (the engine's 8 slots split evenly over "data").
SPLIT_8 = "MeshConfig.num_generation_devices_per_host = 4"


def _args(run_dir, *extra):
    return ["train", f"--gin_file={QUICKSTART}", *[f"--gin_param={p}" for p in SHORT + list(extra)],
            f"--run_dir={run_dir}", "--quiet"]


def test_quickstart_runs_end_to_end_in_short_form(tmp_path):
    assert main(_args(tmp_path, "RLConfig.dump_rollouts_every = 2", SPLIT_8)) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    # SFT's 10 steps first, at -10..-1 (one record each), then RL's from 0.
    assert [r["step"] for r in records] == list(range(-10, 0)) + [0, 1]
    assert all("loss" in r["metrics"]["sft"] for r in records[:10])
    records = records[10:]
    for r in records:
        m = r["metrics"]
        for key in ("reward/mean", "reward/accuracy", "staleness/max", "staleness/hist", "train/loss",
                    "train/grad_norm", "train/clip_frac", "train/imp_weight_mean", "train/entropy",
                    "throughput/generated_tokens_per_s", "throughput/trained_tokens_per_s", "rollout/queue_depth",
                    "time/weight_transfer_s", "eval/accuracy", "version"):
            assert key in m, key
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("sft_accuracy", "final_accuracy", "steps", "wall_time_s", "trained_tokens"):
        assert key in summary, key
    # Two validation checks (steps 5 and 10); a 10-step policy is far from the 0.5 target.
    assert summary["sft_steps"] == 10 and summary["sft_stopped_early"] is False
    assert 0.0 <= summary["sft_val_accuracy"] < 0.5
    assert summary["held_out_problems"] == 8
    assert summary["steps"] == 2 and summary["trained_tokens"] > 0
    assert (tmp_path / "progress.png").stat().st_size > 0
    rollouts = read_jsonl(tmp_path / "rollouts" / "step_1.jsonl")  # step index 1 = the 2nd step
    assert len(rollouts) == 2 * 2 and not (tmp_path / "rollouts" / "step_0.jsonl").exists()
    for r in rollouts:
        assert len(r["versions"]) == len(r["behavior_logprobs"]) and r["prompt"] and "reward" in r
    assert "RLConfig.steps = 2" in (tmp_path / "config.gin").read_text()
    from areal_jax.models import load_pretrained
    from areal_jax.models.tokenizer import Tokenizer

    load_pretrained(tmp_path / "final_model")
    Tokenizer.from_pretrained(tmp_path / "final_model")


def test_train_runs_as_two_processes_over_jax_distributed(tmp_path):
    """`areal-jax train` on two hosts (two local processes, real jax.distributed, one run directory):
    SFT, RL over the global train mesh, held-out accuracy over both processes' shards, and one set of
    records written by process 0. Generation in bf16, the weights moved in small groups."""
    run_cli_processes(_args(tmp_path, "TaskSource.eval_size = 9", "RLConfig.generation_dtype = 'bfloat16'",
                            "RLConfig.transfer_group_bytes = 4096"))
    # Once, not once per process: SFT's steps (-10..-1) then RL's.
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(-10, 0)) + [0, 1]
    assert len(list((tmp_path / "tensorboard").iterdir())) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trained_tokens"] > 0
    # 9 held-out problems split 5 / 4 between the processes: the accuracy is over all 9.
    assert summary["held_out_problems"] == 9
    # Rollout counts summed over both processes' controllers: the trainers took 2 groups per step.
    rollout = summary["rollout"]
    assert rollout["accepted"] >= summary["steps"] * 2
    assert rollout["admitted"] == (rollout["accepted"] + sum(rollout.get("rejected", {}).values())
                                   + rollout["failed"] + rollout["in_flight_at_shutdown"])
    assert 0.0 <= summary["sft_accuracy"] <= 1.0 and 0.0 <= summary["final_accuracy"] <= 1.0
    from areal_jax.models import load_pretrained

    load_pretrained(tmp_path / "final_model")


@pytest.mark.parametrize("binding,message", [
    ("RLConfig.stepz = 3", "stepz"),
    ("NotAConfig.x = 1", "NotAConfig"),
    ("RLConfig.steps = 'many'", "RLConfig.steps"),
    ("PPOConfig.eps_clip = -1.0", "eps_clip"),
    ("MeshConfig.num_generation_devices_per_host = 8", "MeshConfig"),
    ("TaskSource.validation_size = 0", "TaskSource.validation_size"),
    ("SFTConfig.eval_from = 11", "no validation check"),
])
def test_config_errors_are_reported_before_anything_starts(tmp_path, capsys, binding, message):
    assert main(_args(tmp_path / "run", binding)) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and message in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "config.gin").exists()


def _tiny_model_dir(path: pathlib.Path, style: str = "chatml", template_storage: str = "config") -> pathlib.Path:
    """A random 1-layer model with a tiny tokenizer of `style` (tests/tokenizer_fixtures.py; "none" as
    template_storage: no chat template, like a base model), saved in HF format."""
    import jax

    from areal_jax.models import ModelConfig, init_params, save_params
    from areal_jax.models.tokenizer import Tokenizer
    from tests.tokenizer_fixtures import build_tiny_tokenizer

    model_dir = build_tiny_tokenizer(path, style, template_storage=template_storage)
    cfg = ModelConfig(vocab_size=len(Tokenizer.from_pretrained(model_dir)), hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)
    save_params(init_params(cfg, jax.random.key(0), std=0.3), cfg, model_dir)
    return pathlib.Path(model_dir)


def test_eval_command_reports_pass_at_k_from_files(tmp_path, capsys):
    model_dir = _tiny_model_dir(tmp_path / "model")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i}+1?", "answer": f"so #### {i + 1}"}) + "\n"
                            for i in range(3)))
    out = tmp_path / "eval"
    assert main(["eval", f"--model={model_dir}", f"--run_dir={out}", "--reward_workers=1",
                 f"--gin_param=DataConfig.paths = ('{data}',)", "--gin_param=EvalConfig.n_samples = 4",
                 "--gin_param=EvalConfig.temperature = 1.0", "--gin_param=EvalConfig.ks = (1, 4)",
                 "--gin_param=EvalConfig.max_new_tokens = 8", "--gin_param=EvalConfig.max_seq_len = 64",
                 "--gin_param=EvalConfig.num_slots = 8"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["overall"]["num_prompts"] == 3 and report["overall"]["num_samples"] == 12
    assert {"pass@1", "pass@4", "maj@1", "maj@4"} <= set(report["overall"])
    assert len(read_jsonl(out / "samples.jsonl")) == 12
    assert main(["eval", f"--model={model_dir}", "--gin_param=EvalConfig.ks = (8,)",
                 f"--gin_param=DataConfig.paths = ('{data}',)"]) == 2
    assert "configuration error" in capsys.readouterr().err


def test_eval_runs_as_two_processes_and_matches_one(tmp_path):
    """`areal-jax eval` on two hosts (real jax.distributed): rows are shared out 3 / 2, and the one
    report and samples file (written by process 0) equal a single-process evaluation's."""
    model_dir = _tiny_model_dir(tmp_path / "model")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i}+2?", "answer": f"so #### {i + 2}"}) + "\n"
                            for i in range(5)))
    # Greedy, and 2 slots on every process, so both runs decode identical batches.
    args = [f"--model={model_dir}", f"--gin_param=DataConfig.paths = ('{data}',)",
            "--gin_param=EvalConfig.temperature = 0.0", "--gin_param=EvalConfig.max_new_tokens = 8",
            "--gin_param=EvalConfig.max_seq_len = 64", "--gin_param=EvalConfig.num_slots = 2"]
    assert main(["eval", *args, f"--run_dir={tmp_path / 'one'}"]) == 0
    run_cli_processes(["eval", *args, f"--run_dir={tmp_path / 'two'}"])
    one, two = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two"))
    timings = {"wall_s", "generation_s", "scoring_s", "tokens_per_s"}
    assert two["overall"]["num_prompts"] == 5
    assert {k: v for k, v in two["overall"].items() if k not in timings} == \
        {k: v for k, v in one["overall"].items() if k not in timings}
    assert read_jsonl(tmp_path / "two" / "samples.jsonl") == read_jsonl(tmp_path / "one" / "samples.jsonl")
    assert main(["eval", *args, "--distributed"]) == 2  # no --run_dir: processes could not agree on one


@pytest.mark.parametrize("name", ["qwen2_5_1_5b_gsm8k_tpu.gin", "qwen3_1_7b_gsm8k_gpu.gin", "qwen2_5_7b_math_gpu.gin",
                                  "qwen2_5_7b_math_tpu.gin", "qwen2_5_32b_math_gpu.gin", "qwen2_5_7b_lora_gpu.gin",
                                  "qwen3_30b_a3b_math_tpu.gin", "qwen3_30b_a3b_math_gpu.gin",
                                  "llama3_3_70b_math_gpu.gin", "llama3_3_70b_math_tpu.gin",
                                  "qwen3_235b_a22b_math_gpu.gin", "qwen3_235b_a22b_math_tpu.gin"])
def test_real_model_configs_parse_and_validate(tmp_path, name):
    from areal_jax import config_system as cs
    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.plan.config import PlanConfig
    from areal_jax.plan.targets import parse_target

    cfg = load_job_configs([ROOT / "configs" / name], run_dir=str(tmp_path))
    assert cfg.task.kind == "dataset" and cfg.data.paths and cfg.model.path
    # eta 4, the paper's, except where fewer samples in flight train as fast (docs/scale.md, session 29).
    assert cfg.rl.max_staleness == {"qwen2_5_7b_lora_gpu.gin": 3}.get(name, 4) and cfg.rollout.reward == "math"
    plan = cs.build(PlanConfig)  # every real config names its hardware and ships its model's shapes
    parse_target(plan.target)
    assert (ROOT / "configs" / plan.model_config).is_file()


def test_compile_cache_flag_stores_the_compiled_programs(tmp_path):
    # A fresh process: the persistent cache is process-wide jax state, set once before compiling.
    import os
    import subprocess
    import sys

    model_dir = _tiny_model_dir(tmp_path / "model")
    cache = tmp_path / "xla_cache"
    env = {**os.environ, "AREAL_JAX_COMPILE_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "areal_jax.cli", "generate", f"--model={model_dir}", "--prompt=hi",
           "--max_new_tokens=4"]

    def run():
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout, sorted(p.name for p in cache.iterdir())

    first, entries = run()
    assert entries, "no program was written to the cache"
    second, entries_after = run()
    assert second == first  # greedy: the cached programs give the same completion
    assert entries_after == entries  # the rerun found every program in the cache


def test_validation_problems_are_neither_trained_on_nor_held_out(tmp_path):
    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.jobs.workload import prepare_workload

    cfg = load_job_configs([QUICKSTART], SHORT + ["TaskSource.validation_size = 40"], run_dir=str(tmp_path))
    work = prepare_workload(cfg, tmp_path)
    prompts = lambda ids: {tuple(int(t) for t in p) for p in ids}  # noqa: E731
    validation = prompts(r["prompt_ids"] for r in work.validation_rows)
    trained = prompts(p for p, _ in work.sft_examples)
    held_out = prompts(r["prompt_ids"] for r in work.eval_rows)
    assert len(validation) == 40 and len(trained) == 300 and len(held_out) == 8
    assert not validation & trained and not validation & held_out
