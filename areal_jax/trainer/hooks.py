"""What happens around an RL step, as hooks on it: checkpoints, held-out evaluation, rollout dumps,
the step's record. `RLLoop.add_hook(hook, stage=..., every=N)` runs `hook(info)` after steps
whose index + 1 is a multiple of N, at one of three stages of the step, in the order added:

- "update": the trainer has updated and the version is bumped; the new weights have not reached
  the generator yet (what a checkpoint records of the data position must be taken here: in
  "sync" mode nothing is in flight or queued, so a resume reproduces the run exactly);
- "metrics": the step's metrics are computed; a hook may add to them (evaluation does);
- "record": the metrics are final (the run's records, then the checkpoint write: a checkpoint
  never holds a step its records lack).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import jax

from areal_jax import api
from areal_jax.checkpoint import Checkpointer

if TYPE_CHECKING:
    from areal_jax.trainer.loop import RLLoop

logger = logging.getLogger(__name__)

__all__ = ["STAGES", "CheckpointHook", "StepInfo", "evaluation_hook", "rollout_dump_hook"]

Stage = Literal["update", "metrics", "record"]
STAGES: tuple[Stage, ...] = ("update", "metrics", "record")


@dataclasses.dataclass(frozen=True)
class StepInfo(api.StepInfo):
    """A step as its hooks see it (`api.StepInfo`: step, version, groups, metrics, last), and the loop
    while the built-in hooks still read it (going: hooks are to receive data only, issue 38)."""

    loop: RLLoop | None = None


def evaluation_hook(info: StepInfo) -> None:
    """Held-out accuracy every RLConfig.eval_every steps and after the last ("eval/accuracy")."""
    loop = info.loop
    if loop.has_eval_rows and loop.rl.eval_every and ((info.step + 1) % loop.rl.eval_every == 0 or info.last):
        info.metrics["eval/accuracy"] = loop.evaluate()


def rollout_dump_hook(write: Callable[[int, list[dict[str, Any]]], None]) -> Callable[[StepInfo], None]:
    """A hook handing the step's trajectories, human-readable (`RLLoop.rollout_records`), to `write`."""
    return lambda info: write(info.step, info.loop.rollout_records(info.groups))


class _FrozenPosition:
    """A data position read earlier, handed to the checkpointer in place of the live iterator."""

    def __init__(self, state: Any):
        self._state = state

    def get_state(self) -> Any:
        return self._state


class CheckpointHook:
    """The loop's checkpoints: `point` (stage "update") takes a step's resume point when a save is
    due (or always, when a stop may need it), `save` (stage "record") writes it. `restore` continues
    a loop from the latest checkpoint; `save_on_stop` writes the last completed step's.

    `extra`: more metadata for each checkpoint (the job's summary and history so far).
    `on_export`: called on process 0 with each HF export's directory (the run adds its files).
    """

    def __init__(self, checkpointer: Checkpointer, *, extra: Callable[[], dict[str, Any]] | None = None,
                 on_export: Callable[[Any], None] | None = None, always_point: bool = False):
        self.checkpointer, self.extra, self.on_export = checkpointer, extra, on_export
        self.always_point = always_point
        self.last_point: dict[str, Any] | None = None  # the last completed step's resume point
        self._pending: dict[str, Any] | None = None  # a due checkpoint, saved once the step is recorded
        self._saved_step: int | None = None

    def point(self, info: StepInfo) -> None:
        """The resume point after `info.step`, taken now if a save is due or a stop may need it."""
        loop, ckpt = info.loop, self.checkpointer
        due = info.last or ckpt.should_save(info.step + 1)  # a collective with a time trigger: decided here
        if not (due or self.always_point):
            self.last_point = None
            return
        engine_seed = loop.engine.seed
        meta = {"step": info.step, "version": loop.version, "staleness": loop.staleness.state_dict(),
                "engine_seed": engine_seed, "trained_tokens": loop.trained_tokens}
        data = _FrozenPosition(loop.data_iter.get_state()) if isinstance(loop.data_iter, api.CheckpointableIterator) else None
        self.last_point = {"step": info.step, "meta": meta, "data": data}
        self._pending = self.last_point if due else None

    def save(self, loop: RLLoop) -> None:
        """Writes the checkpoint `point` prepared (the trainer's state has not moved since)."""
        point, self._pending = self._pending, None
        if point is None:
            return
        self._saved_step = point["step"]
        ckpt, step, meta = self.checkpointer, point["step"], point["meta"]
        if self.extra is not None:
            meta["extra"] = self.extra()
        ckpt.save(step + 1, state=loop.trainer.state_dict(), meta=meta, data_iterator=point["data"], force=True)
        if ckpt.should_export_hf(step + 1):
            target = ckpt.export_hf(loop.plain_params(), loop.model_config, step + 1)
            if target is not None and self.on_export is not None and jax.process_index() == 0:
                self.on_export(target)

    def save_on_stop(self, loop: RLLoop) -> None:
        """A stop's checkpoint: the last completed step, unless already saved (or none ran here)."""
        point, self.last_point = self.last_point, None
        if point is None or point["step"] == self._saved_step:
            return
        self._pending = point
        self.save(loop)
        logger.warning("stopped after step %d: checkpoint %d written", point["step"], point["step"] + 1)

    def restore(self, loop: RLLoop) -> dict[str, Any]:
        """Continues `loop` from the latest checkpoint: the trainer's weights and optimizer state,
        the data position; returns the checkpoint's metadata (version, counters, step)."""
        template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                                if isinstance(a, jax.Array) else a, loop.trainer.state_dict())
        state, meta = self.checkpointer.restore(
            state_template=template, data_iterator=loop.data_iter if isinstance(loop.data_iter, api.CheckpointableIterator) else None)
        loop.trainer.load_state_dict(state)
        return meta

    def wait(self) -> None:
        self.checkpointer.wait()
