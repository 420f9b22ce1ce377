"""A resumed run's records: what the killed run logged past its checkpoint is dropped, torn tails
included, so that with the resumed run's own records every step appears once."""

import json

import pytest

from areal_jax.jobs.run_records import drop_steps_from, last_wall_time
from areal_jax.metrics import MetricsLogger, read_jsonl


def _tensorboard_points(logdir) -> dict[str, list[int]]:
    """Steps per tag over every event file of `logdir`, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _log_steps(run_dir, steps, value):
    with MetricsLogger(run_dir, console=False) as log:
        for step in steps:
            log.log(step, {"loss": value + step, "time/since_start_s": 10.0 * (step + 1)})
            log.dump_rollouts(step, [{"step": step}])


def test_a_resumed_run_records_each_step_once(tmp_path):
    _log_steps(tmp_path, range(6), 0.0)  # the killed run got to step 5; its checkpoint holds 0..2
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "wall_ti')  # killed mid-line
    (events,) = (tmp_path / "tensorboard").iterdir()
    with open(events, "ab") as f:
        f.write(b"\x20\x00\x00\x00\x00\x00\x00\x00\x01")  # killed mid-record

    dropped = drop_steps_from(tmp_path, 3)
    assert [r["step"] for r in dropped] == [3, 4, 5]
    assert last_wall_time(dropped) == 60.0
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [f"step_{s}.jsonl" for s in range(3)]
    assert _tensorboard_points(tmp_path / "tensorboard")["loss"] == [0, 1, 2]

    _log_steps(tmp_path, range(3, 7), 100.0)  # the resumed run
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(7))
    assert [r["metrics"]["loss"] for r in records] == [0.0, 1.0, 2.0, 103.0, 104.0, 105.0, 106.0]
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2  # the old file and the resumed run's
    points = _tensorboard_points(tmp_path / "tensorboard")
    assert points == {"loss": list(range(7)), "time/since_start_s": list(range(7))}


def test_nothing_past_the_checkpoint_leaves_the_files_as_they_are(tmp_path):
    _log_steps(tmp_path, range(3), 0.0)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert drop_steps_from(tmp_path, 3) == []
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert drop_steps_from(tmp_path / "empty", 0) == []  # a run that logged nothing yet


@pytest.mark.parametrize("line", ['{"step": 1, "metrics": {}}', "not json at all"])
def test_a_last_line_without_its_newline_is_dropped(tmp_path, line):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "metrics": {}}) + "\n" + line)
    assert drop_steps_from(tmp_path, 5) == []
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0]
