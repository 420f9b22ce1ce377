"""Routing mismatch between the generation engine and the trainer on a tiny MoE policy, measured
from the experts the engine RECORDED while sampling (`Completion.moe_routing`, the record that
reaches `Trajectory.moe_routing`), and what routing replay does to the behaviour-vs-trainer gap.

The engine samples groups of completions of arithmetic prompts with its own programs (chunked
prefill, decode chunks; weights and KV cache in `--engine_dtypes`), recording per input token and
sparse layer the k experts it routed to. The completions become Trajectories, are packed as the
trainer packs them, and go through the trainer's log-prob program (`build_train_programs`, fp32
master weights, `TrainEngineConfig.compute_dtype` compute) with `TrainEngineConfig.moe_routing` "recompute" and
"replay". Same weights on both sides: this isolates the two programs' numerics, not staleness.
Printed, per (engine dtype, trainer compute):

  topk_mismatch  share of (sampling position, sparse layer) pairs whose set of k experts differs
                 between the record and the trainer's own routing (positions: the input tokens
                 whose logits sampled a completion token, i.e. the loss-mask positions)
  token_mismatch share of those positions whose experts differ in at least one sparse layer
  prompt_mismatch  topk_mismatch over the other prompt tokens (their keys/values feed attention)
  gap_recompute  mean |behaviour log-prob - trainer log-prob| over completion tokens, trainer routing afresh
  gap_replay     the same with the recorded experts replayed (TrainEngineConfig.moe_routing = "replay")

    PYTHONPATH=$PWD .venv/bin/python bench/moe_routing_replay.py --model_dir RUN/final_model
    PYTHONPATH=$PWD .venv/bin/python bench/moe_routing_replay.py            # random built-in MoE
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

from areal_jax.generation.offline import generate
from areal_jax.models import moe
from areal_jax.models.hf_io import load_pretrained
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.models.transformer import Transformer, forward, init_params
from areal_jax.packing import ffd_allocate, pack_sequences
from areal_jax.rollout.types import Trajectory
from areal_jax.tasks import arithmetic as ar
from areal_jax.tasks.tokenizer_builder import build_tokenizer, task_model_config
from areal_jax.trainer.algorithm import ppo_objective
from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
from areal_jax.trainer.programs import COMPUTE_DTYPES, FORWARD_KEYS, MOE_ROUTING_KEY, build_train_programs

TEMPERATURE = 0.7  # the quickstart's sampling temperature; behaviour and trainer log-probs both take it
ROW_LEN = 128  # packed row length of the trainer-side batches


def packed_batch(samples: list[tuple[list[int], object]]) -> dict[str, np.ndarray]:
    """The completions as Trajectory training rows packed into `[R, ROW_LEN]` rows, plus
    `prompt_token`: 1 on the prompt tokens but the last (those no log-prob is taken at)."""
    rows = []
    for prompt, c in samples:
        row = Trajectory(np.asarray(prompt, np.int32), c.tokens, c.logprobs, c.versions, 0.0,
                         moe_routing=c.moe_routing).training_row()
        row["prompt_token"] = (np.arange(len(row["input_ids"])) < len(prompt) - 1).astype(np.int32)
        rows.append(row)
    return pack_sequences(rows, ffd_allocate([len(r["input_ids"]) for r in rows], ROW_LEN), ROW_LEN)


def mismatch(recorded: np.ndarray, trainer: np.ndarray, where: np.ndarray) -> tuple[float, float, int]:
    """(share of (position, sparse layer) pairs whose k-sets differ, share of positions differing in
    any sparse layer, positions) over the positions `where` `[R, T]`; records `[R, T, L_moe, k]`."""
    differ = np.any(np.sort(recorded[where], -1) != np.sort(trainer[where], -1), -1)  # [N, L_moe]
    n = max(int(where.sum()), 1)
    return float(differ.mean()) if differ.size else 0.0, float(differ.any(-1).sum()) / n, int(where.sum())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", default=None, help="HF directory of a MoE policy (default: random built-in MoE)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (a GRPO group)")
    p.add_argument("--max_new_tokens", type=int, default=24)
    p.add_argument("--engine_dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--train_computes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    tokenizer = Tokenizer.from_pretrained(build_tokenizer(pathlib.Path(tempfile.mkdtemp()) / "tokenizer"))
    if args.model_dir:
        model = load_pretrained(args.model_dir)
        cfg, params32 = model.config, model.params
    else:
        cfg = task_model_config(num_experts=8)
        params32 = init_params(cfg, args.seed, std=0.1)
    if cfg.moe is None:
        raise SystemExit(f"{args.model_dir}: not a MoE policy")
    problems = ar.problems(ar.ArithmeticConfig(min_operands=3, max_operands=4, max_digits=1, operators="+-"),
                           "test", args.prompts, seed=args.seed)
    prompts = [list(map(int, ar.prompt_ids(tokenizer, pr))) for pr in problems]
    programs = {(compute, mode): build_train_programs(
        cfg, TrainEngineConfig(compute_dtype=compute, moe_routing=mode), ppo_objective(PPOConfig(temperature=TEMPERATURE)),
        optax.sgd(0.0))
        for compute in args.train_computes for mode in ("recompute", "replay")}
    for engine_dtype in args.engine_dtypes:
        eparams = jax.tree.map(lambda a: a.astype(COMPUTE_DTYPES[engine_dtype]), params32)
        comps = generate(Transformer(cfg, eparams), prompts, max_new_tokens=args.max_new_tokens,
                         temperature=TEMPERATURE, n=args.n, seed=args.seed, stop_token_ids=[cfg.eos_token_id])
        batch = packed_batch([(prompt, c) for prompt, group in zip(prompts, comps) for c in group])
        device = {k: jnp.asarray(batch[k]) for k in (*FORWARD_KEYS, MOE_ROUTING_KEY)}
        loss = batch["loss_mask"] > 0  # [R, T]: positions whose logits sampled a completion token
        prompt = batch["prompt_token"] > 0
        for compute in args.train_computes:
            _, _, routing = forward(params32, cfg, device["input_ids"], device["positions"], device["segment_ids"],
                                    compute_dtype=COMPUTE_DTYPES[compute], return_routing=True)
            trainer = np.asarray(moe.record(cfg, routing.experts))  # [R, T, L_moe, k]
            topk, tokens, positions = mismatch(batch[MOE_ROUTING_KEY], trainer, loss)
            prompt_topk, _, prompt_positions = mismatch(batch[MOE_ROUTING_KEY], trainer, prompt)
            gaps = {}
            for mode in ("recompute", "replay"):
                logp = np.asarray(programs[compute, mode].logprobs(params32, device))
                gaps[mode] = float(np.mean(np.abs(logp[loss] - batch["behavior_logprobs"][loss])))
            print(json.dumps({"engine_dtype": engine_dtype, "train_compute": compute, "topk_mismatch": topk,
                              "token_mismatch": tokens, "positions": positions, "prompt_mismatch": prompt_topk,
                              "prompt_positions": prompt_positions, "gap_recompute": gaps["recompute"],
                              "gap_replay": gaps["replay"]}), flush=True)


if __name__ == "__main__":
    main()
