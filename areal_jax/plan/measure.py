"""Compile one ProgramSpec for a target's fake devices and read what its compiler says it needs.

Peak bytes per device = arguments + outputs - aliased (donated) buffers + temporaries, from the
compiler's own memory analysis, plus what stays resident on the device meanwhile without being
an argument (`ProgramSpec.resident`). FLOPs and bytes accessed come from XLA's cost analysis:
libtpu's per device after partitioning. XLA:GPU has none, so XLA's HLO cost analysis runs on the
CPU client: FLOPs of the unpartitioned program before optimisation divided by its device count,
bytes accessed of the optimised program of one device.

Results are cached on disk by target and the lowered program's text: compiling a real model's
programs takes minutes on a small host, and a rerun or a sweep over a config field recompiles
only what changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import time
from typing import Any

import jax

from areal_jax.aot import ProgramSpec, bytes_per_device


_CACHE_VERSION = 2  # bump when what is measured changes


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the compiler reports for one program on one device."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    num_devices: int
    compile_s: float
    cached: bool = False
    attention: tuple[str, ...] = ()  # attention kernels in the program (`attention_kernels`), not cached

    @property
    def program_peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("AREAL_JAX_PLAN_CACHE") or pathlib.Path.home() / ".cache" / "areal_jax" / "plan")


def spec_devices(spec: ProgramSpec) -> int:
    counts = [len(s.device_set) for x in jax.tree.leaves((spec.args, dict(spec.kwargs)))
              if (s := getattr(x, "sharding", None)) is not None]
    return max(counts, default=1)


def _cost(lowered: jax.stages.Lowered, compiled: jax.stages.Compiled, num_devices: int) -> tuple[float, float]:
    """(FLOPs, bytes accessed) per device."""
    cost = None
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001  (XLA:GPU: not implemented)
        cost = None
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    if cost and cost.get("flops") is not None:
        return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    from jax._src.lib import _jax  # XLA's HLO cost analysis, run by the CPU client

    cpu = jax.devices("cpu")[0].client
    # FLOPs: the program before optimisation (after it, matmuls are library calls that count 0),
    # over every device. Bytes: the optimised, partitioned program of one device, whose fusions
    # are what the memory system sees (before fusion every elementwise op would count its
    # operands again).
    before = _jax.hlo_module_cost_analysis(cpu, lowered._lowering.hlo().as_hlo_module())
    flops = float(before.get("flops", 0.0)) / num_devices
    accessed = float(before.get("bytes accessed", 0.0)) / num_devices
    try:
        after = _jax.hlo_module_cost_analysis(cpu, compiled.runtime_executable().hlo_modules()[0])
        accessed = float(after.get("bytes accessed", accessed))
    except Exception:  # noqa: BLE001  (no optimised module exposed: keep the unfused count)
        pass
    return flops, accessed


# Names the kernels give their pallas_call (or cuDNN its custom call), as they appear in a lowered
# program -> the name `plan --json` reports in a program's "attention".
_ATTENTION_KERNELS = (
    ("ragged_paged_attention", "ragged_paged"),  # jax's TPU kernel (kernels/paged_tpu.py)
    ("pallas_triton_paged_attention", "pallas_triton_paged"),  # ours (kernels/paged_gpu.py)
    ("pallas_triton_prefill_attention", "pallas_triton_prefill"),  # ours (kernels/prefill_gpu.py)
    ("pallas_mosaic_prefill_attention", "pallas_mosaic_prefill"),  # ours (kernels/prefill_tpu.py)
    ("splash_mha", "splash"), ("splash_mqa", "splash"),  # jax's TPU flash attention
    ("mha_forward", "pallas_triton_flash"), ("mha_backward", "pallas_triton_flash"),  # jax's Triton `mha`
    ("__cudnn$fmha", "cudnn"),  # jax.nn.dot_product_attention(implementation="cudnn")
)


# How each grouped matmul of a MoE block shows in a lowered program -> the name `plan --json`
# reports in a program's "grouped_matmul".
_GROUPED_MATMULS = (
    (re.compile(r"@t?gmm(?:_\d+)?\("), "megablox_gmm"),  # TPU Pallas kernels, jitted as gmm / tgmm
    (re.compile(r"custom_call @mosaic_gpu"), "mosaic_ragged_dot"),  # kernels/grouped_matmul_gpu.py (Hopper)
    (re.compile(r"chlo\.ragged_dot"), "ragged_dot"),  # XLA's lax.ragged_dot (dense over every group on GPU)
)


def grouped_matmul_kernels(program_text: str) -> tuple[str, ...]:
    """The grouped-matmul implementations compiled into a program, from its lowered text."""
    return tuple(name for pattern, name in _GROUPED_MATMULS if pattern.search(program_text))


def attention_kernels(program_text: str) -> tuple[str, ...]:
    """The attention kernels compiled into a program, from its lowered text, in a fixed order."""
    found: list[str] = []
    for pattern, name in _ATTENTION_KERNELS:
        if pattern in program_text and name not in found:
            found.append(name)
    return tuple(found)


def cache_path(target_name: str, text: str) -> pathlib.Path:
    key = hashlib.sha256(f"{_CACHE_VERSION}\n{target_name}\n{text}".encode()).hexdigest()[:32]
    return cache_dir() / f"{key}.json"


def cached_measure(target_name: str, text: str) -> Measured | None:
    """The plan cache's figures of a lowered program (its `as_text()`), None where it holds none:
    compiled peaks without compiling (`simulate --tune`)."""
    path = cache_path(target_name, text)
    try:
        return dataclasses.replace(Measured(**json.loads(path.read_text())), cached=True)
    except (OSError, ValueError, TypeError):
        return None


def measure(spec: ProgramSpec, target_name: str, *, use_cache: bool = True,
            lowered: jax.stages.Lowered | None = None, text: str | None = None) -> Measured:
    """Lowers (unless given `lowered`) and compiles `spec` (its arguments already sit on the
    target's fake devices). `text`: `lowered.as_text()` where the caller has it (a large
    program's text takes seconds to print)."""
    lowered = lowered if lowered is not None else spec.lower()
    text = text if text is not None else lowered.as_text()
    kernels = attention_kernels(text)
    path = cache_path(target_name, text)
    if use_cache and path.exists():
        try:
            return dataclasses.replace(Measured(**json.loads(path.read_text())), cached=True, attention=kernels)
        except (ValueError, TypeError):
            pass  # an unreadable entry is recompiled
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001
        needed = compile_time_oom_bytes(e)
        if needed is None:
            raise
        # libtpu refuses to compile a program whose temporaries exceed the chip: that is the
        # verdict, with the bytes it asked for (arguments counted on top, as for any program).
        args = bytes_per_device((spec.args, dict(spec.kwargs)))
        return Measured(argument_bytes=args, output_bytes=0, alias_bytes=0, temp_bytes=needed, flops=0.0,
                        bytes_accessed=0.0, num_devices=spec_devices(spec), compile_s=time.perf_counter() - t0,
                        attention=kernels)
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    num_devices = spec_devices(spec)
    flops, accessed = _cost(lowered, compiled, num_devices)
    out = Measured(argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
                   alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
                   flops=flops, bytes_accessed=accessed, num_devices=num_devices, compile_s=compile_s,
                   attention=kernels)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({k: v for k, v in dataclasses.asdict(out).items()
                                       if k not in ("cached", "attention")}))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home only costs the next run its compile time
    return out


_OOM = re.compile(r"HLO temporaries \(([0-9.]+)([KMGT])\)")


def compile_time_oom_bytes(error: Exception) -> int | None:
    """Temporaries a compiler said it needed when it refused a program for lack of memory
    (libtpu: "CompileTimeHbmOom ... HLO temporaries (104.31G) exceeds available HBM"); None for any
    other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "HbmOom" not in text:
        return None
    m = _OOM.search(text)
    if m is None:
        return None
    return int(float(m.group(1)) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2)])


def resident_bytes(spec: ProgramSpec) -> int:
    return bytes_per_device(spec.resident)


def describe(value: Any) -> str:
    return f"{value / (1 << 30):.2f} GiB"
