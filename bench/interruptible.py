"""Interruptible vs non-interruptible generation under periodic weight updates.

A trainer-like thread pushes new weights every --update-every seconds while the engine serves
a steady stream of requests with long-tailed lengths (geometric: a random policy and two stop
tokens, capped). Interruptible: the swap happens at the next chunk boundary and in-flight
samples are re-prefilled. Non-interruptible: admission stops until in-flight samples finish on
the old weights. Reported: generated tokens/s over the same wall-clock window.

Usage: .venv/bin/python -m bench.interruptible [--seconds 30 --warmup 20 --update-every 2]
"""

import argparse
import threading
import time

import jax
import numpy as np

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.models import ModelConfig, init_params
from bench.common import machine


def run(interruptible: bool, args, cfg, params_by_version) -> dict:
    engine = GenerationEngine((cfg, params_by_version[0]), EngineConfig(
        num_slots=args.slots, max_seq_len=args.max_new + 32, decode_chunk=8, interruptible=interruptible))
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, stop_token_ids=(3, 5))
    warm = engine.submit([1, 2, 3], sp, n=args.slots)
    engine.run_until_idle()
    warm.result()
    engine.start()
    stop = threading.Event()
    swaps = []

    def trainer():
        version = 0
        while not stop.wait(args.update_every):
            version += 1
            t0 = time.perf_counter()
            engine.update_weights(params_by_version[version % len(params_by_version)], version).result()
            swaps.append(time.perf_counter() - t0)

    pusher = threading.Thread(target=trainer)
    pusher.start()
    handles = []

    def serve(seconds):
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            while engine.stats().queued_requests < 2 * args.slots:  # keep the queue full
                handles.append(engine.submit(rng.integers(0, cfg.vocab_size, size=16).tolist(), sp))
            time.sleep(0.01)

    serve(args.warmup)  # compiles the re-prefill programs (one per prefill length bucket)
    swaps.clear()
    before = engine.stats().generated_tokens
    t0 = time.perf_counter()
    serve(args.seconds)
    stop.set()
    pusher.join()
    generated = engine.stats().generated_tokens - before
    wall = time.perf_counter() - t0
    engine.stop()
    return {"tps": generated / wall, "swaps": len(swaps), "swap_wait_s": float(np.mean(swaps)) if swaps else 0.0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--warmup", type=float, default=20)
    ap.add_argument("--update-every", type=float, default=2.0)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=256)
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32)
    params_by_version = [init_params(cfg, seed, std=0.02) for seed in range(3)]
    results = {mode: run(mode == "interruptible", args, cfg, params_by_version)
               for mode in ("interruptible", "non-interruptible")}
    print(f"machine: {machine()}; {args.slots} slots, up to {args.max_new} new tokens, weights pushed every "
          f"{args.update_every} s for {args.seconds} s")
    for mode, r in results.items():
        print(f"{mode:18s}: {r['tps']:8.0f} generated tokens/s, {r['swaps']} swaps, "
              f"mean wait for a swap to apply {1e3 * r['swap_wait_s']:.0f} ms")
    print(f"ratio interruptible / non-interruptible: {results['interruptible']['tps'] / results['non-interruptible']['tps']:.2f}x")


if __name__ == "__main__":
    main()
