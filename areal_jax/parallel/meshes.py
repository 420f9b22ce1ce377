"""Per-host device split into a global train mesh and a host-local generation mesh.

Conventions (used project-wide; models/sharding.py maps logical axes onto these names):

    train mesh       ("fsdp", "expert", "tensor")  GLOBAL: every process's training devices.
                     Each host's devices form a contiguous block of rows along "fsdp",
                     so tensor parallelism never crosses a host. "expert" (size
                     `train_expert`, default 1) splits a MoE model's experts; batch rows and
                     the other weights shard over "fsdp" and "expert" together, so it is
                     data parallelism for everything but the experts.
    generation mesh  ("data", "expert", "tensor")  HOST-LOCAL: this process's generation
                     devices. Generation needs no cross-host collective; hosts scale as
                     data parallelism (one inference server per node, as in AReaL). Within
                     a replica, "expert" (`generation_expert`) splits the experts; the rest
                     of the replica (attention, KV cache) is replicated over it.

Every host splits its local devices the same way: the first `num_train` local devices
(by id) train, the rest generate. In colocated mode (the synchronous baseline) both
meshes use every local device, in the same order.

Several TPU slices (`MeshConfig.num_slices`): the slices are joined by the data-centre network
(DCN), one to two orders of magnitude slower than the chips' interconnect (ICI). The train mesh's
"fsdp" axis then spans the slices as its outermost part (slice-major, as
`mesh_utils.create_hybrid_device_mesh` lays out a DCN axis), so a tensor or expert group never
crosses DCN; the generation mesh stays host-local, so only the weight push (and training's own
"fsdp" collectives) crosses it. Within a slice, hosts stay contiguous blocks of "fsdp" (the weight
transfer's view relies on it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

logger = logging.getLogger(__name__)

TRAIN_AXES = ("fsdp", "expert", "tensor")
GENERATION_AXES = ("data", "expert", "tensor")

# Below this many local devices a host cannot give both sides a useful share.
MIN_DEVICES_FOR_SPLIT = 4


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """How each host divides its local devices between generation and training.

    Attributes:
      generation_fraction: share of each host's local devices that generate (paper: 3/4),
        rounded down. Ignored when `num_generation_devices_per_host` is set.
      num_generation_devices_per_host: explicit generation device count per host.
      train_tensor: tensor-parallel size of the train mesh; fsdp takes the rest.
      generation_tensor: tensor-parallel size of the generation mesh; data takes the rest.
      train_expert: expert-parallel size of the train mesh (a MoE model's experts split over it;
        it must divide MoEConfig.num_experts, checked by `check_model_fits_mesh`).
      generation_expert: expert-parallel size of each generation replica (expert x tensor
        devices hold one replica).
      num_slices: TPU slices the job spans (joined by DCN; `plan --target=NxSLICE`). The train
        mesh's "fsdp" axis spans them, outermost; hosts must split evenly among them.
      colocated: generation and training share every local device. With RLConfig.mode = 'sync'
        they take turns on them (the synchronous baseline); in 'async' both run at once, each
        program waiting for the devices as the other's hold them.
        Hosts with fewer than 4 devices colocate automatically unless an explicit
        generation device count is given.
      reward_devices: devices per host set apart, from the generation devices' end, for the
        learned rewards (reward models, a generative judge: reward/composite.py). 0: they share
        the first generation device with the policy's engine.
    """

    generation_fraction: float = 0.75
    num_generation_devices_per_host: int | None = None
    train_tensor: int = 1
    generation_tensor: int = 1
    train_expert: int = 1
    generation_expert: int = 1
    colocated: bool = False
    num_slices: int = 1
    reward_devices: int = 0

    def __post_init__(self):
        if not 0.0 < self.generation_fraction < 1.0:
            raise ValueError(
                f"generation_fraction must lie strictly between 0 and 1 so both sides get "
                f"devices, got {self.generation_fraction}"
            )
        if self.num_generation_devices_per_host is not None:
            if self.num_generation_devices_per_host < 1:
                raise ValueError(
                    "num_generation_devices_per_host must be >= 1, got "
                    f"{self.num_generation_devices_per_host}"
                )
            if self.colocated:
                raise ValueError(
                    "colocated=True uses every device for both sides; do not also set "
                    "num_generation_devices_per_host"
                )
        if isinstance(self.reward_devices, bool) or not isinstance(self.reward_devices, int) or self.reward_devices < 0:
            raise ValueError(f"reward_devices must be an int >= 0, got {self.reward_devices!r}")
        if self.reward_devices and self.colocated:
            raise ValueError("colocated=True shares every device; reward_devices needs devices of their own")
        for name in ("train_tensor", "generation_tensor", "train_expert", "generation_expert", "num_slices"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class DeviceSplit:
    """Per-host device counts that a MeshConfig resolves to for a given host size."""

    num_local: int
    num_train: int
    num_generation: int
    colocated: bool
    num_reward: int = 0  # the last devices of each host, for learned rewards (MeshConfig.reward_devices)


def split_local_devices(cfg: MeshConfig, num_local: int) -> DeviceSplit:
    """Resolves `cfg` for hosts with `num_local` devices; raises ValueError if impossible."""
    if num_local < 1:
        raise ValueError("a host has no devices")
    colocated = cfg.colocated
    if not colocated and cfg.num_generation_devices_per_host is None and num_local < MIN_DEVICES_FOR_SPLIT:
        logger.warning(
            "each host has only %d device(s) (< %d): colocating generation and training "
            "on all of them (both run at once on them; RL stays asynchronous unless RLConfig.mode = 'sync')",
            num_local,
            MIN_DEVICES_FOR_SPLIT,
        )
        colocated = True

    if colocated and cfg.reward_devices:
        raise ValueError(f"hosts with {num_local} devices colocate generation and training; MeshConfig.reward_devices "
                         f"= {cfg.reward_devices} needs a split (num_generation_devices_per_host)")
    if colocated:
        num_train = num_generation = num_local
    else:
        if cfg.num_generation_devices_per_host is not None:
            num_generation = cfg.num_generation_devices_per_host
            how = f"num_generation_devices_per_host={num_generation}"
        else:
            num_generation = int(cfg.generation_fraction * num_local)
            how = f"generation_fraction={cfg.generation_fraction}"
        num_train = num_local - num_generation
        num_generation -= cfg.reward_devices  # the reward devices come from the generation side
        if num_generation < 1 or num_train < 1:
            raise ValueError(
                f"{how} on hosts with {num_local} devices leaves {num_generation} generation "
                f"and {num_train} training device(s) (reward_devices={cfg.reward_devices} taken from generation); "
                "each side needs at least one"
            )

    if num_train % cfg.train_tensor:
        raise ValueError(
            f"train_tensor={cfg.train_tensor} does not divide the {num_train} training "
            f"device(s) per host (tensor parallelism must stay within a host)"
        )
    if num_generation % cfg.generation_tensor:
        raise ValueError(
            f"generation_tensor={cfg.generation_tensor} does not divide the "
            f"{num_generation} generation device(s) per host"
        )
    replica = cfg.generation_expert * cfg.generation_tensor
    if num_generation % replica:
        raise ValueError(
            f"generation_expert={cfg.generation_expert} x generation_tensor={cfg.generation_tensor} does not "
            f"divide the {num_generation} generation device(s) per host (a replica stays within its host)"
        )
    return DeviceSplit(num_local, num_train, num_generation, colocated, cfg.reward_devices)


@dataclasses.dataclass(frozen=True)
class Meshes:
    """The two meshes of this process and the local devices behind them.

    `train` spans every process; `generation` spans only this process's devices.
    `train_devices_local` / `generation_devices_local` are this process's devices, in
    mesh order. `train_devices_by_host[h]` are process h's training devices in train-mesh
    order (the rows host h owns along "fsdp").
    """

    train: Mesh
    generation: Mesh
    train_devices_local: tuple[jax.Device, ...]
    generation_devices_local: tuple[jax.Device, ...]
    train_devices_by_host: tuple[tuple[jax.Device, ...], ...]
    split: DeviceSplit
    reward_devices_local: tuple[jax.Device, ...] = ()  # MeshConfig.reward_devices of this process

    @property
    def learned_reward_devices(self) -> tuple[jax.Device, ...]:
        """Where this process's learned rewards run: their own devices, else the first generation device."""
        return self.reward_devices_local or self.generation_devices_local[:1]

    @property
    def colocated(self) -> bool:
        return self.split.colocated

    @property
    def num_hosts(self) -> int:
        return len(self.train_devices_by_host)

    @property
    def host_index(self) -> int:
        """Row of this process in `train_devices_by_host`."""
        mine = self.train_devices_local[0]
        return next(h for h, devs in enumerate(self.train_devices_by_host) if mine in devs)


def _devices_by_process(devices: Sequence[jax.Device]) -> dict[int, list[jax.Device]]:
    by_process: dict[int, list[jax.Device]] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    for devs in by_process.values():
        devs.sort(key=lambda d: d.id)
    return dict(sorted(by_process.items()))


def build_meshes(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Meshes:
    """Splits each host's devices and builds the global train and host-local generation meshes.

    Args:
      cfg: the split and tensor-parallel sizes.
      devices: global device list to use (default: `jax.devices()`); every process that
        appears must contribute the same number of devices, and this process must appear.
    """
    devices = list(jax.devices() if devices is None else devices)
    by_process = _devices_by_process(devices)
    counts = {p: len(devs) for p, devs in by_process.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"hosts have differing device counts {counts}; every host must split alike")
    me = jax.process_index()
    if me not in by_process:
        raise ValueError(f"this process ({me}) owns none of the given devices")

    split = split_local_devices(cfg, next(iter(counts.values())))
    # Hosts in slice order (stable): the train mesh's "fsdp" blocks, slice by slice.
    hosts = sorted(by_process.values(), key=lambda devs: slice_of(devs[0]) or 0)
    train_by_host = tuple(tuple(devs[: split.num_train]) for devs in hosts)
    local = by_process[me]
    train_local = tuple(local[: split.num_train])
    generation_local = tuple(local if split.colocated else local[split.num_train : split.num_train + split.num_generation])
    reward_local = tuple(local[split.num_train + split.num_generation :]) if split.num_reward else ()

    train_devices = [d for devs in train_by_host for d in devs]
    group = cfg.train_expert * cfg.train_tensor
    if len(train_devices) % (group * cfg.num_slices):
        slices = f" x num_slices={cfg.num_slices}" if cfg.num_slices > 1 else ""
        raise ValueError(f"train_expert={cfg.train_expert} x train_tensor={cfg.train_tensor}{slices} does not "
                         f"divide the {len(train_devices)} training device(s)")
    train_grid = slice_major(train_devices, cfg.num_slices).reshape(-1, cfg.train_expert, cfg.train_tensor)
    train_mesh = Mesh(train_grid, TRAIN_AXES, axis_types=(AxisType.Auto,) * 3)
    return Meshes(
        train=train_mesh,
        generation=generation_mesh(generation_local, cfg.generation_tensor, cfg.generation_expert),
        train_devices_local=train_local,
        generation_devices_local=generation_local,
        train_devices_by_host=train_by_host,
        split=split,
        reward_devices_local=reward_local,
    )


def slice_of(device: jax.Device) -> int | None:
    """The TPU slice a device belongs to (`slice_index`), or None where devices carry none (CPU, GPU)."""
    return getattr(device, "slice_index", None)


def slice_major(devices: Sequence[jax.Device], num_slices: int) -> np.ndarray:
    """`devices` (hosts as contiguous blocks) ordered slice by slice, each slice's in the given order.

    Devices that carry `slice_index` (a multi-slice TPU job, or libtpu's multi-slice topology
    devices) are grouped by it, and there must be exactly `num_slices`, of equal size. Devices
    without one (CPU, GPU) stand for slices as `num_slices` consecutive equal blocks: how a CPU test
    simulates slices."""
    devices = list(devices)
    if num_slices < 1 or len(devices) % num_slices:
        raise ValueError(f"{len(devices)} device(s) do not split into {num_slices} slice(s)")
    if num_slices == 1 and all(slice_of(d) is None or slice_of(d) == slice_of(devices[0]) for d in devices):
        return np.array(devices, dtype=object)
    if any(slice_of(d) is None for d in devices):
        return np.array(devices, dtype=object)  # simulated: consecutive blocks are the slices
    by_slice: dict[int, list[jax.Device]] = {}
    for d in devices:
        by_slice.setdefault(slice_of(d), []).append(d)
    sizes = {k: len(v) for k, v in sorted(by_slice.items())}
    if len(by_slice) != num_slices or len(set(sizes.values())) != 1:
        raise ValueError(f"MeshConfig.num_slices = {num_slices}, but the devices lie on slices {sizes} "
                         "(slice index: devices); every slice must hold the same number")
    return np.array([d for k in sorted(by_slice) for d in by_slice[k]], dtype=object)


def hybrid_train_grid(devices: Sequence[jax.Device], num_slices: int, expert: int, tensor: int) -> np.ndarray:
    """The [fsdp, expert, tensor] grid of a multi-slice train mesh over whole slices' devices, by
    `mesh_utils.create_hybrid_device_mesh`: "fsdp" = DCN (slices, outermost) x ICI (within a slice),
    each slice's devices in an order its interconnect favours. For the planner's topology devices,
    which are whole slices; a run keeps hosts contiguous instead (`build_meshes`)."""
    from jax.experimental import mesh_utils

    per_slice = len(devices) // num_slices
    return mesh_utils.create_hybrid_device_mesh((per_slice // (expert * tensor), expert, tensor), (num_slices, 1, 1),
                                                list(devices), allow_split_physical_axes=True)


def generation_mesh(devices: Sequence[jax.Device], tensor: int, expert: int = 1) -> Mesh:
    """The ("data", "expert", "tensor") mesh over `devices` in their order: consecutive groups of
    `expert * tensor` devices hold one model replica each, and the replicas form "data".
    `expert * tensor` must divide len(devices) (callers check it and name their field)."""
    if tensor < 1 or expert < 1 or len(devices) % (tensor * expert):
        raise ValueError(f"expert x tensor size {expert} x {tensor} does not divide the {len(devices)} device(s)")
    grid = np.array(list(devices), dtype=object).reshape(-1, expert, tensor)  # [data, expert, tensor]
    return Mesh(grid, GENERATION_AXES, axis_types=(AxisType.Auto,) * 3)


def batch_shards(mesh: Mesh) -> int:
    """How many ways a train mesh splits micro-batch rows ("fsdp" x "expert", the rule table's
    "batch" axes): the row multiple that keeps rows evenly sharded."""
    return mesh.shape.get("fsdp", 1) * mesh.shape.get("expert", 1)


def check_model_fits_mesh(model_cfg, cfg: MeshConfig) -> None:
    """Where the model config meets the mesh config: the expert axes must divide the experts.

    A dense model with an expert axis > 1 is refused rather than ignored: its devices along the
    axis would only repeat the data parallelism "fsdp" gives, so the config surely meant something else.
    """
    moe = getattr(model_cfg, "moe", None)
    for name in ("train_expert", "generation_expert"):
        size = getattr(cfg, name)
        if size == 1:
            continue
        if moe is None:
            raise ValueError(f"MeshConfig.{name} = {size} needs a mixture-of-experts model; "
                             f"this one (family {model_cfg.family!r}) is dense")
        if moe.num_experts % size:
            raise ValueError(f"MeshConfig.{name} = {size} does not divide the model's "
                             f"{moe.num_experts} experts (MoEConfig.num_experts)")
