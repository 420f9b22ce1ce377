#!/usr/bin/env bash
# One call on a one-GPU machine (no registry access): set up, measure, test, and write the figures.
#
#   bench/accelerator_check.sh                        # the check; figures under $OUT (./accelerator_out)
#   bench/accelerator_check.sh --download-deps DIR [PKG...]
#       on a host with PyPI: wheels (Linux x86_64, CPython 3.12) of what a GPU image's python lacks,
#       with their dependencies; default IMAGE_LACKS below (~28 MB: fits the device tool's 64 MiB)
#   bench/accelerator_check.sh --download-wheels DIR
#       on a host with PyPI: every wheel a bare machine needs, jax[cuda12] included (GBs)
#
# On the device tool (the wheels travel in .whl, which .gitignore ignores):
#   here:  bench/accelerator_check.sh --download-deps .whl
#   there: AREAL_WHEELS=.whl bench/accelerator_check.sh        (run with carry [".whl"])
#
# Steps (each with its own timeout, none stopping the others; a summary ends the log):
#   setup      find a python whose jax sees a GPU (AREAL_PYTHON, .venv, python3). What it lacks of
#              the project's dependencies goes into a folder on PYTHONPATH (its own packages are left
#              as they are), from AREAL_WHEELS=DIR (pip --no-index --find-links DIR), else from the
#              registry if reachable. With no such python, a fresh venv gets jax[cuda12] and the rest.
#   probe      bench/accelerator_probe.py: decode tokens/s vs the HBM roofline, training MFU.
#   paged      bench/paged_check.py (issue 25): one layer's decode attention over lognormal lengths by
#              the paged Pallas kernel, the jnp gather and the dense window (seconds per call, live KV
#              bytes/s vs HBM); the engine's decode tokens/s with kv_layout "paged" vs "dense" on the
#              same ragged workload; a training step's tokens/s and MFU with flash attention
#              (TrainEngineConfig.attention_impl "pallas") vs the jnp path. A part whose feature is not in the
#              tree records why in paged_check.json's "errors" and the others still run.
#   moe        bench/moe_gpu_check.py (issue 29): the MoE grouped matmul's Mosaic GPU kernels against
#              XLA's ragged dot on a Qwen3-30B-A3B expert layer: forward and gradients compared,
#              seconds per forward+backward of each.
#   engine     bench/engine_speed_check.py (issue 41): paged decode attention and the engine's decode
#              tokens/s with the KV pool in bfloat16 vs float8_e4m3fn (EngineConfig.kv_dtype), and
#              wall tokens/s with weight swaps every few rounds under EngineConfig.on_swap "recompute"
#              vs "keep" (tokens re-prefilled, prefill seconds); decode by live slots vs the full
#              batch (EngineConfig.decode_min_rows), groups with shared vs copied prompt pages; the
#              engine's decode tokens/s scanned vs unrolled (EngineConfig.scan_layers, issue 40).
#   tests      tests/test_generation.py + tests/test_train_step.py + tests/test_paged_kernels.py +
#              tests/test_prefill_kernels.py (the Pallas paged and prefill kernels natively against
#              the reference) on the GPU.
#   quickstart the command launch/quickstart.sh execs (the script itself would build .venv from the
#              registry), capped by the time left; summary.json and metrics.jsonl are copied to $OUT.
#
# $OUT gets at most 8 files (the device tool returns 8): accelerator_check.json (every step's status
# and figures), accelerator_check.log, probe.json, paged_check.json, moe_gpu_check.json,
# engine_speed_check.json, quickstart_summary.json, quickstart_metrics.jsonl.
#
# Environment: OUT, AREAL_WHEELS, AREAL_PYTHON; AREAL_CHECK_BUDGET_S (whole run, default 460),
# AREAL_CHECK_STEPS (default "probe paged moe engine tests quickstart"; setup always runs); AREAL_CHECK_ALLOW_CPU=1 runs on a
# machine without a GPU (probe --tiny: to try the script itself).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

JAX_VERSION_PIN="${AREAL_JAX_VERSION:-0.12.0.1}"
# Test-time packages beyond [project].dependencies (the test extra also pulls TPU and dataset
# packages these two test files never import).
TEST_PKGS=(pytest pytest-timeout)
# The project's dependencies that the device image's python lacks (its package list in the
# device tool's KINDS.md): what --download-deps fetches by default, with their own dependencies.
IMAGE_LACKS=(gin-config grain math-verify)

# ---- wheel download (run where PyPI is reachable) --------------------------------------------------

# Requirement strings of [project].dependencies, one a line; with --names, bare names only.
project_deps() {
  python3 - "$ROOT/pyproject.toml" "${1:-}" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
for d in deps:
    print(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] if sys.argv[2] == "--names" else d)
EOF
}

download() {  # download DIR full|deps [PKG...]
  local dir=$1 kind=$2 reqs=()
  shift 2
  mkdir -p "$dir" || return 1
  if [ "$kind" = full ]; then
    mapfile -t reqs < <(project_deps)
    reqs+=("jax[cuda12]==$JAX_VERSION_PIN" "${TEST_PKGS[@]}")
  else
    reqs=("${IMAGE_LACKS[@]}")
    [ $# -eq 0 ] || reqs=("$@")
  fi
  echo "[download] ${reqs[*]} -> $dir"
  python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$dir" "${reqs[@]}" || return 1
  echo "[download] $(find "$dir" -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
}

case "${1:-}" in
  --download-wheels) download "${2:?usage: $0 --download-wheels DIR}" full; exit ;;
  --download-deps) download "${2:?usage: $0 --download-deps DIR [PKG...]}" deps "${@:3}"; exit ;;
  "") ;;
  *) echo "usage: $0 [--download-wheels DIR | --download-deps DIR [PKG...]]" >&2; exit 2 ;;
esac

# ---- the check -------------------------------------------------------------------------------------

OUT="${OUT:-$ROOT/accelerator_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/accelerator_check.log"
STATUS="$OUT/.status.tsv"  # step, status, seconds, note (kept out of the returned files by its name)
: > "$LOG"
: > "$STATUS"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

BUDGET_S="${AREAL_CHECK_BUDGET_S:-460}"
STEPS="${AREAL_CHECK_STEPS:-probe paged moe engine tests quickstart}"
START=$(date +%s)
WORK="${TMPDIR:-/tmp}/areal_accelerator_check"
SITE="$WORK/site"  # packages the chosen python lacks
rm -rf "$SITE" && mkdir -p "$WORK" "$SITE"
PY=""          # the interpreter every step runs
PLATFORM=""    # jax's platform for that interpreter's first device
SETUP_NOTE=""
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*"; }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4//$'\t'/ }" >> "$STATUS"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
wants() { [[ " $STEPS " == *" $1 "* ]]; }

# cap SECONDS -> the step's timeout: its cap or the time left, whichever is less
cap() { local l; l=$(( $(left) - 10 )); echo $(( $1 < l ? $1 : l )); }

# gpu_platform PYTHON -> prints jax's platform for its first device; fails unless that is a GPU
# (or, with AREAL_CHECK_ALLOW_CPU=1, the CPU).
gpu_platform() {
  local p
  p=$(JAX_PLATFORMS="" timeout 60 "$1" -c 'import jax; print(jax.devices()[0].platform)' 2>/dev/null | tail -1)
  echo "$p"
  [ "$p" = gpu ] || { [ "${AREAL_CHECK_ALLOW_CPU:-0}" = 1 ] && [ "$p" = cpu ]; }
}

# Distributions (from [project].dependencies and TEST_PKGS) that PYTHON does not have, one a line.
missing_for() {
  { project_deps --names; printf '%s\n' "${TEST_PKGS[@]}"; } | "$1" -c '
import importlib.metadata as md, sys
for name in sys.stdin.read().split():
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        print(name)'
}

pip_source() {  # pip's options for where packages come from
  if [ -n "${AREAL_WHEELS:-}" ]; then
    printf '%s\n' --no-index --find-links "$(cd "$AREAL_WHEELS" && pwd)"
  else
    printf '%s\n' --retries 0 --timeout 15
  fi
}

# add_missing PYTHON NAME...: installs the NAMEs and whatever of their dependencies PYTHON lacks into
# $SITE (on PYTHONPATH), leaving PYTHON's own packages as they are.
add_missing() {
  local py=$1 src=() new=()
  shift
  mapfile -t src < <(pip_source)
  # A dry run resolves against PYTHON's installed packages: its report lists only what is new.
  timeout "$(cap 120)" "$py" -m pip install --quiet --dry-run --report "$WORK/pip_report.json" "${src[@]}" "$@" || return 1
  mapfile -t new < <("$py" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["metadata"]["name"] + "==" + item["metadata"]["version"])' "$WORK/pip_report.json")
  [ ${#new[@]} -gt 0 ] || return 0
  log "setup: installing into $SITE: ${new[*]}"
  timeout "$(cap 120)" "$py" -m pip install --quiet --no-deps --target "$SITE" "${src[@]}" "${new[@]}"
}

step_setup() {
  local cand p missing=()
  for cand in "${AREAL_PYTHON:-}" "$ROOT/.venv/bin/python" python3 python3.12; do
    if [ -z "$cand" ] || ! command -v "$cand" >/dev/null 2>&1; then continue; fi
    if p=$(gpu_platform "$cand"); then PY=$(command -v "$cand"); PLATFORM=$p; break; fi
    log "setup: $cand: jax absent or no GPU (${p:-no jax})"
  done
  if [ -n "$PY" ]; then
    mapfile -t missing < <(missing_for "$PY")
    log "setup: $PY sees a $PLATFORM; jax $("$PY" -c 'import jax; print(jax.__version__)'); lacks: ${missing[*]:-nothing}"
    if [ ${#missing[@]} -gt 0 ] && ! add_missing "$PY" "${missing[@]}"; then
      SETUP_NOTE="could not install ${missing[*]} (AREAL_WHEELS=${AREAL_WHEELS:-unset})"
      return 1
    fi
  else
    local base venv="$WORK/venv" reqs=() src=()
    log "setup: no python with jax on a GPU; building $venv with jax[cuda12]==$JAX_VERSION_PIN"
    for base in python3.12 python3 ""; do  # the first that runs and is new enough
      [ -n "$base" ] && "$base" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && break
    done
    [ -n "$base" ] || { SETUP_NOTE="no python >= 3.12"; return 1; }
    mapfile -t reqs < <(project_deps)
    mapfile -t src < <(pip_source)
    if ! { "$base" -m venv "$venv" && timeout "$(cap 300)" "$venv/bin/python" -m pip install --quiet "${src[@]}" \
           "jax[cuda12]==$JAX_VERSION_PIN" "${reqs[@]}" "${TEST_PKGS[@]}"; }; then
      SETUP_NOTE="could not install jax[cuda12] (AREAL_WHEELS=${AREAL_WHEELS:-unset})"
      return 1
    fi
    PY="$venv/bin/python"
    PLATFORM=$(gpu_platform "$PY") || { SETUP_NOTE="jax installed but sees no GPU (${PLATFORM:-none})"; return 1; }
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  "$PY" -c 'import jax, areal_jax.trainer.train_step, areal_jax.generation; print("jax", jax.__version__, jax.devices())' \
    || { SETUP_NOTE="areal_jax does not import"; return 1; }
  SETUP_NOTE="$PY ($PLATFORM, jax $("$PY" -c 'import jax; print(jax.__version__)'))"
}

# run_step NAME CAP COMMAND...: runs it under `timeout`, records ok / failed / timeout.
run_step() {
  local name=$1 cap_s t0 rc; cap_s=$(cap "$2"); shift 2
  if ! wants "$name"; then record "$name" skipped 0 "not in AREAL_CHECK_STEPS"; return; fi
  if [ "$cap_s" -lt 20 ]; then record "$name" skipped 0 "budget spent"; return; fi
  log "=== $name (timeout ${cap_s}s)"
  t0=$(date +%s)
  timeout --kill-after=10 "$cap_s" "$@"
  rc=$?
  local took=$(( $(date +%s) - t0 )) status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=timeout; elif [ $rc -ne 0 ]; then status=failed; fi
  echo  # a killed command may have left its last line open
  log "=== $name: $status (rc $rc, ${took}s)"
  record "$name" "$status" "$took" "rc $rc"
}

# ---- steps -----------------------------------------------------------------------------------------

t0=$(date +%s)
log "=== setup"
# Runs in this shell (a subshell could not hand PY back), so its own commands carry the timeouts.
if step_setup; then status=ok; else status=failed; fi
record setup "$status" "$(( $(date +%s) - t0 ))" "$SETUP_NOTE"
log "=== setup: $status: $SETUP_NOTE"
if [ -z "$PY" ]; then
  for s in probe paged moe engine tests quickstart; do record "$s" skipped 0 "no python with jax on a GPU"; done
else
  if [ "$PLATFORM" = gpu ]; then
    export JAX_PLATFORMS=cuda  # tests/conftest.py sets cpu only when JAX_PLATFORMS is unset
    PROBE_ARGS=()
  else  # AREAL_CHECK_ALLOW_CPU=1: the plumbing, at the smallest sizes
    export JAX_PLATFORMS=cpu
    PROBE_ARGS=(--tiny)
  fi

  run_step probe 200 "$PY" -m bench.accelerator_probe "${PROBE_ARGS[@]}" --out "$OUT/probe.json"

  run_step paged 200 "$PY" -m bench.paged_check "${PROBE_ARGS[@]}" --out "$OUT/paged_check.json"

  run_step moe 120 "$PY" -m bench.moe_gpu_check "${PROBE_ARGS[@]}" --out "$OUT/moe_gpu_check.json"

  run_step engine 240 "$PY" -m bench.engine_speed_check "${PROBE_ARGS[@]}" --out "$OUT/engine_speed_check.json"

  # One GPU: the tests that build 2x2 meshes over jax.devices() need several devices. fp32 matmuls
  # at full precision, since the tests compare against fp32 references (GPUs default to TF32).
  # -v: a line per test, so a run cut by its timeout still shows which passed.
  JAX_DEFAULT_MATMUL_PRECISION=highest run_step tests 150 "$PY" -m pytest -v -p no:cacheprovider \
    tests/test_generation.py tests/test_train_step.py tests/test_paged_kernels.py tests/test_prefill_kernels.py \
    -k "not sharded_step_matches_single_device and not generation_mesh_of_its_weights"

  RUN_DIR="${RUN_DIR:-$WORK/quickstart}"
  rm -rf "$RUN_DIR"
  # The command launch/quickstart.sh execs, compile cache under $WORK; AREAL_CHECK_QUICKSTART_ARGS
  # adds flags, split on spaces (e.g. --gin_param=RLConfig.steps=40 to finish inside the cap).
  read -ra QS_ARGS <<< "${AREAL_CHECK_QUICKSTART_ARGS:-}"
  AREAL_JAX_COMPILE_CACHE="$WORK/xla" run_step quickstart 240 "$PY" -m areal_jax.cli train \
    --gin_file=configs/quickstart.gin --run_dir="$RUN_DIR" --quiet "${QS_ARGS[@]}"
  [ -f "$RUN_DIR/summary.json" ] && cp "$RUN_DIR/summary.json" "$OUT/quickstart_summary.json"
  [ -f "$RUN_DIR/metrics.jsonl" ] && cp "$RUN_DIR/metrics.jsonl" "$OUT/quickstart_metrics.jsonl"
fi

# ---- summary ---------------------------------------------------------------------------------------

log "=== summary"
python3 - "$OUT" "$STATUS" "$LOG" "$(( $(date +%s) - START ))" "${PY:-}" "${PLATFORM:-}" <<'EOF'
import json, pathlib, re, sys
out, status, log, total, py, platform = sys.argv[1:]
out = pathlib.Path(out)
steps = {}
for line in pathlib.Path(status).read_text().splitlines():
    name, state, secs, note = (line.split("\t") + [""] * 4)[:4]
    steps[name] = {"status": state, "seconds": int(secs or 0), "note": note}

def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None

text = pathlib.Path(log).read_text(errors="replace")
# pytest -v: "tests/x.py::name PASSED [ 5%]" per test; the closing line only if it was not cut short.
outcomes = dict(re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", text, re.M))
closing = re.findall(r"^=+ (\d+ (?:passed|failed|error|skipped|deselected).*?) in [\d.]+s", text, re.M)
failed = sorted(t for t, o in outcomes.items() if o in ("FAILED", "ERROR"))
metrics = (out / "quickstart_metrics.jsonl")
result = {
    "total_seconds": int(total), "python": py, "platform": platform, "steps": steps,
    "probe": load("probe.json"),
    "paged": load("paged_check.json"),
    "moe": load("moe_gpu_check.json"),
    "engine": load("engine_speed_check.json"),
    "tests": {"summary": closing[-1] if closing else None, "failed": failed,
              "counts": {o: list(outcomes.values()).count(o) for o in sorted(set(outcomes.values()))}},
    "quickstart": {"summary": load("quickstart_summary.json"),
                   "rl_records": len(metrics.read_text().splitlines()) if metrics.exists() else 0},
}
(out / "accelerator_check.json").write_text(json.dumps(result, indent=1) + "\n")
for name, s in steps.items():
    print(f"  {name:<11} {s['status']:<8} {s['seconds']:>4}s  {s['note']}")
p = result["probe"] or {}
if "decode" in p:
    d = p["decode"]
    print(f"  decode      {d['tokens_per_s']:.0f} tokens/s = {d['roofline_fraction']:.1%} of the HBM roofline "
          f"({d['roofline_window_fraction']:.1%} of the window roofline), {d['slots']} slots")
if "train" in p:
    t = p["train"]
    print(f"  train       {t['tokens_per_s']:.0f} tokens/s, MFU {t['mfu']:.1%} (peak {t['peak_flops']:.3g} FLOP/s)")
if p.get("errors"):
    print(f"  probe errors: {p['errors']}")
g = result["paged"] or {}
if "kernel" in g:
    k = g["kernel"]
    print(f"  paged kern  {k['kernel']}: {k['paged_s'] * 1e6:.0f} us vs dense window {k['dense_s'] * 1e6:.0f} us "
          f"({k['paged_speedup_over_dense']:.2f}x), live KV at {k['paged_live_fraction_of_hbm']:.1%} of HBM")
if "engine" in g:
    e = g["engine"]
    print(f"  paged eng.  decode {e['paged']['decode_tokens_per_s']:.0f} vs dense {e['dense']['decode_tokens_per_s']:.0f} "
          f"tokens/s ({e['paged_over_dense_decode']:.2f}x; wall {e['paged_over_dense_wall']:.2f}x)")
if "train" in g:
    t = g["train"]
    print(f"  flash train MFU {t['pallas']['mfu']:.1%} vs {t['reference']['mfu']:.1%} without ({t['flash_speedup']:.2f}x)")
if g.get("errors"):
    print(f"  paged errors: {g['errors']}")
m = (result["moe"] or {}).get("grouped_matmul")
if m:
    print(f"  moe         {m['kernel']}: {m['kernel_s'] * 1e3:.2f} ms vs ragged_dot {m['ragged_dot_s'] * 1e3:.2f} ms "
          f"({m['speedup']:.2f}x, {m['kernel_tflops']:.0f} TFLOP/s); largest relative error {max(m['relative_error'].values()):.3g}")
if (result["moe"] or {}).get("errors"):
    print(f"  moe errors: {result['moe']['errors']}")
e = result["engine"] or {}
if "kernel" in e:
    k = e["kernel"]
    print(f"  fp8 kernel  {k['kernel']}: {k['float8_e4m3fn']['s'] * 1e6:.0f} us vs bf16 {k['bfloat16']['s'] * 1e6:.0f} us "
          f"({k['fp8_speedup']:.2f}x)")
if "decode" in e:
    d = e["decode"]
    print(f"  fp8 decode  {d['float8_e4m3fn']['decode_tokens_per_s']:.0f} vs bf16 {d['bfloat16']['decode_tokens_per_s']:.0f} "
          f"tokens/s ({d['fp8_over_bf16_decode']:.2f}x)")
if "swap" in e:
    w = e["swap"]
    print(f"  on_swap     keep {w['keep']['wall_tokens_per_s']:.0f} vs recompute {w['recompute']['wall_tokens_per_s']:.0f} "
          f"tokens/s ({w['keep_over_recompute_wall']:.2f}x); re-prefilled {w['recompute']['reprefill_tokens']:.0f} vs "
          f"{w['keep']['reprefill_tokens']:.0f} tokens")
if e.get("errors"):
    print(f"  engine errors: {e['errors']}")
tests = result["tests"]
shown = tests["summary"] or (f"cut short after {tests['counts']}" if tests["counts"] else "not run")
print(f"  tests       {shown}; failed: {failed or 'none'}")
q = result["quickstart"]
print(f"  quickstart  summary.json {'written' if q['summary'] else 'missing'}; {q['rl_records']} RL records")
print(f"  figures in {out}/accelerator_check.json")
EOF
rm -f "$STATUS"
exec >&- 2>&-
wait "$TEE_PID"  # the log is whole before the caller collects $OUT
