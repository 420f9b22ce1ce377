"""Forward tokens/s: areal_jax vs transformers (torch CPU) on the same random Qwen2 model.

Usage: .venv/bin/python -m bench.forward_throughput [--rows 4 --width 512 --iters 5 --rounds 2]
Both sides compute the same logits for the same [R, W] rows of packed sequences: areal_jax
from segment ids, transformers from a block-causal 4-D mask and per-sequence position ids
(bench/torch_side.py); a slice of the logits is compared before any timing counts.
The two sides alternate for --rounds rounds, so that load from other jobs on a shared machine
hits both; each round's ratio is printed, then the median. A last line times one layer's
attention alone, dense vs causal-blocked, on the same packed rows.
"""

import argparse
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models import load_pretrained
from areal_jax.models.attention import attention, causal_attention
from areal_jax.models.transformer import forward
from bench.common import machine, measured_ceilings, packed_rows, qwen2_bench_config, timed, torch_side


def attention_alone(cfg, seg: np.ndarray, iters: int) -> tuple[float, float]:
    """Seconds per call of dense and causal-blocked attention on one layer's q, k, v."""
    B, T = seg.shape
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(B, T, cfg.num_heads, cfg.head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, cfg.num_kv_heads, cfg.head_dim)), jnp.float32) for _ in range(2))
    idx = np.arange(T)
    mask = jnp.asarray((idx[:, None] >= idx[None, :])[None] & (seg[:, :, None] == seg[:, None, :])
                       & (seg[:, None, :] > 0))
    return tuple(timed(lambda f=jax.jit(fn): f(q, k, v, mask).block_until_ready(), iters)
                 for fn in (attention, causal_attention))


LOGITS_SAMPLE = (37, 64)  # logits [:, ::37, :64] are compared between the sides


def check_same_logits(ours: np.ndarray, torch_result: dict) -> None:
    """Both sides must compute the same function: compare the slice torch_side returns."""
    theirs = np.asarray(torch_result["logits_sample"], np.float32)
    mine = ours[:, ::LOGITS_SAMPLE[0], :LOGITS_SAMPLE[1]]
    diff = float(np.max(np.abs(mine - theirs)))
    scale = float(np.max(np.abs(theirs)))
    print(f"logits check: max abs diff {diff:.2e} over {theirs.size} values (logit scale {scale:.2f})")
    if diff > 1e-3 * max(scale, 1.0):
        raise SystemExit("areal_jax and transformers disagree on the packed batch's logits")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    hf = qwen2_bench_config()
    ratios, jax_runs, torch_runs = [], [], []
    with tempfile.TemporaryDirectory() as d:
        info = torch_side("make_model", out=d, config=hf)
        ids, seg = packed_rows(np.random.default_rng(0), args.rows, args.width, hf["vocab_size"], 128)
        model = load_pretrained(d)
        cfg, params = model.config, model.params
        fwd = jax.jit(lambda p, i, s: forward(p, cfg, i, segment_ids=s)[0])
        check_same_logits(np.asarray(fwd(params, ids, seg)), torch_side(
            "forward", model=d, rows=ids.tolist(), segments=seg.tolist(), iters=0, threads=args.threads,
            sample=LOGITS_SAMPLE))
        for r in range(args.rounds):
            jax_runs.append(ids.size / timed(lambda: fwd(params, ids, seg).block_until_ready(), args.iters))
            torch_runs.append(torch_side("forward", model=d, rows=ids.tolist(), segments=seg.tolist(),
                                         iters=args.iters, threads=args.threads)["tokens_per_s"])
            ratios.append(jax_runs[-1] / torch_runs[-1])
            print(f"round {r}: areal_jax {jax_runs[-1]:.0f} tokens/s, torch {torch_runs[-1]:.0f} tokens/s, "
                  f"ratio {ratios[-1]:.2f}x", flush=True)
    t_dense, t_blocked = attention_alone(cfg, seg, args.iters)
    jax_tps = max(jax_runs)
    t_jax = ids.size / jax_tps
    non_embed = info["params"] - 2 * hf["vocab_size"] * hf["hidden_size"]
    flops = 2 * (non_embed + hf["vocab_size"] * hf["hidden_size"]) * ids.size + 4 * hf["num_hidden_layers"] * (
        args.width ** 2 / 2) * hf["hidden_size"] * args.rows
    ceil = measured_ceilings()
    print(f"machine: {machine()}; model: {info['params'] / 1e6:.1f}M params (Qwen2-shaped, 8 layers, hidden 512)")
    print(f"batch: {args.rows} rows x {args.width} tokens, packed sequences (mean length ~128)")
    print(f"areal_jax  : {jax_tps:10.0f} tokens/s best of {args.rounds} ({flops / t_jax / 1e9:.1f} GFLOP/s; "
          f"{100 * flops / t_jax / ceil['matmul_flops']:.0f}% of measured fp32 matmul "
          f"{ceil['matmul_flops'] / 1e9:.0f} GFLOP/s)")
    print(f"torch      : {max(torch_runs):10.0f} tokens/s best of {args.rounds}")
    print(f"attention alone, one layer: dense {t_dense * 1e3:.1f} ms, causal-blocked {t_blocked * 1e3:.1f} ms "
          f"({t_dense / t_blocked:.2f}x)")
    print(f"ratio areal_jax / torch: median {statistics.median(ratios):.2f}x over {args.rounds} rounds "
          f"({', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
