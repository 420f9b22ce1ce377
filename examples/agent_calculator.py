"""Train an agent written with the openai SDK: arithmetic on large operands with a calculator tool.

The agent (areal_jax/agents/calculator_agent.py, `solve`) offers the model a `calculator` tool,
runs the calls it makes and scores its final \\boxed{} answer. The tiny built-in model cannot add
4-digit numbers in its head; with the tool it only has to copy the expression and the result.

1. SFT on programmatically made tool-using traces (question, calculator call, result, boxed answer),
   `--sft_steps` steps (run_dir/sft).
2. RL from that model through the OpenAI-compatible endpoint (RLConfig.workflow = AgentWorkflow,
   AgentConfig.agent = solve over HTTP), `--rl_steps` steps (run_dir/rl).
3. Held-out accuracy of both models, each through the same agent (greedy, in-process client),
   written to run_dir/summary.json.

    python examples/agent_calculator.py --run_dir runs/agent_calculator --seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib

import areal_jax as aj
from areal_jax.agents.calculator_agent import solve, tool_trace, tools_preamble
from areal_jax.agents.chat import ChatService
from areal_jax.agents.inprocess import InProcessClient
from areal_jax.agents.session import Session
from areal_jax.api import SamplingParams
from areal_jax.generation import EngineConfig, GenerationEngine
from areal_jax.models import load_pretrained
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.workflow import RolloutClient
from areal_jax.tasks import arithmetic as ar
from areal_jax.tasks.tokenizer_builder import build_tokenizer

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.gin"
TASK = ar.ArithmeticConfig(min_operands=2, max_operands=2, max_digits=4, operators="+-")
AGENT = "areal_jax.agents.calculator_agent:solve"
# What both stages share: the quickstart's model, room for the tool turns, no single-turn held-out
# evaluation (the run's own check samples without tools; step 3 measures through the agent).
# A reply holds a whole tool call (about 85 characters with 4-digit operands): RLVRConfig.max_new_tokens
# is the default budget of each call.
COMMON = ["RLVRConfig.max_new_tokens = 112", "TaskSource.validation_size = 0", "TaskSource.eval_size = 0",
          "RLConfig.eval_every = 0", "EngineConfig.max_seq_len = 256",
          "SFTConfig.max_len = 224", "SFTConfig.eval_every = 0", "SFTConfig.stop_accuracy = 0.0"]
# --small: a smoke test (a barely trained model is always wrong: keep its all-equal groups).
SMALL = ["ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "RLConfig.batch_size = 2",
         "RLConfig.max_concurrent = 4", "RLVRConfig.n_samples = 2", "EngineConfig.num_slots = 8",
         "RLVRConfig.filter_all_equal_rewards = False"]
# The full run: fewer groups per step than the quickstart (each sample is a 2-3 call session).
FULL = ["RLConfig.batch_size = 16"]


def agent_accuracy(model_dir: pathlib.Path, problems: list[ar.ArithmeticProblem], *, max_new_tokens: int = 112) -> float:
    """The share of `problems` the agent solves with the model in `model_dir`, greedy."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    engine = GenerationEngine(load_pretrained(model_dir), EngineConfig(num_slots=16, max_seq_len=256))
    engine.start()
    client = RolloutClient(engine, tokenizer)
    service = ChatService(client, tokenizer, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))

    async def run() -> list[float]:
        return await asyncio.gather(*(solve(InProcessClient(service, Session(p.query_id)), p.prompt_row())
                                      for p in problems))

    try:
        rewards = asyncio.run(run())
    finally:
        engine.stop()
        client.close()
    return sum(rewards) / max(len(problems), 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", default="runs/agent_calculator")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft_steps", type=int, default=300)
    parser.add_argument("--rl_steps", type=int, default=40)
    parser.add_argument("--train_size", type=int, default=4000)
    parser.add_argument("--eval_size", type=int, default=200)
    parser.add_argument("--small", action="store_true", help="a 1-layer model and tiny batches (a smoke test)")
    parser.add_argument("--overwrite", action="store_true", help="replace runs already in --run_dir")
    parser.add_argument("--reuse_sft", action="store_true", help="start from run_dir/sft/final_model if it is there")
    args = parser.parse_args(argv)
    root = pathlib.Path(args.run_dir).absolute()
    inputs = root / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    train = ar.problems(TASK, "train", args.train_size, seed=args.seed)
    held_out = ar.problems(TASK, "test", args.eval_size, seed=args.seed)
    # The SFT rows: each problem as the agent's conversation with the right call (task tokenizer).
    preamble = tools_preamble(Tokenizer.from_pretrained(build_tokenizer(inputs / "tokenizer")))
    with (inputs / "sft.jsonl").open("w") as f:
        for p in train:
            f.write(json.dumps(tool_trace(p.prompt_row().messages, p.expression, preamble)) + "\n")
    rows = [p.math_record() for p in train]  # the RL prompts: the same questions
    small = SMALL if args.small else FULL
    seed = [f"TaskSource.seed = {args.seed}", f"SFTConfig.seed = {args.seed}", f"ModelSource.init_seed = {args.seed}"]

    sft = aj.Trainer(QUICKSTART, run_dir=root / "sft", train_data=rows, overrides=[
        *COMMON, *small, *seed, "Stages.rl = False", f"SFTConfig.steps = {args.sft_steps}",
        f"SFTConfig.warmup_steps = {min(50, args.sft_steps // 5)}",
        f"SFTConfig.paths = ('{inputs / 'sft.jsonl'}',)"])
    if not (args.reuse_sft and (root / "sft" / "final_model" / "config.json").is_file()):
        sft.train(overwrite=args.overwrite, progress=False)
    sft_accuracy = agent_accuracy(root / "sft" / "final_model", held_out)
    print(f"SFT: held-out accuracy through the agent {sft_accuracy:.3f}", flush=True)

    rl = aj.Trainer(QUICKSTART, run_dir=root / "rl", train_data=rows, overrides=[
        *COMMON, *small, *seed, "Stages.sft = False", f"ModelSource.path = '{root / 'sft' / 'final_model'}'",
        f"RLConfig.steps = {args.rl_steps}", f"RLConfig.dump_rollouts_every = {1 if args.small else 10}",
        "RLConfig.workflow = 'areal_jax.workflows.agent:AgentWorkflow'", f"AgentConfig.agent = '{AGENT}'",
        *(["RLVRConfig.filter_all_equal_rewards = True"] if not args.small else [])])
    rl.train(overwrite=args.overwrite, progress=False)
    rl_accuracy = agent_accuracy(root / "rl" / "final_model", held_out)
    summary = {"seed": args.seed, "sft_steps": args.sft_steps, "rl_steps": args.rl_steps,
               "held_out_problems": len(held_out), "sft_accuracy": sft_accuracy, "rl_accuracy": rl_accuracy,
               "gain": rl_accuracy - sft_accuracy}
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"RL: held-out accuracy through the agent {sft_accuracy:.3f} -> {rl_accuracy:.3f}; records in {root}")
    return summary


if __name__ == "__main__":
    main()
