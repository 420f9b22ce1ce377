"""The scripts in examples/ run as a user runs them (a fresh process, this machine's devices) and
leave the run directory, records and models they promise."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from areal_jax.metrics import read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    # One CPU device, as on a laptop (conftest's 8 fake devices are the tests', not the user's).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_gsm8k_rows_with_a_python_reward(tmp_path):
    out = _run("gsm8k_python_reward.py", f"--run_dir={tmp_path}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["sft_steps"] == 10 and summary["trained_tokens"] > 0
    assert summary["held_out_problems"] == 8 and 0.0 <= summary["final_accuracy"] <= 1.0
    # The rows were written once into the run directory and read as files are.
    rows = read_jsonl(tmp_path / "inputs" / "train.jsonl")
    assert len(rows) == 200 and rows[0]["answer"].split("####")[1].strip().isdigit()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["data"]["paths"] == [str(tmp_path / "inputs" / "train.jsonl")]
    assert config["rollout"]["reward"].startswith("py_")  # the Python callable, registered in-process
    assert (tmp_path / "final_model" / "config.json").is_file() and "held-out accuracy" in out
    assert "step 0: reward" in out and "step 1: reward" in out and "policy version 2" in out  # its hook ran
    # The preflight scored the rows' own answers with the Python reward (a reward that could not
    # read them would have refused the run): every step's rewards are the callable's 0/1 values.
    for record in read_jsonl(tmp_path / "metrics.jsonl"):
        if record["step"] >= 0:
            assert record["metrics"]["reward/mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)


@pytest.mark.slow
def test_custom_multi_turn_workflow_trains_only_the_model_tokens(tmp_path):
    _run("custom_multi_turn_workflow.py", f"--run_dir={tmp_path}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trained_tokens"] > 0
    feedback = "<|user|>Wrong. Again.<|end|><|assistant|>"
    records = [r for step in (0, 1) for r in read_jsonl(tmp_path / "rollouts" / f"step_{step}.jsonl")]
    assert len(records) == 2 * 2 * 2  # steps x groups x samples
    retried = [r for r in records if "loss_mask" in r]
    assert retried, "a random policy is wrong at first: some episodes take the second turn"
    for r in records:
        mask = r.get("loss_mask", [1] * len(r["versions"]))
        # Inserted tokens: loss mask 0, version -1, no behaviour log-prob; the model's: a real version.
        assert all((m == 0) == (v == -1) for m, v in zip(mask, r["versions"]))
        assert all(lp == 0.0 for m, lp in zip(mask, r["behavior_logprobs"]) if m == 0)
        if "loss_mask" in r:
            # The feedback turn: its 13 characters and 3 role tokens (the task tokenizer is per character).
            assert mask.count(0) == len("Wrong. Again.") + 3 and feedback in r["completion"]
            assert r["reward"] in (0.0, 0.5)  # the second answer earns half


@pytest.mark.slow
def test_evaluate_and_export_from_python_built_configs(tmp_path):
    out = _run("evaluate_and_export.py", f"--run_dir={tmp_path / 'run'}", f"--out={tmp_path / 'hf'}")
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())["overall"]
    assert report["num_prompts"] == 4 and report["num_samples"] == 8 and report["pass@1"] <= report["pass@2"]
    assert '"pass@2"' in out
    # config.gin of a run configured in Python: the fields that differ from the defaults.
    gin_text = (tmp_path / "run" / "config.gin").read_text()
    assert "RLConfig.steps = 2" in gin_text and "ModelSource.hidden_size = 32" in gin_text
    from areal_jax.models import load_pretrained
    from areal_jax.models.tokenizer import Tokenizer

    exported, final = tmp_path / "hf", tmp_path / "run" / "final_model"
    assert sorted(p.name for p in exported.iterdir()) == sorted(p.name for p in final.iterdir())
    assert (exported / "model.safetensors").read_bytes() == (final / "model.safetensors").read_bytes()
    load_pretrained(exported)
    Tokenizer.from_pretrained(exported)


@pytest.mark.slow
def test_agent_calculator_example_runs_sft_then_rl_through_the_endpoint(tmp_path):
    out = _run("agent_calculator.py", f"--run_dir={tmp_path}", "--small", "--sft_steps=10", "--rl_steps=2",
               "--train_size=50", "--eval_size=8")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["held_out_problems"] == 8
    assert 0.0 <= summary["sft_accuracy"] <= 1.0 and 0.0 <= summary["rl_accuracy"] <= 1.0
    assert "held-out accuracy through the agent" in out
    assert 0.0 <= summary["sft_tool_rate"] <= 1.0 and 0.0 <= summary["rl_tool_rate"] <= 1.0
    # The SFT rows are the agent's conversations, tools named: the call, its result, the answer, or
    # (the rest) the answer straight away.
    rows = [r["messages"] for r in read_jsonl(tmp_path / "inputs" / "sft.jsonl")]
    assert {tuple(m["role"] for m in r) for r in rows} == {("system", "user", "assistant", "tool", "assistant"),
                                                          ("system", "user", "assistant")}
    assert all(r[0]["content"] == "Tools: calculator(expression)" for r in rows)
    # RL went through the agent workflow: the dumps carry the sessions' messages.
    dumped = read_jsonl(tmp_path / "rl" / "rollouts" / "step_0.jsonl")
    assert dumped and all("messages" in d and "loss_mask" in d for d in dumped)



def _check_rm_example(tmp_path, rm_loss: str, term: str, architecture: str) -> None:
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["rl_steps"] == 2 and result["rm_loss"] == rm_loss and result["rm_rows"] > 0
    assert result["kl_coef"] == (0.05 if rm_loss == "likelihood" else 0.0)
    for figures in (result["rm_before_rl"], result["rm_after_rl"]):  # 8 held-out problems x 8 samples
        assert figures["samples"] == 64 and 0.0 <= figures["sign"] <= 1.0
    rm_dir = tmp_path / "reward_model"
    config = json.loads((rm_dir / "config.json").read_text())
    assert config["architectures"] == [architecture]
    # The RL run's reward is the reward model alone; the verifier (weight 0) is logged beside it.
    run_config = json.loads((tmp_path / "rl" / "config.json").read_text())
    assert run_config["rollout"]["reward"] == [[f"{term}:{rm_dir}", 1.0], ["arithmetic", 0.0]]
    records = read_jsonl(tmp_path / "rl" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        m = record["metrics"]
        assert m[f"reward/{term}:{rm_dir}/failed"] == 0
        assert m["reward/mean"] == pytest.approx(m[f"reward/{term}:{rm_dir}/mean"], abs=1e-5)
        assert m["reward/arithmetic/mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)
        if term == "lm":  # a mean log-likelihood, and RL's KL penalty to the SFT policy
            assert m[f"reward/{term}:{rm_dir}/mean"] < 0 and "train/kl_to_reference" in m


def test_learned_reward_model_example_runs_end_to_end(tmp_path):
    """The reward-model example in its smoke mode (a 1-layer policy, a few steps), its default
    recipe: the policy tuned as an implicit reward model on its own samples, saved as a causal LM,
    loaded as the run's only reward ("lm:"), and its ranking measured before and after RL."""
    _run("learned_reward_model.py", f"--run_dir={tmp_path}", "--small")
    _check_rm_example(tmp_path, "likelihood", "lm", "Qwen2ForCausalLM")


@pytest.mark.slow  # a second SFT + RL smoke run (~2 min on a 2-core host)
def test_learned_reward_model_example_with_a_scalar_head(tmp_path):
    """`--rm_loss label`: the RM saved as a one-label Qwen2ForSequenceClassification ("rm:")."""
    _run("learned_reward_model.py", f"--run_dir={tmp_path}", "--small", "--rm_loss=label")
    _check_rm_example(tmp_path, "label", "rm", "Qwen2ForSequenceClassification")
    config = json.loads((tmp_path / "reward_model" / "config.json").read_text())
    assert config["num_labels"] == 1


@pytest.mark.slow  # a second SFT + RL smoke run (~3 min on a 2-core host)
def test_learned_judge_example_runs_end_to_end(tmp_path):
    out = _run("learned_judge.py", f"--run_dir={tmp_path}", "--small")
    assert "after RL on the judge alone" in out
    config = json.loads((tmp_path / "rl" / "config.json").read_text())
    assert config["rollout"]["judge"]["parse"] == "logprob"
    assert config["rollout"]["reward"] == [["judge", 1.0], ["arithmetic", 0.0]]
    records = read_jsonl(tmp_path / "rl" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        m = record["metrics"]
        assert m["reward/judge/failed"] == 0 and 0.0 <= m["reward/judge/mean"] <= 1.0
