"""Asynchronous vs synchronous RL throughput on the same devices and workload (the paper's headline).

Effective training throughput = trained tokens per second of wall time. Async: the paper's
system (max_staleness 4, interruptible generation; 3 of 4 devices generate, 1 trains). Sync:
the colocated synchronous baseline (all devices generate, then train; max_staleness 0). Response
lengths are long-tailed: a random policy stops at either of two stop tokens (geometric lengths),
capped at --max-new. Reward is a cheap character-parity rule (bench/rewards.py).

Usage: .venv/bin/python -m bench.async_vs_sync [--steps 8 --batch 8 --n 4]
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import argparse  # noqa: E402
import itertools  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from areal_jax.data.formats import PromptRow  # noqa: E402
from areal_jax.generation import EngineConfig  # noqa: E402
from areal_jax.models import ModelConfig, init_params  # noqa: E402
from areal_jax.models.tokenizer import Tokenizer  # noqa: E402
from areal_jax.parallel import MeshConfig  # noqa: E402
from areal_jax.ppo import AdvantageConfig  # noqa: E402
from areal_jax.rollout.workflow import RLVRConfig  # noqa: E402
from areal_jax.tasks.tokenizer_builder import build_tokenizer  # noqa: E402
from areal_jax.trainer import OptimizerConfig, PPOConfig  # noqa: E402
from areal_jax.trainer.loop import RLConfig, RLLoop  # noqa: E402
from bench.common import machine  # noqa: E402


def rows(tokenizer):
    for i in itertools.count():
        q = f"Compute {i % 9}+{i % 7}."
        row = PromptRow(query_id=f"q{i}", messages=[{"role": "user", "content": q}], answer="0", test_cases=None,
                        task="math", source=f"bench:{i}")
        yield {"prompt_ids": np.asarray(tokenizer.apply_chat_template(row.messages, add_generation_prompt=True),
                                        np.int32), "row": row}


def run(mode: str, args, tokenizer, cfg, params) -> dict:
    sync = mode == "sync"
    rl = RLConfig(steps=args.steps, batch_size=args.batch, max_staleness=0 if sync else 4,
                  max_concurrent=4 * args.batch, mode="sync" if sync else "async")
    stops = (tokenizer.token_to_id("7"), tokenizer.token_to_id("="))
    loop = RLLoop(cfg, params, tokenizer=tokenizer, data_iter=rows(tokenizer), rl=rl,
                  ppo=PPOConfig(num_minibatches=2, max_tokens_per_microbatch=4096),
                  optimizer=OptimizerConfig(lr=1e-5), advantages=AdvantageConfig(norm="group"),
                  workflow=RLVRConfig(n_samples=args.n, max_new_tokens=args.max_new, reward="bench.rewards:parity_reward",
                                      filter_all_equal_rewards=False, stop_token_ids=stops),
                  engine=EngineConfig(num_slots=4 * args.batch, max_seq_len=args.max_new + 48, decode_chunk=8),
                  mesh=MeshConfig(colocated=True) if sync else MeshConfig(num_generation_devices_per_host=3))
    t0 = time.perf_counter()
    result = loop.run()
    wall = time.perf_counter() - t0
    lengths = [m["completion/mean_length"] for m in result.history]
    return {"wall_s": wall, "tokens": result.trained_tokens, "tps": result.trained_tokens / wall,
            "mean_len": float(np.mean(lengths)), "max_len": max(m["completion/max_length"] for m in result.history),
            "stale_max": max(m["staleness/max"] for m in result.history)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=192)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tokenizer = Tokenizer.from_pretrained(build_tokenizer(d))
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=32)
    params = init_params(cfg, 0, std=0.02)
    results = {mode: run(mode, args, tokenizer, cfg, params) for mode in ("async", "sync")}
    print(f"machine: {machine()}, {jax.device_count()} fake CPU devices; {args.steps} steps x {args.batch} groups x "
          f"{args.n} samples, up to {args.max_new} new tokens")
    for mode, r in results.items():
        print(f"{mode:5s}: {r['tps']:8.1f} trained tokens/s ({r['tokens']:.0f} tokens in {r['wall_s']:.1f} s; "
              f"completion mean {r['mean_len']:.1f}, max {r['max_len']}; max staleness {r['stale_max']})")
    print(f"ratio async / sync: {results['async']['tps'] / results['sync']['tps']:.2f}x")


if __name__ == "__main__":
    main()
