"""Reads the records of a W&B run file (`run-<id>.wandb`, what offline mode writes) with W&B's
own protobuf schema, so tests check what W&B received without a network or an account.

The file is a LevelDB-style log: a 7-byte header (":W&B", a 2-byte magic, a version byte), then
32 KiB blocks of records, each with a 7-byte header (CRC32, little-endian length, chunk type:
1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a header is padding.
"""

from __future__ import annotations

import json
import pathlib
import struct
import time

BLOCK = 32 * 1024
HEADER = 7


def _chunks(raw: bytes):
    if raw[:4] != b":W&B":
        raise ValueError("not a W&B run file")
    pos, record = HEADER, b""
    while pos + HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + HEADER])
        pos += HEADER
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left - HEADER
            continue
        record += raw[pos:pos + length]
        pos += length
        if kind in (1, 4):
            yield record
            record = b""


def read_run(path: str | pathlib.Path) -> dict:
    """{"run": {project, name, tags, id}, "config": {key: value}, "history": [{key: value}, ...],
    "finished": whether the run's exit record is there}."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict = {"run": None, "config": {}, "history": [], "finished": False}
    for data in _chunks(pathlib.Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run"] = {"project": rec.run.project, "name": rec.run.display_name, "tags": list(rec.run.tags),
                          "id": rec.run.run_id}
            out["config"].update({item.key: json.loads(item.value_json) for item in rec.run.config.update})
        elif kind == "config":
            out["config"].update({item.key: json.loads(item.value_json) for item in rec.config.update})
        elif kind == "exit":
            out["finished"] = True
        elif kind == "history":
            out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in rec.history.item})
    return out


def finished_runs(run_dir: str | pathlib.Path, count: int, timeout_s: float = 60.0) -> list[dict]:
    """The `count` offline runs W&B wrote under `run_dir`/wandb (read_run of each, oldest first),
    once each holds its exit record: W&B's service process may still be writing after `finish()`
    returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(pathlib.Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
        runs = [read_run(f) for f in files]
        if len(runs) == count and all(r["finished"] for r in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)
