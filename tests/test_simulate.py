"""`areal-jax simulate`: the discrete-event model of the whole system (areal_jax/simulate/)."""

import dataclasses
import json

import numpy as np
import pytest

from areal_jax.generation.config import EngineConfig
from areal_jax.simulate.calibrate import fit_costs
from areal_jax.simulate.config import RowConfig, Workload
from areal_jax.simulate.costs import LinearCosts
from areal_jax.simulate.lengths import LengthSampler, parse_length_spec, read_rollout_lengths
from areal_jax.simulate.system import Simulation

WORKLOAD = Workload(hosts=1, devices_per_host=4, batch_groups=8, samples_per_group=4, max_concurrent=12,
                    channel_capacity=32, engine=EngineConfig(num_slots=48, max_seq_len=432, decode_chunk=8),
                    generation_tensor=1, train_tensor=1, config_generation_devices=2, max_tokens_per_microbatch=1024,
                    num_minibatches=2, max_new_tokens=384)
COSTS = LinearCosts(decode_step=2e-3, decode_slot=1e-5, decode_window=3e-6, prefill_call=4e-3, prefill_token=2e-6,
                    insert_call=1e-3, reprefill_call=5e-3, reprefill_token=3e-6, train_step=0.05,
                    train_microbatch=0.02, train_token=4e-5, train_attention=1e-8, transfer_s=0.01)


def simulate(row: RowConfig, spec="geometric:mean=60", *, workload=WORKLOAD, costs=COSTS):
    sampler = LengthSampler(parse_length_spec(spec), cap=workload.max_new_tokens, prompt=16, seed=row.seed)
    return Simulation(workload, row, costs, sampler, scale_engine=False).run()


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_eta_bounds_the_staleness_of_trained_tokens(eta):
    # With the per-group age filter K, no trained token lags more than eta + K versions (the
    # controller's guarantee); eta 0 is synchronous whatever the lengths.
    age = 1
    result = simulate(RowConfig(mode="async", eta=eta, generation_devices=2, steps=16, warmup_steps=2),
                      workload=dataclasses.replace(WORKLOAD, max_group_age=age))
    assert result.staleness_max <= eta + age
    if eta == 0:
        assert result.staleness_max == 0 and result.staleness_mean == 0.0
    else:
        assert result.staleness_mean > 0.5  # generation does run ahead: the bound is what limits it


def test_more_eta_more_staleness_and_throughput_until_generation_bound():
    rows = [simulate(RowConfig(mode="async", eta=eta, generation_devices=2, steps=16, warmup_steps=2))
            for eta in (0, 1, 4)]
    means = [r.staleness_mean for r in rows]
    assert means == sorted(means) and means[0] == 0.0
    assert rows[1].trained_tokens_per_s > 1.2 * rows[0].trained_tokens_per_s


def test_equal_lengths_and_free_transfer_match_the_analytic_throughput():
    # eta 0 on a split: each step generates one batch (every sample admitted together, one token
    # from the prefill and L - 1 decode steps), then trains it; nothing overlaps.
    L, d, t0 = 100, 1e-3, 0.05
    costs = LinearCosts(decode_step=d, train_step=t0)
    workload = dataclasses.replace(WORKLOAD, max_concurrent=WORKLOAD.batch_groups)
    result = simulate(RowConfig(mode="async", eta=0, generation_devices=2, steps=10, warmup_steps=2),
                      f"constant:length={L}", workload=workload, costs=costs)
    groups, n = workload.batch_groups, workload.samples_per_group
    expected = groups * n * L / ((L - 1) * d + t0)
    assert result.trained_tokens_per_s == pytest.approx(expected, rel=1e-9)
    assert result.generation_busy == pytest.approx((L - 1) * d / ((L - 1) * d + t0), rel=1e-9)
    assert result.slot_occupancy == pytest.approx(groups * n / workload.engine.num_slots)
    # The synchronous baseline on the same costs is the same schedule.
    sync = simulate(RowConfig(mode="sync", eta=0, steps=10, warmup_steps=2), f"constant:length={L}",
                    workload=workload, costs=costs)
    assert sync.trained_tokens_per_s == pytest.approx(expected, rel=1e-9)


def test_calibration_recovers_the_costs_a_run_was_simulated_with():
    # The simulator records its calls in the run's own metrics format; fitting them gives back the
    # costs (the minibatch term is not identifiable with a fixed minibatch count: truth 0).
    # More groups in flight than slots: some groups start on a kept prefill block (insert calls).
    result = simulate(RowConfig(mode="async", eta=2, generation_devices=2, steps=24, warmup_steps=2),
                      "geometric:mean=80", workload=dataclasses.replace(WORKLOAD, max_concurrent=15))
    records = json.loads(json.dumps(list(result.records)))  # through JSON, as metrics.jsonl holds them
    kinds = {k for r in records for k in r["timings"]}
    assert {"decode", "prefill", "insert", "reprefill", "train"} <= kinds
    fit = fit_costs(records, skip_steps=0)
    for f in dataclasses.fields(LinearCosts):
        if f.name not in ("label", "ride_token"):
            assert getattr(fit.costs, f.name) == pytest.approx(getattr(COSTS, f.name), rel=1e-6, abs=1e-12), f.name
    assert fit.costs.ride_token is None  # no chunk carried re-prefill rows: they would cost reprefill_token
    assert max(fit.residuals.values()) < 1e-9 and not fit.dropped


def test_calibration_leaves_out_a_compiling_call():
    result = simulate(RowConfig(mode="async", eta=2, generation_devices=2, steps=24, warmup_steps=2))
    records = json.loads(json.dumps(list(result.records)))
    prefill = next(r["timings"]["prefill"] for r in records if "prefill" in r["timings"])
    key = next(iter(prefill))
    prefill[key]["s"] += 2.0  # a call that compiled
    fit = fit_costs(records, skip_steps=0)
    assert fit.dropped == {"prefill": 1}
    assert fit.costs.prefill_call == pytest.approx(COSTS.prefill_call, rel=1e-6)


def test_runs_are_deterministic_for_a_seed():
    row = RowConfig(mode="async", eta=2, generation_devices=2, steps=12, warmup_steps=2, seed=5)
    a, b = simulate(row), simulate(row)
    assert a == b and a.records == b.records
    other = simulate(dataclasses.replace(row, seed=6))
    assert other.trained_tokens_per_s != a.trained_tokens_per_s


def test_interruption_re_prefills_in_flight_samples_and_sync_does_not():
    async_row = simulate(RowConfig(mode="async", eta=2, generation_devices=2, steps=12, warmup_steps=2))
    sync_row = simulate(RowConfig(mode="sync", eta=0, steps=12, warmup_steps=2))
    assert async_row.reprefill_per_trained_token > 0.05
    assert sync_row.reprefill_per_trained_token == 0.0
    assert async_row.slot_occupancy > sync_row.slot_occupancy  # no batch barrier


def test_length_specs_and_errors(tmp_path):
    spec = parse_length_spec("lognormal:mean=3000,sigma=1.2,cap=16384,prompt=256")
    sampler = LengthSampler(spec, cap=99, prompt=7, seed=0)
    prompt, lengths = sampler.group(4000)
    assert prompt == 256 and lengths.max() <= 16384 and 2500 < lengths.mean() < 3200
    assert parse_length_spec("constant:512").params == (("length", 512.0),)
    for bad, words in (("pareto:mean=3", "unknown"), ("lognormal:mean=3", "sigma"), ("geometric:mean=x", "key=number"),
                       ("uniform:lo=5,hi=2", "lo"), ("geometric:mean=3,tail=2", "not 'tail'")):
        with pytest.raises(ValueError, match=words):
            parse_length_spec(bad)
    step = tmp_path / "rollouts" / "step_0.jsonl"
    step.parent.mkdir()
    step.write_text("\n".join(json.dumps({"versions": [0] * n, "prompt_tokens": 9}) for n in (3, 5, 7)) + "\n")
    lengths = read_rollout_lengths(tmp_path)
    assert lengths.completions.tolist() == [3, 5, 7] and lengths.prompts.tolist() == [9, 9, 9]
    with pytest.raises(ValueError, match="no rollouts"):
        read_rollout_lengths(tmp_path / "missing")


def test_configs_are_validated_on_construction():
    with pytest.raises(ValueError, match="eta 0"):
        RowConfig(mode="sync", eta=2)
    with pytest.raises(ValueError, match="steps"):
        RowConfig(steps=3, warmup_steps=3)
    with pytest.raises(ValueError, match="divide over 3 hosts"):
        dataclasses.replace(WORKLOAD, hosts=3)
    with pytest.raises(ValueError, match="split"):
        RowConfig(mode="async", generation_devices=4).check(WORKLOAD)
    with pytest.raises(ValueError, match="decode_step"):
        LinearCosts(decode_step=-1.0)
    assert np.isfinite(simulate(RowConfig(mode="async", eta=1, generation_devices=3, steps=6, warmup_steps=1))
                       .trained_tokens_per_s)


def test_cli_on_a_target_gives_the_json_schema(capsys):
    from areal_jax.cli import main

    assert main(["simulate", "--gin_file", "configs/qwen2_5_7b_math_gpu.gin", "--steps", "4", "--warmup", "1",
                 "--length-dist", "lognormal:mean=2000,sigma=1", "--sweep", "eta=1,4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    # The swept rows, and the sync baseline "vs sync" compares with, kept under a sweep.
    assert [(r["mode"], r["eta"]) for r in rows] == [("async", 1), ("async", 4), ("sync", 0)]
    assert rows[-1]["vs_sync"] == 1.0 and all(r["vs_sync"] > 0 for r in rows)
    for r in rows:
        assert {"mode", "eta", "generation_devices", "train_devices", "trained_tokens_per_s", "generation_busy",
                "train_busy", "staleness_max", "staleness_mean"} <= r.keys()
        assert r["trained_tokens_per_s"] > 0
        # The whole run: RLConfig.steps (300 in this config) at the row's step time, on all 8 devices.
        run = r["run"]
        assert run["steps"] == 300 and run["devices"] == 8
        assert run["wall_hours"] == pytest.approx(r["step_s"] * 300 / 3600)
        assert run["device_hours"] == pytest.approx(run["wall_hours"] * 8)
    assert all(r["generation_devices"] == 4 and r["train_devices"] == 4 for r in rows[:2])  # the config's 4:4
    assert "mean length" in report["assumptions"]["step time"]
    assert "roofline on 8xh200" in report["assumptions"]["costs"]
    # Issue 40: what a user needs to judge each row.
    sync = rows[-1]
    assert sync["async_bound"] == pytest.approx(1 / (sync["generation_share"] * sync["sync_generation_efficiency"]
                                                     + sync["train_share"] * sync["sync_train_efficiency"]))
    assert 0 < sync["generation_share"] < 1 and 0 < sync["sync_generation_efficiency"] <= 1
    assert 0 < sync["train_share"] < 1 and 0 < sync["sync_train_efficiency"] <= 1
    assert sync["generation_share"] + sync["train_share"] + sync["idle_share"] == pytest.approx(1.0)
    # The bound's concurrency: the most any row sustains (async's live sequences, sync's one batch).
    assert sync["bound_live_per_replica"] == max(r["sustained_per_replica"] for r in rows)
    assert sync["sustained_per_replica"] == 32 * 8 / 8  # one batch's samples per replica (8 replicas of 1 GPU)
    for r in rows:
        assert r["trained_tokens_per_s_per_device"] * 8 == pytest.approx(r["trained_tokens_per_s"])
        assert 1.0 <= r["padded_token_ratio"] < 1.5  # short rows here: a bucket's last micro-batch is part empty
        roof = r["roofline"]
        assert 1 / (roof["t_gen_s"] + roof["t_prefill_s"] + roof["t_train_s"]) == pytest.approx(
            roof["tokens_per_s_per_device"])
        assert 0 < roof["t_prefill_s"] < 0.1 * roof["t_gen_s"]
        assert r["roofline_fraction"] == pytest.approx(r["trained_tokens_per_s_per_device"]
                                                       / roof["tokens_per_s_per_device"])
        assert 0 < r["roofline_fraction"] <= 1  # the simulator runs on the roofline's own costs
    for r in rows[:2]:
        assert r["async_bound"] == sync["async_bound"]
        assert r["vs_async_bound"] == pytest.approx(r["vs_sync"] / sync["async_bound"])
        assert r["vs_async_bound"] <= 1 + 1e-9  # the bound holds for every row
    # Training in the bound: the cheapest training device-seconds per trained token of the rows.
    per_token = [r["train_s_per_step"] * r["train_devices"] / (r["trained_tokens_per_s"] * r["step_s"]) for r in rows]
    assert sync["sync_train_efficiency"] == pytest.approx(min(per_token) / per_token[-1])


def test_the_async_bound_by_hand():
    """Sync spends 12 device-seconds per trained token: 8 generating, 3 training, 1 idle. The
    roofline at the bound's concurrency generates a token in 2 and trains it in 2.4: e_s = 2 / 8 =
    0.25, e_t = 2.4 / 3 = 0.8, g = 8 / 12, t = 3 / 12, and the bound is 1 / (g e_s + t e_t) =
    12 / (2 + 2.4) = 2.727...: no scheduler spends less than 4.4 device-seconds per token. With no
    idle time and training at its roofline it is the issue's 1 + g' (1 / e_s - 1), g' = e_s G / (e_s G + T)."""
    from areal_jax.simulate.roofline import async_bound, sync_terms

    terms = sync_terms(12.0, 8.0, 3.0, 2.0, 2.4)
    assert terms["generation_share"] == pytest.approx(2 / 3) and terms["train_share"] == pytest.approx(0.25)
    assert terms["idle_share"] == pytest.approx(1 / 12)
    assert terms["sync_generation_efficiency"] == pytest.approx(0.25)
    assert terms["sync_train_efficiency"] == pytest.approx(0.8)
    assert terms["async_bound"] == pytest.approx(12 / 4.4) == pytest.approx(2.7272727)
    # The form: G = 10 at e_s 0.4, T = 2 at its roofline, no idle: (10 + 2) / (4 + 2) = 2.0.
    assert sync_terms(12.0, 10.0, 2.0, 4.0, 2.0)["async_bound"] == pytest.approx(2.0)
    g_prime = 4 / (4 + 2)
    assert async_bound(10 / 12, 0.4) == pytest.approx(1 + g_prime * (1 / 0.4 - 1)) == pytest.approx(2.0)
    assert async_bound(0.7, 1.0) == 1.0 and async_bound(0.0, 0.1) == 1.0  # no tail, or no generation
    with pytest.raises(ValueError, match="e_s"):
        async_bound(0.5, 0.0)
    with pytest.raises(ValueError, match="g \\+ t"):
        async_bound(0.7, 0.5, 0.5)


def test_the_bound_holds_where_async_decodes_more_sequences_than_sync(capsys):
    """The 70B GPU config keeps ~53 sequences live per replica against sync's one batch of 32 per
    replica: the issue's bound (sync's generation at its slot occupancy) put async at 119% of it;
    against the roofline at the larger concurrency async stays below."""
    from areal_jax.cli import main

    assert main(["simulate", "--gin_file", "configs/llama3_3_70b_math_gpu.gin", "--steps", "6", "--warmup", "2",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    run, sync = rows[0], rows[-1]
    assert run["live_per_replica"] > sync["sustained_per_replica"] == 32
    assert sync["bound_live_per_replica"] == run["live_per_replica"]
    old = sync["generation_s_per_step"] * sync["slot_occupancy"]  # the tail-free generation
    old_bound = (sync["generation_s_per_step"] + sync["train_s_per_step"]) / (old + sync["train_s_per_step"])
    assert run["vs_sync"] > old_bound
    assert run["vs_sync"] <= run["async_bound"] == sync["async_bound"]
    # The bound trains at the cheapest training of the rows (its programs as run), no less than
    # their FLOPs at the peak: the share of it is at least the roofline fraction, and at most 1.
    assert run["roofline_fraction"] <= run["vs_async_bound"] <= 1.0
    assert sync["sync_train_efficiency"] <= 1.0


def test_the_bound_trains_at_the_cheapest_training_of_the_rows():
    """A row's training device-seconds per trained token: its steps and pushes on every training
    device over the tokens it trains per step. 4 devices training 0.5 s of a 2 s step that trains
    200 tokens spend 0.01 device-seconds per token."""
    from types import SimpleNamespace

    from areal_jax.simulate.driver import train_seconds_per_token

    row = SimpleNamespace(trained_tokens_per_s=100.0, step_s=2.0, train_s_per_step=0.5)
    assert train_seconds_per_token(row, 4) == pytest.approx(0.01)
    assert train_seconds_per_token(SimpleNamespace(trained_tokens_per_s=0.0, step_s=2.0, train_s_per_step=0.5),
                                   4) == float("inf")


def test_cli_calibrates_on_a_run_directory(tmp_path, capsys):
    from areal_jax.cli import main

    result = simulate(RowConfig(mode="async", eta=2, generation_devices=2, steps=12, warmup_steps=2))
    (tmp_path / "devices.json").write_text('{"devices_per_host": 2, "hosts": 1}')  # as the bench writes it
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for record in result.records:
            f.write(json.dumps({"step": record["step"], "metrics": record}) + "\n")
    assert main(["simulate", "--gin_file", "configs/quickstart.gin", "--calibrate", str(tmp_path),
                 "--length-dist", "geometric:mean=60", "--steps", "6", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "calibrated on" in out and "sync" in out and "async" in out
    assert main(["simulate", "--gin_file", "configs/quickstart.gin", "--calibrate", str(tmp_path / "none")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert main(["simulate", "--gin_file", "configs/quickstart.gin", "--calibrate", str(tmp_path),
                 "--sweep", "split=1,2"]) == 2
    assert "the run's own split" in capsys.readouterr().err


def test_colocated_async_takes_turns_on_the_shared_devices():
    """Colocated async: the trainer's programs hold the devices the engine decodes on. With equal
    lengths and the costs of decode steps and train steps alone, each step costs the devices one
    batch's decode steps plus one train step, whatever eta lets overlap on separate devices; where
    the sharing is not charged (costs fitted to a colocated run hold it) both sides ran at once."""
    L, d, t0 = 100, 1e-3, 0.08
    costs = LinearCosts(decode_step=d, train_step=t0)
    workload = dataclasses.replace(WORKLOAD, max_concurrent=WORKLOAD.batch_groups)
    row = RowConfig(mode="async", eta=1, colocated=True, steps=12, warmup_steps=4)
    sampler = lambda: LengthSampler(parse_length_spec(f"constant:length={L}"), cap=workload.max_new_tokens,  # noqa: E731
                                    prompt=16, seed=0)
    shared = Simulation(workload, row, costs, sampler(), scale_engine=False, share_devices=True).run()
    free = Simulation(workload, row, costs, sampler(), scale_engine=False, share_devices=False).run()
    tokens = workload.batch_groups * workload.samples_per_group * L
    assert shared.trained_tokens_per_s == pytest.approx(tokens / ((L - 1) * d + t0), rel=0.02)
    assert shared.generation_busy + shared.train_busy <= 1.0 + 1e-9  # no device-second counted twice
    assert free.trained_tokens_per_s == pytest.approx(tokens / max((L - 1) * d, t0), rel=0.02)
    assert free.generation_busy + free.train_busy > 1.5


def test_a_colocated_split_can_be_swept(capsys):
    from areal_jax.cli import main

    assert main(["simulate", "--gin_file", "configs/qwen2_5_7b_math_gpu.gin", "--steps", "10", "--warmup", "3",
                 "--sweep", "split=colocated,4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["mode"], r["split"]) for r in rows] == [("async", "colocated"), ("async", "4:4"), ("sync", "colocated")]
    coloc = rows[0]
    assert coloc["generation_busy"] + coloc["train_busy"] <= 1.0 + 1e-9
    assert coloc["train_devices"] == coloc["generation_devices"] == 8
    assert main(["simulate", "--gin_file", "configs/qwen2_5_7b_math_gpu.gin", "--sweep", "split=shared"]) == 2
    assert "split takes integers (or 'colocated')" in capsys.readouterr().err
