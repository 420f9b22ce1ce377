"""Forward tokens/s: areal_jax vs transformers (torch CPU) on the same random Qwen2 model.

Usage: .venv/bin/python bench/forward_throughput.py [--rows 4 --width 512 --iters 5]
Both sides see the same [R, W] token rows; areal_jax packs several sequences per row
(segment-masked attention), torch runs the rows as plain causal sequences (same FLOPs).
"""

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models import load_pretrained
from areal_jax.models.transformer import forward
from bench.common import machine, measured_ceilings, packed_rows, qwen2_bench_config, timed, torch_side


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    hf = qwen2_bench_config()
    with tempfile.TemporaryDirectory() as d:
        info = torch_side("make_model", out=d, config=hf)
        ids, seg = packed_rows(np.random.default_rng(0), args.rows, args.width, hf["vocab_size"], 128)
        model = load_pretrained(d)
        cfg, params = model.config, model.params
        fwd = jax.jit(lambda p, i, s: forward(p, cfg, i, segment_ids=s)[0])
        t_jax = timed(lambda: fwd(params, ids, seg).block_until_ready(), args.iters)
        torch_res = torch_side("forward", model=d, rows=ids.tolist(), iters=args.iters, threads=args.threads)
    tokens = ids.size
    jax_tps = tokens / t_jax
    non_embed = info["params"] - 2 * hf["vocab_size"] * hf["hidden_size"]
    flops = 2 * (non_embed + hf["vocab_size"] * hf["hidden_size"]) * tokens + 4 * hf["num_hidden_layers"] * (
        args.width ** 2 / 2) * hf["hidden_size"] * args.rows
    ceil = measured_ceilings()
    print(f"machine: {machine()}; model: {info['params'] / 1e6:.1f}M params (Qwen2-shaped, 8 layers, hidden 512)")
    print(f"batch: {args.rows} rows x {args.width} tokens, packed sequences (mean length ~128)")
    print(f"areal_jax  : {jax_tps:10.0f} tokens/s  ({flops / t_jax / 1e9:.1f} GFLOP/s; "
          f"{100 * flops / t_jax / ceil['matmul_flops']:.0f}% of measured fp32 matmul "
          f"{ceil['matmul_flops'] / 1e9:.0f} GFLOP/s)")
    print(f"torch      : {torch_res['tokens_per_s']:10.0f} tokens/s")
    print(f"ratio areal_jax / torch: {jax_tps / torch_res['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
