"""Staleness ablation at toy scale (the paper's Table 2 / Fig. 5): max_staleness (eta) x objective.

One SFT-only run of the quickstart job (one per seed with `--sft_per_seed`) writes a checkpoint;
every RL configuration then starts from it in a fresh `areal-jax train` subprocess (one at a time: throughput is
wall time on shared cores). Every configuration runs in "async" mode so only eta changes
(eta = 0 there is synchronous data with the asynchronous machinery). The objectives
(`--variants`, `areal_jax.trainer.config.OBJECTIVES`): "decoupled" is decoupled PPO (proximal
policy recomputed with the pre-step weights, weighted by pi_prox / pi_behav), "naive" is PPO with
proximal := behavior (`PPOConfig.objective = "naive"`: the clip is a trust region around the
sampling policy), "naive_recompute" anchors the clip at the recomputed pre-step policy with no
behaviour weight (`behav_imp_weight_mode = "disabled"`; AReaL v0.3.0 with recomputed log-probs and
decoupling off, which may be what the paper's naive rows ran).

Seeds: by default one SFT checkpoint is shared and a seed varies only the engine's sampling
(`EngineConfig.seed`). With `--sft_per_seed` a seed varies everything a repeat should: its own SFT
run (`SFTConfig.seed`, `ModelSource.init_seed`), the problems and their order (`TaskSource.seed`,
for SFT and RL alike, so a seed's runs share their held-out set) and the engine's sampling; runs of
different configurations with one seed are then paired (`bench/ablation_report.py`).

`--regime offpolicy` adds bindings meant to make staleness bite (`REGIMES`): sampling at
temperature 1.0, an earlier SFT stop (a higher-entropy start), the paper's batch-level advantage
normalisation, its 4 minibatches per step and no weight cap. They are a starting point for a
short probe (e.g. `--etas 8 --variants decoupled --steps 20 --per_step`), not a measured regime.
A `--gin_param` comes after them (and the objective's bindings after that): a cap for the
decoupled arm goes in its own `--out` directory, sharing the SFT runs through `--sft_root`:

    S=(--regime offpolicy --sft_per_seed --seeds 0 1 2 3 4)   # at eta 0 the objectives coincide: one arm
    .venv/bin/python -m bench.staleness_ablation "${S[@]}" --etas 0 --variants decoupled --out /tmp/abl31/main
    .venv/bin/python -m bench.staleness_ablation "${S[@]}" --etas 2 8 --variants decoupled naive naive_recompute \
        --out /tmp/abl31/main
    .venv/bin/python -m bench.staleness_ablation "${S[@]}" --etas 8 --variants decoupled \
        --out /tmp/abl31/cap5_clamp --sft_root /tmp/abl31/main \
        --gin_param 'PPOConfig.behav_imp_weight_cap = 5.0' --gin_param 'PPOConfig.behav_imp_weight_mode = "clamp"'

Per configuration, from the run's summary.json and metrics.jsonl (or metrics.jsonl.gz, as kept in
bench/results/): held-out greedy accuracy at the start (the checkpoint), during RL
(`RLConfig.eval_every`) and at the end; trained tokens per second (whole RL stage, and steady state
after `--warmup` steps, in-loop evaluations included); observed staleness of the trained tokens
(max, token-weighted mean); how off-policy the training was, per step and averaged: the share of
trained tokens whose pi_theta / pi_behav lies outside [0.8, 1.2], the clipped share, and the share
of the gradient carried by the 1% of tokens with the largest behaviour weight (`--per_step` prints
them step by step).

    .venv/bin/python -m bench.staleness_ablation --steps 30 --seeds 0
    .venv/bin/python -m bench.staleness_ablation --sft_run /tmp/staleness_ablation/sft --etas 0 4 \\
        --gin_param 'OptimizerConfig.lr = 2e-5'
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from areal_jax.trainer.config import OBJECTIVES
from bench.common import read_jsonl_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = tuple(OBJECTIVES)  # "decoupled", "naive", "naive_recompute"
# Bindings added to every run (SFT included) by --regime.
REGIMES = {
    "default": [],
    "offpolicy": ["RLVRConfig.temperature = 1.0", "PPOConfig.temperature = 1.0",
                  "SFTConfig.eval_from = 300", "SFTConfig.stop_accuracy = 0.3",
                  "AdvantageConfig.norm = 'batch'", "PPOConfig.num_minibatches = 4",
                  "PPOConfig.behav_imp_weight_cap = None"],
}
# Per-step training metrics read back from metrics.jsonl (NaN where a run predates them).
STEP_METRICS = ("train/behav_ratio_out_frac", "train/clip_frac", "train/weight_top1pct_grad_share",
                "train/imp_weight_max")


def objective_bindings(variant: str) -> list[str]:
    """The gin bindings that select one objective; "decoupled" keeps the gin file's behaviour-weight
    cap and mode, "naive_recompute" sets the cap to None and the mode to "disabled"."""
    return [f"PPOConfig.{k} = {v!r}" for k, v in OBJECTIVES[variant].items()]


def train(run_dir: pathlib.Path, gin_file: str, params: list[str], compile_cache: str = "") -> float:
    """`areal-jax train` in a fresh process; returns the command's wall time.

    With `compile_cache`, XLA programs persist across the runs (every configuration compiles the
    same shapes; on shared cores that costs minutes per run otherwise).
    """
    cache = {"JAX_COMPILATION_CACHE_DIR": compile_cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"} if compile_cache else {}
    cmd = [sys.executable, "-m", "areal_jax.cli", "train", f"--gin_file={gin_file}", f"--run_dir={run_dir}",
           "--quiet", *(f"--gin_param={p}" for p in params)]
    t0 = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **cache})
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}); see {log.name}")
    return time.perf_counter() - t0


def seed_bindings(seed: int) -> list[str]:
    """What a seed fixes besides the engine's sampling under --sft_per_seed (SFT and RL runs)."""
    return [f"SFTConfig.seed = {seed}", f"ModelSource.init_seed = {seed}", f"TaskSource.seed = {seed}"]


def sft_checkpoint(out: pathlib.Path, gin_file: str, extra: list[str], seed: int | None = None) -> pathlib.Path:
    """The SFT-only run: shared (seed None) or the seed's own (`seed_bindings`); skipped when its
    final_model already exists."""
    run_dir = out / ("sft" if seed is None else f"sft_seed{seed}")
    if seed is not None:
        extra = [*extra, *seed_bindings(seed)]
    if not (run_dir / "final_model" / "config.json").exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        wall = train(run_dir, gin_file, [*extra, "Stages.rl = False", "Stages.plot = False"])
        print(f"SFT: {json.loads((run_dir / 'summary.json').read_text())['sft_accuracy']:.3f} held-out accuracy "
              f"({wall:.0f} s) -> {run_dir / 'final_model'}", flush=True)
    return run_dir / "final_model"


def _number(v) -> float:
    return float(v) if not isinstance(v, str) else {"NaN": math.nan, "Infinity": math.inf}.get(v, math.nan)


def read_run(run_dir: pathlib.Path, warmup: int) -> dict:
    """Figures of one RL run from its summary.json and metrics.jsonl (or metrics.jsonl.gz)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_jsonl_records(run_dir / "metrics.jsonl")  # or metrics.jsonl.gz (bench/results/)
    steps = [r["metrics"] for r in records if r["step"] >= 0]  # RL's (SFT's steps are at negative indices)
    curve = [(0, summary["sft_accuracy"])] + [(m["step"] + 1, _number(m["eval/accuracy"])) for m in steps
                                              if "eval/accuracy" in m]
    # The same points against the RL stage's wall time at the end of that step (earlier in-loop
    # evaluations included: every row evaluates at the same steps, at the same cost).
    curve_wall = [(0.0, summary["sft_accuracy"])] + [(m["time/wall_s"], _number(m["eval/accuracy"])) for m in steps
                                                     if "eval/accuracy" in m]
    lag = {}
    for m in steps:
        for k, v in m["staleness/hist"].items():
            lag[int(k)] = lag.get(int(k), 0.0) + _number(v)
    lag_tokens = sum(lag.values())
    wall = [m["time/wall_s"] for m in steps]
    tokens = [m["train/trained_tokens_total"] for m in steps]
    k = min(warmup, len(steps) - 1)
    per_step = {name: [_number(m.get(name, math.nan)) for m in steps] for name in STEP_METRICS}
    return {
        "per_step": per_step,
        **{f"{name.split('/')[1]}_mean": float(np.nanmean(v)) if np.isfinite(v).any() else math.nan
           for name, v in ((n, np.asarray(x, float)) for n, x in per_step.items())},
        "start_accuracy": summary["sft_accuracy"], "final_accuracy": summary["final_accuracy"], "curve": curve,
        "curve_wall": curve_wall,
        "steps": len(steps), "rl_wall_s": wall[-1], "trained_tokens": tokens[-1],
        "tokens_per_s": tokens[-1] / wall[-1],
        "steady_tokens_per_s": (tokens[-1] - tokens[k - 1]) / (wall[-1] - wall[k - 1]) if k >= 1 else math.nan,
        "staleness_max": max(m["staleness/max"] for m in steps),
        "staleness_mean": sum(k * v for k, v in lag.items()) / lag_tokens if lag_tokens else 0.0,
        "rollout_reward_first": float(np.nanmean([_number(m["rollout/reward_mean"]) for m in steps[:5]])),
        "rollout_reward_last": float(np.nanmean([_number(m["rollout/reward_mean"]) for m in steps[-5:]])),
    }


def run_config(out: pathlib.Path, model: pathlib.Path, eta: int, variant: str, seed: int, args,
               extra: list[str]) -> dict:
    """One RL run from checkpoint `model` with bindings `extra` (regime, --gin_param, the seed's
    own under --sft_per_seed). variant "sync" is the synchronous baseline
    (`RLConfig.mode = "sync"`, eta 0: the engine pauses while the trainer steps; on-policy, so
    the decoupled and naive objectives coincide)."""
    run_dir = out / (f"sync_seed{seed}" if variant == "sync" else f"eta{eta}_{variant}_seed{seed}")
    if not (run_dir / "summary.json").exists():
        mode = "sync" if variant == "sync" else "async"
        params = [*extra, "Stages.sft = False", f"ModelSource.path = '{model}'",
                  "Stages.save_final_model = False", "Stages.plot = False", f'RLConfig.mode = "{mode}"',
                  f"RLConfig.max_staleness = {eta}", *objective_bindings("naive" if variant == "sync" else variant),
                  f"EngineConfig.seed = {seed}"]
        if args.steps is not None:
            params.append(f"RLConfig.steps = {args.steps}")
        run_dir.mkdir(parents=True, exist_ok=True)
        train(run_dir, args.gin_file, params, args.compile_cache)
    return {"eta": eta, "variant": variant, "seed": seed, **read_run(run_dir, args.warmup)}


def table(results: list[dict]) -> str:
    """Per (eta, variant): mean over seeds of the figures; the accuracy curve of the first seed."""
    lines = ["| eta | objective | seeds | start acc | final acc | gain | acc curve (step: acc) | trained tok/s "
             "(steady) | staleness max / mean | sampled reward first 5 -> last 5 steps | off-policy tokens | "
             "top-1% weight gradient share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["eta"], r["variant"]) for r in results}, key=lambda k: (k[0], k[1] != "decoupled"))
    for eta, variant in keys:
        rs = [r for r in results if r["eta"] == eta and r["variant"] == variant]

        def mean(name):
            return float(np.mean([r[name] for r in rs]))

        final = [r["final_accuracy"] for r in rs]
        spread = f" ± {np.std(final):.3f}" if len(rs) > 1 else ""
        curve = ", ".join(f"{s}: {a:.2f}" for s, a in rs[0]["curve"])
        lines.append(f"| {eta} | {variant} | {len(rs)} | {mean('start_accuracy'):.3f} | {mean('final_accuracy'):.3f}"
                     f"{spread} | {mean('final_accuracy') - mean('start_accuracy'):+.3f} | {curve} | "
                     f"{mean('tokens_per_s'):.0f} ({mean('steady_tokens_per_s'):.0f}) | "
                     f"{max(r['staleness_max'] for r in rs)} / {mean('staleness_mean'):.2f} | "
                     f"{mean('rollout_reward_first'):.3f} -> {mean('rollout_reward_last'):.3f} | "
                     f"{mean('behav_ratio_out_frac_mean'):.3f} | {mean('weight_top1pct_grad_share_mean'):.3f} |")
    return "\n".join(lines)


def per_step_table(per_step: dict[str, list[float]]) -> str:
    """One line per RL step of the STEP_METRICS."""
    names = [n.split("/")[1] for n in STEP_METRICS]
    lines = ["step  " + "  ".join(f"{n:>25s}" for n in names)]
    for i, row in enumerate(zip(*(per_step[n] for n in STEP_METRICS))):
        lines.append(f"{i:4d}  " + "  ".join(f"{v:25.4f}" for v in row))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gin_file", default="configs/quickstart.gin")
    p.add_argument("--gin_param", action="append", default=[], help="binding for every run, SFT included (repeatable)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the gin file's RLConfig.steps)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="RL sampling seeds (EngineConfig.seed)")
    p.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    p.add_argument("--variants", nargs="+", default=["decoupled", "naive"], choices=VARIANTS,
                   help="objectives to run at each eta (see the module docstring)")
    p.add_argument("--sync_baseline", action="store_true",
                   help="also one synchronous row per seed (RLConfig.mode = 'sync', eta 0)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the steady-state throughput")
    p.add_argument("--out", default="/tmp/staleness_ablation",
                   help="parent of the run directories; finished runs found there are read, not rerun")
    p.add_argument("--compile_cache", default="/tmp/areal_jax_bench_cache",
                   help="persistent XLA cache shared by the runs ('' = off)")
    p.add_argument("--sft_run", default=None, help="an existing run directory whose final_model to start from")
    p.add_argument("--sft_per_seed", action="store_true",
                   help="each seed its own SFT start, problems and prompt order (see the module docstring)")
    p.add_argument("--sft_root", default=None,
                   help="directory of the SFT runs (sft/, sft_seed{S}/; default --out): ablations in several "
                        "--out directories (e.g. one per weight cap) can share them")
    p.add_argument("--regime", default="default", choices=list(REGIMES), help="bindings added to every run")
    p.add_argument("--per_step", action="store_true", help="print each run's per-step off-policy figures")
    args = p.parse_args(argv)
    if args.sft_run and args.sft_per_seed:
        raise SystemExit("--sft_run and --sft_per_seed exclude each other")
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sft_root = pathlib.Path(args.sft_root).resolve() if args.sft_root else out
    common = [*REGIMES[args.regime], *args.gin_param]
    shared = None if args.sft_per_seed else (
        (pathlib.Path(args.sft_run).resolve() / "final_model") if args.sft_run
        else sft_checkpoint(sft_root, args.gin_file, common))
    results = []
    plan = [(0, "sync")] * args.sync_baseline + [(eta, v) for eta in args.etas for v in args.variants]
    for eta, variant in plan:
        for seed in args.seeds:
            t0 = time.perf_counter()
            model, extra = shared, common
            if args.sft_per_seed:
                model, extra = sft_checkpoint(sft_root, args.gin_file, common, seed), [*common, *seed_bindings(seed)]
            r = run_config(out, model, eta, variant, seed, args, extra)
            results.append(r)
            print(f"eta {eta} {variant:9s} seed {seed}: accuracy {r['start_accuracy']:.3f} -> "
                  f"{r['final_accuracy']:.3f}, {r['tokens_per_s']:.0f} trained tokens/s, staleness max "
                  f"{r['staleness_max']} mean {r['staleness_mean']:.2f}, off-policy tokens "
                  f"{r['behav_ratio_out_frac_mean']:.3f}, top-1% gradient share "
                  f"{r['weight_top1pct_grad_share_mean']:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if args.per_step:
                print(per_step_table(r["per_step"]), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    print(f"load average: {os.getloadavg()}; results: {out / 'results.json'}; command: {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
