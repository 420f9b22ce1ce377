"""`areal-jax train` end to end in a shortened form, and configuration errors caught up front."""

import json
import pathlib

import pytest

from areal_jax.cli import main
from areal_jax.metrics import read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.gin")
SHORT = [  # the quickstart, shrunk to seconds
    "ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "TaskSource.train_size = 300",
    "TaskSource.eval_size = 8", "SFTConfig.steps = 10", "SFTConfig.warmup = 2", "RLConfig.steps = 2",
    "RLConfig.batch_size = 2", "RLConfig.max_concurrent = 4", "RLConfig.eval_every = 1",
    "RLVRConfig.n_samples = 2", "RLVRConfig.max_new_tokens = 8", "RLVRConfig.filter_all_equal_rewards = False",
    "RLConfig.eval_max_new_tokens = 8", "EngineConfig.num_slots = 8", "EngineConfig.max_seq_len = 64",
]


def _args(run_dir, *extra):
    return ["train", f"--gin_file={QUICKSTART}", *[f"--gin_param={p}" for p in SHORT + list(extra)],
            f"--run_dir={run_dir}", "--quiet"]


def test_quickstart_runs_end_to_end_in_short_form(tmp_path):
    assert main(_args(tmp_path)) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
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
    assert summary["steps"] == 2 and summary["trained_tokens"] > 0
    assert (tmp_path / "progress.png").stat().st_size > 0
    assert "RLConfig.steps = 2" in (tmp_path / "config.gin").read_text()
    from areal_jax.models import load_pretrained
    from areal_jax.models.tokenizer import Tokenizer

    load_pretrained(tmp_path / "final_model")
    Tokenizer.from_pretrained(tmp_path / "final_model")


@pytest.mark.parametrize("binding,message", [
    ("RLConfig.stepz = 3", "stepz"),
    ("NotAConfig.x = 1", "NotAConfig"),
    ("RLConfig.steps = 'many'", "RLConfig.steps"),
    ("PPOConfig.eps_clip = -1.0", "eps_clip"),
    ("MeshConfig.num_generation_devices_per_host = 8", "MeshConfig"),
])
def test_config_errors_are_reported_before_anything_starts(tmp_path, capsys, binding, message):
    assert main(_args(tmp_path / "run", binding)) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err and message in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "config.gin").exists()
