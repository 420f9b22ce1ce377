"""What a training job works on: the tokenizer, the initial weights (laid out on the train mesh),
the RL prompt stream, SFT's examples and the held-out rows, from the built-in task or the user's files."""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from areal_jax import config_system as cs
from areal_jax import paths
from areal_jax.job_config import JobConfigs
from areal_jax.jobs.inputs import InputError, input_errors
from areal_jax.models.hf_io import load_params
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.models.transformer import init_params
from areal_jax.parallel.meshes import check_model_fits_mesh
from areal_jax.parallel.transfer_plan import model_partition_specs


@dataclasses.dataclass
class Workload:
    model_config: Any
    params: Any
    tokenizer: Tokenizer
    tokenizer_dir: pathlib.Path
    train_rows: Any  # iterator of loader rows
    eval_rows: list
    sft_examples: list
    validation_rows: list = dataclasses.field(default_factory=list)  # SFT's accuracy checks
    sft_val_examples: list = dataclasses.field(default_factory=list)  # SFT's held-out loss (SFTConfig.eval_paths)


def prepare_workload(cfg: JobConfigs, run_dir: paths.Path, *, mesh: Mesh | None = None) -> Workload:
    """Tokenizer, initial weights, prompts and held-out rows for the job.

    mesh: the train mesh: the initial weights are laid out on it by the training rule table, each
    device reading only its slice. Without, they land on this process's first device.
    """
    if cfg.model.path is None:
        from areal_jax.tasks import arithmetic as ar
        from areal_jax.tasks.tokenizer_builder import build_tokenizer, task_model_config

        # The tokenizer is read from local files: a remote run directory gets a copy (run_train).
        tokenizer_dir = build_tokenizer(pathlib.Path(tempfile.mkdtemp(prefix="areal-jax-tokenizer-"))
                                        if paths.is_remote(run_dir) else run_dir / "tokenizer")
        tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
        model_cfg = task_model_config(hidden_size=cfg.model.hidden_size, num_layers=cfg.model.num_layers,
                                      num_experts=cfg.model.num_experts,
                                      num_experts_per_tok=cfg.model.num_experts_per_tok)
        params = init_params(model_cfg, cfg.model.init_seed, dtype=cfg.model.dtype)
        if mesh is not None:  # a small built-in model: drawn whole, then placed
            params = _place_on_train_mesh(model_cfg, mesh, jax.device_get(params))
    else:
        tokenizer_dir = pathlib.Path(cfg.model.tokenizer_path or cfg.model.path)
        with input_errors("ModelSource.tokenizer_path" if cfg.model.tokenizer_path else "ModelSource.path"):
            tokenizer = Tokenizer.from_pretrained(tokenizer_dir)
        with input_errors("ModelSource.path"):
            model_cfg, params = load_params(cfg.model.path, dtype=cfg.model.dtype, mesh=mesh)
    try:
        check_model_fits_mesh(model_cfg, cfg.mesh)
    except ValueError as e:
        raise cs.ConfigError(str(e)) from None
    if cfg.task.kind == "arithmetic":
        from areal_jax.tasks import arithmetic as ar

        if not tokenizer.has_chat_template:  # its prompts are chats: one line, not the template's traceback
            raise InputError(f"ModelSource.path: the tokenizer in {tokenizer_dir} has no chat template (a base "
                             "model?), and the built-in arithmetic task (no DataConfig.paths bound) prompts through "
                             "one: bind DataConfig.paths to your files and DataConfig.prompt_template, e.g. "
                             "'Question: {question}\\nAnswer:'")
        # Validation problems continue the training stream: distinct from every training problem.
        train_and_val = ar.problems(cfg.arithmetic, "train", cfg.task.train_size + cfg.task.validation_size,
                                    seed=cfg.task.seed)
        train, validation = train_and_val[:cfg.task.train_size], train_and_val[cfg.task.train_size:]
        held_out = ar.problems(cfg.arithmetic, "test", cfg.task.eval_size, seed=cfg.task.seed)
        shard = slice(jax.process_index(), None, jax.process_count())
        stream = ar.ProblemStream(tokenizer, train[shard], seed=cfg.task.seed + 1 + jax.process_index())
        return Workload(model_cfg, params, tokenizer, tokenizer_dir, stream, list(ar.prompt_rows(tokenizer, held_out[shard])),
                        ar.sft_examples(tokenizer, train), list(ar.prompt_rows(tokenizer, validation)))
    from areal_jax.data.pipeline import build_prompt_loader

    with input_errors("ModelSource.tokenizer_path" if cfg.model.tokenizer_path else "ModelSource.path"):
        cfg.data.prompt_encoder(tokenizer)  # no chat template and no DataConfig.prompt_template: one line
    sft_examples, sft_val = _sft_data(cfg, tokenizer) if cfg.stages.sft else ([], [])
    loader = None  # `areal-jax sft` reads no RL prompts (its files may hold only chats)
    if cfg.stages.rl:
        with input_errors("DataConfig.paths"):
            loader = build_prompt_loader(cfg.data, tokenizer, process_index=jax.process_index(),
                                         process_count=jax.process_count(), max_seq_len=cfg.engine.max_seq_len)
    eval_rows: list = []
    if cfg.task.eval_paths and cfg.task.eval_size:
        eval_cfg = dataclasses.replace(cfg.data, paths=cfg.task.eval_paths, shuffle=False, num_epochs=1,
                                       even_shards=False)
        with input_errors("TaskSource.eval_paths"):
            eval_loader = build_prompt_loader(eval_cfg, tokenizer, process_index=jax.process_index(),
                                              process_count=jax.process_count())
        eval_rows = [r for _, r in zip(range(cfg.task.eval_size), eval_loader)]
    return Workload(model_cfg, params, tokenizer, tokenizer_dir, loader, eval_rows, sft_examples,
                    sft_val_examples=sft_val)


def _sft_data(cfg: JobConfigs, tokenizer: Tokenizer) -> tuple[list, list]:
    """SFT's training and held-out examples from SFTConfig.paths (default DataConfig.paths) and
    SFTConfig.eval_paths; no usable row is an InputError naming the field, the files and why."""
    from areal_jax.data.sft_data import load_sft_examples

    out = []
    for field, files in (("SFTConfig.paths" if cfg.sft.paths else "DataConfig.paths", cfg.sft.paths or cfg.data.paths),
                         ("SFTConfig.eval_paths", cfg.sft.eval_paths)):
        examples = []
        if files:
            with input_errors(field):
                examples, _ = load_sft_examples(dataclasses.replace(cfg.data, paths=tuple(files)), tokenizer,
                                                max_len=cfg.sft.max_len)
        out.append(examples)
    return out[0], out[1]


def _place_on_train_mesh(model_cfg: Any, mesh: Mesh, host: Any) -> Any:
    """Host arrays laid out on the train mesh by the training rules (each device takes its slice)."""
    specs, _ = model_partition_specs(model_cfg, mesh, 1)
    return jax.tree.map(lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                                                   lambda index: a[index]), host, specs)
