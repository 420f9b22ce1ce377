"""Side by side with TRL: GRPOTrainer (torch, CPU) vs areal_jax's RLLoop on the same RL workload.

Shared: one random Qwen2-shaped checkpoint saved by transformers and loaded by both sides, the
arithmetic task's tokenizer (in the checkpoint directory), the same prompts in the same order,
its reward (areal_jax/tasks/reward.py, loaded by file path on the TRL side), B prompts x n
samples per step, up to --max-new new tokens at temperature 1.0, and one AdamW step per batch
with the same lr / betas / eps / weight decay / grad-norm clip, fp32, no KL term (no
reference model) and group-normalized advantages.

Trained tokens = completion tokens (the generated tokens, the stop token included, that carry
the policy loss), counted the same way on both sides. Step time = time between consecutive
step ends, so the overlap of generation and training in asynchronous mode is credited. The
first --warmup steps (compilation, allocator warm-up) are not measured.

areal_jax rows: "async" (max_staleness --staleness, interruptible generation) and "sync"
(max_staleness 0, generation paused while training). With one update per step neither side
runs a separate forward for the old/proximal log-probs: TRL skips it when it takes one step
per generation, areal_jax's decoupled PPO takes pi_prox from the loss forward itself. The sync
row uses naive PPO (proximal = behavior), the same on-policy objective as TRL's.

TRL is not a dependency of the project: this script installs it into .venv-ref on first use.

Usage: .venv/bin/python -m bench.trl_side_by_side [--steps 8 --warmup 2 --modes trl,async,sync]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import subprocess
import tempfile
import time

import numpy as np

from bench.common import REF_PYTHON, ROOT, CompileClock, machine, qwen2_bench_config, torch_side

TRL_VERSION = "1.16.0"  # the newest TRL; works with torch 2.13 and transformers 5.24 of .venv-ref
MODES = ("trl", "async", "sync")


def ensure_trl(version: str) -> None:
    """Installs TRL into .venv-ref unless it imports; the installed torch and transformers stay pinned."""
    if not REF_PYTHON.exists():
        raise SystemExit("the torch reference venv is missing: run `AREAL_WITH_REFERENCE=1 source launch/env.sh`")
    if subprocess.run([str(REF_PYTHON), "-c", "import trl"], capture_output=True).returncode == 0:
        return
    pins = subprocess.run([str(REF_PYTHON), "-c", "import torch, transformers; "
                           "print(f'torch=={torch.__version__}\\ntransformers=={transformers.__version__}')"],
                          capture_output=True, text=True, check=True).stdout
    print(f"installing trl=={version} into .venv-ref (keeping {pins.split()}) ...", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
        constraints.write(pins)
        constraints.flush()
        proc = subprocess.run([str(REF_PYTHON), "-m", "pip", "install", "-q", f"trl=={version}", "-c",
                               constraints.name], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"could not install trl=={version} into .venv-ref (pip exit {proc.returncode}); "
                         f"the TRL side cannot run. pip said:\n{proc.stderr[-3000:]}")


def make_checkpoint(directory: pathlib.Path, layers: int, hidden: int, seed: int) -> int:
    """A random Qwen2 checkpoint (saved by transformers) plus the task tokenizer in one directory; returns #params."""
    from areal_jax.tasks.tokenizer_builder import EOS, PAD, build_tokenizer, vocabulary

    vocab = vocabulary()
    config = {**qwen2_bench_config(layers=layers, hidden=hidden, vocab=len(vocab)), "eos_token_id": vocab[EOS],
              "pad_token_id": vocab[PAD], "bos_token_id": None}
    made = torch_side("make_model", out=str(directory), config=config, seed=seed)
    build_tokenizer(directory)  # after the model: its generation_config.json names eos and pad
    return made["params"]


def prompt_rows(tokenizer, count: int, seed: int) -> list[dict]:
    """The first `count` training problems of the arithmetic task as loader rows (the same list for both sides)."""
    from areal_jax.tasks import arithmetic as ar

    return list(ar.prompt_rows(tokenizer, ar.problems(ar.ArithmeticConfig(), "train", count, seed=seed)))


def step_figures(ends: list[float], tokens: list[float], warmup: int,
                 compiled: list[float] | None = None) -> dict:
    """Per-step wall times (between consecutive step ends) and trained tokens/s after `warmup` steps.

    `compiled`: cumulative XLA compile seconds at each step end (areal_jax side). A micro-batch
    shape first seen inside the window compiles there (seconds on this CPU, once per shape in a
    run of any length); the steady figure leaves out the steps that compiled."""
    times = np.diff(np.asarray(ends))[warmup - 1:]
    measured = np.asarray(tokens[warmup:], np.float64)
    per_step = np.zeros(len(times)) if compiled is None else np.diff(np.asarray(compiled))[warmup - 1:]
    quiet = per_step < 0.1
    return {"median_s": float(np.median(times)), "mean_s": float(times.mean()), "steps": len(times),
            "tokens": float(measured.sum()), "tokens_per_s": float(measured.sum() / times.sum()),
            "tokens_per_step": float(measured.mean()), "compile_s": float(per_step.sum()),
            "steady_steps": int(quiet.sum()),
            "steady_tokens_per_s": float(measured[quiet].sum() / times[quiet].sum()) if quiet.any() else float("nan")}


def run_trl(model_dir: pathlib.Path, rows: list[dict], args) -> dict:
    request = {
        "model_dir": str(model_dir), "reward_file": str(ROOT / "areal_jax" / "tasks" / "reward.py"),
        "rows": [{"messages": r["row"].messages, "answer": r["row"].answer, "prompt_ids": r["prompt_ids"].tolist()}
                 for r in rows],
        "steps": args.warmup + args.steps, "batch": args.batch, "n": args.n, "max_new_tokens": args.max_new,
        "lr": args.lr, "b1": args.b1, "b2": args.b2, "eps": args.eps, "weight_decay": args.weight_decay,
        "max_grad_norm": args.max_grad_norm, "seed": args.seed, "threads": args.threads,
        "out_dir": str(model_dir.parent / "trl_out")}
    proc = subprocess.run([str(REF_PYTHON), str(ROOT / "bench" / "trl_grpo_side.py")], input=json.dumps(request),
                          capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode:
        raise RuntimeError(f"the TRL side failed:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    steps = out["steps"]
    figures = step_figures([s["end"] for s in steps], [s["tokens"] for s in steps], args.warmup)
    figures["reward"] = float(np.mean([s["reward"] for s in steps]))
    # Generation (plus scoring) runs from the previous step's end to the scoring; training after it.
    measured = steps[args.warmup:]
    figures["generate_s"] = float(np.mean([s["scored"] - prev["end"]
                                          for prev, s in zip(steps[args.warmup - 1:], measured)]))
    figures["train_s"] = float(np.mean([s["end"] - s["scored"] for s in measured]))
    figures["versions"] = f"trl {out['trl']}, torch {out['torch']}, transformers {out['transformers']}, " \
                          f"{out['threads']} threads"
    return figures


def run_areal(mode: str, model_dir: pathlib.Path, rows: list[dict], args, clock: CompileClock) -> dict:
    import areal_jax.tasks  # noqa: F401  (registers the "arithmetic" reward)
    from areal_jax.generation import EngineConfig
    from areal_jax.models import load_params
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.ppo import AdvantageConfig
    from areal_jax.rollout.workflow import RLVRConfig
    from areal_jax.trainer import OptimizerConfig, PPOConfig, RLConfig, TrainEngineConfig
    from areal_jax.jobs.rl_loop_builder import build_rl_loop

    sync = mode == "sync"
    tokenizer = Tokenizer.from_pretrained(model_dir)
    cfg, params = load_params(model_dir)
    in_flight = args.batch if sync else args.batch * (args.staleness + 1)
    rl = RLConfig(steps=args.warmup + args.steps, batch_size=args.batch, max_staleness=0 if sync else args.staleness,
                  max_concurrent=in_flight, mode=mode)
    longest_prompt = max(len(r["prompt_ids"]) for r in rows)
    ends: list[float] = []
    compiled: list[float] = []
    history: list[dict] = []

    def on_step(step: int, metrics: dict) -> None:
        ends.append(time.perf_counter())
        compiled.append(clock.total_s)
        history.append(metrics)

    loop = build_rl_loop(
        cfg, params, tokenizer=tokenizer, data_iter=itertools.cycle(rows), rl=rl,
        # Sync trains each batch once, on-policy: proximal = behavior (naive PPO) is then the same
        # objective as TRL's. Async needs the decoupled one (pi_prox from the loss forward).
        # Unrolled layers, as configs/quickstart.gin runs this size of model on CPU.
        ppo=PPOConfig(num_minibatches=1, objective="naive" if sync else "decoupled"),
        train_engine=TrainEngineConfig(max_tokens_per_microbatch=args.microbatch_tokens, scan_layers=False,
                                       row_buckets=row_buckets(args.row_buckets, args.microbatch_tokens)),
        optimizer=OptimizerConfig(lr=args.lr, b1=args.b1, b2=args.b2, eps=args.eps, weight_decay=args.weight_decay,
                                  max_grad_norm=args.max_grad_norm),
        advantages=AdvantageConfig(norm="group"),
        # TRL trains on every group, all-equal rewards included: no filter here either.
        workflow=RLVRConfig(n_samples=args.n, max_new_tokens=args.max_new, temperature=1.0, reward="arithmetic",
                            filter_all_equal_rewards=False, stop_token_ids=tokenizer.stop_token_ids),
        engine=EngineConfig(num_slots=min(in_flight * args.n, args.max_slots),
                            max_seq_len=longest_prompt + args.max_new + 1, decode_chunk=args.decode_chunk,
                            seed=args.seed),
        on_step=on_step)
    loop.run()
    figures = step_figures(ends, [m["train/trained_tokens"] for m in history], args.warmup, compiled)
    figures["reward"] = float(np.mean([m["reward/mean"] for m in history]))
    measured = history[args.warmup:]
    # The trainer's time waiting for a batch, and its training step (forward + backward + update).
    figures["generate_s"] = float(np.mean([m["time/wait_batch_s"] for m in measured]))
    figures["train_s"] = float(np.mean([m["time/train_step_s"] for m in measured]))
    figures["staleness_max"] = max(m["staleness/max"] for m in measured)
    return figures


def row_buckets(extra: str, budget: int) -> tuple[int, ...]:
    """TrainEngineConfig.row_buckets: the default powers of two up to the budget plus `extra` sizes."""
    from areal_jax.packing import default_buckets

    return tuple(sorted({*default_buckets(budget), *(int(x) for x in extra.split(",") if x.strip())}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (compilation), >= 1")
    ap.add_argument("--batch", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--b1", type=float, default=0.9)
    ap.add_argument("--b2", type=float, default=0.999)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--staleness", type=int, default=2, help="max_staleness (eta) of the async row")
    ap.add_argument("--max-slots", type=int, default=128, help="cap on the engine's decode slots")
    ap.add_argument("--decode-chunk", type=int, default=8)
    ap.add_argument("--microbatch-tokens", type=int, default=8192)
    ap.add_argument("--row-buckets", default="",
                    help="row lengths added to the default powers of two from 128 (comma-separated), e.g. 96: "
                         "~70-token samples that do not pair in 128-token rows waste less one per 96-token row, "
                         "at the price of more micro-batch shapes to compile")
    # As many torch threads as areal_jax's XLA uses (every core): the fair default. Under heavy load
    # from other jobs 2 threads once made HF generate ~20x slower; --threads 1 is for that case.
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads on the TRL side")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    ap.add_argument("--trl-version", default=TRL_VERSION)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if args.warmup < 1 or args.steps < 1 or any(m not in MODES for m in modes):
        ap.error(f"--warmup and --steps must be >= 1 and --modes a subset of {MODES}")
    if "trl" in modes:
        ensure_trl(args.trl_version)

    from areal_jax.models.tokenizer import Tokenizer

    load_before = os.getloadavg()[0]
    results: dict[str, dict] = {}
    clock = CompileClock()  # one listener for every areal_jax row (jax keeps each registered one)
    with tempfile.TemporaryDirectory(prefix="trl_side_by_side_") as tmp:
        model_dir = pathlib.Path(tmp) / "model"
        n_params = make_checkpoint(model_dir, args.layers, args.hidden, args.seed)
        tokenizer = Tokenizer.from_pretrained(model_dir)
        # Enough prompts for the async side's look-ahead; TRL takes the first (warmup + steps) x batch.
        rows = prompt_rows(tokenizer, (args.warmup + args.steps + args.staleness + 2) * args.batch, args.seed)
        for mode in modes:
            t0 = time.perf_counter()
            results[mode] = (run_trl(model_dir, rows, args) if mode == "trl"
                             else run_areal(mode, model_dir, rows, args, clock))
            results[mode]["wall_s"] = time.perf_counter() - t0
            print(f"[{mode}] done in {results[mode]['wall_s']:.0f} s", flush=True)

    print(f"machine: {machine()}; 1-min load average {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} "
          f"at the end")
    print(f"model: random Qwen2, {n_params / 1e6:.2f}M parameters ({args.layers} layers, hidden {args.hidden}, "
          f"vocab {len(tokenizer)}); {args.batch} prompts x {args.n} samples per step, up to {args.max_new} new "
          f"tokens, temperature 1.0, AdamW lr {args.lr}; {args.warmup} warm-up + {args.steps} measured steps")
    if "trl" in results:
        print(f"TRL side: {results['trl']['versions']}")
    print("gen s: TRL generation + scoring; areal_jax: the trainer's wait for a batch. train s: the update "
          "(forward + backward + optimizer step). stale: max version lag of a trained token")
    print(f"{'side':6s} {'median s/step':>14s} {'mean s/step':>12s} {'gen s':>6s} {'train s':>8s} "
          f"{'trained tok/s':>14s} {'tok/step':>9s} {'reward':>7s} {'stale':>6s} {'vs TRL':>7s} "
          f"{'compile s':>9s} {'steady vs TRL':>13s}")
    for mode, r in results.items():
        trl = results.get("trl")
        ratio = f"{r['tokens_per_s'] / trl['tokens_per_s']:.2f}x" if trl else "-"
        steady = (f"{r['steady_tokens_per_s'] / trl['tokens_per_s']:.2f}x ({r['steady_steps']})" if trl else "-")
        print(f"{mode:6s} {r['median_s']:14.2f} {r['mean_s']:12.2f} {r['generate_s']:6.2f} {r['train_s']:8.2f} "
              f"{r['tokens_per_s']:14.1f} {r['tokens_per_step']:9.0f} {r['reward']:7.3f} "
              f"{r.get('staleness_max', 0):6d} {ratio:>7s} {r['compile_s']:9.1f} {steady:>13s}")
    print("compile s: XLA compilation inside the measured window (a micro-batch shape first seen there); "
          "steady: trained tokens/s over the measured steps without compilation (their count in brackets)")
    if "trl" in results:
        for mode in ("async", "sync"):
            if mode in results:
                print(f"ratio {mode} / TRL: {results[mode]['tokens_per_s'] / results['trl']['tokens_per_s']:.2f}x "
                      f"trained tokens/s, {results['trl']['median_s'] / results[mode]['median_s']:.2f}x median "
                      f"step time")


if __name__ == "__main__":
    main()
