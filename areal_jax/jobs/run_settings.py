"""What a run's model carries of the run, and what later commands read back from a run directory.

- `areal_jax_prompt.json` beside the HF files of final_model/ and of every `areal-jax export`:
  the prompt encoding the run trained with (DataConfig's prompt_template, chat_template_kwargs,
  system_prompt, prompt_suffix). `eval` and `generate` encode prompts with it unless told otherwise,
  so a base model trained on "Question: {question}\\nAnswer:" is not evaluated on raw questions.
- `eval --run_dir_of=RUN`: the run's final model, reward, held-out files, data format, prompt
  encoding and completion budget, from RUN/config.json.
- `train --resume` without --gin_file: RUN/config.gin, the run's operative bindings.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from collections.abc import Mapping
from typing import Any

from areal_jax import paths
from areal_jax.jobs.inputs import InputError

PROMPT_FILE = "areal_jax_prompt.json"
PROMPT_FIELDS = ("prompt_template", "chat_template_kwargs", "system_prompt", "prompt_suffix")


def prompt_settings(data: Any) -> dict[str, Any]:
    """The prompt encoding of a DataConfig (or its dict in config.json); None: the built-in task's
    (the chat template, no variables)."""
    if data is None:
        data = {}
    get = data.get if isinstance(data, Mapping) else lambda name, default=None: getattr(data, name, default)
    return {"prompt_template": get("prompt_template"), "chat_template_kwargs": dict(get("chat_template_kwargs") or {}),
            "system_prompt": get("system_prompt"), "prompt_suffix": get("prompt_suffix") or ""}


def write_prompt_settings(directory: paths.Path, data: Any) -> None:
    (paths.as_path(directory) / PROMPT_FILE).write_text(json.dumps(prompt_settings(data), indent=2) + "\n")


def read_prompt_settings(model_dir: str | pathlib.Path) -> dict[str, Any] | None:
    """The prompt encoding recorded beside a model's weights, None when it has none."""
    file = paths.as_path(model_dir) / PROMPT_FILE
    if not file.is_file():
        return None
    try:
        settings = json.loads(file.read_text())
    except ValueError as e:
        raise InputError(f"--model: {file} is not JSON ({e})") from None
    if not isinstance(settings, dict) or set(settings) - set(PROMPT_FIELDS):
        raise InputError(f"--model: {file} is not a prompt encoding (fields {', '.join(PROMPT_FIELDS)})")
    return settings


def unbound_prompt_settings(settings: dict[str, Any] | None, bound: Mapping[str, Any]) -> dict[str, Any]:
    """The recorded encoding as DataConfig overrides, taken whole, and only when the user binds none
    of its fields (a bound prompt_template with a recorded chat_template_kwargs would contradict)."""
    if not settings or any(name in bound for name in PROMPT_FIELDS):
        return {}
    return {name: value for name, value in settings.items() if value not in (None, "", {})}


def run_config(run_dir: str) -> dict[str, Any]:
    """RUN/config.json (every resolved config of the run)."""
    file = paths.as_path(run_dir) / "config.json"
    if not file.is_file():
        raise InputError(f"--run_dir_of {run_dir}: no config.json (not a run directory of areal-jax train)")
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise InputError(f"--run_dir_of: {file} is not JSON ({e})") from None


def eval_defaults(run_dir: str, *, require_eval_paths: bool = True, held_out_dir: paths.PathLike | None = None
                  ) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(model directory, EvalConfig overrides, DataConfig overrides) that evaluate the run as it
    evaluated itself: its final model, reward, held-out files and format, and completion budget.
    Without `require_eval_paths` a run without held-out files is accepted (the caller names files).
    A run of the built-in arithmetic task gets its held-out problems written as a file
    (`held_out_dir`/held_out.jsonl, default a temporary directory)."""
    cfg = run_config(run_dir)
    model = paths.as_path(run_dir) / "final_model"
    if not (model / "config.json").is_file():
        raise InputError(f"--run_dir_of {run_dir}: no final_model/ (the run has not finished: export a checkpoint "
                         "and pass --model=DIR)")
    task, data, rollout = cfg.get("task") or {}, cfg.get("data") or {}, cfg.get("rollout") or {}
    if task.get("kind") == "arithmetic" and task.get("eval_size") and require_eval_paths:
        task = {**task, "eval_paths": (_arithmetic_held_out(cfg, held_out_dir),)}
        data = {**data, "format": "math"}
    if not task.get("eval_paths") and require_eval_paths:
        raise InputError(f"--run_dir_of {run_dir}: the run has no held-out files (TaskSource.eval_paths): bind "
                         "DataConfig.paths")
    rl, engine = cfg.get("rl") or {}, cfg.get("engine") or {}
    budget = rl.get("eval_max_new_tokens") or rollout.get("max_new_tokens")
    # The run's whole reward (a composite's terms, its judge), as its held-out evaluation scored.
    evals = {"reward": rollout.get("reward"), "judge": rollout.get("judge"), "max_new_tokens": budget,
             "max_seq_len": engine.get("max_seq_len")}
    datas = {"paths": tuple(task.get("eval_paths") or ()), "format": data.get("format"),
             "max_prompt_tokens": data.get("max_prompt_tokens")}
    return (str(model), {k: v for k, v in evals.items() if v is not None},
            {k: v for k, v in datas.items() if v is not None})


def _arithmetic_held_out(cfg: dict[str, Any], directory: paths.PathLike | None) -> str:
    """The built-in task's held-out problems of a run (its config.json), written as MATH-format JSONL:
    the same problems, prompts and golds its held-out accuracy used."""
    from areal_jax.tasks.arithmetic import ArithmeticConfig, write_jsonl

    if directory is None or paths.is_remote(directory):
        directory = tempfile.mkdtemp(prefix="areal-jax-held-out-")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in (cfg.get("arithmetic") or {}).items()}
    task = cfg["task"]
    return str(write_jsonl(pathlib.Path(directory) / "held_out.jsonl", "test", int(task["eval_size"]),
                           cfg=ArithmeticConfig(**fields), seed=int(task.get("seed", 0)), fmt="math"))


def resume_gin_files(run_dir: str) -> list[str]:
    """[RUN/config.gin] for `--resume` without --gin_file (a local copy when RUN is remote)."""
    file = paths.as_path(run_dir) / "config.gin"
    if not file.is_file():
        raise InputError(f"--resume: {file} not found (not a run directory?): pass the run's --gin_file")
    if not paths.is_remote(file):
        return [str(file)]
    local = pathlib.Path(tempfile.mkdtemp(prefix="areal-jax-resume-")) / "config.gin"
    local.write_text(file.read_text())
    return [str(local)]


def generate_settings(model_dir: str, *, system: str | None, chat_template_kwargs: str | None) -> dict[str, Any]:
    """The prompt encoding `areal-jax generate` uses: the model's recorded one, with --system and
    --chat_template_kwargs (a JSON object) in place of its fields."""
    settings = dict(read_prompt_settings(model_dir) or prompt_settings(None))
    if system is not None:
        settings["system_prompt"] = system or None
    if chat_template_kwargs is not None:
        try:
            kwargs = json.loads(chat_template_kwargs)
        except ValueError as e:
            raise InputError(f"--chat_template_kwargs: not a JSON object ({e})") from None
        if not isinstance(kwargs, dict):
            raise InputError(f"--chat_template_kwargs: not a JSON object, got {chat_template_kwargs!r}")
        settings["chat_template_kwargs"] = kwargs
    return settings


def encode_prompts(tokenizer: Any, texts: list[str], settings: dict[str, Any]) -> list[list[int]]:
    """Token ids of free-text prompts under a prompt encoding: a prompt_template gets the text in
    every field it names; a chat template gets the system prompt, the text plus prompt_suffix and
    the template variables; a base model with neither continues the text as given."""
    from areal_jax.data.formats import PromptTemplate, template_fields
    from areal_jax.data.templating import PromptEncoder

    template = settings.get("prompt_template")
    if template and (settings.get("system_prompt") or settings.get("chat_template_kwargs")):
        raise InputError(f"--system and --chat_template_kwargs apply to a chat template, and this model's prompt "
                         f"encoding is the prompt_template {template!r} ({PROMPT_FILE}), the whole prompt")
    if template:
        encoder = PromptEncoder(tokenizer, prompt_template=template)
        fields = template_fields(template)
        return [encoder.prompt_ids([{"role": "user", "content": template.format_map({f: t for f in fields})}])
                for t in texts]
    if not tokenizer.has_chat_template:
        if settings.get("system_prompt") or settings.get("chat_template_kwargs"):
            raise InputError(f"--model: the tokenizer in {getattr(tokenizer, 'name', '?')} has no chat template, so "
                             "--system and --chat_template_kwargs have nothing to apply to")
        return [tokenizer.encode(t) for t in texts]
    try:
        encoder = PromptEncoder(tokenizer, chat_template_kwargs=settings.get("chat_template_kwargs"))
        chat = PromptTemplate(settings.get("prompt_suffix") or "", settings.get("system_prompt"))
    except (TypeError, ValueError) as e:
        raise InputError(f"--chat_template_kwargs: {e}") from None
    return [encoder.prompt_ids(chat.messages(t)) for t in texts]
