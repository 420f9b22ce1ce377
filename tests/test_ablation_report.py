"""bench/ablation_report.py: the paired and Welch comparisons against scipy's tests and their
closed forms, and the verdicts on constructed regimes whose answer is known."""

import math

import numpy as np
import pytest
from scipy import stats

from bench.ablation_report import compare, holm, verdicts


def test_paired_when_the_seeds_match():
    a, b = {0: 0.50, 1: 0.61, 2: 0.70, 3: 0.66}, {0: 0.40, 1: 0.55, 2: 0.50, 3: 0.60}
    c = compare(a, b)
    d = np.array([a[k] - b[k] for k in range(4)])
    want = stats.ttest_rel([a[k] for k in range(4)], [b[k] for k in range(4)])
    assert c["test"] == "paired" and c["dof"] == 3
    assert c["diff"] == pytest.approx(d.mean())
    assert c["t"] == pytest.approx(want.statistic) and c["p"] == pytest.approx(want.pvalue)
    half = stats.t.ppf(0.975, 3) * d.std(ddof=1) / 2.0
    assert (c["lo"], c["hi"]) == pytest.approx((d.mean() - half, d.mean() + half))


def test_welch_when_the_seeds_differ():
    a, b = {0: 0.50, 1: 0.61, 2: 0.70}, {5: 0.40, 6: 0.45, 7: 0.52, 8: 0.38}
    c = compare(a, b)
    want = stats.ttest_ind(list(a.values()), list(b.values()), equal_var=False)
    assert c["test"] == "Welch"
    assert c["t"] == pytest.approx(want.statistic) and c["p"] == pytest.approx(want.pvalue)
    # The interval is where the Welch test at 5% would not reject: p = 0.05 at its ends.
    for end in (c["lo"], c["hi"]):
        shifted = {k: v - end for k, v in a.items()}
        p_end = stats.ttest_ind(list(shifted.values()), list(b.values()), equal_var=False).pvalue
        assert p_end == pytest.approx(0.05, abs=1e-9)


def test_too_few_seeds_and_no_spread():
    assert compare({0: 0.5}, {0: 0.4, 1: 0.3}) is None
    c = compare({0: 0.5, 1: 0.6}, {0: 0.4, 1: 0.5})  # every paired difference 0.1: no spread
    assert c["diff"] == pytest.approx(0.1) and c["p"] == 0.0 and math.isinf(c["t"])


def _regime(effects, seeds=range(5), noise=0.01):
    """Runs whose final accuracy is 0.6 + effects[(variant, eta)] + per-seed noise."""
    rng = np.random.default_rng(0)
    runs = []
    for (variant, eta), effect in effects.items():
        for seed in seeds:
            acc = 0.6 + effect + rng.normal(0, noise)
            runs.append({"eta": eta, "variant": variant, "seed": seed, "final_accuracy": acc,
                         "curve": [(0, 0.5), (10, acc), (20, acc)]})
    return runs


def test_verdicts_reproduce_refute_or_abstain():
    held = verdicts(_regime({("decoupled", 0): 0.0, ("decoupled", 8): 0.0, ("naive", 8): -0.2,
                             ("naive_recompute", 8): -0.15}))
    assert "naive degrades from eta 0 to eta 8 (interval below 0): the paper's claim holds here" in held
    assert any(v.startswith("naive_recompute degrades") for v in held)
    assert any(v.startswith("decoupled holds within 2 points at eta 8") for v in held)
    [line] = [v for v in held if v.startswith("eta 8: decoupled - naive (final):")]
    assert "paired" in line and "+2" in line.split("points")[0]  # about +20 points, paired by seed

    refuted = verdicts(_regime({("decoupled", 0): 0.0, ("decoupled", 8): -0.1, ("naive", 8): 0.0}, noise=0.003))
    assert any(v.startswith("naive does not degrade by more than 2 points") for v in refuted)
    assert any(v.startswith("decoupled loses more than 2 points") for v in refuted)

    noisy = verdicts(_regime({("decoupled", 0): 0.0, ("decoupled", 8): -0.02, ("naive", 8): -0.02}, seeds=range(3),
                             noise=0.05))
    assert any(v.startswith("naive at eta 8: inconclusive") for v in noisy)
    assert any(v.startswith("decoupled at eta 8: inconclusive") for v in noisy)


def test_holm_adjusts_the_family_of_comparisons():
    """Holm's step-down: the i-th smallest p times (m - i), non-decreasing, at most 1; in input order."""
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and holm([]) == []
    # Against the closed form on random p-values: max over j <= i of (m - j) p_(j).
    ps = list(np.random.default_rng(3).uniform(0, 0.2, 10))
    order = np.argsort(ps)
    want = np.maximum.accumulate(np.minimum(1.0, (10 - np.arange(10)) * np.sort(ps)))
    assert [holm(ps)[i] for i in order] == pytest.approx(list(want))
    # Each verdict line carries its raw and its adjusted p over the measure's comparisons.
    lines = verdicts(_regime({("decoupled", 0): 0.0, ("decoupled", 8): 0.0, ("naive", 8): -0.05}, noise=0.02))
    tested = [v for v in lines if ", p = " in v]
    assert len(tested) == 3 and all("(Holm " in v and " over 3)" in v for v in tested)
    raw = [float(v.split(", p = ")[1].split(" ")[0]) for v in tested]
    adjusted = [float(v.split("(Holm ")[1].split(" ")[0]) for v in tested]
    assert all(a >= r for a, r in zip(adjusted, raw)) and max(adjusted) <= 1.0


@pytest.mark.parametrize("variant", ["decoupled", "naive", "naive_recompute"])
def test_offpolicy_regime_and_seed_bindings_build_the_intended_job(variant):
    # The bindings bench/staleness_ablation.py adds must parse over the quickstart and mean what
    # they say (a typo would only surface hours into a sweep).
    from areal_jax import config_system as cs
    from areal_jax.jobs.configs import load_job_configs
    from bench.staleness_ablation import REGIMES, ROOT, objective_bindings, seed_bindings

    try:
        job = load_job_configs([ROOT / "configs" / "quickstart.gin"],
                               [*REGIMES["offpolicy"], *seed_bindings(3), *objective_bindings(variant)], run_dir="/x")
    finally:
        cs.parse()
    assert job.rollout.temperature == job.ppo.temperature == 1.0
    assert job.advantages.norm == "batch" and job.ppo.num_minibatches == 4
    assert job.ppo.behav_imp_weight_cap is None and job.ppo.objective == variant
    assert job.sft.seed == job.model.init_seed == job.task.seed == 3
    assert job.sft.stop_accuracy == 0.3 and job.sft.eval_from == 300


def test_cross_regime_comparison_pairs_by_seed():
    from bench.ablation_report import cross_regime

    regimes = {"no cap": _regime({("decoupled", 8): -0.1}), "cap 5": _regime({("decoupled", 8): 0.0})}
    line = cross_regime(regimes, "cap 5:8:decoupled,no cap:8:decoupled")
    assert line.startswith("cap 5:8:decoupled - no cap:8:decoupled (final): +1") and "paired" in line
    with pytest.raises(SystemExit, match="LABEL:ETA:OBJECTIVE"):
        cross_regime(regimes, "cap 6:8:decoupled,no cap:8:decoupled")
    # A label may hold a comma: each side ends in ":ETA:OBJECTIVE".
    regimes["off-policy, 40 steps"] = regimes.pop("no cap")
    line = cross_regime(regimes, "cap 5:8:decoupled,off-policy, 40 steps:8:decoupled")
    assert line.startswith("cap 5:8:decoupled - off-policy, 40 steps:8:decoupled (final): +1")
    with pytest.raises(SystemExit, match="LABEL:ETA:OBJECTIVE"):
        cross_regime(regimes, "cap 5:8:decoupled")


def test_kept_results_are_gzipped_and_read_like_plain_jsonl(tmp_path):
    # bench/results/ keeps metrics.jsonl gzipped (its README says how); a plain one left there would
    # put ~10k data lines back in the tree. The report reads both forms to the same figures.
    import gzip
    import json
    import shutil

    from bench.staleness_ablation import ROOT, read_run

    results = ROOT / "bench" / "results"
    plain_left = sorted(results.rglob("*.jsonl"))
    assert not plain_left, f"{plain_left}: compress with find bench/results -name '*.jsonl' -exec gzip -n -9 {{}} +"
    kept = results / "staleness_offpolicy" / "main" / "eta8_decoupled_seed0"
    plain = tmp_path / "run"
    plain.mkdir()
    shutil.copy(kept / "summary.json", plain / "summary.json")
    (plain / "metrics.jsonl").write_bytes(gzip.decompress((kept / "metrics.jsonl.gz").read_bytes()))
    from_gz, from_plain = read_run(kept, warmup=3), read_run(plain, warmup=3)
    assert json.dumps(from_gz, sort_keys=True) == json.dumps(from_plain, sort_keys=True)
    assert from_gz["steps"] == 40 and from_gz["final_accuracy"] == pytest.approx(0.570)  # docs/benchmarks.md's seed 0
    (plain / "metrics.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl.gz"):
        read_run(plain, warmup=3)
