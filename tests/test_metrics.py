"""MetricsLogger: JSONL round trip, TensorBoard events read back, progress line, rollout dumps."""

from __future__ import annotations

import json
import math
import struct
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.metrics import MetricsLogger, flatten_metrics, format_progress, read_jsonl


def _strict_json(line: str):
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(line, parse_constant=reject)


def _same(a, b) -> bool:
    """Equality that treats NaN as equal to NaN, recursively."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


STEPS = [
    (1, {"reward": {"mean": 0.25, "max": 5}, "loss": np.float32(0.5), "grad_norm": jnp.asarray(1.5),
         "staleness": {"mean": 0.0}, "ok": True}),
    (2, {"reward": {"mean": float("nan"), "max": np.int64(-5)}, "loss": float("inf"),
         "deep": {"a": {"b": {"c": -float("inf")}}}}),
    (3, {"throughput": {"tokens_per_s": 12345.6}, "version": 3}),
]
EXPECTED = [  # the same metrics as plain Python numbers
    {"reward": {"mean": 0.25, "max": 5}, "loss": 0.5, "grad_norm": 1.5, "staleness": {"mean": 0.0}, "ok": 1},
    {"reward": {"mean": math.nan, "max": -5}, "loss": math.inf, "deep": {"a": {"b": {"c": -math.inf}}}},
    {"throughput": {"tokens_per_s": 12345.6}, "version": 3},
]


def test_jsonl_round_trip_and_per_line_flush(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False, console=False)
    for i, (step, metrics) in enumerate(STEPS):
        logger.log(step, metrics, wall_time=1000.0 + i)
        # Flushed per call: the file already holds every line, each strict JSON.
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == i + 1
        _strict_json(lines[-1])
    raw = [_strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert raw[1]["metrics"]["reward"]["mean"] == "NaN" and raw[1]["metrics"]["loss"] == "Infinity"
    assert raw[1]["metrics"]["deep"]["a"]["b"]["c"] == "-Infinity"
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["wall_time"] for r in records] == [1000.0, 1001.0, 1002.0]
    for got, want in zip(records, EXPECTED):
        assert _same(got["metrics"], want), (got, want)
    logger.close()
    # A resumed run appends to the same file.
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as again:
        again.log(4, {"x": 1})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_bad_metric_values_name_the_key(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        with pytest.raises(TypeError, match="reward/text"):
            logger.log(1, {"reward": {"text": "high"}})
        with pytest.raises(TypeError, match="vec"):
            logger.log(1, {"vec": np.ones(3)})
        with pytest.raises(TypeError, match="step"):
            logger.log(1.5, {"x": 1})
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_flatten_metrics():
    assert flatten_metrics({"a": {"b": 1, "c": {"d": np.float32(2.5)}}, "e": False}) == {
        "a/b": 1, "a/c/d": 2.5, "e": 0}


def test_tensorboard_events_read_back_without_tensorflow(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, jsonl=False, console=False) as logger:
        for i, (step, metrics) in enumerate(STEPS):
            logger.log(step, metrics, wall_time=2000.0 + i)
    assert "tensorflow" not in sys.modules
    assert not (tmp_path / "metrics.jsonl").exists()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    expected: dict[str, list[tuple[int, float, float]]] = {}
    for i, ((step, _), metrics) in enumerate(zip(STEPS, EXPECTED)):
        for tag, value in flatten_metrics(metrics).items():
            expected.setdefault(tag, []).append((step, 2000.0 + i, value))
    assert set(acc.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        events = acc.Scalars(tag)
        assert [(e.step, e.wall_time) for e in events] == [(s, w) for s, w, _ in points], tag
        for e, (_, _, value) in zip(events, points):
            # simple_value is float32 on the wire.
            np.testing.assert_array_equal(np.float32(e.value), np.float32(value))


def _read_tfrecords(path) -> list[bytes]:
    """Payloads of a TFRecord file: [u64 length][u32 crc][payload][u32 crc] repeated."""
    data, out, pos = path.read_bytes(), [], 0
    while pos < len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        out.append(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
    assert pos == len(data)
    return out


def test_tensorboard_event_file_parsed_with_the_protos(tmp_path):
    from tensorboard.compat.proto import event_pb2

    with MetricsLogger(tmp_path, jsonl=False, console=False) as logger:
        logger.log(7, {"a": {"b": 0.125}, "c": -3}, wall_time=5.0)
        logger.log(8, {"c": float("nan")}, wall_time=6.0)
    (event_file,) = (tmp_path / "tensorboard").iterdir()
    events = [event_pb2.Event.FromString(r) for r in _read_tfrecords(event_file)]
    assert events[0].file_version == "brain.Event:2"
    first, second = [e for e in events if e.HasField("summary")]
    assert (first.step, first.wall_time, second.step, second.wall_time) == (7, 5.0, 8, 6.0)
    assert {v.tag: v.simple_value for v in first.summary.value} == {"a/b": 0.125, "c": -3.0}
    (nan_value,) = second.summary.value
    assert nan_value.tag == "c" and math.isnan(nan_value.simple_value)


def test_format_progress():
    assert format_progress(12, {"reward": {"mean": 0.53249}, "staleness": {"mean": 1.2},
                                "throughput": {"tokens_per_s": 1534.4}, "loss": 3.0}) == (
        "step 12 | reward 0.532 | staleness 1.20 | 1,534 tok/s")
    assert format_progress(3, {"reward": 5, "tokens_per_s": 10}) == "step 3 | reward 5.000 | 10 tok/s"
    # Non-finite values print as nan/inf; absent fields are left out.
    assert format_progress(4, {"reward": {"mean": float("nan")}, "staleness": float("inf")}) == (
        "step 4 | reward nan | staleness inf")
    assert format_progress(0, {}) == "step 0"


def test_console_prints_one_line_per_log(tmp_path, capsys):
    with MetricsLogger(tmp_path, tensorboard=False, jsonl=False, console=True) as logger:
        logger.log(1, {"reward": {"mean": 1.0}})
        logger.log(2, {"reward": {"mean": -1.0}, "staleness": {"mean": 0.5}})
    assert capsys.readouterr().out == "step 1 | reward 1.000\nstep 2 | reward -1.000 | staleness 0.50\n"
    assert not any(tmp_path.iterdir())


def test_dump_rollouts(tmp_path):
    records = [
        {"prompt": "1+1=?", "completion": "\\boxed{2}", "reward": 5.0,
         "versions": np.array([3, 3, 4], np.int32), "logprobs": jnp.asarray([-0.5, -1.25, -jnp.inf])},
        {"prompt": "2+2=?", "completion": "5", "reward": np.float32(-5.0), "versions": [4], "logprobs": [-0.25],
         "meta": {"group": 1, "tags": ("a", "b")}},
    ]
    with MetricsLogger(tmp_path, tensorboard=False, jsonl=False, console=False) as logger:
        path = logger.dump_rollouts(10, records)
        assert path == tmp_path / "rollouts" / "step_10.jsonl"
        lines = path.read_text().splitlines()
        assert len(lines) == 2 and all(_strict_json(line) for line in lines)
        back = read_jsonl(path)
        assert back[0] == {"prompt": "1+1=?", "completion": "\\boxed{2}", "reward": 5.0, "versions": [3, 3, 4],
                           "logprobs": [-0.5, -1.25, -math.inf]}
        assert back[1] == {"prompt": "2+2=?", "completion": "5", "reward": -5.0, "versions": [4],
                           "logprobs": [-0.25], "meta": {"group": 1, "tags": ["a", "b"]}}
        logger.dump_rollouts(10, records[:1])  # replaces the step's file whole
        assert len(read_jsonl(path)) == 1
        with pytest.raises(TypeError, match=r"records\[0\]\.bad"):
            logger.dump_rollouts(11, [{"bad": object()}])
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_10.jsonl"]


# ---- Weights & Biases (offline: no network) ----------------------------------------------------------


def test_wandb_offline_run_gets_every_step_under_the_jsonl_step_and_a_resume_continues_it(tmp_path):
    from areal_jax.metrics import MetricsConfig
    from tests.wandb_records import finished_runs

    cfg = MetricsConfig(wandb_mode="offline", wandb_project="areal-test", wandb_run_name="tiny",
                        wandb_tags=("rl", "cpu"))
    with MetricsLogger(tmp_path, tensorboard=False, console=False, wandb=cfg,
                       wandb_config={"rl": {"steps": 3}, "mode": "sync"}) as logger:
        logger.log(0, {"reward": {"mean": 0.25, "std": 0.5}, "completion": {"truncated_frac": 0.0}})
        logger.log(1, {"reward": {"mean": 0.75, "std": 0.25}, "completion": {"truncated_frac": 0.5}})
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    # A resumed run (a new logger on the same directory) continues the same W&B run.
    with MetricsLogger(tmp_path, tensorboard=False, console=False, wandb=cfg) as logger:
        logger.log(2, {"reward": {"mean": 1.0, "std": 0.0}, "sft": {"loss": 1.5}})
    runs = finished_runs(tmp_path, 2)
    assert len(runs) == 2 and all(r["finished"] and r["run"]["id"] == run_id for r in runs)
    first, second = runs
    assert first["run"] == {"project": "areal-test", "name": "tiny", "tags": ["rl", "cpu"], "id": run_id}
    assert first["config"]["rl"] == {"steps": 3} and first["config"]["mode"] == "sync"
    history = [{k: v for k, v in h.items() if not k.startswith("_")} for h in first["history"] + second["history"]]
    jsonl = read_jsonl(tmp_path / "metrics.jsonl")
    assert history == [{"step": r["step"], **flatten_metrics(r["metrics"])} for r in jsonl]
    assert [h["step"] for h in history] == [0, 1, 2]


def test_wandb_missing_is_one_line_naming_the_package_and_the_extra(tmp_path, monkeypatch):
    from areal_jax.metrics import MetricsConfig

    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets without the package
    with pytest.raises(ImportError) as info:
        MetricsLogger(tmp_path, console=False, wandb=MetricsConfig(wandb_mode="offline"))
    message = str(info.value)
    assert "`wandb` package" in message and "areal-jax[wandb]" in message and "MetricsConfig.wandb_mode" in message
    assert "\n" not in message
    # Disabled (the default), nothing needs the package.
    with MetricsLogger(tmp_path, tensorboard=False, console=False, wandb=MetricsConfig()) as logger:
        logger.log(0, {"x": 1})
    assert not (tmp_path / "wandb").exists()


def test_metrics_config_is_validated_and_registered():
    from areal_jax import config_system as cs
    from areal_jax.jobs.configs import JOB_CONFIG_CLASSES
    from areal_jax.metrics import MetricsConfig

    assert MetricsConfig in JOB_CONFIG_CLASSES
    cs.parse(gin_params=["MetricsConfig.wandb_mode = 'offline'", "MetricsConfig.wandb_tags = ['a', 'b']"])
    assert cs.build(MetricsConfig) == MetricsConfig(wandb_mode="offline", wandb_tags=("a", "b"))
    cs.parse(gin_params=["MetricsConfig.wandb_mode = 'cloud'"])
    with pytest.raises(cs.ConfigError, match="MetricsConfig.wandb_mode"):
        cs.build(MetricsConfig)
    cs.parse()
    with pytest.raises(ValueError, match="wandb_tags"):
        MetricsConfig(wandb_tags=("x" * 65,))
    with pytest.raises(ValueError, match="wandb_project"):
        MetricsConfig(wandb_project="")


# ---- the progress bar and the per-step lines share the terminal -------------------------------------

BAR_AND_LINES = """
import sys
from areal_jax.jobs.progress import progress_bar
from areal_jax.metrics import MetricsLogger

bar = progress_bar(3, True)
with MetricsLogger(sys.argv[1], tensorboard=False, jsonl=False, console=True) as log:
    for step in range(3):
        bar.refresh()  # the bar is on screen, as between steps of a run
        log.log(step, {"reward": {"mean": 0.5 * step}})
        bar.update(1)
bar.close()
"""


def test_progress_bar_and_step_lines_do_not_interleave(tmp_path):
    import subprocess

    # stdout and stderr into one pipe, as on a terminal: the bar draws on stderr, lines go to stdout.
    proc = subprocess.run([sys.executable, "-c", BAR_AND_LINES, str(tmp_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    pieces = [p for p in proc.stdout.replace("\r", "\n").split("\n") if "step " in p]
    # Each per-step line stands alone: nothing of the bar before or after it on its line.
    assert pieces == ["step 0 | reward 0.000", "step 1 | reward 0.500", "step 2 | reward 1.000"], proc.stdout
    assert "RL steps" in proc.stdout  # the bar was drawn too
