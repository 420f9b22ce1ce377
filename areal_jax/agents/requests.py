"""OpenAI request bodies, checked: `ChatRequest` / `TextRequest` from the JSON an agent sent.

A bad body raises `RequestError` naming the field, which the endpoint answers as OpenAI does: HTTP
400 with `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`. Fields the
engine has no use for (`model`, `user`, `logprobs`, ...) are accepted and ignored, as agents and
SDKs send them freely.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["ChatRequest", "RequestError", "TextRequest", "parse_chat_request", "parse_text_request"]

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16
MAX_STOP = 4


class RequestError(ValueError):
    """A request the endpoint refuses: `status` (400, 401, 404, 503), the field it names, a code."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling fields common to both endpoints (None: the run's default)."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    sampling: Sampling


@dataclasses.dataclass(frozen=True)
class TextRequest:
    prompt: str | list[int]
    sampling: Sampling


def _number(body: Mapping[str, Any], key: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (low < value if low_open else low <= value) and value <= high):
        bound = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(f"{key} must be a number in {bound}, got {value!r}", param=key)
    return float(value)


def _int(body: Mapping[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise RequestError(f"{key} must be an integer >= {low}{f' and <= {high}' if high else ''}, got {value!r}",
                           param=key)
    return value


def _sampling(body: Mapping[str, Any]) -> Sampling:
    if body.get("stream"):
        raise RequestError("stream is not supported by this endpoint (send stream=false)", param="stream")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stop = tuple(stop)
    else:
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP} strings, got {stop!r}", param="stop")
    if any(not s for s in stop):
        raise RequestError("stop strings must not be empty", param="stop")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"seed must be an integer, got {seed!r}", param="seed")
    return Sampling(n=_int(body, "n", 1, MAX_N) or 1, temperature=_number(body, "temperature", 0.0, 2.0),
                    top_p=_number(body, "top_p", 0.0, 1.0, low_open=True), max_tokens=max_tokens, stop=stop,
                    seed=seed)


def _content(message: Mapping[str, Any], where: str) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is understood
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}.content[{i}] must be a text part {{'type': 'text', 'text': ...}}",
                                   param=f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _tool_calls(message: Mapping[str, Any], where: str) -> list[dict[str, Any]] | None:
    calls = message.get("tool_calls")
    if not calls:
        return None
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not (isinstance(fn, Mapping) and isinstance(fn.get("name"), str)):
            raise RequestError(f"{where}.tool_calls[{i}] must have function.name", param=f"{where}.tool_calls")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # as the API sends them; templates want the object
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of messages", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise RequestError(f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        clean: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": _content(message, where)}
        calls = _tool_calls(message, where) if role == "assistant" else None
        if calls:
            clean["tool_calls"] = calls
        if role == "tool" and message.get("tool_call_id") is not None:
            clean["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            clean["name"] = message["name"]
        out.append(clean)
    return out


def _tools(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError("tools must be a list of function tools", param="tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if not (isinstance(tool, Mapping) and tool.get("type") == "function" and isinstance(fn, Mapping)
                    and isinstance(fn.get("name"), str) and fn["name"]):
                raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}",
                                   param=f"tools[{i}]")
        tools = tools or None
    choice = body.get("tool_choice")
    names = {t["function"]["name"] for t in tools or ()}
    if choice is None or choice in ("none", "auto"):
        pass
    elif choice == "required" or isinstance(choice, Mapping):
        if not tools:
            raise RequestError("tool_choice needs tools", param="tool_choice")
        if isinstance(choice, Mapping):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in names:
                raise RequestError(f"tool_choice names function {name!r}, which is not among tools "
                                   f"({', '.join(sorted(names))})", param="tool_choice")
    else:
        raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                           param="tool_choice")
    return tools, choice


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    tools, choice = _tools(body)
    return ChatRequest(messages=_messages(body), tools=tools, tool_choice=choice, sampling=_sampling(body))


def parse_text_request(body: Any) -> TextRequest:
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in prompt)
    if not ((isinstance(prompt, str) and prompt) or ok_ids):
        raise RequestError("prompt must be a non-empty string or a list of token ids (one prompt per request)",
                           param="prompt")
    return TextRequest(prompt=prompt, sampling=_sampling(body))
