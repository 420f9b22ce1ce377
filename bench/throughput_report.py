"""Issue 40's table of docs/scale.md: for every shipped config with a target (and the paper's 1.5B
setting), async at the config's own split and eta against (a) the fair synchronous baseline
(colocated, the same kernels and costs, the per-device micro-batch budget) beside its bound, and
(b) eta = 0 on the same split (the paper's kind of baseline: its 2.77x is against its own system at
eta 0), with each row's roofline fraction and micro-batch padding. Costs: each target's analytic
roofline (nothing compiled), as `areal-jax simulate`.

    .venv/bin/python -m bench.throughput_report [--steps 12] [--match TEXT] [--json OUT]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from areal_jax.simulate.driver import simulate_rows  # noqa: E402
from bench.simulate_scale import PAPER, paged_paper, simulate_args  # noqa: E402


def shipped_configs() -> list[str]:
    """configs/*.gin that bind PlanConfig.target: the configs planned (and simulated) on hardware."""
    return sorted(f for f in glob.glob("configs/*.gin") if re.search(r"^PlanConfig\.target\s*=", open(f).read(), re.M))


def rows(gin_file: str, params: list[str], *, target: str | None, length_dist: str | None, steps: int,
         split: int | None = None, eta: int | None = None, adjust=None) -> dict:
    """The config's row (or `split` and `eta` swept in), eta 0 on its split, and the sync
    baseline (simulate adds it)."""
    where = [f"split={split}"] if split else []

    def args(*sweeps):
        return simulate_args(gin_file, params, target=target, length_dist=length_dist, steps=steps,
                             sweeps=[*where, *sweeps])

    own = simulate_rows(args(*([f"eta={eta}"] if eta is not None else [])), adjust_workload=adjust)
    eta0 = simulate_rows(args("eta=0"), include_sync=False, adjust_workload=adjust)
    return {"own": own, "eta0": eta0["rows"][0]}


def summary(name: str, report: dict) -> dict:
    own = report["own"]
    async_row = next(r for r in own["rows"] if r["mode"] == "async")
    sync = next(r for r in own["rows"] if r["mode"] == "sync")
    eta0 = report["eta0"]
    return {
        "config": name, "split": async_row["split"], "eta": async_row["eta"],
        "async_tok_s": async_row["trained_tokens_per_s"], "sync_tok_s": sync["trained_tokens_per_s"],
        "vs_sync": async_row["vs_sync"], "async_bound": sync["async_bound"],
        "vs_async_bound": async_row["vs_async_bound"], "g": sync["generation_share"],
        "e_s": sync["sync_generation_efficiency"], "t": sync["train_share"], "e_t": sync["sync_train_efficiency"],
        "bound_live_per_replica": sync["bound_live_per_replica"],
        "eta0_tok_s": eta0["trained_tokens_per_s"],
        "vs_eta0_same_split": async_row["trained_tokens_per_s"] / eta0["trained_tokens_per_s"],
        "tok_s_per_device": async_row["trained_tokens_per_s_per_device"],
        "roofline_fraction": async_row["roofline_fraction"], "sync_roofline_fraction": sync["roofline_fraction"],
        "padded_async": async_row["padded_token_ratio"], "padded_sync": sync["padded_token_ratio"],
        "hosts": own["assumptions"]["hosts"], "devices_per_host": own["assumptions"]["devices_per_host"],
        "lengths": own["assumptions"]["lengths"],
    }


HEADER = ("| config (target) | split, eta | trained tok/s async / fair sync | vs fair sync | async_bound (g, e_s; t, e_t) "
          "| async / bound | vs eta 0 on the same split (the paper's kind) | tok/s per device | roofline fraction "
          "async / sync | padded async / sync |\n|---|---|---|---|---|---|---|---|---|---|")


def line(s: dict) -> str:
    return (f"| {s['config']} | {s['split']}, {s['eta']} | {s['async_tok_s']:,.0f} / {s['sync_tok_s']:,.0f} | "
            f"{s['vs_sync']:.2f}x | {s['async_bound']:.2f}x ({s['g']:.2f}, {s['e_s']:.2f}; {s['t']:.2f}, {s['e_t']:.2f}) | {s['vs_async_bound']:.2f} | "
            f"{s['vs_eta0_same_split']:.2f}x | {s['tok_s_per_device']:,.0f} | "
            f"{s['roofline_fraction']:.2f} / {s['sync_roofline_fraction']:.2f} | "
            f"{s['padded_async']:.2f}x / {s['padded_sync']:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--match", default="", help="only the scenarios whose name contains this text")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = []
    print(HEADER, flush=True)
    for gin_file in shipped_configs():
        if args.match not in gin_file:
            continue
        t0 = time.time()
        target = re.search(r'^PlanConfig\.target\s*=\s*"([^"]+)"', open(gin_file).read(), re.M).group(1)
        s = summary(f"`{os.path.basename(gin_file)}` ({target})",
                    rows(gin_file, [], target=None, length_dist=None, steps=args.steps))
        out.append(s)
        print(line(s), f"<!-- {time.time() - t0:.0f} s -->", flush=True)
    name, (params, dist) = "1.5B, 16k cap", PAPER["1.5B, 16k cap"]
    key = f"paper {name}, 16 x 8 H800 (H100 figures), paged"
    if args.match in key:
        t0 = time.time()
        # The paged engine of docs/scale.md's issue-25 table (bench/simulate_scale.py --paged: the
        # dense cache's pool, 512 slots per GPU) at its best split, 5:3, eta 4.
        bindings, adjust = paged_paper(params, 768 // 6, (4,))
        s = summary(key, rows("configs/qwen2_5_7b_math_gpu.gin", bindings, target="16x8xh100", length_dist=dist,
                              steps=args.steps, split=5, eta=4, adjust=adjust))
        out.append(s)
        print(line(s), f"<!-- {time.time() - t0:.0f} s -->", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
