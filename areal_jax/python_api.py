"""The Python API: a whole run from a script or a notebook, the same run `areal-jax train` makes.

    import areal_jax as aj
    cfg = aj.load_config("configs/quickstart.gin", overrides=["RLConfig.steps = 20"])
    trainer = aj.Trainer(cfg, run_dir="runs/nb", reward_fn=my_reward, train_data=rows, eval_data=held_out)
    summary = trainer.train()        # run directory, records, checkpoints and resume as the CLI's
    trainer.evaluate()               # pass@k of the final model on eval_data (`areal-jax eval`)
    trainer.export("hf/out")         # the final model, or the latest checkpoint, as an HF directory

Configs come from gin (`load_config`) or are built in Python, `aj.JobConfigs(rl=aj.RLConfig(...))`.
Data is a list or iterable of dicts (rows in any DataConfig format: GSM8K's question/answer,
MATH's problem/solution, ...), written once to RUN/inputs/*.jsonl so that the run reads, shards,
checkpoints and resumes it as it does files; or a path (a file or a list of files). `reward_fn` is
any callable(completion_text, gold) -> float, run in this process
(`reward.registry.register_reward_callable`); a workflow is an `api.RolloutWorkflow` instance, a
workflow class (built as RLConfig.workflow's are) or a callable(rollout_config, tokenizer) -> workflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from areal_jax import paths
from areal_jax.job_config import JobConfigs
from areal_jax.rollout.workflow import missing_workflow_members

__all__ = ["Trainer", "load_config"]

_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")  # a string ending so names a data file, existing or not
DataInput = str | os.PathLike | Sequence[str | os.PathLike] | Iterable[Mapping[str, Any]]


def load_config(path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                overrides: Sequence[str] = (), *, run_dir: str = "{run_dir}") -> JobConfigs:
    """Typed configs from .gin files (one path or several) and gin-style `overrides`
    ("RLConfig.steps = 20"); ConfigError (one line naming the field) for any mistake. Paths that
    depend on the run directory (checkpoints) hold "{run_dir}" until a run fills it in."""
    from areal_jax import config_system as cs
    from areal_jax.data.pipeline import DataConfig
    from areal_jax.jobs.configs import load_job_configs

    files = [] if path is None else [path] if isinstance(path, (str, os.PathLike)) else list(path)
    try:
        cfg = load_job_configs([str(f) for f in files], list(overrides), run_dir=run_dir)
    except cs.ConfigError as e:  # named as this function's parameter, not the CLI's flag
        if "--gin_param" not in str(e):
            raise
        raise cs.ConfigError(str(e).replace("--gin_param", "overrides")) from None
    bound = cs.bindings(DataConfig)
    if cfg.data is None and bound:  # the built-in task reads none; kept in the text for `Trainer(train_data=)`
        text = cfg.bindings + "\n# DataConfig, for data given to the Trainer\n" + "".join(
            f"DataConfig.{name} = {value!r}\n" for name, value in bound.items())
        cfg = JobConfigs(**{f.name: cfg.given(f.name) for f in dataclasses.fields(cfg) if f.name != "bindings"},
                         bindings=text)
    return cfg


def _bound_data_config(cfg: JobConfigs, files: tuple[str, ...]) -> Any:
    """A DataConfig of `files` with the fields `cfg`'s gin text binds (none: the defaults)."""
    from areal_jax import config_system as cs
    from areal_jax.data.pipeline import DataConfig

    if cfg.bindings:
        cs.parse((), [cfg.bindings], skip_unknown=True)
        return cs.build(DataConfig, paths=files)
    return DataConfig(paths=files)


# The CLI's flags in the messages of the jobs the API shares with it, as the API's own parameters.
_PARAMETERS = {"--run_dir": "run_dir", "--resume": "resume=True", "--overwrite": "overwrite=True", "--out": "out",
               "--dtype": "dtype", "--checkpoint": "the run's checkpoint", "--run_dir_of": "run_dir"}


@contextlib.contextmanager
def _named_as_parameters() -> Iterator[None]:
    """An InputError naming CLI flags, raised again naming the Python API's parameters."""
    from areal_jax.jobs.inputs import InputError

    try:
        yield
    except InputError as e:
        text = re.sub(r"--[a-z_]+", lambda m: _PARAMETERS.get(m.group(0), m.group(0)), str(e))
        if text == str(e):
            raise
        try:
            renamed = type(e)(text)
        except TypeError:  # a subclass built otherwise: the base type carries the message
            renamed = InputError(text)
        raise renamed from None


class Trainer:
    """One run: `train`, then `evaluate` and `export` its model.

    config: JobConfigs, or a .gin path (then `overrides` apply as in `load_config`).
    run_dir: the run directory (local or gs://), laid out as `areal-jax train --run_dir` lays it out.
    reward_fn: callable(completion, gold) -> float; replaces RLVRConfig.reward.
    train_data / eval_data: the prompts and the held-out prompts (see the module docstring);
        replace DataConfig.paths / TaskSource.eval_paths. Without eval_data a run on train_data
        reports no held-out accuracy.
    workflow: the rollout workflow (see the module docstring); replaces RLConfig.workflow.
    """

    def __init__(self, config: JobConfigs | str | os.PathLike, *, run_dir: str | os.PathLike,
                 reward_fn: Callable[[str, Any], float] | None = None, train_data: DataInput | None = None,
                 eval_data: DataInput | None = None, workflow: Any = None, overrides: Sequence[str] = ()):
        cfg = config if isinstance(config, JobConfigs) else load_config(config, overrides)
        if overrides and isinstance(config, JobConfigs):
            raise ValueError("overrides apply to a .gin path; set the fields of the JobConfigs instead")
        self.run_dir = str(run_dir)
        parts: dict[str, Any] = {}  # the parts replaced, from the parts as given: JobConfigs derives again
        if reward_fn is not None:
            from areal_jax.reward.registry import register_reward_callable

            parts["rollout"] = dataclasses.replace(cfg.given("rollout"), reward=register_reward_callable(reward_fn))
        self._inputs: dict[str, Any] = {}  # inputs/<name>.jsonl -> rows still to write
        task, data = cfg.given("task"), cfg.given("data")
        if train_data is not None:
            files = self._data_paths(train_data, "train")
            data = dataclasses.replace(data, paths=files) if data is not None else _bound_data_config(cfg, files)
            # The rows replace the task; without eval_data they have no held-out part.
            task = dataclasses.replace(task, kind="dataset", eval_size=task.eval_size if task.eval_paths else 0)
        if eval_data is not None:  # rows: every one is held out; files: up to TaskSource.eval_size of them
            files = self._data_paths(eval_data, "eval")
            rows = self._inputs.get(files[0])
            task = dataclasses.replace(task, eval_paths=files,
                                       eval_size=len(rows) if rows is not None else task.eval_size or 1_000_000)
        if task is not cfg.given("task") or data is not cfg.given("data"):
            parts.update(task=task, data=data)
        self.workflow = workflow
        if workflow is not None:  # a class's own config: the bound one if it is of its config_class
            if isinstance(workflow, type) and missing_workflow_members(workflow):
                raise TypeError(f"workflow= {workflow.__name__} lacks {', '.join(missing_workflow_members(workflow))} "
                                "of api.RolloutWorkflow: subclass areal_jax.RolloutWorkflow (it has their defaults)")
            config_class = workflow.config_class if isinstance(workflow, type) else None
            wf_cfg = cfg.workflow_config if config_class and isinstance(cfg.workflow_config, config_class) else (
                config_class() if config_class else None)
            parts.update(rl=dataclasses.replace(cfg.given("rl"), workflow=None), workflow_config=wf_cfg)
        if parts:  # config.gin then holds the fields that differ from their defaults (`with_parts`)
            cfg = cfg.with_parts(**parts)
        self.config = cfg.for_run(self.run_dir)
        self.summary: dict[str, Any] | None = None
        self._hooks: list[tuple[Callable[[Any], None], str, int]] = []

    def add_hook(self, hook: Callable[[Any], None], *, stage: str = "record", every: int = 1) -> None:
        """Runs `hook(info)` after every `every`-th RL step at `stage`: "update" (after the update,
        before the weights reach the generator), "metrics" (the step's metrics may be added to),
        "record" (they are final) or "end" (once, when RL ends). `info` is an `aj.StepInfo`, the
        step's data: step, version, groups, metrics, trained_tokens, last, stopped."""
        from areal_jax.api import STAGES

        if stage not in STAGES or not isinstance(every, int) or every < 1:
            raise ValueError(f"add_hook: stage must be one of {STAGES} and every an int >= 1, got {stage!r}, {every!r}")
        self._hooks.append((hook, stage, every))

    def _data_paths(self, data: DataInput, name: str, param: str | None = None) -> tuple[str, ...]:
        param = param or f"{name}_data"
        if isinstance(data, (str, os.PathLike)):
            files = (str(data),)
        elif isinstance(data, Sequence) and data and all(isinstance(d, (str, os.PathLike)) for d in data):
            files = tuple(str(d) for d in data)
        else:
            files = ()
        for file in files:  # a list of prompts is no list of paths: said now, not as a missing file later
            if not (paths.is_remote(file) or os.path.exists(file) or "/" in file or file.endswith(_DATA_SUFFIXES)):
                raise FileNotFoundError(f"{param}: no file {file!r} (a string or a list of strings is read as data "
                                        "file paths; give rows as dicts, e.g. {'question': ..., 'answer': ...})")
        if files:
            return files
        rows = list(data)  # a finite iterable of dicts: written once the run starts
        if not all(isinstance(r, Mapping) for r in rows):
            raise TypeError(f"{param} must be a path, a list of paths, or an iterable of dicts (rows)")
        target = str(paths.absolute(self.run_dir) / "inputs" / f"{name}.jsonl")
        self._inputs[target] = rows
        return (target,)

    def _input_files(self, names: Sequence[str] | None = None) -> dict[str, bytes]:
        """The rows given as data (of `names`, default all), as the JSONL files the run reads:
        path -> content. `train` writes them once the run directory's lock and checks pass."""
        return {target: "".join(json.dumps(r, default=str) + "\n" for r in rows).encode()
                for target, rows in self._inputs.items()
                if names is None or paths.as_path(target).stem in names}

    def train(self, *, resume: bool = False, overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
        """SFT (if configured) then RL, as `areal-jax train`; returns the summary (summary.json).
        `resume`: continue from the run directory's latest checkpoint; `overwrite`: replace a
        finished or failed run there. Every config check runs before any work."""
        with _named_as_parameters():
            return self._train(resume=resume, overwrite=overwrite, progress=progress)

    def _train(self, *, resume: bool, overwrite: bool, progress: bool) -> dict[str, Any]:
        """`train`, its errors naming the CLI's flags (`areal-jax train` runs this)."""
        import jax

        from areal_jax.job_config import check_cross_fields
        from areal_jax.jobs.train import run_train

        check_cross_fields(self.config, jax.process_count())
        budget, engine = self.config.train_engine.max_tokens_per_microbatch, self.config.engine
        if self.workflow is not None and engine.max_seq_len > budget:
            from areal_jax.config_system import ConfigError

            # A custom workflow may grow an episode turn by turn, up to the engine's limit.
            raise ConfigError(f"TrainEngineConfig.max_tokens_per_microbatch ({budget}) is below "
                              f"EngineConfig.max_seq_len ({engine.max_seq_len}), the longest sequence the workflow "
                              "may build; such a sequence could not be trained")
        self.summary = run_train(self.config, self.run_dir, progress=progress, resume=resume, overwrite=overwrite,
                                 workflow=self.workflow, hooks=self._hooks, inputs=self._input_files())
        return self.summary

    def evaluate(self, data: DataInput | None = None, *, n_samples: int = 1, temperature: float = 0.0,
                 out_dir: str | os.PathLike | None = None) -> dict[str, Any]:
        """pass@k and accuracy of the run's final model on `data` (default: eval_data), with the
        run's reward and prompt encoding, as `areal-jax eval --run_dir_of=RUN`; the per-sample
        results and report land in `out_dir` (default RUN/eval). Returns the report's overall figures."""
        from areal_jax.jobs.evaluate import evaluate_run

        files = self._data_paths(data, "evaluate", "data") if data is not None else self.config.task.eval_paths
        if not files:
            raise ValueError("evaluate needs data: pass it, or eval_data to the Trainer")
        from areal_jax.jobs.run_data import write_inputs

        write_inputs(self._input_files(["evaluate"]))  # the run's own inputs/ are the run's: left as they are
        out = out_dir if out_dir is not None else paths.as_path(self.run_dir) / "eval"
        with _named_as_parameters():
            return evaluate_run(self.run_dir, files, out_dir=out, n_samples=n_samples, temperature=temperature,
                                reward=self.config.rollout.reward, judge=self.config.rollout.judge,
                                reward_pool=self.config.reward_pool,
                                sandbox=self.config.sandbox)

    def export(self, out: str | os.PathLike, *, dtype: str = "float32", overwrite: bool = False) -> str:
        """The run's model as an HF directory `out`: final_model/ when the run finished, else the
        latest checkpoint (as `areal-jax export`). Returns `out`."""
        from areal_jax.jobs.run_dir import check_replaceable

        final = paths.as_path(self.run_dir) / "final_model"
        if final.exists() and dtype == "float32":
            target = paths.as_path(out)
            # `out` is replaced whole: never the run, its final model, or a directory holding either.
            check_replaceable(target, "out", {"the run directory": self.run_dir, "the final model": final})
            if target.exists() and any(target.iterdir()) and not overwrite:
                raise FileExistsError(f"{out} holds files: pass overwrite=True to replace them")
            with paths.staged_dir(target) as staged:  # final_model/ is flat: weights, configs, tokenizer
                paths.copy_files(final, staged)
            return str(out)
        from areal_jax.jobs.export import ExportConfig, run_export

        if self.config.checkpoint is None:
            raise FileNotFoundError(f"{self.run_dir} has no final_model/ and the run keeps no checkpoints")
        with _named_as_parameters():
            run_export(ExportConfig(checkpoint=str(self.config.checkpoint.directory), out=str(out), dtype=dtype,
                                    overwrite=overwrite, run_dir=self.run_dir))
        return str(out)
