"""`areal-jax train`: (optional) SFT warm start, then asynchronous RL, with a run directory.

The run directory receives: config.gin (the bindings that rebuild its configs), config.json (every resolved
config), metrics.jsonl (one object per SFT step, at indices -SFTConfig.steps..-1, then one per RL
step from 0) and TensorBoard events, summary.json,
progress.png (reward and held-out accuracy against steps and wall time) and final_model/
(HF format, with the prompt encoding in areal_jax_prompt.json).

Where the weights live: the initial weights are loaded straight onto the train mesh (each
device reads its slice) and handed to the RL trainer, which keeps its own fp32 copy; the
initial buffers are then deleted. Held-out evaluation (before and after RL, and SFT's checks)
runs on this host's generation devices in RLConfig.generation_dtype, the weights moved there
by the run's WeightSync. The final weights are never gathered onto one device: saving fetches
them to host memory one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from areal_jax import config_system as cs
from areal_jax import api, paths
from areal_jax.job_config import JobConfigs
from areal_jax.jobs.inputs import InputError, on_every_process, check_sources
from areal_jax.jobs.preflight import check_model_fit, check_solution_rewards, sandbox_for_run
from areal_jax.jobs.progress import accuracy_text, plot_progress, progress_bar
from areal_jax.jobs.run_settings import write_prompt_settings
from areal_jax.jobs.run_data import absolute_paths, check_same_data, write_data_record, write_inputs
from areal_jax.jobs.resume_config import check_checkpoint_matches
from areal_jax.jobs.run_dir import check_run_dir, remove_previous_run
from areal_jax.jobs.run_lock import hold_run_dir
from areal_jax.jobs.workload import Workload, prepare_workload
from areal_jax.jobs.shutdown import StopRequest, stop_on_signal
from areal_jax.jobs.run_records import drop_steps_from, last_wall_time
from areal_jax.checkpoint import Checkpointer
from areal_jax.metrics import MetricsLogger
from areal_jax.models.hf_io import copy_tokenizer_files, save_params
from areal_jax.parallel.distributed import agree_max, agree_sum, gather_json
from areal_jax.parallel.meshes import build_meshes
from areal_jax.rollout.workflow import make_workflow, missing_workflow_members, resolve_workflow_class
from areal_jax.jobs.rl_loop_builder import build_rl_loop
from areal_jax.trainer.cluster import generation_weight_sync
from areal_jax.reward.pool import RewardPool
from areal_jax.reward.sandbox import SandboxUnavailable
from areal_jax.reward.scoring import RewardScorer, open_reward_pool, pool_totals

logger = logging.getLogger(__name__)

def run_train(cfg: JobConfigs, run_dir: str | pathlib.Path, *, progress: bool = True, resume: bool = False,
              overwrite: bool = False, workflow: Any = None, hooks: Sequence[tuple[Any, str, int]] = (),
              inputs: Mapping[str, bytes] | None = None) -> dict[str, Any]:
    """Runs the configured stages; returns the summary also written to summary.json.

    The reward runs where its registration allows (`reward.scoring.open_reward_pool`): in
    RewardPoolConfig's worker processes under RLVRConfig.reward_timeout_s, unless it is declared
    in-process. The pool is closed however the run ends (an exception, SIGINT or SIGTERM turned
    into one by the CLI): workers with calls in flight are killed and their sandboxes swept.
    `workflow`: the rollouts' workflow, an api.RolloutWorkflow instance, a class or a factory
    (`_rollout_workflow`); None: RLConfig.workflow's class, else RLVR. `hooks`: (hook, stage, every)
    for the RL loop (`api.Hook`). `inputs`: data files to write (path -> content: rows the
    Python API was given), written only once the run directory's checks have passed.
    """
    # Its checkpoints ("{run_dir}" in CheckpointConfig.directory, or the default); data and model paths absolute.
    cfg = absolute_paths(cfg.for_run(run_dir))
    # The run directory is held for the run's whole life, before anything is written (jobs/run_lock.py).
    with hold_run_dir(run_dir), stop_on_signal(cfg.checkpoint and cfg.checkpoint.save_on_signal_s) as stop:
        return _run_with_pool(cfg, run_dir, stop, progress=progress, resume=resume, overwrite=overwrite,
                              workflow=workflow, hooks=hooks, inputs=inputs or {})


def _run_with_pool(cfg: JobConfigs, run_dir: str | pathlib.Path, stop: StopRequest | None, *, progress: bool,
                   resume: bool, overwrite: bool, workflow: Any = None, hooks: Sequence = (),
                   inputs: Mapping[str, bytes]) -> dict[str, Any]:
    try:
        pool = open_reward_pool(cfg.rollout.verifier_terms, cfg.reward_pool, sandbox_for_run(cfg, run_dir))
    except (SandboxUnavailable, ValueError) as e:  # before any work, like every other config problem
        raise cs.ConfigError(str(e)) from None
    try:
        return _run_train(cfg, run_dir, pool, stop, progress=progress, resume=resume, overwrite=overwrite,
                          workflow=workflow, hooks=hooks, inputs=inputs)
    finally:
        if pool is not None:
            pool.close(wait=False)


@dataclasses.dataclass
class _Run:
    """What the stages of one `run_train` share: its configs, inputs and records so far."""

    cfg: JobConfigs
    run_dir: paths.Path
    reward_pool: RewardPool | None
    stop: StopRequest | None
    progress: bool
    t0: float  # when this segment started (perf_counter)
    meshes: Any
    work: Workload
    reward_fn: RewardScorer | None  # held-out and validation accuracy (None: no verifier term)
    sync: Any  # the run's WeightSync: train mesh -> this host's generation devices, reused by RL
    eval_slots: int
    checkpointer: Checkpointer | None
    resuming: bool
    summary: dict[str, Any] = dataclasses.field(default_factory=lambda: {"sft_steps": 0, "sft_time_s": 0.0})
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # SFT's records and RL's go through one logger: one TensorBoard file, one W&B run.
    metrics_log: MetricsLogger | None = None
    wall_before: float = 0.0  # wall time of the earlier segments of a resumed run
    meta: dict[str, Any] | None = None  # the resumed checkpoint's metadata

    def elapsed(self) -> float:
        """Wall time of the run so far, every segment of a resumed run included."""
        return self.wall_before + time.perf_counter() - self.t0


def _run_train(cfg: JobConfigs, run_dir: str | pathlib.Path, reward_pool: RewardPool | None,
               stop: StopRequest | None, *, progress: bool, resume: bool, overwrite: bool,
               workflow: Any = None, hooks: Sequence = (), inputs: Mapping[str, bytes]) -> dict[str, Any]:
    """The stages of `run_train`, scoring with `reward_pool` (None: the reward is declared in-process);
    `stop`, armed for the RL stage, turns a signal into a checkpoint of the last step and a stop.

    A directory that holds a run is refused (InputError) unless `overwrite` (its records and
    checkpoints are removed once the new run's inputs have loaded) or `resume`: then a checkpoint
    under the run's CheckpointConfig directory is required, the fields in RESUME_FIELDS must equal
    the saved config.json's, SFT is skipped and RL continues from the latest checkpoint (weights,
    optimizer, version, counters, data position). config.gin and config.json are written only
    once every check has passed and the model and data have loaded.
    """
    run = _prepare_run(cfg, run_dir, reward_pool, stop, progress=progress, resume=resume, overwrite=overwrite,
                       inputs=inputs)
    params, run.work.params = run.work.params, None  # from here on `params` is the only reference
    if run.resuming:  # the SFT stage is already in the checkpoint's weights
        _restore_records(run)
    else:
        params = _sft_stage(run, params)
        run.summary["sft_accuracy"] = held_out_accuracy(run, params)
        print(f"[areal-jax] held-out greedy accuracy after SFT: {accuracy_text(run.summary['sft_accuracy'])}",
              flush=True)
    reward_before = dict(run.summary.get("reward", {}))  # reward calls of a resumed run's earlier segments
    if cfg.stages.rl:
        params = _rl_stage(run, params, reward_before, workflow, hooks)
    run.summary["final_accuracy"] = held_out_accuracy(run, params)
    summary = _finish(run, params, reward_before)
    problem = nothing_trained(run.history, cfg.ppo.num_minibatches)
    if problem is not None:  # every record written: what the run did stays readable, then a failure
        raise InputError(f"{problem} (metrics.jsonl: train/skipped_updates; records in {run.run_dir})")
    return summary


def nothing_trained(history: Sequence[dict[str, Any]], updates_per_step: int) -> str | None:
    """Why a run whose every optimizer update was skipped (a non-finite loss or gradient each time)
    trained nothing, None when one update applied (or no RL step ran)."""
    skipped = [m["train/skipped_updates"] for m in history if "train/skipped_updates" in m]
    if not skipped or any(s < updates_per_step for s in skipped):
        return None
    return (f"RL applied none of its {len(skipped) * updates_per_step} optimizer updates: each had a non-finite "
            "loss or gradient, so the final model is the initial one (a learning rate, reward scale or dtype "
            "to fix)")


def _prepare_run(cfg: JobConfigs, run_dir: str | pathlib.Path, reward_pool: RewardPool | None,
                 stop: StopRequest | None, *, progress: bool, resume: bool, overwrite: bool,
                 inputs: Mapping[str, bytes]) -> _Run:
    """Every check, the model and data loaded, and the run directory's config files written."""
    t0 = time.perf_counter()
    run_dir = paths.as_path(run_dir)  # local or remote (gs://)
    try:
        meshes = build_meshes(cfg.mesh)  # an impossible device split fails here, before any work
    except ValueError as e:
        raise cs.ConfigError(f"MeshConfig: {e}") from None
    on_every_process(lambda: check_run_dir(cfg, run_dir, resume=resume, overwrite=overwrite))
    if resume:  # the checkpoint's shapes and the data its position counts rows of, before anything is written
        on_every_process(lambda: check_checkpoint_matches(cfg))
        on_every_process(lambda: check_same_data(cfg, run_dir, inputs))
    write_inputs(inputs)
    on_every_process(lambda: check_sources(cfg))
    check_model_fit(cfg, meshes.generation.devices.flat[0].platform)  # the same on every process
    # Held-out and validation accuracy score in the same pool as the rollouts, under the same deadline.
    reward_fn = None  # a reward of learned terms alone: no accuracy (its RL records still log each term)
    if cfg.rollout.verifier is not None:
        reward_fn = RewardScorer(cfg.rollout.verifier, reward_pool, timeout_s=cfg.rollout.reward_timeout_s)
        on_every_process(lambda: check_solution_rewards(cfg, reward_fn.checked_map))  # a reward that cannot read the data
    # One device: the weights stay unplaced, as SFT then runs without a mesh.
    work = prepare_workload(cfg, run_dir, mesh=meshes.train if meshes.train.devices.size > 1 else None)
    if overwrite:
        remove_previous_run(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        _write_run_files(cfg, run_dir, work)
    checkpointer = Checkpointer(cfg.checkpoint) if cfg.checkpoint is not None else None
    return _Run(cfg=cfg, run_dir=run_dir, reward_pool=reward_pool, stop=stop, progress=progress, t0=t0,
                meshes=meshes, work=work, reward_fn=reward_fn,
                # Moves weights to this host's generation devices in the generation dtype, per layer;
                # the RL loop reuses it (and its compiled programs).
                sync=generation_weight_sync(work.model_config, meshes, cfg.rl, cfg.lora, cfg.engine.weight_dtype,
                                            stacked=cfg.engine.serves_stacked(
                                                meshes.generation.devices.flat[0].platform)),
                eval_slots=_eval_slots(cfg, work.model_config, meshes), checkpointer=checkpointer,
                resuming=bool(resume and checkpointer is not None and checkpointer.latest_step() is not None))


def _eval_slots(cfg: JobConfigs, model_config, meshes) -> int:
    """Evaluation engines take at most the RL engine's slots and the full-length sequences its KV
    pool holds: that pool is what the config sized to fit the generation devices."""
    data = meshes.generation.shape.get("data", 1) if meshes.generation is not None else 1
    return cfg.eval_engine_slots(model_config, data)


def _write_run_files(cfg: JobConfigs, run_dir: paths.Path, work: Workload) -> None:
    """config.gin, config.json, the model's HF config and the tokenizer: what resume, `export`
    and `eval` read back."""
    (run_dir / "config.gin").write_text(cfg.gin_text())
    (run_dir / "config.json").write_text(json.dumps(cfg.as_dict(), indent=2, default=str))
    (run_dir / "model_config.json").write_text(json.dumps(work.model_config.to_hf(), indent=2))
    write_data_record(cfg, run_dir)
    if work.tokenizer_dir != run_dir / "tokenizer":  # the run directory keeps the tokenizer it used
        paths.remove(run_dir / "tokenizer")
        copy_tokenizer_files(work.tokenizer_dir, run_dir / "tokenizer")


def held_out_accuracy(run: _Run, params: Any) -> float | None:
    """Greedy accuracy on the held-out rows of every process (each holds a shard of them), on
    this host's generation devices with the weights in the generation dtype. All processes
    call it: moving weights from the train mesh is a collective."""
    from areal_jax.evaluation.held_out import GreedyAccuracy

    work = run.work
    if run.reward_fn is None:  # no verifier term: nothing to call right
        return None
    if not _on_any_process(bool(work.eval_rows)):
        run.summary["held_out_problems"] = 0
        return None  # no held-out rows: no accuracy (null in summary.json, not NaN)
    weights = run.sync.transfer(params)
    correct, total = 0, 0
    if work.eval_rows:  # a one-off engine: none holds memory during RL
        correct, total = GreedyAccuracy(work.model_config, work.eval_rows, work.tokenizer,
                                        max_new_tokens=run.cfg.rl.eval_max_new_tokens, reward_fn=run.reward_fn,
                                        slots=run.eval_slots, scan_layers=run.cfg.engine.scan_layers).count(weights)
    del weights
    if jax.process_count() > 1:
        correct, total = agree_sum(correct), agree_sum(total)
    run.summary["held_out_problems"] = total
    return correct / total if total else float("nan")


def _restore_records(run: _Run) -> None:
    """A resumed run's summary, history and wall time so far, from its checkpoint's metadata."""
    run.meta = meta = run.checkpointer.read_meta()
    extra = meta.get("extra", {})
    run.summary.update({k: _decode_float(v) for k, v in extra.get("summary", {}).items()})
    run.history = list(extra.get("history", []))
    run.wall_before = float(extra.get("wall_time_s", 0.0))
    print(f"[areal-jax] resuming from checkpoint step {run.checkpointer.latest_step()}", flush=True)


def _sft_stage(run: _Run, params: Any) -> Any:
    """The SFT warm start (when configured and there are examples); returns the weights after it."""
    from areal_jax.evaluation.held_out import GreedyAccuracy
    from areal_jax.trainer.sft import run_sft

    cfg, work, summary = run.cfg, run.work, run.summary
    if not (cfg.stages.sft and work.sft_examples):
        return params
    t_sft = time.perf_counter()
    validate = probe = None
    if cfg.sft.eval_every:  # on the generation devices too (SFT hands it whole weights: no collective)
        probe = GreedyAccuracy(work.model_config, work.validation_rows, work.tokenizer,
                               max_new_tokens=cfg.rl.eval_max_new_tokens, reward_fn=run.reward_fn,
                               slots=run.eval_slots, scan_layers=cfg.engine.scan_layers)
        validate = lambda p: probe(run.sync.transfer(p))  # noqa: E731
    # SFT trains on the RL trainer's mesh (sharded, across hosts); on a single device as is.
    sft_mesh = run.meshes.train if run.meshes.train.devices.size > 1 else None
    run.metrics_log = metrics_log = metrics_logger(cfg, run.run_dir, progress=False)  # SFT has its own bar
    params, sft_log = run_sft(work.model_config, params, work.sft_examples, cfg.sft, engine=cfg.train_engine,
                              progress=run.progress,
                              validate=validate, mesh=sft_mesh, val_examples=work.sft_val_examples,
                              on_step=lambda step, m: metrics_log.log(sft_step_index(cfg.sft, step), {"sft": m}))
    del validate, probe  # its engine (weights, KV cache) is not kept through RL
    last = sft_log[-1]  # its step is the number of steps run
    summary.update(sft_steps=last["step"], sft_time_s=time.perf_counter() - t_sft, sft_loss=last["loss"])
    if "val_loss" in last:
        summary["sft_val_loss"] = last["val_loss"]
    checks = [m["val_accuracy"] for m in sft_log if "val_accuracy" in m]
    if checks:
        summary.update(sft_val_accuracy=checks[-1], sft_stopped_early=bool(last.get("stopped_early")))
    if last.get("stopped_early"):
        print(f"[areal-jax] SFT stopped at step {last['step']} of {cfg.sft.steps}: validation accuracy "
              f"{last['val_accuracy']:.3f} >= SFTConfig.stop_accuracy {cfg.sft.stop_accuracy}", flush=True)
    return params


class _StepRecorder:
    """The RL loop's `on_step`: each step's record into history, metrics sinks, summary and bar."""

    def __init__(self, run: _Run, reward_before: dict[str, int], bar: Any):
        self.run, self.reward_before, self.bar = run, reward_before, bar

    def __call__(self, step: int, m: dict[str, Any]) -> None:
        run = self.run
        m = {**m, "time/since_start_s": run.elapsed()}
        run.history.append(m)
        run.metrics_log.log(step, m)
        # Every process's calls (all call on_step in step with each other), carried by checkpoints:
        # a resume on any number of hosts starts from the global totals.
        run.summary["reward"] = _add_counts(self.reward_before, *gather_json(pool_totals(run.reward_pool)))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{m.get('rollout/reward_mean', m['reward/mean']):.2f}",
                                 stale=m["staleness/max"], acc=f"{m.get('eval/accuracy', float('nan')):.2f}")


def _rl_stage(run: _Run, params: Any, reward_before: dict[str, int], workflow: Any = None,
              hooks: Sequence = ()) -> Any:
    """Asynchronous RL from `params` (donated); returns the final weights, sharded on the train mesh.
    `workflow`: as `_rollout_workflow` takes it (None: RLConfig.workflow's, else RLVR); `hooks`:
    (hook, stage, every) added to the loop after its own (`api.Hook`)."""
    cfg, work, summary = run.cfg, run.work, run.summary
    writer = jax.process_index() == 0  # one process writes the run directory's records
    if run.resuming and writer:  # steps logged after the checkpoint are trained again: recorded once
        dropped = drop_steps_from(run.run_dir, int(run.meta["step"]) + 1)
        run.wall_before = max(run.wall_before, last_wall_time(dropped))  # the killed segment ran that long
    if run.metrics_log is None:
        run.metrics_log = metrics_logger(cfg, run.run_dir, progress=run.progress)
    else:  # SFT's: RL's steps go on in the same files
        run.metrics_log.console = run.progress and writer
    bar = progress_bar(cfg.rl.steps, run.progress)
    t_rl = time.perf_counter()
    stop = run.stop
    if stop is not None:  # SIGTERM/SIGINT from here on: the last completed step is checkpointed, then a stop
        stop.arm()
    stop_ids = tuple(cfg.rollout.stop_token_ids) or tuple(work.tokenizer.stop_token_ids)
    rollout_cfg = dataclasses.replace(cfg.rollout, stop_token_ids=stop_ids)
    # The trainer keeps its own fp32 copy; the initial buffers are deleted once it has it.
    loop = build_rl_loop(work.model_config, params, tokenizer=work.tokenizer, data_iter=work.train_rows, rl=cfg.rl,
                         ppo=cfg.ppo, optimizer=cfg.optimizer, advantages=cfg.advantages,
                         train_engine=cfg.train_engine,
                         workflow=_rollout_workflow(cfg, rollout_cfg, work.tokenizer, workflow),
                         engine=cfg.engine, mesh=cfg.mesh, eval_rows=work.eval_rows,
                         on_step=_StepRecorder(run, reward_before, bar),
                         checkpointer=run.checkpointer, resume=run.resuming,
                         checkpoint_extra=lambda: {"summary": _jsonable(summary), "history": _jsonable(run.history),
                                                   "wall_time_s": run.elapsed()},
                         on_rollouts=run.metrics_log.dump_rollouts if writer else None,
                         on_export=lambda out: _complete_export(out, work.tokenizer_dir, cfg.data),
                         donate_params=True, weight_sync=run.sync, reward_pool=run.reward_pool,
                         should_stop=stop and (lambda: stop.requested), lora=cfg.lora,
                         hooks=[api.Hook(hook, stage=stage, every=every) for hook, stage, every in hooks])
    params = None
    if loop.resume is not None:  # carried into later checkpoints by their summary
        summary.setdefault("resumed", []).append(loop.resume.report())
    if bar is not None and loop.first_step:
        bar.update(loop.first_step)
    result = loop.run()
    if bar is not None:
        bar.close()
    run.metrics_log.close()
    # A stop agreed by the loop, or (one process) a signal during the last step: its checkpoint is
    # on disk once the checkpointer closes.
    if loop.stop.stopped or (stop is not None and stop.requested and jax.process_count() == 1):
        run.checkpointer.close()
        stop.finish()
    # The final weights stay sharded on the train mesh; the engine and optimizer state go.
    params = result.final_params
    summary.update(steps=loop.first_step + result.steps, version=result.version,
                   rl_time_s=time.perf_counter() - t_rl, trained_tokens=loop.trained_tokens)
    loop.close()
    gc.collect()
    totals = _rollout_totals(result.rollout_report)
    if totals:
        summary["rollout"] = totals
    return params


def _finish(run: _Run, params: Any, reward_before: dict[str, int]) -> dict[str, Any]:
    """The summary's totals, final_model/, progress.png and summary.json; returns the summary."""
    cfg, summary = run.cfg, run.summary
    # Every process's reward calls (outcomes: succeeded, timeouts, crashes, errors, cancelled).
    summary["reward"] = _add_counts(reward_before, *gather_json(pool_totals(run.reward_pool)))
    summary.setdefault("steps", 0)
    summary.setdefault("trained_tokens", 0.0)
    summary["wall_time_s"] = run.elapsed()
    if run.checkpointer is not None:
        run.checkpointer.close()
    if cfg.stages.save_final_model:
        _save_final_model(run, params)
    del params
    if jax.process_index() == 0:
        if cfg.stages.plot and run.history:
            plot_progress(run.history, summary, run.run_dir / "progress.png")
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if run.metrics_log is not None:
        run.metrics_log.close()  # an `areal-jax sft` run's (RL closes its own; closing twice is a no-op)
    print(f"[areal-jax] summary: sft_accuracy={accuracy_text(summary['sft_accuracy'])} "
          f"final_accuracy={accuracy_text(summary['final_accuracy'])} steps={summary['steps']} "
          f"trained_tokens={summary['trained_tokens']:.0f} wall_time={summary['wall_time_s']:.0f}s -> {run.run_dir}",
          flush=True)
    return summary


def _save_final_model(run: _Run, params: Any) -> None:
    """final_model/ in HF format. Every process takes part (a tensor spanning processes is gathered
    alone, then written to host memory one at a time); process 0 writes, the tokenizer beside the weights."""
    work = run.work
    if jax.process_index() == 0:
        with paths.staged_dir(run.run_dir / "final_model") as out:
            save_params(params, work.model_config, out)
            copy_tokenizer_files(work.tokenizer_dir, out)
            write_prompt_settings(out, run.cfg.data)  # eval and generate encode prompts as the run did
    else:
        save_params(params, work.model_config, run.run_dir / "final_model", write=False)


def _complete_export(out: paths.Path, tokenizer_dir: pathlib.Path, data: Any) -> None:
    """What final_model/ holds besides the weights, for each CheckpointConfig.export_hf_interval_steps
    export: the tokenizer and the prompt encoding, so `eval --model` and `generate` take it as is."""
    copy_tokenizer_files(tokenizer_dir, out)
    write_prompt_settings(out, data)


def sft_step_index(sft: Any, step: int) -> int:
    """The run's step index of SFT step `step` (1-based): -SFTConfig.steps .. -1. RL's steps count
    from 0, so one axis orders the whole run (metrics.jsonl, TensorBoard, W&B), no index holds two
    stages' steps, and a resumed RL run, which drops the records from its resume step on, keeps SFT's."""
    return step - 1 - sft.steps


def metrics_logger(cfg: JobConfigs, run_dir: Any, *, progress: bool) -> MetricsLogger:
    """The run directory's metrics sinks as MetricsConfig asks (JSONL always, TensorBoard, W&B), on
    process 0; on the other processes a logger that records nothing. Every stage logs through one of
    these: they share the run's metrics.jsonl and its one W&B run."""
    writer = jax.process_index() == 0
    return MetricsLogger(run_dir, tensorboard=writer and cfg.metrics.tensorboard, jsonl=writer,
                         console=progress and writer, wandb=cfg.metrics if writer else None,
                         wandb_config=cfg.as_dict())


def _rollout_workflow(cfg: JobConfigs, rollout: Any, tokenizer: Any, given: Any = None) -> Any:
    """The run's workflow: `given` (an api.RolloutWorkflow instance, a workflow class, or a
    callable(rollout, tokenizer) -> workflow), else RLConfig.workflow's class, both classes built
    as areal_jax/rollout/workflow.py's contract says; or (neither) the RLVR config the loop builds
    its default workflow from. A class gets the prompts' encoder (DataConfig's chat_template_kwargs
    or prompt_template), so the turns it inserts match them."""
    if given is not None and not isinstance(given, type):
        if isinstance(given, api.RolloutWorkflow):
            return given
        if not callable(given):
            raise TypeError(f"workflow= {type(given).__name__} lacks {', '.join(missing_workflow_members(given))} of "
                            "api.RolloutWorkflow: subclass areal_jax.RolloutWorkflow (it has their defaults)")
        return given(rollout, tokenizer)
    if given is None and cfg.rl.workflow is None:
        return rollout
    # None: the arithmetic task, whose prompts are the chat template without variables.
    encoder = None if cfg.data is None else cfg.data.prompt_encoder(tokenizer)
    cls = given if given is not None else resolve_workflow_class(cfg.rl.workflow)
    return make_workflow(cls, rollout, tokenizer, cfg.workflow_config, prompt_encoder=encoder)


def _on_any_process(flag: bool) -> bool:
    return bool(agree_max(int(flag))) if jax.process_count() > 1 else flag


def _rollout_totals(report: Any) -> dict[str, Any]:
    """Where the admitted prompt groups ended, summed over every process's rollout controller
    (each host generates for its own share of the batch). All processes must call this."""
    local = {} if report is None else {
        "admitted": report.admitted, "accepted": report.accepted, "rejected": dict(report.rejected),
        "failed": report.failed, "in_flight_at_shutdown": report.in_flight}
    totals: dict[str, Any] = {}
    for part in gather_json(local):
        for key, value in part.items():
            if isinstance(value, dict):
                merged = totals.setdefault(key, {})
                for reason, count in value.items():
                    merged[reason] = merged.get(reason, 0) + count
            else:
                totals[key] = totals.get(key, 0) + value
    return totals


def _decode_float(value: Any) -> Any:
    return {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.get(value, value) \
        if isinstance(value, str) else value


def _jsonable(obj: Any) -> Any:
    """Strict JSON for the checkpoint's metadata (NaN and infinities become strings)."""
    from areal_jax.metrics import to_jsonable

    return to_jsonable(obj)


def _add_counts(*counts: dict[str, int]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for key, value in c.items():
            total[key] = total.get(key, 0) + int(value)
    return total
