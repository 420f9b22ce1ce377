#!/usr/bin/env bash
# The main job on a laptop CPU: SFT warm start then asynchronous RL on the built-in arithmetic
# task (configs/quickstart.gin). Builds .venv on first use. Extra flags go to `areal-jax train`,
# e.g. ./launch/quickstart.sh --gin_param='RLConfig.steps = 80'
# Compiled XLA programs are kept in .cache/xla (AREAL_JAX_COMPILE_CACHE overrides it; set it empty
# to turn the cache off): a rerun loads them instead of compiling, and so does a second engine of
# the same shape within one run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
source launch/env.sh
set -euo pipefail
export AREAL_JAX_COMPILE_CACHE="${AREAL_JAX_COMPILE_CACHE-$ROOT/.cache/xla}"
exec areal-jax train --gin_file=configs/quickstart.gin --run_dir="${RUN_DIR:-runs/quickstart-$(date +%Y%m%d-%H%M%S)}" "$@"
