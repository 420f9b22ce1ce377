"""Fixtures of the agent tests: a scripted engine, tool-calling tokenizers of two families, a tiny
real engine over the arithmetic task's tokenizer.

`ScriptedEngine` is an engine (submit / abort, as the RolloutClient drives one) whose samples are
text chosen by a script from the prompt: `script(prompt_text, sample) -> reply`. A reply is the
tokenizer's encoding of the text then eos (cut at max_new_tokens: "length"), with log-prob
-0.01 * (i + 1) for token i and the engine's `version`. Every prompt it was fed is kept in `fed`.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import pathlib

import numpy as np

from areal_jax.api import Completion, GroupResult
from areal_jax.models.tokenizer import Tokenizer
from tests.tokenizer_fixtures import build_tiny_tokenizer

# Qwen2.5's tool layout, in the style of its chat template (written for these tests).
HERMES_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' + (messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.') }}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nReturn each call as <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Llama 3.1's JSON tool calls, in the style of its chat template (written for these tests).
LLAMA31_TEMPLATE = """\
{{- bos_token + '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}
    {{- 'Respond with a JSON function call {"name": function name, "parameters": arguments}.\\n\\n' }}
    {%- for tool in tools %}{{- tool | tojson + '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- (messages[0].content if messages[0].role == 'system' else '') + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""


def tool_tokenizer(directory: pathlib.Path, family: str) -> Tokenizer:
    """A tiny BPE tokenizer of `family` ("hermes": Qwen2.5 layout, "llama3": Llama 3.1) whose chat
    template writes tool calls as that family does."""
    out = build_tiny_tokenizer(directory, "chatml" if family == "hermes" else "llama3")
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE if family == "hermes" else LLAMA31_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_pretrained(out)


class ScriptedEngine:
    """An engine whose replies a script writes (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, script, version: int = 0) -> None:
        self.tokenizer, self.script, self.version = tokenizer, script, version
        self.fed: list[list[int]] = []
        self._ids = itertools.count()

    def submit(self, prompt_ids, sampling, n=1, *, seed=None) -> concurrent.futures.Future:
        prompt = [int(t) for t in prompt_ids]
        self.fed.append(prompt)
        text = self.tokenizer.decode(prompt)
        completions = []
        for sample in range(n):
            tokens = self.tokenizer.encode(self.script(text, sample), add_special_tokens=False)
            tokens.append(self.tokenizer.eos_token_id)
            stop = "stop" if len(tokens) <= sampling.max_new_tokens else "length"
            tokens = tokens[:sampling.max_new_tokens]
            completions.append(Completion(tokens=np.asarray(tokens, np.int32),
                                          logprobs=-0.01 * np.arange(1, len(tokens) + 1, dtype=np.float32),
                                          versions=np.full(len(tokens), self.version, np.int32), stop_reason=stop))
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.request_id = f"scripted-{next(self._ids)}"
        future.set_result(GroupResult(future.request_id, np.asarray(prompt, np.int32), completions))
        return future

    def abort(self, request_id: str) -> None:
        pass
