"""Asynchronous vs synchronous RL throughput on the same devices and workload (the paper's headline).

Effective training throughput = trained tokens per second of wall time, measured in steady
state: from the end of step `--warmup` to the end of the last step (compilation, which both
sides pay in their first steps, is excluded; compile time still falling inside the window is
reported). Rows (same random model, prompts, engine shape and long-tailed lengths):

    async             the paper's system: max_staleness 4, interruptible generation, 3 of 4
                      devices generate and 1 trains, generation and training overlap.
    sync              the colocated synchronous baseline: all devices generate a batch, the
                      engine pauses while all devices train, max_staleness 0.
    async-colocated   asynchronous (eta 4) on all devices shared by both sides (no split).

Long-tailed lengths: a random policy stops at any of `--stop-tokens` stop characters, so lengths
are geometric (mean ~ vocab / stop tokens) capped at `--max-new`; the batch barrier of the
synchronous side waits for the longest of B x n samples. Reward is a cheap character-parity rule
(bench/rewards.py).

On a host with fewer cores than fake devices (JAX_NUM_CPU_DEVICES) every side shares the same
cores, so the device split buys no parallel compute: what asynchrony can buy there is full
generation slots (no barrier, no long-tail idling) and overlap of generation with training.

Usage: .venv/bin/python -m bench.async_vs_sync [--steps 14 --warmup 6 --batch 12 --n 4 --max-new 384]
           [--run-dir DIR]

With --run-dir each row writes DIR/<mode>/: metrics.jsonl (with the per-program timings),
rollouts/step_N.jsonl and config.gin (the row's configs), which `areal-jax simulate
--gin_file=DIR/<mode>/config.gin --calibrate DIR/<mode>` reads; and DIR/bench.json the figures.

Slots = batch x n must divide over the generation devices of every row (else the engine's
slots are replicated and each device decodes all of them).
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from areal_jax.cli import enable_compile_cache  # noqa: E402
from areal_jax.data.formats import PromptRow  # noqa: E402
from areal_jax.generation import EngineConfig  # noqa: E402
from areal_jax.metrics import MetricsLogger  # noqa: E402
from areal_jax.models import ModelConfig, init_params  # noqa: E402
from areal_jax.models.tokenizer import Tokenizer  # noqa: E402
from areal_jax.parallel import MeshConfig  # noqa: E402
from areal_jax.ppo import AdvantageConfig  # noqa: E402
from areal_jax.rollout.workflow import RLVRConfig  # noqa: E402
from areal_jax.tasks.tokenizer_builder import build_tokenizer  # noqa: E402
from areal_jax.trainer import OptimizerConfig, PPOConfig, RLConfig, TrainEngineConfig  # noqa: E402
from areal_jax.jobs.rl_loop_builder import build_rl_loop  # noqa: E402
from areal_jax.trainer.loop import RLLoop  # noqa: E402
from bench.common import CompileClock, machine  # noqa: E402

MODES = ("async", "sync", "async-colocated")
# Characters a random policy stops at (each ~1/vocab per token): more of them, shorter samples.
STOP_CHARS = "7=#@%&~^"


def rows(tokenizer):
    for i in itertools.count():
        q = f"Compute {i % 9}+{i % 7}."
        row = PromptRow(query_id=f"q{i}", messages=[{"role": "user", "content": q}], answer="0", test_cases=None,
                        task="math", source=f"bench:{i}")
        yield {"prompt_ids": np.asarray(tokenizer.apply_chat_template(row.messages, add_generation_prompt=True),
                                        np.int32), "row": row}


def mesh_for(mode: str, args) -> MeshConfig:
    return MeshConfig(num_generation_devices_per_host=args.gen_devices) if mode == "async" \
        else MeshConfig(colocated=True)


def rollout_config(args, tokenizer) -> RLVRConfig:
    stops = tuple(tokenizer.token_to_id(c) for c in STOP_CHARS[:args.stop_tokens])
    return RLVRConfig(n_samples=args.n, max_new_tokens=args.max_new, reward="bench.rewards:parity_reward",
                      filter_all_equal_rewards=False, stop_token_ids=stops)


def build_loop(mode: str, args, tokenizer, cfg, params, **callbacks) -> RLLoop:
    """The row's loop; `callbacks`: its on_step and on_rollouts."""
    sync = mode == "sync"
    rl = RLConfig(steps=args.steps, batch_size=args.batch, max_staleness=0 if sync else args.eta,
                  max_concurrent=4 * args.batch, mode="sync" if sync else "async", dump_rollouts_every=1)
    mesh = mesh_for(mode, args)
    # One slot per sample of a synchronous batch (B x n): the baseline's full concurrency, and
    # the same engine shape for every row.
    return build_rl_loop(cfg, params, tokenizer=tokenizer, data_iter=rows(tokenizer), rl=rl,
                         ppo=PPOConfig(num_minibatches=args.minibatches),
                         train_engine=TrainEngineConfig(max_tokens_per_microbatch=args.mb_tokens),
                         optimizer=OptimizerConfig(lr=1e-5), advantages=AdvantageConfig(norm="group"),
                         workflow=rollout_config(args, tokenizer),
                         engine=EngineConfig(num_slots=args.batch * args.n, max_seq_len=args.max_new + 48,
                                             decode_chunk=8),
                         mesh=mesh, **callbacks)


def gin_bindings(*configs) -> str:
    """The fields of `configs` that differ from their defaults, as gin bindings."""
    lines = []
    for c in configs:
        default = type(c)()
        lines += [f"{type(c).__name__}.{f.name} = {getattr(c, f.name)!r}" for f in dataclasses.fields(c)
                  if getattr(c, f.name) != getattr(default, f.name)]
    return "\n".join(lines) + "\n"


def run(mode: str, args, tokenizer, cfg, params, clock: CompileClock) -> dict:
    """Runs one row; returns its steady-state figures (window: end of step `warmup` -> end)."""
    log = None
    if args.run_dir:
        out = pathlib.Path(args.run_dir) / mode
        out.mkdir(parents=True, exist_ok=True)
        log = MetricsLogger(out, tensorboard=False, console=False)
    snaps: list[dict] = []
    lengths: dict[int, list[int]] = {}

    def on_step(step, m):
        if log is not None:
            log.log(step, m)
        snaps.append({"wall": m["time/wall_s"], "cpu": time.process_time(), "tokens": m["train/trained_tokens_total"],
                      "compile_s": clock.total_s, "engine": dataclasses.asdict(loop.cluster.engine.stats()),
                      "train_s": m["time/train_step_s"], "wait_s": m["time/wait_batch_s"],
                      "transfer_s": m["time/weight_transfer_s"], "stale_max": m["staleness/max"],
                      "stale_mean": m["staleness/mean"]})

    def on_rollouts(step, records):
        lengths[step] = [len(r["versions"]) for r in records]
        if log is not None:
            log.dump_rollouts(step, records)

    loop = build_loop(mode, args, tokenizer, cfg, params, on_step=on_step, on_rollouts=on_rollouts)
    if args.run_dir:
        (out / "config.gin").write_text(gin_bindings(loop.rl, loop.algorithm.ppo, loop.cluster.trainer.engine_config,
                                                     rollout_config(args, tokenizer), loop.cluster.engine.config,
                                                     mesh_for(mode, args)))
        (out / "devices.json").write_text(json.dumps({"devices_per_host": jax.device_count(), "hosts": 1}))
    compile_before = clock.total_s
    loop.run()
    if log is not None:
        log.close()
    a, b = snaps[args.warmup - 1], snaps[-1]
    window = snaps[args.warmup:]
    wall = b["wall"] - a["wall"]
    ea, eb = a["engine"], b["engine"]
    gen_tokens = eb["generated_tokens"] - ea["generated_tokens"]
    engine_busy = (eb["prefill_s"] - ea["prefill_s"]) + (eb["decode_s"] - ea["decode_s"])
    decode_steps = eb["decode_steps"] - ea["decode_steps"]
    lens = np.concatenate([lengths[s] for s in range(args.warmup, args.steps)])
    return {
        "mode": mode, "window_steps": len(window), "wall_s": wall, "tokens": b["tokens"] - a["tokens"],
        "tps": (b["tokens"] - a["tokens"]) / wall,
        # CPU seconds of this process (all threads): less sensitive to other jobs on the host.
        "cpu_s": b["cpu"] - a["cpu"], "tokens_per_cpu_s": (b["tokens"] - a["tokens"]) / (b["cpu"] - a["cpu"]),
        "warmup_wall_s": a["wall"], "warmup_compile_s": a["compile_s"] - compile_before,
        "window_compile_s": b["compile_s"] - a["compile_s"],
        "gen_tps_wall": gen_tokens / wall,  # generated tokens per second of wall time
        "gen_tps_busy": gen_tokens / engine_busy if engine_busy else 0.0,  # ... per second the engine ran
        "engine_busy_share": engine_busy / wall,
        "prefill_share_of_busy": (eb["prefill_s"] - ea["prefill_s"]) / engine_busy if engine_busy else 0.0,
        "decode_s_per_step": (eb["decode_s"] - ea["decode_s"]) / decode_steps if decode_steps else 0.0,
        "slot_occupancy": (eb["busy_slot_steps"] - ea["busy_slot_steps"]) / decode_steps / args.slots
        if decode_steps else 0.0,
        "reprefill_tokens": eb["reprefill_tokens"] - ea["reprefill_tokens"],
        "train_share": sum(s["train_s"] for s in window) / wall,
        "wait_share": sum(s["wait_s"] for s in window) / wall,
        "transfer_share": sum(s["transfer_s"] for s in window) / wall,
        "len_mean": float(lens.mean()), "len_p50": float(np.median(lens)), "len_p90": float(np.percentile(lens, 90)),
        "len_max": int(lens.max()), "len_max_over_mean": float(lens.max() / lens.mean()),
        "batch_max_over_mean": float(np.mean([max(lengths[s]) / np.mean(lengths[s])
                                              for s in range(args.warmup, args.steps)])),
        "stale_max": max(s["stale_max"] for s in window),
        "stale_mean": float(np.mean([s["stale_mean"] for s in window])),
    }


def report(results: dict, args) -> None:
    print(f"machine: {machine()}, {jax.device_count()} fake CPU devices ('async' splits {args.gen_devices} generate : "
          f"{jax.device_count() - args.gen_devices} train); {args.steps} steps ({args.warmup} warm-up "
          f"excluded) x {args.batch} groups x {args.n} samples, {args.slots} slots, up to {args.max_new} new tokens, "
          f"{args.stop_tokens} stop tokens")
    for mode, r in results.items():
        print(f"{mode:15s}: {r['tps']:8.1f} trained tokens/s ({r['tokens']:.0f} tokens in {r['wall_s']:.1f} s over "
              f"{r['window_steps']} steps; warm-up {r['warmup_wall_s']:.1f} s incl. {r['warmup_compile_s']:.1f} s "
              f"compiling; {r['window_compile_s']:.1f} s compiling inside the window)")
        print(f"{'':15s}  {r['tokens_per_cpu_s']:.1f} trained tokens per CPU-second of this process "
              f"({r['cpu_s'] / r['wall_s']:.2f} cores busy on average)")
        print(f"{'':15s}  generation {r['gen_tps_wall']:.0f} tokens/s of wall ({r['gen_tps_busy']:.0f} per engine-"
              f"busy s; engine busy {r['engine_busy_share']:.0%} of wall), slot occupancy {r['slot_occupancy']:.0%}, "
              f"re-prefilled {r['reprefill_tokens']} tokens; prefill {r['prefill_share_of_busy']:.0%} of engine-busy "
              f"time, {1e3 * r['decode_s_per_step']:.2f} ms per decode step")
        print(f"{'':15s}  trainer: training {r['train_share']:.0%}, waiting for a batch {r['wait_share']:.0%}, "
              f"weight transfer {r['transfer_share']:.0%} of wall; staleness max {r['stale_max']} mean "
              f"{r['stale_mean']:.2f}")
        print(f"{'':15s}  lengths: mean {r['len_mean']:.1f}, p50 {r['len_p50']:.0f}, p90 {r['len_p90']:.0f}, max "
              f"{r['len_max']} (max/mean {r['len_max_over_mean']:.1f}; per-batch max/mean "
              f"{r['batch_max_over_mean']:.1f})")
    if "sync" in results:
        for mode in results:
            if mode != "sync":
                print(f"ratio {mode} / sync: {results[mode]['tps'] / results['sync']['tps']:.2f}x per wall-second, "
                      f"{results[mode]['tokens_per_cpu_s'] / results['sync']['tokens_per_cpu_s']:.2f}x per CPU-second")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=6, help="steps excluded from the measurement (compilation)")
    ap.add_argument("--batch", type=int, default=12, help="prompt groups per training step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=384)
    ap.add_argument("--stop-tokens", type=int, default=2, help=f"how many of {STOP_CHARS!r} end a sample")
    ap.add_argument("--minibatches", type=int, default=2, help="optimizer updates per training step")
    ap.add_argument("--mb-tokens", type=int, default=2048, help="token budget of one training micro-batch")
    ap.add_argument("--gen-devices", type=int, default=3, help="generation devices of the split 'async' row "
                    "(of JAX_NUM_CPU_DEVICES; the paper: 3 of 4)")
    ap.add_argument("--eta", type=int, default=4, help="max_staleness of the asynchronous rows")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--run-dir", default=None, help="write each row's metrics, rollouts and config.gin under "
                    "DIR/<mode> (for areal-jax simulate --calibrate) and the figures to DIR/bench.json")
    ap.add_argument("--compile-cache", default="/tmp/areal_jax_bench_cache",
                    help="persistent XLA cache ('' = off): a second run loads what the first compiled, so "
                         "late first-time compilations (long re-prefill buckets) stay out of the window")
    args = ap.parse_args()
    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    if not 1 <= args.warmup < args.steps:
        raise SystemExit("--warmup must be >= 1 and < --steps")
    if not 1 <= args.stop_tokens <= len(STOP_CHARS):
        raise SystemExit(f"--stop-tokens must be in 1..{len(STOP_CHARS)}")
    args.slots = args.batch * args.n
    if args.slots % args.gen_devices or args.slots % jax.device_count():
        raise SystemExit(f"--batch x --n = {args.slots} slots must divide over {args.gen_devices} and "
                         f"{jax.device_count()} generation devices")
    with tempfile.TemporaryDirectory() as d:
        tokenizer = Tokenizer.from_pretrained(build_tokenizer(d))
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32)
    params = init_params(cfg, 0, std=0.02)
    clock = CompileClock()
    results = {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {MODES}")
        t0 = time.perf_counter()
        results[mode] = run(mode, args, tokenizer, cfg, params, clock)
        print(f"[{mode} done in {time.perf_counter() - t0:.0f} s]", flush=True)
    report(results, args)
    for path in filter(None, (args.json, args.run_dir and f"{args.run_dir}/bench.json")):
        with open(path, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
