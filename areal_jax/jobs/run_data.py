"""What a run trains on, pinned so that a resume trains on the same: the data paths made absolute
(a resume from another working directory reads the same files), rows given as Python data written
into RUN/inputs/ only under the run's lock, and RUN/data_files.json, each data file's size, line
count and sha256, which a resume compares before anything is written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax

from areal_jax import paths
from areal_jax.job_config import JobConfigs
from areal_jax.jobs.inputs import InputError

logger = logging.getLogger(__name__)

RECORD_FILE = "data_files.json"
# (JobConfigs part, field, the name a message gives it): every path a run reads its data from.
DATA_FIELDS = (("data", "paths", "DataConfig.paths"), ("sft", "paths", "SFTConfig.paths"),
               ("sft", "eval_paths", "SFTConfig.eval_paths"), ("task", "eval_paths", "TaskSource.eval_paths"))
MODEL_FIELDS = (("model", "path", "ModelSource.path"), ("model", "tokenizer_path", "ModelSource.tokenizer_path"))


def _absolute(path: str) -> str:
    return path if paths.is_remote(path) else os.path.abspath(path)


def absolute_paths(cfg: JobConfigs) -> JobConfigs:
    """`cfg` with every data and model path absolute. Parsed configs keep their gin text, with the
    absolute values bound after it (gin's last binding wins), so config.gin records them too."""
    changed: dict[str, dict[str, Any]] = {}
    lines = []
    for part, field, name in DATA_FIELDS + MODEL_FIELDS:
        obj = getattr(cfg, part)
        value = None if obj is None else getattr(obj, field)
        if not value:
            continue
        new = _absolute(value) if isinstance(value, str) else tuple(_absolute(str(v)) for v in value)
        if new != value:
            changed.setdefault(part, {})[field] = new
            lines.append(f"{name} = {new!r}")
    if not changed:
        return cfg
    parts = {part: dataclasses.replace(getattr(cfg, part), **fields) for part, fields in changed.items()}
    bindings = cfg.bindings and cfg.bindings.rstrip("\n") + "\n\n# Absolute paths (jobs/run_data.py)\n" + \
        "\n".join(lines) + "\n"
    return dataclasses.replace(cfg, **parts, bindings=bindings)


def data_record(cfg: JobConfigs, pending: Mapping[str, bytes] | None = None) -> list[dict[str, Any]]:
    """Each data file of the run: field, path, bytes, lines and sha256; `pending`: files about to be
    written (path -> content), fingerprinted from that content."""
    record, pending = [], pending or {}
    for part, field, name in DATA_FIELDS:
        obj = getattr(cfg, part)
        for path in (getattr(obj, field) if obj is not None else ()) or ():
            content = pending.get(path)
            record.append({"field": name, "path": path, **(_fingerprint_bytes(content) if content is not None
                                                           else _fingerprint_path(path))})
    return record


def _fingerprint_bytes(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "lines": data.count(b"\n"), "sha256": hashlib.sha256(data).hexdigest()}


def _fingerprint_path(path: str) -> dict[str, Any]:
    """A file's, or (a `datasets` directory) its files' together, read in 1 MiB chunks."""
    root = paths.as_path(path)
    if not root.exists():
        return {"missing": True}
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    digest, size, lines = hashlib.sha256(), 0, 0
    for file in files:
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
                lines += chunk.count(b"\n")
    return {"bytes": size, "lines": lines, "sha256": digest.hexdigest()}


def write_data_record(cfg: JobConfigs, run_dir: paths.PathLike) -> None:
    paths.write_whole(paths.as_path(run_dir) / RECORD_FILE, json.dumps(data_record(cfg), indent=2) + "\n")


def check_same_data(cfg: JobConfigs, run_dir: paths.PathLike, pending: Mapping[str, bytes] | None = None) -> None:
    """A resume: raises InputError naming the first data file that differs from the one the run
    trained on (RUN/data_files.json); the data position in the checkpoint counts rows of those."""
    file = paths.as_path(run_dir) / RECORD_FILE
    if not file.is_file():  # a run of an earlier version: nothing to compare
        logger.warning("%s not found: the resumed run's data is not compared with what it trained on", file)
        return
    try:
        old = json.loads(file.read_text())
    except ValueError as e:
        raise InputError(f"--resume: {file} is not JSON ({e})") from None
    new = data_record(cfg, pending)
    for field in dict.fromkeys(entry["field"] for entry in old + new):
        was = [e for e in old if e["field"] == field]
        now = [e for e in new if e["field"] == field]
        if [e.get("sha256") for e in was] != [e.get("sha256") for e in now]:
            raise InputError(f"--resume: {field} is not the data the run trained on ({_describe(was)}; now "
                             f"{_describe(now)}): restore it, or start a new run")


def _describe(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "no files"
    return ", ".join(f"{e['path']}: " + ("missing" if e.get("missing") else
                                         f"{e['lines']} lines, sha256 {e['sha256'][:12]}") for e in entries)


def write_inputs(inputs: Mapping[str, bytes]) -> None:
    """Rows given as Python data (path -> JSONL bytes), written whole by process 0 (every process
    holds the same rows); all processes wait until they are there."""
    if jax.process_index() == 0:
        for target, content in inputs.items():
            path = paths.as_path(target)
            path.parent.mkdir(parents=True, exist_ok=True)
            paths.write_whole(path, content)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("areal_jax.jobs.run_data.inputs")
