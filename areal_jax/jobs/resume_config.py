"""`train --resume`: the run continues with its own bindings (RUN/config.gin). Flags that would
change them (another --gin_file, a --gin_param) are shown field by field and take effect only with
--override_config: a resume given the original .gin file but not its --gin_params would otherwise
silently train with another learning rate, mode or reward."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from areal_jax import paths
from areal_jax.job_config import JobConfigs
from areal_jax.jobs.inputs import InputError
from areal_jax.jobs.run_data import absolute_paths
from areal_jax.jobs.run_settings import resume_gin_files


def _fields(cfg: JobConfigs) -> dict[str, Any]:
    """'Class.field' -> value as config.json spells it (tuples as lists), for every config part."""
    flat = {}
    for name, part in json.loads(json.dumps(cfg.as_dict(), default=str)).items():
        cls = type(getattr(cfg, name)).__name__
        for field, value in (part or {}).items():
            flat[f"{cls}.{field}"] = value
    return flat


def config_changes(old: JobConfigs, new: JobConfigs) -> list[str]:
    """'Class.field: old -> new' for every field whose value differs."""
    a, b = _fields(old), _fields(new)
    return [f"{key}: {a.get(key)!r} -> {b.get(key)!r}" for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]


def resume_configs(run_dir: str, gin_files: Sequence[str], gin_params: Sequence[str], *, override: bool,
                   num_processes: int | None = None) -> JobConfigs:
    """The resumed run's configs: RUN/config.gin's, or (`override`) those the flags give, the
    changes printed. Flags that change any field without `override`: InputError listing them."""
    from areal_jax.jobs.configs import load_job_configs

    if gin_files and not (paths.as_path(run_dir) / "config.gin").is_file():  # checkpoints kept elsewhere
        return load_job_configs(list(gin_files), list(gin_params), run_dir=run_dir, num_processes=num_processes)
    saved = resume_gin_files(run_dir)
    own = absolute_paths(load_job_configs(saved, [], run_dir=run_dir, num_processes=num_processes))
    if not gin_files and not gin_params:
        return own
    asked = absolute_paths(load_job_configs(list(gin_files) or saved, list(gin_params), run_dir=run_dir,
                                            num_processes=num_processes))
    changes = config_changes(own, asked)
    if not changes:
        return own
    if not override:
        raise InputError(f"--resume: the flags change the run's own config ({run_dir}/config.gin): "
                         f"{'; '.join(changes)}; pass --override_config to apply them, or drop them to resume as the "
                         "run was")
    print("[areal-jax] --override_config: the resumed run's config changes:\n" +
          "\n".join(f"  {change}" for change in changes), file=sys.stderr, flush=True)
    return asked


def _model_config(cfg: JobConfigs) -> Any:
    """The model the configs describe, from its config alone (no weights loaded)."""
    from areal_jax.jobs.inputs import input_errors

    if cfg.model.path is None:
        from areal_jax.tasks.tokenizer_builder import task_model_config

        return task_model_config(hidden_size=cfg.model.hidden_size, num_layers=cfg.model.num_layers,
                                 num_experts=cfg.model.num_experts, num_experts_per_tok=cfg.model.num_experts_per_tok)
    from areal_jax.models.hf_io import read_config

    with input_errors("ModelSource.path"):
        return read_config(cfg.model.path)


def check_checkpoint_matches(cfg: JobConfigs) -> None:
    """A resume: raises InputError naming the first weight or LoRAConfig field whose shape differs
    from the latest finished checkpoint step's (its metadata only is read), so that nothing is
    written for a resume the restore would refuse with a traceback."""
    import math

    from areal_jax.checkpoint import SavedParams, finalized_steps
    from areal_jax.jobs.export import saved_lora
    from areal_jax.models.hf_io import leaf_keys
    from areal_jax.models.transformer import param_shapes

    directory = paths.as_path(cfg.checkpoint.directory)
    step = finalized_steps(directory)[-1]
    try:
        saved = SavedParams(directory, step)
    except (OSError, ValueError) as e:
        raise InputError(f"--resume: checkpoint step {step} under {directory} is unreadable: {e}") from None
    where = f"checkpoint step {step} under {directory}"
    model_cfg = _model_config(cfg)
    want = param_shapes(model_cfg)
    for leaf in leaf_keys(model_cfg):
        shape = tuple(want["layers"][leaf[1]] if leaf[0] == "layers" else want[leaf[0]])
        got = saved.shapes.get(leaf)
        if got is None or got[0] != shape:
            raise InputError(f"--resume: the model's weight {'/'.join(leaf)} is {shape}, {where} holds "
                             f"{'none' if got is None else got[0]}: ModelSource differs from the run's")
    lora = saved_lora(saved)
    rank = lora.rank if lora is not None else 0
    if rank != cfg.lora.rank:
        raise InputError(f"--resume: LoRAConfig.rank is {cfg.lora.rank}, {where} holds adapters of rank {rank}")
    if lora is not None:
        ours = tuple(sorted(cfg.lora.targets))
        if tuple(sorted(lora.targets)) != ours:
            raise InputError(f"--resume: LoRAConfig.targets are {ours}, {where} holds adapters on "
                             f"{tuple(sorted(lora.targets))}")
        if not math.isclose(lora.alpha, cfg.lora.alpha, rel_tol=1e-5):
            raise InputError(f"--resume: LoRAConfig.alpha is {cfg.lora.alpha}, {where} was trained with {lora.alpha:g}")

