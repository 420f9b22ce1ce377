"""An RL run's checkpoints as hooks on its steps, and the restore a resumed run starts from.

`CheckpointHook.hooks()` gives three: at "update" the step's resume point (taken when a save is
due, or always when a stop may need it), at "record" its write (after the step's records: a
checkpoint never holds a step its records lack), at "end" a stop's checkpoint of the last completed
step and the wait for any save in flight. `CheckpointHook.restore` puts the trainer, the data
position and the cluster back at the latest checkpoint and says where the loop continues (`Resume`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax

from areal_jax import api
from areal_jax.api import Hook, StepInfo
from areal_jax.checkpoint import Checkpointer
from areal_jax.models.lora import plain_weights
from areal_jax.trainer.cluster import RLCluster

logger = logging.getLogger(__name__)

__all__ = ["CheckpointHook", "Resume"]


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where a restored loop continues: its first step, the version, the tokens trained so far and
    the run's other counters (StepInfo.counters), and what the restore cost (groups queued or
    generating at the save, lost with it)."""

    step: int
    version: int
    trained_tokens: float
    lost_groups: int
    capacity: int  # admission capacity at the restored version
    counters: dict[str, int] = dataclasses.field(default_factory=dict)  # StepInfo.counters at the save

    def report(self) -> dict[str, int]:
        return {"step": self.step, "version": self.version, "lost_groups": self.lost_groups,
                "capacity": self.capacity}


class _FrozenPosition:
    """A data position read earlier, handed to the checkpointer in place of the live iterator."""

    def __init__(self, state: Any):
        self._state = state

    def get_state(self) -> Any:
        return self._state


class CheckpointHook:
    """The checkpoints of a run on `cluster` (see the module docstring). `data`: the iterator the
    rollout side reads (`RLCluster.connect`'s), whose position is saved when it has one.
    `model_config`: for the HF exports CheckpointConfig asks for. `extra`: more metadata for each
    checkpoint (the job's summary and history so far). `on_export`: called on process 0 with each
    HF export's directory (the run adds its files). `always_point`: take a resume point after every
    step (a stop request may need it)."""

    def __init__(self, checkpointer: Checkpointer, cluster: RLCluster, *, data: Any = None, model_config: Any = None,
                 extra: Callable[[], dict[str, Any]] | None = None, on_export: Callable[[Any], None] | None = None,
                 always_point: bool = False):
        self.checkpointer, self.cluster, self.model_config = checkpointer, cluster, model_config
        self.data = data if isinstance(data, api.CheckpointableIterator) else None
        self.extra, self.on_export, self.always_point = extra, on_export, always_point
        self.last_point: dict[str, Any] | None = None  # the last completed step's resume point
        self._pending: dict[str, Any] | None = None  # a due checkpoint, saved once the step is recorded
        self._saved_step: int | None = None

    def hooks(self) -> tuple[Hook, ...]:
        return Hook(self.point, stage="update"), Hook(self.save, stage="record"), Hook(self.end, stage="end")

    def point(self, info: StepInfo) -> None:
        """The resume point after `info.step`, taken now if a save is due or a stop may need it."""
        due = info.last or self.checkpointer.should_save(info.step + 1)  # a collective with a time trigger
        if not (due or self.always_point):
            self.last_point = None
            return
        meta = {"step": info.step, "version": info.version, "staleness": self.cluster.staleness.state_dict(),
                "engine_seed": self.cluster.engine.seed, "trained_tokens": info.trained_tokens,
                "counters": dict(info.counters)}
        data = _FrozenPosition(self.data.get_state()) if self.data is not None else None
        self.last_point = {"step": info.step, "meta": meta, "data": data}
        self._pending = self.last_point if due else None

    def save(self, info: StepInfo | None = None) -> None:
        """Writes the checkpoint `point` prepared (the trainer's state has not moved since)."""
        point, self._pending = self._pending, None
        if point is None:
            return
        self._saved_step = point["step"]
        ckpt, step, meta = self.checkpointer, point["step"], point["meta"]
        if self.extra is not None:
            meta["extra"] = self.extra()
        trainer = self.cluster.trainer
        ckpt.save(step + 1, state=trainer.state_dict(), meta=meta, data_iterator=point["data"], force=True)
        if ckpt.should_export_hf(step + 1):
            target = ckpt.export_hf(plain_weights(trainer.params), self.model_config, step + 1)
            if target is not None and self.on_export is not None and jax.process_index() == 0:
                self.on_export(target)

    def end(self, info: StepInfo) -> None:
        """After a stop, the last completed step's checkpoint (unless already saved or none ran
        here); then the save in flight completes."""
        if info.stopped:
            point, self.last_point = self.last_point, None
            if point is not None and point["step"] != self._saved_step:
                self._pending = point
                self.save()
                logger.warning("stopped after step %d: checkpoint %d written", point["step"], point["step"] + 1)
        self.checkpointer.wait()

    def restore(self) -> Resume:
        """Continues from the latest checkpoint: the trainer's weights and optimizer state, the data
        position, and the cluster at the saved version (staleness counters; the generator serves the
        restored weights)."""
        trainer = self.cluster.trainer
        template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                                if isinstance(a, jax.Array) else a, trainer.state_dict())
        state, meta = self.checkpointer.restore(state_template=template, data_iterator=self.data)
        trainer.load_state_dict(state)
        version = int(meta["version"])
        # Only the trained groups count: those queued or generating at the save died with it.
        lost = self.cluster.resume_at(version, meta["staleness"])
        resume = Resume(step=int(meta["step"]) + 1, version=version,
                        trained_tokens=float(meta.get("trained_tokens", 0.0)), lost_groups=lost,
                        capacity=self.cluster.staleness.capacity(version),
                        counters={str(k): int(v) for k, v in meta.get("counters", {}).items()})
        logger.info("resumed at step %d, version %d: %d groups queued or in flight at the save were lost, "
                    "admission capacity %d", resume.step, version, lost, resume.capacity)
        return resume
