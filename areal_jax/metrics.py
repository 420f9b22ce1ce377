"""Training observability: JSONL metrics, TensorBoard scalars, Weights & Biases (optional), a console
progress line, rollout dumps.

Layout under `run_dir`:

    metrics.jsonl           one object per `log` call: {"step", "wall_time", "metrics": {...nested}}
    tensorboard/            event files (scalars tagged by the "/"-joined nested key)
    wandb/, wandb_run_id    W&B's local run files and the run's id (a resumed run continues it),
                            when MetricsConfig.wandb_mode is not "disabled"
    rollouts/step_<N>.jsonl one object per record, written by `dump_rollouts`

Every sink records a `log` call under the same step index: the JSONL "step", TensorBoard's step
and W&B's "step" field (W&B charts are drawn against it; its own `_step` only counts calls).

JSON has no NaN or infinity; non-finite floats are written as the strings "NaN", "Infinity"
and "-Infinity" everywhere in these files (`read_jsonl` turns them back into floats).
TensorBoard events are written with tensorboard's own writer and protos: no TensorFlow.
Create the logger on one process only (process 0) in multi-host runs. `run_dir` may be remote
(gs://, see areal_jax/paths.py): an object cannot be appended to, so there metrics.jsonl is
rewritten whole at each step, and TensorBoard writes through fsspec as well.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Iterable
from typing import Any, Literal, Mapping

from areal_jax import paths


Number = int | float
Metrics = Mapping[str, Any]  # values: numbers (incl. NumPy/JAX scalars) or nested Metrics

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

# Console progress fields: (label, candidate flattened keys in order of preference, format).
PROGRESS_FIELDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("reward", ("reward/mean", "reward"), "{:.3f}"),
    ("staleness", ("staleness/mean", "staleness"), "{:.2f}"),
    ("tok/s", ("throughput/tokens_per_s", "tokens_per_s"), "{:,.0f}"),
)


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """Where a run's metrics go besides metrics.jsonl (always written).

    tensorboard: event files under run_dir/tensorboard.
    wandb_mode: "disabled" (default), "offline" (W&B's run files under run_dir/wandb, no network;
        `wandb sync` uploads them later) or "online". Needs the `wandb` package: the `[wandb]` extra.
    wandb_project / wandb_entity / wandb_run_name / wandb_tags: the W&B run's project, team or user
        (None: W&B's default), name (None: the run directory's name) and tags.
    """

    tensorboard: bool = True
    wandb_mode: Literal["disabled", "offline", "online"] = "disabled"
    wandb_project: str = "areal-jax"
    wandb_entity: str | None = None
    wandb_run_name: str | None = None
    wandb_tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("disabled", "offline", "online"):
            raise ValueError(f"MetricsConfig.wandb_mode must be 'disabled', 'offline' or 'online', "
                             f"got {self.wandb_mode!r}")
        for name in ("wandb_project", "wandb_entity", "wandb_run_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"MetricsConfig.{name} must be a non-empty string, got {value!r}")
        if self.wandb_project is None:
            raise ValueError("MetricsConfig.wandb_project must be a non-empty string, got None")
        object.__setattr__(self, "wandb_tags", tuple(self.wandb_tags))
        for tag in self.wandb_tags:
            # W&B refuses tags outside 1..64 characters when the run starts; say so before any work.
            if not isinstance(tag, str) or not 0 < len(tag) <= 64:
                raise ValueError(f"MetricsConfig.wandb_tags: each tag must be a string of 1 to 64 characters, "
                                 f"got {tag!r}")

    @property
    def wandb(self) -> bool:
        return self.wandb_mode != "disabled"


def batch_metrics(trajectories: Iterable[Any]) -> dict[str, float]:
    """Per-step statistics of the trajectories a step trains on.

    reward/mean, reward/std (population std over trajectories), reward/accuracy (reward >= 1);
    completion/mean_length and max_length count the tokens the model generated (a multi-turn
    trajectory's feedback tokens excluded: `generated_tokens`); completion/truncated_frac is the
    fraction that ended without a stop token (stop_reason "length": cut at the token budget).
    """
    trajs = list(trajectories)
    if not trajs:
        raise ValueError("batch_metrics needs at least one trajectory")
    rewards = [float(t.reward) for t in trajs]
    lengths = [int(t.generated_tokens) for t in trajs]
    n = len(trajs)
    mean = math.fsum(rewards) / n
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n),
        "reward/accuracy": sum(r >= 1.0 for r in rewards) / n,
        "completion/mean_length": sum(lengths) / n,
        "completion/max_length": max(lengths),
        "completion/truncated_frac": sum(t.stop_reason == "length" for t in trajs) / n,
    }


def _encode_float(x: float) -> float | str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def to_number(value: Any, key: str = "value") -> Number:
    """A metric value as a plain Python int or float (bools, NumPy and 0-d JAX arrays accepted)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)  # plain float, also for np.float64 (a float subclass)
    if hasattr(value, "__array__") or hasattr(value, "item"):
        import numpy as np

        arr = np.asarray(value)
        if arr.shape == () and arr.dtype.kind in "biuf":
            item = arr.item()
            return int(item) if isinstance(item, bool) else item
    raise TypeError(f"metric {key!r} must be a number or a dict of numbers, got {type(value).__name__}: {value!r}")


def flatten_metrics(metrics: Metrics, prefix: str = "") -> dict[str, Number]:
    """Nested metrics as {"a/b/c": number}; values converted by `to_number`."""
    flat: dict[str, Number] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric keys must be non-empty strings, got {key!r} under {prefix!r}")
        name = f"{prefix}/{key}" if prefix else key
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, name))
        else:
            flat[name] = to_number(value, name)
    return flat


def _normalize(metrics: Metrics, prefix: str = "") -> dict[str, Any]:
    """Nested metrics with plain numbers (structure kept, for JSONL)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric keys must be non-empty strings, got {key!r} under {prefix!r}")
        name = f"{prefix}/{key}" if prefix else key
        out[key] = _normalize(value, name) if isinstance(value, Mapping) else to_number(value, name)
    return out


def to_jsonable(obj: Any, path: str = "record") -> Any:
    """`obj` as strict-JSON data: arrays become lists, non-finite floats become strings."""
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    if isinstance(obj, float):
        return _encode_float(obj)
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if hasattr(obj, "__array__"):
        import numpy as np

        return to_jsonable(np.asarray(obj).tolist(), path)
    if hasattr(obj, "item"):  # NumPy scalar
        return to_jsonable(obj.item(), path)
    raise TypeError(f"{path} is not JSON-serializable: {type(obj).__name__}")


def _decode(obj: Any) -> Any:
    if isinstance(obj, str) and obj in _NON_FINITE:
        return _NON_FINITE[obj]
    if isinstance(obj, dict):
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Reads a metrics or rollouts JSONL file written here, non-finite strings back to floats."""
    with paths.as_path(path).open() as f:
        return [_decode(json.loads(line)) for line in f if line.strip()]


def format_progress(step: int, metrics: Metrics) -> str:
    """One console line: step, then reward, staleness and tokens/s where present (see PROGRESS_FIELDS)."""
    flat = flatten_metrics(metrics)
    parts = [f"step {step}"]
    for label, keys, fmt in PROGRESS_FIELDS:
        key = next((k for k in keys if k in flat), None)
        if key is None:
            continue
        value = flat[key]
        text = fmt.format(value) if math.isfinite(value) else str(float(value))
        parts.append(f"{text} {label}" if label == "tok/s" else f"{label} {text}")
    return " | ".join(parts)


def console_line(text: str) -> None:
    """Prints `text` as one whole line on stdout. Any tqdm bar on the terminal (stdout or stderr) is
    cleared first and redrawn after, and stdout is flushed inside that window: printed plainly, the
    line would land after a bar's partial redraw, in the middle of the bar's line."""
    from tqdm import tqdm

    with tqdm.external_write_mode(file=sys.stdout):
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


class _TensorBoardScalars:
    """Scalar summaries through tensorboard's event writer and protos (no TensorFlow needed)."""

    def __init__(self, logdir: paths.Path):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as err:
            raise ImportError("MetricsLogger(tensorboard=True) needs the `tensorboard` package "
                              "(pip install tensorboard), or pass tensorboard=False") from err
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(logdir))

    def write(self, step: int, wall_time: float, flat: Mapping[str, Number]) -> None:
        values = [self._summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in flat.items()]
        event = self._event_pb2.Event(wall_time=wall_time, step=step, summary=self._summary_pb2.Summary(value=values))
        self._writer.add_event(event)
        # Flush per call so a live TensorBoard (and a crash) sees every logged step.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _JsonlAppender:
    """Appends lines to a file, each flushed at once. An object store cannot append, so a remote
    file is rewritten whole from the lines so far (those of a resumed run's file included)."""

    def __init__(self, path: paths.Path):
        self._path = path
        if paths.is_remote(path):
            self._file = None
            self._text = path.read_text() if path.exists() else ""
        else:
            self._file = open(path, "a")

    def append(self, line: str) -> None:
        if self._file is None:
            self._text += line
            self._path.write_text(self._text)
        else:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class _WandbRun:
    """One W&B run per run directory: its id is kept in run_dir/wandb_run_id, so a resumed run (or a
    later stage of the same job) continues the same W&B run instead of starting another."""

    def __init__(self, cfg: MetricsConfig, run_dir: Any, config: Mapping[str, Any] | None):
        try:
            import wandb
        except ImportError:
            raise ImportError(f"MetricsConfig.wandb_mode = {cfg.wandb_mode!r} needs the `wandb` package: "
                              "pip install 'areal-jax[wandb]' (or set MetricsConfig.wandb_mode = 'disabled')") from None
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(6)
        id_file.write_text(run_id + "\n")
        local = "://" not in str(run_dir)  # W&B writes its files locally: a remote run directory's go to ./wandb
        self._run = wandb.init(
            project=cfg.wandb_project, entity=cfg.wandb_entity, name=cfg.wandb_run_name or run_dir.name,
            tags=list(cfg.wandb_tags), mode=cfg.wandb_mode, dir=str(run_dir) if local else None, id=run_id, resume="allow",
            # As config.json is written: anything JSON lacks (a path, an enum) recorded as its text.
            config=json.loads(json.dumps(dict(config or {}), default=str)),
            # W&B's console capture would copy every line the job prints into its files.
            settings=wandb.Settings(console="off"))
        # Charts use the "step" field (the JSONL/TensorBoard step) as the x axis.
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def write(self, step: int, flat: Mapping[str, Number]) -> None:
        self._run.log({**flat, "step": step})

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Writes each step's metrics to JSONL, TensorBoard and W&B and prints a progress line.

    `wandb`: a MetricsConfig whose wandb_mode is not "disabled" starts (or continues) the run
    directory's W&B run; `wandb_config` is recorded as that run's config. The progress line is
    printed through tqdm, so it never lands inside a progress bar being drawn on the terminal.
    """

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, jsonl: bool = True,
                 console: bool = True, wandb: MetricsConfig | None = None,
                 wandb_config: Mapping[str, Any] | None = None):
        self.run_dir = paths.as_path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = console
        # Append: a resumed run continues the same file.
        self._jsonl = _JsonlAppender(self.run_dir / "metrics.jsonl") if jsonl else None
        self._tensorboard = _TensorBoardScalars(self.run_dir / "tensorboard") if tensorboard else None
        self._closed = False
        self._wandb = None
        try:
            self._wandb = _WandbRun(wandb, self.run_dir, wandb_config) if wandb is not None and wandb.wandb else None
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Metrics, wall_time: float | None = None) -> None:
        """Records `metrics` (numbers or nested dicts of numbers) for `step`."""
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {step!r}")
        wall_time = time.time() if wall_time is None else float(wall_time)
        nested = _normalize(metrics)
        if self._jsonl is not None:
            record = {"step": step, "wall_time": wall_time, "metrics": to_jsonable(nested)}
            self._jsonl.append(json.dumps(record, allow_nan=False) + "\n")
        if self._tensorboard is not None or self._wandb is not None:
            flat = flatten_metrics(nested)
            if self._tensorboard is not None:
                self._tensorboard.write(step, wall_time, flat)
            if self._wandb is not None:
                self._wandb.write(step, flat)
        if self.console:
            console_line(format_progress(step, nested))

    def dump_rollouts(self, step: int, records: list[Mapping[str, Any]]) -> paths.Path:
        """Writes `records` (prompt, completion, reward, per-token versions, ...) to rollouts/step_<step>.jsonl.

        The file appears whole (written beside it, then renamed); a second dump of a step replaces it.
        """
        out_dir = self.run_dir / "rollouts"
        out_dir.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(to_jsonable(r, f"records[{i}]"), allow_nan=False) for i, r in enumerate(records)]
        path = out_dir / f"step_{step}.jsonl"
        paths.write_whole(path, "".join(line + "\n" for line in lines))
        return path

    def close(self) -> None:
        """Flushes and closes the JSONL file and the TensorBoard writer."""
        if self._closed:
            return
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
