"""Example tools an agent hands the model: a calculator and a sandboxed Python interpreter.

Each tool is an OpenAI function spec (`*_TOOL`, for `tools=`) and a function from the call's
arguments to the text the tool turn carries back. `ToolBox` runs the tool calls of a reply and
returns the `tool` messages to append; a call of an unknown tool or with bad arguments is
answered with an error text (the model's mistake is its observation, never the agent's crash).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

__all__ = ["CALCULATOR_TOOL", "PYTHON_TOOL", "ToolBox", "calculate", "run_python"]

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run a Python program in a sandbox and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_MAX_DIGITS = 4000  # results beyond this are refused (a tool must not hang the rollout)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * max(len(str(abs(int(left)))), 1) > _MAX_DIGITS:
            raise ValueError("the result is too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text, or "error: ..." (never raises)."""
    try:
        value = _eval(ast.parse(str(expression).strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def run_python(code: str, *, limits: Any = None, max_chars: int = 2000) -> str:
    """Run `code` in the code sandbox (reward/sandbox.py, its default limits unless given); what it
    prints, or its exit code and error tail, cut to `max_chars`."""
    from areal_jax.reward.sandbox import run_program

    result = run_program(str(code), "", limits)
    out = result.stdout if result.exit_code == 0 else (
        f"{result.stdout}\n[exit code {result.exit_code}]\n{result.stderr_tail}")
    return out[:max_chars]


class ToolBox:
    """Named tools: `specs` for the request, `await run(message)` for a reply's tool calls."""

    def __init__(self, tools: Mapping[str, tuple[dict[str, Any], Callable[..., str | Awaitable[str]]]]) -> None:
        self.tools = dict(tools)

    @classmethod
    def calculator(cls) -> ToolBox:
        return cls({"calculator": (CALCULATOR_TOOL, calculate)})

    @classmethod
    def python(cls, limits: Any = None) -> ToolBox:
        return cls({"python": (PYTHON_TOOL, lambda code: asyncio.to_thread(run_python, code, limits=limits))})

    @property
    def specs(self) -> list[dict[str, Any]]:
        return [spec for spec, _ in self.tools.values()]

    async def call(self, name: str, arguments: Any) -> str:
        if name not in self.tools:
            return f"error: no tool named {name!r} (tools: {', '.join(self.tools)})"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return f"error: the arguments are not JSON: {exc}"
        if not isinstance(arguments, dict):
            return "error: the arguments must be a JSON object"
        try:
            out = self.tools[name][1](**arguments)
            if asyncio.iscoroutine(out) or isinstance(out, asyncio.Future):
                out = await out
        except TypeError as exc:  # wrong argument names
            return f"error: {exc}"
        return str(out)

    async def run(self, message: Any) -> list[dict[str, Any]]:
        """The `tool` messages answering each tool call of `message` (an SDK message or a dict)."""
        calls = message.get("tool_calls") if isinstance(message, Mapping) else message.tool_calls
        out = []
        for call in calls or ():
            if isinstance(call, Mapping):
                call_id, fn = call.get("id"), call["function"]
                name, args = fn["name"], fn.get("arguments", "{}")
            else:
                call_id, name, args = call.id, call.function.name, call.function.arguments
            out.append({"role": "tool", "tool_call_id": call_id, "content": await self.call(name, args)})
        return out
