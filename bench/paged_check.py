"""Paged against dense decode, and training with flash attention, on the device at hand.

Three parts, each recorded on its own (a failure leaves the others' figures):

1. kernel: one layer's decode attention over ragged lengths (lognormal, sigma 1, capped at the
   longest: the reasoning-length tails the paged cache is for), by
     - `paged_attention(impl="pallas")`: the platform's kernel, reading each slot's pages up to its length;
     - `paged_attention(impl="reference")`: the jnp gather of every slot's whole page table;
     - dense: the dense engine's attention, every slot over the power-of-two window of the longest.
   Median seconds per call, and the live KV bytes (sum of lengths x K x H x 2 x itemsize) per
   second: a paged kernel's useful bandwidth, to set against the HBM peak.
2. engine: `GenerationEngine` with `EngineConfig.kv_layout` "paged" and "dense" on the same
   ragged workload (each request's max_new_tokens drawn from the same lognormal): decode tokens/s
   (busy slot-steps over decode seconds) and wall tokens/s. Needs the paged engine (issue 25).
3. train: `JaxTrainEngine` steps with `TrainEngineConfig.attention_impl` "pallas" (flash kernel) and the
   jnp path: tokens/s and MFU as bench/accelerator_probe.py counts it. Needs the flash attention
   config field (issue 25).

Usage: python -m bench.paged_check [--tiny] [--out paged_check.json] [--skip kernel|engine|train]
`--tiny` (CPU smoke run) interprets the Pallas GPU kernel; its figures prove the plumbing only.
Prints one JSON object (last line of stdout).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.accelerator_probe import (H200_HBM_BYTES_PER_S, H200_PEAK_BF16_FLOPS, PRESETS, full_length_sequences,
                                     model_figures, run_parts)

KERNEL = {  # Qwen2.5-1.5B's attention shapes (one layer), 128 slots, up to 8k tokens
    "full": dict(slots=128, num_heads=12, num_kv_heads=2, head_dim=128, page_size=16, max_len=8192, mean_len=2048,
                 repeats=20),
    "tiny": dict(slots=4, num_heads=4, num_kv_heads=2, head_dim=16, page_size=8, max_len=64, mean_len=24, repeats=2),
}


def lognormal_lengths(rng, n: int, mean: float, cap: int, sigma: float = 1.0) -> np.ndarray:
    mu = np.log(mean) - sigma ** 2 / 2
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int32)


def _median_s(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe_kernel(k: dict, interpret: bool, hbm: float) -> dict:
    from areal_jax.kernels.paged_attention import PagePool, kernel_name, paged_attention, pool_layout

    platform = jax.default_backend()
    B, N, K, H, S = k["slots"], k["num_heads"], k["num_kv_heads"], k["head_dim"], k["page_size"]
    M = k["max_len"] // S
    rng = np.random.default_rng(0)
    lengths = lognormal_lengths(rng, B, k["mean_len"], k["max_len"])
    P = B * M
    tables = rng.permutation(P).reshape(B, M).astype(np.int32)  # pages anywhere, in any order
    dtype = jnp.bfloat16
    impl = "pallas" if (interpret or platform != "cpu") else "reference"
    kernel_platform = "gpu" if interpret else platform
    layout = pool_layout(impl, kernel_platform)
    key = jax.random.key(0)
    if layout == "combined":
        pool = PagePool(jax.random.normal(key, (P, S, 2 * K, H), dtype), None, "combined")
    else:
        pool = PagePool(jax.random.normal(key, (K, P, S, H), dtype), jax.random.normal(key, (K, P, S, H), dtype))
    q = jax.random.normal(jax.random.key(1), (B, N, H), dtype)
    lengths_d, tables_d = jnp.asarray(lengths), jnp.asarray(tables)
    options = {"interpret": True} if interpret else {}
    paged = jax.jit(lambda q, pool, l, t: paged_attention(q, pool, l, t, impl=impl, platform=kernel_platform,
                                                          **options))
    reference = jax.jit(lambda q, pool, l, t: paged_attention(q, pool, l, t, impl="reference"))
    window = 1 << int(np.ceil(np.log2(lengths.max())))
    dense_k = jax.random.normal(key, (B, K, window, H), dtype)  # the dense cache's [B, K, W, H] per layer
    dense_v = dense_k

    def dense(q, ck, cv, lengths):  # every slot over the whole window, masked past its length
        qg = q.reshape(B, K, N // K, H)
        s = jnp.einsum("bkgh,bksh->bkgs", qg, ck, preferred_element_type=jnp.float32) * H ** -0.5
        s = jnp.where(jnp.arange(window)[None, None, None] < lengths[:, None, None, None], s, -1e30)
        return jnp.einsum("bkgs,bksh->bkgh", jax.nn.softmax(s, -1).astype(cv.dtype), cv).reshape(B, N, H)

    itemsize = jnp.dtype(dtype).itemsize
    live_bytes = float(lengths.sum()) * 2 * K * H * itemsize
    out = {"platform": platform, "kernel": kernel_name(impl, kernel_platform), "interpret": interpret,
           "slots": B, "lengths_mean": float(lengths.mean()), "lengths_max": int(lengths.max()), "window": window,
           "live_kv_bytes": live_bytes, "dense_window_bytes": float(B * window * 2 * K * H * itemsize),
           "hbm_bytes_per_s": hbm}
    for name, fn, args in (("paged", paged, (q, pool, lengths_d, tables_d)),
                           ("reference", reference, (q, pool, lengths_d, tables_d)),
                           ("dense", jax.jit(dense), (q, dense_k, dense_v, lengths_d))):
        s = _median_s(fn, *args, repeats=k["repeats"])
        out[f"{name}_s"] = s
        out[f"{name}_live_bytes_per_s"] = live_bytes / s
    out["paged_speedup_over_dense"] = out["dense_s"] / out["paged_s"]
    out["paged_live_fraction_of_hbm"] = out["paged_live_bytes_per_s"] / hbm
    return out


def probe_engine(cfg, params, p: dict) -> dict:
    from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams

    if "kv_layout" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        raise RuntimeError("EngineConfig has no kv_layout: the paged engine (issue 25) is not in this tree")
    slots, plen, new = p["slots"], p["prompt_len"], p["new_tokens"] * 4
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, plen).tolist() for _ in range(2 * slots)]
    budgets = lognormal_lengths(rng, len(prompts), new / 4, new)  # mean a quarter of the longest
    out = {"requests": len(prompts), "prompt_len": plen, "max_new_tokens": new,
           "new_tokens_mean": float(budgets.mean())}
    for layout in ("dense", "paged"):
        ec = EngineConfig(num_slots=slots, max_seq_len=plen + new, decode_chunk=p["decode_chunk"],
                          max_prefill_batch=min(32, slots), kv_layout=layout)
        engine = GenerationEngine((cfg, params), ec)

        def run(seed0: int):
            before, t0 = engine.stats(), time.perf_counter()
            handles = [engine.submit(pr, SamplingParams(max_new_tokens=int(b), temperature=1.0), seed=seed0 + i)
                       for i, (pr, b) in enumerate(zip(prompts, budgets))]
            engine.run_until_idle()
            generated = sum(len(h.result().completions[0].tokens) for h in handles)
            after = engine.stats()
            return ((after.busy_slot_steps - before.busy_slot_steps) / (after.decode_s - before.decode_s),
                    generated / (time.perf_counter() - t0))

        run(10_000)  # compiles
        runs = [run(20_000 + 1000 * r) for r in range(p["decode_repeats"])]
        out[layout] = {"decode_tokens_per_s": statistics.median(r[0] for r in runs),
                       "wall_tokens_per_s": statistics.median(r[1] for r in runs)}
        del engine
    out["paged_over_dense_decode"] = out["paged"]["decode_tokens_per_s"] / out["dense"]["decode_tokens_per_s"]
    out["paged_over_dense_wall"] = out["paged"]["wall_tokens_per_s"] / out["dense"]["wall_tokens_per_s"]
    return out


def probe_train(cfg, params32, p: dict, peak: float, flop_params: float) -> dict:
    from areal_jax.trainer.batching import make_microbatches
    from areal_jax.trainer.optimizer import OptimizerConfig
    from areal_jax.trainer.algorithm import ppo_trainer
    from areal_jax.trainer.config import PPOConfig, TrainEngineConfig

    if "attention_impl" not in {f.name for f in dataclasses.fields(TrainEngineConfig)}:
        raise RuntimeError("TrainEngineConfig has no attention_impl: flash attention (issue 25) is not in this tree")
    seqs = full_length_sequences(cfg, p["train_seqs"], p["train_seq_len"])
    minibatches = make_microbatches(seqs, max_tokens_per_microbatch=p["train_budget"], num_minibatches=1)
    tokens = sum(m.num_tokens for mb in minibatches for m in mb)
    out = {"tokens_per_step": float(tokens), "peak_flops": peak}
    for impl in ("pallas", "reference"):
        engine = TrainEngineConfig(compute_dtype="bfloat16", max_tokens_per_microbatch=p["train_budget"],
                                   attention_impl=impl)
        trainer = ppo_trainer(cfg, params32, OptimizerConfig(lr=1e-6), PPOConfig(num_minibatches=1), engine=engine)
        times = []
        for i in range(p["warmup"] + p["train_repeats"]):
            t0 = time.perf_counter()
            trainer.train_step(minibatches)
            jax.block_until_ready(trainer.params)
            if i >= p["warmup"]:
                times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        out[impl] = {"step_s": step_s, "tokens_per_s": tokens / step_s,
                     "mfu": 6.0 * flop_params * tokens / step_s / peak}
        del trainer
    out["flash_speedup"] = out["reference"]["step_s"] / out["pallas"]["step_s"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes; the GPU kernel interpreted (CPU smoke test)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--peak-flops", type=float, default=H200_PEAK_BF16_FLOPS, help="peak dense bf16 FLOP/s")
    ap.add_argument("--hbm-bandwidth", type=float, default=H200_HBM_BYTES_PER_S, help="HBM bytes/s")
    ap.add_argument("--skip", choices=("kernel", "engine", "train"), action="append", default=[])
    args = ap.parse_args(argv)
    preset = "tiny" if args.tiny else "full"
    p = dict(PRESETS[preset])
    from areal_jax.models import ModelConfig, init_params

    cfg = ModelConfig(**p["model"], qkv_bias=True, tie_word_embeddings=True, family="qwen2")
    figures = model_figures(cfg)
    dev = jax.devices()[0]
    result: dict = {"preset": preset, "device": {"platform": dev.platform, "kind": dev.device_kind,
                                                 "jax": jax.__version__}, "errors": {}}
    params32 = None

    def params():
        nonlocal params32
        if params32 is None:
            params32 = init_params(cfg, 0, std=0.02)
        return params32

    parts = {
        "kernel": lambda: probe_kernel(KERNEL[preset], interpret=args.tiny and dev.platform == "cpu",
                                       hbm=args.hbm_bandwidth),
        "engine": lambda: probe_engine(cfg, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params()), p),
        "train": lambda: probe_train(cfg, params(), p, args.peak_flops, figures["flop_params"]),
    }
    return run_parts(result, parts, args.skip, args.out, tag="paged_check")

if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
