"""Memory of the attention gradient by row length: flash attention against the blocked formula.

For one attention call over packed rows (B rows of T tokens, GQA), prints per T:
  saved     bytes autodiff keeps between forward and backward (the vjp's residuals)
  temp      XLA's compiled temporaries of value-and-gradient (`memory_analysis()`, this backend)
  seconds   wall time of one value-and-gradient after compilation (median of --repeats)

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu .venv/bin/python -m bench.flash_attention_memory --lengths 1024 2048 4096
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.kernels.flash_attention import reference_flash_attention
from areal_jax.models.attention import causal_attention


def packed(rng: np.random.Generator, B: int, T: int) -> np.ndarray:
    """Segment ids `[B, T]`: sequences of 64..T/2 tokens back to back, the row's tail padding."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        pos, k = 0, 1
        while pos < T - 64:
            n = int(rng.integers(64, max(65, T // 2)))
            seg[b, pos:pos + n] = k
            pos, k = pos + n, k + 1
    return seg


def blocked(q, k, v, seg):
    T = q.shape[1]
    idx = jnp.arange(T)
    mask = (idx[None, :, None] >= idx[None, None, :]) & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    return causal_attention(q, k, v, mask)


def measure(fn, q, k, v, seg, repeats: int) -> tuple[int, int, float]:
    leaves = jax.eval_shape(lambda *a: jax.tree.leaves(jax.vjp(lambda q, k, v: fn(q, k, v, seg), *a)[1]), q, k, v)
    saved = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
    step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg) ** 2), argnums=(0, 1, 2)))
    compiled = step.lower(q, k, v).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - t0)
    return saved, temp, statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("N", "K"))
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    N, K = args.heads
    print(f"B={args.rows} N={N} K={K} H={args.head_dim} fp32, backend {jax.default_backend()}")
    print(f"{'T':>6} {'impl':>8} {'saved MB':>9} {'temp MB':>9} {'grad s':>8}")
    for T in args.lengths:
        seg = jnp.asarray(packed(rng, args.rows, T))
        q = jnp.asarray(rng.normal(size=(args.rows, T, N, args.head_dim)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(args.rows, T, K, args.head_dim)), jnp.float32) for _ in range(2))
        for name, fn in (("blocked", blocked), ("flash", reference_flash_attention)):
            saved, temp, secs = measure(fn, q, k, v, seg, args.repeats)
            print(f"{T:>6} {name:>8} {saved / 2**20:>9.1f} {temp / 2**20:>9.1f} {secs:>8.3f}", flush=True)
    print(f"load average {os.getloadavg()}; command: {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
