"""Compiles flash attention's value-and-gradient for a TPU or GPU target from this host (no device)
and prints, per row length, the custom calls in the program and XLA's temporaries.

TPU: splash through libtpu (v5e, one chip); GPU: the Pallas Triton kernel through XLA:GPU (H100),
traced under an abstract mesh naming the device, which Pallas asks for its compute capability
(DESIGN.md section 7). One attention call of Qwen3-1.7B's shape by default (16 query heads,
8 kv heads of 128), bf16, one row.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu .venv/bin/python -m bench.flash_attention_targets --target gpu
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 flock /tmp/libtpu.lock \\
        .venv/bin/python -m bench.flash_attention_targets --target tpu
"""

from __future__ import annotations

import argparse
import contextlib
import re

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from areal_jax.kernels.dispatch import target_platform
from areal_jax.kernels.flash_attention import flash_attention, kernel_name


def device(target: str):
    from jax.experimental import topologies

    from areal_jax.plan.targets import gpu_target_config

    if target == "tpu":
        return topologies.get_topology_desc("v5e:1x1", "tpu").devices[0]
    return topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config("h100"),
                                        topology="1x1x1").devices[0]


def trace_context(target: str):
    if target == "tpu":
        return contextlib.nullcontext()
    from jax._src.mesh import AbstractDevice

    abstract = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    return jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                                                       abstract_device=abstract))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=("gpu", "tpu"), required=True)
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--heads", type=int, nargs=2, default=[16, 8], metavar=("N", "K"))
    p.add_argument("--head_dim", type=int, default=128)
    args = p.parse_args(argv)
    N, K = args.heads
    H = args.head_dim
    replicated = NamedSharding(Mesh([device(args.target)], ("x",)), PartitionSpec())

    def loss(q, k, v, seg):
        return jnp.sum(flash_attention(q, k, v, seg).astype(jnp.float32) ** 2)

    print(f"target {args.target}: N={N} K={K} H={H} bf16, one row; kernel {kernel_name('auto', args.target)}")
    for T in args.lengths:
        shapes = [(1, T, N, H), (1, T, K, H), (1, T, K, H)]
        specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=replicated) for s in shapes]
        specs.append(jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=replicated))
        with target_platform(args.target), trace_context(args.target):
            lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*specs)
        compiled = lowered.compile()
        calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))
        memory = compiled.memory_analysis()
        print(f"T={T:>6}: temporaries {memory.temp_size_in_bytes / 2**20:8.1f} MiB, arguments "
              f"{memory.argument_size_in_bytes / 2**20:7.1f} MiB; custom calls {calls}", flush=True)


if __name__ == "__main__":
    main()
