"""Fit `LinearCosts` to a run's recorded timings (metrics.jsonl's per-step "timings", which
trainer/step_metrics.py writes from the engine's `CallTimings` and the train step's shapes).

Each program family is a non-negative least-squares fit of its recorded seconds on what it
processed (the features of `LinearCosts`); a feature that never varies independently of the
others in the run (say, the minibatch count when every step had 2) cannot be told apart from them
and is left at 0, its cost carried by the others. Steps before `skip_steps` are left out: they
compile.

Decode chunks that carried re-prefill rows ("decode_ride", EngineConfig.reprefill_in_decode_rows)
do not enter the decode fit: their seconds less the plain decode fit's for the same steps, slots and
window are the rows' cost, fitted per ride token (`LinearCosts.ride_token`). The engine records no
token count for them; each of its ride steps computes the same R x W rows per data replica, so the
caller gives that (`ride_tokens_per_step`, the recorded run's engine), and without it (or without
ride chunks) ride_token stays None: the packed re-prefill's rate. The simulator's own records carry
ride_tokens, used as they are.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from areal_jax.simulate.costs import LinearCosts

OUTLIER_FACTOR = 4.0
_DECODE_KEY = re.compile(r"w(\d+)_q\d+$")
_SHAPE_KEY = re.compile(r"len(\d+)_rows(\d+)$")


@dataclasses.dataclass(frozen=True)
class Fit:
    costs: LinearCosts
    steps_used: int
    # Per family: relative error of the fit's total against the recorded total seconds.
    residuals: dict[str, float]
    source: str
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)  # rows left out as compiles


def _independent_nnls(columns: list[np.ndarray], target: np.ndarray) -> np.ndarray:
    """Non-negative least squares on the columns that add rank (others get 0), columns scaled."""
    from scipy.optimize import nnls

    if not target.size:
        return np.zeros(len(columns))
    keep, basis = [], np.zeros((target.size, 0))
    for j, col in enumerate(columns):
        trial = np.column_stack([basis, col])
        if np.linalg.matrix_rank(trial, tol=1e-9 * max(1.0, np.abs(trial).max())) > basis.shape[1]:
            keep.append(j)
            basis = trial
    coef = np.zeros(len(columns))
    if keep:
        scale = np.linalg.norm(basis, axis=0)
        scale[scale == 0] = 1.0
        solution, _ = nnls(basis / scale, target)
        coef[keep] = solution / scale
    return coef


def _rel(fitted: float, recorded: float) -> float:
    return abs(fitted - recorded) / recorded if recorded > 0 else 0.0


def fit_costs(records: Sequence[dict[str, Any]], *, skip_steps: int = 0, reward_s: float = 0.0,
              source: str = "records", ride_tokens_per_step: int = 0) -> Fit:
    """`records`: per-step metrics dicts (as metrics.jsonl's "metrics") carrying "timings";
    `ride_tokens_per_step`: history tokens (padding included) each step of a "decode_ride" chunk
    computed over the host, data replicas x reprefill_in_decode_rows x _width (0: unknown)."""
    used = [r for r in records if "timings" in r and int(r.get("step", 0)) >= skip_steps]
    if not used:
        raise ValueError(f"{source}: no step after the first {skip_steps} records per-program timings "
                         "(runs from this version of areal_jax record them in metrics.jsonl)")
    rows: dict[str, tuple[list[list[float]], list[float]]] = {k: ([], []) for k in
                                                              ("decode", "prefill", "insert", "reprefill", "train")}
    rides: tuple[list[list[float]], list[float], list[float]] = ([], [], [])  # decode features, tokens, s

    def add(family, features, seconds):
        rows[family][0].append(features)
        rows[family][1].append(seconds)

    for r in used:
        t = r["timings"]
        for key, v in t.get("decode", {}).items():
            window = int(_DECODE_KEY.match(key).group(1))
            add("decode", [v["steps"], v["slot_steps"], v["steps"] * window], v["s"])
        for key, v in t.get("decode_ride", {}).items():
            window = int(_DECODE_KEY.match(key).group(1))
            rides[0].append([v["steps"], v["slot_steps"], v["steps"] * window])
            rides[1].append(v.get("ride_tokens", v["steps"] * ride_tokens_per_step))
            rides[2].append(v["s"])
        for kind in ("prefill", "reprefill_long"):
            for key, v in t.get(kind, {}).items():
                m = _SHAPE_KEY.match(key)
                length, count = int(m.group(1)), int(m.group(2))
                add("prefill", [v["calls"], v["calls"] * count * length], v["s"])
        for v in t.get("insert", {}).values():
            add("insert", [v["calls"]], v["s"])
        for v in t.get("reprefill", {}).values():
            add("reprefill", [v["calls"], v["tokens"]], v["s"])
        tr = t.get("train")
        if tr and math.isfinite(tr["s"]):
            add("train", [1.0, tr["minibatches"], tr["microbatches"], tr["padded_tokens"], tr["attention"]], tr["s"])

    widths = {"decode": 3, "prefill": 2, "insert": 1, "reprefill": 2, "train": 5}
    coefs, residuals, dropped = {}, {}, {}
    for family, (features, seconds) in rows.items():
        if not seconds:  # the run made no such call (e.g. no swap with samples in flight)
            coefs[family] = np.zeros(widths[family])
            continue
        coefs[family] = _fit(family, np.asarray(features, np.float64), np.asarray(seconds, np.float64),
                             np.zeros(len(seconds)), residuals, dropped)
    ride_token = _ride_token(rides, coefs["decode"], residuals, dropped)
    transfers = [r["time/weight_transfer_s"] for r in used if math.isfinite(r.get("time/weight_transfer_s", math.nan))]
    d, p, i, rp, tr = (coefs[k] for k in ("decode", "prefill", "insert", "reprefill", "train"))
    d, p, i, rp, tr = ([float(x) for x in c] for c in (d, p, i, rp, tr))
    costs = LinearCosts(
        decode_step=d[0], decode_slot=d[1], decode_window=d[2], prefill_call=p[0], prefill_token=p[1],
        insert_call=i[0], reprefill_call=rp[0], reprefill_token=rp[1],
        ride_token=ride_token, train_step=tr[0], train_minibatch=tr[1],
        train_microbatch=tr[2], train_token=tr[3], train_attention=tr[4],
        transfer_s=float(np.mean(transfers)) if transfers else 0.0, reward_s=reward_s,
        label=f"calibrated on {source}")
    return Fit(costs, len(used), residuals, source, dropped)


def _fit(family: str, a: np.ndarray, b: np.ndarray, offset: np.ndarray, residuals: dict, dropped: dict
         ) -> np.ndarray:
    """Non-negative coefficients of seconds `b` ~ `offset` + `a` @ coef, recording the family's
    residual (and rows dropped). A call that compiled (a shape first seen inside the window) takes
    seconds where its peers take milliseconds: rows whose time is far above the fit, relative to the
    typical row, are dropped once (at most a fifth of them) and the rest refitted."""
    def solve(keep):
        return _independent_nnls([a[keep, j] for j in range(a.shape[1])], b[keep] - offset[keep])

    keep = np.ones(b.size, bool)
    coef = solve(keep)
    ratio = b / np.maximum(offset + a @ coef, 1e-9)
    outliers = ratio > OUTLIER_FACTOR * np.median(ratio)
    if outliers.any() and outliers.mean() <= 0.2:
        keep = ~outliers
        coef = solve(keep)
        dropped[family] = int(outliers.sum())
    residuals[family] = _rel(float((offset[keep] + a[keep] @ coef).sum()), float(b[keep].sum()))
    return coef


def _ride_token(rides, decode: np.ndarray, residuals: dict, dropped: dict) -> float | None:
    """Seconds per ride token: the ride chunks' seconds beyond the plain decode fit's, on their
    tokens (None: no ride chunk, or their tokens unknown)."""
    features, tokens, seconds = (np.asarray(x, np.float64) for x in rides)
    if not seconds.size or not (tokens > 0).all():
        return None
    return float(_fit("decode_ride", tokens[:, None], seconds, features @ decode, residuals, dropped)[0])


def fit_run_dir(run_dir: str | pathlib.Path, *, skip_steps: int | None = None, reward_s: float = 0.0,
                ride_tokens_per_step: int = 0) -> Fit:
    """Fit to RUN_DIR/metrics.jsonl; `skip_steps` None: the first 40% of the steps (compilation)."""
    from areal_jax.metrics import read_jsonl

    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"--calibrate {run_dir}: no metrics.jsonl there")
    records = [line.get("metrics", line) for line in read_jsonl(path)]
    if skip_steps is None:
        skip_steps = int(round(0.4 * len(records)))
    return fit_costs(records, skip_steps=skip_steps, reward_s=reward_s, source=str(run_dir),
                     ride_tokens_per_step=ride_tokens_per_step)
