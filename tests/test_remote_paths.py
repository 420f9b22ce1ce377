"""Run and checkpoint directories on gs://, against an in-memory GCS (tests/fake_gcs.py) that both
fsspec (epath, tensorboard) and TensorStore's GCS driver (Orbax's arrays) talk to: the checkpoint
manager, the record writers, the run-directory checks, a whole `areal-jax train` run and its export."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax import paths
from areal_jax.checkpoint import CheckpointConfig, Checkpointer, SavedParams, clear_checkpoints, finalized_steps
from areal_jax.metrics import MetricsLogger, read_jsonl
from areal_jax.models import init_params, load_params
from areal_jax.tasks.tokenizer_builder import task_model_config
from tests.fake_gcs import fake_gcs

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def gcs(monkeypatch):
    with fake_gcs(monkeypatch) as fs:
        yield fs


def _objects(gcs, prefix: str) -> list[str]:
    return sorted(k[len(prefix):] for k in gcs.store if k.startswith(prefix))


def test_paths_keep_gs_urls_and_local_paths_as_given():
    assert str(paths.absolute("gs://bkt/run") / "checkpoints") == "gs://bkt/run/checkpoints"
    assert paths.is_remote("gs://bkt/run") and not paths.is_remote("runs/x")
    assert str(paths.as_path("runs/x")) == "runs/x"
    assert paths.absolute("runs/x") == pathlib.Path("runs/x").absolute()


def test_checkpoints_save_restore_keep_and_export_on_gcs(gcs, tmp_path):
    cfg = task_model_config(hidden_size=32, num_layers=2)
    states = [init_params(cfg, seed) for seed in (1, 2, 3)]
    config = CheckpointConfig("gs://bkt/run/checkpoints", max_to_keep=2, async_save=False,
                              export_hf_interval_steps=1, export_dir="gs://bkt/run/hf")
    with Checkpointer(config) as ckpt:
        for step, params in enumerate(states, start=1):
            state = {"params": params, "opt_state": jax.tree.map(jnp.zeros_like, params), "step": step}
            assert ckpt.save(step, state=state, meta={"step": step}, force=True)
        assert ckpt.all_steps() == [2, 3]  # max_to_keep deleted step 1's objects
        restored, meta = ckpt.restore()
        assert meta == {"step": 3}
        np.testing.assert_array_equal(restored["params"]["embed"], states[2]["embed"])
        path = ckpt.export_hf(states[2], cfg, 3)
    assert str(path) == "gs://bkt/run/hf/step_3"
    assert {"config.json", "model.safetensors"} <= set(_objects(gcs, "bkt/run/hf/step_3/"))
    assert not _objects(gcs, "bkt/run/checkpoints/1/")
    np.testing.assert_array_equal(SavedParams("gs://bkt/run/checkpoints", 2).read(("layers", "wq")),
                                  states[1]["layers"]["wq"])
    # A step written in place but never committed (a crash mid-save) is not a finished step.
    gcs.pipe_file("bkt/run/checkpoints/4/_CHECKPOINT_METADATA", b"{}")
    assert finalized_steps("gs://bkt/run/checkpoints") == [2, 3]
    clear_checkpoints("gs://bkt/run/checkpoints")
    assert not _objects(gcs, "bkt/run/checkpoints/")
    # The export read back from GCS is the same model (copied to local disk: the reader memory-maps).
    local = tmp_path / "hf"
    paths.copy_files("gs://bkt/run/hf/step_3", local)
    _, loaded = load_params(local)
    np.testing.assert_array_equal(loaded["layers"]["w_up"], states[2]["layers"]["w_up"])


def test_metrics_rollouts_and_tensorboard_on_gcs(gcs):
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2

    with MetricsLogger("gs://bkt/run", console=False) as log:
        log.log(0, {"reward": {"mean": 0.5}})
        log.log(1, {"reward": {"mean": float("nan")}})
        log.dump_rollouts(1, [{"prompt": "1+1", "completion": "2", "reward": 1.0}])
    with MetricsLogger("gs://bkt/run", console=False, tensorboard=False) as log:  # a resumed run appends
        log.log(2, {"reward": {"mean": 1.0}})
    records = read_jsonl("gs://bkt/run/metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert np.isnan(records[1]["metrics"]["reward"]["mean"])
    assert read_jsonl("gs://bkt/run/rollouts/step_1.jsonl")[0]["completion"] == "2"
    (events,) = _objects(gcs, "bkt/run/tensorboard/")
    raw = list(RawEventFileLoader(f"gs://bkt/run/tensorboard/{events}").Load())
    scalars = [(e.step, v.tag, v.simple_value) for e in map(event_pb2.Event.FromString, raw) for v in e.summary.value]
    assert scalars[0] == (0, "reward/mean", 0.5) and scalars[1][:2] == (1, "reward/mean")


TINY_RUN = [
    f"--gin_file={ROOT / 'configs' / 'quickstart.gin'}",
    *[f"--gin_param={p}" for p in (
        "ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "TaskSource.train_size = 50",
        "TaskSource.eval_size = 2", "SFTConfig.steps = 2", "SFTConfig.warmup_steps = 1", "SFTConfig.eval_every = 0",
        "SFTConfig.stop_accuracy = 0.0",
        "RLConfig.steps = 2", "RLConfig.batch_size = 2", "RLConfig.max_concurrent = 4",
        "RLConfig.dump_rollouts_every = 1", "RLVRConfig.n_samples = 2", "RLVRConfig.max_new_tokens = 4",
        "RLVRConfig.filter_all_equal_rewards = False", "RLConfig.eval_max_new_tokens = 4",
        "EngineConfig.num_slots = 4", "EngineConfig.max_seq_len = 48", "CheckpointConfig.save_interval_steps = 1",
        "MeshConfig.num_generation_devices_per_host = 4")],
    "--quiet",
]


def test_a_whole_run_and_its_export_on_gcs(gcs, tmp_path, capsys):
    from areal_jax.cli import main

    assert main(["train", *TINY_RUN, "--run_dir=gs://bkt/run"]) == 0
    held = set(_objects(gcs, "bkt/run/"))
    for record in ("config.gin", "config.json", "model_config.json", "summary.json", "metrics.jsonl",
                   "progress.png", "tokenizer/tokenizer.json", "final_model/model.safetensors",
                   "final_model/config.json", "final_model/tokenizer.json", "rollouts/step_1.jsonl",
                   "checkpoints/2/commit_success.txt"):
        assert record in held, record
    assert any(name.startswith("tensorboard/events.out.tfevents.") for name in held)
    assert [r["step"] for r in read_jsonl("gs://bkt/run/metrics.jsonl")][-2:] == [0, 1]
    assert json.loads(gcs.cat_file("bkt/run/summary.json"))["steps"] == 2
    assert not (pathlib.Path.cwd() / "gs:").exists()  # nothing went to a local "gs:" directory
    # The run directory is recognised as holding a run, and --overwrite clears it.
    assert main(["train", *TINY_RUN, "--run_dir=gs://bkt/run"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    # --overwrite's clean-up removes the records and the checkpoints, on GCS as locally.
    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.jobs.run_dir import previous_run, remove_previous_run

    cfg = load_job_configs([TINY_RUN[0][len("--gin_file="):]], [a[len("--gin_param="):] for a in TINY_RUN[1:-1]],
                           run_dir="gs://bkt/run")
    assert previous_run(cfg, "gs://bkt/run") == ["config.gin", "config.json", "summary.json", "metrics.jsonl",
                                                 "final_model/", "checkpoints/ (step 2)"]
    kept = {k: gcs.store[k].getvalue() for k in gcs.store if k.startswith("bkt/run/")}
    remove_previous_run(cfg, "gs://bkt/run")
    assert previous_run(cfg, "gs://bkt/run") == [] and not _objects(gcs, "bkt/run/checkpoints/")
    for k, v in kept.items():  # put back for the export below
        gcs.pipe_file(k, v)
    # The export reads the checkpoint, the model config and the tokenizer from gs://.
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint=gs://bkt/run/checkpoints", f"--out={out}"]) == 0
    final_dir = tmp_path / "final"
    paths.copy_files("gs://bkt/run/final_model", final_dir)
    _, exported = load_params(out)
    _, final = load_params(final_dir)  # the last checkpoint holds the final weights
    for key in ("embed", "final_norm"):
        np.testing.assert_array_equal(exported[key], final[key])
    np.testing.assert_array_equal(exported["layers"]["wq"], final["layers"]["wq"])
    assert (out / "tokenizer.json").read_bytes() == gcs.cat_file("bkt/run/tokenizer/tokenizer.json")


def test_gs_paths_without_gcsfs_are_one_line_before_any_work(tmp_path, capsys):
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
        pytest.skip("gcsfs is installed: gs:// is reachable")
    except ImportError:
        pass
    with pytest.raises(ValueError, match=r"CheckpointConfig.directory = gs://bkt/ck: .*gcsfs.*areal-jax\[gcs\]"):
        CheckpointConfig("gs://bkt/ck")
    from areal_jax.cli import main

    assert main(["train", *TINY_RUN, "--run_dir=gs://bkt/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gs://bkt/run" in err[0] and "gcsfs" in err[0]


def test_eval_writes_its_report_to_gcs(gcs, tmp_path):
    from areal_jax.cli import main
    from areal_jax.models import save_params
    from areal_jax.tasks.tokenizer_builder import build_tokenizer

    model = build_tokenizer(tmp_path / "model")
    cfg = task_model_config(hidden_size=32, num_layers=1)
    save_params(init_params(cfg, 0), cfg, model)
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1 =", "answer": f"#### {i + 1}"}) + "\n" for i in range(2)))
    assert main(["eval", f"--model={model}", "--run_dir=gs://bkt/eval", "--reward_workers=1",
                 f"--gin_param=DataConfig.paths = ('{data}',)", "--gin_param=EvalConfig.n_samples = 2",
                 "--gin_param=EvalConfig.ks = (1, 2)", "--gin_param=EvalConfig.temperature = 1.0",
                 "--gin_param=EvalConfig.max_new_tokens = 4",
                 "--gin_param=EvalConfig.max_seq_len = 48", "--gin_param=EvalConfig.num_slots = 4"]) == 0
    assert json.loads(gcs.cat_file("bkt/eval/report.json"))["overall"]["num_samples"] == 4
    assert len(read_jsonl("gs://bkt/eval/samples.jsonl")) == 4
