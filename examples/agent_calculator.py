"""Train an agent written with the openai SDK: arithmetic on large operands with a calculator tool.

The agent (areal_jax/agents/calculator_agent.py, `solve`) offers the model a `calculator` tool,
runs the calls it makes and scores its final \\boxed{} answer. The problems are a+b with both
operands 5000-9999: the tiny built-in model cannot add them in its head; with the tool it only has
to copy the expression and the result.

1. SFT on programmatically made traces (run_dir/sft, `--sft_steps` steps): `--tool_share` of them
   call the calculator (question, call, result, boxed answer), the rest restate the expression and
   box the right answer straight away, as a model that knows the tool but does not always reach for
   it. Answering from the head is mostly wrong here, so the SFT model is right about as often as it
   calls the tool. (The restatement puts a copy of the operands in every row: with copies in the
   tool traces alone, whether the model learned to copy within 1,000 steps depended on the seed.)
2. RL from that model through the OpenAI-compatible endpoint (RLConfig.workflow = AgentWorkflow,
   AgentConfig.agent = solve over HTTP), `--rl_steps` steps (run_dir/rl): calling the tool pays.
3. Held-out accuracy of both models, each through the same agent (greedy, in-process client), and
   how often each calls the tool (greedy on the held-out set; sampled in RL's metrics and rollout
   dumps), written to run_dir/summary.json.

    python examples/agent_calculator.py --run_dir runs/agent_calculator --seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import time

import areal_jax as aj
from areal_jax.agents.calculator_agent import solve, tool_trace, tools_preamble
from areal_jax.agents.chat import ChatService
from areal_jax.agents.inprocess import InProcessClient
from areal_jax.agents.session import Session
from areal_jax.api import SamplingParams
from areal_jax.generation import EngineConfig, GenerationEngine
from areal_jax.metrics import read_jsonl
from areal_jax.models import load_pretrained
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.workflow import RolloutClient
from areal_jax.tasks import arithmetic as ar
from areal_jax.tasks.tokenizer_builder import build_tokenizer

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.gin"
# One fixed shape, a+b with both operands 5000-9999 (the sum always 5 digits): each digit the call
# copies sits at one distance from its source, which this model learns to copy in a few hundred SFT
# steps; with free-length operands it does not (docs/benchmarks.md, issue 42; bench/agent_copy_sft.py).
LOW, HIGH = 5000, 9999
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


def problems(split: str, n: int, seed: int) -> list[ar.ArithmeticProblem]:
    """The first `n` distinct a+b problems of `split` (the task's hash split, so train and test never meet)."""
    rng, out, seen = random.Random(f"agent_calculator/{seed}/{split}"), [], set()
    while len(out) < n:
        expression = f"{rng.randint(LOW, HIGH)}+{rng.randint(LOW, HIGH)}"
        if ar.split_of(expression, 10) == split and expression not in seen:
            seen.add(expression)
            out.append(ar.make_problem(expression))
    return out


def direct_trace(messages: list[dict[str, str]], expression: str, answer: str, preamble: str) -> dict:
    """An SFT row that answers from the head: the tools are offered, the reply restates the
    expression and boxes the answer (the restatement is a copy of the operands in every row)."""
    return {"messages": [{"role": "system", "content": preamble}, *messages,
                         {"role": "assistant", "content": f"{expression} = \\boxed{{{answer}}}"}]}


class _Counting:
    """The in-process client, counting the sessions whose first reply calls a tool."""

    def __init__(self, client: InProcessClient):
        self.inner, self.first, self.called = client, True, False
        self.chat = self
        self.completions = self

    async def create(self, **kwargs):
        reply = await self.inner.chat.completions.create(**kwargs)
        if self.first:
            self.first, self.called = False, bool(reply.choices[0].message.tool_calls)
        return reply


def agent_accuracy(model_dir: pathlib.Path, problems: list[ar.ArithmeticProblem], *,
                   max_new_tokens: int = 112) -> tuple[float, float]:
    """The share of `problems` the agent solves with the model in `model_dir`, greedy, and the share
    of its sessions whose first reply calls the calculator."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    engine = GenerationEngine(load_pretrained(model_dir), EngineConfig(num_slots=16, max_seq_len=256))
    engine.start()
    client = RolloutClient(engine, tokenizer)
    service = ChatService(client, tokenizer, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))

    clients = [_Counting(InProcessClient(service, Session(p.query_id))) for p in problems]

    async def run() -> list[float]:
        return await asyncio.gather(*(solve(c, p.prompt_row()) for c, p in zip(clients, problems)))

    try:
        rewards = asyncio.run(run())
    finally:
        engine.stop()
        client.close()
    n = max(len(problems), 1)
    return sum(rewards) / n, sum(c.called for c in clients) / n


def dumped_tool_rate(path: pathlib.Path) -> float:
    """The share of a rollout dump's sessions (its rows' sessions) that called the calculator."""
    rows = read_jsonl(path)
    return sum(any(call["reply"].get("tool_calls") for call in r["messages"]) for r in rows) / max(len(rows), 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", default="runs/agent_calculator")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft_steps", type=int, default=1000)
    parser.add_argument("--rl_steps", type=int, default=20)
    parser.add_argument("--train_size", type=int, default=4000)
    parser.add_argument("--eval_size", type=int, default=200)
    parser.add_argument("--tool_share", type=float, default=0.4, help="share of SFT traces that call the tool")
    parser.add_argument("--small", action="store_true", help="a 1-layer model and tiny batches (a smoke test)")
    parser.add_argument("--overwrite", action="store_true", help="replace runs already in --run_dir")
    parser.add_argument("--reuse_sft", action="store_true", help="start from run_dir/sft/final_model if it is there")
    args = parser.parse_args(argv)
    start = time.time()
    root = pathlib.Path(args.run_dir).absolute()
    inputs = root / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    train = problems("train", args.train_size, args.seed)
    held_out = problems("test", args.eval_size, args.seed)
    # The SFT rows: each problem as the agent's conversation (task tokenizer), --tool_share of them
    # calling the calculator and the rest answering from the head, as a model that knows the tool
    # but does not always reach for it. The direct answers are right, but this model cannot add
    # 4-digit numbers in its head, so only the calls pay: RL has that to learn.
    preamble = tools_preamble(Tokenizer.from_pretrained(build_tokenizer(inputs / "tokenizer")))
    pick = random.Random(f"agent_calculator/{args.seed}/mix")
    with (inputs / "sft.jsonl").open("w") as f:
        for p in train:
            messages = p.prompt_row().messages
            trace = (tool_trace(messages, p.expression, preamble) if pick.random() < args.tool_share
                     else direct_trace(messages, p.expression, str(p.answer), preamble))
            f.write(json.dumps(trace) + "\n")
    rows = [p.math_record() for p in train]  # the RL prompts: the same questions
    small = SMALL if args.small else FULL
    seed = [f"TaskSource.seed = {args.seed}", f"SFTConfig.seed = {args.seed}", f"ModelSource.init_seed = {args.seed}"]

    sft = aj.Trainer(QUICKSTART, run_dir=root / "sft", train_data=rows, overrides=[
        *COMMON, *small, *seed, "Stages.rl = False", f"SFTConfig.steps = {args.sft_steps}",
        f"SFTConfig.warmup_steps = {min(50, args.sft_steps // 5)}",
        f"SFTConfig.paths = ('{inputs / 'sft.jsonl'}',)"])
    if not (args.reuse_sft and (root / "sft" / "final_model" / "config.json").is_file()):
        sft.train(overwrite=args.overwrite, progress=False)
    sft_accuracy, sft_tool_rate = agent_accuracy(root / "sft" / "final_model", held_out)
    print(f"SFT: held-out accuracy through the agent {sft_accuracy:.3f}, tool called in {sft_tool_rate:.3f} "
          f"({time.time() - start:.0f} s)", flush=True)

    rl = aj.Trainer(QUICKSTART, run_dir=root / "rl", train_data=rows, overrides=[
        *COMMON, *small, *seed, "Stages.sft = False", f"ModelSource.path = '{root / 'sft' / 'final_model'}'",
        f"RLConfig.steps = {args.rl_steps}", f"RLConfig.dump_rollouts_every = {1 if args.small else 10}",
        "RLConfig.workflow = 'areal_jax.workflows.agent:AgentWorkflow'", f"AgentConfig.agent = '{AGENT}'",
        *(["RLVRConfig.filter_all_equal_rewards = True"] if not args.small else [])])
    rl.train(overwrite=args.overwrite, progress=False)
    rl_accuracy, rl_tool_rate = agent_accuracy(root / "rl" / "final_model", held_out)
    records = [r["metrics"] for r in read_jsonl(root / "rl" / "metrics.jsonl")]
    dumps = sorted((root / "rl" / "rollouts").glob("step_*.jsonl"), key=lambda d: int(d.stem.split("_")[1]))
    summary = {"seed": args.seed, "sft_steps": args.sft_steps, "rl_steps": args.rl_steps,
               "tool_share": args.tool_share, "held_out_problems": len(held_out),
               "sft_accuracy": sft_accuracy, "rl_accuracy": rl_accuracy, "gain": rl_accuracy - sft_accuracy,
               # greedy, held-out: the share of sessions whose first reply calls the calculator
               "sft_tool_rate": sft_tool_rate, "rl_tool_rate": rl_tool_rate,
               # sampled, training: calls per session (1 = answered directly) and the dumps' share of
               # sessions that called the tool, first and last
               "rl_calls_mean": [records[0].get("agent/calls_mean"), records[-1].get("agent/calls_mean")],
               "dump_tool_rate": {d.stem: dumped_tool_rate(d) for d in (dumps[0], dumps[-1])} if dumps else {},
               "seconds": round(time.time() - start)}
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"RL: held-out accuracy through the agent {sft_accuracy:.3f} -> {rl_accuracy:.3f}, tool called in "
          f"{sft_tool_rate:.3f} -> {rl_tool_rate:.3f}; records in {root}")
    return summary


if __name__ == "__main__":
    main()
