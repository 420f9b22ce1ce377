"""Whether a config's programs fit its target, without compiling: the plan's programs (the same
bounding set `areal-jax plan` compiles, `plan_inputs`) at the hand estimate of their peaks, or
where asked and the plan cache holds them, the compiled peaks a previous `plan` recorded.

`simulate --tune` asks this of every candidate point; what a point's verdict rests on is stated
(`Fit.source`), as the estimate is only within ~25% of the compiler.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from areal_jax.aot import bytes_per_device
from areal_jax.plan.estimate import estimate_peak
from areal_jax.plan.targets import Target

# The attention kernels the programs compile with on each platform (models/ "auto" on an
# accelerator): flash attention in training and prefill, the paged decode kernel.
PLATFORM_KERNELS = {"tpu": ("splash", "ragged_paged"), "cuda": ("pallas_triton_flash", "pallas_triton_paged")}


@dataclasses.dataclass(frozen=True)
class Fit:
    """The tightest program of a config against its device's capacity.

    Attributes:
        fits: every program's peak within (1 - headroom) x capacity.
        peak_fraction: the tightest program's peak over its device's capacity.
        tightest: that program's name.
        source: "estimate" (the hand estimate of every program), or "compiled (plan cache)" (every
            program's compiled peak read from the plan cache), or "compiled K of N, estimate the
            rest" where the cache holds some; or why the config cannot be planned at all.
        generation_fraction: the tightest generation or evaluation program's peak over capacity
            (what a larger KV pool grows).
    """

    fits: bool
    peak_fraction: float
    tightest: str
    source: str
    generation_fraction: float = 0.0


def stand_in_devices(target: Target, num_devices: int, hosts: int = 1, slices: int = 1) -> list:
    """Fake GPU devices standing in for any target's: the estimate reads only shapes and
    shardings, so a TPU target's candidates need no libtpu (one process at a time holds it)."""
    from jax.experimental import topologies

    from areal_jax.plan.targets import gpu_target_config

    topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config("h100"),
                                        topology=f"1x{hosts}x{num_devices // hosts}")
    return list(topo.devices)


def estimate_fit(job, plan_cfg, target: Target, *, gin_files: Sequence[str] = (), model_cfg=None,
                 compiled_within_s: float = 0.0) -> Fit:
    """`job`'s bounding programs on `target` at their estimated peaks. With `compiled_within_s`
    > 0, programs are also lowered on the target's own fake devices (for a TPU target: when
    libtpu is free) and the plan cache's compiled peak replaces the estimate where it holds one,
    until that many seconds have passed (lowering a large model's program takes seconds)."""
    from areal_jax.plan.job import plan_inputs

    inputs = plan_inputs(job, plan_cfg, target, gin_files=gin_files, model_cfg=model_cfg, devices=stand_in_devices)
    refusal = paged_kernel_refusal(job, target, inputs)
    if refusal is not None:  # the engine would decode with the reference gather: not this point's figures
        return Fit(fits=False, peak_fraction=float("nan"), tightest="generation/decode", source=f"refused: {refusal}")
    kernels = PLATFORM_KERNELS["tpu" if target.platform == "tpu" else "cuda"]
    peaks = {s.name: estimate_peak(s, inputs.ctx, kernels) + inputs.extra_resident(s) for s in inputs.specs}
    compiled = 0
    if compiled_within_s > 0:
        compiled = _compiled_peaks(job, plan_cfg, target, gin_files, inputs.model_cfg, peaks, compiled_within_s)
    capacity = target.capacity_bytes_per_device
    tightest = max(peaks, key=peaks.get)
    source = ("estimate" if not compiled else "compiled (plan cache)" if compiled == len(peaks)
              else f"compiled {compiled} of {len(peaks)}, estimate the rest")
    roles = {s.name: s.role for s in inputs.specs}
    generation = max((v for k, v in peaks.items() if roles[k] in ("generation", "eval")), default=0)
    return Fit(fits=peaks[tightest] <= (1.0 - plan_cfg.headroom) * capacity,
               peak_fraction=peaks[tightest] / capacity, tightest=tightest, source=source,
               generation_fraction=generation / capacity)


def paged_kernel_refusal(job, target: Target, inputs) -> str | None:
    """Why the target's paged decode kernel cannot take one replica's page tables (its `limits`:
    on TPU the page table and lengths must fit the core's SMEM), or None. The engine would then
    decode with the reference gather, slower and larger than the point was estimated at."""
    from areal_jax.kernels.paged_attention import KERNELS
    from areal_jax.plan.job import gen_dtype, replica_engine_config

    layout = getattr(job.engine, "layout", None)
    if layout is None or layout(target.platform) != "paged":
        return None
    platform = "tpu" if target.platform == "tpu" else "gpu"
    engine = replica_engine_config(job.engine, inputs.meshes.generation_replicas_per_host)
    m = inputs.model_cfg
    why = KERNELS.unfit(platform, m.head_dim, engine.page_size, engine.num_slots, engine.pages_per_sequence,
                        max(1, m.num_kv_heads // job.mesh.generation_tensor), job.engine.kv_itemsize(gen_dtype(job)))
    return None if why is None else f"{KERNELS.entry(platform).name}: {why}"


def _compiled_peaks(job, plan_cfg, target, gin_files, model_cfg, peaks: dict[str, int], within_s: float) -> int:
    """Replaces `peaks` entries by the plan cache's compiled figures where it holds them; returns
    how many it replaced. The peak index (plan/peak_index.py) names them without lowering; the
    rest are lowered, one at a time, while the time left exceeds the slowest lowering so far."""
    from areal_jax.plan import peak_index
    from areal_jax.plan.job import plan_inputs
    from areal_jax.plan.measure import cache_path, cached_measure
    from areal_jax.plan.targets import LibtpuBusy

    deadline = time.monotonic() + within_s
    key = peak_index.index_key(job, plan_cfg, target.name, model_cfg)
    indexed, uncompiled = peak_index.read(key)
    found = 0
    for name, (m, resident) in indexed.items():
        if name in peaks:
            peaks[name] = m.program_peak_bytes + resident
            found += 1
    missing = set(peaks) - set(indexed) - uncompiled
    if not missing:
        return found
    try:
        inputs = plan_inputs(job, plan_cfg, target, gin_files=gin_files, model_cfg=model_cfg)
    except LibtpuBusy:
        return found
    slowest, lowered_entries = 0.0, {}
    for spec in inputs.specs:
        if spec.name not in missing:
            continue
        if deadline - time.monotonic() <= slowest:  # the next lowering would likely overrun
            break
        t0 = time.monotonic()
        text = spec.lower().as_text()
        slowest = max(slowest, time.monotonic() - t0)
        resident = bytes_per_device(spec.resident) + inputs.extra_resident(spec)
        lowered_entries[spec.name] = {"file": cache_path(target.name, text).name, "resident": resident}
        m = cached_measure(target.name, text)
        if m is not None:
            peaks[spec.name] = m.program_peak_bytes + resident
            found += 1
    peak_index.add(key, lowered_entries)
    return found
