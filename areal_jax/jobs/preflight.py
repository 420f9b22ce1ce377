"""Checks run before the model loads or any stage starts: the job's reward against its data, the
generation engine's cache and the LoRA targets against the model (`check_model_fit`).

A reward that cannot read the answers the data teaches scores every rollout 0: RL then runs to
the end with nothing to learn from and no error. Where rows carry reference solutions (GSM8K's
`answer`, MATH's `solution`, AReaL's `solutions`), the configured reward scores a sample of them
against their own gold answers; a mean below TaskSource.solution_reward_min refuses the run in
one line naming the reward, the file and the score.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from areal_jax.data.formats import RowFormatError, parse_record, solution_pair
from areal_jax.data.sources import iter_records
from areal_jax.job_config import JobConfigs
from areal_jax.jobs.inputs import InputError
from areal_jax.reward.scoring import RewardCheckFailed

SAMPLE_ROWS = 64  # reference solutions scored per file: the first ones that parse


def solution_samples(path: str, fmt: str, limit: int = SAMPLE_ROWS) -> Iterator[tuple[str, str]]:
    """(reference solution, gold answer) of the first `limit` rows of `path` that have both;
    rows without a reference solution (code, chats) or that do not parse are passed over."""
    found = 0
    for raw in itertools.islice(iter_records(path), 20 * limit):  # a file of chats is not read to its end
        if raw.record is None:
            continue
        try:
            _, solution = solution_pair(raw.record, fmt)
            row = parse_record(raw.record, source=raw.source, fmt=fmt)
        except (RowFormatError, ValueError):
            continue
        if row.answer is None:
            continue
        yield solution, row.answer
        found += 1
        if found == limit:
            return


def checked_files(cfg: JobConfigs) -> list[str]:
    """The files the run trains or evaluates on, each once, in the order the run reads them."""
    if cfg.task.kind != "dataset" or cfg.data is None:
        return []
    files: list[str] = []
    if cfg.stages.sft:
        files += list(cfg.sft.paths or cfg.data.paths)
    if cfg.stages.rl:
        files += list(cfg.data.paths)
    if cfg.task.eval_size:
        files += list(cfg.task.eval_paths)
    return list(dict.fromkeys(files))


def check_solution_rewards(cfg: JobConfigs, score: Callable[[Sequence[tuple]], list[float]]) -> dict[str, float]:
    """Mean reward of each checked file's reference solutions (`score` maps (text, gold) calls to
    rewards; `RewardScorer.checked_map`); InputError for the first file below
    TaskSource.solution_reward_min, or for a reward that fails on a solution (raises, returns no
    finite number, runs past its deadline): one line naming it and its first error."""
    threshold = cfg.task.solution_reward_min
    means: dict[str, float] = {}
    if not threshold:
        return means
    for path in checked_files(cfg):
        calls = list(solution_samples(path, cfg.data.format))
        if not calls:
            continue
        try:
            rewards = score(calls)
        except RewardCheckFailed as e:  # the reward's own error, not the data's format
            raise InputError(f"RLVRConfig.reward = {cfg.rollout.reward!r} failed on a reference solution of "
                             f"{path}: {e}") from None
        means[path] = sum(rewards) / len(rewards)
        if means[path] < threshold:
            example = calls[0][0].strip().splitlines()[-1][-60:]
            raise InputError(
                f"RLVRConfig.reward = {cfg.rollout.reward!r} scores the reference solutions of {path} "
                f"{means[path]:.2f} on average ({len(calls)} rows), below TaskSource.solution_reward_min = "
                f"{threshold}: it cannot read the answers these rows teach (a solution ends {example!r}). "
                f"Use a reward that reads them (e.g. RLVRConfig.reward = 'gsm8k' for '#### N'), or set "
                f"TaskSource.solution_reward_min = 0 to train anyway")
    return means


def check_model_fit(cfg: JobConfigs, platform: str) -> None:
    """What the trainer or the RL engine would refuse once built, checked from the model's config
    alone (no weights): LoRA targets the model does not have (`lora.check_targets`), a paged pool
    (`EngineConfig.kv_pool_bytes`) smaller than one max_seq_len sequence, `attention_impl = "pallas"`
    where `platform` has no such kernel. ConfigError of one line; run before anything is written.
    A model on remote storage (gs://) is checked for the kernel only: its config is read later."""
    import jax.numpy as jnp

    from areal_jax.config_system import ConfigError
    from areal_jax.generation.paged import page_bytes
    from areal_jax.kernels.paged_attention import KERNELS
    from areal_jax.models.lora import check_targets

    local = cfg.model.path is None or "://" not in cfg.model.path
    engine = cfg.engine
    if cfg.lora.enabled and local:
        try:
            check_targets(_model_config(cfg), cfg.lora)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if not cfg.stages.rl or engine.layout(platform) != "paged":
        return
    try:
        KERNELS.resolve(engine.attention_impl, platform)
        if engine.kv_pool_bytes and local:
            model, weights = _model_config(cfg), jnp.dtype(cfg.rl.generation_dtype or cfg.model.dtype)
            engine.pool_pages(page_bytes(model, engine.page_size, jnp.dtype(engine.storage_dtype(weights))), 1,
                              engine.kv_scale_bytes(model.num_layers, model.num_kv_heads, weights))
    except ValueError as e:
        raise ConfigError(f"EngineConfig: {e}") from None


def _model_config(cfg: JobConfigs) -> Any:
    """The policy's ModelConfig from its config.json (or the built-in model's fields): no weights."""
    if cfg.model.path is None:
        from areal_jax.tasks.tokenizer_builder import task_model_config

        return task_model_config(hidden_size=cfg.model.hidden_size, num_layers=cfg.model.num_layers,
                                 num_experts=cfg.model.num_experts, num_experts_per_tok=cfg.model.num_experts_per_tok)
    from areal_jax.models.hf_io import read_config

    return read_config(cfg.model.path)


def sandbox_for_run(cfg: JobConfigs, run_dir: str | os.PathLike) -> Any:
    """cfg.sandbox with the run's local data files, run directory and checkpoint directory added to
    its hidden_paths: a sandboxed completion must not read the expected outputs of the test cases."""
    import dataclasses

    files = list(cfg.data.paths) if cfg.data is not None else []
    files += list(cfg.task.eval_paths) + list(cfg.sft.paths) + list(cfg.sft.eval_paths)
    files += [str(run_dir)] + ([str(cfg.checkpoint.directory)] if cfg.checkpoint is not None else [])
    local = [os.path.abspath(f) for f in files if "://" not in str(f)]
    return dataclasses.replace(cfg.sandbox, hidden_paths=tuple(dict.fromkeys(cfg.sandbox.hidden_paths + tuple(local))))
