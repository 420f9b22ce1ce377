"""Routing mismatch between the generation engine's program and the trainer's, on a tiny MoE policy,
and what routing replay does to the behaviour-vs-trainer log-prob gap.

The engine samples completions of arithmetic prompts (its own programs, weights in `--engine_dtype`).
The engine-side routing of every token is then recomputed with the decode arithmetic: the prompt as a
cached prefill, each completion token as a one-token decode step against the KV cache, weights and
activations in the engine dtype. The trainer side is the training forward (packed, no cache) with
fp32 weights and `--train_compute` compute, as PPOConfig.compute_dtype runs it. Printed, per setting:

  topk_mismatch  share of (completion token, sparse layer) pairs whose set of k experts differs
  gap_recompute  mean |behaviour log-prob - trainer log-prob| over completion tokens, trainer routing afresh
  gap_replay     the same with the engine-side experts replayed (PPOConfig.moe_routing = "replay")

    PYTHONPATH=$PWD .venv/bin/python bench/moe_routing_replay.py --model_dir RUN/final_model
    PYTHONPATH=$PWD .venv/bin/python bench/moe_routing_replay.py            # random built-in MoE
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.generation.offline import generate
from areal_jax.models.hf_io import load_pretrained
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.models.transformer import KVCache, Transformer, forward, init_params, lm_head
from areal_jax.ppo.logprobs import hidden_logprobs
from areal_jax.tasks import arithmetic as ar
from areal_jax.tasks.tokenizer_builder import build_tokenizer, task_model_config

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TEMPERATURE = 0.7  # the quickstart's sampling temperature; behaviour and trainer log-probs both take it


def engine_routing(params, cfg, seq: np.ndarray, prompt_len: int, dtype) -> np.ndarray:
    """Experts `[L, S, k]` of each token of `seq` as the engine's decode arithmetic routes it."""
    S = len(seq)
    cache = KVCache.zeros(cfg, 1, S, dtype)
    ids = jnp.asarray(seq[None, :prompt_len])
    _, cache, first = forward(params, cfg, ids, jnp.arange(prompt_len)[None], cache=cache, compute_dtype=dtype,
                              return_routing=True)
    out = [np.asarray(first.experts[:, 0])]
    cache = cache.per_layer()
    for t in range(prompt_len, S):
        _, cache, r = forward(params, cfg, jnp.asarray(seq[None, t:t + 1]), jnp.asarray([[t]]), cache=cache,
                              compute_dtype=dtype, return_routing=True)
        out.append(np.asarray(r.experts[:, 0]))
    return np.concatenate(out, axis=1)


def trainer_side(params32, cfg, seq: np.ndarray, compute, replay: np.ndarray | None):
    """Trainer experts `[L, S, k]` and log-probs `[S - 1]` of seq[1:] (training forward, one row)."""
    ids = jnp.asarray(seq[None])
    seg = jnp.ones_like(ids)
    hidden, _, r = forward(params32, cfg, ids, segment_ids=seg, compute_dtype=compute, return_hidden=True,
                           return_routing=True, moe_routing=None if replay is None else jnp.asarray(replay[:, None]))
    logp = hidden_logprobs(hidden, functools.partial(lm_head, params32, cfg), jnp.asarray(np.append(seq[1:], 0)[None]),
                           TEMPERATURE)
    return np.asarray(r.experts[:, 0]), np.asarray(logp[0, :-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", default=None, help="HF directory of a MoE policy (default: random built-in MoE)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--engine_dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    tok_dir = build_tokenizer(pathlib.Path(tempfile.mkdtemp()) / "tokenizer")
    tokenizer = Tokenizer.from_pretrained(tok_dir)
    if args.model_dir:
        model = load_pretrained(args.model_dir)
        cfg, params32 = model.config, model.params
    else:
        cfg = task_model_config(num_experts=8)
        params32 = init_params(cfg, args.seed, std=0.1)
    assert cfg.moe is not None, "a MoE policy is needed"
    sparse = np.asarray(cfg.sparse_layers)
    problems = ar.problems(ar.ArithmeticConfig(min_operands=3, max_operands=4, max_digits=1, operators="+-"),
                           "test", args.prompts, seed=args.seed)
    prompts = [list(map(int, ar.prompt_ids(tokenizer, pr))) for pr in problems]
    results = []
    for engine_dtype in args.engine_dtypes:
        dtype = DTYPES[engine_dtype]
        eparams = jax.tree.map(lambda a: a.astype(dtype), params32)
        comps = generate(Transformer(cfg, eparams), prompts, max_new_tokens=args.max_new_tokens, temperature=TEMPERATURE,
                         seed=args.seed, stop_token_ids=[cfg.eos_token_id])
        for compute_name in ("float32", "bfloat16"):
            compute = DTYPES[compute_name]
            differ = pairs = 0
            gaps = {"recompute": [], "replay": []}
            for prompt, (c,) in zip(prompts, comps):
                seq = np.asarray(prompt + list(c.tokens), np.int32)
                P = len(prompt)
                eng = engine_routing(eparams, cfg, seq, P, dtype)  # [L, S, k]
                behav = np.asarray(c.logprobs, np.float32)
                for mode in ("recompute", "replay"):
                    experts, logp = trainer_side(params32, cfg, seq, compute, eng if mode == "replay" else None)
                    gaps[mode].append(np.abs(logp[P - 1:] - behav))
                    if mode == "recompute":
                        # Completion tokens fed back in (the last sampled token never is).
                        a = np.sort(eng[sparse][:, P:len(seq) - 1], -1)
                        b = np.sort(experts[sparse][:, P:len(seq) - 1], -1)
                        differ += int(np.any(a != b, -1).sum())
                        pairs += a.shape[0] * a.shape[1]
            row = {"engine_dtype": engine_dtype, "train_compute": compute_name,
                   "topk_mismatch": differ / max(pairs, 1), "pairs": pairs,
                   "gap_recompute": float(np.mean(np.concatenate(gaps["recompute"]))),
                   "gap_replay": float(np.mean(np.concatenate(gaps["replay"])))}
            results.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
