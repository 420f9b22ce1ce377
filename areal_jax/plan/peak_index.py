"""An index of compiled peaks by config, beside the plan cache: which cache entry holds each
program of a config, so `simulate --tune` reads a point's compiled peaks without lowering its
programs again (lowering a large model's program takes a minute on a small host, and the plan
cache is keyed by the lowered text).

An index file is keyed by the job's configs (the checkpoint config aside: it changes no program),
the plan config, the target, the model's shapes and a digest of this package's source and the jax
version: a change to any of them that could change a lowered program starts a new index. Each
entry names the plan cache file and the bytes that stay resident beside the program; an entry
whose cache file is gone counts as missing. `plan` writes the entries of the programs it compiles;
the tune's lookup writes those it lowers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
from typing import Any

import jax

from areal_jax.plan.measure import Measured, cache_dir


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the package's Python source and the jax version."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256(jax.__version__.encode())
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def index_key(job, plan_cfg, target_name: str, model_cfg) -> str:
    fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(job) if f.name != "checkpoint"}
    text = repr((sorted(fields.items()), plan_cfg, target_name, model_cfg, code_digest()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _path(key: str) -> pathlib.Path:
    return cache_dir() / "index" / f"{key}.json"


def read(key: str) -> tuple[dict[str, tuple[Measured, int]], set[str]]:
    """({program name: (its cached Measured, resident bytes beside it)}, the names indexed whose
    plan cache file is not there: lowered before, never compiled, so no lowering finds them)."""
    try:
        entries = json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return {}, set()
    found, uncompiled = {}, set()
    for name, entry in entries.items():
        try:
            file = cache_dir() / entry["file"]
            resident = int(entry["resident"])
        except (KeyError, TypeError, ValueError):
            continue
        try:
            m = Measured(**json.loads(file.read_text()))
        except OSError:
            uncompiled.add(name)
            continue
        except (ValueError, TypeError):
            continue
        found[name] = (dataclasses.replace(m, cached=True), resident)
    return found, uncompiled


def add(key: str, entries: dict[str, dict[str, Any]]) -> None:
    """Merges {program name: {"file": plan cache file name, "resident": bytes}} into the index;
    a read-only cache only costs the next lookup its lowering."""
    if not entries:
        return
    path = _path(key)
    try:
        current = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        current = {}
    current.update(entries)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(current, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass
