#!/usr/bin/env bash
# The test command: builds the environments if needed, then runs the test suite.
#   launch/test.sh            default suite (slow tests excluded)
#   launch/test.sh --slow     only the slow tests
#   launch/test.sh ARGS...    extra pytest arguments (e.g. -k parity)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# The tests need the [test] extra (libtpu and the CUDA plugin for plan's tests, pytest, wandb,
# datasets); the quickstart installs the base package only.
export AREAL_WITH_REFERENCE=1 AREAL_REQUIRE_REFERENCE=1 AREAL_TEST_EXTRAS=1
# shellcheck disable=SC1091
source launch/env.sh
set -euo pipefail
marker=(-m "not slow")
if [ "${1:-}" = "--slow" ]; then marker=(-m slow); shift; fi
exec python -m pytest "${marker[@]}" "$@"
