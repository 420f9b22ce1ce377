"""Exact resume of an agent run: the run's cumulative agent counters (sessions, failed and timed-out
sessions, model calls) after a stop and --resume equal an uninterrupted run's at every step."""

import jax

from areal_jax.checkpoint import CheckpointConfig, Checkpointer
from areal_jax.parallel import MeshConfig
from areal_jax.rollout.workflow import RLVRConfig
from areal_jax.trainer.config import RLConfig
from areal_jax.workflows.agent import AgentConfig, AgentWorkflow
from tests.test_rl_loop import make_loop, rows, tokenizer  # noqa: F401 - tokenizer is a fixture

TOTALS = ("agent/sessions_total", "agent/failed_sessions_total", "agent/timed_out_sessions_total",
          "agent/calls_total")
STEPS = 3


async def uneven_agent(client, row) -> float:
    """1 or 2 calls by the row, and a failure on every third row: each counter moves differently."""
    index = int(row.query_id[1:])
    messages = list(row.messages)
    for _ in range(1 + index % 2):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages += [reply.choices[0].message, {"role": "user", "content": "Again."}]
    if index % 3 == 0:
        raise RuntimeError("this row's session fails")
    return float(len(reply.choices[0].message.content or "") % 2)


class Rows:
    """tests.test_rl_loop's rows with a position a checkpoint saves (so the resumed run reads on)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.index = tokenizer, 0

    def __iter__(self):
        return self

    def __next__(self):
        row = next(rows(self.tokenizer, offset=self.index))
        self.index += 1
        return row

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = int(state["index"])


def _loop(tokenizer, checkpoints, *, steps_before_stop=None, resume=False):
    workflow = AgentWorkflow(RLVRConfig(n_samples=2, max_new_tokens=4, temperature=1.0), tokenizer,
                             AgentConfig(agent="tests.test_agent_resume:uneven_agent", transport="inprocess"))
    rl = RLConfig(steps=STEPS, batch_size=2, max_staleness=0, max_concurrent=4, mode="sync", eval_every=0)
    records: list[dict] = []
    stop = None if steps_before_stop is None else (lambda: len(records) >= steps_before_stop)
    loop = make_loop(tokenizer, rl=rl, mesh=MeshConfig(colocated=True), devices=jax.devices()[:1],
                     workflow=workflow, data=Rows(tokenizer), max_seq_len=128, resume=resume, should_stop=stop,
                     on_step=lambda step, m: records.append(m),
                     checkpointer=Checkpointer(CheckpointConfig(checkpoints, save_interval_steps=1)))
    return loop, records


def _totals(records):
    return {m["step"]: {k: m[k] for k in TOTALS} for m in records}


def test_resumed_agent_run_counts_as_an_uninterrupted_one(tokenizer, tmp_path):
    # Uninterrupted, sync mode reads rows q0, q1, ... two a step (2 sessions each): q0 and q3 fail,
    # odd rows make 2 calls. The stopped run's first two steps are that run's.
    want = {0: (4, 2, 6), 1: (8, 4, 12), 2: (12, 4, 18)}
    want = {step: dict(zip(TOTALS, (s, f, 0, c))) for step, (s, f, c) in want.items()}
    stopped, first = _loop(tokenizer, tmp_path, steps_before_stop=2)
    stopped.run()
    stopped.close()
    assert [m["step"] for m in first] == [0, 1]
    resumed, second = _loop(tokenizer, tmp_path, resume=True)
    assert resumed.first_step == 2
    assert {f"{k}_total": v for k, v in resumed.resume.counters.items()} == want[1]
    resumed.run()
    resumed.close()
    assert [m["step"] for m in second] == [2]
    assert _totals(first + second) == want
