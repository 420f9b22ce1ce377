"""Read raw records from local files, each tagged with where it came from.

Readers: JSON Lines (``.jsonl``, 1-based line numbers: "path:LINE"), Parquet
(``.parquet``, 0-based row numbers: "path[ROW]") and a directory written by
``datasets.Dataset.save_to_disk`` ("path[ROW]"; `datasets` is imported only here, only
then). A record that cannot be decoded (bad JSON, bad UTF-8, not an object) is yielded
as a `RawRecord` with `error` set rather than raised, so one bad line never stops a load.
A missing path or an unknown file type is a configuration error and does raise.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class RawRecord:
    """One record as read: either `record` (a mapping) or `error` (why it is unreadable)."""

    source: str
    record: Mapping[str, Any] | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if (self.record is None) == (self.error is None):
            raise ValueError(f"RawRecord {self.source}: exactly one of record / error must be set")


def iter_records(path: str) -> Iterator[RawRecord]:
    """Yield every record of one path (JSONL file, Parquet file or `datasets` directory)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"data path does not exist: {path}")
    if os.path.isdir(path):
        return iter_datasets_dir(path)
    if path.endswith(".jsonl"):
        return iter_jsonl(path)
    if path.endswith(".parquet"):
        return iter_parquet(path)
    raise ValueError(
        f"unsupported data path {path}: expected a .jsonl or .parquet file, or a directory "
        "written by datasets.Dataset.save_to_disk"
    )


def iter_jsonl(path: str) -> Iterator[RawRecord]:
    """Records of a JSON Lines file; blank lines are skipped, line numbers start at 1."""
    # Binary mode: a line of bad UTF-8 becomes one bad record instead of a crash.
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            source = f"{path}:{line_no}"
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield RawRecord(source, error=f"invalid UTF-8: {err.reason} at byte {err.start}")
                continue
            except json.JSONDecodeError as err:
                yield RawRecord(source, error=f"invalid JSON: {err.msg} (column {err.colno})")
                continue
            if not isinstance(value, dict):
                yield RawRecord(source, error=f"expected a JSON object, got {type(value).__name__}")
                continue
            yield RawRecord(source, record=value)


def iter_parquet(path: str, batch_size: int = 1024) -> Iterator[RawRecord]:
    """Records of a Parquet file, read batch by batch; row numbers start at 0."""
    try:
        import pyarrow.parquet as pq  # lazy: only this reader needs it
    except ImportError as err:
        raise ImportError(f"reading {path} needs the `pyarrow` package (pip install 'areal-jax[data]')") from err

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        for value in batch.to_pylist():
            yield RawRecord(f"{path}[{row}]", record=value)
            row += 1


def iter_datasets_dir(path: str) -> Iterator[RawRecord]:
    """Records of a directory written by `datasets.Dataset.save_to_disk`; rows start at 0."""
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(e for e in os.listdir(path) if os.path.isdir(os.path.join(path, e)))
        raise ValueError(f"{path} holds a DatasetDict; point at one split instead, one of: {splits}")
    if not os.path.exists(os.path.join(path, "state.json")):
        raise ValueError(f"{path} is a directory but not one written by datasets.Dataset.save_to_disk (no state.json)")
    try:
        import datasets  # lazy: only this reader needs it
    except ImportError as err:
        raise ImportError(f"reading {path} needs the `datasets` package (pip install 'areal-jax[data]')") from err
    dataset = datasets.load_from_disk(path)
    for row, value in enumerate(dataset):
        yield RawRecord(f"{path}[{row}]", record=value)
