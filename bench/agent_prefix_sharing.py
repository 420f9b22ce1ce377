"""How much would shared-prefix ("tree") training save on agent rollouts? Counted on real sessions.

Runs the calculator agent (areal_jax/agents/calculator_agent.py) in process with the model in
MODEL_DIR: `--problems` held-out arithmetic problems (examples/agent_calculator.py's task), `--n`
sessions each at temperature 1, as the AgentWorkflow samples a group. The rows of a group (its
sessions' leaves) go into a trie of token ids: plain packing trains every row's tokens,
shared-prefix training each trie node once. Reports per trained (loss-mask) token the tokens
processed and the forward+backward FLOPs (6 x parameters per token + 12 x layers x hidden x
context for attention) under both. Prints JSON and the command line.

    .venv/bin/python bench/agent_prefix_sharing.py runs/agent_calculator/sft/final_model
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
    from examples.agent_calculator import TASK

    tokenizer = Tokenizer.from_pretrained(args.model_dir)
    model = load_pretrained(args.model_dir)
    engine = GenerationEngine(model, EngineConfig(num_slots=32, max_seq_len=256))
    engine.start()
    client = RolloutClient(engine, tokenizer)
    service = ChatService(client, tokenizer, SamplingParams(max_new_tokens=112, temperature=1.0))
    problems = ar.problems(TASK, "test", args.problems, seed=args.seed)

    async def group(p) -> list[Session]:
        sessions = [Session(f"{p.query_id}-{i}", seed=args.seed * 1000 + i) for i in range(args.n)]
        # A session that outgrows the engine fails as in the workflow; its rows so far still count.
        await asyncio.gather(*(solve(InProcessClient(service, s), p.prompt_row()) for s in sessions),
                             return_exceptions=True)
        return sessions

    async def run():
        return await asyncio.gather(*(group(p) for p in problems))

    try:
        groups = asyncio.run(run())
    finally:
        engine.stop()
        client.close()
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
    print(json.dumps(out, indent=2))
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    return out


if __name__ == "__main__":
    main()
