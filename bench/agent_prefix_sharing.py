"""How much does shared-prefix ("tree") training save on agent rollouts? Counted and timed on real sessions.

The rows: either the calculator agent (areal_jax/agents/calculator_agent.py) run in process with
the model in MODEL_DIR, `--problems` held-out problems of examples/agent_calculator.py, `--n`
sessions each at `--temperature` (the example's RL samples at 0.7), one group per problem as the
AgentWorkflow makes them; or, with `--rollouts`, the rows an RL run of the example trained, from
its rollout dumps (`RLConfig.dump_rollouts_every`; MODEL_DIR then gives the tokenizer and the
weights to time with). The rows of a group go into a trie of token ids: plain packing trains
every row's tokens, shared-prefix training each trie node once. Reports per trained (loss-mask)
token the tokens processed and the forward+backward FLOPs (6 x parameters per token + 12 x
layers x hidden x context for attention) under both. With `--time_rounds R`, it also times the
training forward and backward of all those rows (one minibatch's gradients,
`JaxTrainEngine.minibatch_gradients`, PPO's decoupled loss, the example's TrainEngineConfig:
budget 2048, layers unrolled) with plain packing and with `TrainEngineConfig.share_prefixes`,
alternating which goes first in each round after a compile round, and reports per trained token
the wall and process CPU time (best and median of R, the ratio per round), the tokens the
micro-batches hold (padding included) and both losses (they agree). Prints JSON and the command.

    .venv/bin/python bench/agent_prefix_sharing.py RUN/sft/final_model --rollouts RUN/rl/rollouts/step_9.jsonl --time_rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys

import numpy as np

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
    parser.add_argument("--rollouts", type=pathlib.Path, nargs="*", default=[],
                        help="rollout dumps (step_N.jsonl) of the example's RL run: count and time their rows "
                             "instead of running the agent")
    parser.add_argument("--attention_impl", default="auto", help="TrainEngineConfig.attention_impl for the timing")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from areal_jax.models import load_pretrained
    from areal_jax.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(args.model_dir)
    model = load_pretrained(args.model_dir)
    groups = dumped_groups(args.rollouts, tokenizer) if args.rollouts else played_groups(args, model, tokenizer)
    cfg = model.config
    params = cfg.num_layers * (cfg.hidden_size * cfg.head_dim * 2 * (cfg.num_heads + cfg.num_kv_heads)
                               + 3 * cfg.hidden_size * cfg.intermediate_size) + cfg.hidden_size * cfg.vocab_size
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # FLOPs per (token, context position)
    trained = plain_tokens = plain_ctx = shared_tokens = shared_ctx = rows = 0
    for group in groups:
        token_rows = [np.concatenate([t.prompt_ids, t.completion_ids]) for t in group.trajectories]
        rows += len(token_rows)
        trained += int(sum(t.training_row()["loss_mask"].sum() for t in group.trajectories))
        plain_tokens += sum(len(x) for x in token_rows)
        plain_ctx += sum(n * (n + 1) // 2 for n in (len(x) for x in token_rows))
        depths = trie_nodes([x.tolist() for x in token_rows])
        shared_tokens += len(depths)
        shared_ctx += sum(depths)
    out = {"model": str(args.model_dir), "source": [str(p) for p in args.rollouts] or "agent", "groups": len(groups),
           "rows": rows,
           "trained_tokens": trained, "plain_tokens_per_trained": plain_tokens / trained,
           "shared_tokens_per_trained": shared_tokens / trained,
           "plain_flops_per_trained": (6 * params * plain_tokens + attention * plain_ctx) / trained,
           "shared_flops_per_trained": (6 * params * shared_tokens + attention * shared_ctx) / trained}
    out["flops_saved"] = 1 - out["shared_flops_per_trained"] / out["plain_flops_per_trained"]
    if args.time_rounds:
        out["timing"] = time_training(model, groups, args.time_rounds, args.attention_impl)
    print(json.dumps(out, indent=2))
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    return out


def played_groups(args, model, tokenizer) -> list:
    """Trajectory groups of the calculator agent's sessions, `args.n` per held-out problem."""
    from areal_jax.agents.calculator_agent import solve
    from areal_jax.agents.chat import ChatService
    from areal_jax.agents.inprocess import InProcessClient
    from areal_jax.agents.session import Session
    from areal_jax.api import SamplingParams
    from areal_jax.api.trajectories import TrajectoryGroup
    from areal_jax.generation import EngineConfig, GenerationEngine
    from areal_jax.rollout.workflow import RolloutClient
    from examples.agent_calculator import problems as example_problems

    engine = GenerationEngine(model, EngineConfig(num_slots=32, max_seq_len=256))
    engine.start()
    client = RolloutClient(engine, tokenizer)
    service = ChatService(client, tokenizer, SamplingParams(max_new_tokens=112, temperature=args.temperature))

    async def group(p):
        sessions = [Session(f"{p.query_id}-{i}", seed=args.seed * 1000 + i) for i in range(args.n)]
        # A session that outgrows the engine fails as in the workflow; its rows so far still count.
        rewards = await asyncio.gather(*(solve(InProcessClient(service, s), p.prompt_row()) for s in sessions),
                                       return_exceptions=True)
        trajs = [t for s, r in zip(sessions, rewards) for t in s.trajectories(r if isinstance(r, float) else 0.0)]
        return TrajectoryGroup(p.query_id, tuple(trajs), 0)

    async def run():
        return await asyncio.gather(*(group(p) for p in example_problems("test", args.problems, args.seed)))

    try:
        return [g for g in asyncio.run(run()) if g.trajectories]
    finally:
        engine.stop()
        client.close()


def dumped_groups(paths, tokenizer) -> list:
    """Trajectory groups from RL rollout dumps (`RLConfig.dump_rollouts_every`): the rows the run
    trained, grouped by (query, admitted version). A dump keeps the prompt as text: it is encoded
    again, and a row whose encoding does not have the dumped prompt length is refused."""
    from areal_jax.api.trajectories import Trajectory, TrajectoryGroup

    groups: dict = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            row = json.loads(line)
            prompt = np.asarray(tokenizer.encode(row["prompt"]), np.int32)
            if len(prompt) != row["prompt_tokens"]:
                raise ValueError(f"{path}: the prompt of {row['query_id']} encodes to {len(prompt)} tokens, "
                                 f"the dump says {row['prompt_tokens']}")
            traj = Trajectory(prompt, np.asarray(row["completion_tokens"], np.int32),
                              np.asarray(row["behavior_logprobs"], np.float32), np.asarray(row["versions"], np.int32),
                              float(row["reward"]), row["stop_reason"], np.asarray(row["loss_mask"], np.float32))
            groups.setdefault((path, row["query_id"], row["admitted_version"]), []).append(traj)
    return [TrajectoryGroup(f"{k[1]}@{k[2]}", tuple(v), k[2]) for k, v in groups.items()]


def time_training(model, groups, rounds: int, attention_impl: str) -> dict:
    """Seconds per trained token of one minibatch's forward+backward over every row, plain packing
    against shared prefixes (same weights, same rows), rounds alternating which goes first."""
    import statistics
    import time

    import jax
    import numpy as np

    from areal_jax.ppo import AdvantageConfig
    from areal_jax.trainer.algorithm import ppo_trainer
    from areal_jax.trainer.batching import build_sequences, make_microbatches, sequence_group_ids
    from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
    from areal_jax.trainer.optimizer import OptimizerConfig

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
        runs[name] = {"trainer": trainer, "micro": micro, "times": [], "cpu": [],
                      "row_tokens_per_trained": slots / trained, "real_tokens_per_trained": real / trained,
                      "microbatches": len(micro), "shapes": sorted({tuple(np.shape(m.arrays[forward_keys])) for m in micro})}
    for r in range(rounds + 1):  # round 0 compiles
        for name in (("plain", "shared") if r % 2 else ("shared", "plain")):
            run = runs[name]
            t0, c0 = time.perf_counter(), time.process_time()
            grads, stats = run["trainer"].minibatch_gradients(run["micro"])
            jax.block_until_ready(grads)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            run["loss"] = float(stats["loss"])
            if r:
                run["times"].append(dt)
                run["cpu"].append(dc)
            print(f"round {r} {name}: {dt:.2f} s wall, {dc:.2f} s CPU", file=sys.stderr, flush=True)
    out = {"trained_tokens": trained, "rows": len(seqs), "attention_impl": attention_impl, "rounds": rounds}
    for name, run in runs.items():
        t, c = run["times"], run["cpu"]
        out[name] = {"best_us_per_trained": 1e6 * min(t) / trained,
                     "median_us_per_trained": 1e6 * statistics.median(t) / trained,
                     "best_cpu_us_per_trained": 1e6 * min(c) / trained,
                     "median_cpu_us_per_trained": 1e6 * statistics.median(c) / trained,
                     "seconds": [round(x, 3) for x in t], "cpu_seconds": [round(x, 3) for x in c],
                     "loss": run["loss"], "microbatches": run["microbatches"],
                     "shapes": run["shapes"], "row_tokens_per_trained": run["row_tokens_per_trained"],
                     "real_tokens_per_trained": run["real_tokens_per_trained"]}
    for unit, key in (("", "times"), ("cpu_", "cpu")):
        ratios = [p / s for p, s in zip(runs["plain"][key], runs["shared"][key])]
        out[f"{unit}plain_over_shared_best"] = min(runs["plain"][key]) / min(runs["shared"][key])
        out[f"{unit}plain_over_shared_median_of_rounds"] = statistics.median(ratios)
        out[f"{unit}ratios"] = [round(x, 3) for x in ratios]
    return out


if __name__ == "__main__":
    main()
