"""The asynchronous RL loop: trainer thread + rollout side, connected by the channel.

Per process (multi-controller): the trainer thread (the caller of `RLLoop.run`) drives the
global train mesh; the rollout side (controller thread + engine thread) drives only this
host's generation mesh. One training step:

    take B oldest groups from the channel -> advantages -> packed minibatches
    -> proximal logprobs (pre-update weights) -> minibatch updates -> version + 1
    -> reshard weights train -> generation mesh -> engine swaps them at its next chunk boundary

The loop composes three parts, each its own module: the cluster (trainer/cluster.py: meshes,
engine, trainer, weight path and rollout side, and their lifetimes), the algorithm step
(trainer/algorithm.py: batch -> advantages -> micro-batches -> `train_step`) and hooks on the step
(trainer/hooks.py: held-out evaluation, rollout dumps, the run's records; checkpoints in
trainer/checkpoint_hook.py), which receive the step's data, not the loop. The step's record is
assembled by trainer/step_metrics.py, stop requests polled by trainer/stopping.py;
jobs/rl_loop_builder.py builds all of it from configs.

Modes: "async" (the paper's system; eta = max_staleness bounds how far generation runs ahead)
and "sync" (the baseline the paper's speedup is measured against): generation waits while
the trainer trains (engine paused) and nothing generated under old weights is trained, which
together with max_staleness = 0 is exactly synchronous RL; with MeshConfig.colocated both
sides use all devices, in turn in "sync" mode and at once in "async" mode (in turn there too with
EngineConfig.weight_swap "evict": the engine drops its weights for each update, RLCluster.begin_update).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from areal_jax.api import Hook, Stage, StepInfo
from areal_jax.models.lora import plain_weights
from areal_jax.models.transformer import Params
from areal_jax.rollout.controller import ShutdownReport
from areal_jax.trainer.algorithm import StepOutput
from areal_jax.trainer.checkpoint_hook import Resume
from areal_jax.trainer.cluster import RLCluster
from areal_jax.trainer.config import RLConfig
from areal_jax.trainer.hooks import Hooks
from areal_jax.trainer.step_metrics import StepMetrics, agent_counters
from areal_jax.trainer.stopping import StopPolling

__all__ = ["LoopResult", "RLLoop"]


@dataclasses.dataclass
class LoopResult:
    steps: int
    version: int
    wall_time_s: float
    trained_tokens: float
    history: list[dict[str, Any]]
    rollout_report: ShutdownReport | None
    final_params: Params


class RLLoop:
    """Runs RLConfig.steps steps of `algorithm` on `cluster`, whose rollout side is connected
    (`RLCluster.connect`), and the step's `hooks`.

    `algorithm(groups, step=, version=)` returns a `trainer.algorithm.StepOutput` (`PPOStep` does).
    `resume`: where a restored run continues (`CheckpointHook.restore`); None: from step 0.
    `should_stop`: a stop request, polled between steps and while waiting for a batch; the loop
    then returns early and its "end" hooks see `info.stopped`.
    """

    def __init__(self, cluster: RLCluster, algorithm: Callable[..., StepOutput], *, rl: RLConfig,
                 hooks: Sequence[Hook] = (), resume: Resume | None = None,
                 should_stop: Callable[[], bool] | None = None):
        self.cluster, self.algorithm, self.rl = cluster, algorithm, rl
        self.hooks = Hooks(hooks)
        self.resume = resume
        self.first_step = resume.step if resume is not None else 0
        self.trained_tokens = resume.trained_tokens if resume is not None else 0.0  # resumes included
        # Cumulative counts of what was trained (StepInfo.counters), resumes included.
        self.counters: dict[str, int] = dict(resume.counters) if resume is not None else {}
        self._run_tokens = 0.0  # by this process since it started
        self.stop = StopPolling(should_stop)
        self.metrics = StepMetrics(cluster)
        self._last_applied = None

    def add_hook(self, fn: Callable[[StepInfo], None], *, stage: Stage = "record", every: int = 1) -> None:
        """Runs `fn(StepInfo)` after each step whose index + 1 is a multiple of `every`, at `stage`
        (trainer/hooks.py), after the hooks added before it."""
        self.hooks.add(Hook(fn, stage=stage, every=every))

    def close(self) -> None:
        """After `run`: drops the engine (KV cache, served weights), the rollout side and the
        trainer (optimizer state), and the hooks that hold them, freeing both sides' devices for
        evaluation and saving; the final weights live on in `LoopResult.final_params`."""
        self.cluster.close()
        self.algorithm = self.hooks = None

    def run(self) -> LoopResult:
        cluster = self.cluster
        if cluster.controller is None:
            raise ValueError("RLLoop.run: the cluster's rollout side is not connected (RLCluster.connect)")
        history: list[dict[str, Any]] = []
        last = StepInfo(self.first_step - 1, cluster.version, (), {}, self.trained_tokens, last=False,
                        counters=dict(self.counters))
        report = None
        cluster.start()
        t_start = time.perf_counter()
        try:
            for step in range(self.first_step, self.rl.steps):
                if self.stop.between_steps():
                    break
                taken = cluster.take_batch(self.rl.batch_timeout_s, give_up=self.stop.while_waiting)
                if taken is None:  # stopped while waiting for the batch: nothing of this step happened
                    break
                last = self._step(step, *taken, t_start=t_start)
                history.append(last.metrics)
            if not self.stop.stopped and self._last_applied is not None:  # the generator ends on the final weights
                self._last_applied.result(timeout=self.rl.batch_timeout_s)
        finally:
            try:  # a stop's checkpoint, saves in flight completed
                self.hooks.run("end", dataclasses.replace(last, stopped=self.stop.stopped))
            finally:
                report = cluster.shutdown(timeout=30.0)
        return LoopResult(steps=len(history), version=cluster.version, wall_time_s=time.perf_counter() - t_start,
                          trained_tokens=self._run_tokens, history=history, rollout_report=report,
                          final_params=plain_weights(cluster.trainer.params))

    def _step(self, step: int, groups: list, wait_s: float, *, t_start: float) -> StepInfo:
        """One step on `groups`: the update, its hooks at "update", the weights to the generator,
        the record, its hooks at "metrics" and "record"."""
        cluster = self.cluster
        if self.rl.mode == "sync":
            cluster.engine.pause()
        cluster.begin_update()
        out = self.algorithm(groups, step=step, version=cluster.version)
        cluster.version += 1
        tokens = float(out.train.get("trained_tokens", 0.0))
        self.trained_tokens += tokens
        self._run_tokens += tokens
        for name, count in agent_counters(groups).items():
            self.counters[name] = self.counters.get(name, 0) + count
        info = StepInfo(step, cluster.version, tuple(groups), {}, self.trained_tokens, last=step == self.rl.steps - 1,
                        counters=dict(self.counters))
        # Before the new weights reach the generator: a checkpoint's resume point (in "sync" mode
        # nothing is in flight or queued here, so the data position is exactly what the trained
        # steps consumed).
        self.hooks.run("update", info)
        t0 = time.perf_counter()
        applied = self._last_applied = cluster.push_weights(cluster.version)
        transfer_s = time.perf_counter() - t0
        if self.rl.mode == "sync":
            cluster.engine.resume()
            applied.result()  # nothing generates on stale weights in the synchronous baseline
        cluster.controller.notify()
        metrics = self.metrics(step, groups, out, wait_s=wait_s, transfer_s=transfer_s)
        wall_s = time.perf_counter() - t_start
        metrics.update({"time/wall_s": wall_s, "train/trained_tokens_total": self.trained_tokens,
                        "throughput/trained_tokens_per_s": self._run_tokens / wall_s,
                        **{f"{name}_total": count for name, count in self.counters.items()}})
        info = dataclasses.replace(info, metrics=metrics)
        self.hooks.run("metrics", info)  # rollout dumps, held-out evaluation
        # The step's records, then (a checkpoint never holds a step its records lack: a resumed
        # run drops records past its checkpoint, so each step is recorded once) its save.
        self.hooks.run("record", info)
        return info
