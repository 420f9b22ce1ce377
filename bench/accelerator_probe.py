"""Accelerator probe: decode tokens/s against the HBM roofline and a training step's MFU.

On a random Qwen2-shaped model (~0.4B parameters in bf16 by default; `--tiny` for a CPU smoke
run), through the public APIs the RL loop uses:

1. Decode: `GenerationEngine` with `slots` prompts of `prompt_len` tokens, each generating
   `new_tokens`. Each decode step must read every weight it multiplies by once plus the KV cache
   in use (every slot's context so far), so
       roofline tokens/s = slots * HBM bytes/s / (weight bytes + mean cache bytes per step).
   Achieved = the engine's decode-generated tokens over its decode seconds (prefill excluded),
   median over repeats after a warm-up run of the same workload (which compiles every program).
   The engine attends over a power-of-two window of the cache, not just the part in use, so the
   window roofline (`roofline_window_tokens_per_s`) is the tighter bound for this engine.
2. Train: `JaxTrainEngine` (bf16 compute, one minibatch) on packed micro-batches of full-length
   sequences (no padding), tokens/s and MFU = 6 * flop_params * tokens/s / peak FLOP/s, where
   flop_params counts the matrices each token multiplies by (layers + LM head, not the embedding
   lookup) and attention's score/value products are left out, as MFU is usually quoted.

Peaks default to the H200's published figures (989 TFLOP/s dense bf16, 4.8 TB/s HBM3e:
https://www.nvidia.com/en-us/data-center/h200/). A small measured-ceilings section (one bf16
matmul, one device copy) shows what this device actually reaches.

Usage: python -m bench.accelerator_probe [--tiny] [--out probe.json]
Prints one JSON object (last line of stdout) and writes it to --out when given.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.models import ModelConfig, init_params, param_shapes
from areal_jax.ppo import AdvantageConfig
from areal_jax.rollout.types import Trajectory, TrajectoryGroup
from areal_jax.trainer.batching import build_sequences, make_microbatches
from areal_jax.trainer.optimizer import OptimizerConfig
from areal_jax.trainer.algorithm import ppo_trainer
from areal_jax.trainer.config import PPOConfig, TrainEngineConfig

H200_PEAK_BF16_FLOPS = 989e12
H200_HBM_BYTES_PER_S = 4.8e12

# Numbers the probe always produces (finite and > 0); the test checks each.
REQUIRED = {
    "model": ("params", "flop_params", "weight_bytes_bf16"),
    "decode": ("tokens_per_s", "wall_tokens_per_s", "weight_bytes_per_step", "cache_bytes_per_step",
               "roofline_tokens_per_s", "roofline_fraction", "roofline_window_tokens_per_s",
               "roofline_window_fraction"),
    "train": ("tokens_per_step", "step_s", "tokens_per_s", "model_flops_per_s", "mfu", "peak_flops"),
    "measured": ("matmul_flops_per_s", "copy_bytes_per_s"),
}

PRESETS = {
    # Qwen2-shaped (GQA, qkv bias, tied embeddings as in Qwen2.5-0.5B), ~0.42B parameters.
    "full": dict(model=dict(vocab_size=151936, hidden_size=1024, intermediate_size=2816, num_layers=24,
                            num_heads=16, num_kv_heads=2, head_dim=64),
                 slots=256, prompt_len=128, new_tokens=256, decode_chunk=16, decode_repeats=3,
                 train_seqs=32, train_seq_len=1024, train_budget=16384, train_repeats=5, warmup=2,
                 matmul=8192, copy_mb=1024),
    # Seconds on a 2-core CPU: proves the plumbing, not the figures.
    "tiny": dict(model=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16),
                 slots=8, prompt_len=8, new_tokens=16, decode_chunk=8, decode_repeats=2,
                 train_seqs=8, train_seq_len=64, train_budget=256, train_repeats=2, warmup=1,
                 matmul=256, copy_mb=8),
}


def model_figures(cfg: ModelConfig) -> dict[str, float]:
    """Parameter counts. flop_params: weights a token multiplies by (layer matrices + LM head);
    weights read per decode step exclude the embedding table unless it doubles as the LM head."""
    shapes = param_shapes(cfg)
    total = sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
    matrices = sum(math.prod(s) for name, s in shapes["layers"].items()
                   if not (name.endswith("norm") or name.startswith("b")))
    head = cfg.hidden_size * cfg.vocab_size
    read_per_step = total - (0 if cfg.tie_word_embeddings else math.prod(shapes["embed"]))
    return {"params": float(total), "flop_params": float(matrices + head), "weight_bytes_bf16": 2.0 * total,
            "decode_weight_bytes_bf16": 2.0 * read_per_step}


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int = 2) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize  # keys and values


def probe_decode(cfg: ModelConfig, params, p: dict, hbm: float, weight_bytes: float) -> dict:
    slots, plen, new, chunk = p["slots"], p["prompt_len"], p["new_tokens"], p["decode_chunk"]
    ec = EngineConfig(num_slots=slots, max_seq_len=plen + new, decode_chunk=chunk, max_prefill_batch=min(32, slots))
    engine = GenerationEngine((cfg, params), ec)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, plen).tolist() for _ in range(slots)]
    sampling = SamplingParams(max_new_tokens=new, temperature=1.0)

    def run_once(seed0: int) -> tuple[float, float, int, float]:
        before, t0 = engine.stats(), time.perf_counter()
        handles = [engine.submit(pr, sampling, seed=seed0 + i) for i, pr in enumerate(prompts)]
        engine.run_until_idle()
        generated = sum(len(h.result().completions[0].tokens) for h in handles)
        wall = time.perf_counter() - t0
        after = engine.stats()
        decode_tokens = after.busy_slot_steps - before.busy_slot_steps
        return decode_tokens / (after.decode_s - before.decode_s), generated / wall, \
            after.decode_steps - before.decode_steps, after.decode_s - before.decode_s

    run_once(10_000)  # warm-up: compiles prefill and every decode window this workload passes
    runs = [run_once(20_000 + 1000 * r) for r in range(p["decode_repeats"])]
    del engine
    # Decode step k (1..new-1) attends over plen + k positions per slot: the mean cache in use.
    kv_tok = kv_bytes_per_token(cfg)
    cache_bytes = slots * (plen + new / 2) * kv_tok
    # What this engine reads: per chunk, the window holding the furthest position the chunk reaches.
    windows = [ec.decode_window(plen + k + chunk) for k in range(0, new - 1, chunk)]
    window_bytes = slots * kv_tok * float(np.mean(windows))
    tps = statistics.median(r[0] for r in runs)
    roofline = slots * hbm / (weight_bytes + cache_bytes)
    roofline_window = slots * hbm / (weight_bytes + window_bytes)
    return {
        "slots": slots, "prompt_len": plen, "new_tokens": new, "decode_chunk": chunk, "repeats": len(runs),
        "tokens_per_s": tps, "tokens_per_s_runs": [r[0] for r in runs],
        "wall_tokens_per_s": statistics.median(r[1] for r in runs),
        "decode_steps_per_run": runs[-1][2], "decode_s_per_run": statistics.median(r[3] for r in runs),
        "weight_bytes_per_step": weight_bytes, "cache_bytes_per_step": cache_bytes,
        "cache_window_bytes_per_step": window_bytes, "hbm_bytes_per_s": hbm,
        "roofline_tokens_per_s": roofline, "roofline_fraction": tps / roofline,
        "roofline_window_tokens_per_s": roofline_window, "roofline_window_fraction": tps / roofline_window,
    }


def full_length_sequences(cfg: ModelConfig, n: int, length: int, seed: int = 0) -> list[dict]:
    """n trajectories of exactly `length` tokens (a quarter prompt), in groups of 4, packed rows
    without padding; random behavior log-probs and +-1 rewards so advantages are non-zero."""
    rng = np.random.default_rng(seed)
    prompt = max(1, length // 4)
    groups = []
    for g in range(0, n, 4):
        trajs = tuple(
            Trajectory(rng.integers(0, cfg.vocab_size, prompt), rng.integers(0, cfg.vocab_size, length - prompt),
                       (-12.0 + rng.random(length - prompt)).astype(np.float32),
                       np.zeros(length - prompt, np.int32), float(rng.choice([-1.0, 1.0])))
            for _ in range(min(4, n - g)))
        groups.append(TrajectoryGroup(f"q{g}", trajs, 0))
    return build_sequences(groups, AdvantageConfig())


def probe_train(cfg: ModelConfig, params, p: dict, peak: float, flop_params: float) -> dict:
    trainer = ppo_trainer(cfg, params, OptimizerConfig(lr=1e-6), PPOConfig(num_minibatches=1),
                          engine=TrainEngineConfig(compute_dtype="bfloat16", max_tokens_per_microbatch=p["train_budget"]))
    seqs = full_length_sequences(cfg, p["train_seqs"], p["train_seq_len"])
    minibatches = make_microbatches(seqs, max_tokens_per_microbatch=p["train_budget"], num_minibatches=1)
    tokens = sum(m.num_tokens for mb in minibatches for m in mb)
    padded = sum(math.prod(m.shape) for mb in minibatches for m in mb)
    times = []
    for i in range(p["warmup"] + p["train_repeats"]):
        t0 = time.perf_counter()
        metrics = trainer.train_step(minibatches)  # returns host floats: the step has finished
        jax.block_until_ready(trainer.params)
        if i >= p["warmup"]:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    flops = 6.0 * flop_params * tokens / step_s
    return {
        "tokens_per_step": float(tokens), "padded_tokens_per_step": float(padded),
        "microbatches": sum(len(mb) for mb in minibatches),
        "microbatch_shapes": sorted({m.shape for mb in minibatches for m in mb}),
        "repeats": len(times), "step_s": step_s, "step_s_runs": times, "tokens_per_s": tokens / step_s,
        "model_flops_per_s": flops, "peak_flops": peak, "mfu": flops / peak,
        "loss_finite": bool(np.isfinite(metrics["loss"])), "skipped_updates": metrics["skipped_updates"],
    }


def measured_ceilings(p: dict) -> dict:
    """One square bf16 matmul of random data (FLOP/s) and one elementwise pass over a large array
    (bytes read + written per second), best of five after a warm-up."""
    def best(fn, *args):
        fn(*args).block_until_ready()
        out = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            out.append(time.perf_counter() - t0)
        return min(out)

    n = p["matmul"]
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)  # random: constant data runs cooler and faster
    mm_s = best(jax.jit(lambda x: x @ x), a)
    x = jnp.ones((p["copy_mb"] * 2**20 // 4,), jnp.float32)
    copy_s = best(jax.jit(lambda v: v * 2.0), x)  # elementwise: one read and one write per element
    return {"matmul_n": n, "matmul_flops_per_s": 2.0 * n**3 / mm_s, "copy_bytes_per_s": 2.0 * x.nbytes / copy_s}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model and few steps (CPU smoke test)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--peak-flops", type=float, default=H200_PEAK_BF16_FLOPS, help="peak dense bf16 FLOP/s")
    ap.add_argument("--hbm-bandwidth", type=float, default=H200_HBM_BYTES_PER_S, help="HBM bytes/s")
    ap.add_argument("--slots", type=int, help="decode slots (default: the preset's)")
    ap.add_argument("--skip", choices=("decode", "train"), action="append", default=[], help="leave a part out")
    args = ap.parse_args(argv)
    p = dict(PRESETS["tiny" if args.tiny else "full"])
    if args.slots:
        p["slots"] = args.slots
    cfg = ModelConfig(**p["model"], qkv_bias=True, tie_word_embeddings=True, family="qwen2")
    figures = model_figures(cfg)
    dev = jax.devices()[0]
    result: dict = {
        "preset": "tiny" if args.tiny else "full",
        "device": {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count(),
                   "jax": jax.__version__},
        "model": {**figures, "config": p["model"]},
        "errors": {},
    }
    t0 = time.perf_counter()
    params32 = init_params(cfg, 0, std=0.02)
    result["init_s"] = time.perf_counter() - t0
    # Each part is caught on its own, so one failure still leaves the other's figures.
    parts = {
        "measured": lambda: measured_ceilings(p),
        "decode": lambda: probe_decode(cfg, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32), p,
                                       args.hbm_bandwidth, figures["decode_weight_bytes_bf16"]),
        "train": lambda: probe_train(cfg, params32, p, args.peak_flops, figures["flop_params"]),
    }
    return run_parts(result, parts, args.skip, args.out, tag="probe")


def run_parts(result: dict, parts: dict, skip, out: str | None, *, tag: str) -> dict:
    """Runs each part not in `skip` into result[name] (its failure into result["errors"][name]),
    then prints the result as one JSON line and writes it to `out` when given."""
    for name, fn in parts.items():
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            result[name] = {**fn(), "elapsed_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - recorded, and the exit code says so
            result["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
        print(f"[{tag}] {name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    text = json.dumps(result, default=float)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
