"""The prediction tables of docs/scale.md: `areal-jax simulate` on the paper's setting and on every
shipped real-model config, each swept over the generation/training split and eta, against the
synchronous colocated baseline. Costs: the analytic roofline of each target (nothing compiled).

    .venv/bin/python -m bench.simulate_scale [--only paper|configs] [--steps 10] [--json OUT]

Prints one markdown table per scenario (the best async row first) and a summary line per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from areal_jax.simulate.driver import add_arguments, simulate_rows  # noqa: E402

# The paper's setting (AReaL, arXiv 2505.24298): DeepSeek-R1-Distill-Qwen 1.5B and 7B (Qwen2.5
# shapes), 512 prompts x 16 answers per step, long-tailed reasoning lengths, H800 nodes of 8 GPUs
# (H100 SXM figures: the same bf16 peak and HBM bandwidth; H800 differs in NVLink only).
PAPER_BASE = ["RLConfig.batch_size = 512", "RLVRConfig.n_samples = 16", "PPOConfig.num_minibatches = 4",
              "EngineConfig.decode_chunk = 16", "MeshConfig.num_generation_devices_per_host = 6"]
PAPER = {
    "1.5B, 16k cap": (PAPER_BASE + [
        'PlanConfig.model_config = "models/qwen2.5-1.5b-instruct.json"', "RLVRConfig.max_new_tokens = 16384",
        # 128 slots per GPU (128 x 17k x 28 KiB = 61 GB); groups in flight: twice slots / n (see docs/scale.md)
        "EngineConfig.max_seq_len = 17408", "EngineConfig.num_slots = 768",
        "RLConfig.max_concurrent = 96", "PPOConfig.max_tokens_per_microbatch = 32768",
        "PPOConfig.row_buckets = (1024, 2048, 4096, 8192, 17408, 32768)"], "lognormal:mean=5000,sigma=1,prompt=300"),
    "7B, 32k cap": (PAPER_BASE + [
        'PlanConfig.model_config = "models/qwen2.5-7b.json"', "RLVRConfig.max_new_tokens = 32768",
        # 24 slots per GPU (24 x 33k x 56 KiB = 45 GB); groups in flight: twice slots / n
        "EngineConfig.max_seq_len = 33792", "EngineConfig.num_slots = 144",
        "RLConfig.max_concurrent = 18", "PPOConfig.max_tokens_per_microbatch = 65536",
        "PPOConfig.row_buckets = (1024, 2048, 4096, 8192, 16384, 33792, 65536)"], "lognormal:mean=5000,sigma=1,prompt=300"),
}
PAPER_NODES = (16, 64)

CONFIGS = {  # config -> splits (generation devices per host) its replicas allow
    "configs/qwen2_5_1_5b_gsm8k_tpu.gin": (1, 2, 3),
    "configs/qwen3_1_7b_gsm8k_gpu.gin": (4, 5, 6, 7),
    "configs/qwen2_5_7b_math_gpu.gin": (4, 5, 6, 7),
    "configs/qwen2_5_32b_math_gpu.gin": (4,),
    "configs/qwen2_5_7b_math_tpu.gin": (2,),
}
ETAS = (1, 2, 4, 8)


def run(gin_file: str, params: list[str], *, target: str | None, splits, length_dist: str | None, steps: int,
        etas=ETAS):
    import argparse as ap

    p = ap.ArgumentParser()
    add_arguments(p)
    argv = ["--gin_file", gin_file, "--steps", str(steps), "--warmup", str(max(1, steps // 4)),
            "--sweep", "mode=async,sync", "--sweep", "eta=" + ",".join(map(str, etas)),
            "--sweep", "split=" + ",".join(map(str, splits))]
    for param in params:
        argv += ["--gin_param", param]
    if target:
        argv += ["--target", target]
    if length_dist:
        argv += ["--length-dist", length_dist]
    return simulate_rows(p.parse_args(argv))


def table(name: str, report: dict) -> str:
    rows = report["rows"]
    sync = next(r for r in rows if r["mode"] == "sync")
    best = sorted((r for r in rows if r["mode"] == "async"), key=lambda r: -r["trained_tokens_per_s"])
    lines = [f"**{name}** ({report['assumptions']['lengths']}; {report['assumptions']['batch']}; "
             f"{report['assumptions']['hosts']} hosts)", "",
             "| mode | eta | split (gen:train per host) | trained tok/s | vs sync | gen busy | train busy | slot occupancy "
             "| re-prefilled per trained token | staleness max / mean | step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in best[:6] + [sync]:
        lines.append(f"| {r['mode']} | {r['eta']} | {r['split']} | {r['trained_tokens_per_s']:,.0f} | "
                     f"{r['trained_tokens_per_s'] / sync['trained_tokens_per_s']:.2f}x | {r['generation_busy']:.0%} | "
                     f"{r['train_busy']:.0%} | {r['slot_occupancy']:.0%} | {r['reprefill_per_trained_token']:.2f} | "
                     f"{r['staleness_max']} / {r['staleness_mean']:.2f} | {r['step_s']:.1f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("paper", "configs"), default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {}
    if args.only in (None, "paper"):
        for name, (params, dist) in PAPER.items():
            for nodes in PAPER_NODES:
                t0 = time.time()
                key = f"paper {name}, {nodes} x 8 H800 (H100 figures)"
                out[key] = run("configs/qwen2_5_7b_math_gpu.gin", params, target=f"{nodes}x8xh100",
                               splits=(6, 7), length_dist=dist, steps=args.steps, etas=(2, 4, 8))
                print(table(key, out[key]), f"\n[{time.time() - t0:.0f} s]\n", flush=True)
    if args.only in (None, "configs"):
        for gin_file, splits in CONFIGS.items():
            t0 = time.time()
            out[gin_file] = run(gin_file, [], target=None, splits=splits, length_dist=None, steps=args.steps)
            print(table(f"`{gin_file}`", out[gin_file]), f"\n[{time.time() - t0:.0f} s]\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
