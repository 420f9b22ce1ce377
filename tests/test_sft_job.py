"""`areal-jax sft` on files end to end (the built-in tiny model and tokenizer), its records and its
errors; `areal-jax eval` on a base model through DataConfig.prompt_template."""

import json
import math
import pathlib

import pytest

from areal_jax.cli import main
from areal_jax.jobs.train import sft_step_index
from areal_jax.metrics import read_jsonl
from areal_jax.trainer.sft import SFTConfig
from tests.test_cli import _tiny_model_dir

TINY_RUN = ["ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "TaskSource.kind = 'dataset'",
            "TaskSource.eval_size = 0", "SFTConfig.steps = 6", "SFTConfig.warmup_steps = 1", "SFTConfig.rows_per_step = 4",
            "SFTConfig.max_len = 160", "SFTConfig.log_every = 4", "Stages.plot = False",
            "MeshConfig.num_generation_devices_per_host = 4"]


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"Ann has {i} pens and gets 2 more. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
            for i in range(start, start + n)]


def chat_rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}"},
                          {"role": "user", "content": "Again."}, {"role": "assistant", "content": f"{i} again"}]}
            for i in range(n)]


def sft_args(run_dir, *extra):
    return ["sft", *[f"--gin_param={p}" for p in TINY_RUN + list(extra)], f"--run_dir={run_dir}", "--quiet"]


def strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"{constant} in strict JSON")

    return json.loads(text, parse_constant=refuse)


def test_sft_step_index_orders_sft_before_rl():
    cfg = SFTConfig(steps=6, warmup_steps=1)
    assert [sft_step_index(cfg, s) for s in range(1, 7)] == [-6, -5, -4, -3, -2, -1]


def test_sft_command_trains_on_files_and_records_each_step(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="the held-out file is Parquet: needs pyarrow (the [data] extra)")
    import pyarrow.parquet as pq

    train = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(12) + chat_rows(4))
    held_out = gsm8k_rows(3, start=50)
    val = str(tmp_path / "val.parquet")
    pq.write_table(pa.table({k: [r[k] for r in held_out] for k in ("question", "answer")}), val)
    run = tmp_path / "run"
    assert main(sft_args(run, f"DataConfig.paths = ('{train}',)", f"SFTConfig.eval_paths = ('{val}',)",
                          "SFTConfig.val_every = 3")) == 0

    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [-6, -5, -4, -3, -2, -1]  # one record per SFT step, before RL's 0
    sft = [r["metrics"]["sft"] for r in records]
    assert all(math.isfinite(m["loss"]) and m["tokens"] > 0 and m["lr"] >= 0 for m in sft)
    assert [r["step"] for r in records if "val_loss" in r["metrics"]["sft"]] == [-4, -1]  # steps 3 and 6
    summary = strict_json((run / "summary.json").read_text())  # no NaN
    assert summary["sft_steps"] == 6 and summary["steps"] == 0
    # The summary's loss is the last logged entry's: the mean over the steps since the one before (5 and 6).
    assert summary["sft_loss"] == pytest.approx((sft[-2]["loss"] + sft[-1]["loss"]) / 2, rel=1e-6)
    assert summary["sft_val_loss"] == sft[-1]["val_loss"]
    assert summary["sft_accuracy"] is None and summary["final_accuracy"] is None  # no held-out prompts asked for
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("sft/loss")] == [-6, -5, -4, -3, -2, -1]
    assert [e.step for e in acc.Scalars("sft/val_loss")] == [-4, -1]
    from areal_jax.models import load_pretrained

    load_pretrained(run / "final_model")


def test_no_usable_sft_rows_is_one_line_naming_the_file_and_why(tmp_path, capsys):
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"prompt": "p", "completion": "c"}] * 2)
    run = tmp_path / "run"
    assert main(sft_args(run, f"DataConfig.paths = ('{wrong}',)")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"areal-jax: error: DataConfig.paths: no usable SFT examples in {wrong}: 0/2 SFT rows kept")
    assert "cannot detect the format from keys ['completion', 'prompt']" in err and "\n" not in err
    assert not (run / "metrics.jsonl").exists() and not (run / "config.gin").exists()
    # SFTConfig.paths alone selects the files (the dataset task); with the built-in task named, refused.
    assert main(["sft", f"--gin_param=SFTConfig.paths = ('{wrong}',)", f"--run_dir={run}", "--quiet"]) == 2
    assert f"SFTConfig.paths: no usable SFT examples in {wrong}" in capsys.readouterr().err
    assert main(["sft", f"--gin_param=SFTConfig.paths = ('{wrong}',)", "--gin_param=TaskSource.kind = 'arithmetic'",
                 f"--run_dir={run}", "--quiet"]) == 2
    assert "SFTConfig.paths is bound, but TaskSource.kind = 'arithmetic'" in capsys.readouterr().err


def test_eval_of_a_base_model_takes_a_prompt_template(tmp_path, capsys):
    model_dir = _tiny_model_dir(tmp_path / "model", "llama3", template_storage="none")  # a base model
    data = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(2))
    common = [f"--model={model_dir}", "--reward_workers=1", f"--gin_param=DataConfig.paths = ('{data}',)",
              "--gin_param=EvalConfig.max_new_tokens = 4", "--gin_param=EvalConfig.max_seq_len = 64",
              "--gin_param=EvalConfig.num_slots = 4"]
    assert main(["eval", *common, f"--run_dir={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err
    assert str(model_dir) in err and "DataConfig.prompt_template" in err and "DataConfig.chat_template_kwargs" in err
    out = tmp_path / "eval"
    assert main(["eval", *common, f"--run_dir={out}",
                 "--gin_param=DataConfig.prompt_template = 'Question: {question}\\nAnswer:'"]) == 0
    samples = read_jsonl(out / "samples.jsonl")
    assert len(samples) == 2 and json.loads((out / "report.json").read_text())["overall"]["num_prompts"] == 2


def test_train_warm_starts_on_files_then_runs_rl_on_one_step_axis(tmp_path):
    """`areal-jax train` on a dataset: SFT on chat and GSM8K rows from files, then RL on the GSM8K
    prompts; metrics.jsonl holds SFT's steps at -4..-1, then RL's from 0."""
    from tests.test_cli import QUICKSTART, SHORT, SPLIT_8

    sft_rows = write_jsonl(tmp_path / "sft.jsonl", gsm8k_rows(6) + chat_rows(2))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"}
                                                       for i in range(8)])
    run = tmp_path / "run"
    bindings = SHORT + [SPLIT_8, "TaskSource.kind = 'dataset'", f"DataConfig.paths = ('{prompts}',)",
                        f"SFTConfig.paths = ('{sft_rows}',)", "TaskSource.eval_size = 0", "TaskSource.validation_size = 0",
                        "SFTConfig.eval_every = 0", "SFTConfig.stop_accuracy = 0.0", "SFTConfig.steps = 4",
                        "SFTConfig.max_len = 160", "RLConfig.steps = 1", "RLConfig.eval_every = 0",
                        "RLVRConfig.reward = 'math'", "Stages.plot = False"]
    assert main(["train", f"--gin_file={QUICKSTART}", *[f"--gin_param={b}" for b in bindings], f"--run_dir={run}",
                 "--quiet"]) == 0
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [-4, -3, -2, -1, 0]
    assert all("sft" in r["metrics"] for r in records[:4]) and "sft" not in records[4]["metrics"]
    summary = strict_json((run / "summary.json").read_text())
    assert summary["sft_steps"] == 4 and summary["steps"] == 1


def test_sft_of_a_base_model_takes_a_prompt_template(tmp_path, capsys):
    model_dir = _tiny_model_dir(tmp_path / "model", "llama3", template_storage="none")  # a base model
    data = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(4))
    args = [*[p for p in TINY_RUN if not p.startswith("ModelSource.")], f"ModelSource.path = '{model_dir}'",
            f"DataConfig.paths = ('{data}',)", "SFTConfig.steps = 2", "SFTConfig.log_every = 1"]
    assert main(sft_args(tmp_path / "plain", *args)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"areal-jax: error: ModelSource.path: the tokenizer in {model_dir} has no chat template")
    assert "DataConfig.prompt_template" in err and "DataConfig.chat_template_kwargs" in err and "\n" not in err
    run = tmp_path / "templated"
    assert main(sft_args(run, *args, "DataConfig.prompt_template = 'Question: {question}\\nAnswer:'")) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [-2, -1]
