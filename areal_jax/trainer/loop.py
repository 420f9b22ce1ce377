"""The asynchronous RL loop: trainer thread + rollout side, connected by the channel.

Per process (multi-controller): the trainer thread (the caller of `RLLoop.run`) drives the
global train mesh; the rollout side (controller thread + engine thread) drives only this
host's generation mesh. One training step:

    take B oldest groups from the channel -> advantages -> packed minibatches
    -> proximal logprobs (pre-update weights) -> minibatch updates -> version + 1
    -> reshard weights train -> generation mesh -> engine swaps them at its next chunk boundary

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
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax

from areal_jax.checkpoint import Checkpointer
from areal_jax.generation.engine import EngineConfig, GenerationEngine
from areal_jax.generation.sampling import SamplingParams
from areal_jax.generation.timings import timings_delta
from areal_jax.metrics import batch_metrics
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Params
from areal_jax.parallel.distributed import agree_max, agree_sum, agree_sum_array
from areal_jax.parallel.meshes import MeshConfig, Meshes, build_meshes
from areal_jax.parallel.weight_sync import DEFAULT_GROUP_BYTES, WeightSync
from areal_jax.ppo.advantages import AdvantageConfig
from areal_jax.reward.scoring import RewardScorer, score_all
from areal_jax.rollout.channel import TrajectoryChannel
from areal_jax.rollout.controller import RolloutController, ShutdownReport
from areal_jax.rollout.staleness import StalenessManager
from areal_jax.rollout.types import TrajectoryGroup
from areal_jax.rollout.workflow import RLVRConfig, RLVRWorkflow, resolve_workflow_class
from areal_jax.trainer.batching import make_microbatches, sequence_group_ids
from areal_jax.trainer.reference import ReferencePolicy, sequences_with_kl
from areal_jax.trainer.optimizer import OptimizerConfig
from areal_jax.trainer.train_step import PolicyTrainer, PPOConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL loop. batch_size is in prompt groups per training step (global, all processes)."""

    steps: int = 20
    batch_size: int = 8
    max_staleness: int = 4  # eta (AReaL's max_head_offpolicyness); 0 = synchronous
    max_concurrent: int = 32  # prompt groups in flight on the generator
    mode: Literal["async", "sync"] = "async"
    # Reject groups whose oldest token lags more than this behind the trainer when they finish;
    # then no trained token lags more than max_staleness + max_group_age versions. No AReaL twin.
    max_group_age: int | None = None
    channel_capacity: int = 0  # 0: 4 x batch_size
    generation_dtype: str | None = None  # e.g. "bfloat16": cast on the way to the generator
    # Generation weights one reshard group moves (whole arrays): the training devices hold at most
    # one group's staging buffers beside the fp32 weights and optimizer state during a transfer.
    transfer_group_bytes: int = DEFAULT_GROUP_BYTES
    eval_every: int = 0  # steps between held-out evaluations (0: only at the start and end)
    # Completion budget of held-out checks. None: RLVRConfig.max_new_tokens (the rollouts' budget).
    eval_max_new_tokens: int | None = None
    dump_rollouts_every: int = 0  # write the step's trajectories to rollouts/step_N.jsonl every N steps
    batch_timeout_s: float = 600.0  # waiting longer than this for a batch is an error
    # A custom rollout workflow, "package.module:Class" (the contract: areal_jax/rollout/workflow.py;
    # an example: areal_jax.workflows.multi_turn_math:MultiTurnMathWorkflow). None: RLVRWorkflow.
    workflow: str | None = None
    # AReaL's name for eta, kept only to refuse it: a ported config must not set the age filter by mistake.
    max_head_offpolicyness: int | None = None

    def __post_init__(self):
        if self.max_head_offpolicyness is not None:
            raise ValueError("RLConfig.max_head_offpolicyness is AReaL's name for eta: set RLConfig.max_staleness "
                             "instead (the per-group age filter here is RLConfig.max_group_age)")
        for name in ("steps", "batch_size", "max_concurrent"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RLConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"RLConfig.max_staleness must be an int >= 0, got {self.max_staleness!r}")
        if self.max_group_age is not None and (isinstance(self.max_group_age, bool)
                                               or not isinstance(self.max_group_age, int) or self.max_group_age < 0):
            raise ValueError(f"RLConfig.max_group_age must be None or an int >= 0, got {self.max_group_age!r}")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"RLConfig.mode must be 'async' or 'sync', got {self.mode!r}")
        if self.mode == "sync" and self.max_staleness != 0:
            raise ValueError("RLConfig.mode = 'sync' needs max_staleness = 0")
        if self.eval_max_new_tokens is not None and (isinstance(self.eval_max_new_tokens, bool) or not isinstance(
                self.eval_max_new_tokens, int) or self.eval_max_new_tokens < 1):
            raise ValueError(f"RLConfig.eval_max_new_tokens must be None or an int >= 1, got {self.eval_max_new_tokens!r}")
        if self.channel_capacity < 0 or self.eval_every < 0 or self.dump_rollouts_every < 0:
            raise ValueError("RLConfig.channel_capacity, eval_every and dump_rollouts_every must be >= 0")
        if (not isinstance(self.transfer_group_bytes, int) or isinstance(self.transfer_group_bytes, bool)
                or self.transfer_group_bytes < 1):
            raise ValueError(f"RLConfig.transfer_group_bytes must be an int >= 1, got {self.transfer_group_bytes!r}")
        if not self.batch_timeout_s > 0:
            raise ValueError(f"RLConfig.batch_timeout_s must be > 0, got {self.batch_timeout_s!r}")
        if self.workflow is not None:
            resolve_workflow_class(self.workflow)  # imports it: a wrong path fails here, before any work


@dataclasses.dataclass
class LoopResult:
    steps: int
    version: int
    wall_time_s: float
    trained_tokens: float
    history: list[dict[str, Any]]
    rollout_report: ShutdownReport | None
    final_params: Params


def generation_weight_sync(model_cfg: ModelConfig, meshes: Meshes, rl: RLConfig) -> WeightSync:
    """The train -> generation transfer of a run: the generation dtype and group size of `rl`,
    weights delivered per layer (the layout the engine holds)."""
    return WeightSync.for_model(model_cfg, meshes, rl.generation_dtype, group_bytes=rl.transfer_group_bytes)


class RLLoop:
    """Owns the trainer, the engine, the controller and the weight path between them.

    `params`: the initial weights (any placement; the trainer keeps its own fp32 copy on the train
    mesh). With `donate_params` their buffers are deleted once the trainer holds its copy, so no
    initial copy stays on the devices whatever references the caller keeps (use them no more).
    `weight_sync`: a `generation_weight_sync` of the same meshes to reuse (its programs compiled).
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
                 donate_params: bool = False, weight_sync: WeightSync | None = None,
                 should_stop: Callable[[], bool] | None = None):
        # A custom workflow samples with the RLVRConfig it was built with (its `rollout`).
        rollout = workflow if isinstance(workflow, RLVRConfig) else getattr(workflow, "rollout", None)
        rollout = rollout if isinstance(rollout, RLVRConfig) else None
        if rollout is not None and ppo.temperature is None:  # derived: the sampling temperature
            ppo = dataclasses.replace(ppo, temperature=rollout.temperature)
        if rollout is not None and rollout.temperature != ppo.temperature:
            # The trainer's log-probs must be of the distribution that sampled the tokens, or the
            # importance weights pi_prox / pi_behav measure the temperature, not the staleness.
            raise ValueError(f"RLVRConfig.temperature ({rollout.temperature}) and PPOConfig.temperature "
                             f"({ppo.temperature}) must be equal: behavior log-probs are taken at the sampling "
                             "temperature and the trainer recomputes them at PPOConfig.temperature")
        self.model_config = model_cfg
        self.rl = rl
        self.advantages = advantages
        self.tokenizer = tokenizer
        self.eval_rows = list(eval_rows)
        self.on_step = on_step
        self.meshes: Meshes = build_meshes(mesh, devices)
        self.trainer = PolicyTrainer(model_cfg, params, optimizer, ppo, mesh=self.meshes.train)
        if donate_params:
            _delete_unless_held(params, self.trainer.params)
        del params  # the trainer holds its own copy: nothing below may keep the initial one alive
        # A frozen copy of the initial policy, only when the KL penalty needs it (it costs a copy).
        self.reference = ReferencePolicy(self.trainer) if advantages.kl_coef > 0 else None
        if weight_sync is not None and (weight_sync.meshes.train, weight_sync.meshes.generation) != (
                self.meshes.train, self.meshes.generation):
            raise ValueError("weight_sync was built for other meshes than this loop's")
        self.weight_sync = weight_sync or generation_weight_sync(model_cfg, self.meshes, rl)
        self.version = start_version
        self.engine = GenerationEngine((model_cfg, self.weight_sync.transfer(self.trainer.params)), engine,
                                       version=start_version)
        local_batch = rl.batch_size // jax.process_count()
        if local_batch * jax.process_count() != rl.batch_size:
            raise ValueError(f"RLConfig.batch_size {rl.batch_size} must divide over {jax.process_count()} processes")
        self.local_batch = local_batch
        # Micro-batch rows split over "fsdp": each process contributes a multiple of its share.
        self.rows_per_process = max(self.meshes.train.shape["fsdp"] // jax.process_count(), 1)
        self.staleness = StalenessManager(rl.max_staleness, local_batch, rl.max_concurrent)
        self.channel = TrajectoryChannel(rl.channel_capacity or 4 * local_batch)
        self.workflow_config = rollout  # held-out evaluation scores with its reward and stop tokens
        wf = RLVRWorkflow(workflow) if isinstance(workflow, RLVRConfig) else workflow
        # The controller thread reads rows while the trainer thread snapshots the position for a
        # checkpoint: a lock keeps a snapshot from landing halfway through a read.
        self.data_iter = _LockedIterator(data_iter) if hasattr(data_iter, "get_state") else data_iter
        self.checkpointer = checkpointer
        self.checkpoint_extra = checkpoint_extra
        self.on_rollouts = on_rollouts
        self.on_export = on_export  # called on process 0 with each HF export's directory (the run adds its files)
        self.first_step = 0
        self.trained_tokens = 0.0  # over the whole run, resumes included
        self._run_tokens = 0.0  # by this process since it started
        self.resumed_meta: dict[str, Any] | None = None
        self.resume_report: dict[str, int] | None = None  # after a resume: step, lost groups, capacity
        self._pending_save: dict[str, Any] | None = None  # a due checkpoint, saved once the step is logged
        # A stop request (jobs/shutdown.py): polled between steps and while waiting for a batch; the
        # loop then checkpoints its last completed step (`_last_point`) and returns early.
        self.should_stop = should_stop
        self.stopped_early = False
        self._last_point: dict[str, Any] | None = None
        self._saved_step: int | None = None
        if resume and checkpointer is not None and checkpointer.latest_step() is not None:
            self._restore()
        self.controller = RolloutController(self.engine, wf, self.staleness, self.channel, self.data_iter,
                                            version_fn=lambda: self.version, tokenizer=tokenizer,
                                            reward_pool=reward_pool,
                                            max_group_age=rl.max_group_age)
        self._last_applied = None
        self._reward_tally = (0, 0.0)  # (trajectories, reward sum) finished before the last step
        self.reward_pool = reward_pool
        self._pool_seen = (0, 0)  # the pool's (timeouts, crashes + errors) counted by earlier steps
        self._timings_seen: dict | None = None  # engine timings at the previous step's record

    def close(self) -> None:
        """After `run`: drops the engine (KV cache, served weights), the rollout side and the
        trainer (optimizer state), freeing both sides' devices for evaluation and saving; the
        final weights live on in `LoopResult.final_params`."""
        self.controller = self.engine = self.reference = self.trainer = None

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> LoopResult:
        history: list[dict[str, Any]] = []
        report = None
        self.engine.start()
        self.controller.start()
        t_start = time.perf_counter()
        try:
            for step in range(self.first_step, self.rl.steps):
                if self._stop_requested():
                    break
                try:
                    metrics = self._train_one_step(step)
                except _Abandoned:  # stopped while waiting for the batch: nothing of this step happened
                    break
                metrics["time/wall_s"] = time.perf_counter() - t_start
                metrics["train/trained_tokens_total"] = self.trained_tokens
                metrics["throughput/trained_tokens_per_s"] = self._run_tokens / metrics["time/wall_s"]
                last = step == self.rl.steps - 1
                if self.eval_rows and self.rl.eval_every and ((step + 1) % self.rl.eval_every == 0 or last):
                    metrics["eval/accuracy"] = self.evaluate()
                history.append(metrics)
                if self.on_step is not None:
                    self.on_step(step, metrics)
                # After the step's records, so a checkpoint never holds a step its records lack (a
                # resumed run drops records past its checkpoint: each step is recorded once).
                self._save_pending()
            if self.stopped_early:
                self._save_on_stop()
            elif self._last_applied is not None:  # leave the generator serving the final weights
                self._last_applied.result(timeout=self.rl.batch_timeout_s)
        finally:
            report = self.controller.shutdown(timeout=30.0)
            self.engine.stop()
            if self.checkpointer is not None:
                self.checkpointer.wait()
        return LoopResult(steps=len(history), version=self.version, wall_time_s=time.perf_counter() - t_start,
                          trained_tokens=self._run_tokens, history=history, rollout_report=report,
                          final_params=self.trainer.params)

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

    def _train_one_step(self, step: int) -> dict[str, Any]:
        groups, wait_s = self._take_batch()
        if self.rl.mode == "sync":
            self.engine.pause()
        ppo = self.trainer.ppo_config
        multi = jax.process_count() > 1
        # KL against the frozen reference (off by default) shapes the advantages; with it off this
        # is exactly build_sequences. Batch-level advantage statistics span every process's groups.
        buckets = ppo.row_buckets or None  # () = make_microbatches' default lengths
        shaped = sequences_with_kl(groups, self.advantages, self.trainer, self.reference,
                                   row_multiple=self.rows_per_process, buckets=buckets,
                                   agree_max=agree_max if multi else None,
                                   reduce_sum=agree_sum_array if multi else None)
        seqs = shaped.sequences
        # Every process must run the same programs in the same order: agree on micro-batch counts
        # and shapes, and on the minibatch token count that divides the loss. The groups are split
        # into minibatches in a seeded order of their own, reproducible by step.
        minibatches = make_microbatches(seqs, max_tokens_per_microbatch=ppo.max_tokens_per_microbatch,
                                        buckets=buckets,
                                        num_minibatches=min(ppo.num_minibatches, len(seqs)),
                                        row_multiple=self.rows_per_process,
                                        agree_max=agree_max if multi else None, agree_sum=agree_sum if multi else None,
                                        group_ids=sequence_group_ids(groups), shuffle_seed=(ppo.minibatch_seed, step))
        train = self.trainer.train_step(minibatches, current_version=self.version)
        self.version += 1
        self.trained_tokens += float(train.get("trained_tokens", 0.0))
        self._run_tokens += float(train.get("trained_tokens", 0.0))
        # The resume point is taken before the new weights reach the generator: in "sync" mode
        # nothing is in flight or queued here, so the data position is exactly what the trained
        # steps consumed. It is written once the step is recorded (run).
        self._last_point = self._resume_point(step, always=self.should_stop is not None)
        self._pending_save = self._last_point if self._last_point and self._last_point["due"] else None
        t0 = time.perf_counter()
        generation_params = self.weight_sync.transfer(self.trainer.params)
        applied = self._last_applied = self.engine.update_weights(generation_params, self.version)
        transfer_s = time.perf_counter() - t0
        if self.rl.mode == "sync":
            self.engine.resume()
            applied.result()  # nothing generates on stale weights in the synchronous baseline
        self.controller.notify()
        metrics = self._metrics(step, groups, train, wait_s, transfer_s)
        metrics["timings"] = self._step_timings(train, minibatches)
        every = self.rl.dump_rollouts_every
        if self.on_rollouts is not None and every and (step + 1) % every == 0:
            self.on_rollouts(step, self.rollout_records(groups))
        if shaped.kl_mean is not None:
            metrics["train/kl_to_reference"] = shaped.kl_mean
        return metrics

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
                  "weight_top1pct_grad_share", "moe_aux_loss", "moe_load_max", "moe_dropped"):
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

    def _resume_point(self, step: int, always: bool = False) -> dict[str, Any] | None:
        """What a checkpoint after `step` records of the loop, taken now if one is due or `always`
        (a stop may need it; "due" says which); else None."""
        ckpt = self.checkpointer
        if ckpt is None:
            return None
        last = step == self.rl.steps - 1
        due = last or ckpt.should_save(step + 1)  # a collective with a time trigger: decided here
        if not (due or always):
            return None
        meta = {"step": step, "version": self.version, "staleness": self.staleness.state_dict(),
                "engine_seed": self.engine.config.seed, "trained_tokens": self.trained_tokens}
        data = _FrozenPosition(self.data_iter.get_state()) if hasattr(self.data_iter, "get_state") else None
        return {"step": step, "meta": meta, "data": data, "due": due}

    def _stop_requested(self) -> bool:
        """Whether to stop now; with several processes all agree (a collective: call it on every one)."""
        if self.should_stop is None:
            return False
        stop = bool(self.should_stop())
        if jax.process_count() > 1:
            stop = bool(agree_max(int(stop)))
        self.stopped_early = self.stopped_early or stop
        return stop

    def _save_on_stop(self) -> None:
        """A stop's checkpoint: the last completed step, unless already saved (or none ran here)."""
        point, self._last_point = self._last_point, None
        if point is None or point["step"] == self._saved_step:
            return
        self._pending_save = point
        self._save_pending()
        logger.warning("stopped after step %d: checkpoint %d written", point["step"], point["step"] + 1)

    def _save_pending(self) -> None:
        """Writes the checkpoint `_resume_point` prepared (the trainer's state has not moved since)."""
        point, self._pending_save = self._pending_save, None
        if point is None:
            return
        self._saved_step = point["step"]
        ckpt, step, meta = self.checkpointer, point["step"], point["meta"]
        if self.checkpoint_extra is not None:
            meta["extra"] = self.checkpoint_extra()
        ckpt.save(step + 1, state=self.trainer.state_dict(), meta=meta, data_iterator=point["data"], force=True)
        if ckpt.should_export_hf(step + 1):
            target = ckpt.export_hf(self.trainer.params, self.model_config, step + 1)
            if target is not None and self.on_export is not None and jax.process_index() == 0:
                self.on_export(target)

    def _restore(self) -> None:
        """Continues from the latest checkpoint: weights, optimizer, version, counters, data position."""
        ckpt = self.checkpointer
        template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                                if isinstance(a, jax.Array) else a, self.trainer.state_dict())
        state, meta = ckpt.restore(state_template=template,
                                   data_iterator=self.data_iter if hasattr(self.data_iter, "get_state") else None)
        self.trainer.load_state_dict(state)
        self.version = int(meta["version"])
        # Only the trained groups count: those queued or generating at the save died with it.
        lost = self.staleness.resume_at(self.version, meta["staleness"])
        self.first_step = int(meta["step"]) + 1
        self.resumed_meta = meta
        self.trained_tokens = float(meta.get("trained_tokens", 0.0))
        self.resume_report = {"step": self.first_step, "version": self.version, "lost_groups": lost,
                              "capacity": self.staleness.capacity(self.version)}
        # The generator starts on the restored weights, as the restored version.
        self.engine.update_weights(self.weight_sync.transfer(self.trainer.params), self.version)
        logger.info("resumed at step %d, version %d: %d groups queued or in flight at the save were lost, "
                    "admission capacity %d", self.first_step, self.version, lost, self.resume_report["capacity"])

    # ---- evaluation ---------------------------------------------------------------------------

    def evaluate(self) -> float:
        """Held-out greedy accuracy with the current weights, on the running engine."""
        rollout = self.workflow_config
        # In the rollouts' pool under their deadline (in this process only when no pool was given).
        scorer = RewardScorer(rollout.reward if rollout else "math", self.reward_pool,
                              timeout_s=rollout.reward_timeout_s if rollout else 10.0)
        stop = self.workflow_config.stop_token_ids if self.workflow_config else ()
        budget = self.rl.eval_max_new_tokens or (rollout.max_new_tokens if rollout else 64)
        sp = SamplingParams(max_new_tokens=budget, temperature=0.0, stop_token_ids=stop)
        handles = [self.engine.submit(row["prompt_ids"], sp) for row in self.eval_rows]
        calls = []
        for row, h in zip(self.eval_rows, handles):
            tokens = h.result(timeout=self.rl.batch_timeout_s).completions[0].tokens
            gold = row["row"].answer if row["row"].task == "math" else row["row"].test_cases
            calls.append((self.tokenizer.decode(tokens, skip_special_tokens=True), gold))
        correct = sum(reward >= 1.0 for reward in score_all(scorer, calls))
        total = len(self.eval_rows)
        if jax.process_count() > 1:  # each host evaluates its own shard of the held-out rows
            correct, total = agree_sum(int(correct)), agree_sum(total)
        return correct / max(total, 1)


class _Abandoned(Exception):
    """A step given up before it trained anything, on a stop request."""


class _LockedIterator:
    """A checkpointable iterator whose reads and position snapshots exclude each other."""

    def __init__(self, inner: Any):
        self._inner, self._lock = inner, threading.Lock()

    def __iter__(self) -> _LockedIterator:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return next(self._inner)

    def get_state(self) -> Any:
        with self._lock:
            return self._inner.get_state()

    def set_state(self, state: Any) -> None:
        with self._lock:
            self._inner.set_state(state)

    def __getattr__(self, name: str) -> Any:  # e.g. start_prefetch, which a restore calls
        return getattr(self._inner, name)


class _FrozenPosition:
    """A data position read earlier, handed to the checkpointer in place of the live iterator."""

    def __init__(self, state: Any):
        self._state = state

    def get_state(self) -> Any:
        return self._state


def _delete_unless_held(given: Params, held: Params) -> None:
    """Frees the buffers of `given` that `held` does not use (the trainer may keep an input as is)."""

    def buffers(x: jax.Array) -> set[tuple[Any, int]]:
        return {(s.device, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}

    kept = set().union(*(buffers(x) for x in jax.tree.leaves(held) if isinstance(x, jax.Array)))
    for x in jax.tree.leaves(given):
        if isinstance(x, jax.Array) and not x.is_deleted() and not buffers(x) & kept:
            x.delete()
