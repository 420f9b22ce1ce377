"""`areal-jax export`: a real run's checkpoint becomes an HF directory that transformers loads with
our logits, that `areal-jax eval` takes, and whose weights are the checkpoint's; bad input is one
line naming the flag."""

import json
import pathlib

import numpy as np
import pytest

from areal_jax.checkpoint import SavedParams
from areal_jax.cli import main
from areal_jax.models.hf_io import leaf_keys
from tests.test_model_parity import _tol

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_RUN = [  # the quickstart without SFT, two RL steps, a checkpoint after each
    f"--gin_file={ROOT / 'configs' / 'quickstart.gin'}",
    *[f"--gin_param={p}" for p in (
        "ModelSource.hidden_size = 32", "ModelSource.num_layers = 2", "TaskSource.train_size = 50",
        "TaskSource.eval_size = 2", "Stages.sft = False", "Stages.plot = False", "RLConfig.steps = 2",
        "RLConfig.batch_size = 2", "RLConfig.max_concurrent = 4", "RLVRConfig.n_samples = 2",
        "RLVRConfig.max_new_tokens = 4", "RLVRConfig.filter_all_equal_rewards = False",
        "RLConfig.eval_max_new_tokens = 4", "EngineConfig.num_slots = 4", "EngineConfig.max_seq_len = 48",
        "CheckpointConfig.save_interval_steps = 1", "CheckpointConfig.async_save = False",
        "MeshConfig.num_generation_devices_per_host = 4",  # of 8 fake devices: 4 train, 4 generate
        # A reward that varies on an untrained policy: every step changes the weights.
        "RLVRConfig.reward = 'tests.resume_fixtures:digit_share'")],
    "--quiet",
]
SEQS = [[1, 5, 9, 2, 7, 3, 3, 8], [4], [11, 12, 13]]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "run"
    assert main(["train", *TINY_RUN, f"--run_dir={run}"]) == 0
    return run


def _weights(leaf_source, cfg):
    return {leaf: np.asarray(leaf_source(leaf)) for leaf in leaf_keys(cfg)}


def test_export_loads_in_transformers_with_our_logits(run_dir, tmp_path, reference):
    import jax.numpy as jnp

    from areal_jax.models import load_params, load_pretrained

    out = tmp_path / "hf"
    assert main(["export", f"--checkpoint={run_dir / 'checkpoints'}", f"--out={out}"]) == 0
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= \
        {p.name for p in out.iterdir()}
    # The latest step's weights, exactly (fp32 in, fp32 out).
    cfg, params = load_params(out)
    saved = SavedParams(run_dir / "checkpoints", 2)
    exported = _weights(lambda leaf: params["layers"][leaf[1]] if leaf[0] == "layers" else params[leaf[0]], cfg)
    for leaf, value in _weights(saved.read, cfg).items():
        np.testing.assert_array_equal(exported[leaf], value, err_msg=str(leaf))
    # ... and a trained step differs from the first: the export did not pick an arbitrary step.
    first = SavedParams(run_dir / "checkpoints", 1).read(("layers", "wq"))
    assert not np.array_equal(first, exported[("layers", "wq")])
    reference.run("logits", model=str(out), sequences=SEQS, out=str(tmp_path / "ref.npz"))
    ref = np.load(tmp_path / "ref.npz")
    refs = [ref[f"logits_{i}"] for i in range(len(SEQS))]
    model = load_pretrained(out)
    for seq, r in zip(SEQS, refs):
        np.testing.assert_allclose(np.asarray(model(jnp.asarray([seq])))[0], r, atol=_tol(refs), rtol=0)


def test_export_of_a_step_in_bfloat16_is_taken_by_eval(run_dir, tmp_path, capsys):
    import ml_dtypes

    from areal_jax.models import load_params

    out = tmp_path / "hf1"
    assert main(["export", f"--checkpoint={run_dir / 'checkpoints' / '1'}", f"--out={out}", "--dtype=bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    cfg, params = load_params(out)
    wq = SavedParams(run_dir / "checkpoints", 1).read(("layers", "wq"))
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"]),
                                  wq.astype(ml_dtypes.bfloat16).astype(np.float32))
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1 =", "answer": f"#### {i + 1}"}) + "\n" for i in range(2)))
    evaluation = tmp_path / "eval"
    assert main(["eval", f"--model={out}", f"--run_dir={evaluation}", "--reward_workers=1",
                 f"--gin_param=DataConfig.paths = ('{data}',)", "--gin_param=EvalConfig.n_samples = 1",
                 "--gin_param=EvalConfig.ks = (1,)", "--gin_param=EvalConfig.max_new_tokens = 4",
                 "--gin_param=EvalConfig.max_seq_len = 48", "--gin_param=EvalConfig.num_slots = 4"]) == 0
    assert json.loads((evaluation / "report.json").read_text())["overall"]["num_prompts"] == 2


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_input_is_one_line_naming_the_flag_and_path(run_dir, tmp_path, capsys):
    ckpts = run_dir / "checkpoints"
    assert main(["export", f"--checkpoint={tmp_path / 'nothing'}", f"--out={tmp_path / 'o'}"]) == 2
    line = _error_line(capsys)
    assert "--checkpoint" in line and str(tmp_path / "nothing") in line
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", f"--checkpoint={empty}", f"--out={tmp_path / 'o'}"]) == 2
    line = _error_line(capsys)
    assert "--checkpoint" in line and "no finished checkpoint" in line
    assert main(["export", f"--checkpoint={ckpts / '7'}", f"--out={tmp_path / 'o'}"]) == 2
    line = _error_line(capsys)
    assert "--checkpoint" in line and "no finished step 7" in line and "1, 2" in line
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert main(["export", f"--checkpoint={ckpts}", f"--out={full}"]) == 2
    line = _error_line(capsys)
    assert "--out" in line and str(full) in line and "--overwrite" in line
    assert (full / "keep.txt").read_text() == "mine"  # nothing was touched
    assert main(["export", f"--checkpoint={ckpts}", f"--out={full}", "--dtype=int8"]) == 2
    assert "--dtype" in _error_line(capsys)
    assert main(["export", f"--checkpoint={ckpts}", f"--out={tmp_path / 'o'}", "--adapter"]) == 2
    line = _error_line(capsys)
    assert "--adapter" in line and "no LoRA adapters" in line, line
    assert not (tmp_path / "o").exists()
    # --overwrite replaces the directory whole.
    assert main(["export", f"--checkpoint={ckpts}", f"--out={full}", "--overwrite"]) == 0
    assert not (full / "keep.txt").exists() and (full / "model.safetensors").is_file()


def test_a_broken_step_or_run_is_one_line_naming_what_is_wrong(run_dir, tmp_path, capsys):
    import shutil

    def broken(name: str, breaks) -> pathlib.Path:
        copy = tmp_path / name
        shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("final_model", "tensorboard"))
        breaks(copy / "checkpoints" / "2")
        return copy

    def truncate(step: pathlib.Path) -> None:
        data = max((p for p in (step / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
                   key=lambda p: p.stat().st_size)
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)

    cases = [("no_metadata", lambda step: (step / "state" / "_METADATA").unlink(), "state/_METADATA is missing"),
             ("truncated", truncate, "is truncated")]
    for name, breaks, phrase in cases:
        copy = broken(name, breaks)
        out = tmp_path / f"out_{name}"
        assert main(["export", f"--checkpoint={copy / 'checkpoints'}", f"--out={out}"]) == 2
        line = _error_line(capsys)
        assert "--checkpoint" in line and "step 2" in line and phrase in line, line
        assert not out.exists()
    copy = broken("no_architectures", lambda step: None)
    config = json.loads((copy / "model_config.json").read_text())
    del config["architectures"], config["model_type"]  # without architectures, model_type alone would do
    (copy / "model_config.json").write_text(json.dumps(config))
    assert main(["export", f"--checkpoint={copy / 'checkpoints'}", f"--out={tmp_path / 'o'}"]) == 2
    line = _error_line(capsys)
    assert "model_config.json" in line and "architecture" in line, line


def test_gs_without_gcsfs_is_one_line(tmp_path, capsys, monkeypatch):
    import fsspec

    def no_gcs(scheme):
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec, "get_filesystem_class", no_gcs)
    assert main(["export", "--checkpoint=gs://bkt/run/checkpoints", f"--out={tmp_path / 'o'}"]) == 2
    line = _error_line(capsys)
    assert "--checkpoint = gs://bkt/run/checkpoints" in line and "areal-jax[gcs]" in line


def test_out_that_is_or_holds_a_run_or_the_checkpoint_is_refused_and_nothing_is_touched(run_dir, tmp_path, capsys):
    ckpts = run_dir / "checkpoints"
    before = sorted(str(p.relative_to(run_dir.parent)) for p in run_dir.parent.rglob("*"))
    cases = [(run_dir, "is the run directory"), (ckpts, "is the checkpoint directory"),
             (ckpts / "2", "is the checkpoint step"), (run_dir.parent, "contains the run directory"),
             (run_dir / "tokenizer", "is the tokenizer directory")]
    for out, phrase in cases:
        assert main(["export", f"--checkpoint={ckpts}", f"--out={out}", "--overwrite"]) == 2
        line = _error_line(capsys)
        assert "--out" in line and phrase in line, line
    # A copy of the run elsewhere: a run directory by its markers, or one inside --out.
    other = tmp_path / "other"
    (other / "deep" / "run").mkdir(parents=True)
    (other / "deep" / "run" / "config.gin").write_text("RLConfig.steps = 1\n")
    for out, phrase in ((other / "deep" / "run", "is a run directory (it holds config.gin)"),
                        (other, f"contains the run directory {other / 'deep' / 'run'}")):
        assert main(["export", f"--checkpoint={ckpts}", f"--out={out}", "--overwrite"]) == 2
        assert phrase in _error_line(capsys)
    assert (other / "deep" / "run" / "config.gin").is_file()
    assert sorted(str(p.relative_to(run_dir.parent)) for p in run_dir.parent.rglob("*")) == before


def test_a_killed_exports_hidden_partial_directory_goes_with_the_next_export(run_dir, tmp_path):
    import os

    out = tmp_path / "hf"
    dead = tmp_path / ".hf.tmp-999999999-1"  # a pid no process has: its writer was killed
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    live = tmp_path / f".hf.tmp-{os.getpid()}-1"  # a writer still running keeps its own
    live.mkdir()
    assert main(["export", f"--checkpoint={run_dir / 'checkpoints'}", f"--out={out}"]) == 0
    assert not dead.exists() and live.is_dir() and (out / "model.safetensors").is_file()


def test_eval_of_a_builtin_task_run_takes_its_held_out_problems(run_dir, tmp_path):
    """README's `eval --run_dir_of=runs/qs`: the quickstart's held-out set is generated, not a file."""
    evaluation = tmp_path / "eval"
    assert main(["eval", f"--run_dir_of={run_dir}", f"--run_dir={evaluation}", "--reward_workers=1"]) == 0
    assert json.loads((evaluation / "report.json").read_text())["overall"]["num_prompts"] == 2  # TaskSource.eval_size
    assert len((evaluation / "held_out.jsonl").read_text().splitlines()) == 2
