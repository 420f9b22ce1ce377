"""The asynchronous RL loop: trainer thread + rollout side, connected by the channel.

Per process (multi-controller): the trainer thread (the caller of `RLLoop.run`) drives the
global train mesh; the rollout side (controller thread + engine thread) drives only this
host's generation mesh. One training step:

    take B oldest groups from the channel -> advantages -> packed minibatches
    -> proximal logprobs (pre-update weights) -> minibatch updates -> version + 1
    -> reshard weights train -> generation mesh -> engine swaps them at its next chunk boundary

Three parts, each its own module: the cluster (trainer/cluster.py: meshes, engine, trainer,
weight path and rollout side, and their lifetimes), the algorithm step (trainer/algorithm.py:
batch -> advantages -> micro-batches -> `train_step`) and hooks on the step (trainer/hooks.py:
checkpoints, held-out evaluation, rollout dumps, the run's records). This module is the loop
that drives them.

Modes: "async" (the paper's system; eta = max_staleness bounds how far generation runs ahead)
and "sync" (the baseline the paper's speedup is measured against): generation waits while
the trainer trains (engine paused) and nothing generated under old weights is trained, which
together with max_staleness = 0 is exactly synchronous RL; with MeshConfig.colocated both
sides use all devices, in turn in "sync" mode and at once in "async" mode.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from areal_jax import api
from areal_jax.checkpoint import Checkpointer
from areal_jax.data.examples import prompt_example
from areal_jax.evaluation.held_out import greedy_correct
from areal_jax.generation.config import EngineConfig
from areal_jax.generation.timings import timings_delta
from areal_jax.metrics import batch_metrics
from areal_jax.models import lora as lora_lib
from areal_jax.models.config import ModelConfig
from areal_jax.models.lora import LoRAConfig
from areal_jax.models.transformer import Params
from areal_jax.parallel.adapter_sync import AdapterSync
from areal_jax.parallel.distributed import agree_max, agree_sum
from areal_jax.parallel.meshes import MeshConfig, Meshes
from areal_jax.parallel.weight_sync import WeightSync
from areal_jax.ppo.advantages import AdvantageConfig
from areal_jax.reward.scoring import RewardScorer
from areal_jax.rollout.controller import ShutdownReport
from areal_jax.api import TrajectoryGroup
from areal_jax.rollout.workflow import RLVRConfig, RLVRWorkflow
from areal_jax.trainer.algorithm import PPOStep
from areal_jax.trainer.cluster import RLCluster, generation_weight_sync
from areal_jax.trainer.config import OptimizerConfig, PPOConfig, RLConfig
from areal_jax.trainer.hooks import STAGES, CheckpointHook, StepInfo, evaluation_hook
from areal_jax.trainer.reference import ReferencePolicy

logger = logging.getLogger(__name__)

__all__ = ["LoopResult", "RLLoop", "generation_weight_sync"]


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
    """Drives an `RLCluster` with an algorithm step (`PPOStep`) and runs the step's hooks.

    The constructor builds the native cluster and the standard hooks from configs (the job's
    way in); `RLLoop.from_parts` takes a cluster and step made elsewhere (any `api.TrainEngine`
    and `api.InferenceEngine`). `params`: the initial weights (any placement; the trainer keeps its
    own fp32 copy on the train mesh). With `donate_params` their buffers are deleted once the
    trainer holds its copy, so no initial copy stays on the devices whatever references the caller
    keeps (use them no more). `weight_sync`: a `generation_weight_sync` of the same meshes to reuse
    (its programs compiled). `eval_rows`: held-out loader rows (`data.examples.prompt_example`).
    `on_step(step, metrics)` and `on_rollouts(step, records)` (every
    RLConfig.dump_rollouts_every steps) are read when each step runs, so they may be set later.
    """

    def __init__(self, model_cfg: ModelConfig, params: Params, *, tokenizer: Any, data_iter: Iterator[Any],
                 rl: RLConfig, ppo: PPOConfig, optimizer: OptimizerConfig, advantages: AdvantageConfig,
                 workflow: RLVRConfig | Any, engine: EngineConfig, mesh: MeshConfig = MeshConfig(),
                 eval_rows: Sequence[Any] = (), reward_pool: Any = None,
                 on_step: Callable[[int, dict[str, Any]], None] | None = None,
                 devices: Sequence[jax.Device] | None = None, start_version: int = 0,
                 checkpointer: Checkpointer | None = None, resume: bool = False,
                 checkpoint_extra: Callable[[], dict[str, Any]] | None = None,
                 on_rollouts: Callable[[int, list[dict[str, Any]]], None] | None = None,
                 on_export: Callable[[Any], None] | None = None,
                 donate_params: bool = False, weight_sync: WeightSync | AdapterSync | None = None,
                 should_stop: Callable[[], bool] | None = None, lora: LoRAConfig = LoRAConfig()):
        ppo = _sampling_temperature(workflow, ppo)
        cluster = RLCluster.build(model_cfg, params, rl=rl, ppo=ppo, optimizer=optimizer, engine=engine, mesh=mesh,
                                  devices=devices, start_version=start_version, donate_params=donate_params,
                                  weight_sync=weight_sync, lora=lora)
        del params  # the trainer holds its own copy: nothing below may keep the initial one alive
        # A frozen copy of the initial policy, only when the KL penalty needs it (it costs a copy).
        reference = ReferencePolicy(cluster.trainer) if advantages.kl_coef > 0 else None
        algorithm = PPOStep(cluster.trainer, advantages, reference=reference, rows_per_process=cluster.rows_per_process)
        self._init(cluster, algorithm, rl=rl, workflow=workflow, data_iter=data_iter, tokenizer=tokenizer,
                   model_config=model_cfg, eval_rows=eval_rows, reward_pool=reward_pool, start_version=start_version,
                   should_stop=should_stop)
        self.advantages = advantages
        self.on_step, self.on_rollouts = on_step, on_rollouts
        if checkpointer is not None:
            self.use_checkpoints(CheckpointHook(checkpointer, extra=checkpoint_extra, on_export=on_export,
                                                always_point=should_stop is not None), resume=resume)

    @classmethod
    def from_parts(cls, cluster: RLCluster, algorithm: Any, *, rl: RLConfig, workflow: api.RolloutWorkflow | RLVRConfig,
                   data_iter: Iterator[Any], tokenizer: Any, model_config: Any = None, eval_rows: Sequence[Any] = (),
                   reward_pool: Any = None, start_version: int = 0,
                   should_stop: Callable[[], bool] | None = None) -> RLLoop:
        """A loop over a cluster and an algorithm step built elsewhere; `algorithm(groups, step=,
        version=)` returns a `trainer.algorithm.StepOutput` (PPOStep does). Add checkpoints with
        `use_checkpoints` and more hooks with `add_hook`."""
        loop = cls.__new__(cls)
        loop._init(cluster, algorithm, rl=rl, workflow=workflow, data_iter=data_iter, tokenizer=tokenizer,
                   model_config=model_config, eval_rows=eval_rows, reward_pool=reward_pool,
                   start_version=start_version, should_stop=should_stop)
        return loop

    def _init(self, cluster: RLCluster, algorithm: Any, *, rl: RLConfig, workflow: Any, data_iter: Iterator[Any],
              tokenizer: Any, model_config: Any, eval_rows: Sequence[Any], reward_pool: Any, start_version: int,
              should_stop: Callable[[], bool] | None) -> None:
        self.cluster, self.algorithm = cluster, algorithm
        self.model_config = model_config
        self.rl = rl
        self.tokenizer = tokenizer
        self.eval_examples = [prompt_example(row) for row in eval_rows]  # a malformed row fails here
        self.reward_pool = reward_pool
        # A custom workflow samples with the RLVRConfig it was built with (its `rollout`): held-out
        # evaluation scores with its reward and stop tokens.
        rollout = workflow if isinstance(workflow, RLVRConfig) else workflow.rollout
        self.workflow_config = rollout if isinstance(rollout, RLVRConfig) else None
        self.workflow = RLVRWorkflow(workflow) if isinstance(workflow, RLVRConfig) else workflow
        self.data_iter = data_iter
        self.version = start_version
        self.on_step = self.on_rollouts = None
        self._hooks: dict[str, list[tuple[Callable[[StepInfo], None], int]]] = {stage: [] for stage in STAGES}
        self.add_hook(_rollout_dumps, stage="metrics")
        self.add_hook(evaluation_hook, stage="metrics")
        self.add_hook(_record, stage="record")
        self.checkpoints: CheckpointHook | None = None
        self.first_step = 0
        self.trained_tokens = 0.0  # over the whole run, resumes included
        self._run_tokens = 0.0  # by this process since it started
        self.resumed_meta: dict[str, Any] | None = None
        self.resume_report: dict[str, int] | None = None  # after a resume: step, lost groups, capacity
        # A stop request (jobs/shutdown.py): polled between steps and while waiting for a batch; the
        # loop then checkpoints its last completed step and returns early.
        self.should_stop = should_stop
        self.stopped_early = False
        self._last_applied = None
        self._reward_tally = (0, 0.0)  # (trajectories, reward sum) finished before the last step
        self._pool_seen = (0, 0)  # the pool's (timeouts, crashes + errors) counted by earlier steps
        self._timings_seen: dict | None = None  # engine timings at the previous step's record

    # ---- the parts, as the loop's callers know them ---------------------------------------------

    @property
    def trainer(self) -> api.TrainEngine:
        return self.cluster.trainer

    @property
    def engine(self) -> api.InferenceEngine:
        return self.cluster.engine

    @property
    def meshes(self) -> Meshes | None:
        return self.cluster.meshes

    @property
    def weight_sync(self) -> WeightSync | AdapterSync | None:
        return self.cluster.weight_sync

    @property
    def staleness(self):
        return self.cluster.staleness

    @property
    def channel(self):
        return self.cluster.channel

    @property
    def controller(self):
        return self.cluster.controller

    @property
    def local_batch(self) -> int:
        return self.cluster.local_batch

    @property
    def has_eval_rows(self) -> bool:
        return bool(self.eval_examples)

    def add_hook(self, hook: Callable[[StepInfo], None], *, stage: str = "record", every: int = 1) -> None:
        """Runs `hook(StepInfo)` after each step whose index + 1 is a multiple of `every`, at `stage`
        ("update", "metrics" or "record": trainer/hooks.py), after the hooks added before it."""
        if stage not in self._hooks:
            raise ValueError(f"hook stage must be one of {STAGES}, got {stage!r}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"hook every must be an int >= 1, got {every!r}")
        self._hooks[stage].append((hook, every))

    def use_checkpoints(self, checkpoints: CheckpointHook, *, resume: bool = False) -> None:
        """Checkpoints at the steps `checkpoints.checkpointer` asks for (its point taken at "update",
        written at "record" after the step's records); with `resume` and a checkpoint there, the loop
        continues from it (weights, optimizer, version, counters, data position)."""
        self.checkpoints = checkpoints
        self.add_hook(checkpoints.point, stage="update")
        self.add_hook(lambda info: checkpoints.save(info.loop), stage="record")
        if resume and checkpoints.checkpointer.latest_step() is not None:
            self._restore()

    def plain_params(self) -> Params:
        """The policy's weights without adapters (LoRA's merged into the base, in its dtype)."""
        params = self.trainer.params
        is_native = isinstance(params, dict) and isinstance(params.get("layers"), dict)
        return lora_lib.merge(params) if is_native and lora_lib.adapters_of(params) is not None else params

    def _run_hooks(self, stage: str, info: StepInfo) -> None:
        for hook, every in self._hooks[stage]:
            if (info.step + 1) % every == 0:
                hook(info)

    def close(self) -> None:
        """After `run`: drops the engine (KV cache, served weights), the rollout side and the
        trainer (optimizer state), freeing both sides' devices for evaluation and saving; the
        final weights live on in `LoopResult.final_params`."""
        self.cluster.close()
        self.algorithm = None

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> LoopResult:
        history: list[dict[str, Any]] = []
        report = None
        if self.controller is None:
            self.data_iter = self.cluster.connect(self.workflow, self.data_iter, version_fn=lambda: self.version,
                                                  tokenizer=self.tokenizer, reward_pool=self.reward_pool)
        self.cluster.start()
        t_start = time.perf_counter()
        try:
            for step in range(self.first_step, self.rl.steps):
                if self._stop_requested():
                    break
                try:
                    groups, metrics = self._train_one_step(step)
                except _Abandoned:  # stopped while waiting for the batch: nothing of this step happened
                    break
                metrics["time/wall_s"] = time.perf_counter() - t_start
                metrics["train/trained_tokens_total"] = self.trained_tokens
                metrics["throughput/trained_tokens_per_s"] = self._run_tokens / metrics["time/wall_s"]
                info = StepInfo(step, self.version, groups, metrics, step == self.rl.steps - 1, loop=self)
                self._run_hooks("metrics", info)  # rollout dumps, held-out evaluation
                history.append(metrics)
                # The step's records, then (a checkpoint never holds a step its records lack: a
                # resumed run drops records past its checkpoint, so each step is recorded once) its save.
                self._run_hooks("record", info)
            if self.stopped_early:
                if self.checkpoints is not None:
                    self.checkpoints.save_on_stop(self)
            elif self._last_applied is not None:  # leave the generator serving the final weights
                self._last_applied.result(timeout=self.rl.batch_timeout_s)
        finally:
            report = self.cluster.shutdown(timeout=30.0)
            if self.checkpoints is not None:
                self.checkpoints.wait()
        return LoopResult(steps=len(history), version=self.version, wall_time_s=time.perf_counter() - t_start,
                          trained_tokens=self._run_tokens, history=history, rollout_report=report,
                          final_params=self.plain_params())

    def _take_batch(self) -> tuple[list[TrajectoryGroup], float]:
        t0 = time.perf_counter()
        deadline = t0 + self.rl.batch_timeout_s
        while True:
            self.controller.check()  # a fatal rollout error surfaces here instead of a hang
            try:
                batch = self.channel.get_batch(self.local_batch, timeout=1.0)
                # A fixed order (groups arrive in completion order) keeps the step's arithmetic
                # independent of thread timing.
                batch.sort(key=lambda g: (g.admitted_version, g.query_id))
                return batch, time.perf_counter() - t0
            except TimeoutError:
                if jax.process_count() == 1 and self._stop_requested():  # with several, only between steps
                    raise _Abandoned() from None
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"no batch of {self.local_batch} groups within {self.rl.batch_timeout_s} s; "
                                       f"rollout stats: {self.controller.stats()}") from None

    def _train_one_step(self, step: int) -> tuple[list[TrajectoryGroup], dict[str, Any]]:
        groups, wait_s = self._take_batch()
        if self.rl.mode == "sync":
            self.engine.pause()
        out = self.algorithm(groups, step=step, version=self.version)
        train = out.train
        self.version += 1
        self.trained_tokens += float(train.get("trained_tokens", 0.0))
        self._run_tokens += float(train.get("trained_tokens", 0.0))
        # Before the new weights reach the generator: a checkpoint's resume point (in "sync" mode
        # nothing is in flight or queued here, so the data position is exactly what the trained
        # steps consumed).
        self._run_hooks("update", StepInfo(step, self.version, groups, {}, step == self.rl.steps - 1, loop=self))
        t0 = time.perf_counter()
        applied = self._last_applied = self.cluster.push_weights(self.version)
        transfer_s = time.perf_counter() - t0
        if self.rl.mode == "sync":
            self.engine.resume()
            applied.result()  # nothing generates on stale weights in the synchronous baseline
        self.controller.notify()
        metrics = self._metrics(step, groups, train, wait_s, transfer_s)
        metrics["timings"] = self._step_timings(train, out.minibatches)
        if out.kl_mean is not None:
            metrics["train/kl_to_reference"] = out.kl_mean
        return groups, metrics

    def _metrics(self, step, groups, train, wait_s, transfer_s) -> dict[str, Any]:
        counters = self.staleness.stats()  # restored on resume, unlike the controller's own
        ctl = self.controller.stats()
        n_prev, sum_prev = self._reward_tally
        self._reward_tally = (ctl.finished_trajectories, ctl.finished_reward_sum)
        n_new = ctl.finished_trajectories - n_prev
        lag = train.get("version_lag_hist", {})
        out = {
            "step": step,
            "version": self.version,
            # reward mean/std/accuracy, generated length mean/max, truncated fraction
            **batch_metrics(t for g in groups for t in g.trajectories),
            # Every group finished since the previous step, filtered ones included (unbiased,
            # unlike reward/mean over the trained groups when the all-equal filter is on).
            "rollout/reward_mean": (ctl.finished_reward_sum - sum_prev) / n_new if n_new else math.nan,
            "staleness/mean": float(sum(int(k) * v for k, v in lag.items()) / max(sum(lag.values()), 1)),
            "staleness/max": int(max((int(k) for k, v in lag.items() if v), default=0)),
            "staleness/hist": {str(k): float(v) for k, v in lag.items()},
            "rollout/queue_depth": self.channel.qsize(),
            "rollout/accepted": counters.accepted,
            "rollout/rejected": counters.rejected,
            "throughput/generated_tokens_per_s": ctl.generation_tokens_per_s,
            "rollout/preempted_samples": ctl.generation_preempted_samples,  # cumulative (paged KV cache)
            "throughput/tokens_per_s": train.get("trained_tokens", 0.0) / max(train.get("time_step_s", 1e-9), 1e-9),
            "time/wait_batch_s": wait_s,
            "time/train_step_s": train.get("time_step_s", math.nan),
            "time/weight_transfer_s": transfer_s,
            # What the last swap moved to the generation devices (with LoRA: the adapters only).
            "transfer/bytes": _last_transfer_bytes(self.cluster.weight_sync),
        }
        if self.reward_pool is not None:  # calls past their deadline (scored 0.0), and ones that crashed or raised
            stats = self.reward_pool.stats()
            seen, self._pool_seen = self._pool_seen, (stats.timeouts, stats.crashes + stats.errors)
            timeouts, failures = self._pool_seen[0] - seen[0], self._pool_seen[1] - seen[1]
            if jax.process_count() > 1:
                timeouts, failures = agree_sum(timeouts), agree_sum(failures)
            out["reward/timeouts"], out["reward/failures"] = timeouts, failures
        for k in ("loss", "grad_norm", "clip_frac", "imp_weight_mean", "imp_weight_max", "capped_frac", "entropy",
                  "approx_kl", "skipped_updates", "trained_tokens", "lr", "behav_ratio_out_frac",
                  "weight_top1pct_grad_share", "moe_aux_loss", "moe_load_max", "moe_dropped", "moe_route_mismatch", "behav_logp_gap"):
            if k in train:
                out[f"train/{k}"] = train[k]
        return out

    def _step_timings(self, train: dict[str, Any], minibatches) -> dict[str, Any]:
        """The step's program timings, which `areal-jax simulate --calibrate` fits: the engine's calls
        since the previous record (generation/timings.py) and the training step with the shapes it ran."""
        now = self.engine.timings()
        out = timings_delta(now, self._timings_seen)
        self._timings_seen = now
        shapes = [mb.shape for minibatch in minibatches for mb in minibatch]
        out["train"] = {"s": train.get("time_step_s", math.nan), "minibatches": len(minibatches),
                        "microbatches": len(shapes), "padded_tokens": sum(r * t for r, t in shapes),
                        "attention": float(sum(r * t * t for r, t in shapes))}
        return out

    def rollout_records(self, groups: Sequence[TrajectoryGroup]) -> list[dict[str, Any]]:
        """Human-readable trajectories of a batch: prompt, completion, reward, per-token versions."""
        decode = self.tokenizer.decode
        return [{"query_id": g.query_id, "admitted_version": g.admitted_version, "sample": i,
                 "prompt": decode(t.prompt_ids), "prompt_tokens": len(t.prompt_ids),
                 "completion": decode(t.completion_ids), "reward": t.reward,
                 "stop_reason": t.stop_reason, "versions": t.versions.tolist(),
                 **({} if t.loss_mask is None else {"loss_mask": t.loss_mask.astype(int).tolist()}),
                 "behavior_logprobs": t.behavior_logprobs.tolist()}
                for g in groups for i, t in enumerate(g.trajectories)]

    # ---- checkpoints --------------------------------------------------------------------------

    def _stop_requested(self) -> bool:
        """Whether to stop now; with several processes all agree (a collective: call it on every one)."""
        if self.should_stop is None:
            return False
        stop = bool(self.should_stop())
        if jax.process_count() > 1:
            stop = bool(agree_max(int(stop)))
        self.stopped_early = self.stopped_early or stop
        return stop

    def _restore(self) -> None:
        """Continues from the latest checkpoint: weights, optimizer, version, counters, data position."""
        meta = self.checkpoints.restore(self)
        self.version = int(meta["version"])
        # Only the trained groups count: those queued or generating at the save died with it.
        lost = self.staleness.resume_at(self.version, meta["staleness"])
        self.first_step = int(meta["step"]) + 1
        self.resumed_meta = meta
        self.trained_tokens = float(meta.get("trained_tokens", 0.0))
        self.resume_report = {"step": self.first_step, "version": self.version, "lost_groups": lost,
                              "capacity": self.staleness.capacity(self.version)}
        # The generator starts on the restored weights, as the restored version.
        self.cluster.push_weights(self.version)
        logger.info("resumed at step %d, version %d: %d groups queued or in flight at the save were lost, "
                    "admission capacity %d", self.first_step, self.version, lost, self.resume_report["capacity"])

    # ---- evaluation ---------------------------------------------------------------------------

    def evaluate(self) -> float:
        """Held-out greedy accuracy with the current weights, on the running engine (evaluation.held_out)."""
        rollout = self.workflow_config
        # In the rollouts' pool under their deadline (in this process only when no pool was given).
        scorer = RewardScorer(rollout.reward if rollout else "math", self.reward_pool,
                              timeout_s=rollout.reward_timeout_s if rollout else 10.0)
        budget = self.rl.eval_max_new_tokens or (rollout.max_new_tokens if rollout else 64)
        correct = greedy_correct(self.engine, self.eval_examples, scorer, self.tokenizer, max_new_tokens=budget,
                                 stop_token_ids=rollout.stop_token_ids if rollout else (), drive=False,
                                 timeout_s=self.rl.batch_timeout_s)
        total = len(self.eval_examples)
        if jax.process_count() > 1:  # each host evaluates its own shard of the held-out rows
            correct, total = agree_sum(int(correct)), agree_sum(total)
        return correct / max(total, 1)

class _Abandoned(Exception):
    """A step given up before it trained anything, on a stop request."""


def _last_transfer_bytes(sync: Any) -> float:
    """Bytes the last swap moved to the generation devices (0 before any, or for another engine pair)."""
    stats = None if sync is None else sync.last_stats
    return float(stats.num_bytes) if stats is not None else 0.0


def _sampling_temperature(workflow: Any, ppo: PPOConfig) -> PPOConfig:
    """`ppo` with the rollouts' sampling temperature, which it must equal when set: the trainer's
    log-probs must be of the distribution that sampled the tokens, or the importance weights
    pi_prox / pi_behav measure the temperature, not the staleness."""
    rollout = workflow if isinstance(workflow, RLVRConfig) else workflow.rollout
    if not isinstance(rollout, RLVRConfig):
        return ppo
    if ppo.temperature is None:  # derived: the sampling temperature
        ppo = dataclasses.replace(ppo, temperature=rollout.temperature)
    if rollout.temperature != ppo.temperature:
        raise ValueError(f"RLVRConfig.temperature ({rollout.temperature}) and PPOConfig.temperature "
                         f"({ppo.temperature}) must be equal: behavior log-probs are taken at the sampling "
                         "temperature and the trainer recomputes them at PPOConfig.temperature")
    return ppo


def _rollout_dumps(info: StepInfo) -> None:
    """The step's trajectories to `loop.on_rollouts` every RLConfig.dump_rollouts_every steps."""
    loop, every = info.loop, info.loop.rl.dump_rollouts_every
    if loop.on_rollouts is not None and every and (info.step + 1) % every == 0:
        loop.on_rollouts(info.step, loop.rollout_records(info.groups))


def _record(info: StepInfo) -> None:
    """The step's record to `loop.on_step` (the run's metrics sinks)."""
    if info.loop.on_step is not None:
        info.loop.on_step(info.step, info.metrics)
