"""The agent workflow over the real engine: token-exact rows (the trained row is what the engine
was fed and sampled), masks and versions across a weight swap in the middle of a turn, sessions
that fail or time out, the environment interface, and the HTTP transport."""

from __future__ import annotations

import asyncio
import pathlib
import threading
import time

import jax
import numpy as np
import pytest

from areal_jax.agents.environment import ArithmeticEnv, Environment, environment_agent
from areal_jax.agents.tools import CALCULATOR_TOOL, ToolBox, calculate
from areal_jax.generation import EngineConfig, GenerationEngine
from areal_jax.models import init_params
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.rollout.workflow import RLVRConfig, RolloutClient
from areal_jax.tasks import arithmetic as ar
from areal_jax.tasks.tokenizer_builder import build_tokenizer, task_model_config
from areal_jax.workflows.agent import AgentConfig, AgentWorkflow
from tests.agent_fixtures import ScriptedEngine

HERE = "tests.test_agent_workflow"
CFG = task_model_config(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                        max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def _row(tokenizer, expression="12+30"):
    problem = ar.make_problem(expression)
    return {"prompt_ids": ar.prompt_ids(tokenizer, problem), "row": problem.prompt_row()}


class RecordingClient(RolloutClient):
    """The native client, keeping every (prompt fed, result) pair."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    async def generate(self, prompt_ids, sampling, n=1, *, seed=None):
        result = await super().generate(prompt_ids, sampling, n, seed=seed)
        self.calls.append(([int(t) for t in prompt_ids], result))
        return result


async def three_turn_agent(client, row) -> float:
    """Asks, gets a tool result back, asks again, then a user turn: three calls, one row (the tool
    specs are left out of the prompt to keep it short; tool turns render all the same)."""
    messages = list(row.messages)
    for turn in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        messages.append(reply.choices[0].message)
        messages.append({"role": "tool", "content": calculate("6*7")} if turn == 0 else
                        {"role": "user", "content": "Again."})
    return 1.0


async def two_turn_agent(client, row) -> float:
    messages = list(row.messages)
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
        messages += [reply.choices[0].message, {"role": "user", "content": "Again."}]
    return 1.0


NAMED = {"type": "function", "function": {"name": "calculator"}}


async def forced_call_agent(client, row) -> float:
    """Two calls whose replies open as calls: a named function, then any function ("required")."""
    messages = list(row.messages)
    for choice in (NAMED, "required"):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3,
                                                     tools=[CALCULATOR_TOOL], tool_choice=choice)
        messages += [reply.choices[0].message, {"role": "user", "content": "Go."}]  # short: 128 positions
    return 1.0


def _workflow(tokenizer, agent, **config):
    rollout = RLVRConfig(n_samples=config.pop("n_samples", 2), max_new_tokens=8, temperature=1.0)
    return AgentWorkflow(rollout, tokenizer, AgentConfig(agent=f"{HERE}:{agent}", **config))


@pytest.fixture(scope="module")
def engine():
    """One tiny engine for the module (its programs compile once), stepped by the tests' driver."""
    params = init_params(CFG, jax.random.key(0), std=0.3)
    return GenerationEngine((CFG, params), EngineConfig(num_slots=4, max_seq_len=128, decode_chunk=2,
                                                        prefill_buckets=(128,)))


def _drive(engine, run, on_first_request=None):
    """`run()` on a thread while this thread steps `engine`; `on_first_request()` once the first
    request is queued. Returns what `run` returned."""
    out = {}
    runner = threading.Thread(target=lambda: out.update(result=run()))
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while not engine.has_work():
            assert runner.is_alive() and time.monotonic() < deadline
            time.sleep(0.005)
        if on_first_request is not None:
            on_first_request()
        while runner.is_alive():
            engine.run_until_idle()
            time.sleep(0.002)
    finally:
        runner.join(60)
    return out["result"]


def test_trained_rows_are_what_the_engine_was_fed_and_sampled(tokenizer, engine):
    client = RecordingClient(engine, tokenizer)
    workflow = _workflow(tokenizer, "three_turn_agent", transport="inprocess", turn_discount=0.5)
    version = engine.version
    try:
        group = _drive(engine, lambda: asyncio.run(workflow.arun(client, _row(tokenizer), version=0)))
    finally:
        client.close()
    assert len(group.trajectories) == 2 and group.info["turns"] == [3, 3] and group.info["session_of"] == [0, 1]
    for t in group.trajectories:
        assert t.reward == 0.25  # 1.0 * 0.5 ** (3 calls - 1)
        # The session's three calls: find them by the prompt they share with this row.
        row = np.concatenate([t.prompt_ids, t.completion_ids]).tolist()
        calls = [(fed, c) for fed, result in client.calls for c in result.completions
                 if row[:len(fed) + len(c.tokens)] == fed + c.tokens.tolist()]
        assert len(calls) == 3
        (last_fed, last), mask, logprobs = calls[-1], np.zeros(len(row)), np.zeros(len(row))
        assert row == last_fed + last.tokens.tolist()  # the row ends with the last call, exactly
        for fed, c in calls:  # each call's prompt extends the previous call's prompt and sample
            mask[len(fed):len(fed) + len(c.tokens)] = 1
            logprobs[len(fed):len(fed) + len(c.tokens)] = c.logprobs
        p = len(t.prompt_ids)
        assert p == len(calls[0][0])
        np.testing.assert_array_equal(t.loss_mask, mask[p:])
        np.testing.assert_allclose(t.behavior_logprobs, logprobs[p:])
        np.testing.assert_array_equal(t.versions, np.where(mask[p:] > 0, version, -1))
        # The trainer's row (input ids, targets shifted by one) is that same sequence.
        training = t.training_row()
        assert training["input_ids"].tolist() == row and training["loss_mask"].sum() == mask.sum()
    # The session's messages ride along for the rollout dumps.
    assert group.info["messages"][0][1]["messages"][-1] == {"role": "tool", "content": "42"}


def test_forced_call_openings_are_fed_not_sampled_in_the_trained_row(tokenizer, engine):
    """tool_choice "required" / a named function: the call's opening is fed after the generation
    prompt, and the trained row still equals what the engine was fed and sampled, the forced tokens
    with loss mask 0, behaviour log-prob 0 and version -1."""
    client = RecordingClient(engine, tokenizer)
    workflow = _workflow(tokenizer, "forced_call_agent", transport="inprocess", n_samples=1)
    try:
        group = _drive(engine, lambda: asyncio.run(workflow.arun(client, _row(tokenizer), version=0)))
    finally:
        client.close()
    (t,) = group.trajectories  # the second call continues the first: one row
    row = np.concatenate([t.prompt_ids, t.completion_ids]).tolist()
    (first_fed, first), (last_fed, last) = [(fed, result.completions[0]) for fed, result in client.calls]
    assert row == last_fed + last.tokens.tolist()
    assert row[:len(first_fed) + len(first.tokens)] == first_fed + first.tokens.tolist()
    for fed, forced in ((first_fed, '<tool_call>{"name": "calculator", "arguments": '),
                        (last_fed, '<tool_call>{"name": "')):
        opening = tokenizer.encode(forced, add_special_tokens=False)
        assert fed[-len(opening):] == opening  # fed right after the generation prompt
    mask = np.zeros(len(row))
    mask[len(first_fed):len(first_fed) + len(first.tokens)] = 1
    mask[len(last_fed):] = 1
    p = len(first_fed)  # the first forced opening belongs to the row's prompt
    assert len(t.prompt_ids) == p
    np.testing.assert_array_equal(t.loss_mask, mask[p:])
    np.testing.assert_array_equal(t.versions, np.where(mask[p:] > 0, engine.version, -1))
    logprobs = np.zeros(len(row))
    logprobs[len(first_fed):len(first_fed) + len(first.tokens)] = first.logprobs
    logprobs[len(last_fed):] = last.logprobs
    np.testing.assert_allclose(t.behavior_logprobs, logprobs[p:])
    assert t.training_row()["input_ids"].tolist() == row


def test_masks_and_versions_across_a_weight_swap_in_the_middle_of_a_turn(tokenizer, engine):
    """Two decode chunks into the first turn the weights change."""
    client = RolloutClient(engine, tokenizer)
    workflow = _workflow(tokenizer, "two_turn_agent", transport="inprocess", n_samples=1)
    old, new = engine.version, engine.version + 7

    def swap():
        engine.step()
        engine.step()
        engine.update_weights(init_params(CFG, jax.random.key(2), std=0.3), version=new)

    try:
        group = _drive(engine, lambda: asyncio.run(workflow.arun(client, _row(tokenizer), version=old)), swap)
    finally:
        client.close()
    (t,) = group.trajectories
    sampled = t.loss_mask > 0
    assert (t.versions[~sampled] == -1).all() and (t.behavior_logprobs[~sampled] == 0).all()
    versions = t.versions[sampled]
    assert set(versions.tolist()) == {old, new} and (np.diff(versions) >= 0).all()  # switched once, never back
    # The first turn itself holds both versions: the swap landed inside it.
    first_turn = t.versions[:np.flatnonzero(~sampled)[0]]
    assert set(first_turn.tolist()) == {old, new}


async def failing_agent(client, row) -> float:
    await client.chat.completions.create(model="policy", messages=list(row.messages), max_tokens=4)
    raise RuntimeError("the agent broke")


async def slow_agent(client, row) -> float:
    await client.chat.completions.create(model="policy", messages=list(row.messages), max_tokens=4)
    await asyncio.sleep(30)
    return 1.0


async def wrong_type_agent(client, row):
    return "1.0"


@pytest.mark.parametrize("agent, outcome", [("failing_agent", "failed_sessions"),
                                            ("slow_agent", "timed_out_sessions"),
                                            ("wrong_type_agent", "failed_sessions")])
def test_a_session_that_raises_or_times_out_scores_zero_and_is_counted(tokenizer, agent, outcome):
    engine = ScriptedEngine(tokenizer, lambda text, i: "7")
    workflow = _workflow(tokenizer, agent, transport="inprocess", timeout_s=0.5)
    group = asyncio.run(workflow.arun(RolloutClient(engine, tokenizer), _row(tokenizer), version=3))
    if agent == "wrong_type_agent":
        assert group is None  # no call, nothing to train
    else:  # what was sampled before the failure is trained, with reward 0
        assert len(group.trajectories) == 2 and all(t.reward == 0.0 for t in group.trajectories)
        assert group.info[outcome] == 2
    assert workflow.counts[outcome] == 2 and workflow.counts["sessions"] == 2


def test_config_is_checked():
    with pytest.raises(ValueError, match="AgentConfig.agent"):
        AgentConfig(agent="no_colon")
    with pytest.raises(ValueError, match="AgentConfig.transport"):
        AgentConfig(agent="a:b", transport="grpc")
    with pytest.raises(ValueError, match="AgentConfig.turn_discount"):
        AgentConfig(agent="a:b", turn_discount=0)
    with pytest.raises(ValueError, match="AgentConfig.agent = 'tests.test_agent_workflow:nothing'"):
        _workflow(None or Tokenizer, "nothing")
    with pytest.raises(ValueError, match="not an `async def"):
        _workflow(Tokenizer, "_row")


# ---- environments ------------------------------------------------------------------------------------

env_agent = environment_agent(lambda: ArithmeticEnv(max_steps=3), max_tokens=16)


def test_arithmetic_env_steps():
    env = ArithmeticEnv(max_steps=2)
    assert isinstance(env, Environment)
    problem = ar.make_problem("2+3")
    assert env.reset(problem.prompt_row()) == problem.prompt_row().messages[-1]["content"]
    assert env.step("I think \\boxed{6}") == ("Wrong. Check the arithmetic and answer in \\boxed{}.", 0.0, False)
    assert env.step("so \\boxed{4} no \\boxed{5}") == ("Correct.", 1.0, True)
    env.reset(problem.prompt_row())
    assert env.step("x")[2] is False and env.step("y")[2] is True  # out of steps


def test_an_environment_drives_a_session_through_the_endpoint(tokenizer):
    """Wrong, then right: reward 1, one row whose observation turn is masked out."""
    engine = ScriptedEngine(tokenizer, lambda text, i: "\\boxed{42}" if "Wrong" in text else "\\boxed{41}")
    workflow = _workflow(tokenizer, "env_agent", transport="inprocess", n_samples=1)
    group = asyncio.run(workflow.arun(RolloutClient(engine, tokenizer), _row(tokenizer), version=0))
    (t,) = group.trajectories
    assert t.reward == 1.0 and group.info["turns"] == [2]
    observation = tokenizer.encode("<|user|>Wrong. Check the arithmetic and answer in \\boxed{}.<|end|><|assistant|>",
                                   add_special_tokens=False)
    assert t.loss_mask.tolist() == [1] * 6 + [0] * len(observation) + [1] * 6  # \\boxed { 4 1 } <|end|>
    assert t.completion_ids[6:6 + len(observation)].tolist() == observation


# ---- the HTTP transport --------------------------------------------------------------------------------

async def tool_using_agent(client, row) -> float:
    """The calculator example's shape: call the tool, read its result, answer."""
    tools = ToolBox.calculator()
    messages = list(row.messages)
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools.specs,
                                                     max_tokens=128)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return float(message.content == "\\boxed{42}")
        messages += await tools.run(message)
    return 0.0


def test_http_sessions_use_the_tool_and_the_endpoint_stops_with_the_workflow(tokenizer):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+30"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, lambda text, i: "\\boxed{42}" if "<tool_response>42" in text else call)
    workflow = _workflow(tokenizer, "tool_using_agent", transport="http", n_samples=3)
    client = RolloutClient(engine, tokenizer)
    try:
        group = asyncio.run(workflow.arun(client, _row(tokenizer), version=0))
        url = workflow.endpoint.base_url
    finally:
        workflow.close()
        client.close()
    assert [t.reward for t in group.trajectories] == [1.0] * 3 and group.info["turns"] == [2] * 3
    assert workflow.endpoint is None and len(workflow.sessions) == 0
    import httpx

    with pytest.raises(httpx.ConnectError):  # the port is released
        httpx.get(url + "/models", timeout=2)


class AbortingEngine(ScriptedEngine):
    """Every sample comes back 'aborted', as when the run stops mid-generation."""

    def submit(self, prompt_ids, sampling, n=1, *, seed=None):
        import dataclasses

        future = super().submit(prompt_ids, sampling, n, seed=seed)
        result = future.result()
        aborted = type(future)()
        aborted.request_id = future.request_id
        aborted.set_result(dataclasses.replace(result, completions=[
            dataclasses.replace(c, stop_reason="aborted") for c in result.completions]))
        return aborted


def test_an_aborted_generation_fails_the_group_as_for_single_turn_samples(tokenizer):
    from areal_jax.rollout.workflow import GenerationAborted

    engine = AbortingEngine(tokenizer, lambda text, i: "7")
    workflow = _workflow(tokenizer, "failing_agent", transport="inprocess")
    with pytest.raises(GenerationAborted, match="aborted"):
        asyncio.run(workflow.arun(RolloutClient(engine, tokenizer), _row(tokenizer), version=0))


@pytest.mark.slow  # minutes on 2 cores: two jax.distributed processes compiling trainer and engine
def test_two_processes_train_agents_each_through_its_own_endpoint(tmp_path):
    """2 processes x 4 fake CPU devices over real jax.distributed, the agent workflow over HTTP."""
    from tests.multiprocess import run_processes
    from tests.tokenizer_fixtures import build_tiny_tokenizer

    tok_dir = build_tiny_tokenizer(tmp_path / "tok", "chatml")
    worker = pathlib.Path(__file__).parent / "multiprocess_agent_worker.py"
    a, b = run_processes(worker, lambda i: ("2", tok_dir, tmp_path), tmp_path, timeout=600)
    assert a["versions"] == b["versions"] == [1, 2] and a["engine_version"] == b["engine_version"] == 2
    for r in (a, b):  # each step: its 2 groups (of 4 across the processes) x 2 sessions, 2 calls each
        assert r["sessions"] == [4, 4] and r["calls_mean"] == [2.0, 2.0] and r["failed"] == [0, 0]
        assert r["served"] and r["endpoint_stopped"]  # the controller's shutdown stopped the endpoint
        assert all(np.isfinite(r["loss"]))
