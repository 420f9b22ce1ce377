"""The OpenAI chat and text completion calls over the native engine, for one agent session.

`ChatService.chat(session, body)` / `.complete(session, body)` take a request body (a dict) and
return the OpenAI response body; the HTTP endpoint (agents/server.py) and the in-process client
(agents/inprocess.py) both call them. Every completion is recorded in the session (agents/session.py).

Token exactness. A conversation that continues an earlier call of the session (its messages are
that call's messages, then the reply it got, then more) is fed to the engine as that call's exact
tokens (prompt and sampled reply) followed by the tokens of what the chat template writes after
the reply (turn end, new messages, generation prompt). That tail is read off the template's
rendering of the conversation with the reply replaced by a marker, so the model's own tokens are
never re-tokenized from text. Where the template renders the history differently from what the
model saw (e.g. Qwen3 dropping old reasoning), the conversation is rendered afresh and starts a
new training row.

Stop strings are applied to the sampled text: the reply ends with the token that completes the
first stop string (the tokens kept are exactly the ones the model sampled up to there).

`tool_choice`. "none" reads no calls from the reply (the tools are still rendered, as OpenAI does).
"required" and a named function are enforced by opening the reply as a call: the text the chat
template writes for an assistant tool call before the function's name ("required") or before its
arguments (a named function: `<tool_call>{"name": "fn", "arguments": ` for hermes) is fed after
the generation prompt, and the model continues from there. Those forced tokens are fed, not
sampled, so the row has them with loss mask 0, behaviour log-prob 0 and version -1; the reply is
read as the forced text followed by the sampled text (a malformed rest still comes back as content).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from areal_jax.agents.requests import (ChatRequest, RequestError, Sampling, TextRequest, parse_chat_request,
                                       parse_text_request)
from areal_jax.agents.session import Session
from areal_jax.agents.tool_calls import ToolFormat, detect_tool_format, parse_tool_calls
from areal_jax.api import Completion, SamplingParams

__all__ = ["ChatService", "GenerationAbortedError"]

# Stands for a reply while the template renders what follows it (never sampled, never fed).
_MARK = "\u2063reply\u2063"
# Stand for a function's name / arguments while the template renders a forced call's opening.
_NAME_MARK, _ARGS_MARK = "fn\u2063name\u2063", "args_mark_7f3a"


class GenerationAbortedError(RequestError):
    """The engine ended a sample as 'aborted' (stopping, or the request was cancelled)."""

    def __init__(self) -> None:
        super().__init__("generation was aborted (the engine is stopping)", status=503, kind="server_error",
                         code="aborted")


def _norm_message(message: dict[str, Any]) -> tuple:
    """What identifies a message for matching a conversation against earlier calls."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or ())
    return message["role"], message.get("content") or "", calls


@dataclasses.dataclass(frozen=True)
class _Turn:
    """One reply of a chat call that a later call may continue."""

    messages: tuple[tuple, ...]  # the call's messages, normalised
    reply: tuple  # the reply as returned, normalised
    prompt_text: str  # the template's rendering of the call's messages (with the generation prompt)
    tokens: np.ndarray  # the node's tokens: the call's prompt ids, then the sampled reply
    stop_reason: str


class ChatService:
    """Chat and text completions for agent sessions over `client` (a RolloutClient: `generate`).

    tokenizer: the policy's (encode, decode, apply_chat_template, stop_token_ids); defaults: the
    run's sampling (its max_new_tokens, temperature, top_p, top_k and stop ids); prompt_limit:
    the longest prompt the engine takes (None: unchecked here); tool_format: "auto" reads it off
    the chat template (agents/tool_calls.py); chat_template_kwargs: extra template variables.
    """

    def __init__(self, client: Any, tokenizer: Any, defaults: SamplingParams, *, prompt_limit: int | None = None,
                 tool_format: ToolFormat | str = "auto", chat_template_kwargs: dict[str, Any] | None = None,
                 model_name: str = "policy") -> None:
        self.client, self.tokenizer, self.defaults = client, tokenizer, defaults
        self.prompt_limit = prompt_limit
        self.tool_format = detect_tool_format(tokenizer.chat_template) if tool_format == "auto" else tool_format
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.model_name = model_name
        self.stop_ids = tuple(dict.fromkeys([*defaults.stop_token_ids, *tokenizer.stop_token_ids]))

    # ---- the calls ------------------------------------------------------------------------------

    async def chat(self, session: Session, body: Any) -> dict[str, Any]:
        request = parse_chat_request(body)
        prompt_ids, prompt_text = self._chat_prompt(session, request)
        forced = self._forced_opening(request, prompt_text)
        if forced:  # fed after the generation prompt: part of the row's prompt (mask 0, version -1)
            prompt_ids = [*prompt_ids, *self.tokenizer.encode(forced, add_special_tokens=False)]
        completions = await self._generate(session, prompt_ids, request.sampling, "messages")
        parse = request.tools is not None and request.tool_choice != "none"
        choices, usage = [], 0
        for index, completion in enumerate(completions):
            completion, text = self._apply_stop(completion, request.sampling.stop)
            text = forced + text
            usage += len(completion.tokens)
            node = session.record(prompt_ids, completion)
            content, calls, _ = parse_tool_calls(text, self.tool_format if parse else "none")
            message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
            finish = "length" if completion.stop_reason == "length" else "stop"
            if calls:
                message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                         for c in calls]
                finish = "tool_calls"
            reply = {**message, "tool_calls": [{**c, "function": {**c["function"], "arguments": a.arguments}}
                                               for c, a in zip(message.get("tool_calls", ()), calls)]}
            session.turns.append(_Turn(tuple(map(_norm_message, request.messages)), _norm_message(reply),
                                       prompt_text, session.nodes[node].tokens, completion.stop_reason))
            session.messages.append({"messages": request.messages, "reply": message})
            choices.append({"index": index, "message": message, "finish_reason": finish, "logprobs": None})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self._model(body), "choices": choices,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": usage,
                          "total_tokens": len(prompt_ids) + usage}}

    async def complete(self, session: Session, body: Any) -> dict[str, Any]:
        request = parse_text_request(body)
        if isinstance(request.prompt, str):
            prompt_ids = self.tokenizer.encode(request.prompt)
        else:
            prompt_ids = list(request.prompt)
            if max(prompt_ids) >= len(self.tokenizer):
                raise RequestError(f"prompt holds token id {max(prompt_ids)}, beyond the vocabulary of "
                                   f"{len(self.tokenizer)}", param="prompt")
        completions = await self._generate(session, prompt_ids, request.sampling, "prompt")
        choices, usage = [], 0
        for index, completion in enumerate(completions):
            completion, text = self._apply_stop(completion, request.sampling.stop)
            usage += len(completion.tokens)
            session.record(prompt_ids, completion)
            session.messages.append({"prompt": request.prompt, "reply": text})
            choices.append({"index": index, "text": text, "logprobs": None,
                            "finish_reason": "length" if completion.stop_reason == "length" else "stop"})
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self._model(body), "choices": choices,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": usage,
                          "total_tokens": len(prompt_ids) + usage}}

    # ---- pieces ---------------------------------------------------------------------------------

    def _model(self, body: Any) -> str:
        model = body.get("model") if isinstance(body, dict) else None
        return model if isinstance(model, str) and model else self.model_name

    def _render(self, messages: Sequence[dict[str, Any]], tools: Any) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                                      tools=tools, **self.template_kwargs)
        except ValueError as exc:  # the template refused the conversation (a role it has no place for)
            raise RequestError(f"the chat template cannot render these messages: {exc}", param="messages") from exc

    def _forced_opening(self, request: ChatRequest, prompt_text: str) -> str:
        """The text a reply is forced to open with under `tool_choice` (see the module docstring);
        "" when the choice leaves the reply free."""
        choice = request.tool_choice
        if choice is None or choice in ("none", "auto"):
            return ""
        named = not isinstance(choice, str)
        name = choice["function"]["name"] if named else _NAME_MARK
        call = {"id": "call_0", "type": "function",
                "function": {"name": name, "arguments": {_ARGS_MARK: 0} if named else {}}}
        try:
            text = self.tokenizer.apply_chat_template(
                [*request.messages, {"role": "assistant", "content": "", "tool_calls": [call]}],
                tokenize=False, tools=request.tools, **self.template_kwargs)
        except ValueError as exc:
            raise RequestError(f"the chat template cannot render a tool call here: {exc}",
                               param="tool_choice") from exc
        reply = text[len(prompt_text):] if text.startswith(prompt_text) else None
        at = -1 if reply is None else reply.find(f'{{"{_ARGS_MARK}"' if named else _NAME_MARK)
        if at < 0:
            raise RequestError("tool_choice cannot be enforced with this chat template (it does not write a tool "
                               "call after the generation prompt)", param="tool_choice")
        return reply[:at]

    def _chat_prompt(self, session: Session, request: ChatRequest) -> tuple[list[int], str]:
        """The call's prompt ids and the template's text of its messages (see the module docstring)."""
        messages, tools = request.messages, request.tools
        text = self._render(messages, tools)
        normed = [_norm_message(m) for m in messages]
        for turn in sorted(session.turns, key=lambda t: -len(t.messages)):  # the longest history first
            k = len(turn.messages)
            if len(messages) <= k or tuple(normed[:k]) != turn.messages or normed[k] != turn.reply:
                continue
            marked = self._render([*messages[:k], {"role": "assistant", "content": _MARK}, *messages[k + 1:]], tools)
            head = turn.prompt_text + _MARK
            if not marked.startswith(head):
                continue  # the template renders this history otherwise than the model saw it
            tail = marked[len(head):]
            last = int(turn.tokens[-1])
            if turn.stop_reason == "stop" and last in self.stop_ids:  # the reply's own end-of-turn token
                closing = self.tokenizer.decode([last])
                if closing and tail.startswith(closing):
                    tail = tail[len(closing):]
            ids = [int(t) for t in turn.tokens] + self.tokenizer.encode(tail, add_special_tokens=False)
            return ids, text
        return self.tokenizer.encode(text, add_special_tokens=False), text

    async def _generate(self, session: Session, prompt_ids: list[int], sampling: Sampling,
                        field: str) -> list[Completion]:
        if self.prompt_limit is not None and len(prompt_ids) > self.prompt_limit:
            raise RequestError(f"{field}: the prompt is {len(prompt_ids)} tokens, the engine takes at most "
                               f"{self.prompt_limit}", param=field, code="context_length_exceeded")
        d = self.defaults
        params = SamplingParams(max_new_tokens=sampling.max_tokens or d.max_new_tokens,
                                temperature=d.temperature if sampling.temperature is None else sampling.temperature,
                                top_p=d.top_p if sampling.top_p is None else sampling.top_p, top_k=d.top_k,
                                stop_token_ids=self.stop_ids)
        seed = session.next_seed()  # counts the call too
        seed = seed if sampling.seed is None else sampling.seed
        try:
            result = await self.client.generate(prompt_ids, params, sampling.n, seed=seed)
        except ValueError as exc:  # the engine refused the request (e.g. longer than it holds)
            raise RequestError(f"{field}: {exc}", param=field) from exc
        if any(c.stop_reason == "aborted" for c in result.completions):
            session.aborted = True
            raise GenerationAbortedError()
        return list(result.completions)

    def _apply_stop(self, completion: Completion, stop: tuple[str, ...]) -> tuple[Completion, str]:
        """The completion cut after the token that completes its first stop string, and its text
        (without the stop string, without the stop token)."""
        tokens = [int(t) for t in completion.tokens]
        body = tokens[:-1] if tokens and completion.stop_reason == "stop" and tokens[-1] in self.stop_ids else tokens
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stop if s in text]
        if not hits:
            return completion, text
        at = min(hits)[0]
        for k in range(1, len(body) + 1):  # the first token whose text reaches past a stop string
            prefix = self.tokenizer.decode(body[:k], skip_special_tokens=True)
            if any(s in prefix for s in stop):
                break
        cut = dataclasses.replace(completion, tokens=np.asarray(tokens[:k], np.int32),
                                  logprobs=np.asarray(completion.logprobs)[:k],
                                  versions=np.asarray(completion.versions)[:k], stop_reason="stop", moe_routing=None)
        return cut, text[:at]
