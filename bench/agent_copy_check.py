"""Does a calculator-example model copy? Greedy, its first reply forced to be a call (tool_choice).

examples/agent_calculator.py's SFT model answers directly under greedy decoding (most of its traces
do); this separates "does not reach for the tool" from "cannot use it": on `N` held-out problems of
the example's seed the first reply is forced to open a call (tool_choice "required"), and it prints
the share whose call copies the expression exactly and the share then answered right.

    .venv/bin/python bench/agent_copy_check.py RUN_DIR/sft/final_model SEED N
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    import agent_calculator as example

    from areal_jax.agents.calculator_agent import boxed_answer
    from areal_jax.agents.chat import ChatService
    from areal_jax.agents.inprocess import InProcessClient
    from areal_jax.agents.session import Session
    from areal_jax.agents.tools import ToolBox
    from areal_jax.api import SamplingParams
    from areal_jax.generation import EngineConfig, GenerationEngine
    from areal_jax.models import load_pretrained
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.rollout.workflow import RolloutClient

    args = sys.argv[1:] if argv is None else argv
    model_dir, seed, n = pathlib.Path(args[0]), int(args[1]), int(args[2])
    problems = example.problems("test", n, seed)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    engine = GenerationEngine(load_pretrained(model_dir), EngineConfig(num_slots=16, max_seq_len=256))
    engine.start()
    client = RolloutClient(engine, tokenizer)
    service = ChatService(client, tokenizer, SamplingParams(max_new_tokens=112, temperature=0.0))

    async def one(problem) -> tuple[float, float]:
        chat, tools = InProcessClient(service, Session(problem.query_id)), ToolBox.calculator()
        messages = list(problem.prompt_row().messages)
        reply = await chat.chat.completions.create(model="policy", messages=messages, tools=tools.specs,
                                                   tool_choice="required")
        message = reply.choices[0].message
        if not message.tool_calls:  # the forced opening, then a malformed rest
            return 0.0, 0.0
        copied = json.loads(message.tool_calls[0].function.arguments).get("expression") == problem.expression
        messages += [message, *await tools.run(message)]
        reply = await chat.chat.completions.create(model="policy", messages=messages, tools=tools.specs)
        return float(copied), float(boxed_answer(reply.choices[0].message.content) == str(problem.answer))

    async def run() -> list[tuple[float, float]]:
        return await asyncio.gather(*(one(p) for p in problems))

    try:
        out = asyncio.run(run())
    finally:
        engine.stop()
        client.close()
    result = {"model": str(model_dir), "seed": seed, "problems": n, "copied_expression": sum(a for a, _ in out) / n,
              "solved_with_forced_call": sum(b for _, b in out) / n}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
