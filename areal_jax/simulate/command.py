"""`areal-jax simulate`'s entry: the flags checked, then the rows (simulate/driver.py) or, with
`--tune`, the search (simulate/tune_run.py); a bad input is one line on stderr and exit code 2.
Kept apart from both so that the driver does not import the search that imports it."""

from __future__ import annotations

import json
import math
import pathlib
import sys

from areal_jax.simulate.driver import SimulateError, format_rows, simulate_rows


def main(args) -> int:
    from areal_jax.config_system import ConfigError
    from areal_jax.simulate.flags import check_flags

    try:
        check_flags(args)
        if args.write and not args.tune:
            raise SimulateError("--write takes --tune (it writes the tuned point)")
        if args.tune:
            return _tune(args)
        report = simulate_rows(args)
    except (SimulateError, ConfigError, ValueError, FileNotFoundError) as e:
        print(f"areal-jax: simulate: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    else:
        print(format_rows(report))
    return 0


def _tune(args) -> int:
    from areal_jax.simulate.tune_run import format_tune, run_tune, write_best  # jax-free until run

    if args.write and pathlib.Path(args.write).is_dir():
        raise SimulateError(f"--write {args.write}: a directory, not a file")
    report = run_tune(args)
    if not report["points"]:
        raise SimulateError("--tune: no point fits the target (" + "; ".join(
            sorted({r["memory"]["source"] for r in report["refused_points"]})[:3]) + ")")
    if args.write:
        write_best(report, args.write)
    print(json.dumps(report, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
          if args.json else format_tune(report, args.tune_top))
    return 0
