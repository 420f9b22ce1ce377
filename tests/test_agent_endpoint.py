"""The OpenAI-compatible endpoint (areal_jax/agents/) against the openai SDK: chat, tools, n, stop,
errors; tool-call parsing per model family, malformed calls included."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from areal_jax.agents.chat import ChatService
from areal_jax.agents.session import Session, SessionRegistry
from areal_jax.agents.tool_calls import ToolCall, detect_tool_format, parse_tool_calls
from areal_jax.agents.tools import CALCULATOR_TOOL
from areal_jax.api import SamplingParams
from areal_jax.rollout.workflow import RolloutClient
from tests.agent_fixtures import HERMES_TEMPLATE, LLAMA31_TEMPLATE, ScriptedEngine, tool_tokenizer

openai = pytest.importorskip("openai")  # the [agents] extra

DEFAULTS = SamplingParams(max_new_tokens=256, temperature=1.0)


# ---- tool-call parsing per family ----------------------------------------------------------------

@pytest.mark.parametrize("text, content, calls", [
    ("The sum.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2+3\"}}\n</tool_call>",
     "The sum.", [ToolCall("calculator", {"expression": "2+3"})]),
    ("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": "
     "\"{\\\"x\\\": 1}\"}</tool_call>", "", [ToolCall("a", {}), ToolCall("b", {"x": 1})]),
    ("no call here", "no call here", []),
])
def test_hermes_tool_calls_are_read_as_qwen_writes_them(text, content, calls):
    assert parse_tool_calls(text, "hermes") == (content, calls, False)


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2+3\"}\n</tool_call>",  # bad JSON
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
    "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>",  # arguments not an object
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}",  # never closed
    "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> and then prose",
])
def test_a_malformed_hermes_call_is_content(text):
    assert parse_tool_calls(text, "hermes") == (text, [], True)


@pytest.mark.parametrize("text, calls", [
    ('{"name": "calculator", "parameters": {"expression": "7*6"}}', [ToolCall("calculator", {"expression": "7*6"})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": 2}}',
     [ToolCall("f", {}), ToolCall("g", {"y": 2})]),
])
def test_llama3_json_tool_calls(text, calls):
    assert parse_tool_calls(text, "llama3") == ("", calls, False)


@pytest.mark.parametrize("text, malformed", [
    ("The answer is 42.", False), ('{"name": "f", "parameters": {', True), ('{"parameters": {}}', True),
    ('{"name": "f", "parameters": {}} trailing words', True), ("<|python_tag|>print(1)", True),
])
def test_llama3_text_and_malformed_calls_are_content(text, malformed):
    assert parse_tool_calls(text, "llama3") == (text, [], malformed)


def test_the_format_is_read_off_the_chat_template():
    assert detect_tool_format(HERMES_TEMPLATE) == "hermes"
    assert detect_tool_format(LLAMA31_TEMPLATE) == "llama3"
    assert detect_tool_format("{{ messages }}") == detect_tool_format(None) == "none"
    with pytest.raises(ValueError, match="tool format"):
        parse_tool_calls("x", "xml")


# ---- the endpoint over HTTP, driven by the openai SDK -----------------------------------------------

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3"}}\n</tool_call>'


def _script(text: str, sample: int) -> str:
    # A forced opening (tool_choice "required" / a named function): the model continues the call.
    if text.endswith('<tool_call>\n{"name": "'):
        return 'calculator", "arguments": {"expression": "7*6"}}\n</tool_call>'
    if text.endswith('"arguments": '):
        return '{"expression": "7*6"}}\n</tool_call>'
    if "<tool_response>" in text:
        return f"It is \\boxed{{36}} (sample {sample})."
    if "calculator" in text:  # the tools are offered
        return "bad call <tool_call>\n{\"name\": \"calculator\"" if "MALFORMED" in text else CALL
    if "STOP" in text:
        return "alpha beta gamma delta"
    return f"hello {sample}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An endpoint over a scripted engine with the hermes tokenizer; yields (endpoint, sessions, engine)."""
    from areal_jax.agents.server import Endpoint

    tokenizer = tool_tokenizer(tmp_path_factory.mktemp("hermes"), "hermes")
    engine = ScriptedEngine(tokenizer, _script)
    client = RolloutClient(engine, tokenizer)
    sessions = SessionRegistry()
    endpoint = Endpoint(ChatService(client, tokenizer, DEFAULTS, prompt_limit=2000), sessions)
    endpoint.start()
    yield endpoint, sessions, engine, tokenizer
    endpoint.stop()
    client.close()


def _run(endpoint, sessions, agent, session_id="s0"):
    session = sessions.open(Session(session_id))

    async def main():
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.id, max_retries=0) as client:
            return await agent(client)

    try:
        return asyncio.run(main()), session
    finally:
        sessions.close(session.id)


def test_chat_n_and_usage(served):
    endpoint, sessions, engine, tokenizer = served

    async def agent(client):
        return await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=3,
                                                    temperature=0.5, max_completion_tokens=32)

    reply, session = _run(endpoint, sessions, agent)
    assert [c.message.content for c in reply.choices] == ["hello 0", "hello 1", "hello 2"]
    assert [c.finish_reason for c in reply.choices] == ["stop"] * 3 and reply.model == "m"
    fed = engine.fed[-1]
    assert reply.usage.prompt_tokens == len(fed)
    assert fed == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert len(session.leaves()) == 3  # three samples of one prompt: three rows
    for node in session.leaves():
        assert node.tokens[:len(fed)].tolist() == fed and node.loss_mask[:len(fed)].sum() == 0
        assert node.loss_mask[len(fed):].all() and (node.versions[len(fed):] == 0).all()


def _assert_two_call_row(row, first_fed, sampled, second_fed):
    """`row` is the first call's prompt, its `sampled` reply, the glue, then the second call's reply:
    only the sampled tokens trained (mask 1, the engine's version and log-probs), the rest fed."""
    assert second_fed[:len(first_fed) + len(sampled)] == first_fed + sampled
    assert row.tokens[:len(second_fed)].tolist() == second_fed
    mask = np.zeros(len(row.tokens))
    mask[len(first_fed):len(first_fed) + len(sampled)] = 1
    mask[len(second_fed):] = 1
    np.testing.assert_array_equal(row.loss_mask, mask)
    np.testing.assert_array_equal(row.versions, np.where(mask > 0, 0, -1))
    assert (row.logprobs[mask == 0] == 0).all() and (row.logprobs[mask > 0] < 0).all()


def test_tool_call_round_trip_continues_the_row_token_exactly(served):
    endpoint, sessions, engine, tokenizer = served

    async def agent(client):
        messages = [{"role": "user", "content": "What is 12*3?"}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_TOOL])
        message = first.choices[0].message
        messages.append(message)  # the SDK's object goes back as the agent got it
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "36"})
        second = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_TOOL])
        return first, second

    (first, second), session = _run(endpoint, sessions, agent, "tools")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12*3"}
    assert second.choices[0].message.content == "It is \\boxed{36} (sample 0)."
    # One row: the second prompt is the first prompt, the sampled call, then the tool turn.
    (row,) = session.leaves()
    first_fed, second_fed = engine.fed[-2], engine.fed[-1]
    sampled = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert row.tokens.tolist() == second_fed + tokenizer.encode(second.choices[0].message.content,
                                                               add_special_tokens=False) + [tokenizer.eos_token_id]
    _assert_two_call_row(row, first_fed, sampled, second_fed)
    # The inserted tokens are what the template writes after the call: exactly the tool turn.
    inserted = tokenizer.decode(second_fed[len(first_fed) + len(sampled):])
    assert inserted == "\n<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert session.messages[1]["messages"][-1]["content"] == "36"


@pytest.mark.parametrize("question, choice, content", [
    ("MALFORMED", "auto", 'bad call <tool_call>\n{"name": "calculator"'),
    ("Add.", "none", CALL),  # a well-formed call, not read: the tools are still rendered, as OpenAI does
])
def test_malformed_or_unread_tool_call_is_content_with_finish_stop(served, question, choice, content):
    endpoint, sessions, engine, tokenizer = served
    messages = [{"role": "user", "content": question}]

    async def agent(client):
        return await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_TOOL],
                                                    tool_choice=choice)

    reply, _ = _run(endpoint, sessions, agent)
    (choice,) = reply.choices
    assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content == content
    # Nothing was forced after the generation prompt.
    assert engine.fed[-1] == tokenizer.apply_chat_template(messages, tools=[CALCULATOR_TOOL],
                                                           add_generation_prompt=True)


@pytest.mark.parametrize("choice, forced", [
    ("required", '<tool_call>\n{"name": "'),
    ({"type": "function", "function": {"name": "calculator"}}, '<tool_call>\n{"name": "calculator", "arguments": '),
])
def test_tool_choice_required_or_named_forces_the_call_opening(served, choice, forced):
    """The call's opening is fed after the generation prompt (not sampled: mask 0, log-prob 0,
    version -1), the model continues it, the reply is a call, and the next turn extends the row."""
    endpoint, sessions, engine, tokenizer = served
    question = [{"role": "user", "content": "Say hello."}]  # the script would not call a tool by itself

    async def agent(client):
        first = await client.chat.completions.create(model="m", messages=question, tools=[CALCULATOR_TOOL],
                                                     tool_choice=choice)
        message = first.choices[0].message
        messages = [*question, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}]
        second = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_TOOL])
        return first, second

    (first, second), session = _run(endpoint, sessions, agent, f"forced-{len(forced)}")
    (call_choice,) = first.choices
    assert call_choice.finish_reason == "tool_calls" and call_choice.message.content is None
    (call,) = call_choice.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "7*6"}
    assert second.choices[0].message.content == "It is \\boxed{36} (sample 0)."
    prompt = tokenizer.apply_chat_template(question, tools=[CALCULATOR_TOOL], add_generation_prompt=True)
    opening = tokenizer.encode(forced, add_special_tokens=False)
    first_fed, second_fed = engine.fed[-2], engine.fed[-1]
    assert first_fed == prompt + opening
    (row,) = session.leaves()  # the tool turn continues the forced call's row, token for token
    sampled = row.tokens[len(first_fed):len(first_fed) + int(row.loss_mask[len(first_fed):].argmin())].tolist()
    assert tokenizer.decode(opening + sampled[:-1]) == CALL.replace("12*3", "7*6")
    _assert_two_call_row(row, first_fed, sampled, second_fed)
    assert row.prompt_len == len(first_fed)  # the forced opening is part of the row's prompt


def test_stop_strings_cut_the_reply_at_the_token_that_completes_them(served):
    endpoint, sessions, engine, tokenizer = served

    async def agent(client):
        return await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "STOP"}],
                                                    stop=[" gamma", "zzz"])

    reply, session = _run(endpoint, sessions, agent)
    assert reply.choices[0].message.content == "alpha beta" and reply.choices[0].finish_reason == "stop"
    (row,) = session.leaves()
    kept = row.tokens[len(engine.fed[-1]):].tolist()
    assert " gamma" in tokenizer.decode(kept) and " gamma" not in tokenizer.decode(kept[:-1])
    assert len(kept) == row.loss_mask.sum()


def test_text_completions(served):
    endpoint, sessions, engine, tokenizer = served

    async def agent(client):
        return await client.completions.create(model="m", prompt="say STOP now", max_tokens=3)

    reply, session = _run(endpoint, sessions, agent)
    (choice,) = reply.choices
    assert choice.finish_reason == "length" and engine.fed[-1] == tokenizer.encode("say STOP now")
    assert choice.text == tokenizer.decode(tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)[:3])


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=3.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(tools=[{"type": "function"}]), "tools[0]"),
    (dict(tools=[CALCULATOR_TOOL], tool_choice={"type": "function", "function": {"name": "search"}}), "tool_choice"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "user", "content": "x" * 3000}]), "messages"),
])
def test_bad_requests_are_openai_400s_naming_the_field(served, kwargs, param):
    endpoint, sessions, _, _ = served
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kwargs}

    async def agent(client):
        return await client.chat.completions.create(**request)

    with pytest.raises(openai.BadRequestError) as info:
        _run(endpoint, sessions, agent)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


def test_an_unknown_session_is_a_401(served):
    endpoint, _, _, _ = served

    async def main():
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="nobody", max_retries=0) as client:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

    with pytest.raises(openai.AuthenticationError):
        asyncio.run(main())


def test_llama3_tool_calls_through_the_service(tmp_path):
    """The llama3 family's calls are read in its own format (in process, the same service)."""
    from areal_jax.agents.inprocess import InProcessClient

    tokenizer = tool_tokenizer(tmp_path, "llama3")
    engine = ScriptedEngine(tokenizer, lambda text, i: '{"name": "calculator", "parameters": {"expression": "1+1"}}'
                            if "ipython" not in text else "2")
    service = ChatService(RolloutClient(engine, tokenizer), tokenizer, DEFAULTS)
    assert service.tool_format == "llama3"
    session = Session("llama")
    client = InProcessClient(service, session)

    async def agent():
        messages = [{"role": "user", "content": "1+1?"}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_TOOL])
        messages += [first.choices[0].message, {"role": "tool", "content": "2"}]
        second = await client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR_TOOL])
        return first, second

    first, second = asyncio.run(agent())
    assert first.choices[0].finish_reason == "tool_calls"
    assert json.loads(first.choices[0].message.tool_calls[0].function.arguments) == {"expression": "1+1"}
    assert second.choices[0].message.content == "2"
    (row,) = session.leaves()  # the tool turn extended the row
    call = tokenizer.encode('{"name": "calculator", "parameters": {"expression": "1+1"}}', add_special_tokens=False)
    eot = tokenizer.eos_token_id
    assert engine.fed[-1][:len(engine.fed[-2]) + len(call) + 1] == engine.fed[-2] + call + [eot]
    assert row.tokens.tolist() == engine.fed[-1] + tokenizer.encode("2", add_special_tokens=False) + [eot]
    assert row.loss_mask.sum() == len(call) + 1 + len(tokenizer.encode("2", add_special_tokens=False)) + 1
    assert tokenizer.decode(engine.fed[-1][len(engine.fed[-2]) + len(call) + 1:]) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
