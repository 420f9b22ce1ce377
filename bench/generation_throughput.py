"""Generation benchmarks (issue: generation engine).

1. Generated tokens/s, areal_jax engine vs transformers `generate` (torch CPU), for each batch
   size in --batches (every row is printed): same random Qwen2 model, same prompts, greedy, fp32
   on both sides, a fixed number of new tokens. The two sides alternate for --rounds rounds (the
   engine compiled once per batch size, outside the timing); each round's ratio and the median
   are printed, so that load from other jobs on a shared machine hits both sides.
2. Continuous vs static batching when response lengths are long-tailed (log-normal, max/mean
   >= 4, enforced per request by max_new_tokens): same engine, same requests; static admits
   the next batch only when the whole previous batch has finished.
3. Per batch size, the engine's decode step: achieved FLOP/s and bytes/s against this machine's
   measured ceilings.
4. With --layouts: only the KV cache layouts on the long-tail workload (continuous batching),
   alternating over --rounds: the dense cache, the paged cache at the same slots and memory, and
   the paged cache with 2x the slots in the same memory (admission by pages, preemption counted).

Usage: .venv/bin/python -m bench.generation_throughput [--batches 16,64 --new 64] [--layouts]
"""

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.models import load_pretrained
from bench.common import machine, measured_ceilings, qwen2_bench_config, torch_side


def warm_engine(model, prompts, *, slots, max_seq_len, chunk, **config) -> GenerationEngine:
    """An engine with every program the timed workloads use compiled: prefill at each row count a
    refill may use, and decode over every cache window (a sample running to the end of the cache
    passes through all of them). `config`: more EngineConfig fields."""
    engine = GenerationEngine(model, EngineConfig(num_slots=slots, max_seq_len=max_seq_len, decode_chunk=chunk,
                                                  **config))
    warm = [engine.submit(prompts[0], SamplingParams(max_new_tokens=max_seq_len - len(prompts[0]) - 1,
                                                     temperature=0.0))]
    engine.run_until_idle()
    # Every prefill row count a refill may use (a few free slots at a chunk boundary: small calls).
    for rows in [b for b in engine.config.prefill_batch_buckets if b < slots] + [slots]:
        warm += [engine.submit(p, SamplingParams(max_new_tokens=chunk + 2, temperature=0.0)) for p in prompts[:rows]]
        engine.run_until_idle()
    for h in warm:
        h.result()
    return engine


def time_engine(engine, prompts, lengths, *, static, repeats=1):
    """Generated tokens/s over the whole workload `repeats` times, and the engine stats of that
    region alone. `static`: the next batch of num_slots requests only once the last has finished."""
    slots = engine.config.num_slots
    before = engine.stats()
    t0 = time.perf_counter()
    done = []
    for _ in range(repeats):
        if static:
            for i in range(0, len(prompts), slots):
                hs = [engine.submit(p, SamplingParams(max_new_tokens=n, temperature=0.0))
                      for p, n in zip(prompts[i:i + slots], lengths[i:i + slots])]
                engine.run_until_idle()
                done += [h.result() for h in hs]
        else:
            hs = [engine.submit(p, SamplingParams(max_new_tokens=n, temperature=0.0)) for p, n in zip(prompts, lengths)]
            engine.run_until_idle()
            done += [h.result() for h in hs]
    wall = time.perf_counter() - t0
    generated = sum(len(r.completions[0].tokens) for r in done)
    after = engine.stats()
    for field in ("decode_s", "prefill_s", "decode_steps", "busy_slot_steps", "generated_tokens"):
        setattr(after, field, getattr(after, field) - getattr(before, field))
    return generated / wall, after


def run_engine(model, prompts, lengths, *, slots, max_seq_len, chunk, static, repeats=1, **config):
    """`time_engine` on a freshly warmed engine."""
    engine = warm_engine(model, prompts, slots=slots, max_seq_len=max_seq_len, chunk=chunk, **config)
    return time_engine(engine, prompts, lengths, static=static, repeats=repeats)


def tail_workload(requests: int, vocab: int) -> tuple[np.ndarray, list[list[int]], int]:
    """Long-tailed lengths (log-normal, clipped to [4, 512]), 16-token prompts and the max_seq_len
    that holds them; their own generator, so the workload does not depend on what ran before."""
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(mean=np.log(24), sigma=1.0, size=requests), 4, 512).astype(int)
    prompts = [rng.integers(0, vocab, size=16).tolist() for _ in range(requests)]
    return lengths, prompts, 16 + int(lengths.max()) + 16


def compare_layouts(model, args) -> None:
    """[4]: dense vs paged KV cache on the long-tail workload, alternating over rounds."""
    lengths, prompts, max_seq_len = tail_workload(args.requests, model.config.vocab_size)
    slots, chunk = args.tail_slots, args.tail_chunk
    pages_per_seq = -(-max_seq_len // args.page_size)
    setups = {
        "dense": dict(slots=slots, kv_layout="dense"),
        f"paged (page {args.page_size})": dict(slots=slots, kv_layout="paged", page_size=args.page_size),
        f"paged, {2 * slots} slots, same memory": dict(slots=2 * slots, kv_layout="paged", page_size=args.page_size,
                                                      kv_pool_pages=slots * pages_per_seq),
    }
    engines = {name: warm_engine(model, prompts, max_seq_len=max_seq_len, chunk=chunk, **kw)
               for name, kw in setups.items()}
    results = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            results[name].append(time_engine(engine, prompts, lengths.tolist(), static=False))
    print(f"[4] KV cache layouts: {args.requests} requests, lengths log-normal (mean {lengths.mean():.1f}, max "
          f"{lengths.max()}), max_seq_len {max_seq_len}, decode chunk {chunk}; continuous batching, tokens/s")
    for name, runs in results.items():
        tps = [t for t, _ in runs]
        stats = runs[-1][1]
        print(f"    {name:32s}: median {statistics.median(tps):7.0f} ({', '.join(f'{t:.0f}' for t in tps)}); "
              f"occupancy {stats.slot_occupancy:.1f}, preempted {engines[name].stats().preempted_samples}")


def decode_step_traffic(cfg, batch: int, max_seq_len: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step over `batch` slots: every layer weight and the LM head are
    read once, the embedding only at the batch's rows, and each slot's whole cache row (length S)."""
    d, h = cfg.hidden_size, cfg.head_dim
    layer = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * h + cfg.num_heads * h * d + 3 * d * cfg.intermediate_size
    matmul_params = cfg.num_layers * layer + d * cfg.vocab_size
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * h * 4 * batch * max_seq_len
    return 2 * matmul_params * batch, 4 * (matmul_params + batch * d) + kv_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="16,64", help="comma-separated batch sizes (slots = batch)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tail-slots", type=int, default=16)
    ap.add_argument("--tail-chunk", type=int, default=EngineConfig.decode_chunk,
                    help="decode chunk of the long-tail workload (default: the engine's own default)")
    ap.add_argument("--iters", type=int, default=2,
                    help="timed repetitions of each fixed-length batch per round, both sides")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two sides per batch size")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--layouts", action="store_true", help="only [4]: dense vs paged KV cache")
    ap.add_argument("--page-size", type=int, default=EngineConfig.page_size)
    args = ap.parse_args()
    if args.layouts:
        print(f"machine: {machine()}; load average at start: {os.getloadavg()[0]:.2f}")
        with tempfile.TemporaryDirectory() as d:
            torch_side("make_model", out=d, config=qwen2_bench_config(layers=4, hidden=256))
            compare_layouts(load_pretrained(d), args)
        print(f"load average at end: {os.getloadavg()[0]:.2f}")
        return
    batches = [int(b) for b in args.batches.split(",")]
    hf = qwen2_bench_config(layers=4, hidden=256)
    rng = np.random.default_rng(0)
    print(f"machine: {machine()}; load average at start: {os.getloadavg()[0]:.2f}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        info = torch_side("make_model", out=d, config=hf)
        model = load_pretrained(d)
        max_seq_len = args.prompt + args.new + 16
        for batch in batches:
            prompts = [rng.integers(0, hf["vocab_size"], size=args.prompt).tolist() for _ in range(batch)]
            engine = warm_engine(model, prompts, slots=batch, max_seq_len=max_seq_len, chunk=args.chunk)
            rounds = []
            for _ in range(args.rounds):
                jax_tps, stats = time_engine(engine, prompts, [args.new] * batch, static=False, repeats=args.iters)
                torch_tps = torch_side("generate", model=d, prompts=prompts, max_new_tokens=args.new,
                                       iters=args.iters, threads=args.threads)["tokens_per_s"]
                rounds.append((jax_tps, torch_tps, stats))
            del engine
            rows.append((batch, rounds))

        lengths, tail_prompts, tail_len = tail_workload(args.requests, hf["vocab_size"])
        cont_tps, cont_stats = run_engine(model, tail_prompts, lengths.tolist(), slots=args.tail_slots,
                                          max_seq_len=tail_len, chunk=args.tail_chunk, static=False)
        stat_tps, stat_stats = run_engine(model, tail_prompts, lengths.tolist(), slots=args.tail_slots,
                                          max_seq_len=tail_len, chunk=args.tail_chunk, static=True)

    ceil = measured_ceilings()
    print(f"model: {info['params'] / 1e6:.1f}M params (Qwen2-shaped, 4 layers, hidden 256), fp32 on both sides; "
          f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"[1] greedy, prompt {args.prompt}, {args.new} new tokens, decode chunk {args.chunk}; generated tokens/s")
    for batch, rounds in rows:
        ratios = [j / t for j, t, _ in rounds]
        print(f"    batch {batch:3d}: engine {statistics.median(j for j, _, _ in rounds):7.0f}   torch generate "
              f"{statistics.median(t for _, t, _ in rounds):7.0f} (medians)   ratio median "
              f"{statistics.median(ratios):.2f}x over {len(rounds)} rounds ({', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"[2] {args.requests} requests, lengths log-normal: mean {lengths.mean():.1f}, max {lengths.max()}, "
          f"max/mean {lengths.max() / lengths.mean():.1f}; {args.tail_slots} slots, decode chunk {args.tail_chunk}")
    print(f"    continuous batching: {cont_tps:9.0f} tokens/s (slot occupancy {cont_stats.slot_occupancy:.1f})")
    print(f"    static batching    : {stat_tps:9.0f} tokens/s (slot occupancy {stat_stats.slot_occupancy:.1f})")
    print(f"    ratio              : {cont_tps / stat_tps:.2f}x")
    print(f"[3] decode step, fastest round (ceilings: matmul {ceil['matmul_flops'] / 1e9:.0f} GFLOP/s, "
          f"copy {ceil['copy_bytes'] / 1e9:.1f} GB/s)")
    for batch, rounds in rows:
        step_s = min(stats.decode_s / max(stats.decode_steps, 1) for _, _, stats in rounds)
        flops, nbytes = decode_step_traffic(model.config, batch, max_seq_len)
        print(f"    batch {batch:3d}: {1e3 * step_s:.2f} ms/step, {flops / step_s / 1e9:.1f} GFLOP/s "
              f"({100 * flops / step_s / ceil['matmul_flops']:.0f}% of ceiling), {nbytes / step_s / 1e9:.2f} GB/s "
              f"({100 * nbytes / step_s / ceil['copy_bytes']:.0f}% of ceiling; {nbytes / 1e6:.1f} MB read per step)")


if __name__ == "__main__":
    main()
