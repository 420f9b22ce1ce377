"""Tool calls in a model's own format: read them out of sampled text, per model family.

Families (`ToolFormat`):
- "hermes": Qwen2.5 / Qwen3 chat templates. Each call is `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`; text before the first call is the message's content.
- "llama3": Llama 3.1's JSON tool calls. The whole reply (after an optional `<|python_tag|>`) is one
  JSON object `{"name": ..., "parameters": {...}}`, or several joined by ";".
- "none": no tool calls are read.

`parse_tool_calls(text, fmt)` returns (content, calls). Text that is not a well-formed call in the
family's format (bad JSON, no name, arguments that are not an object, an unclosed tag) is returned
whole as content with no calls: a malformed call is the model's mistake, answered as text (the
endpoint then reports finish_reason "stop"), never an error.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

__all__ = ["ToolCall", "ToolFormat", "detect_tool_format", "parse_tool_calls"]

ToolFormat = Literal["hermes", "llama3", "none"]
TOOL_FORMATS: tuple[str, ...] = ("hermes", "llama3", "none")

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


def detect_tool_format(chat_template: str | None) -> ToolFormat:
    """The tool format a chat template writes: hermes when it mentions `<tool_call>`, llama3 for
    Llama 3 headers, otherwise none (the template has no tool calls to read)."""
    if not chat_template:
        return "none"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|start_header_id|>" in chat_template or _PYTHON_TAG in chat_template:
        return "llama3"
    return "none"


def _call(obj: Any, arg_key: str) -> ToolCall | None:
    """A ToolCall from a decoded JSON object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arg_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def _hermes(text: str) -> tuple[str, list[ToolCall]] | None:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls, end = [], start
    for match in _HERMES.finditer(text, start):
        if text[end:match.start()].strip():  # prose between calls: not the format
            return None
        try:
            call = _call(json.loads(match.group(1)), "arguments")
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
        end = match.end()
    if not calls or text[end:].strip():  # an unclosed tag, or text after the last call
        return None
    return text[:start].rstrip(), calls


def _llama3(text: str) -> tuple[str, list[ToolCall]] | None:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return (text, []) if not text.lstrip().startswith(_PYTHON_TAG) else None
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return None
        call = _call(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        rest = body[i:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return None
        i = len(body) - len(rest)
    return "", calls


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, list[ToolCall], bool]:
    """(content, calls, malformed): calls read from `text` in format `fmt`. malformed: the text
    tried to call a tool but is not a well-formed call (it is then the content, with no calls)."""
    if fmt not in TOOL_FORMATS:
        raise ValueError(f"tool format must be one of {TOOL_FORMATS}, got {fmt!r}")
    if fmt == "none":
        return text, [], False
    parsed = _hermes(text) if fmt == "hermes" else _llama3(text)
    if parsed is None:
        return text, [], True
    return parsed[0], parsed[1], False
