"""The example agent: arithmetic with a calculator tool, written with the openai SDK's calls.

    AgentConfig.agent = "areal_jax.agents.calculator_agent:solve"

`solve(client, row)` offers the `calculator` tool, runs the calls the model makes (up to
`MAX_CALLS` replies), and scores the final reply: 1.0 when its last \\boxed{...} is the row's
answer. `client` is an `openai.AsyncOpenAI` (or the in-process client: the same calls). The
example's SFT traces (`tool_trace`) show the model the same conversation with the right call.
"""

from __future__ import annotations

import re
from typing import Any

from areal_jax.agents.tools import CALCULATOR_TOOL, ToolBox, calculate

__all__ = ["MAX_CALLS", "boxed_answer", "solve", "tool_trace", "tools_preamble"]

MAX_CALLS = 3
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_answer(text: str | None) -> str | None:
    found = _BOXED.findall(text or "")
    return found[-1].strip() if found else None


async def solve(client: Any, row: Any) -> float:
    tools = ToolBox.calculator()
    messages: list[Any] = list(row.messages)
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools.specs)
        message = reply.choices[0].message
        if not message.tool_calls:
            return float(boxed_answer(message.content) == str(row.answer).strip())
        messages.append(message)
        messages += await tools.run(message)
    return 0.0


def tools_preamble(tokenizer: Any) -> str | None:
    """The system text the chat template writes for the calculator tool, when it writes the tools
    as a system turn (the task tokenizer does): SFT rows carry it as their system message, so their
    prompts are the agent's prompts token for token. None when the template does otherwise."""
    probe = "\u2063"
    text = tokenizer.apply_chat_template([{"role": "system", "content": probe}], tools=[CALCULATOR_TOOL],
                                         tokenize=False)
    plain = tokenizer.apply_chat_template([{"role": "system", "content": probe}], tokenize=False)
    head = text[:len(text) - len(plain)]
    preamble = head.removeprefix("<|system|>").removesuffix("<|end|>")
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": preamble}], tokenize=False)
    return preamble if text == rendered + plain else None


def tool_trace(messages: list[dict[str, str]], expression: str, preamble: str) -> dict[str, Any]:
    """An SFT row: the question, the calculator call on `expression`, its result, the boxed answer."""
    result = calculate(expression)
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator",
                                                             "arguments": {"expression": expression}}}
    return {"messages": [{"role": "system", "content": preamble}, *messages,
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": result},
                         {"role": "assistant", "content": f"\\boxed{{{result}}}"}]}
