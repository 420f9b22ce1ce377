"""jobs/rl_loop_builder.py: the native loop from configs, its standard hooks in their order, and a
resume through the checkpoint hook's restore; the loop itself takes a handful of parts."""

import inspect
import itertools

import jax

from areal_jax.checkpoint import CheckpointConfig, Checkpointer
from areal_jax.parallel import MeshConfig
from areal_jax.trainer.config import RLConfig
from areal_jax.api import Hook
from areal_jax.trainer.loop import RLLoop
from tests.test_rl_loop import make_loop, rows, tokenizer  # noqa: F401 - tokenizer is a fixture


def test_the_loop_composes_a_few_parts():
    params = [p for p in inspect.signature(RLLoop.__init__).parameters if p != "self"]
    assert params == ["cluster", "algorithm", "rl", "hooks", "resume", "should_stop"]


def test_builder_wires_records_dumps_evaluation_and_checkpoints_then_resumes(tokenizer, tmp_path):
    rl = RLConfig(steps=2, batch_size=2, max_staleness=0, max_concurrent=4, mode="sync", eval_every=2,
                  dump_rollouts_every=2, eval_max_new_tokens=4)
    events = []
    held_out = list(itertools.islice(rows(tokenizer, offset=500), 3))

    def build(**kw):
        return make_loop(tokenizer, rl=rl, mesh=MeshConfig(colocated=True), devices=jax.devices()[:1],
                         eval_rows=held_out, checkpointer=Checkpointer(CheckpointConfig(tmp_path / "ck")), **kw)

    loop = build(on_step=lambda step, m: events.append(("record", step, "eval/accuracy" in m)),
                 on_rollouts=lambda step, records: events.append(("dump", step, len(records))),
                 hooks=[Hook(lambda info: events.append(("user", info.step, info.version)), stage="record"),
                        Hook(lambda info: events.append(("end", info.step, info.stopped)), stage="end")])
    assert loop.first_step == 0 and loop.resume is None
    result = loop.run()
    # Dumps every 2nd step, at "metrics" before the record; held-out accuracy at the last step only
    # (eval_every = 2); the builder's hooks before the user's; "end" once.
    assert events == [("record", 0, False), ("user", 0, 1),
                      ("dump", 1, 2 * 4), ("record", 1, True), ("user", 1, 2), ("end", 1, False)]
    assert 0.0 <= result.history[-1]["eval/accuracy"] <= 1.0
    checkpointer = Checkpointer(CheckpointConfig(tmp_path / "ck"))
    assert checkpointer.latest_step() == 2  # the last step is always saved
    loop.close()

    # Resumed: the checkpoint hook's restore puts the trainer and cluster at version 2; nothing is left to run.
    resumed = build(resume=True)
    assert resumed.first_step == 2 and resumed.resume.version == 2 and resumed.cluster.version == 2
    assert resumed.resume.report() == {"step": 2, "version": 2, "lost_groups": 0,
                                       "capacity": resumed.cluster.staleness.capacity(2)}
    assert resumed.run().steps == 0

