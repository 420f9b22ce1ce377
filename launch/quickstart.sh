#!/usr/bin/env bash
# The main job on a laptop CPU: SFT warm start then asynchronous RL on the built-in arithmetic
# task (configs/quickstart.gin). Builds .venv on first use. Extra flags go to `areal-jax train`,
# e.g. ./launch/quickstart.sh --gin_param='RLConfig.steps = 80'
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
source launch/env.sh
set -euo pipefail
exec areal-jax train --gin_file=configs/quickstart.gin --run_dir="${RUN_DIR:-runs/quickstart-$(date +%Y%m%d-%H%M%S)}" "$@"
