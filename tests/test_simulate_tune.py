"""`areal-jax simulate --tune`: the search (simulate/tune.py) and the command (simulate/tune_run.py)."""

import dataclasses
import json
import math
import pathlib

import pytest

from areal_jax.cli import main
from areal_jax.simulate.tune import Knobs, budget_candidates, search
from areal_jax.simulate.tune_run import format_tune, row_buckets_for

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


@dataclasses.dataclass(frozen=True)
class _Fit:
    fits: bool
    peak_fraction: float = 0.5
    tightest: str = "train/grad"
    source: str = "table"


def _knobs(split, budget, slots=64, eta=2):
    return Knobs(generation_devices=split, budget=budget, slots=slots, pool_bytes=0, eta=eta, max_concurrent=8)


def test_search_finds_the_planted_optimum_of_a_cost_table():
    # Throughput by (split, budget, slots): stage one sees splits x budgets at 64 slots; the planted
    # optimum needs 128 slots at the second-best pair of stage one, so only stage two reaches it.
    # A faster point (split 3, budget 4096) does not fit and must never be simulated.
    table = {(1, 2048, 64): 10.0, (1, 4096, 64): 12.0, (2, 2048, 64): 30.0, (2, 4096, 64): 28.0,
             (3, 2048, 64): 20.0, (3, 4096, 64): 99.0,
             (2, 2048, 128): 31.0, (2, 4096, 128): 40.0, (2, 2048, 32): 29.0, (2, 4096, 32): 27.0,
             (3, 2048, 128): 21.0, (3, 2048, 32): 19.0}
    too_big = {(3, 4096, 64)}
    simulated = []

    def fits(k):
        return _Fit(fits=(k.generation_devices, k.budget, k.slots) not in too_big)

    def evaluate(k):
        simulated.append(k)
        return table[(k.generation_devices, k.budget, k.slots)], {}

    first = [_knobs(g, b) for g in (1, 2, 3) for b in (2048, 4096)]
    result = search(first, lambda k: [dataclasses.replace(k, slots=s) for s in (32, 64, 128)], fits=fits,
                    evaluate=evaluate, keep=2)
    assert result.best.knobs == _knobs(2, 4096, slots=128)
    assert result.best.trained_tokens_per_s == 40.0 and result.best.stage == 2
    assert _knobs(3, 4096) not in simulated and [k for k, _ in result.refused] == [_knobs(3, 4096)]
    assert len(simulated) == len(set(simulated))  # no point simulated twice
    scores = [p.trained_tokens_per_s for p in result.points]
    assert scores == sorted(scores, reverse=True)
    # keep=1 refines only stage one's best (split 2, budget 2048): the planted point is out of reach.
    assert search(first, lambda k: [dataclasses.replace(k, slots=s) for s in (32, 64, 128)], fits=fits,
                  evaluate=evaluate, keep=1).best.knobs == _knobs(2, 2048, slots=128)


def test_budget_candidates_and_buckets():
    assert budget_candidates(17408, 32768) == [17408, 32768, 65536, 131072]
    assert budget_candidates(1000, 5000, span=4) == [1000, 1024, 2048, 5000]  # up to 4,000 and the own
    # The largest bucket holds the whole budget; buckets past it go.
    assert row_buckets_for((1024, 2048, 17408, 32768), 65536) == (1024, 2048, 17408, 32768, 65536)
    assert row_buckets_for((1024, 2048, 17408, 32768), 17408) == (1024, 2048, 17408)
    with pytest.raises(ValueError, match="budget"):
        _knobs(1, 0)


def test_tune_cli_writes_a_point_that_simulates_to_its_figure(tmp_path, capsys, monkeypatch):
    # The colocated LoRA config (2 x H100): a small search, cut short (few steps, eta fixed). An
    # empty plan cache: every verdict is the hand estimate.
    monkeypatch.setenv("AREAL_JAX_PLAN_CACHE", str(tmp_path / "plan_cache"))
    config = str(CONFIGS / "qwen2_5_7b_lora_gpu.gin")
    out = tmp_path / "tuned.gin"
    common = ["--steps", "4", "--warmup", "1"]
    assert main(["simulate", "--gin_file", config, "--tune", "--json", "--write", str(out), *common]) == 0
    report = json.loads(capsys.readouterr().out)
    best = report["points"][0]
    assert report["simulated"] >= 2 and best["memory"]["fits"] and best["memory"]["source"] == "estimate"
    assert best["memory"]["peak_fraction"] <= 0.9
    assert all(p["trained_tokens_per_s"] <= best["trained_tokens_per_s"] for p in report["points"])
    assert math.isclose(best["trained_tokens_per_s_per_device"], best["trained_tokens_per_s"] / 2, rel_tol=1e-9) \
        or "trained_tokens_per_s_per_device" in best["row"]
    text = out.read_text()
    assert all(b in text for b in best["bindings"])
    # The written file, after the config, simulates to the best point's figure.
    assert main(["simulate", "--gin_file", config, "--gin_file", str(out), "--json", *common]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert math.isclose(rows[0]["trained_tokens_per_s"], best["trained_tokens_per_s"], rel_tol=1e-9)
    # The table: each point's memory source and its bindings.
    table = format_tune(report, top=1)
    assert "estimate" in table and "# 1:" in table and best["bindings"][-1] in table


def test_tune_sweeps_the_caches_dtype_only_when_asked(tmp_path, capsys, monkeypatch):
    """`--sweep kv_dtype=...` adds each dtype's engine to stage two (the config's own dtype bound by
    nothing, never simulated twice); a bf16 point binds its dtype and simulates to its figure;
    without the sweep every point keeps the config's dtype."""
    monkeypatch.setenv("AREAL_JAX_PLAN_CACHE", str(tmp_path / "plan_cache"))
    config = str(CONFIGS / "qwen2_5_7b_lora_gpu.gin")  # FP8 keys and values
    common = ["--steps", "4", "--warmup", "1", "--json"]
    assert main(["simulate", "--gin_file", config, "--tune", "--sweep", "kv_dtype=bfloat16,float8_e4m3fn",
                 *common]) == 0
    report = json.loads(capsys.readouterr().out)
    dtypes = [p["knobs"]["kv_dtype"] for p in report["points"]]
    assert set(dtypes) == {"", "bfloat16"}  # float8_e4m3fn is the config's own: ""
    assert len({json.dumps(p["knobs"], sort_keys=True) for p in report["points"]}) == len(report["points"])
    bf16 = next(p for p in report["points"] if p["knobs"]["kv_dtype"] == "bfloat16")
    assert 'EngineConfig.kv_dtype = "bfloat16"' in bf16["bindings"]
    assert "searched over ['bfloat16', 'float8_e4m3fn']" in report["assumptions"]["kv_dtype"]
    tuned = tmp_path / "bf16.gin"
    tuned.write_text("\n".join(bf16["bindings"]) + "\n")
    assert main(["simulate", "--gin_file", config, "--gin_file", str(tuned), *common]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert math.isclose(rows[0]["trained_tokens_per_s"], bf16["trained_tokens_per_s"], rel_tol=1e-9)
    assert main(["simulate", "--gin_file", config, "--tune", *common]) == 0
    assert {p["knobs"]["kv_dtype"] for p in json.loads(capsys.readouterr().out)["points"]} == {""}


@pytest.mark.parametrize("argv, message", [
    (["--write", "x.gin"], "--write takes --tune"),
    (["--tune", "--sweep", "mode=sync"], "--tune searches"),
    (["--tune", "--sweep", "split=8"], "--sweep split"),
    (["--tune", "--tune_top", "0"], "--tune_top"),
    (["--tune", "--sweep", "kv_dtype=fp8"], "kv_dtype takes values of"),
    (["--sweep", "kv_dtype=bfloat16"], "kv_dtype is swept by --tune"),
])
def test_tune_refuses_bad_flags(argv, message, capsys):
    config = str(CONFIGS / "qwen3_1_7b_gsm8k_gpu.gin")
    assert main(["simulate", "--gin_file", config, *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.gin") if "PlanConfig.target" in p.read_text()))
def test_every_shipped_config_is_within_5_percent_of_its_tune(config, capsys):
    assert main(["simulate", "--gin_file", str(CONFIGS / config), "--tune", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["own_rank"] is not None, f"{config}: its own point does not fit: {report['own']['memory']}"
    own = report["points"][report["own_rank"] - 1]
    assert own["trained_tokens_per_s"] >= 0.95 * report["points"][0]["trained_tokens_per_s"], \
        f"{config}: {own['trained_tokens_per_s']:,.0f} vs the tune's {report['points'][0]['trained_tokens_per_s']:,.0f}"
