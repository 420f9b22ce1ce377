"""`areal-jax export`: a training checkpoint as a Hugging Face model directory.

    areal-jax export --checkpoint=RUN/checkpoints[/STEP] --out=DIR [--dtype=bfloat16] [--overwrite] [--adapter]

Without a STEP the latest finished one is taken. The weights are read from the checkpoint's
Orbax `state` item one tensor at a time as host arrays (`checkpoint.SavedParams`: no optimizer
state, no accelerator) and written by the same streaming writer as the run's final_model
(`hf_io.write_params`), so the host holds one tensor and one safetensors shard at a time.
The model's config comes from the run directory (the checkpoint directory's parent, or
--run_dir): its model_config.json, else the ModelSource recorded in its config.json; the tokenizer
from RUN/tokenizer (every run keeps a copy there), else from the ModelSource's directory, or
--tokenizer. The generation config travels with the tokenizer files (one is written from the
model's bos/eos ids when the source has none), and so does the run's prompt encoding
(areal_jax_prompt.json: `eval` and `generate` read it). Locally DIR appears complete or not at all.

A LoRA run's checkpoint (models/lora.py: adapters under params/layers/lora) exports merged into
the base (`W + scale * a @ b`, in fp32 before the cast), a plain HF model; with --adapter, only
the adapters in PEFT's format (adapter_config.json, adapter_model.safetensors: models/peft_io.py),
which `peft.PeftModel.from_pretrained` loads on the run's base model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from areal_jax import paths
from areal_jax.checkpoint import SavedParams, finalized_steps
from areal_jax.checkpoint_validation import step_problem
from areal_jax.jobs.inputs import InputError
from areal_jax.jobs.run_dir import check_replaceable
from areal_jax.jobs.run_settings import write_prompt_settings
from areal_jax.models.config import ModelConfig
from areal_jax.models import lora as lora_lib
from areal_jax.models.hf_io import copy_tokenizer_files, leaf_keys, read_config, write_params
from areal_jax.models.peft_io import save_adapter
from areal_jax.models.transformer import param_shapes

DTYPES = ("float32", "bfloat16", "float16")
# What a run directory records of its model (written by jobs/train.py beside config.json).
MODEL_CONFIG_FILE = "model_config.json"


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """What to export and where (the flags of `areal-jax export`).

    checkpoint: a checkpoint directory (its latest finished step) or one step directory in it.
    out: the HF directory to write; it must not hold files unless `overwrite`.
    dtype: of the stored weights (the checkpoint holds fp32 master weights).
    run_dir: the run the checkpoint belongs to (default: the checkpoint directory's parent).
    tokenizer: a tokenizer directory (default: the run's).
    adapter: write a LoRA run's adapters alone, in PEFT's format (default: the merged model).
    """

    checkpoint: str
    out: str
    dtype: str = "float32"
    overwrite: bool = False
    run_dir: str | None = None
    tokenizer: str | None = None
    adapter: bool = False

    def __post_init__(self):
        for name in ("checkpoint", "out"):
            if not str(getattr(self, name)).strip():
                raise InputError(f"--{name} must be a non-empty path")
        if self.dtype not in DTYPES:
            raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


def locate_step(checkpoint: str) -> tuple[paths.Path, int]:
    """(checkpoint directory, step) named by --checkpoint: a step directory, or a checkpoint
    directory's latest finished step."""
    path = paths.absolute(checkpoint)
    if path.name.isdigit() and (path.is_dir() or not path.exists()) and finalized_steps(path.parent):
        steps = finalized_steps(path.parent)
        if int(path.name) not in steps:
            raise InputError(f"--checkpoint {checkpoint}: no finished step {int(path.name)} in {path.parent} "
                             f"(finished steps: {', '.join(map(str, steps))})")
        return path.parent, int(path.name)
    if not path.is_dir():
        raise InputError(f"--checkpoint {checkpoint}: no such directory")
    steps = finalized_steps(path)
    if not steps:
        raise InputError(f"--checkpoint {checkpoint}: no finished checkpoint step in it "
                         "(expected RUN/checkpoints or RUN/checkpoints/STEP)")
    return path, steps[-1]


def _run_config(run_dir: paths.Path) -> dict[str, Any]:
    file = run_dir / "config.json"
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise InputError(f"--run_dir: {file} is not JSON ({e})") from None


def model_config(run_dir: paths.Path) -> ModelConfig:
    """The run's model: RUN/model_config.json, else its config.json's ModelSource."""
    recorded = run_dir / MODEL_CONFIG_FILE
    if recorded.is_file():
        try:
            return ModelConfig.from_hf(json.loads(recorded.read_text()), source=str(recorded))
        except (KeyError, TypeError, ValueError) as e:  # not JSON, or a field missing or of the wrong type
            raise InputError(f"--run_dir {run_dir}: {recorded} is not a model config ({type(e).__name__}: "
                             f"{' '.join(str(e).split())})") from None
    source = _run_config(run_dir).get("model")
    if source is None:
        raise InputError(f"--run_dir {run_dir}: neither {MODEL_CONFIG_FILE} nor config.json found, so the "
                         "model's config is unknown (pass --run_dir=the run directory of the checkpoint)")
    if source.get("path"):
        try:
            return read_config(source["path"])
        except (OSError, ValueError) as e:
            raise InputError(f"--run_dir {run_dir}: the run's ModelSource.path: {e}") from None
    from areal_jax.tasks.tokenizer_builder import task_model_config

    return task_model_config(hidden_size=source.get("hidden_size", 128), num_layers=source.get("num_layers", 4),
                             num_experts=source.get("num_experts", 0),
                             num_experts_per_tok=source.get("num_experts_per_tok", 2))


def tokenizer_source(run_dir: paths.Path, override: str | None) -> paths.Path:
    """The tokenizer directory to ship: --tokenizer, RUN/tokenizer, or the run's ModelSource's."""
    if override is not None:
        candidates = [("--tokenizer", paths.as_path(override))]
    else:
        source = _run_config(run_dir).get("model") or {}
        candidates = [("--run_dir", run_dir / "tokenizer")]
        if source.get("tokenizer_path") or source.get("path"):
            candidates.append(("--run_dir", paths.as_path(source.get("tokenizer_path") or source["path"])))
    for _, directory in candidates:
        if (directory / "tokenizer.json").is_file():
            return directory
    flag, directory = candidates[0]
    raise InputError(f"{flag}: no tokenizer.json in {', '.join(str(d) for _, d in candidates)} "
                     + ("" if override else "(pass --tokenizer=DIR)"))


def _check_shapes(saved: SavedParams, cfg: ModelConfig, where: str) -> None:
    want = param_shapes(cfg)
    for leaf in leaf_keys(cfg):
        shape = want["layers"][leaf[1]] if leaf[0] == "layers" else want[leaf[0]]
        got = saved.shapes.get(leaf)
        if got is None or got[0] != tuple(shape):
            raise InputError(f"--checkpoint {where}: weight {'/'.join(leaf)} is "
                             f"{'missing' if got is None else got[0]}, the run's model config expects {shape} "
                             "(is --run_dir the run of this checkpoint?)")


def run_export(cfg: ExportConfig) -> tuple[paths.Path, int]:
    """Writes the HF directory, the run's prompt encoding beside it (run_settings.PROMPT_FILE);
    returns its path and the step exported. Bad input is an InputError naming the flag."""
    for flag, where in (("--checkpoint", cfg.checkpoint), ("--out", cfg.out), ("--run_dir", cfg.run_dir),
                        ("--tokenizer", cfg.tokenizer)):
        try:
            if where is not None:
                paths.check_reachable(where, flag)
        except ValueError as e:
            raise InputError(str(e)) from None
    directory, step = locate_step(cfg.checkpoint)
    problem = step_problem(directory, step)  # a finished step broken since: said before any work
    if problem is not None:
        raise InputError(f"--checkpoint {cfg.checkpoint}: step {step} under {directory} is unreadable: {problem}")
    run_dir = paths.as_path(cfg.run_dir) if cfg.run_dir else directory.parent
    out = paths.as_path(cfg.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {cfg.out} is a file")
    tokenizer_dir = tokenizer_source(run_dir, cfg.tokenizer)
    # --out is replaced whole: never a run, the checkpoint read, or a directory holding either.
    check_replaceable(out, "--out", {"the run directory": run_dir, "the checkpoint directory": directory,
                                     "the checkpoint step": directory / str(step),
                                     "the tokenizer directory": tokenizer_dir})
    if out.is_dir() and any(out.iterdir()) and not cfg.overwrite:
        raise InputError(f"--out {cfg.out} exists and is not empty: pass --overwrite to replace it")
    model_cfg = model_config(run_dir)
    with _quiet_orbax():
        with _unreadable(directory, step):
            saved = SavedParams(directory, step)
        return _write(cfg, out, model_cfg, tokenizer_dir, saved, directory, step, run_dir), step


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax warns through absl that a step's `state` item has no _CHECKPOINT_METADATA file of its
    own (the step's is one level up): true of every step this project writes, so not news."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


def saved_lora(saved: SavedParams) -> lora_lib.LoRAConfig | None:
    """The LoRAConfig of a checkpoint's adapters (rank, alpha, targets from what it holds), or None."""
    prefix = ("layers", lora_lib.LORA)
    weights = {leaf[2] for leaf in saved.shapes if leaf[:2] == prefix and len(leaf) == 4}
    if not weights:
        return None
    targets = tuple(t for t, (w, _) in lora_lib.TARGETS.items() if w in weights)
    rank = saved.shapes[(*prefix, lora_lib.TARGETS[targets[0]][0], "a")][0][-1]
    scale = float(np.asarray(saved.read((*prefix, lora_lib.SCALE)), np.float32)[0])
    return lora_lib.LoRAConfig(rank=rank, alpha=scale * rank, targets=targets)


def merged_reader(saved: SavedParams, lora: lora_lib.LoRAConfig):
    """`saved.read` with each targeted weight read merged: `W + scale * a @ b` (fp32)."""
    def read(leaf: tuple[str, ...]) -> np.ndarray:
        w = saved.read(leaf)
        if leaf[0] != "layers" or leaf[1] not in lora.weights:
            return w
        a, b = (np.asarray(saved.read(("layers", lora_lib.LORA, leaf[1], k)), np.float32) for k in ("a", "b"))
        L, R = a.shape[0], a.shape[-1]
        delta = np.matmul(a.reshape(L, -1, R), b.reshape(L, R, -1)).reshape(w.shape)
        return np.asarray(w, np.float32) + np.float32(lora.scale) * delta
    return read


def _write(cfg: ExportConfig, out: paths.Path, model_cfg: ModelConfig, tokenizer_dir: paths.Path, saved: SavedParams,
           directory: paths.Path, step: int, run_dir: paths.Path) -> paths.Path:
    _check_shapes(saved, model_cfg, f"{directory}/{step}")
    lora = saved_lora(saved)
    if cfg.adapter:
        if lora is None:
            raise InputError(f"--adapter: step {step} under {directory} holds no LoRA adapters (LoRAConfig.rank was 0)")
        sft_steps = _sft_steps(directory, step, run_dir)
        if sft_steps:
            raise InputError(f"--adapter: the run's SFT stage trained every base weight ({sft_steps} steps) before RL "
                             "trained these adapters, so they fit the SFT policy, not the run's base model: export "
                             "without --adapter (the SFT policy with the adapters merged in)")
        adapters = {w: {k: saved.read(("layers", lora_lib.LORA, w, k)) for k in ("a", "b")} for w in lora.weights}
        with paths.staged_dir(out) as staged, _unreadable(directory, step):
            save_adapter(adapters, model_cfg, lora, staged, base_model=(_run_config(run_dir).get("model") or {}).get("path"))
        return out
    read = saved.read if lora is None else merged_reader(saved, lora)
    with paths.staged_dir(out) as staged, _unreadable(directory, step):
        write_params(read, model_cfg, staged, dtype=np.dtype(_NUMPY_DTYPES[cfg.dtype]))
        copied = copy_tokenizer_files(tokenizer_dir, staged)
        if "generation_config.json" not in copied:
            (staged / "generation_config.json").write_text(json.dumps(
                {"bos_token_id": model_cfg.bos_token_id, "eos_token_id": model_cfg.eos_token_id}, indent=2))
        write_prompt_settings(staged, _run_config(run_dir).get("data"))
    return out


def _sft_steps(directory: paths.Path, step: int, run_dir: paths.Path) -> int:
    """SFT steps the weights under the step's adapters took: its metadata's record, else (an older
    checkpoint) the run's config.json's SFTConfig.steps when its SFT stage was on."""
    meta = directory / str(step) / "meta" / "metadata"
    try:
        return int(json.loads(meta.read_text())["extra"]["summary"]["sft_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        config = _run_config(run_dir)
        return int((config.get("sft") or {}).get("steps", 0)) if (config.get("stages") or {}).get("sft") else 0


@contextlib.contextmanager
def _unreadable(directory: paths.Path, step: int) -> Iterator[None]:
    """A read of the step's arrays that fails (a chunk cut short, ...) as one line naming the step."""
    try:
        yield
    except InputError:
        raise
    except Exception as e:  # tensorstore's and Orbax's errors have no common type
        raise InputError(f"--checkpoint: step {step} under {directory} is unreadable: "
                         f"{' '.join(str(e).split())[:300]}") from None


def _numpy_dtypes() -> dict[str, Any]:
    import ml_dtypes

    return {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


_NUMPY_DTYPES = _numpy_dtypes()
