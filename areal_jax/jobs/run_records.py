"""What a resumed run keeps of the records in its run directory: every step recorded once.

A run logs a step before it checkpoints it, and may be killed in between or while the save is
being written; it then resumes from an earlier checkpoint and trains those steps again. Before
the resumed run logs anything, `drop_steps_from(run_dir, first)` removes what was recorded of
step `first` (the first step it will train) and later:

- metrics.jsonl: the lines of those steps, and a last line a kill tore;
- rollouts/step_<N>.jsonl for N >= first;
- tensorboard/: every event file is rewritten without the summaries of those steps (and a torn
  last record). TensorBoard shows every event of every file of a run directory, so without this
  a redone step would appear twice. The resumed run's logger then writes a new event file beside
  the old ones; together they hold each step once.

Only process 0 writes records, so only it calls this. Rewritten files appear whole
(`paths.write_whole`), so a kill during the clean-up leaves either the old or the new file.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

from areal_jax import paths


def drop_steps_from(run_dir: paths.PathLike, first: int) -> list[dict[str, Any]]:
    """Removes the records of steps >= `first` under `run_dir`; returns the metrics.jsonl records removed."""
    run_dir = paths.as_path(run_dir)
    dropped = _drop_jsonl_steps(run_dir / "metrics.jsonl", first)
    rollouts = run_dir / "rollouts"
    if rollouts.is_dir():
        for dump in rollouts.glob("step_*.jsonl"):
            index = dump.name[len("step_"):-len(".jsonl")]
            if index.isdigit() and int(index) >= first:
                dump.unlink()
    tensorboard = run_dir / "tensorboard"
    if tensorboard.is_dir():
        for events in sorted(tensorboard.glob("events.out.tfevents.*")):
            _drop_event_steps(events, first)
    return dropped


def last_wall_time(records: list[dict[str, Any]], key: str = "time/since_start_s") -> float:
    """The largest finite `key` among the records' metrics (0 when none has it)."""
    values = [r.get("metrics", {}).get(key) for r in records]
    return max((float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)), default=0.0)


def _drop_jsonl_steps(path: paths.Path, first: int) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    kept, dropped = [], []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # torn by a kill mid-write
            continue
        if not line.endswith("\n"):
            continue  # a whole object without its newline: the write was cut short all the same
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] >= first:
            dropped.append(record)
        else:
            kept.append(line)
    if len(kept) != len(lines):
        paths.write_whole(path, "".join(kept))
    return dropped


def _drop_event_steps(path: paths.Path, first: int) -> None:
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    data = path.read_bytes()
    records, end = _tfrecords(data)
    kept = [r for r in records if not _summary_from(event_pb2.Event.FromString(r), first)]
    if len(kept) == len(records) and end == len(data):
        return
    out = io.BytesIO()
    writer = RecordWriter(out)
    for record in kept:
        writer.write(record)
    paths.write_whole(path, out.getvalue())


def _tfrecords(data: bytes) -> tuple[list[bytes], int]:
    """The payloads of a TFRecord file ([u64 length][u32 crc][payload][u32 crc] each) and the end
    of the last whole record; a torn tail is left out. Lengths are trusted: the file is ours."""
    records, pos = [], 0
    while pos + 12 <= len(data):
        length = int.from_bytes(data[pos:pos + 8], "little")
        if pos + 12 + length + 4 > len(data):
            break
        records.append(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
    return records, pos


def _summary_from(event: Any, first: int) -> bool:
    return event.HasField("summary") and event.step >= first
