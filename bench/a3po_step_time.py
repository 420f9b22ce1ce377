"""Training-step time with the proximal forward (decoupled PPO) against A-3PO's log-linear approximation.

`PPOConfig.prox_logp_method = "recompute"` runs one log-prob forward per micro-batch with the
pre-step weights before the step's minibatch updates; "loglinear" (A-3PO, AReaL HEAD) replaces it
by per-token interpolation weights from the token versions, computed on the host. Both trainers
start from the same random weights and train on the same packed minibatches (random trajectories
whose tokens lag 0-4 versions behind the trained one); after `--warmup` steps each (compilation),
the two take steps in turn, so load on a shared machine hits both alike. Reported per side: the
median step time and its proximal phase (`time_step_s`, `time_proximal_s` of
`PPOStep.train`), the ratio of the medians and the median ratio of the step pairs.

Usage: .venv/bin/python -m bench.a3po_step_time [--steps 8 --warmup 2 --groups 32 --n 4 --minibatches 4]
"""

import argparse
import dataclasses
import json
import platform
import time

import jax
import numpy as np

from areal_jax.models import ModelConfig, init_params
from areal_jax.ppo import AdvantageConfig
from areal_jax.rollout.types import Trajectory, TrajectoryGroup
from areal_jax.trainer.batching import build_sequences, make_microbatches, sequence_group_ids
from areal_jax.trainer.optimizer import OptimizerConfig
from areal_jax.trainer.algorithm import PPOStep, ppo_trainer
from areal_jax.trainer.config import PPOConfig, TrainEngineConfig

VERSION = 8  # the trained policy's version; tokens carry versions 4..8


def random_groups(rng, cfg, n_groups, n, max_prompt, max_completion):
    groups = []
    for g in range(n_groups):
        trajs = []
        for _ in range(n):
            p, c = int(rng.integers(4, max_prompt + 1)), int(rng.integers(8, max_completion + 1))
            trajs.append(Trajectory(rng.integers(0, cfg.vocab_size, p), rng.integers(0, cfg.vocab_size, c),
                                    (-np.log(cfg.vocab_size) + 0.3 * rng.normal(size=c)).astype(np.float32),
                                    np.sort(rng.integers(VERSION - 4, VERSION + 1, c)), float(rng.choice([-5, 5]))))
        groups.append(TrajectoryGroup(f"q{g}", tuple(trajs), VERSION - 4))
    return groups


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="steps per side before measuring (compilation)")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="samples per group")
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--max-prompt", type=int, default=32)
    ap.add_argument("--max-completion", type=int, default=192)
    ap.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch")
    args = ap.parse_args()

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_layers=args.layers, num_heads=4, num_kv_heads=2, head_dim=args.hidden // 4)
    params = init_params(cfg, jax.random.key(0), std=0.02)
    rng = np.random.default_rng(0)
    groups = random_groups(rng, cfg, args.groups, args.n, args.max_prompt, args.max_completion)
    seqs = build_sequences(groups, AdvantageConfig(norm="group_then_batch"))
    minibatches = make_microbatches(seqs, max_tokens_per_microbatch=args.budget, num_minibatches=args.minibatches,
                                    group_ids=sequence_group_ids(groups), shuffle_seed=(0, 0))
    tokens = sum(len(s["input_ids"]) for s in seqs)
    base = PPOConfig(num_minibatches=args.minibatches, behav_imp_weight_cap=5.0)
    engine = TrainEngineConfig(max_tokens_per_microbatch=args.budget, scan_layers=False)
    sides = {m: PPOStep(ppo_trainer(cfg, params, OptimizerConfig(lr=1e-6), ppo, engine=engine), AdvantageConfig(), ppo)
             for m, ppo in ((m, dataclasses.replace(base, prox_logp_method=m)) for m in ("recompute", "loglinear"))}
    times = {m: [] for m in sides}
    prox = {m: [] for m in sides}
    t0 = time.perf_counter()
    for step in range(args.warmup + args.steps):
        for method, trainer in sides.items():  # in turn: shared-machine load hits both sides alike
            metrics = trainer.train(minibatches, VERSION)  # PPOStep: pi_prox attached, then the engine's step
            if step >= args.warmup:
                times[method].append(metrics["time_step_s"])
                prox[method].append(metrics["time_proximal_s"])
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "devices": str(jax.devices()[0].platform), "cpu_count": __import__("os").cpu_count(),
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "params_m": round(sum(x.size for x in jax.tree.leaves(params)) / 1e6, 2)},
        "step": {"sequences": len(seqs), "tokens": tokens, "minibatches": args.minibatches,
                 "microbatches": sum(len(mb) for mb in minibatches)},
        "median_step_s": {m: float(np.median(v)) for m, v in times.items()},
        "median_proximal_s": {m: float(np.median(v)) for m, v in prox.items()},
        "step_s": {m: [round(x, 3) for x in v] for m, v in times.items()},
        "loglinear_over_recompute": float(np.median(times["loglinear"]) / np.median(times["recompute"])),
        # Each step pair ran back to back: its ratio sees the same machine load on both sides.
        "paired_ratio_median": float(np.median(np.array(times["loglinear"]) / np.array(times["recompute"]))),
        "logprob_compiles": {m: t.trainer.compile_counts["logprobs"] for m, t in sides.items()},
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(result))
    r, ll = result["median_step_s"]["recompute"], result["median_step_s"]["loglinear"]
    print(f"recompute {r:.3f} s/step (proximal {result['median_proximal_s']['recompute']:.3f} s), "
          f"loglinear {ll:.3f} s/step: {ll / r:.2f}x the time, {100 * (1 - ll / r):.0f}% saved "
          f"(paired median {result['paired_ratio_median']:.2f}x)")


if __name__ == "__main__":
    main()
