"""Decode step time with LoRA adapters merged into the weights vs applied unmerged.

Usage: .venv/bin/python -m bench.lora_decode [--layers 8 --hidden 512 --slots 8 --rank 16 --iters 30 --rounds 3]
One decode step (one token per slot against a per-layer KV cache, the engine's unrolled layout)
of a random Qwen2-shaped model: once on merged weights (`lora.merge`: what the engine serves),
once on base + adapters (`adapt` adds `scale * (x @ a) @ b` to every targeted projection). The
two sides alternate for --rounds rounds (load from other jobs hits both) and the fastest round of
each counts (on a shared machine the slow rounds measure the neighbours); the logits of the two are
compared first.
"""

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models import lora as lora_lib
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import KVCache, forward, init_params, split_layers
from bench.common import machine, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--cache", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=8192, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_layers=args.layers, num_heads=8, num_kv_heads=2, head_dim=args.hidden // 8,
                      qkv_bias=True, family="qwen2")
    lora = lora_lib.LoRAConfig(rank=args.rank, alpha=2.0 * args.rank)
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.02, x.shape), jnp.float32),
                            lora_lib.init_adapters(cfg, lora))
    adapters[lora_lib.SCALE] = jnp.full((cfg.num_layers,), lora.scale, jnp.float32)
    adapted = lora_lib.attach(init_params(cfg, 0), adapters)
    sides = {"merged": split_layers(lora_lib.merge(adapted)), "unmerged": split_layers(adapted)}
    B = args.slots
    cache = KVCache.zeros(cfg, B, args.cache).per_layer()
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 1)), jnp.int32)
    positions = jnp.full((B, 1), args.cache // 2, jnp.int32)
    step = jax.jit(lambda p, c: forward(p, cfg, tokens, positions, cache=c)[0])
    out = {k: np.asarray(step(p, cache)) for k, p in sides.items()}
    gap = float(np.abs(out["merged"] - out["unmerged"]).max())
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for k, p in sides.items():
            times[k].append(timed(lambda p=p: step(p, cache).block_until_ready(), args.iters))
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"machine: {machine()}; model: L={cfg.num_layers} D={cfg.hidden_size} F={cfg.intermediate_size}, "
          f"{B} slots, rank {args.rank} on {','.join(lora.targets)}; max |logit gap| {gap:.2e}")
    for k in sides:
        print(f"{k:9s} decode step: best {best[k] * 1e3:.2f} ms, median {med[k] * 1e3:.2f} ms "
              f"(rounds: {', '.join(f'{t * 1e3:.2f}' for t in times[k])})")
    print(f"unmerged / merged: {best['unmerged'] / best['merged']:.2f}x (best), {med['unmerged'] / med['merged']:.2f}x (median)")


if __name__ == "__main__":
    main()
