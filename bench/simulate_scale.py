"""The prediction tables of docs/scale.md: `areal-jax simulate` on the paper's setting and on every
shipped real-model config, each swept over the generation/training split and eta, against the
synchronous colocated baseline. Costs: the analytic roofline of each target (nothing compiled).

    .venv/bin/python -m bench.simulate_scale [--only paper|configs] [--steps 10] [--json OUT]
        [--paged] [--splits 6,7] [--etas 4,8] [--match TEXT]

Prints one markdown table per scenario (the best async row first) and a summary line per scenario.

--paged: the engine pages its KV cache (issue 25): each generation replica's pool holds the bytes
its dense cache held (slots x max_seq_len tokens), a decode step reads the weights and the live
tokens, and admission is by free pages. The paper's engines then get 512 slots per GPU (slots are
cheap: a page-table row each) and groups in flight are bounded by eta alone (max_concurrent =
(eta_max + 1) x the local batch), not sized by hand; the shipped configs keep their slots.
--splits / --etas: restrict the sweeps (the defaults: each scenario's own); --match: only the
scenarios whose name contains TEXT.
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
        "RLConfig.max_concurrent = 96", "TrainEngineConfig.max_tokens_per_microbatch = 32768",
        "TrainEngineConfig.row_buckets = (1024, 2048, 4096, 8192, 17408, 32768)"], "lognormal:mean=5000,sigma=1,prompt=300"),
    "7B, 32k cap": (PAPER_BASE + [
        'PlanConfig.model_config = "models/qwen2.5-7b.json"', "RLVRConfig.max_new_tokens = 32768",
        # 24 slots per GPU (24 x 33k x 56 KiB = 45 GB); groups in flight: twice slots / n
        "EngineConfig.max_seq_len = 33792", "EngineConfig.num_slots = 144",
        "RLConfig.max_concurrent = 18", "TrainEngineConfig.max_tokens_per_microbatch = 65536",
        "TrainEngineConfig.row_buckets = (1024, 2048, 4096, 8192, 16384, 33792, 65536)"], "lognormal:mean=5000,sigma=1,prompt=300"),
}
PAPER_NODES = (16, 64)

CONFIGS = {  # config -> splits (generation devices per host) its replicas allow
    "configs/qwen2_5_1_5b_gsm8k_tpu.gin": (1, 2, 3),
    "configs/qwen3_1_7b_gsm8k_gpu.gin": (4, 5, 6, 7),
    "configs/qwen2_5_7b_math_gpu.gin": (4, 5, 6, 7),
    "configs/qwen2_5_32b_math_gpu.gin": (4,),
    "configs/qwen2_5_7b_math_tpu.gin": (2,),
    "configs/qwen3_30b_a3b_math_gpu.gin": (2, 4, 6),
    "configs/qwen3_30b_a3b_math_tpu.gin": (2,),
}
ETAS = (1, 2, 4, 8)


PAGED_SLOTS_PER_GPU = 512


def paged_pool(workload):
    """The dense cache's tokens per replica (slots x max_seq_len) as a paged pool of 16-token pages."""
    import dataclasses

    replicas = workload.generation_replicas(workload.config_generation_devices)
    tokens = workload.engine.num_slots // replicas * workload.engine.max_seq_len
    return dataclasses.replace(workload, kv_pool_pages=tokens // 16, page_size=16, block_tokens=128)


def paged_paper(params: list[str], slots_per_replica: int, etas) -> tuple[list[str], callable]:
    """The paper setting's bindings with the paged engine: the pool of the dense engine's slots,
    PAGED_SLOTS_PER_GPU slots per GPU, max_concurrent bounded by eta alone."""
    import dataclasses

    pool_pages = slots_per_replica * int(next(p for p in params if "max_seq_len" in p).split("=")[1]) // 16
    kept = [p for p in params if not p.startswith(("EngineConfig.num_slots", "RLConfig.max_concurrent"))]
    gpus = int(next(p for p in PAPER_BASE if "num_generation_devices_per_host" in p).split("=")[1])
    batch = int(next(p for p in PAPER_BASE if "batch_size" in p).split("=")[1])
    kept += [f"EngineConfig.num_slots = {PAGED_SLOTS_PER_GPU * gpus}",
             f"RLConfig.max_concurrent = {(max(etas) + 1) * batch}"]
    return kept, lambda wl: dataclasses.replace(wl, kv_pool_pages=pool_pages, page_size=16, block_tokens=128)


def simulate_args(gin_file: str, params: list[str], *, target: str | None, length_dist: str | None, steps: int,
                  sweeps: list[str] = ()):
    """`areal-jax simulate`'s parsed flags for a config, its extra bindings and sweeps."""
    import argparse as ap

    p = ap.ArgumentParser()
    add_arguments(p)
    argv = ["--gin_file", gin_file, "--steps", str(steps), "--warmup", str(max(1, steps // 4))]
    for sweep in sweeps:
        argv += ["--sweep", sweep]
    for param in params:
        argv += ["--gin_param", param]
    if target:
        argv += ["--target", target]
    if length_dist:
        argv += ["--length-dist", length_dist]
    return p.parse_args(argv)


def run(gin_file: str, params: list[str], *, target: str | None, splits, length_dist: str | None, steps: int,
        etas=ETAS, adjust=None):
    sweeps = ["mode=async,sync", "eta=" + ",".join(map(str, etas)), "split=" + ",".join(map(str, splits))]
    return simulate_rows(simulate_args(gin_file, params, target=target, length_dist=length_dist, steps=steps,
                                       sweeps=sweeps), adjust_workload=adjust)


def table(name: str, report: dict) -> str:
    rows = report["rows"]
    sync = next(r for r in rows if r["mode"] == "sync")
    best = sorted((r for r in rows if r["mode"] == "async"), key=lambda r: -r["trained_tokens_per_s"])
    lines = [f"**{name}** ({report['assumptions']['lengths']}; {report['assumptions']['batch']}; "
             f"{report['assumptions']['hosts']} hosts; sync's async_bound {sync['async_bound']:.2f}x = "
             f"1 / ({sync['generation_share']:.2f} x {sync['sync_generation_efficiency']:.2f} + "
             f"{sync['train_share']:.2f} x {sync['sync_train_efficiency']:.2f}))", "",
             "| mode | eta | split (gen:train per host) | trained tok/s | per device | vs sync | of bound | roofline fraction "
             "| padded | gen busy | train busy | slot occupancy | re-prefilled per trained token | staleness max / mean "
             "| step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in best[:6] + [sync]:
        of_bound = f"{r['vs_async_bound']:.2f}" if r.get("vs_async_bound") is not None else "-"
        lines.append(f"| {r['mode']} | {r['eta']} | {r['split']} | {r['trained_tokens_per_s']:,.0f} | "
                     f"{r['trained_tokens_per_s_per_device']:,.0f} | "
                     f"{r['trained_tokens_per_s'] / sync['trained_tokens_per_s']:.2f}x | {of_bound} | "
                     f"{r['roofline_fraction']:.2f} | {r['padded_token_ratio']:.2f}x | {r['generation_busy']:.0%} | "
                     f"{r['train_busy']:.0%} | {r['slot_occupancy']:.0%} | {r['reprefill_per_trained_token']:.2f} | "
                     f"{r['staleness_max']} / {r['staleness_mean']:.2f} | {r['step_s']:.1f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("paper", "configs"), default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--paged", action="store_true", help="the paged engine (see the module docstring)")
    ap.add_argument("--splits", default=None, help="comma-separated generation devices per host to sweep")
    ap.add_argument("--etas", default=None, help="comma-separated etas to sweep")
    ap.add_argument("--match", default="", help="only the scenarios whose name contains this text")
    args = ap.parse_args()
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    out = {}
    if args.only in (None, "paper"):
        for name, (params, dist) in PAPER.items():
            for nodes in PAPER_NODES:
                t0 = time.time()
                key = f"paper {name}, {nodes} x 8 H800 (H100 figures)" + (", paged" if args.paged else "")
                if args.match not in key:
                    continue
                etas = ints(args.etas) if args.etas else (2, 4, 8)
                bindings, adjust = params, None
                if args.paged:
                    slots = int(next(p for p in params if p.startswith("EngineConfig.num_slots")).split("=")[1]) // 6
                    bindings, adjust = paged_paper(params, slots, etas)
                out[key] = run("configs/qwen2_5_7b_math_gpu.gin", bindings, target=f"{nodes}x8xh100",
                               splits=ints(args.splits) if args.splits else (6, 7), length_dist=dist,
                               steps=args.steps, etas=etas, adjust=adjust)
                print(table(key, out[key]), f"\n[{time.time() - t0:.0f} s]\n", flush=True)
    if args.only in (None, "configs"):
        for gin_file, splits in CONFIGS.items():
            if args.match not in gin_file:
                continue
            t0 = time.time()
            out[gin_file] = run(gin_file, [], target=None, splits=ints(args.splits) if args.splits else splits,
                                length_dist=None, steps=args.steps, etas=ints(args.etas) if args.etas else ETAS,
                                adjust=paged_pool if args.paged else None)
            print(table(f"`{gin_file}`", out[gin_file]), f"\n[{time.time() - t0:.0f} s]\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
