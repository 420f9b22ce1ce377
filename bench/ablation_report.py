"""Tables, verdicts and a plot from `bench/staleness_ablation.py` run directories (issue 19).

Every `--regime LABEL=DIR` names one ablation output directory (its `eta{E}_{variant}_seed{S}/` and
`sync_seed{S}/` runs are read from their summary.json and metrics.jsonl, or metrics.jsonl.gz as kept
in bench/results/, whatever invocation made them). Per regime it prints the mean +- std over seeds
of the final held-out accuracy for each (eta, objective) and its accuracy averaged over the run's
evaluations (after step 0: how the whole run went, not only its end), the paper's two questions
tested on both measures (differences with 95% intervals and p-values: paired by seed where two
configurations share their seeds, Welch otherwise; `verdicts`), and, where a regime holds a
synchronous baseline, when asynchronous runs first reach the baseline's final accuracy in wall time.
The PNG has one row per regime: held-out accuracy against RL steps and against the RL stage's wall
time, means over seeds, shaded min..max (each objective present --
decoupled, naive, naive_recompute -- in panels of its own).

    .venv/bin/python -m bench.ablation_report --regime "4 minibatches, no cap=/tmp/abl19/mb4" \\
        --regime "1 minibatch, cap 5=/tmp/abl19/mb1" --regime "quickstart=/tmp/abl19/qs" \\
        --png docs/figures/staleness_ablation.png
    .venv/bin/python -m bench.ablation_report --regime "off-policy=/tmp/abl31/main" \
        --regime "cap 5 clamp=/tmp/abl31/cap5_clamp" --compare "cap 5 clamp:8:decoupled,off-policy:8:decoupled"
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re

import numpy as np

from bench.staleness_ablation import read_run

OBJECTIVES = ("decoupled", "naive", "naive_recompute")  # bench.staleness_ablation.VARIANTS, in display order
RUN_NAME = re.compile(r"^(?:eta(?P<eta>\d+)_(?P<variant>decoupled|naive_recompute|naive)|(?P<sync>sync))"
                      r"_seed(?P<seed>\d+)$")


def load_regime(out: pathlib.Path) -> list[dict]:
    """Every finished run under `out` (a run without summary.json is skipped: still running or failed)."""
    runs = []
    for run_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        m = RUN_NAME.match(run_dir.name)
        if not m or not (run_dir / "summary.json").exists():
            continue
        eta, variant = (0, "sync") if m["sync"] else (int(m["eta"]), m["variant"])
        runs.append({"eta": eta, "variant": variant, "seed": int(m["seed"]), **read_run(run_dir, warmup=3)})
    if not runs:
        raise SystemExit(f"{out}: no finished ablation runs (eta*_{{{','.join(OBJECTIVES)}}}_seed*/summary.json)")
    return runs


def configs(runs: list[dict]) -> list[tuple[int, str]]:
    """(eta, objective) keys in display order: the synchronous row first, then by eta."""
    return sorted({(r["eta"], r["variant"]) for r in runs},
                  key=lambda k: (k[1] != "sync", k[0], OBJECTIVES.index(k[1]) if k[1] in OBJECTIVES else -1))


def select(runs: list[dict], eta: int, variant: str) -> list[dict]:
    return [r for r in runs if r["eta"] == eta and r["variant"] == variant]


def mean_curve(rs: list[dict], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x (mean over seeds), accuracy mean / min / max at each evaluation point the seeds share."""
    n = min(len(r[key]) for r in rs)
    xs = np.array([[p[0] for p in r[key][:n]] for r in rs], dtype=float)
    ys = np.array([[p[1] for p in r[key][:n]] for r in rs], dtype=float)
    return xs.mean(0), ys.mean(0), ys.min(0), ys.max(0)


def summary_table(runs: list[dict]) -> str:
    lines = ["| eta | objective | seeds | start acc | final acc, mean ± sample std | gain | per seed | "
             "acc averaged over the run's evaluations | RL wall s | trained tok/s | staleness max / mean | "
             "off-policy tokens (pi_theta / pi_behav outside [0.8, 1.2]) | top-1% weight gradient share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for eta, variant in configs(runs):
        rs = sorted(select(runs, eta, variant), key=lambda r: r["seed"])
        final = np.array([r["final_accuracy"] for r in rs])
        std = final.std(ddof=1) if len(final) > 1 else 0.0
        start = np.mean([r["start_accuracy"] for r in rs])
        lines.append(
            f"| {eta} | {variant} | {len(rs)} | {start:.3f} | {final.mean():.3f} ± {std:.3f} | "
            f"{final.mean() - start:+.3f} | {' / '.join(f'{a:.3f}' for a in final)} | "
            f"{mean_curve(rs, 'curve')[1][1:].mean():.3f} | "
            f"{np.mean([r['rl_wall_s'] for r in rs]):.0f} | {np.mean([r['tokens_per_s'] for r in rs]):.0f} | "
            f"{max(r['staleness_max'] for r in rs)} / {np.mean([r['staleness_mean'] for r in rs]):.2f} | "
            f"{np.mean([r['behav_ratio_out_frac_mean'] for r in rs]):.3f} | "
            f"{np.mean([r['weight_top1pct_grad_share_mean'] for r in rs]):.3f} |")
    return "\n".join(lines)


def _by_seed(runs: list[dict], eta: int, variant: str, measure: str) -> dict[int, float]:
    """{seed: measure} of one configuration; measure "final" (final held-out accuracy) or
    "run_mean" (accuracy averaged over the run's evaluations after step 0)."""
    out = {}
    for r in select(runs, eta, variant):
        out[r["seed"]] = r["final_accuracy"] if measure == "final" else float(np.mean([a for _, a in r["curve"][1:]]))
    return out


def compare(a: dict[int, float], b: dict[int, float], level: float = 0.95) -> dict | None:
    """The difference a - b of two configurations' per-seed values, with a t interval and p-value.

    Paired when both hold the same seeds (a seed fixes the SFT start, the prompt order and the
    engine's sampling: the two runs share everything but the configuration): the mean of the
    per-seed differences, t with n - 1 degrees of freedom. Otherwise Welch: the difference of the
    means, its standard error sqrt(s_a^2/n_a + s_b^2/n_b), Welch-Satterthwaite degrees of freedom.
    None when either side has fewer than 2 seeds (no variance to test against).
    Returns {test, n_a, n_b, diff, se, dof, t, p (two-sided), lo, hi (the `level` interval)}.
    """
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return None
    if set(a) == set(b):
        d = np.array([a[k] - b[k] for k in sorted(a)])
        diff, se, dof, test = d.mean(), d.std(ddof=1) / np.sqrt(len(d)), len(d) - 1.0, "paired"
    else:
        x, y = np.array(list(a.values())), np.array(list(b.values()))
        va, vb = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
        diff, se, test = x.mean() - y.mean(), np.sqrt(va + vb), "Welch"
        dof = (va + vb) ** 2 / (va ** 2 / (len(x) - 1) + vb ** 2 / (len(y) - 1)) if va + vb > 0 else len(x) + len(y) - 2.0
    if se > 0:
        t = diff / se
        p = float(2 * stats.t.sf(abs(t), dof))
    else:  # identical differences: no spread to test against
        t, p = (math.inf if diff else 0.0), (0.0 if diff else 1.0)
    half = float(stats.t.ppf(0.5 + level / 2, dof) * se)
    return {"test": test, "n_a": len(a), "n_b": len(b), "diff": float(diff), "se": float(se), "dof": float(dof),
            "t": float(t), "p": p, "lo": float(diff - half), "hi": float(diff + half)}


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment of the p-values of one family of tests (same order as `ps`): the
    i-th smallest is multiplied by (m - i), made non-decreasing, capped at 1. An adjusted p below a
    level rejects at that family-wise error rate, whatever the tests' dependence."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def _p(p: float) -> str:
    return f"{p:.3f}" if p >= 1e-3 else f"{p:.1e}"


def describe(label: str, c: dict) -> str:
    """One line: the difference in points with its 95% interval, the test and its p-value (and the
    Holm-adjusted one, where `c` carries it: `verdicts` adjusts over its family of comparisons)."""
    holm_p = f" (Holm {_p(c['p_holm'])} over {c['family']})" if "p_holm" in c else ""
    return (f"{label}: {c['diff'] * 100:+.1f} points, 95% CI [{c['lo'] * 100:+.1f}, {c['hi'] * 100:+.1f}], "
            f"{c['test']} t = {c['t']:.2f} (dof {c['dof']:.1f}), p = {_p(c['p'])}{holm_p}, "
            f"n = {c['n_a']} / {c['n_b']}")


def _eta0(runs: list[dict], variant: str, measure: str) -> dict[int, float]:
    """The eta 0 reference of an objective: its own eta 0 runs or decoupled's, whichever has more
    seeds (at eta 0 every token is the trained version's, so the objectives coincide)."""
    own, dec = _by_seed(runs, 0, variant, measure), _by_seed(runs, 0, "decoupled", measure)
    return own if len(own) >= len(dec) else dec


def verdicts(runs: list[dict], margin: float = 0.02, measure: str = "final") -> list[str]:
    """The paper's claims (Table 2 of arXiv 2505.24298) tested on this regime, each comparison a
    difference with its 95% interval and p-value (`compare`), and a verdict no stronger than those:

    - per objective, each eta against eta 0;
    - per eta, decoupled against each naive objective;
    - "naive degrades with eta": its interval at the largest eta lies below 0;
    - "decoupled holds": its interval at the largest eta lies above -margin.
    Each line gives the raw p-value and Holm's adjustment over every comparison listed for the
    measure (the family a reader scans for the smallest p).
    Otherwise the claim is called inconclusive at these seeds, or refuted when the interval
    excludes it (naive's above -margin: no degradation larger than the margin; decoupled's below
    -margin).
    """
    etas = sorted({r["eta"] for r in runs if r["variant"] != "sync"})
    present = [o for o in OBJECTIVES if any(r["variant"] == o for r in runs)]
    tests: dict[tuple[str, int], dict] = {}
    family: list[tuple[str, dict]] = []  # every comparison of this measure: one family for Holm
    for variant in present:
        for eta in etas:
            c = compare(_by_seed(runs, eta, variant, measure), _eta0(runs, variant, measure)) if eta else None
            if c is not None:
                tests[(variant, eta)] = c
                family.append((f"{variant} at eta {eta} - eta 0 ({measure})", c))
    for eta in etas:
        for naive in present[1:]:
            if eta and present[0] == "decoupled":
                c = compare(_by_seed(runs, eta, "decoupled", measure), _by_seed(runs, eta, naive, measure))
                if c is not None:
                    family.append((f"eta {eta}: decoupled - {naive} ({measure})", c))
    for (_, c), adjusted in zip(family, holm([c["p"] for _, c in family])):
        c.update(p_holm=adjusted, family=len(family))
    out = [describe(label, c) for label, c in family]
    top = max(etas) if etas else 0
    m = margin * 100
    for naive in present[1:]:
        c = tests.get((naive, top))
        if c is None:
            continue
        if c["hi"] < 0:
            out.append(f"{naive} degrades from eta 0 to eta {top} (interval below 0): the paper's claim holds here")
        elif c["lo"] > -margin:
            out.append(f"{naive} does not degrade by more than {m:.0f} points at eta {top} (interval above -{m:.0f}): "
                       "the paper's claim is refuted here")
        else:
            out.append(f"{naive} at eta {top}: inconclusive at these seeds (the interval spans 0 and -{m:.0f} points)")
    c = tests.get(("decoupled", top))
    if c is not None:
        if c["lo"] > -margin:
            out.append(f"decoupled holds within {m:.0f} points at eta {top} (interval above -{m:.0f}): "
                       "the paper's claim holds here")
        elif c["hi"] < -margin:
            out.append(f"decoupled loses more than {m:.0f} points at eta {top} (interval below -{m:.0f}): "
                       "the paper's claim is refuted here")
        else:
            out.append(f"decoupled at eta {top}: inconclusive at these seeds (the interval reaches below -{m:.0f} "
                       "points)")
    return out


def time_to_sync_accuracy(runs: list[dict]) -> list[str]:
    """Per seed: the synchronous run's final accuracy and wall time, and the first evaluation at
    which each asynchronous run of that seed is at least as accurate (its wall time then)."""
    lines = []
    for sync in sorted(select(runs, 0, "sync"), key=lambda r: r["seed"]):
        target, sync_wall = sync["final_accuracy"], sync["rl_wall_s"]
        for eta, variant in configs(runs):
            for r in select(runs, eta, variant):
                if variant == "sync" or r["seed"] != sync["seed"]:
                    continue
                hit = next(((s, t) for (s, a), (t, _) in zip(r["curve"], r["curve_wall"]) if a >= target), None)
                reach = (f"reaches it at step {hit[0]}, {hit[1]:.0f} s ({hit[1] / sync_wall:.2f}x sync's wall time)"
                         if hit else f"does not reach it (final {r['final_accuracy']:.3f})")
                lines.append(f"seed {r['seed']}: sync final {target:.3f} after {sync_wall:.0f} s; eta {eta} {variant} "
                             f"{reach}; whole run {r['rl_wall_s']:.0f} s = {r['rl_wall_s'] / sync_wall:.2f}x")
    syncs = select(runs, 0, "sync")
    if syncs:  # the same on the means over seeds (one seed's final accuracy moves by ~2 points)
        target, sync_wall = np.mean([r["final_accuracy"] for r in syncs]), np.mean([r["rl_wall_s"] for r in syncs])
        for eta, variant in configs(runs):
            if variant == "sync":
                continue
            rs = select(runs, eta, variant)
            steps, acc, _, _ = mean_curve(rs, "curve")
            wall, _, _, _ = mean_curve(rs, "curve_wall")
            hit = next((i for i, a in enumerate(acc) if a >= target - 1e-9), None)
            reach = (f"first reaches it at step {steps[hit]:.0f}, {wall[hit]:.0f} s = {wall[hit] / sync_wall:.2f}x "
                     "sync's wall time" if hit is not None else f"does not reach it (best {acc.max():.3f})")
            lines.append(f"means over seeds: sync final {target:.3f} after {sync_wall:.0f} s; eta {eta} {variant} "
                         f"{reach}")
    return lines


def plot(regimes: list[tuple[str, list[dict]]], path: pathlib.Path) -> None:
    """One row per regime: per objective present, its runs by eta against steps (for the naive
    ones with eta 0 of decoupled, the same objective when every token is the trained version's, as
    the reference), and every decoupled run against wall time; a synchronous baseline (black,
    dotted) in every panel it exists for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [o for o in OBJECTIVES if any(r["variant"] == o for _, runs in regimes for r in runs)]
    panels = [(o, "curve", f"{o.replace('_', ' ')} PPO", "RL step") for o in present]
    panels.append(("decoupled", "curve_wall", "decoupled PPO", "RL wall time, s (2-vCPU host, one run at a time)"))
    fig, axes = plt.subplots(len(regimes), len(panels), figsize=(5.4 * len(panels), 4.2 * len(regimes)),
                             squeeze=False, sharey="row")
    colours = plt.get_cmap("viridis")
    all_etas = sorted({r["eta"] for _, runs in regimes for r in runs if r["variant"] != "sync"})
    for row, (label, runs) in enumerate(regimes):
        for col, (objective, key, title, xlabel) in enumerate(panels):
            ax = axes[row][col]
            for eta, variant in configs(runs):
                # eta 0: the decoupled runs stand for both objectives (the same run when every
                # token is the trained version's: behavior = proximal).
                reference = objective != "decoupled" and eta == 0 and variant == "decoupled"
                if (variant not in (objective, "sync") and not reference) or (variant in OBJECTIVES[1:] and eta == 0):
                    continue
                rs = select(runs, eta, variant)
                x, mean, lo, hi = mean_curve(rs, key)
                colour = "black" if variant == "sync" else colours(all_etas.index(eta) / max(1, len(all_etas) - 1) * 0.9)
                name = "sync" if variant == "sync" else f"eta {eta}" + (" (= decoupled)" if reference else "")
                ax.plot(x, mean, ":" if variant == "sync" else "-", color=colour, marker="o", markersize=3,
                        label=f"{name}, n={len(rs)}")
                ax.fill_between(x, lo, hi, color=colour, alpha=0.08)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out greedy accuracy")
            ax.set_title(f"{label}: {title}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Held-out accuracy, mean over seeds (shaded: min..max)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def cross_regime(regimes: dict[str, list[dict]], spec: str, measure: str = "final") -> str:
    """`compare` of two configurations named "LABEL:ETA:OBJECTIVE,LABEL:ETA:OBJECTIVE" (first minus
    second) in the regimes by label."""
    # Each side ends in ":ETA:OBJECTIVE", so the split is unambiguous even when a label holds a comma.
    m = re.fullmatch(r"(.+):(\d+):(\w+),(.+):(\d+):(\w+)", spec)
    if m is None:
        raise SystemExit(f"--compare {spec!r}: expected two configurations LABEL:ETA:OBJECTIVE separated by a comma")
    sides = []
    for label, eta, objective in (m.groups()[:3], m.groups()[3:]):
        if label not in regimes:
            raise SystemExit(f"--compare {spec!r}: {label!r} is not the label of a --regime "
                             f"({', '.join(map(repr, regimes))}); expected LABEL:ETA:OBJECTIVE")
        sides.append(_by_seed(regimes[label], int(eta), objective, measure))
    c = compare(*sides)
    spec = f"{':'.join(m.groups()[:3])} - {':'.join(m.groups()[3:])}"
    return describe(f"{spec} ({measure})", c) if c else f"{spec}: fewer than 2 seeds on a side"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regime", action="append", required=True, metavar="LABEL=DIR",
                   help="a label and a staleness_ablation --out directory (repeatable)")
    p.add_argument("--png", default=None, help="where to write the plot")
    p.add_argument("--compare", action="append", default=[], metavar="LABEL:ETA:OBJECTIVE,LABEL:ETA:OBJECTIVE",
                   help="also test one configuration against another across regimes (e.g. a capped decoupled "
                        "arm against the uncapped one), paired by seed where they share seeds (repeatable)")
    args = p.parse_args(argv)
    regimes = []
    for spec in args.regime:
        label, sep, out = spec.rpartition("=")
        if not sep or not label:
            raise SystemExit(f"--regime {spec!r}: expected LABEL=DIR")
        regimes.append((label, load_regime(pathlib.Path(out))))
    for label, runs in regimes:
        print(f"\n### {label}\n\n{summary_table(runs)}\n")
        for line in verdicts(runs) + verdicts(runs, measure="run_mean") + time_to_sync_accuracy(runs):
            print(f"- {line}")
    by_label = dict(regimes)
    for spec in args.compare:
        print(f"- {cross_regime(by_label, spec)}")
    if args.png:
        plot(regimes, pathlib.Path(args.png))
        print(f"\nplot: {args.png}")


if __name__ == "__main__":
    main()
