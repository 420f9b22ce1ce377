"""How much would shared-prefix ("tree") training save on agent rollouts? Counted on real sessions.

Runs the calculator agent (areal_jax/agents/calculator_agent.py) in process with the model in
MODEL_DIR: `--problems` held-out arithmetic problems (examples/agent_calculator.py's task), `--n`
sessions each at `--temperature` (the example's RL samples at 0.7), as the AgentWorkflow samples a group. The rows of a group (its
sessions' leaves) go into a trie of token ids: plain packing trains every row's tokens,
shared-prefix training each trie node once. Reports per trained (loss-mask) token the tokens
processed and the forward+backward FLOPs (6 x parameters per token + 12 x layers x hidden x
context for attention) under both. With `--time_rounds R`, it also times the training forward and
backward of all those rows (one minibatch's gradients, `JaxTrainEngine.minibatch_gradients`, PPO's
decoupled loss, the example's TrainEngineConfig: budget 2048, layers unrolled) with plain packing
and with `TrainEngineConfig.share_prefixes`, alternating in each round after a compile round, and
reports per trained token the time (best and median of R, and the ratio per round) and the tokens
the micro-batches hold (padding included), and checks the two losses agree.

    .venv/bin/python bench/agent_prefix_sharing.py runs/agent_calculator/sft/final_model --time_rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def trie_nodes(sequences: list[list[int]]) -> list[int]:
    """The depth (context length) of every node of a trie of `sequences`: one entry per token that
    shared-prefix training computes."""
    root: dict = {}
    depths = []
    for seq in sequences:
        node = root
        for depth, token in enumerate(seq):
            if token not in node:
                node[token] = {}
                depths.append(depth + 1)
            node = node[token]
    return depths


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=pathlib.Path)
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (the example's RL: 0.7)")
    parser.add_argument("--time_rounds", type=int, default=0, help="time training with both packings this often")
    parser.add_argument("--attention_impl", default="auto", help="TrainEngineConfig.attention_impl for the timing")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from areal_jax.agents.calculator_agent import solve
    from areal_jax.agents.chat import ChatService
    from areal_jax.agents.inprocess import InProcessClient
    from areal_jax.agents.session import Session
    from areal_jax.api import SamplingParams
    from areal_jax.generation import EngineConfig, GenerationEngine
    from areal_jax.models import load_pretrained
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.rollout.workflow import RolloutClient
    from areal_jax.tasks import arithmetic as ar
    from examples.agent_calculator import problems as example_problems

    tokenizer = Tokenizer.from_pretrained(args.model_dir)
    model = load_pretrained(args.model_dir)
    engine = GenerationEngine(model, EngineConfig(num_slots=32, max_seq_len=256))
    engine.start()
    client = RolloutClient(engine, tokenizer)
    service = ChatService(client, tokenizer, SamplingParams(max_new_tokens=112, temperature=args.temperature))
    problems = example_problems("test", args.problems, args.seed)

    async def group(p):
        sessions = [Session(f"{p.query_id}-{i}", seed=args.seed * 1000 + i) for i in range(args.n)]
        # A session that outgrows the engine fails as in the workflow; its rows so far still count.
        rewards = await asyncio.gather(*(solve(InProcessClient(service, s), p.prompt_row()) for s in sessions),
                                       return_exceptions=True)
        return sessions, [r if isinstance(r, float) else 0.0 for r in rewards]

    async def run():
        return await asyncio.gather(*(group(p) for p in problems))

    try:
        played = asyncio.run(run())
    finally:
        engine.stop()
        client.close()
    groups = [sessions for sessions, _ in played]
    cfg = model.config
    params = cfg.num_layers * (cfg.hidden_size * cfg.head_dim * 2 * (cfg.num_heads + cfg.num_kv_heads)
                               + 3 * cfg.hidden_size * cfg.intermediate_size) + cfg.hidden_size * cfg.vocab_size
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # FLOPs per (token, context position)
    trained = plain_tokens = plain_ctx = shared_tokens = shared_ctx = rows = 0
    for sessions in groups:
        leaves = [leaf for s in sessions for leaf in s.leaves()]
        rows += len(leaves)
        trained += int(sum(leaf.loss_mask.sum() for leaf in leaves))
        plain_tokens += sum(len(leaf.tokens) for leaf in leaves)
        plain_ctx += sum(n * (n + 1) // 2 for n in (len(leaf.tokens) for leaf in leaves))
        depths = trie_nodes([leaf.tokens.tolist() for leaf in leaves])
        shared_tokens += len(depths)
        shared_ctx += sum(depths)
    out = {"model": str(args.model_dir), "groups": len(groups), "sessions_per_group": args.n, "rows": rows,
           "trained_tokens": trained, "plain_tokens_per_trained": plain_tokens / trained,
           "shared_tokens_per_trained": shared_tokens / trained,
           "plain_flops_per_trained": (6 * params * plain_tokens + attention * plain_ctx) / trained,
           "shared_flops_per_trained": (6 * params * shared_tokens + attention * shared_ctx) / trained}
    out["flops_saved"] = 1 - out["shared_flops_per_trained"] / out["plain_flops_per_trained"]
    if args.time_rounds:
        out["timing"] = time_training(model, played, args.time_rounds, args.attention_impl)
    print(json.dumps(out, indent=2))
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    return out


def time_training(model, played, rounds: int, attention_impl: str) -> dict:
    """Seconds per trained token of one minibatch's forward+backward over every row, plain packing
    against shared prefixes (same weights, same rows), rounds alternating which goes first."""
    import statistics
    import time

    import jax
    import numpy as np

    from areal_jax.ppo import AdvantageConfig
    from areal_jax.rollout.types import TrajectoryGroup
    from areal_jax.trainer.algorithm import ppo_trainer
    from areal_jax.trainer.batching import build_sequences, make_microbatches, sequence_group_ids
    from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
    from areal_jax.trainer.optimizer import OptimizerConfig

    groups = []
    for k, (sessions, rewards) in enumerate(played):
        trajs = tuple(t for s, r in zip(sessions, rewards) for t in s.trajectories(r))
        if trajs:
            groups.append(TrajectoryGroup(f"g{k}", trajs, 0))
    seqs = build_sequences(groups, AdvantageConfig(norm="group"))
    trained = sum(float(s["loss_mask"].sum()) for s in seqs)
    ppo = PPOConfig(num_minibatches=1)
    runs = {}
    for name, share in (("plain", False), ("shared", True)):
        engine = TrainEngineConfig(max_tokens_per_microbatch=2048, scan_layers=False, attention_impl=attention_impl,
                                   share_prefixes=share)
        trainer = ppo_trainer(model.config, model.params, OptimizerConfig(lr=1e-5), ppo, engine=engine)
        [micro] = make_microbatches(seqs, max_tokens_per_microbatch=2048, num_minibatches=1,
                                    group_ids=sequence_group_ids(groups), share_prefixes=share)
        forward_keys = "tree_segment_ids" if share else "segment_ids"
        slots = sum(int(np.size(m.arrays[forward_keys])) for m in micro)
        real = sum(int(np.count_nonzero(m.arrays[forward_keys])) for m in micro)
        runs[name] = {"trainer": trainer, "micro": micro, "times": [],
                      "row_tokens_per_trained": slots / trained, "real_tokens_per_trained": real / trained,
                      "microbatches": len(micro), "shapes": sorted({tuple(np.shape(m.arrays[forward_keys])) for m in micro})}
    for r in range(rounds + 1):  # round 0 compiles
        for name in (("plain", "shared") if r % 2 else ("shared", "plain")):
            run = runs[name]
            t0 = time.perf_counter()
            grads, stats = run["trainer"].minibatch_gradients(run["micro"])
            jax.block_until_ready(grads)
            dt = time.perf_counter() - t0
            run["loss"] = float(stats["loss"])
            if r:
                run["times"].append(dt)
            print(f"round {r} {name}: {dt:.2f} s", file=sys.stderr, flush=True)
    out = {"trained_tokens": trained, "rows": len(seqs), "attention_impl": attention_impl, "rounds": rounds}
    for name, run in runs.items():
        t = run["times"]
        out[name] = {"best_us_per_trained": 1e6 * min(t) / trained,
                     "median_us_per_trained": 1e6 * statistics.median(t) / trained,
                     "seconds": [round(x, 3) for x in t], "loss": run["loss"], "microbatches": run["microbatches"],
                     "shapes": run["shapes"], "row_tokens_per_trained": run["row_tokens_per_trained"],
                     "real_tokens_per_trained": run["real_tokens_per_trained"]}
    ratios = [p / s for p, s in zip(runs["plain"]["times"], runs["shared"]["times"])]
    out["plain_over_shared_best"] = min(runs["plain"]["times"]) / min(runs["shared"]["times"])
    out["plain_over_shared_median_of_rounds"] = statistics.median(ratios)
    out["ratios"] = [round(x, 3) for x in ratios]
    return out


if __name__ == "__main__":
    main()
