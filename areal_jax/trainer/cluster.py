"""The cluster of an RL run: the meshes, the trainer and engine on them, the weight path between them,
and the rollout side; built together, started and shut down together.

`RLCluster` holds an `api.TrainEngine` (the train mesh), an `api.InferenceEngine` (this host's
generation mesh), `to_engine` (the trainer's weights -> what the engine serves: a `WeightSync`
transfer for the native pair) and the rollout side that feeds the trainer: the staleness manager
(admission), the channel (finished groups, oldest first) and the controller (its thread runs the
workflow per prompt row, `connect` builds it). `version` is the policy version: the trainer's
updates so far, which the rollout side admits against. `RLCluster.build` makes the native one from
configs; any other pair of engines plugs in through the constructor (tests/test_api_seams.py runs
the loop on one).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from areal_jax import api
from areal_jax.generation.config import EngineConfig
from areal_jax.models.config import ModelConfig
from areal_jax.models.lora import LoRAConfig
from areal_jax.models.transformer import Params
from areal_jax.parallel.adapter_sync import AdapterSync
from areal_jax.parallel.delta_sync import DeltaSync
from areal_jax.parallel.meshes import MeshConfig, Meshes, batch_shards, build_meshes, check_model_fits_mesh
from areal_jax.parallel.weight_sync import WeightSync
from areal_jax.rollout.channel import TrajectoryChannel
from areal_jax.rollout.controller import RolloutController, ShutdownReport
from areal_jax.rollout.staleness import StalenessManager
from areal_jax.trainer.config import (OptimizerConfig, PPOConfig, RLConfig, TrainEngineConfig, weight_dtype_conflict,
                                      weight_swap_conflict)

__all__ = ["RLCluster", "generation_weight_sync"]


def generation_weight_sync(model_cfg: ModelConfig, meshes: Meshes, rl: RLConfig, lora: LoRAConfig | None = None,
                           weight_dtype: str | None = None, *, stacked: bool = False
                           ) -> WeightSync | DeltaSync | AdapterSync:
    """The train -> generation transfer of a run: the generation dtype and group size of `rl`,
    weights delivered per layer, or `stacked` (EngineConfig.serves_stacked: the layout the engine
    holds, so it installs them as they land), quantized on the way with `weight_dtype`
    (EngineConfig.weight_dtype). With LoRA, an `AdapterSync`: the base once, then only the
    adapters, merged on the generation devices (per layer; a stacking engine stacks them once
    per push). A delta transfer also stays per layer."""
    conflict = weight_dtype_conflict(weight_dtype, rl, lora.rank if lora is not None else 0)
    if conflict:
        raise ValueError(conflict)
    if lora is not None and lora.enabled:
        return AdapterSync(model_cfg, lora, meshes, rl.generation_dtype, group_bytes=rl.transfer_group_bytes)
    layout = "stacked" if stacked and rl.transfer_mode != "delta" else "split"
    sync = WeightSync.for_model(model_cfg, meshes, rl.generation_dtype, group_bytes=rl.transfer_group_bytes,
                                weight_dtype=weight_dtype, layout=layout)
    return DeltaSync(sync) if rl.transfer_mode == "delta" else sync


class RLCluster:
    """The parts of a run and their lifetimes (see the module docstring).

    `rl` sizes the rollout side: each process admits its share of `rl.batch_size` groups per step
    (`local_batch`), at most `rl.max_concurrent` in flight, `rl.max_staleness` versions ahead.
    `meshes` and `weight_sync` are the native pair's (None for another pair)."""

    def __init__(self, trainer: api.TrainEngine, engine: api.InferenceEngine, to_engine: Callable[[Any], Any], *,
                 rl: RLConfig, meshes: Meshes | None = None, weight_sync: WeightSync | AdapterSync | None = None,
                 rows_per_process: int = 1, evict_before_push: bool = False, evict_for_update: bool = False):
        local_batch = rl.batch_size // jax.process_count()
        if local_batch * jax.process_count() != rl.batch_size:
            raise ValueError(f"RLConfig.batch_size {rl.batch_size} must divide over {jax.process_count()} processes")
        self.trainer, self.engine, self.to_engine = trainer, engine, to_engine
        self.version = engine.version  # the trainer starts at the weights the engine serves
        self.meshes, self.weight_sync = meshes, weight_sync
        self.local_batch = local_batch
        self.rows_per_process = rows_per_process
        # EngineConfig.weight_swap "evict": the engine drops its weights before each push lands.
        self.evict_before_push = evict_before_push
        # ... and, colocated, before each update: the trainer's programs then run on devices that
        # hold no served weights (the weights the engine served are stale once the update ends).
        self.evict_for_update = evict_for_update
        self.staleness = StalenessManager(rl.max_staleness, local_batch, rl.max_concurrent)
        self.channel = TrajectoryChannel(rl.channel_capacity or 4 * local_batch)
        self.max_group_age = rl.max_group_age
        self.controller: RolloutController | None = None
        self.data: Iterator[Any] | None = None  # the rows the controller reads (after `connect`)
        self.reward_pool: Any = None

    @classmethod
    def build(cls, model_cfg: ModelConfig, params: Params, *, rl: RLConfig, ppo: PPOConfig,
              optimizer: OptimizerConfig, engine: EngineConfig, train_engine: TrainEngineConfig | None = None,
              mesh: MeshConfig = MeshConfig(),
              devices: Sequence[jax.Device] | None = None, start_version: int = 0, donate_params: bool = False,
              weight_sync: WeightSync | AdapterSync | None = None, lora: LoRAConfig = LoRAConfig()) -> RLCluster:
        """The native cluster: meshes from `mesh` over `devices`, a JaxTrainEngine of `ppo`'s objective
        (run as `train_engine` says) on the train mesh (its own fp32 copy of `params`; with `donate_params` the given buffers are then deleted),
        a GenerationEngine on this host's generation mesh serving the trainer's weights through a
        WeightSync (`weight_sync`: one of the same meshes to reuse, its programs compiled). `lora`:
        the trainer trains adapters on a frozen base (models/lora.py) and each swap moves only the
        adapters (an AdapterSync)."""
        from areal_jax.generation.engine import GenerationEngine
        from areal_jax.trainer.algorithm import ppo_trainer

        check_model_fits_mesh(model_cfg, mesh)
        conflict = (weight_swap_conflict(engine.weight_swap, rl, lora.rank)
                    or weight_dtype_conflict(engine.weight_dtype, rl, lora.rank))
        if conflict:
            raise ValueError(conflict)
        meshes = build_meshes(mesh, devices)
        trainer = ppo_trainer(model_cfg, params, optimizer, ppo, engine=train_engine, mesh=meshes.train, lora=lora)
        if donate_params:
            _delete_unless_held(params, trainer.params)
        del params  # the trainer holds its own copy: nothing below may keep the initial one alive
        if weight_sync is not None and (weight_sync.meshes.train, weight_sync.meshes.generation) != (
                meshes.train, meshes.generation):
            raise ValueError("weight_sync was built for other meshes than this loop's")
        if weight_sync is not None and isinstance(weight_sync, AdapterSync) != lora.enabled:
            raise ValueError("weight_sync must be an AdapterSync exactly when LoRAConfig.rank > 0")
        if weight_sync is not None and getattr(weight_sync, "weight_dtype", None) != engine.weight_dtype:
            raise ValueError(f"weight_sync quantizes to {getattr(weight_sync, 'weight_dtype', None)!r} but "
                             f"EngineConfig.weight_dtype is {engine.weight_dtype!r}")
        sync = weight_sync or generation_weight_sync(
            model_cfg, meshes, rl, lora, engine.weight_dtype,
            stacked=engine.serves_stacked(meshes.generation.devices.flat[0].platform))
        served = GenerationEngine((model_cfg, sync.transfer(trainer.params)), engine, version=start_version)
        # Micro-batch rows split over "fsdp" x "expert": each process contributes a multiple of its share.
        rows = max(batch_shards(meshes.train) // jax.process_count(), 1)
        evict = engine.weight_swap == "evict"
        return cls(trainer, served, sync.transfer, rl=rl, meshes=meshes, weight_sync=sync, rows_per_process=rows,
                   evict_before_push=evict, evict_for_update=evict and meshes.split.colocated)

    def connect(self, workflow: api.RolloutWorkflow, data_iter: Iterator[Any], *, tokenizer: Any = None,
                reward_pool: Any = None) -> Iterator[Any]:
        """Builds the rollout side: the controller runs `workflow` over `data_iter`'s rows, scoring
        in `reward_pool`, admitting against `version`. Returns the iterator it reads (`data`: a
        checkpointable one is wrapped so that a position snapshot never lands halfway through a
        read); call before `start`."""
        # The controller thread reads rows while the trainer thread snapshots the position for a
        # checkpoint: a lock keeps a snapshot from landing halfway through a read.
        self.data = _LockedIterator(data_iter) if isinstance(data_iter, api.CheckpointableIterator) else data_iter
        self.reward_pool = reward_pool
        self.controller = RolloutController(self.engine, workflow, self.staleness, self.channel, self.data,
                                            version_fn=lambda: self.version, tokenizer=tokenizer,
                                            reward_pool=reward_pool, max_group_age=self.max_group_age)
        return self.data

    def begin_update(self) -> None:
        """Called before each training step. With `evict_for_update` (colocated, weight_swap
        "evict") the engine first drops its weights at its next chunk boundary: generation pauses
        until the push, and the update's programs have the memory the served copy held. In-flight
        samples keep their slots; at the push they are re-prefilled (or kept) as after any swap."""
        if self.evict_for_update:
            self.engine.release_weights().result()

    def push_weights(self, version: int) -> concurrent.futures.Future:
        """The trainer's current weights to the engine as `version`; resolves once they serve.

        With `evict_before_push` the engine first drops its weights (at its next chunk boundary)
        and the transfer waits for that, so the generation devices never hold two copies."""
        if self.evict_before_push:
            self.engine.release_weights().result()
        return self.engine.update_weights(self.to_engine(self.trainer.params), version)

    def resume_at(self, version: int, staleness_state: dict[str, Any]) -> int:
        """The cluster at a restored `version` (the trainer's state restored): the staleness
        counters as saved, the generator on the trainer's weights. Returns the groups lost (queued
        or generating at the save)."""
        self.version = version
        lost = self.staleness.resume_at(version, staleness_state)
        self.push_weights(version)
        return lost

    def take_batch(self, timeout_s: float, *, give_up: Callable[[], bool]
                   ) -> tuple[list[api.TrajectoryGroup], float] | None:
        """This process's `local_batch` oldest finished groups, in a fixed order, and the seconds
        waited; None once `give_up()` (polled each second while waiting). A fatal rollout error raises here."""
        t0 = time.perf_counter()
        while True:
            self.controller.check()  # a fatal rollout error surfaces here instead of a hang
            try:
                batch = self.channel.get_batch(self.local_batch, timeout=1.0)
            except TimeoutError:
                if give_up():
                    return None
                if time.perf_counter() > t0 + timeout_s:
                    raise TimeoutError(f"no batch of {self.local_batch} groups within {timeout_s} s; "
                                       f"rollout stats: {self.controller.stats()}") from None
                continue
            # A fixed order (groups arrive in completion order) keeps the step's arithmetic
            # independent of thread timing.
            batch.sort(key=lambda g: (g.admitted_version, g.query_id))
            return batch, time.perf_counter() - t0

    def start(self) -> None:
        self.engine.start()
        self.controller.start()

    def shutdown(self, timeout: float = 30.0) -> ShutdownReport:
        """Stops the rollout side, then the engine; where every admitted group ended."""
        try:
            return self.controller.shutdown(timeout=timeout)
        finally:
            self.engine.stop()

    def close(self) -> None:
        """Drops the engine (KV cache, served weights), the rollout side and the trainer (optimizer
        state), freeing both sides' devices."""
        self.controller = self.engine = self.trainer = self.data = None


class _LockedIterator:
    """A checkpointable iterator whose reads and position snapshots exclude each other."""

    def __init__(self, inner: Any):
        self._inner, self._lock = inner, threading.Lock()

    def __iter__(self) -> _LockedIterator:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return next(self._inner)

    def get_state(self) -> Any:
        with self._lock:
            return self._inner.get_state()

    def set_state(self, state: Any) -> None:
        with self._lock:
            self._inner.set_state(state)

    def __getattr__(self, name: str) -> Any:  # e.g. start_prefetch, which a restore calls
        return getattr(self._inner, name)


def _delete_unless_held(given: Params, held: Params) -> None:
    """Frees the buffers of `given` that `held` does not use (the trainer may keep an input as is)."""

    def buffers(x: jax.Array) -> set[tuple[Any, int]]:
        return {(s.device, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}

    kept = set().union(*(buffers(x) for x in jax.tree.leaves(held) if isinstance(x, jax.Array)))
    for x in jax.tree.leaves(given):
        if isinstance(x, jax.Array) and not x.is_deleted() and not buffers(x) & kept:
            x.delete()
