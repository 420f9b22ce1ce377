"""Accelerators the planner compiles for: one table of published per-chip figures, and the
fake topologies (libtpu for TPUs, XLA:GPU for NVIDIA GPUs) that let a CPU host compile for them.

Target names: a TPU slice as Cloud TPU names it ("v5e-16", "v5p-128", "v6e-16", "v4-32"; v4 and
v5p count TensorCores, two per chip, v5e and v6e count chips), several such slices joined by the
data-centre network as "2xv5p-64" (slices x slice; compiled through libtpu's multi-slice
topology, `get_topology_desc(..., num_slices=N)`), and GPU nodes as "8xh100" or "4x8xh100"
(nodes x GPUs per node; "a100", "h100", "h200").
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Published figures of one chip. Sources are the vendors' product pages."""

    name: str
    platform: Literal["tpu", "cuda"]
    hbm_bytes: int  # per chip
    bf16_flops: float  # dense peak per chip
    hbm_bandwidth: float  # bytes/s per chip
    source: str
    devices_per_chip: int = 1  # JAX devices libtpu shows per chip (v4 without megacore: 2)
    chips_per_host: int = 4
    cores_per_chip_in_name: int = 1  # "v5p-32" counts TensorCores: 16 chips
    # Bandwidth per chip out of its host over the network between slices (TPU: the data-centre
    # network, DCN) or nodes (GPU: the node's InfiniBand NICs), bytes/s; None where no figure is
    # published (multi-slice targets of that kind are refused).
    dcn_bandwidth: float | None = None
    dcn_source: str = ""


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("v4", "tpu", 32 * GiB, 275e12, 1.2e12, "https://cloud.google.com/tpu/docs/v4",
                devices_per_chip=2, cores_per_chip_in_name=2),
    Accelerator("v5e", "tpu", 16 * GiB, 197e12, 819e9, "https://cloud.google.com/tpu/docs/v5e",
                dcn_bandwidth=25e9 / 8, dcn_source="https://cloud.google.com/tpu/docs/v5e: 2 x 100 Gbps NICs "
                "per host of 8 chips (and 6.4 Tbps of DCN per 256-chip pod): 25 Gbps per chip"),
    Accelerator("v5p", "tpu", 95 * GiB, 459e12, 2.765e12, "https://cloud.google.com/tpu/docs/v5p",
                cores_per_chip_in_name=2, dcn_bandwidth=50e9 / 8,
                dcn_source="https://cloud.google.com/tpu/docs/v5p: data center network (DCN) bandwidth per chip "
                "50 Gbps"),
    Accelerator("v6e", "tpu", 32 * GiB, 918e12, 1.64e12, "https://cloud.google.com/tpu/docs/v6e"),
    Accelerator("a100", "cuda", 80 * GiB, 312e12, 2.039e12,
                "https://www.nvidia.com/en-us/data-center/a100/ (A100 80GB SXM)", chips_per_host=8,
                dcn_bandwidth=200e9 / 8, dcn_source="NVIDIA DGX A100 datasheet: 8 x 200 Gb/s HDR InfiniBand "
                "(one per GPU)"),
    Accelerator("h100", "cuda", 80 * GiB, 989e12, 3.35e12,
                "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM, dense)", chips_per_host=8,
                dcn_bandwidth=400e9 / 8, dcn_source="NVIDIA DGX H100 datasheet: 8 x 400 Gb/s ConnectX-7 "
                "(one per GPU)"),
    Accelerator("h200", "cuda", 141 * 10**9, 989e12, 4.8e12,
                "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM, dense)", chips_per_host=8,
                dcn_bandwidth=400e9 / 8, dcn_source="NVIDIA DGX H200 datasheet: 8 x 400 Gb/s ConnectX-7 "
                "(one per GPU)"),
)}

# What XLA:GPU needs to know of a device to compile for it without one (GpuTargetConfigProto
# text): SM count and limits, memory size and bandwidth, compute capability, toolkit versions.
_GPU_DEVICE_INFO = {
    "a100": dict(core_count=108, fpus_per_core=64, shared_memory_per_core=167936, shared_memory_per_block_optin=166912,
                 l2_cache_size=41943040, clock_rate_ghz=1.41, memory_bandwidth=2039040000000,
                 device_memory_size=85100068864, cc_major=8, description="NVIDIA A100-SXM4-80GB"),
    "h100": dict(core_count=132, fpus_per_core=128, shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
                 l2_cache_size=52428800, clock_rate_ghz=1.98, memory_bandwidth=3352320000000,
                 device_memory_size=84942979072, cc_major=9, description="NVIDIA H100 80GB HBM3"),
    "h200": dict(core_count=132, fpus_per_core=128, shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
                 l2_cache_size=52428800, clock_rate_ghz=1.98, memory_bandwidth=4800000000000,
                 device_memory_size=151397597184, cc_major=9, description="NVIDIA H200 141GB HBM3e"),
}


def gpu_target_config(name: str) -> str:
    """GpuTargetConfigProto text for one of the GPUs in the table."""
    d = _GPU_DEVICE_INFO[name]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {d['shared_memory_per_core']} threads_per_core_limit: 2048
  core_count: {d['core_count']} fpus_per_core: {d['fpus_per_core']}
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {d['memory_bandwidth']} l2_cache_size: {d['l2_cache_size']} clock_rate_ghz: {d['clock_rate_ghz']}
  device_memory_size: {d['device_memory_size']} shared_memory_per_block_optin: {d['shared_memory_per_block_optin']}
  cuda_compute_capability {{ major: {d['cc_major']} minor: 0 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
runtime_version {{ major: 12 minor: 8 }}
dnn_version_info {{ major: 9 minor: 7 }}
device_description_str: "{d['description']}"
"""


@dataclasses.dataclass(frozen=True)
class Target:
    """A slice or a set of GPU nodes: `hosts` hosts of `chips_per_host` chips of `accelerator`."""

    name: str
    accelerator: Accelerator
    hosts: int  # every slice's
    chips_per_host: int
    slices: int = 1  # TPU slices joined by the data-centre network (hosts split evenly among them)

    @property
    def platform(self) -> str:
        return self.accelerator.platform

    @property
    def devices_per_host(self) -> int:
        return self.chips_per_host * self.accelerator.devices_per_chip

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def capacity_bytes_per_device(self) -> int:
        """HBM one JAX device may use (a v4 chip's two TensorCores share its HBM)."""
        return self.accelerator.hbm_bytes // self.accelerator.devices_per_chip

    @property
    def peak_flops_per_device(self) -> float:
        return self.accelerator.bf16_flops / self.accelerator.devices_per_chip

    @property
    def bandwidth_per_device(self) -> float:
        return self.accelerator.hbm_bandwidth / self.accelerator.devices_per_chip

    @property
    def host_network_bandwidth(self) -> float | None:
        """Bytes/s one host sends or receives between slices (TPU DCN) or nodes (GPU), or None."""
        dcn = self.accelerator.dcn_bandwidth
        return None if dcn is None else dcn * self.chips_per_host


def parse_target(name: str) -> Target:
    """"v5e-16", "v5p-128", "8xh100", "4x8xh200" -> Target; a ValueError lists the known names."""
    text = name.strip().lower()
    multi = re.fullmatch(r"(\d+)x((?:v4|v5e|v5p|v6e)-\d+)", text)
    if multi:
        slices, one = int(multi.group(1)), parse_target(multi.group(2))
        if slices < 1:
            raise ValueError(f"target {name!r}: at least one slice")
        if slices > 1 and one.accelerator.dcn_bandwidth is None:
            raise ValueError(f"target {name!r}: no published data-centre network bandwidth for "
                             f"{one.accelerator.name}, which a multi-slice plan costs its transfers at")
        return dataclasses.replace(one, name=text, hosts=one.hosts * slices, slices=slices)
    tpu = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", text)
    gpu = re.fullmatch(r"(?:(\d+)x)?(\d+)x(a100|h100|h200)", text)
    if tpu:
        acc = ACCELERATORS[tpu.group(1)]
        count = int(tpu.group(2))
        if count % acc.cores_per_chip_in_name:
            raise ValueError(f"target {name!r}: {acc.name} slices count TensorCores, "
                             f"{acc.cores_per_chip_in_name} per chip")
        chips = count // acc.cores_per_chip_in_name
        if chips < 1 or chips & (chips - 1):
            raise ValueError(f"target {name!r}: the planner knows slices of a power-of-two chip count")
        # v5e/v6e slices of up to 8 chips are one host (v5litepod-8 is one VM of 8 chips).
        per_host = chips if (acc.name in ("v5e", "v6e") and chips <= 8) else min(chips, acc.chips_per_host)
        return Target(text, acc, chips // per_host, per_host)
    if gpu:
        nodes = int(gpu.group(1) or 1)
        return Target(text, ACCELERATORS[gpu.group(3)], nodes, int(gpu.group(2)))
    raise ValueError(f"unknown target {name!r}: use a TPU slice ({', '.join(a + '-N' for a in ('v4', 'v5e', 'v5p', 'v6e'))}), "
                     "several slices (2xv5p-64) or GPU nodes (8xh100, 4x8xh100; a100, h100, h200)")


def tpu_topology_name(accelerator: Accelerator, num_devices: int) -> str:
    """libtpu topology holding exactly `num_devices` JAX devices (a mesh over part of a larger
    topology aborts on collectives, so each role gets a topology of its own size)."""
    chips = num_devices // accelerator.devices_per_chip
    if chips * accelerator.devices_per_chip != num_devices or chips < 1 or chips & (chips - 1):
        raise ValueError(f"{num_devices} {accelerator.name} devices do not form a TPU topology "
                         f"(a power-of-two chip count): change the MeshConfig split")
    if accelerator.name in ("v5e", "v6e"):  # 2-D tori
        a = 1 << (int(math.log2(chips)) // 2)
        return f"{accelerator.name}:{a}x{chips // a}"
    if chips < 4:  # 3-D tori: a host's 2x2x1 first, then z, y, x doubled in turn
        return f"{accelerator.name}:1x{chips}x1"
    dims, axis = [2, 2, 1], 2
    while dims[0] * dims[1] * dims[2] < chips:
        dims[axis] *= 2
        axis = (axis - 1) % 3
    return f"{accelerator.name}:{dims[0]}x{dims[1]}x{dims[2]}"


class LibtpuBusy(RuntimeError):
    """Another process holds libtpu (its lock file), so no TPU program can be compiled now."""


def topology_devices(target: Target, num_devices: int, hosts: int = 1, slices: int = 1) -> list:
    """Fake devices of `target`'s kind, exactly `num_devices` of them, for compiling; on TPU with
    `slices` > 1, that many slices of num_devices / slices each (devices carry `slice_index`)."""
    from jax.experimental import topologies

    if target.platform == "tpu":
        if num_devices % slices:
            raise ValueError(f"{num_devices} devices do not split over {slices} slices")
        try:
            kwargs = {"num_slices": slices} if slices > 1 else {}
            topo = topologies.get_topology_desc(tpu_topology_name(target.accelerator, num_devices // slices), "tpu",
                                                **kwargs)
        except RuntimeError as e:
            if "lockfile" in str(e):
                raise LibtpuBusy("libtpu is in use by another process (it allows one at a time): wait for that "
                                 "process, e.g. another `areal-jax plan` for a TPU target") from None
            raise
    else:
        if num_devices % hosts:
            raise ValueError(f"{num_devices} GPUs do not split over {hosts} hosts")
        topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(target.accelerator.name),
                                            topology=f"1x{hosts}x{num_devices // hosts}")
    devices = list(topo.devices)
    if len(devices) != num_devices:
        raise RuntimeError(f"topology for {num_devices} devices of {target.name} gave {len(devices)}")
    return devices
