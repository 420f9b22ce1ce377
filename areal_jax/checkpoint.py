"""Training checkpoints with exact resume (Orbax), plus atomic HF exports.

One checkpoint step is a directory `<directory>/<step>/` holding three items:

- `state`: a pytree of jax arrays (params, optimizer state, ...) written by Orbax's
  StandardSave; it restores onto any mesh/sharding given by the restore template.
- `meta`: a JSON dict (policy version, staleness counters, RNG state, config hash, ...).
- `data`: the data iterator's position, one JSON file per process (grain's handler), so a
  resumed run sees exactly the prompts it would have seen next.

Orbax writes each step under `<step>.orbax-checkpoint-tmp-<ts>/` and renames it to `<step>/`
only once every item is complete, so a crash mid-save leaves no directory that looks finished;
`latest_step` additionally requires Orbax's finalize marker. Saves are asynchronous: device
arrays are copied to host before `save` returns, the disk write continues in the background.

Multi-host: every process calls `save`/`restore`/`export_hf` in the same order (they run
collectives); each process stores its own data-iterator position.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from typing import Any, Protocol

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from areal_jax import paths
from areal_jax.models import ModelConfig
from areal_jax.models.hf_io import save_params
from areal_jax.parallel import agree_max

logger = logging.getLogger(__name__)

# Orbax writes this file into a step directory as part of finalizing it (before the rename).
_FINALIZED_MARKER = "_CHECKPOINT_METADATA"
# On an object store Orbax writes a step in place (no rename) and this file last.
_COMMITTED_MARKER = "commit_success.txt"
_STATE, _META, _DATA = "state", "meta", "data"


class StatefulIterator(Protocol):
    """Anything whose position can be read and set: grain DatasetIterator, PromptLoader, ..."""

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and when to checkpoint.

    A step is saved when `step % save_interval_steps == 0` or when `save_interval_s` seconds
    have passed since the last save (either trigger suffices; both None: only forced saves).
    `max_to_keep` newest steps are kept (None: all). HF exports go to `export_dir/step_N`
    every `export_hf_interval_steps` steps.

    `save_on_signal_s`: on SIGTERM or SIGINT during RL (a preemption notice), the run finishes or
    abandons its current step, waits for a save in flight, checkpoints the last completed step and
    exits (143 / 130) within this many seconds; past it, it exits without that checkpoint (the
    previous one stays). None: the signal stops the run at once, as before RL.
    """

    directory: str | os.PathLike
    save_interval_steps: int | None = None
    save_interval_s: float | None = None
    max_to_keep: int | None = 3
    async_save: bool = True
    export_hf_interval_steps: int | None = None
    export_dir: str | os.PathLike | None = None
    save_on_signal_s: float | None = 60.0

    def __post_init__(self):
        if not str(self.directory):
            raise ValueError("CheckpointConfig.directory must be a non-empty path")
        for name in ("save_interval_steps", "max_to_keep", "export_hf_interval_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"CheckpointConfig.{name} must be None or a positive int, got {value!r}")
        if self.save_interval_s is not None and not (
                isinstance(self.save_interval_s, (int, float)) and self.save_interval_s > 0):
            raise ValueError(f"CheckpointConfig.save_interval_s must be None or > 0, got {self.save_interval_s!r}")
        if self.save_on_signal_s is not None and not (
                isinstance(self.save_on_signal_s, (int, float)) and not isinstance(self.save_on_signal_s, bool)
                and math.isfinite(self.save_on_signal_s) and self.save_on_signal_s > 0):
            raise ValueError(f"CheckpointConfig.save_on_signal_s must be None or a positive finite number of seconds, "
                             f"got {self.save_on_signal_s!r}")
        if self.export_hf_interval_steps is not None and self.export_dir is None:
            raise ValueError("CheckpointConfig.export_dir is required when export_hf_interval_steps is set")
        if self.export_dir is not None and not str(self.export_dir):
            raise ValueError("CheckpointConfig.export_dir must be a non-empty path or None")
        paths.check_reachable(self.directory, "CheckpointConfig.directory")
        if self.export_dir is not None:
            paths.check_reachable(self.export_dir, "CheckpointConfig.export_dir")


class _IteratorSnapshot:
    """Frozen iterator position in the shape grain's Orbax handler stores (bytes per process).

    Taken when `save` is called, so the stored position is the one at that call even though
    the training loop keeps consuming the iterator while the write runs.
    """

    def __init__(self, state: Any):
        if isinstance(state, bytes):
            envelope = {"format": "bytes", "state": base64.b64encode(state).decode("ascii")}
        else:
            envelope = {"format": "json", "state": state}
        try:
            self._blob = json.dumps(envelope).encode()
        except (TypeError, ValueError) as err:
            raise TypeError(f"data_iterator.get_state() must return JSON-able data or bytes: {err}") from err

    def get_state(self) -> bytes:
        return self._blob


class _IteratorRestorer:
    """Restore target for grain's handler: decodes the stored position into `iterator`."""

    def __init__(self, iterator: StatefulIterator):
        self._iterator = iterator

    def set_state(self, blob: bytes) -> None:
        envelope = json.loads(blob)
        state = envelope["state"]
        if envelope["format"] == "bytes":
            state = base64.b64decode(state)
        self._iterator.set_state(state)

    def start_prefetch(self) -> None:
        # grain's handler calls this after set_state; forward it to iterators that prefetch.
        start = getattr(self._iterator, "start_prefetch", None)
        if callable(start):
            start()


def _json_checked(meta: dict) -> dict:
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    try:
        # allow_nan=False: NaN is not JSON and would not read back on every parser.
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise TypeError(f"meta must be JSON-serializable (lists of ints for RNG state): {err}") from err


def finalized_steps(directory: str | os.PathLike) -> list[int]:
    """Finalized steps under `directory` (local or remote), ascending; reads only names (creates nothing)."""
    directory = paths.as_path(directory)
    if not directory.is_dir():
        return []
    # Unfinished saves live under `<step>.orbax-checkpoint-tmp-<ts>`: not all digits.
    return sorted(int(e.name) for e in directory.iterdir() if e.name.isdigit() and _is_finished(e))


def _is_finished(step_dir: paths.Path) -> bool:
    """Whether a step directory holds a finished save: remote ones are written in place, so there
    the commit file Orbax writes last must be present as well."""
    return (step_dir / _FINALIZED_MARKER).is_file() and (
        not paths.is_remote(step_dir) or (step_dir / _COMMITTED_MARKER).is_file())


def clear_checkpoints(directory: str | os.PathLike) -> None:
    """Removes every step under `directory` (finished or not) and the directory if it is then
    empty; other files are left alone. For a run that starts over (`--overwrite`)."""
    directory = paths.as_path(directory)
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.is_dir() and entry.name.split(".", 1)[0].isdigit():
            entry.rmtree()
    # An object store has no empty directories: the last object removed, it is gone.
    if directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()


class SavedParams:
    """The weights of one finished step (its `state` item's "params"), read as host arrays one
    tensor at a time and without the optimizer state: what an export needs, on any machine."""

    def __init__(self, directory: str | os.PathLike, step: int):
        step_dir = paths.absolute(directory) / str(step)
        if not _is_finished(step_dir):
            raise FileNotFoundError(f"checkpoint step {step} not found (or unfinished) under {directory}")
        self._state = step_dir / _STATE
        self._reader = ocp.PyTreeCheckpointer()
        tree = self._reader.metadata(self._state).item_metadata.tree
        if "params" not in tree:
            raise ValueError(f"{self._state} holds no params (keys: {sorted(tree)})")
        flat = jax.tree_util.tree_flatten_with_path(tree["params"])[0]
        # (key, ...) -> (shape, dtype) of every saved weight.
        self.shapes = {tuple(k.key for k in path): (tuple(m.shape), m.dtype) for path, m in flat}

    def read(self, leaf: tuple[str, ...]) -> np.ndarray:
        """The weight at `leaf` (e.g. ("layers", "wq")) as a NumPy array (no device involved)."""
        if leaf not in self.shapes:
            raise KeyError(f"{self._state} holds no weight {'/'.join(leaf)}")
        item: Any = 0
        restore_args: Any = ocp.RestoreArgs(restore_type=np.ndarray)
        for key in reversed(("params",) + leaf):
            item, restore_args = {key: item}, {key: restore_args}
        restored = self._reader.restore(self._state, args=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True))
        for key in ("params",) + leaf:
            restored = restored[key]
        return np.asarray(restored)


class Checkpointer:
    """Saves and restores training state, metadata and data position; exports HF weights."""

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self.directory = paths.absolute(config.directory)  # gs://... as is
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.max_to_keep,
            enable_async_checkpointing=config.async_save,
            # Leftover `<step>.orbax-checkpoint-tmp-*` dirs of a crashed run are removed here.
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._last_save_time = time.monotonic()

    # ---- saving -----------------------------------------------------------------------------

    def should_save(self, step: int, now: float | None = None) -> bool:
        """Whether `step` is due by the step interval or by time since the last save.

        `now` is a `time.monotonic()` reading (default: the current one). A step that is
        already on disk is never due again. With several processes and `save_interval_s`
        set, this is a collective (processes agree on the time trigger): call it everywhere.
        """
        latest = self.latest_step()
        if latest is not None and step <= latest:
            return False
        cfg = self.config
        if cfg.save_interval_steps is not None and step % cfg.save_interval_steps == 0:
            return True
        if cfg.save_interval_s is None:
            return False
        now = time.monotonic() if now is None else now
        due = now - self._last_save_time >= cfg.save_interval_s
        # Clocks differ across hosts, and a save is collective: all must decide alike.
        return bool(agree_max(int(due))) if jax.process_count() > 1 else due

    def save(self, step: int, *, state: Any, meta: dict | None = None,
             data_iterator: StatefulIterator | None = None, force: bool = False) -> bool:
        """Starts saving `state` (pytree of jax arrays), `meta` and the iterator position at `step`.

        Returns False (nothing written) when the step is not due and not `force`d, or when it
        is already saved. Returns after device-to-host copies; `wait()` blocks until on disk.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not force and not self.should_save(step):
            return False
        if step in self._manager.all_steps():
            logger.info("checkpoint step %d already exists; not saving it again", step)
            return False
        items: dict[str, Any] = {
            _STATE: ocp.args.StandardSave(state),
            _META: ocp.args.JsonSave(_json_checked(meta or {})),
        }
        if data_iterator is not None:
            items[_DATA] = grain.checkpoint.CheckpointSave(_IteratorSnapshot(data_iterator.get_state()))
        # force=True: the decision above is ours; Orbax's own interval policy must not veto it.
        with self._unfinished_removed_on_error():  # it raises, too, what a previous background save met
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._last_save_time = time.monotonic()
        return True

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        with self._unfinished_removed_on_error():
            self._manager.wait_until_finished()

    @contextlib.contextmanager
    def _unfinished_removed_on_error(self) -> Iterator[None]:
        """A save that failed (a full or read-only disk) leaves no `<step>.orbax-checkpoint-tmp-*`
        behind: removed, as far as the disk lets, before the error goes on (process 0 removes)."""
        try:
            yield
        except Exception:
            if jax.process_index() == 0:
                for entry in (self.directory.iterdir() if self.directory.is_dir() else ()):
                    if ".orbax-checkpoint-tmp" in entry.name:
                        with contextlib.suppress(OSError):
                            entry.rmtree()
            raise

    # ---- restoring --------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Finalized steps on disk, ascending (in-flight and crashed saves excluded)."""
        return finalized_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest finalized step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None = None, *, state_template: Any = None,
                data_iterator: StatefulIterator | None = None) -> tuple[Any, dict]:
        """Reads `(state, meta)` of `step` (default: latest) and moves `data_iterator` to its position.

        `state_template` is a pytree like the saved state of `jax.ShapeDtypeStruct`s carrying
        the target shardings (or concrete arrays, whose shardings are used); the mesh may
        differ from the one saved from. None restores with the saved shardings (same topology only).
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no finalized checkpoint under {self.directory}")
        step_dir = self.directory / str(step)
        if not _is_finished(step_dir):
            raise FileNotFoundError(f"checkpoint step {step} not found (or unfinished) under {self.directory}")
        items: dict[str, Any] = {
            _STATE: ocp.args.StandardRestore(state_template),
            _META: ocp.args.JsonRestore(),
        }
        if data_iterator is not None:
            if not (step_dir / _DATA).is_dir():
                raise ValueError(f"checkpoint step {step} holds no data-iterator state, but data_iterator was given")
            items[_DATA] = grain.checkpoint.CheckpointRestore(_IteratorRestorer(data_iterator))
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return restored[_STATE], dict(restored[_META])

    def read_meta(self, step: int | None = None) -> dict:
        """Only the metadata of `step` (default: latest): cheap, no arrays are read."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no finalized checkpoint under {self.directory}")
        restored = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
        return dict(restored[_META])

    # ---- HF export --------------------------------------------------------------------------

    def should_export_hf(self, step: int) -> bool:
        """Whether `step` is due for an HF export by `export_hf_interval_steps`."""
        interval = self.config.export_hf_interval_steps
        return interval is not None and step % interval == 0

    def export_hf(self, params: Any, model_cfg: ModelConfig, step: int, *, force: bool = False
                  ) -> paths.Path | None:
        """Writes `params` as an HF directory `export_dir/step_<step>` when due (or `force`d).

        Locally the directory appears complete or not at all (`paths.staged_dir`); an existing
        export of the same step is replaced. Call on every process: one tensor at a time is
        gathered (`hf_io.save_params`), process 0 writes. Returns the path, or None if not due.
        """
        if self.config.export_dir is None:
            raise ValueError("CheckpointConfig.export_dir is not set")
        if not force and not self.should_export_hf(step):
            return None
        target = paths.absolute(self.config.export_dir) / f"step_{step}"
        if jax.process_index() != 0:
            save_params(params, model_cfg, target, write=False)  # the gathers process 0's writer runs
            return target
        with paths.staged_dir(target) as out:
            save_params(params, model_cfg, out)
        return target

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's resources."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
