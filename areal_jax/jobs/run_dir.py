"""The run directory: whether a run may start, resume or overwrite there, and what --overwrite
removes. Nothing here writes unless the checks have passed. Run and checkpoint directories may be
local or remote (gs://): they are handled as `areal_jax.paths` paths throughout."""

from __future__ import annotations

import json
import logging
import os

import jax
from jax.experimental import multihost_utils

from areal_jax import paths
from areal_jax.checkpoint import clear_checkpoints, finalized_steps
from areal_jax.checkpoint_validation import NoIntactCheckpoint, intact_resume_step
from areal_jax.job_config import JobConfigs
from areal_jax.jobs.inputs import InputError

logger = logging.getLogger(__name__)

# Any of these in a run directory means a run was started there.
RUN_RECORDS = ("config.gin", "config.json", "summary.json", "metrics.jsonl", "final_model")
# What --overwrite removes besides checkpoint steps: every record a run writes (nothing else).
# wandb_run_id goes, so an overwriting run starts its own W&B run; wandb/ stays (offline runs there
# may not be synced yet).
OLD_RUN_FILES = RUN_RECORDS + ("progress.png", "tensorboard", "rollouts", "wandb_run_id", "model_config.json",
                                "data_files.json")

# Fields a resumed run must share with the run it continues, per JobConfigs attribute (None: every
# field). The checkpoint holds weights and Adam state shaped by the model (ModelSource) and laid
# out on the train mesh, and a data position per process (MeshConfig decides the processes' shares);
# its staleness counters count prompt groups of batch_size x n_samples trajectories; the number of
# optimizer updates per step (PPOConfig) and the micro-batch split (TrainEngineConfig) define what a step computes, so a
# "sync" resume reproduces the uninterrupted run only with them unchanged. No engine state is saved
# (slots, KV cache and programs are rebuilt on every start), so EngineConfig's sizes may change,
# e.g. to fit memory; only its seed is kept: every sampled token's randomness derives from it.
# LoRAConfig shapes the adapters and their optimizer state, and seeds their dropout.
RESUME_FIELDS: dict[str, tuple[str, ...] | None] = {
    "model": None, "mesh": None, "rl": ("batch_size",), "rollout": ("n_samples",),
    "ppo": ("num_minibatches",), "train_engine": ("max_tokens_per_microbatch",), "engine": ("seed",), "lora": None}
# What marks a directory as a run's (RUN_RECORDS less config.json, which an HF model directory holds
# too), or a directory of checkpoint steps: what no export or copy may replace.
RUN_MARKERS = ("config.gin", "summary.json", "metrics.jsonl", "model_config.json", ".areal-jax.lock",
               ".areal-jax.lease")
# An output directory replaced whole is searched this far for a run directory inside it; one holding
# more entries is no model directory, and is refused rather than searched on.
OUT_SEARCH_LIMIT = 20_000


def run_marker(directory: paths.PathLike) -> str | None:
    """What shows `directory` to be a run directory or a checkpoint directory (a marker file, or
    finished checkpoint steps), None when nothing does."""
    directory = paths.as_path(directory)
    for name in RUN_MARKERS:
        if (directory / name).exists():
            return name
    for name, where in (("checkpoints/", directory / "checkpoints"), ("checkpoint steps", directory)):
        if finalized_steps(where):
            return name
    return None


def check_replaceable(out: paths.PathLike, field: str, reads: dict[str, paths.PathLike]) -> None:
    """Raises InputError unless the directory `out` may be replaced whole by an export: it is not,
    and does not contain, any path it is made from (`reads`: what -> path), a run directory or a
    checkpoint directory. Writes nothing."""
    target = paths.absolute(out)
    reads = {what: paths.absolute(path) for what, path in reads.items()}
    for verb, hit in (("is", lambda path: target == path), ("contains", lambda path: target in path.parents)):
        for what, path in reads.items():
            if hit(path):
                raise InputError(f"{field} {out} {verb} {what} {path}, which this export reads: choose another "
                                 f"{field}")
    if not target.is_dir():
        return
    marker = run_marker(target)
    if marker is not None:
        raise InputError(f"{field} {out} is a run directory (it holds {marker}): choose another {field}")
    if paths.is_remote(target):
        return
    seen = 0
    for root, dirs, _ in os.walk(target):
        for name in dirs:
            seen += 1
            marker = run_marker(os.path.join(root, name))
            if marker is not None:
                raise InputError(f"{field} {out} contains the run directory {os.path.join(root, name)} (it holds "
                                 f"{marker}): choose another {field}")
        if seen > OUT_SEARCH_LIMIT:
            raise InputError(f"{field} {out} holds over {OUT_SEARCH_LIMIT} directories, which no model directory "
                             f"does: choose another {field}")


def _checkpoint_dirs(cfg: JobConfigs, run_dir: paths.Path) -> list[paths.Path]:
    """The run directory's checkpoints/ and the CheckpointConfig directory, if elsewhere."""
    dirs = [run_dir / "checkpoints"]
    if cfg.checkpoint is not None and paths.absolute(cfg.checkpoint.directory) != paths.absolute(dirs[0]):
        dirs.append(paths.as_path(cfg.checkpoint.directory))
    return dirs


def previous_run(cfg: JobConfigs, run_dir: paths.PathLike) -> list[str]:
    """What shows an earlier run in `run_dir` (records, checkpoint steps); [] for a fresh directory."""
    run_dir = paths.as_path(run_dir)
    held = [name + ("/" if (run_dir / name).is_dir() else "") for name in RUN_RECORDS if (run_dir / name).exists()]
    for directory in _checkpoint_dirs(cfg, run_dir):
        steps = finalized_steps(directory)
        if steps:
            name = "checkpoints" if directory == run_dir / "checkpoints" else str(directory)
            held.append(f"{name}/ (step {steps[-1]})")
    return held


def check_run_dir(cfg: JobConfigs, run_dir: paths.PathLike, *, resume: bool, overwrite: bool) -> None:
    """Raises InputError unless the run may start in `run_dir` as asked; writes nothing."""
    run_dir = paths.as_path(run_dir)
    try:
        paths.check_reachable(run_dir, "--run_dir")
    except ValueError as e:
        raise InputError(str(e)) from None
    if resume and overwrite:
        raise InputError("--resume continues the run in the directory and --overwrite removes it: pass one")
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"--run_dir {run_dir} is not a directory")
    if resume:
        _check_resumable(cfg, run_dir)
        return
    held = previous_run(cfg, run_dir)
    if held and not overwrite:
        raise InputError(f"{run_dir} already holds a run ({', '.join(held)}): pass --overwrite to replace it, "
                         "--resume to continue it, or choose another --run_dir")


def _check_resumable(cfg: JobConfigs, run_dir: paths.Path) -> None:
    if cfg.checkpoint is None:
        raise InputError(f"--resume: nothing to resume in {run_dir}: Stages.checkpoint = False, so no "
                         "checkpoint is saved or read")
    directory = paths.as_path(cfg.checkpoint.directory)
    if not finalized_steps(directory):
        raise InputError(f"--resume: nothing to resume: no finished checkpoint under {directory}")
    saved = run_dir / "config.json"
    if not saved.is_file():  # checkpoints kept elsewhere, the run directory new: nothing to compare
        logger.warning("%s not found: the resumed run's config is not compared with the saved one", saved)
    else:
        changed = resume_changes(_read_json(saved), cfg)
        if changed:
            raise InputError(f"--resume: fields a resumed run must keep differ from {saved}: {'; '.join(changed)}")
    # A broken newest step is set aside (the run holds the directory's lock); the others see the
    # outcome after on_every_process's agreement.
    if jax.process_index() == 0:
        try:
            intact_resume_step(directory)
        except NoIntactCheckpoint as e:
            raise InputError(f"--resume: {e}") from None


def _read_json(path: paths.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: unreadable ({e})") from None


def resume_changes(saved: dict, cfg: JobConfigs) -> list[str]:
    """'Class.field: old -> new' for each RESUME_FIELDS field whose value differs from `saved` (a
    config.json dict); fields the saved file lacks (an older version wrote it) are not compared."""
    new = json.loads(json.dumps(cfg.as_dict(), default=str))  # as config.json spells values
    changes = []
    for key, fields in RESUME_FIELDS.items():
        old_part, new_part = saved.get(key) or {}, new.get(key) or {}
        for field in fields or sorted(new_part):
            if field in old_part and old_part[field] != new_part.get(field):
                changes.append(f"{type(getattr(cfg, key)).__name__}.{field}: "
                               f"{old_part[field]!r} -> {new_part.get(field)!r}")
    return changes


def remove_previous_run(cfg: JobConfigs, run_dir: paths.PathLike) -> None:
    """--overwrite: the earlier run's records and checkpoint steps go (process 0 removes, all wait),
    so metrics.jsonl starts empty and checkpoints from step 0."""
    run_dir = paths.as_path(run_dir)
    if jax.process_index() == 0:
        for name in OLD_RUN_FILES:
            paths.remove(run_dir / name)
        for directory in _checkpoint_dirs(cfg, run_dir):
            clear_checkpoints(directory)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("areal-jax: previous run removed")
