"""The rollout engine's speed settings of issue 41, measured on the device at hand.

Three parts, each recorded on its own (a failure leaves the others' figures):

1. kernel: one layer's paged decode attention (the platform's kernel) over ragged lengths (lognormal,
   sigma 1) with the pool in bfloat16 and in float8_e4m3fn (`EngineConfig.kv_dtype`): median
   seconds per call, and live KV bytes per second at each pool's own element size.
2. decode: `GenerationEngine` (paged) with kv_dtype "bfloat16" and "float8_e4m3fn" on the same
   ragged workload: decode tokens/s (busy slot-steps over decode seconds) and wall tokens/s.
3. swap: the same engine swapping weights every `swap_every` scheduling rounds under
   `EngineConfig.on_swap` "recompute" and "keep": wall tokens/s, tokens re-prefilled, prefill seconds.
4. live: decode by live slots (`EngineConfig.decode_min_rows` 16, at most slots / 8) against the full
   batch every chunk (decode_min_rows = slots), on the ragged workload: decode and wall tokens/s.
5. share: groups of 4 samples per prompt with `EngineConfig.share_prompt_pages` on and off, on a
   pool of a quarter of the dense cache: wall tokens/s, pages shared, samples preempted.
6. overlap: `EngineConfig.overlap` off and on (the next decode chunk dispatched before the last is
   read back) on the ragged workload: wall tokens/s and the chunks that overlapped.
7. scan: `EngineConfig.scan_layers` off and on (every program's layers as a scan over stacked
   weights and one stacked pool; on GPU cuBLAS GEMMs with dynamic-slice fusion) on the ragged
   workload: decode and wall tokens/s, and the seconds to compile the first round.
8. trie: groups of 4 samples per prompt swapping weights every `swap_every` rounds, the re-prefill
   packed at max_seq_len as prefix tries (`EngineConfig.reprefill_share_prefixes`) and as plain
   rows: wall tokens/s, tokens re-prefilled and of those shared, and re-prefill seconds (the trie
   attends by the jnp blocked formula, the plain rows by the platform's flash kernel).
9. ride: the same swapping workload with the re-prefill beside decode (`EngineConfig.
   reprefill_in_decode_rows` 2 x 128, every history, and capped at 4,096 tokens) against the packed
   calls: wall tokens/s, tokens re-prefilled and of those ridden, and the seconds of the decode chunks
   that carried rows (`decode_ride`) against the packed re-prefill's.

Usage: python -m bench.engine_speed_check [--tiny] [--out engine_speed_check.json] [--skip PART]
(`--only overlap`: that part alone)
`--tiny` (CPU smoke run) interprets the Pallas GPU kernel; its figures prove the plumbing only.
Prints one JSON object (last line of stdout).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.accelerator_probe import H200_HBM_BYTES_PER_S, PRESETS, run_parts
from bench.paged_check import KERNEL, _median_s, lognormal_lengths

KV_DTYPES = ("bfloat16", "float8_e4m3fn")
PARTS = ("kernel", "decode", "swap", "live", "share", "overlap", "scan", "trie", "ride")


def probe_kernel(k: dict, interpret: bool, hbm: float) -> dict:
    from areal_jax.kernels.paged_attention import PagePool, flat_index, kernel_name, paged_attention, write_tokens

    platform = "gpu" if interpret else jax.default_backend()
    impl = "pallas" if (interpret or platform != "cpu") else "reference"
    B, N, K, H, S = k["slots"], k["num_heads"], k["num_kv_heads"], k["head_dim"], k["page_size"]
    M = k["max_len"] // S
    rng = np.random.default_rng(0)
    lengths = lognormal_lengths(rng, B, k["mean_len"], k["max_len"])
    tables = rng.permutation(B * M).reshape(B, M).astype(np.int32)  # pages anywhere, in any order
    index = flat_index(jnp.asarray(tables), jnp.broadcast_to(jnp.arange(M * S), (B, M * S)), S).reshape(-1)
    keys = jax.random.normal(jax.random.key(0), (B * M * S, K, H), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(1), (B, N, H), jnp.bfloat16)
    options = {"interpret": True} if interpret else {}
    fn = jax.jit(lambda q, pool, l, t: paged_attention(q, pool, l, t, impl=impl, platform=platform, **options))
    out = {"platform": platform, "kernel": kernel_name(impl, platform), "interpret": interpret, "slots": B,
           "lengths_mean": float(lengths.mean()), "hbm_bytes_per_s": hbm}
    for dtype in KV_DTYPES:
        pool = PagePool.zeros(K, B * M, S, H, jnp.dtype(dtype), impl=impl, platform=platform)
        pool = jax.jit(lambda p, x, i: write_tokens(p, x, x, i, calibrate=True))(pool, keys, index)
        live = float(lengths.sum()) * 2 * K * H * jnp.dtype(dtype).itemsize
        s = _median_s(fn, q, pool, jnp.asarray(lengths), jnp.asarray(tables), repeats=k["repeats"])
        out[dtype] = {"s": s, "live_bytes_per_s": live / s, "live_fraction_of_hbm": live / s / hbm}
    out["fp8_speedup"] = out["bfloat16"]["s"] / out["float8_e4m3fn"]["s"]
    return out


def _workload(cfg, p: dict):
    slots, plen, new = p["slots"], p["prompt_len"], p["new_tokens"] * 4
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, plen).tolist() for _ in range(2 * slots)]
    budgets = lognormal_lengths(rng, len(prompts), new / 4, new)  # mean a quarter of the longest
    return prompts, budgets, plen + new


def _engine(cfg, params, p: dict, max_seq_len: int, **config):
    from areal_jax.generation import EngineConfig, GenerationEngine

    ec = EngineConfig(num_slots=p["slots"], max_seq_len=max_seq_len, decode_chunk=p["decode_chunk"],
                      max_prefill_batch=min(32, p["slots"]), kv_layout="paged", **config)
    return GenerationEngine((cfg, params), ec)


def _run(engine, prompts, budgets, seed0: int, swap=None, swap_every: int = 0, n: int = 1):
    """Runs the requests (`n` samples each) to the end (swapping to `swap` every `swap_every`
    rounds): (decode tokens/s, wall tokens/s, re-prefilled tokens, prefill seconds, pages shared,
    samples preempted, re-prefilled tokens a shared prefix spared, re-prefilled tokens that rode
    decode steps)."""
    from areal_jax.generation import SamplingParams

    before, t0 = engine.stats(), time.perf_counter()
    handles = [engine.submit(pr, SamplingParams(max_new_tokens=int(b), temperature=1.0), n=n, seed=seed0 + i)
               for i, (pr, b) in enumerate(zip(prompts, budgets))]
    rounds, version = 0, engine.version
    while engine.step():
        rounds += 1
        if swap is not None and swap_every and rounds % swap_every == 0:
            version += 1
            engine.update_weights(swap[version % 2], version)
    generated = sum(len(c.tokens) for h in handles for c in h.result().completions)
    after = engine.stats()
    return ((after.busy_slot_steps - before.busy_slot_steps) / max(after.decode_s - before.decode_s, 1e-9),
            generated / (time.perf_counter() - t0), after.reprefill_tokens - before.reprefill_tokens,
            after.prefill_s - before.prefill_s, after.kv_pages_shared - before.kv_pages_shared,
            after.preempted_samples - before.preempted_samples,
            after.reprefill_shared_tokens - before.reprefill_shared_tokens,
            after.reprefill_ride_tokens - before.reprefill_ride_tokens)


def probe_decode(cfg, params, p: dict) -> dict:
    prompts, budgets, max_seq_len = _workload(cfg, p)
    out = {"requests": len(prompts), "new_tokens_mean": float(budgets.mean())}
    for dtype in KV_DTYPES:
        engine = _engine(cfg, params, p, max_seq_len, kv_dtype=dtype)
        _run(engine, prompts, budgets, 10_000)  # compiles
        runs = [_run(engine, prompts, budgets, 20_000 + 1000 * r) for r in range(p["decode_repeats"])]
        out[dtype] = {"decode_tokens_per_s": statistics.median(r[0] for r in runs),
                      "wall_tokens_per_s": statistics.median(r[1] for r in runs)}
        del engine
    out["fp8_over_bf16_decode"] = out["float8_e4m3fn"]["decode_tokens_per_s"] / out["bfloat16"]["decode_tokens_per_s"]
    return out


def probe_swap(cfg, params, p: dict, swap_every: int) -> dict:
    prompts, budgets, max_seq_len = _workload(cfg, p)
    other = jax.tree.map(lambda x: x * 1.01, params)  # another version of the same shapes
    out = {"requests": len(prompts), "swap_every_rounds": swap_every}
    for on_swap in ("recompute", "keep"):
        engine = _engine(cfg, params, p, max_seq_len, kv_dtype="bfloat16", on_swap=on_swap)
        _run(engine, prompts, budgets, 10_000, swap=(params, other), swap_every=swap_every)  # compiles
        runs = [_run(engine, prompts, budgets, 20_000 + 1000 * r, swap=(params, other), swap_every=swap_every)
                for r in range(p["decode_repeats"])]
        out[on_swap] = {"wall_tokens_per_s": statistics.median(r[1] for r in runs),
                        "reprefill_tokens": statistics.median(r[2] for r in runs),
                        "prefill_s": statistics.median(r[3] for r in runs)}
        del engine
    out["keep_over_recompute_wall"] = out["keep"]["wall_tokens_per_s"] / out["recompute"]["wall_tokens_per_s"]
    return out


def probe_trie(cfg, params, p: dict, swap_every: int) -> dict:
    prompts, budgets, max_seq_len = _workload(cfg, p)
    prompts, budgets = prompts[:len(prompts) // 4], budgets[:len(budgets) // 4]  # 4 samples each
    other = jax.tree.map(lambda x: x * 1.01, params)
    out = {"requests": len(prompts), "samples_per_request": 4, "swap_every_rounds": swap_every}
    for name, share in (("plain", False), ("trie", True)):
        engine = _engine(cfg, params, p, max_seq_len, kv_dtype="bfloat16", reprefill_share_prefixes=share,
                         reprefill_pack_width=max_seq_len)
        _run(engine, prompts, budgets, 10_000, swap=(params, other), swap_every=swap_every, n=4)  # compiles
        runs = [_run(engine, prompts, budgets, 20_000 + 1000 * r, swap=(params, other), swap_every=swap_every, n=4)
                for r in range(p["decode_repeats"])]
        reprefill_s = engine.timings().get("reprefill", {})
        out[name] = {"wall_tokens_per_s": statistics.median(r[1] for r in runs),
                     "reprefill_tokens": statistics.median(r[2] for r in runs),
                     "reprefill_shared_tokens": statistics.median(r[6] for r in runs),
                     "prefill_s": statistics.median(r[3] for r in runs),
                     "packed_reprefill_s_total": sum(v["s"] for v in reprefill_s.values())}
        del engine
    out["trie_over_plain_wall"] = out["trie"]["wall_tokens_per_s"] / out["plain"]["wall_tokens_per_s"]
    out["trie_over_plain_reprefill_s"] = (out["trie"]["packed_reprefill_s_total"]
                                          / max(out["plain"]["packed_reprefill_s_total"], 1e-9))
    return out


def probe_ride(cfg, params, p: dict, swap_every: int) -> dict:
    prompts, budgets, max_seq_len = _workload(cfg, p)
    other = jax.tree.map(lambda x: x * 1.01, params)
    out = {"requests": len(prompts), "swap_every_rounds": swap_every}
    rides = dict(reprefill_in_decode_rows=2, reprefill_in_decode_width=128)
    for name, config in (("packed", {}), ("ride_all", rides), ("ride_capped", dict(rides, reprefill_in_decode_tokens=4096))):
        engine = _engine(cfg, params, p, max_seq_len, kv_dtype="bfloat16", **config)
        _run(engine, prompts, budgets, 10_000, swap=(params, other), swap_every=swap_every)  # compiles
        before = engine.timings()
        runs = [_run(engine, prompts, budgets, 20_000 + 1000 * r, swap=(params, other), swap_every=swap_every)
                for r in range(p["decode_repeats"])]
        after = engine.timings()

        def seconds(kind):  # over the measured runs
            return (sum(v["s"] for v in after.get(kind, {}).values())
                    - sum(v["s"] for v in before.get(kind, {}).values()))

        out[name] = {"wall_tokens_per_s": statistics.median(r[1] for r in runs),
                     "reprefill_tokens": statistics.median(r[2] for r in runs),
                     "reprefill_ride_tokens": statistics.median(r[7] for r in runs),
                     "packed_reprefill_s_total": seconds("reprefill") + seconds("reprefill_long"),
                     "decode_ride_s_total": seconds("decode_ride"), "decode_s_total": seconds("decode")}
        del engine
    for name in ("ride_all", "ride_capped"):
        out[f"{name}_over_packed_wall"] = out[name]["wall_tokens_per_s"] / out["packed"]["wall_tokens_per_s"]
    return out


def _variants(cfg, params, p: dict, variants: dict[str, dict], n: int = 1, prompts_scale: int = 1) -> dict:
    """Each engine variant (EngineConfig fields) on the ragged workload, compiled first, medians of
    `decode_repeats` runs."""
    prompts, budgets, max_seq_len = _workload(cfg, p)
    prompts, budgets = prompts[:len(prompts) // prompts_scale], budgets[:len(budgets) // prompts_scale]
    out: dict = {"requests": len(prompts), "samples_per_request": n}
    for name, config in variants.items():
        start = time.perf_counter()
        engine = _engine(cfg, params, p, max_seq_len, kv_dtype="bfloat16", **config)
        _run(engine, prompts, budgets, 10_000, n=n)  # compiles
        first_round_s = time.perf_counter() - start
        runs = [_run(engine, prompts, budgets, 20_000 + 1000 * r, n=n) for r in range(p["decode_repeats"])]
        out[name] = {"decode_tokens_per_s": statistics.median(r[0] for r in runs),
                     "wall_tokens_per_s": statistics.median(r[1] for r in runs),
                     "kv_pages_shared": statistics.median(r[4] for r in runs),
                     "preempted_samples": statistics.median(r[5] for r in runs),
                     "overlapped_chunks": engine.stats().overlapped_chunks,
                     "first_round_s_with_compiles": first_round_s}
        del engine
    return out


def probe_live(cfg, params, p: dict) -> dict:
    out = _variants(cfg, params, p, {"full_batch": dict(decode_min_rows=p["slots"]),
                                     "live_slots": dict(decode_min_rows=min(16, max(1, p["slots"] // 8)))})
    out["live_over_full_decode"] = out["live_slots"]["decode_tokens_per_s"] / out["full_batch"]["decode_tokens_per_s"]
    return out


def probe_share(cfg, params, p: dict) -> dict:
    # A quarter of the dense cache's pages: sharing decides how many samples fit. Pages of 16 tokens
    # (4 for prompts under 32 tokens, so a prompt holds full pages to share).
    S, longest = (16 if p["prompt_len"] >= 32 else 4), p["prompt_len"] + p["new_tokens"] * 4
    pool = dict(kv_pool_pages=max(p["slots"] * longest // (S * 4), -(-longest // S)), page_size=S)
    out = _variants(cfg, params, p, {"copied": dict(share_prompt_pages=False, **pool),
                                     "shared": dict(share_prompt_pages=True, **pool)}, n=4, prompts_scale=4)
    out["shared_over_copied_wall"] = out["shared"]["wall_tokens_per_s"] / out["copied"]["wall_tokens_per_s"]
    return out


def probe_overlap(cfg, params, p: dict) -> dict:
    out = _variants(cfg, params, p, {"serial": dict(overlap=False), "overlapped": dict(overlap=True)})
    out["overlapped_over_serial_wall"] = out["overlapped"]["wall_tokens_per_s"] / out["serial"]["wall_tokens_per_s"]
    return out


def probe_scan(cfg, params, p: dict) -> dict:
    out = _variants(cfg, params, p, {"unrolled": dict(scan_layers=False), "scanned": dict(scan_layers=True)})
    out["scanned_over_unrolled_decode"] = (out["scanned"]["decode_tokens_per_s"]
                                           / out["unrolled"]["decode_tokens_per_s"])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes; the GPU kernel interpreted (CPU smoke test)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--hbm-bandwidth", type=float, default=H200_HBM_BYTES_PER_S, help="HBM bytes/s")
    ap.add_argument("--swap-every", type=int, default=4, help="scheduling rounds between weight swaps")
    ap.add_argument("--skip", choices=PARTS, action="append", default=[])
    ap.add_argument("--only", choices=PARTS, action="append",
                    default=[], help="run only these parts")
    args = ap.parse_args(argv)
    preset = "tiny" if args.tiny else "full"
    p = dict(PRESETS[preset])
    from areal_jax.models import ModelConfig, init_params

    cfg = ModelConfig(**p["model"], qkv_bias=True, tie_word_embeddings=True, family="qwen2")
    dev = jax.devices()[0]
    result: dict = {"preset": preset, "device": {"platform": dev.platform, "kind": dev.device_kind,
                                                 "jax": jax.__version__}, "errors": {}}
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(cfg, 0, std=0.02))
    parts = {
        "kernel": lambda: probe_kernel(KERNEL[preset], interpret=args.tiny and dev.platform == "cpu",
                                       hbm=args.hbm_bandwidth),
        "decode": lambda: probe_decode(cfg, params, p),
        "swap": lambda: probe_swap(cfg, params, p, args.swap_every),
        "live": lambda: probe_live(cfg, params, p),
        "share": lambda: probe_share(cfg, params, p),
        "overlap": lambda: probe_overlap(cfg, params, p),
        "scan": lambda: probe_scan(cfg, params, p),
        "trie": lambda: probe_trie(cfg, params, p, args.swap_every),
        "ride": lambda: probe_ride(cfg, params, p, args.swap_every),
    }
    skip = args.skip + ([name for name in parts if name not in args.only] if args.only else [])
    return run_parts(result, parts, skip, args.out, tag="engine_speed_check")


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
