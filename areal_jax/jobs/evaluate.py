"""An evaluation job: a model directory, prompt files and an EvalConfig -> pass@k report.

`evaluate_model` is what `areal-jax eval` and `Trainer.evaluate` run: the reward checked and its
pool opened (in-process rewards get none), the model read onto this process's devices, every row
once in file order, samples.jsonl and report.json written to the output directory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from areal_jax import config_system as cs
from areal_jax import paths

__all__ = ["evaluate_model", "evaluate_run", "load_model"]


def evaluate_model(model_dir: str, data: Any, cfg: Any, *, pool_cfg: Any, sandbox: Any, out_dir: paths.PathLike,
                   tokenizer_dir: str | None = None, before_load: Callable[[], None] | None = None) -> Any:
    """The EvalReport of `model_dir` on `data` (a DataConfig) under `cfg` (an EvalConfig).

    Config and input problems raise ConfigError / InputError (one line) before the model loads;
    `before_load` runs just before it (e.g. jax.distributed's start). All processes call this."""
    import jax

    from areal_jax.data.pipeline import build_prompt_loader
    from areal_jax.evaluation import engine_mesh, run_evaluation
    from areal_jax.jobs.inputs import check_data_paths, input_errors
    from areal_jax.reward.composite import check_terms, is_learned
    from areal_jax.reward.registry import check_reward_function
    from areal_jax.reward.sandbox import SandboxUnavailable
    from areal_jax.reward.scoring import open_reward_pool

    # Every row once, in file order (every process reads them all; run_evaluation shares them out).
    data = dataclasses.replace(data, shuffle=False, num_epochs=1, even_shards=False)
    check_data_paths(data.paths, "DataConfig.paths")
    verifiers = cfg.reward if isinstance(cfg.reward, str) else [n for n in cfg.terms if not is_learned(n)]
    try:
        if isinstance(cfg.reward, str):
            check_reward_function(cfg.reward, "EvalConfig.reward")
        else:  # a composite's verifiers resolve and its reward models' directories hold one
            check_terms(cfg.reward, check_reward_function, "EvalConfig.reward")
    except ValueError as e:
        raise cs.ConfigError(str(e)) from None
    try:  # in worker processes under EvalConfig.reward_timeout_s, unless declared in-process
        # The eval files hold the expected outputs of code test cases: hidden from sandboxed programs.
        hidden = tuple(os.path.abspath(p) for p in data.paths if "://" not in str(p))
        if sandbox is not None:
            sandbox = dataclasses.replace(sandbox, hidden_paths=tuple(dict.fromkeys(sandbox.hidden_paths + hidden)))
        pool = open_reward_pool(verifiers, pool_cfg, sandbox)
    except (SandboxUnavailable, ValueError) as e:
        raise cs.ConfigError(str(e)) from None
    out_dir = paths.as_path(out_dir)
    try:
        if before_load is not None:
            before_load()
        # On this process's devices: every host of a multi-process eval builds its own mesh.
        tokenizer, model = load_model(model_dir, tokenizer_dir, dtype=cfg.dtype,
                                      mesh_for=lambda model_cfg: engine_mesh(model_cfg, cfg.tensor_parallel))
        with input_errors("--tokenizer" if tokenizer_dir else "--model"):
            data.prompt_encoder(tokenizer)  # a base model needs DataConfig.prompt_template: one line
        with input_errors("DataConfig.paths"):
            rows = build_prompt_loader(data, tokenizer)
        out_dir.mkdir(parents=True, exist_ok=True)
        report = run_evaluation(model, tokenizer, rows, cfg, reward_pool=pool, out_path=out_dir / "samples.jsonl")
    finally:
        if pool is not None:
            pool.close(wait=False)  # kills workers still busy (an interrupt) and sweeps their sandboxes
    if jax.process_index() == 0:
        (out_dir / "report.json").write_text(report.to_json())
    return report


def evaluate_run(run_dir: str, files: Sequence[str], *, out_dir: paths.PathLike, n_samples: int = 1,
                 temperature: float = 0.0, reward: Any = None, judge: Any = None, reward_pool: Any = None,
                 sandbox: Any = None) -> dict[str, Any]:
    """A finished run's final model on `files`, evaluated as the run evaluated itself (its reward,
    prompt encoding and completion budget: `run_settings.eval_defaults`); pass@1..n_samples.
    Returns the report's overall figures."""
    from areal_jax.data.pipeline import DataConfig
    from areal_jax.evaluation import EvalConfig
    from areal_jax.jobs import run_settings
    from areal_jax.reward.pool import RewardPoolConfig
    from areal_jax.reward.sandbox import SandboxLimits

    model_dir, eval_over, data_over = run_settings.eval_defaults(run_dir, require_eval_paths=False)
    data_over.update(run_settings.unbound_prompt_settings(run_settings.read_prompt_settings(model_dir), {}))
    data_over["paths"] = tuple(files)
    if reward is not None:
        eval_over["reward"] = reward
    if judge is not None:
        eval_over["judge"] = judge
    cfg = EvalConfig(**{**eval_over, "n_samples": n_samples, "temperature": temperature,
                        "ks": tuple(range(1, n_samples + 1))})
    report = evaluate_model(model_dir, DataConfig(**data_over), cfg, pool_cfg=reward_pool or RewardPoolConfig(),
                            sandbox=sandbox or SandboxLimits(), out_dir=out_dir)
    return dict(report.overall)


def load_model(model_dir: str, tokenizer_dir: str | None = None, *, dtype: str = "float32", mesh_for=None):
    """(tokenizer, model) of an HF directory; its problems are InputErrors naming the flag and file.

    The weights are read in `dtype` straight onto `mesh_for(model config)` (each device reads its
    slice; never the whole float32 model on one device), or onto the first local device when
    `mesh_for` is None or returns None. `mesh_for` raises ConfigError for an impossible split,
    before any weight is read."""
    from areal_jax.jobs.inputs import check_model_dir, check_tokenizer_dir, input_errors
    from areal_jax.models import load_pretrained
    from areal_jax.models.hf_io import read_config
    from areal_jax.models.tokenizer import Tokenizer

    tokenizer_flag = "--tokenizer" if tokenizer_dir else "--model"
    check_model_dir(model_dir, "--model")
    check_tokenizer_dir(tokenizer_dir or model_dir, tokenizer_flag)
    with input_errors(tokenizer_flag):
        tokenizer = Tokenizer.from_pretrained(tokenizer_dir or model_dir)
    mesh = mesh_for(read_config(model_dir)) if mesh_for is not None else None  # check_model_dir parsed it
    with input_errors("--model"):
        return tokenizer, load_pretrained(model_dir, dtype=dtype, mesh=mesh)
