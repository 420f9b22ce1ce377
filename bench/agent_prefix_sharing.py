"""How much would shared-prefix ("tree") training save on agent rollouts? Counted from a run's dumps.

Reads RUN/rollouts/step_*.jsonl (RLConfig.dump_rollouts_every) of an AgentWorkflow run. The rows
of one group (query_id, admitted_version: the n sessions of one prompt, and the rows of one
session) are put in a trie of token ids; plain packing trains every row's tokens, shared-prefix
training each trie node once. Reports, per trained (loss-mask) token: tokens processed under both,
and the forward+backward FLOPs of the model (6 x non-embedding parameters + attention
12 x layers x hidden x context per token) under both.

    .venv/bin/python bench/agent_prefix_sharing.py RUN [--tokenizer RUN/final_model]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib


def _trie_size(sequences: list[list[int]]) -> tuple[int, list[int]]:
    """(nodes, depth of each node): the tokens a trie of `sequences` holds."""
    root: dict = {}
    depths = []
    for seq in sequences:
        node = root
        for depth, token in enumerate(seq):
            if token not in node:
                node[token] = {}
                depths.append(depth + 1)
            node = node[token]
    return len(depths), depths


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=pathlib.Path)
    parser.add_argument("--tokenizer", type=pathlib.Path, help="default: RUN/final_model or RUN/tokenizer")
    args = parser.parse_args(argv)
    from areal_jax.models.tokenizer import Tokenizer

    tok_dir = args.tokenizer or next(p for p in (args.run / "final_model", args.run / "tokenizer") if p.exists())
    tokenizer = Tokenizer.from_pretrained(tok_dir)
    model = json.loads((args.run / "model_config.json").read_text())
    hidden, layers = model["hidden_size"], model["num_hidden_layers"]  # config.json (HF names)
    inter = model["intermediate_size"]
    heads, kv = model["num_attention_heads"], model["num_key_value_heads"]
    head_dim = model.get("head_dim") or hidden // heads
    per_layer = hidden * head_dim * (heads * 2 + kv * 2) + 3 * hidden * inter
    params = layers * per_layer + hidden * model["vocab_size"]  # + the output projection

    groups = collections.defaultdict(list)
    trained = 0
    for path in sorted((args.run / "rollouts").glob("step_*.jsonl")):
        for line in path.read_text().splitlines():
            d = json.loads(line)
            prompt = tokenizer.encode(d["prompt"], add_special_tokens=False)
            assert len(prompt) == d["prompt_tokens"], "the prompt text does not re-encode to its ids"
            groups[(path.name, d["query_id"], d["admitted_version"])].append(prompt + d["completion_tokens"])
            trained += sum(d["loss_mask"])
    plain_tokens = plain_attn = shared_tokens = shared_attn = 0
    for rows in groups.values():
        plain_tokens += sum(len(r) for r in rows)
        plain_attn += sum(n * (n + 1) // 2 for n in map(len, rows))
        nodes, depths = _trie_size(rows)
        shared_tokens += nodes
        shared_attn += sum(depths)
    def flops(tokens: int, attn: int) -> float:
        return 6 * params * tokens + 12 * layers * heads * head_dim * attn
    out = {"groups": len(groups), "rows": sum(map(len, groups.values())), "trained_tokens": trained,
           "plain_tokens_per_trained": plain_tokens / trained, "shared_tokens_per_trained": shared_tokens / trained,
           "plain_flops_per_trained": flops(plain_tokens, plain_attn) / trained,
           "shared_flops_per_trained": flops(shared_tokens, shared_attn) / trained}
    out["flops_saved"] = 1 - out["shared_flops_per_trained"] / out["plain_flops_per_trained"]
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
