"""Runs the quickstart (`areal-jax train --gin_file=configs/quickstart.gin`) for several seeds and
prints, per seed, held-out greedy accuracy after SFT and after RL, the gain and the wall time.

The seed varies the SFT data order and batches (SFTConfig.seed), the RL prompt stream
(TaskSource.seed) and the generator's sampling (EngineConfig.seed); runs are sequential (one at
a time: they measure wall time on shared cores).

    .venv/bin/python bench/quickstart_seeds.py --seeds 0 1
    .venv/bin/python bench/quickstart_seeds.py --seeds 0 --gin_param 'OptimizerConfig.lr = 2e-5'
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_seed(seed: int, run_dir: pathlib.Path, gin_file: str, extra: list[str]) -> dict:
    """One quickstart run; returns its summary.json plus the measured wall time of the command."""
    params = [f"SFTConfig.seed = {seed}", f"TaskSource.seed = {seed}", f"EngineConfig.seed = {seed}", *extra]
    cmd = [sys.executable, "-m", "areal_jax.cli", "train", f"--gin_file={gin_file}", f"--run_dir={run_dir}",
           "--quiet", *(f"--gin_param={p}" for p in params)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["command_wall_s"] = time.perf_counter() - t0
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--gin_file", default="configs/quickstart.gin")
    p.add_argument("--gin_param", action="append", default=[], help="extra bindings (repeatable)")
    p.add_argument("--out", default="/tmp/quickstart_seeds", help="parent of the per-seed run directories")
    args = p.parse_args(argv)
    rows = []
    for seed in args.seeds:
        s = run_seed(seed, pathlib.Path(args.out) / f"seed_{seed}", args.gin_file, args.gin_param)
        rows.append((seed, s["sft_accuracy"], s["final_accuracy"], s["command_wall_s"]))
        print(f"seed {seed}: sft {s['sft_accuracy']:.3f} final {s['final_accuracy']:.3f} "
              f"gain {s['final_accuracy'] - s['sft_accuracy']:+.3f} wall {s['command_wall_s']:.0f}s", flush=True)
    print("\nseed  sft_accuracy  final_accuracy  gain    wall_s")
    for seed, sft, final, wall in rows:
        print(f"{seed:<5} {sft:<13.3f} {final:<15.3f} {final - sft:+.3f}  {wall:.0f}")
    print(f"load average: {os.getloadavg()}  command: {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
