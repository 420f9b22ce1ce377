"""docs/user_guide.md "Train your agent" as written: the guide's openai-SDK agent trains through a
real `areal-jax train` process over HTTP, and the rollout dumps show each row's tokens, loss mask,
versions and its session's messages."""

import asyncio
import json
import types

import pytest

from areal_jax.metrics import read_jsonl
from tests.test_user_code import areal_jax, guide_example, train_args

pytest.importorskip("openai")  # the [agents] extra


def test_the_guides_agent_runs_its_tool(tmp_path, monkeypatch):
    """The agent itself, on a client whose replies are fixed: it calls the tool, then scores."""
    (tmp_path / "my_agent.py").write_text(guide_example("my_agent.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_agent import solve

    def reply(message):
        return types.SimpleNamespace(choices=[types.SimpleNamespace(message=message)])

    call = types.SimpleNamespace(id="c1", function=types.SimpleNamespace(
        name="calculator", arguments=json.dumps({"expression": "1234 + 8766"})))
    seen = []

    class Completions:
        async def create(self, **kwargs):
            seen.append(kwargs["messages"])
            if len(seen) == 1:
                return reply(types.SimpleNamespace(content=None, tool_calls=[call]))
            return reply(types.SimpleNamespace(content="\\boxed{10000}", tool_calls=None))

    client = types.SimpleNamespace(chat=types.SimpleNamespace(completions=Completions()))
    row = types.SimpleNamespace(messages=[{"role": "user", "content": "Compute 1234+8766."}], answer="10000")
    assert asyncio.run(solve(client, row)) == 1.0
    assert seen[1][-1] == {"role": "tool", "tool_call_id": "c1", "content": "10000"}


@pytest.mark.slow  # a whole `areal-jax train` process: about a minute on 2 cores
def test_the_guides_agent_trains_through_the_endpoint(tmp_path):
    (tmp_path / "my_agent.py").write_text(guide_example("my_agent.py"))
    run = tmp_path / "run"
    done = areal_jax(*train_args(run, "RLConfig.workflow = 'areal_jax.workflows.agent:AgentWorkflow'",
                                 "AgentConfig.agent = 'my_agent:solve'", "RLConfig.dump_rollouts_every = 1",
                                 "TrainEngineConfig.max_tokens_per_microbatch = 256", "EngineConfig.max_seq_len = 256"),
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:  # the sessions behind each step: 2 groups x 2, each 1 to 3 calls
        m = r["metrics"]
        assert m["agent/sessions"] == 4 and 1 <= m["agent/calls_mean"] <= 3
        assert m["agent/failed_sessions"] + m["agent/timed_out_sessions"] <= 4
    for step in (0, 1):
        dumped = read_jsonl(run / "rollouts" / f"step_{step}.jsonl")
        assert len(dumped) >= 2 * 2  # groups x sessions, at least one row each
        for d in dumped:
            # The session's first call: the row's question with the tools, rendered by the template.
            first = d["messages"][0]
            assert first["messages"][-1]["content"].startswith("Compute ") and "reply" in first
            assert d["prompt"].startswith("<|system|>Tools: calculator(expression)<|end|><|user|>Compute ")
            mask, versions = d["loss_mask"], d["versions"]
            assert len(mask) == len(versions) == len(d["completion_tokens"]) and mask[0] == 1
            assert all((m == 0) == (v == -1) for m, v in zip(mask, versions))
            assert all(v in (step, step - 1, step + 1) for v, m in zip(versions, mask) if m)
