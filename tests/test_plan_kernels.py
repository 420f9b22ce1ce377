"""Every program of every shipped config names an attention kernel on its target (issue 41, point 7):
prefill, re-prefill, decode and training alike, never the jnp `reference` (the CPU's path).

The programs are those `areal-jax plan` reports by default (the largest of each family), lowered for
the config's own target without compiling (a kernel shows in the lowered text, as plan/measure.py
reads it); every prompt and history bucket of the engine is also checked against the prefill
kernel's limits, since a bucket the kernel refused would prefill by the reference.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None or \
    importlib.util.find_spec("jax_cuda12_plugin") is not None

_LOWER = """
import json, sys
from areal_jax import config_system as cs
from areal_jax.jobs.configs import load_job_configs
from areal_jax.kernels import prefill_attention
from areal_jax.plan.config import PlanConfig
from areal_jax.plan.job import eval_engine_config, generation_lengths, plan_inputs
from areal_jax.plan.measure import attention_kernels
from areal_jax.plan.planner import attention_name
from areal_jax.plan.targets import parse_target
for gin in sys.argv[1:]:
    job = load_job_configs([gin], [], run_dir="plan")
    plan_cfg = cs.build(PlanConfig)
    target = parse_target(plan_cfg.target)
    inputs = plan_inputs(job, plan_cfg, target, gin_files=[gin])
    ec, H = job.engine, inputs.model_cfg.head_dim
    longest = generation_lengths(job, plan_cfg)[2]
    evals = [eval_engine_config(job, longest, 1, target.hosts, inputs.model_cfg)] if job.task.eval_size else []
    refused = []
    for engine in [ec] + evals:
        for P in sorted(set(engine.admission_buckets()) | set(engine.long_history_buckets())):
            C = min(engine.prefill_chunk, P)
            run = prefill_attention.kernel_block_len(engine.attention_impl, target.platform, H, P, C)
            if not prefill_attention.kernel_fits(engine.attention_impl, target.platform, H, run, min(C, run)):
                refused.append(P)
    print(json.dumps(dict(config=gin, program="prefill buckets", attention="refused %s" % refused if refused
                          else "fit")), flush=True)
    for spec in inputs.specs:
        text = spec.lower().as_text()
        print(json.dumps(dict(config=gin, program=spec.name, attention=attention_name(spec.name,
                                                                                  attention_kernels(text)))),
              flush=True)
"""


def _lowered(configs):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1"}
    out = subprocess.run([sys.executable, "-c", _LOWER, *configs], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=1100)
    if "in use by another process" in out.stderr or "LibtpuBusy" in out.stderr:
        pytest.skip("another process holds libtpu (one at a time)")
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _shipped(platform):
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob(f"*_{platform}.gin"))


def _check(rows, configs):
    assert {r["config"] for r in rows} == set(configs)
    # The trie re-prefill (EngineConfig.reprefill_share_prefixes, every shipped config) attends by
    # the jnp blocked formula by design: no Pallas kernel takes a prefix trie's mask.
    bad = [r for r in rows if r["attention"].startswith("refused")
           or (r["attention"] == "reference" and "reprefill_packed" not in r["program"])]
    assert not bad, bad
    # Every attending family named a kernel: prefill, admission's prefill_start, re-prefill, decode.
    for config in configs:
        kinds = {r["program"].split("[")[0].rsplit("/", 1)[-1]: r["attention"] for r in rows if r["config"] == config}
        assert {"prefill_start", "reprefill_packed", "decode", "grad"} <= set(kinds), (config, kinds)


# Per platform: whether its compiler is installed, and the kernels its programs must name.
_PLATFORMS = {
    "gpu": (HAS_CUDA_PLUGIN, {"pallas_triton_prefill", "pallas_triton_flash", "pallas_triton_paged"}),
    "tpu": (HAS_LIBTPU, {"pallas_mosaic_prefill", "splash", "ragged_paged"}),
}


# One case per shipped config: each lowers in its own process, so a slow model shows by name.
CASES = [(platform, gin) for platform in sorted(_PLATFORMS) for gin in _shipped(platform)]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # lowering one real model's programs: 10-80 s on a 2-core host (GPU, 2026-12-04)
@pytest.mark.parametrize("platform, config", CASES, ids=[f"{p}-{pathlib.Path(c).stem}" for p, c in CASES])
def test_no_program_of_a_shipped_config_attends_by_the_reference(platform, config):
    installed, kernels = _PLATFORMS[platform]
    if not installed:
        pytest.skip(f"the {platform} compiler is not installed ([plan] extra)")
    rows = _lowered([config])
    _check(rows, [config])
    assert kernels <= {r["attention"] for r in rows}, (config, kernels)
