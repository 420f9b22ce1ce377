"""Checks of what a job is given (model directory, tokenizer, data files), run before anything
loads, and the one error type a user sees for them: InputError, one line naming the field and file."""

from __future__ import annotations

import contextlib
import json
import pathlib
import struct
from typing import Any, Iterator

import jax

from areal_jax.job_config import JobConfigs
from areal_jax.models.hf_io import read_config
from areal_jax.parallel.distributed import agree_max


class InputError(Exception):
    """A problem with what the run was given (model, data, run directory), reported as one line
    naming the file or field: `areal-jax` prints it without a traceback and exits 2."""


@contextlib.contextmanager
def input_errors(field: str) -> Iterator[None]:
    """Turns the file and format errors of loading a model or data into an InputError naming `field`
    (the loaders' own messages name the file, tensor or row)."""
    try:
        yield
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError; ConfigError a ValueError
        raise InputError(f"{field}: {' '.join(str(e).split())}") from e


def on_every_process(check) -> None:
    """Runs `check` on every process: if it fails on one, it fails on all (none goes on alone)."""
    error = None
    try:
        check()
    except InputError as e:
        error = e
    if jax.process_count() > 1 and agree_max(int(error is not None)) and error is None:
        raise InputError("another process refused to start the run (its error names the reason)")
    if error is not None:
        raise error



def check_sources(cfg: JobConfigs) -> None:
    """The model and data checks that load nothing: directories and files exist, config.json reads
    as a model config, weight files are whole. Raises InputError naming the field and file."""
    if cfg.model.path is not None:
        check_model_dir(cfg.model.path, "ModelSource.path")
        tokenizer_field = "ModelSource.tokenizer_path" if cfg.model.tokenizer_path else "ModelSource.path"
        check_tokenizer_dir(cfg.model.tokenizer_path or cfg.model.path, tokenizer_field)
    if cfg.task.kind == "dataset":
        check_data_paths(cfg.data.paths, "DataConfig.paths")
        if cfg.stages.sft:
            check_data_paths(cfg.sft.paths, "SFTConfig.paths")
            check_data_paths(cfg.sft.eval_paths, "SFTConfig.eval_paths")
        if cfg.task.eval_size:
            check_data_paths(cfg.task.eval_paths, "TaskSource.eval_paths")


def check_model_dir(path: str | pathlib.Path, field: str) -> None:
    """`path` is an HF model directory whose config.json reads and whose safetensors are whole."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise InputError(f"{field}: model directory {path} does not exist")
    with input_errors(field):
        read_config(path)
    for weights in sorted(path.glob("*.safetensors")):
        check_safetensors_file(weights)


def check_tokenizer_dir(path: str | pathlib.Path, field: str) -> None:
    tokenizer_file = pathlib.Path(path) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise InputError(f"{field}: {tokenizer_file} not found (a fast tokenizer.json is required)")


def check_safetensors_file(path: pathlib.Path) -> None:
    """Reads only the header: raises InputError naming the file (and the first tensor cut off) when
    the header is unreadable or the file ends before a tensor's bytes do."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes, the file holds {size} bytes")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        ends = sorted((int(entry["data_offsets"][1]), name) for name, entry in header.items())
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError, AttributeError) as e:
        raise InputError(f"{path}: not a readable safetensors file ({e})") from None
    data_bytes = size - 8 - n
    for end, name in ends:
        if end > data_bytes:
            raise InputError(f"{path}: truncated: tensor {name!r} ends at byte {end} of the data, "
                             f"the file holds {data_bytes}")


def check_data_paths(paths: Any, field: str) -> None:
    for path in paths:
        if not pathlib.Path(path).exists():
            raise InputError(f"{field}: data file {path} does not exist")
