"""Generation benchmarks (issue: generation engine).

1. Generated tokens/s, areal_jax engine vs transformers `generate` (torch CPU): same random
   Qwen2 model, same prompts, greedy, fixed number of new tokens.
2. Continuous vs static batching when response lengths are long-tailed (log-normal, max/mean
   >= 4, enforced per request by max_new_tokens): same engine, same requests; static admits
   the next batch only when the whole previous batch has finished.
3. Achieved FLOP/s and bytes/s of decoding against this machine's measured ceilings.

Usage: .venv/bin/python bench/generation_throughput.py [--batch 16 --new 64]
"""

import argparse
import os
import tempfile
import time

import numpy as np

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.models import load_pretrained
from bench.common import machine, measured_ceilings, qwen2_bench_config, torch_side


def run_engine(model, prompts, lengths, *, slots, max_seq_len, chunk, static):
    engine = GenerationEngine(model, EngineConfig(num_slots=slots, max_seq_len=max_seq_len, decode_chunk=chunk))
    # Compile outside the timed region: single and batched prefill, decode.
    warm = [engine.submit(prompts[0], SamplingParams(max_new_tokens=chunk + 2, temperature=0.0))]
    engine.run_until_idle()
    warm += [engine.submit(p, SamplingParams(max_new_tokens=chunk + 2, temperature=0.0)) for p in prompts[:slots]]
    engine.run_until_idle()
    for h in warm:
        h.result()
    before = engine.stats()
    t0 = time.perf_counter()
    if static:
        done = []
        for i in range(0, len(prompts), slots):
            hs = [engine.submit(p, SamplingParams(max_new_tokens=n, temperature=0.0))
                  for p, n in zip(prompts[i:i + slots], lengths[i:i + slots])]
            engine.run_until_idle()
            done += [h.result() for h in hs]
    else:
        hs = [engine.submit(p, SamplingParams(max_new_tokens=n, temperature=0.0)) for p, n in zip(prompts, lengths)]
        engine.run_until_idle()
        done = [h.result() for h in hs]
    wall = time.perf_counter() - t0
    generated = sum(len(r.completions[0].tokens) for r in done)
    after = engine.stats()  # the timed region only (the warm-up's compile time excluded)
    for field in ("decode_s", "prefill_s", "decode_steps", "busy_slot_steps", "generated_tokens"):
        setattr(after, field, getattr(after, field) - getattr(before, field))
    return generated / wall, after


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    hf = qwen2_bench_config(layers=4, hidden=256)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, hf["vocab_size"], size=args.prompt).tolist() for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as d:
        info = torch_side("make_model", out=d, config=hf)
        model = load_pretrained(d)
        max_seq_len = args.prompt + args.new + 16
        jax_tps, stats = run_engine(model, prompts, [args.new] * args.batch, slots=args.batch,
                                    max_seq_len=max_seq_len, chunk=args.chunk, static=False)
        torch_res = torch_side("generate", model=d, prompts=prompts, max_new_tokens=args.new, iters=1,
                               threads=args.threads)

        # Long-tailed lengths: log-normal, clipped to [4, 512].
        lengths = np.clip(rng.lognormal(mean=np.log(24), sigma=1.0, size=args.requests), 4, 512).astype(int)
        tail_prompts = [rng.integers(0, hf["vocab_size"], size=16).tolist() for _ in range(args.requests)]
        tail_len = 16 + int(lengths.max()) + 16
        cont_tps, cont_stats = run_engine(model, tail_prompts, lengths.tolist(), slots=args.batch,
                                          max_seq_len=tail_len, chunk=args.chunk, static=False)
        stat_tps, stat_stats = run_engine(model, tail_prompts, lengths.tolist(), slots=args.batch,
                                          max_seq_len=tail_len, chunk=args.chunk, static=True)

    ceil = measured_ceilings()
    cfg = model.config
    weight_bytes = 4 * info["params"]
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    flops_per_token = 2 * info["params"]
    step_s = stats.decode_s / max(stats.decode_steps, 1)
    # Per decode step the engine reads all weights once and each slot's whole cache row (length S).
    bytes_per_step = weight_bytes + args.batch * max_seq_len * kv_bytes_per_token
    print(f"machine: {machine()}; model: {info['params'] / 1e6:.1f}M params (Qwen2-shaped, 4 layers, hidden 256)")
    print(f"[1] batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, greedy")
    print(f"    areal_jax engine : {jax_tps:9.0f} generated tokens/s")
    print(f"    torch generate   : {torch_res['tokens_per_s']:9.0f} generated tokens/s")
    print(f"    ratio            : {jax_tps / torch_res['tokens_per_s']:.2f}x")
    print(f"[2] {args.requests} requests, lengths log-normal: mean {lengths.mean():.1f}, max {lengths.max()}, "
          f"max/mean {lengths.max() / lengths.mean():.1f}; {args.batch} slots")
    print(f"    continuous batching: {cont_tps:9.0f} tokens/s (slot occupancy {cont_stats.slot_occupancy:.1f})")
    print(f"    static batching    : {stat_tps:9.0f} tokens/s (slot occupancy {stat_stats.slot_occupancy:.1f})")
    print(f"    ratio              : {cont_tps / stat_tps:.2f}x")
    print(f"[3] decode step {1e3 * step_s:.2f} ms for {args.batch} slots: "
          f"{flops_per_token * args.batch / step_s / 1e9:.2f} GFLOP/s "
          f"({100 * flops_per_token * args.batch / step_s / ceil['matmul_flops']:.1f}% of matmul ceiling "
          f"{ceil['matmul_flops'] / 1e9:.0f} GFLOP/s), "
          f"{bytes_per_step / step_s / 1e9:.2f} GB/s ({100 * bytes_per_step / step_s / ceil['copy_bytes']:.1f}% of "
          f"copy ceiling {ceil['copy_bytes'] / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
