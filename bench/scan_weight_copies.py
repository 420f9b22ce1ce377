"""Does a scan over stacked weights copy each layer's slice before its matmul? Deviceless compiles.

A decode-sized MLP stack (8 layers of [4096, 14336] bf16, 128 rows) runs as a `lax.scan` over the
stacked weights inside a loop, compiled for a target without its hardware (plan/targets.py); the
compiled temporaries say whether XLA materialised a layer's weights (one layer is 112 MiB here).
GPU targets compile twice: with XLA's defaults (Triton GEMMs) and with the options a scanned
engine's programs use (generation/programs.py SCAN_GPU_OPTIONS: cuBLAS GEMMs and dynamic-slice
fusion). Usage: python -m bench.scan_weight_copies [--target 8xh100] (TPU targets need libtpu and
TPU_SKIP_MDS_QUERY=1). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from areal_jax.generation.programs import SCAN_GPU_OPTIONS  # noqa: E402
from areal_jax.plan.targets import parse_target, topology_devices  # noqa: E402

L, B, D, F = 8, 128, 4096, 14336


def temporaries_mib(target: str, options: dict | None) -> float:
    mesh = Mesh(np.array(topology_devices(parse_target(target), 1)[:1]), ("x",))
    whole = NamedSharding(mesh, PartitionSpec())
    up = jax.ShapeDtypeStruct((L, D, F), jnp.bfloat16, sharding=whole)
    down = jax.ShapeDtypeStruct((L, F, D), jnp.bfloat16, sharding=whole)
    x = jax.ShapeDtypeStruct((B, D), jnp.bfloat16, sharding=whole)

    def steps(w_up, w_down, x):
        def layer(x, w):
            return x + jax.nn.silu(x @ w[0]) @ w[1], None
        return jax.lax.fori_loop(0, 4, lambda _, x: jax.lax.scan(layer, x, (w_up, w_down))[0], x)

    compiled = jax.jit(steps, compiler_options=options).lower(up, down, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="8xh100")
    args = ap.parse_args()
    out = {"target": args.target, "layer_weights_mib": 2 * D * F * 2 / 2**20,
           "temporaries_mib": {"defaults": temporaries_mib(args.target, None)}}
    if parse_target(args.target).platform != "tpu":
        out["temporaries_mib"]["scan_gpu_options"] = temporaries_mib(args.target, SCAN_GPU_OPTIONS)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
