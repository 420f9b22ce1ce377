"""`plan(...)`: every program a run executes, compiled at its real shapes for a target, measured.

The meshes are built as the run builds them (MeshConfig's per-host split of the target's devices),
on fake devices of the target's kind:
- train: one topology of every host's training devices, ("fsdp", "expert", "tensor") as parallel/meshes.py
  lays them out (tensor parallelism within a host).
- generation: the generation mesh is host-local and its "data" replicas are independent (each
  decodes its own slots; no collective crosses replicas), so one replica is compiled, on a
  topology of `generation_tensor` devices, with its share of the slots. Its per-device memory is
  the real one's.
Program specs come from the modules that own the programs (trainer/programs.py,
generation/programs.py, parallel/weight_sync.py); this module adds what the run keeps on the same
devices meanwhile, measures, and predicts throughput from the roofline of each program.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.sharding import AxisType, Mesh

from areal_jax.aot import ProgramSpec, bytes_per_device
from areal_jax.models.config import ModelConfig
from areal_jax.parallel.meshes import GENERATION_AXES, TRAIN_AXES, DeviceSplit, hybrid_train_grid
from areal_jax.plan.measure import (Measured, attention_kernels, cache_path, grouped_matmul_kernels, measure,
                                    spec_devices)
from areal_jax.plan.targets import Target


@dataclasses.dataclass(frozen=True)
class ProgramPlan:
    """One program's figures on one device of its role."""

    name: str
    role: str
    peak_bytes_per_device: int
    capacity_bytes_per_device: int
    fits: bool
    flops: float
    bytes_accessed: float
    roofline_s: float
    source: str
    program_bytes: int  # the compiler's own peak: arguments + outputs - aliases + temporaries
    resident_bytes: int  # held on the device meanwhile, not an argument
    temp_bytes: int
    compile_s: float
    fields: tuple[str, ...]
    estimate_bytes: int = 0  # plan/estimate.py's hand estimate of the peak (0: none)
    flops_xla: float = 0.0  # XLA's own count (loop bodies once); `flops` is the larger of it and the analytic count
    # The attention implementation compiled into the program: a kernel name ("splash",
    # "ragged_paged", "pallas_triton_paged", "pallas_triton_flash", "cudnn"; several joined by "+"),
    # "reference" (jnp attention) or "none" (a program without attention).
    attention: str = "none"
    # The MoE blocks' grouped matmul: "megablox_gmm" (TPU), "mosaic_ragged_dot" (Hopper),
    # "ragged_dot" (XLA; on a GPU a dense product over every expert), joined by "+"; "none" (dense model).
    grouped_matmul: str = "none"
    refused: bool = False  # not compiled: the hand estimate alone exceeds REFUSE_FACTOR x capacity

    def as_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class Plan:
    target: Target
    split: DeviceSplit
    train_devices: int
    generation_devices: int
    programs: tuple[ProgramPlan, ...]
    prediction: dict[str, Any]
    headroom: float

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.programs)

    def failures(self) -> list[ProgramPlan]:
        return [p for p in self.programs if not p.fits]

    def as_json(self) -> dict[str, Any]:
        return {
            "target": self.target.name,
            "fits": self.fits,
            "headroom": self.headroom,
            "train_devices": self.train_devices,
            "generation_devices": self.generation_devices,
            "hosts": self.target.hosts,
            "programs": [p.as_json() for p in self.programs],
            "prediction": self.prediction,
        }


def read_model_config(path: str | pathlib.Path, *, search: Sequence[pathlib.Path] = ()) -> ModelConfig:
    """ModelConfig from an HF config.json or a directory holding one (no weights needed)."""
    candidates = [pathlib.Path(path)] + [base / path for base in search if not pathlib.Path(path).is_absolute()]
    for p in candidates:
        f = p / "config.json" if p.is_dir() else p
        if f.is_file():
            try:
                return ModelConfig.from_hf(json.loads(f.read_text()), source=str(f))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{f}: {e}") from None
    raise FileNotFoundError(f"model config {str(path)!r} not found (looked for config.json at "
                            f"{', '.join(str(c) for c in candidates)})")


def paged_decode_figures(*, slots: int, pool_tokens: int, mean_prompt: float, mean_completion: float,
                         page_size: int, decode_chunk: int, block_tokens: int, weight_bytes: float,
                         kv_bytes_per_token: float) -> dict[str, Any]:
    """A paged replica's decode step at the mean lengths, per device. A sequence in flight holds on
    average its prompt, half its completion, half a page and the chunk its pages grow ahead by; the
    replica decodes as many as its slots and its pool hold. Each step reads the weights and the
    live tokens, each sequence's last kernel block whole (half a block more on average)."""
    mean_live = mean_prompt + mean_completion / 2
    footprint = mean_live + page_size / 2 + decode_chunk
    in_flight = max(1, min(slots, int(pool_tokens // footprint)))
    live, read = in_flight * mean_live, in_flight * (mean_live + block_tokens / 2)
    return {"in_flight_per_replica": in_flight, "bound_by": "slots" if in_flight == slots else "pool",
            "pool_tokens_per_replica": pool_tokens, "live_tokens_per_step": live, "read_tokens_per_step": read,
            "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
            "pool_bytes_per_device": pool_tokens * kv_bytes_per_token,
            "bytes_per_step": weight_bytes + read * kv_bytes_per_token,
            "bytes_over_weights_and_live": (weight_bytes + read * kv_bytes_per_token)
            / (weight_bytes + live * kv_bytes_per_token)}


def roofline_s(flops: float, accessed: float, target: Target) -> float:
    """Time bound of a program on one device: compute or memory traffic, whichever is longer."""
    return max(flops / target.peak_flops_per_device, accessed / target.bandwidth_per_device)


def _mesh(devices: Sequence[Any], shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(devices, dtype=object).reshape(shape), axes, axis_types=(AxisType.Auto,) * len(axes))


@dataclasses.dataclass(frozen=True)
class RoleMeshes:
    """The meshes the planner compiles on, and how they relate to the real run's."""

    split: DeviceSplit
    train: Mesh
    generation: Mesh  # one data replica
    generation_replicas_per_host: int
    reward: Mesh | None = None  # one device of the learned rewards (reward/programs.py)


def role_meshes(target: Target, split: DeviceSplit, train_tensor: int, generation_tensor: int,
                train_expert: int = 1, generation_expert: int = 1, devices: Callable[..., list] | None = None
                ) -> RoleMeshes:
    """`devices(target, n, hosts=1)`: fake devices to build on (default the target's kind)."""
    from areal_jax.plan.targets import topology_devices

    topology_devices = devices or topology_devices
    slices = getattr(target, "slices", 1)
    count = split.num_train * target.hosts
    train_devices = (topology_devices(target, count, hosts=target.hosts, slices=slices) if slices > 1
                     else topology_devices(target, count, hosts=target.hosts))
    if len(train_devices) % (train_expert * train_tensor * slices):
        raise ValueError(f"MeshConfig.train_expert = {train_expert} x train_tensor = {train_tensor} does not divide "
                         f"the {len(train_devices) // slices} training devices of each of {slices} slice(s)")
    # Stand-in devices of one slice (plan/fit.stand_in_devices: the estimate reads only shapes and
    # shardings) carry slice_index 0 alike: they take the flat mesh, whose "fsdp" is as large.
    if slices > 1 and len({getattr(d, "slice_index", None) for d in train_devices} - {None}) == slices:
        # Several slices over DCN: "fsdp" = slices (outermost) x each slice's devices (parallel/meshes.py).
        train = Mesh(hybrid_train_grid(train_devices, slices, train_expert, train_tensor), TRAIN_AXES,
                     axis_types=(AxisType.Auto,) * 3)
    else:
        train = _mesh(train_devices, (len(train_devices) // (train_expert * train_tensor), train_expert,
                                      train_tensor), TRAIN_AXES)
    replica = generation_expert * generation_tensor
    generation = _mesh(topology_devices(target, replica), (1, generation_expert, generation_tensor), GENERATION_AXES)
    reward = generation if replica == 1 else _mesh(topology_devices(target, 1), (1, 1, 1), GENERATION_AXES)
    return RoleMeshes(split, train, generation, split.num_generation // replica, reward)


SpecSource = Callable[..., list[ProgramSpec]]

# A program whose hand estimate exceeds this many times its device's capacity is refused without
# compiling: the estimate is within 25% of the compiler at small shapes, so 2x is far past any
# doubt, and such programs are the slowest to compile (a 262,144-token micro-batch took 17 minutes
# on 2 cores before libtpu refused it).
REFUSE_FACTOR = 2.0

# Program kinds that attend (the rest: optimizer update, transfers, inserts, splits).
_ATTENDING = ("decode", "prefill_start", "prefill", "reprefill_packed", "reprefill", "grad", "logprobs", "forward",
              "score", "choices")


def attention_name(spec_name: str, kernels: Sequence[str]) -> str:
    if kernels:
        return "+".join(kernels)
    kind = spec_name.split("[")[0].rsplit("/", 1)[-1]  # "reward/judge/decode[...]" -> "decode"
    return "reference" if kind.startswith(_ATTENDING) else "none"


def compile_workers(requested: int | None = None, *, per_compile_bytes: int = 6 << 30) -> int:
    """Compiles to run at once: `requested`, or as many as the host's cores and free memory allow
    (a real model's program takes gigabytes of host memory to compile)."""
    import os

    if requested is not None:
        return max(1, requested)
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 1
    return max(1, min(os.cpu_count() or 1, free // per_compile_bytes))


def measure_programs(specs: Sequence[ProgramSpec], target: Target, *, extra_resident: Callable[[ProgramSpec], int],
                     headroom: float, use_cache: bool = True,
                     estimator: Callable[[ProgramSpec, Sequence[str]], int] | None = None,
                     flop_counter: Callable[[ProgramSpec, int], float] | None = None,
                     on_program: Callable[[ProgramPlan], None] | None = None,
                     lower_bound: Callable[[ProgramSpec], int] | None = None,
                     refuse_factor: float = REFUSE_FACTOR, workers: int = 1,
                     cache_files: dict[str, str] | None = None) -> list[ProgramPlan]:
    """Compiles and measures every spec; `extra_resident(spec)` adds bytes the run holds beside it.

    `estimator(spec, attention_kernels)`: the hand estimate of the program's peak, printed beside
    the compiler's. `lower_bound(spec)`: an estimate no implementation of the program undercuts;
    a program whose lower bound (plus what stays resident) exceeds `refuse_factor` x capacity is
    lowered (to name its attention) but not compiled: refused on the estimate, marked `refused`.

    `workers` > 1: that many compiles run at once on threads of this process (the compiler
    releases the GIL; one process holds libtpu, which allows one process at a time), while the
    next programs are lowered; `on_program` still sees the programs in order. `cache_files`
    (filled when given): each compiled program's plan cache file name (plan/peak_index.py)."""
    import concurrent.futures

    source = "libtpu" if target.platform == "tpu" else "xla-gpu"
    capacity = target.capacity_bytes_per_device
    out: list[ProgramPlan] = []
    pending: list[Callable[[], ProgramPlan]] = []  # in spec order; a compile's waits on its future

    def flush(wait: bool) -> None:
        while pending and (wait or getattr(pending[0], "done", lambda: True)()):
            plan = pending.pop(0)()
            out.append(plan)
            if on_program is not None:
                on_program(plan)

    def measured(spec, m: Measured, estimate: int, grouped: str) -> ProgramPlan:
        resident = bytes_per_device(spec.resident) + extra_resident(spec)
        peak = m.program_peak_bytes + resident
        flops = max(m.flops, flop_counter(spec, m.num_devices) if flop_counter is not None else 0.0)
        return ProgramPlan(
            name=spec.name, role=spec.role, peak_bytes_per_device=peak, capacity_bytes_per_device=capacity,
            fits=peak <= (1.0 - headroom) * capacity, flops=flops, bytes_accessed=m.bytes_accessed,
            roofline_s=roofline_s(flops, m.bytes_accessed, target), source=source, flops_xla=m.flops,
            program_bytes=m.program_peak_bytes, resident_bytes=resident, temp_bytes=m.temp_bytes,
            compile_s=m.compile_s, fields=tuple(spec.fields), estimate_bytes=estimate,
            attention=attention_name(spec.name, m.attention), grouped_matmul=grouped)

    pool = concurrent.futures.ThreadPoolExecutor(workers) if workers > 1 else None
    try:
        for spec in specs:
            lowered = spec.lower()
            text = lowered.as_text()
            kernels = attention_kernels(text)
            grouped = "+".join(grouped_matmul_kernels(text)) or "none"
            if cache_files is not None:
                cache_files[spec.name] = cache_path(target.name, text).name
            estimate = (estimator(spec, kernels) + extra_resident(spec)) if estimator is not None else 0
            floor = (lower_bound(spec) + extra_resident(spec)) if lower_bound is not None else 0
            if lower_bound is not None and floor > refuse_factor * capacity:
                resident = bytes_per_device(spec.resident) + extra_resident(spec)
                flops = flop_counter(spec, spec_devices(spec)) if flop_counter is not None else 0.0
                plan = ProgramPlan(
                    name=spec.name, role=spec.role, peak_bytes_per_device=floor, capacity_bytes_per_device=capacity,
                    fits=False, flops=flops, bytes_accessed=0.0, roofline_s=roofline_s(flops, 0.0, target),
                    source="estimate", program_bytes=floor - resident, resident_bytes=resident, temp_bytes=0,
                    compile_s=0.0, fields=tuple(spec.fields), estimate_bytes=estimate,
                    attention=attention_name(spec.name, kernels), grouped_matmul=grouped, refused=True)
                pending.append(lambda plan=plan: plan)
            elif pool is None:
                m = measure(spec, target.name, use_cache=use_cache, lowered=lowered, text=text)
                plan = measured(spec, m, estimate, grouped)
                pending.append(lambda plan=plan: plan)
            else:
                future = pool.submit(measure, spec, target.name, use_cache=use_cache, lowered=lowered, text=text)
                finish = (lambda f=future, spec=spec, estimate=estimate, grouped=grouped:
                          measured(spec, f.result(), estimate, grouped))
                finish.done = future.done
                pending.append(finish)
            flush(wait=False)
        flush(wait=True)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return out


def predict(programs: Sequence[ProgramPlan], *, target: Target, meshes: RoleMeshes, model_cfg: ModelConfig,
            slots_per_replica: int, batch_groups: int, samples_per_group: int, mean_prompt: float,
            mean_completion: float, decode_chunk: int, decode_window: Callable[[int], int],
            row_length: Callable[[int], int], num_minibatches: int,
            separate_proximal: bool, colocated: bool, decode_bytes: Callable[[int], float] | None = None,
            paged: dict[str, Any] | None = None, live: dict[str, Any] | None = None,
            live_decode_bytes: Callable[[float, float], float] | None = None) -> dict[str, Any]:
    """Throughput from the programs' rooflines at the mean lengths, with the slots full.

    A decode chunk's cost analysis counts its loop body once: one decode step of every slot.
    `decode_bytes(window)`: the bytes one decode step must read per device (weights and the KV
    cache up to the window). XLA's cost analysis counts each in-place cache write (a scatter into
    the donated cache) as a read and a write of the whole cache, several times the real traffic,
    so the step time is taken from this count and the compiler's FLOPs.

    `paged`: the paged engine's decode at the mean lengths (`paged_decode_figures`): its
    sequences in flight per replica replace the slots, and `decode_bytes` reads the weights and
    their live tokens, whatever the window.

    `live`: the simulator's row of this config (`simulate.driver.config_row`): generation is
    then predicted at the sequences it keeps live per replica (Little's law: group latency x
    groups per unit time, far below the slots), each decode step reading
    `live_decode_bytes(live, context)`, and the step time is set beside the simulated one
    (`step_vs_simulate`, with `step_disagreement` saying why when they differ by over 15%)."""
    by_name = {p.name: p for p in programs}

    def find(prefix: str, **want: int) -> ProgramPlan | None:
        tag = ",".join(f"{k}={v}" for k, v in want.items())
        hit = by_name.get(f"{prefix}[{tag}]")
        if hit is not None:
            return hit
        cands = [p for p in programs if p.name.startswith(prefix + "[") and all(f"{k}={v}" in p.name for k, v in want.items())]
        return max(cands, key=lambda p: p.roofline_s, default=None)

    mean_seq = mean_prompt + mean_completion
    window = decode_window(int(mean_seq))
    decode = find("generation/decode", window=window)
    replicas = meshes.generation_replicas_per_host * target.hosts
    out: dict[str, Any] = {"assumptions": {
        "mean_prompt_tokens": mean_prompt, "mean_completion_tokens": mean_completion,
        "decode_window": window, "slots_full": True,
        "roofline": "max(FLOPs / peak bf16 FLOP/s, bytes accessed / HBM bandwidth) per program, per device",
        "decode_bytes": ("weights + the live KV of the sequences in flight (each slot's last kernel block whole), "
                         "read once per decode step" if paged else
                         "weights + KV cache up to the window, read once per decode step"),
    }}
    if paged:
        out["paged"] = paged
    gen_tps = None
    if decode is not None and decode.roofline_s > 0:
        step_s = decode.roofline_s
        if decode_bytes is not None:
            step_s = roofline_s(decode.flops, decode_bytes(window), target)
            out["decode_bytes_per_step"] = decode_bytes(window)
        gen_tps = replicas * slots_per_replica / step_s
        out["decode_step_s"] = step_s
        out["generation_tokens_per_s_full_slots"] = gen_tps
        if live is not None and live_decode_bytes is not None and live.get("live_per_replica", 0) > 0:
            c = live["live_per_replica"]
            step_s = roofline_s(decode.flops, live_decode_bytes(c, live["live_context"]), target)
            gen_tps = replicas * c / step_s
            out["decode_step_s"] = step_s
            out["assumptions"].update(slots_full=False, live_per_replica=c, live_context=live["live_context"])
        out["generation_tokens_per_s"] = gen_tps
    T = row_length(int(math.ceil(mean_seq)))
    grad = find("train/grad", len=T)
    prox = find("train/logprobs", len=T) if separate_proximal else None
    update = by_name.get("train/update")
    train_tps = None
    if grad is not None and grad.roofline_s > 0:
        per_micro = grad.roofline_s + (prox.roofline_s if prox is not None else 0.0)
        # The program's rows are every process's, budget // T per training device (issue 40).
        dims = dict(part.split("=") for part in grad.name[grad.name.index("[") + 1:-1].split(","))
        train_tps = int(dims["rows"]) * int(dims["len"]) / per_micro
        out["train_microbatch_s"] = per_micro
        out["trained_tokens_per_s_compute"] = train_tps
    step_tokens = batch_groups * samples_per_group * mean_seq
    gen_tokens = batch_groups * samples_per_group * mean_completion
    if gen_tps and train_tps:
        transfer = swap_s(programs)
        out["transfer_s_per_step"] = transfer
        t_train = step_tokens / train_tps + num_minibatches * (update.roofline_s if update else 0.0) + transfer
        t_gen = gen_tokens / gen_tps
        t_step = t_gen + t_train if colocated else max(t_gen, t_train)
        out.update(
            step_generation_s=t_gen, step_train_s=t_train, step_s=t_step,
            trained_tokens_per_s=step_tokens / t_step,
            bound="generation" if t_gen >= t_train else "training",
        )
        if live is not None and live.get("step_s"):
            out.update(simulated_step_s=live["step_s"], step_vs_simulate=t_step / live["step_s"])
            if not 0.85 <= t_step / live["step_s"] <= 1.15:
                out["step_disagreement"] = step_disagreement(t_step, live)
    return out


_LAYER_GROUP = re.compile(r"^(?P<head>.*layers)\[(?P<a>\d+):(?P<b>\d+) of (?P<n>\d+)\](?P<tail>.*)$")


def swap_s(programs: Sequence[ProgramPlan]) -> float:
    """Seconds of one weight swap at the transfer programs' rooflines: the whole model, or with LoRA
    the adapters alone (the base crosses once). A swap runs every group of `RLConfig.transfer_group_bytes`;
    runs of equal length share one program, and the default plan compiles only the largest of the
    family ("transfer/layers[0:k of N]"), so the layer groups are its roofline per layer times the N
    layers (with `--all`, every group's program is planned and each gives the same per-layer figure).
    The other groups (embedding, head, norms) are each their own program, counted once."""
    swaps = [p for p in programs if p.role == "transfer"]
    swaps = [p for p in swaps if p.name.startswith("transfer/lora/")] or swaps
    per_layer: dict[tuple[str, str], tuple[float, int]] = {}
    total = 0.0
    for p in swaps:
        m = _LAYER_GROUP.match(p.name)
        if m is None:
            total += p.roofline_s
            continue
        key, count = (m["head"], m["tail"]), int(m["b"]) - int(m["a"])
        seconds = p.roofline_s / count
        per_layer[key] = (max(seconds, per_layer.get(key, (0.0, 0))[0]), int(m["n"]))
    return total + sum(seconds * layers for seconds, layers in per_layer.values())


def step_disagreement(plan_step_s: float, live: dict[str, Any]) -> str:
    """Why plan's step and the simulated one differ by more than 15%, from the simulated row."""
    return (f"plan's step {plan_step_s:.1f} s is {plan_step_s / live['step_s']:.2f}x the simulated "
            f"{live['step_s']:.1f} s: plan takes every completion at the mean length, full micro-batches and "
            f"the sides either overlapped or back to back; the simulated run pads its micro-batches "
            f"{live.get('padded_token_ratio', 0):.2f}x, keeps generation busy {live.get('generation_busy', 0):.0%} "
            f"and training {live.get('train_busy', 0):.0%} of the step (the length tail and the staleness bound "
            "leave the rest idle), and re-prefills on weight swaps")
