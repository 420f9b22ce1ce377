"""Whether a finished checkpoint step can be restored, checked without reading its arrays, and the
newest intact step a resume falls back to (a bad newer one set aside).

A step is finished when Orbax's marker is there (`checkpoint.finalized_steps`), but a disk fault or a
hand edit can still break it afterwards: a missing `meta/` or `state/_METADATA`, or a truncated data
file. The check reads what is small: the step's JSON files and the OCDBT b-tree of `state/` (its
manifest and nodes, the index of every array chunk), then compares each data file's size with the
furthest byte the index references in it. Chunk contents are not read (a resume reads them anyway);
a bit flip inside a chunk is not caught here.
"""

from __future__ import annotations

import json
import logging
import os
import time

from areal_jax import paths
from areal_jax.checkpoint import finalized_steps

logger = logging.getLogger(__name__)

_REQUIRED_JSON = ("_CHECKPOINT_METADATA", "state/_METADATA", "meta/metadata")


class NoIntactCheckpoint(RuntimeError):
    """Every finished step under the directory failed the check."""


def step_problem(directory: paths.PathLike, step: int) -> str | None:
    """What is wrong with finished step `step` under `directory` (one line), or None if it looks whole."""
    step_dir = paths.absolute(directory) / str(step)
    for name in _REQUIRED_JSON:
        path = step_dir / name
        try:
            json.loads(path.read_text())
        except FileNotFoundError:
            return f"{name} is missing"
        except (OSError, ValueError) as e:
            return f"{name} is unreadable ({' '.join(str(e).split())[:200]})"
    try:
        return _ocdbt_problem(step_dir / "state")
    except Exception as e:  # tensorstore's errors: the manifest or a b-tree node cut short, ...
        return f"state/ index unreadable ({' '.join(str(e).split())[:200]})"


def _ocdbt_problem(state: paths.Path) -> str | None:
    """Walks the OCDBT b-tree under `state` (Orbax's default layout, the one Checkpointer writes)
    and checks that every data file holds the bytes it references."""
    import tensorstore as ts

    if not (state / "manifest.ocdbt").exists():
        return "state/manifest.ocdbt is missing"
    base = ts.KvStore.open(_kvstore_url(state)).result()
    manifest = ts.ocdbt.dump(base).result()
    if not manifest.get("versions"):
        return "state/manifest.ocdbt lists no version"
    needed: dict[str, int] = {}  # data file (relative to state/) -> bytes it must hold
    pending = [manifest["versions"][-1]["root"]["location"]]
    while pending:
        location = pending.pop()
        _need(needed, location)
        node = ts.ocdbt.dump(base, location).result()
        for entry in node.get("entries", ()):
            for value in entry.values():
                if isinstance(value, str) and value.startswith("btreenode:"):
                    pending.append(value)
                elif isinstance(value, str) and value.startswith("value:"):
                    _need(needed, value)
    for name, size in sorted(needed.items()):
        path = state / name
        if not path.exists():
            return f"state/{name} is missing"
        have = path.stat().length
        if have < size:
            return f"state/{name} is truncated ({have} of {size} bytes)"
    return None


def _need(needed: dict[str, int], location: str) -> None:
    # "<kind>:<prefix>:<file>:<offset>:<length>", e.g. "value:ocdbt.process_0/:d/3f2a...:0:268713".
    parts = location.split(":")
    if len(parts) < 5:
        return
    name = parts[1] + ":".join(parts[2:-2])
    needed[name] = max(needed.get(name, 0), int(parts[-2]) + int(parts[-1]))


def _kvstore_url(path: paths.Path) -> str:
    text = os.fspath(path)
    return (text if paths.is_remote(text) else "file://" + text).rstrip("/") + "/"


def intact_resume_step(directory: paths.PathLike) -> int:
    """The newest finished step that passes `step_problem`; each newer step that fails is set aside
    (renamed `<step>.corrupt-<time>` locally, deleted on an object store) with one warning line
    naming what was wrong. No intact step: NoIntactCheckpoint, and nothing is moved."""
    directory = paths.absolute(directory)
    steps = finalized_steps(directory)
    bad: list[tuple[int, str]] = []
    for step in reversed(steps):
        problem = step_problem(directory, step)
        if problem is None:
            for broken, why in bad:
                _set_aside(directory, broken, why, step)
            return step
        bad.append((step, problem))
    raise NoIntactCheckpoint("no intact checkpoint under " + f"{directory}: " + "; ".join(
        f"step {s}: {why}" for s, why in bad))


def _set_aside(directory: paths.Path, step: int, why: str, fallback: int) -> None:
    step_dir = directory / str(step)
    if paths.is_remote(directory):  # no directory rename on an object store
        paths.remove(step_dir)
        where = "deleted"
    else:
        target = directory / f"{step}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
        step_dir.rename(target)
        where = f"moved to {target}"
    logger.warning("checkpoint step %d under %s is unreadable: %s; %s; resuming from step %d",
                   step, directory, why, where, fallback)
