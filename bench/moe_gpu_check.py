"""The MoE grouped matmul on the GPU at hand: the Mosaic kernels against XLA's ragged dot.

One Qwen3-30B-A3B expert projection pair per call (D 2,048, Fe 768 halved by tensor = 2, 128
experts, 8 per token), tokens routed at random (skewed: a Zipf-like expert popularity), bf16:
- values: the forward and both gradients of `expert_mlp` with `impl="auto"` (the Mosaic kernels
  on Hopper) against `impl="ragged_dot"`, as the largest difference relative to the reference's
  largest magnitude (both accumulate in fp32; bf16 outputs round differently);
- time: median seconds of forward+backward of each, and the kernel's useful TFLOP/s (the routed
  work only: 3 projections x 3 products x 2 A D Fe).

Usage: python -m bench.moe_gpu_check [--tiny] [--out moe_gpu_check.json]
`--tiny` runs on the CPU with ragged_dot on both sides: the plumbing only. Prints one JSON line.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.accelerator_probe import run_parts
from bench.paged_check import _median_s

SHAPES = {"full": dict(tokens=8192, experts=128, k=8, hidden=2048, expert_hidden=384, repeats=10),
          "tiny": dict(tokens=64, experts=8, k=2, hidden=64, expert_hidden=64, repeats=1)}


def check(s: dict, tiny: bool) -> dict:
    from areal_jax.kernels.grouped_matmul import GROUPED_MATMUL
    from areal_jax.models.moe import expert_mlp

    M, E, k, D, F = s["tokens"], s["experts"], s["k"], s["hidden"], s["expert_hidden"]
    rng = np.random.default_rng(0)
    popularity = 1.0 / np.arange(1, E + 1) ** 0.8
    experts = np.stack([rng.choice(E, k, replace=False, p=popularity / popularity.sum()) for _ in range(M)])
    keys = jax.random.split(jax.random.key(0), 5)
    dt = jnp.bfloat16
    x = jax.random.normal(keys[0], (M, D), dt)
    wg, wu = (jax.random.normal(kk, (E, D, F), dt) * D ** -0.5 for kk in keys[1:3])
    wd = jax.random.normal(keys[3], (E, F, D), dt) * F ** -0.5
    weights = jax.nn.softmax(jax.random.normal(keys[4], (M, k)), axis=-1)
    experts = jnp.asarray(experts, jnp.int32)

    def grads(impl):
        def loss(x, wg, wu, wd):
            out, _ = expert_mlp(x, experts, weights, wg, wu, wd, impl)
            return jnp.sum(out.astype(jnp.float32) ** 2), out
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))

    kernel_impl = "ragged_dot" if tiny else "auto"
    kernel, reference = grads(kernel_impl), grads("ragged_dot")
    (_, out_k), g_k = kernel(x, wg, wu, wd)
    (_, out_r), g_r = reference(x, wg, wu, wd)

    def rel(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

    kernel_s = _median_s(kernel, x, wg, wu, wd, repeats=s["repeats"])
    reference_s = _median_s(reference, x, wg, wu, wd, repeats=s["repeats"])
    flops = 3 * 3 * 2 * M * k * D * F
    return {
        "shape": s, "kernel": GROUPED_MATMUL.kernel_name("auto" if not tiny else "reference"),
        "relative_error": {"out": rel(out_k, out_r), **{f"d_{n}": rel(a, b) for n, a, b in
                                                         zip(("x", "we_gate", "we_up", "we_down"), g_k, g_r)}},
        "kernel_s": kernel_s, "ragged_dot_s": reference_s, "speedup": reference_s / kernel_s,
        "kernel_tflops": flops / kernel_s / 1e12,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = {"device": str(jax.devices()[0].device_kind), "errors": {}}
    shapes = SHAPES["tiny" if args.tiny else "full"]
    return run_parts(result, {"grouped_matmul": lambda: check(shapes, args.tiny)}, (), args.out, tag="moe_gpu_check")


if __name__ == "__main__":
    raise SystemExit(1 if main()["errors"] else 0)
