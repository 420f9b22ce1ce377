"""What one simulated run is: the workload (from the job's configs) and the row's choices.

`Workload` holds the fields of the real configs the scheduling depends on, per host as the real
run lays it out (one engine and one controller per host; the trainer takes `batch_groups / hosts`
groups from each host's channel). `RowConfig` is what a row of the output varies: mode, eta and the
generation/training split.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from areal_jax.generation.config import EngineConfig, round_slots

Mode = Literal["async", "sync"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """The job as the scheduler sees it.

    Attributes:
        hosts: processes, each with one engine and one controller.
        devices_per_host: accelerator devices of one host (what a split divides).
        batch_groups: prompt groups per training step, over all hosts (RLConfig.batch_size).
        samples_per_group: RLVRConfig.n_samples.
        max_concurrent: groups in flight per host (RLConfig.max_concurrent) at the config's split.
        channel_capacity: groups a host's channel holds (RLConfig.channel_capacity or 4 x local batch).
        engine: the host's engine at the config's split.
        generation_tensor: devices per generation replica (MeshConfig.generation_tensor).
        train_tensor: MeshConfig.train_tensor (fsdp takes the other training devices).
        config_generation_devices: generation devices per host of the config (its split).
        max_tokens_per_microbatch, num_minibatches, row_buckets: the batching fields (TrainEngineConfig's,
            PPOConfig.num_minibatches).
        max_group_age: RLConfig.max_group_age (None: no per-group age filter).
        max_new_tokens: RLVRConfig.max_new_tokens (the completion cap).
        minibatch_seed: PPOConfig.minibatch_seed (the groups' order before the minibatch split).
        kv_pool_pages: pages of one generation replica's paged KV pool (EngineConfig.pool_pages);
            0: the dense KV cache (num_slots x max_seq_len, every slot read up to the window).
        page_size: tokens per page (EngineConfig.page_size).
        block_tokens: tokens the paged decode kernel reads at a time (kernels/: 128 on GPU, 256 on TPU).
    """

    hosts: int
    devices_per_host: int
    batch_groups: int
    samples_per_group: int
    max_concurrent: int
    channel_capacity: int
    engine: EngineConfig
    generation_tensor: int
    train_tensor: int
    config_generation_devices: int
    max_tokens_per_microbatch: int
    num_minibatches: int
    row_buckets: tuple[int, ...] = ()
    max_group_age: int | None = None
    max_new_tokens: int = 512
    minibatch_seed: int = 0
    kv_pool_pages: int = 0
    page_size: int = 16
    block_tokens: int = 128

    def __post_init__(self):
        for name in ("hosts", "devices_per_host", "batch_groups", "samples_per_group", "max_concurrent",
                     "channel_capacity", "generation_tensor", "train_tensor", "config_generation_devices",
                     "max_tokens_per_microbatch", "num_minibatches", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be an int >= 1, got {value!r}")
        for name in ("kv_pool_pages", "page_size", "block_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "kv_pool_pages" else 1):
                raise ValueError(f"Workload.{name} must be an int >= {0 if name == 'kv_pool_pages' else 1}, got {value!r}")
        if self.batch_groups % self.hosts:
            raise ValueError(f"RLConfig.batch_size {self.batch_groups} must divide over {self.hosts} hosts")
        if self.channel_capacity < self.local_batch:
            raise ValueError(f"channel capacity {self.channel_capacity} is below the per-host batch {self.local_batch}")

    @property
    def local_batch(self) -> int:
        return self.batch_groups // self.hosts

    @property
    def paged(self) -> bool:
        return self.kv_pool_pages > 0

    def generation_replicas(self, generation_devices: int) -> int:
        return max(1, generation_devices // self.generation_tensor)

    def scaled_to(self, generation_devices: int) -> tuple[EngineConfig, int]:
        """The host's engine and max_concurrent when `generation_devices` generate: slots per
        replica stay as configured (a replica's memory is what bounds them), so slots and groups in
        flight scale with the replica count."""
        before = self.generation_replicas(self.config_generation_devices)
        after = self.generation_replicas(generation_devices)
        if after == before:
            return self.engine, self.max_concurrent
        slots = self.engine.num_slots // before * after
        return dataclasses.replace(self.engine, num_slots=slots), max(1, self.max_concurrent * after // before)

    def engine_for(self, row: RowConfig, *, scale: bool) -> tuple[EngineConfig, int]:
        """The host's engine and max_concurrent in `row`. With `scale` (costs from a roofline, not a
        run): `scaled_to` the row's generation devices, and a synchronous row's engine holds no more
        slots than one batch's samples (a sync run would size it so: the dense decode reads every
        slot's cache, used or not)."""
        if not scale:
            return self.engine, self.max_concurrent
        generating = row.generating_devices(self)
        engine, max_concurrent = self.scaled_to(generating)
        if row.mode == "sync":
            data = self.generation_replicas(generating)
            needed = round_slots(self.local_batch * self.samples_per_group, data)
            if needed < engine.num_slots:
                engine = dataclasses.replace(engine, num_slots=needed)
        return engine, max_concurrent


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """One simulated configuration.

    Attributes:
        mode: "async" (generation and training overlap, eta bounds how far generation runs ahead)
            or "sync" (the colocated baseline: every device generates a batch, then every device
            trains; eta 0).
        eta: max staleness (RLConfig.max_staleness); 0 in sync mode.
        generation_devices: generation devices per host in async mode (the split); in sync mode
            every device does both and this is ignored.
        colocated: async on shared devices (both sides use every device, one program at a time):
            the simulation holds the engine while the trainer's programs run (simulate/system.py
            `share_devices`), except on costs fitted to a colocated run, which hold the sharing.
        steps: training steps simulated; warmup_steps of them are left out of the figures.
        seed: lengths are drawn from it (and nothing else is random).
    """

    mode: Mode = "async"
    eta: int = 2
    generation_devices: int = 1
    colocated: bool = False
    steps: int = 20
    warmup_steps: int = 4
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {self.mode!r}")
        for name in ("eta", "warmup_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.mode == "sync" and self.eta != 0:
            raise ValueError(f"sync mode has eta 0, got eta {self.eta}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps <= self.warmup_steps:
            raise ValueError(f"steps ({self.steps!r}) must be an int > warmup_steps ({self.warmup_steps})")
        if isinstance(self.generation_devices, bool) or not isinstance(self.generation_devices, int) \
                or self.generation_devices < 1:
            raise ValueError(f"generation_devices must be an int >= 1, got {self.generation_devices!r}")

    def train_devices(self, workload: Workload) -> int:
        """Training devices per host."""
        if self.mode == "sync" or self.colocated:
            return workload.devices_per_host
        return workload.devices_per_host - self.generation_devices

    def generating_devices(self, workload: Workload) -> int:
        """Generation devices per host."""
        if self.mode == "sync" or self.colocated:
            return workload.devices_per_host
        return self.generation_devices

    def check(self, workload: Workload) -> None:
        if self.mode == "async" and not self.colocated and not 1 <= self.generation_devices < workload.devices_per_host:
            raise ValueError(f"split: generation devices per host must be in [1, {workload.devices_per_host - 1}] "
                             f"(a host has {workload.devices_per_host}), got {self.generation_devices}")
        if self.generating_devices(workload) % workload.generation_tensor:
            raise ValueError(f"split: {self.generating_devices(workload)} generation devices per host do not divide "
                             f"into replicas of MeshConfig.generation_tensor = {workload.generation_tensor}")
