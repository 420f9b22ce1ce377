"""bench/accelerator_probe.py --tiny on CPU: every figure the GPU check reports is produced, finite
and positive (the real figures need the GPU; this keeps the probe runnable between such runs)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from bench.accelerator_probe import REQUIRED

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_probe_reports_every_figure(tmp_path):
    out = tmp_path / "probe.json"
    # One CPU device, in a fresh process: the probe compiles its own programs and must not see
    # the eight fake devices this test process was given.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.accelerator_probe", "--tiny", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == json.loads(proc.stdout.strip().splitlines()[-1])  # printed and written alike
    assert result["errors"] == {}
    for section, keys in REQUIRED.items():
        for key in keys:
            value = result[section][key]
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (section, key, value)
    # The roofline figures are what they claim to be.
    d = result["decode"]
    assert math.isclose(d["roofline_fraction"], d["tokens_per_s"] / d["roofline_tokens_per_s"])
    assert math.isclose(d["roofline_tokens_per_s"], d["slots"] * d["hbm_bytes_per_s"]
                        / (d["weight_bytes_per_step"] + d["cache_bytes_per_step"]))
    t = result["train"]
    assert math.isclose(t["mfu"], 6 * result["model"]["flop_params"] * t["tokens_per_s"] / t["peak_flops"])
    assert t["tokens_per_step"] == t["padded_tokens_per_step"]  # full-length rows: no padding


@pytest.mark.slow
def test_tiny_paged_check_reports_the_kernel_figures(tmp_path):
    # The engine and train parts need the paged engine and flash attention's config field; the
    # kernel part runs the Pallas GPU kernel interpreted.
    out = tmp_path / "paged.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.paged_check", "--tiny", "--skip", "engine", "--skip", "train",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    k = json.loads(out.read_text())["kernel"]
    assert k["kernel"] == "pallas_triton_paged" and k["interpret"] is True
    for key in ("paged_s", "reference_s", "dense_s", "live_kv_bytes", "dense_window_bytes"):
        assert math.isfinite(k[key]) and k[key] > 0, key
    assert k["live_kv_bytes"] < k["dense_window_bytes"]  # ragged lengths: the window reads more than is live
    assert math.isclose(k["paged_speedup_over_dense"], k["dense_s"] / k["paged_s"])


def test_tiny_moe_gpu_check_compares_and_times_both_paths(tmp_path):
    # On CPU both sides are ragged_dot (no Mosaic kernel runs here): equal values, finite times.
    out = tmp_path / "moe.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.moe_gpu_check", "--tiny", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(out.read_text())["grouped_matmul"]
    assert m["kernel"] == "reference" and set(m["relative_error"]) == {"out", "d_x", "d_we_gate", "d_we_up", "d_we_down"}
    assert all(v == 0.0 for v in m["relative_error"].values())
    assert math.isclose(m["speedup"], m["ragged_dot_s"] / m["kernel_s"]) and m["kernel_tflops"] > 0
