#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environments; safe to run repeatedly.
#   .venv      Python >= 3.12 with areal_jax installed editable (what users and tests run): the base
#              package, plus the [test] extra (libtpu, the CUDA plugin, pytest, wandb, datasets, and
#              the [agents] extra's aiohttp and openai) when
#              AREAL_TEST_EXTRAS=1 (launch/test.sh sets it). A venv holding more extras is kept.
#   .venv-ref  Python 3.11 with torch (CPU) + transformers + peft: the reference implementation the
#              parity tests compare against. Built only when asked (AREAL_WITH_REFERENCE=1).
# AREAL_EXTRAS=cuda (or tpu) installs jax for that accelerator into .venv as well.
# Source it: `source launch/env.sh` leaves .venv activated.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_runs_at_least() {  # _runs_at_least PYTHON MAJOR MINOR -> true if PYTHON runs and is new enough
  "$1" -c "import sys; sys.exit(0 if sys.version_info[:2] >= ($2, $3) else 1)" >/dev/null 2>&1
}

_find_python() {  # _find_python MAJOR MINOR EXACT(0|1): prints an interpreter path or fails
  local major=$1 minor=$2 exact=$3 cand
  local -a cands=()
  [ -n "${AREAL_PYTHON:-}" ] && [ "$exact" = 0 ] && cands+=("$AREAL_PYTHON")
  cands+=("python${major}.${minor}")
  [ "$exact" = 0 ] && cands+=(python3.13 python3.14 python3)
  local pyroot="${PYENV_ROOT:-$HOME/.pyenv}"
  command -v pyenv >/dev/null 2>&1 && pyroot="$(pyenv root)"
  # pyenv's, uv's (`uv python install 3.12`: TPU VM images ship Python 3.10) and the system's.
  for cand in "$pyroot"/versions/"${major}.${minor}".*/bin/python"${major}.${minor}" \
              "${UV_PYTHON_INSTALL_DIR:-$HOME/.local/share/uv/python}"/cpython-"${major}.${minor}".*/bin/python"${major}.${minor}" \
              /usr/bin/python"${major}.${minor}" /usr/local/bin/python"${major}.${minor}"; do
    cands+=("$cand")
  done
  for cand in "${cands[@]}"; do
    if _runs_at_least "$cand" "$major" "$minor"; then
      if [ "$exact" = 1 ] && ! "$cand" -c "import sys; sys.exit(0 if sys.version_info[:2] == ($major, $minor) else 1)"; then
        continue
      fi
      command -v "$cand" 2>/dev/null || echo "$cand"
      return 0
    fi
  done
  return 1
}

_stamp() { cat "$ROOT/pyproject.toml" "$ROOT/launch/env.sh" | sha256sum | cut -c1-16; }

_wanted_extras() {  # the extras this call needs, comma-separated (may be empty)
  local extras="${AREAL_EXTRAS:-}"
  [ "${AREAL_TEST_EXTRAS:-0}" = 1 ] && extras="test${extras:+,$extras}"
  echo "$extras"
}

_venv_is_current() {  # _venv_is_current STAMPFILE HASH EXTRAS: same sources, every wanted extra installed
  [ -f "$1" ] && [ "$(sed -n 1p "$1")" = "$2" ] || return 1
  local have extra
  have=",$(sed -n 2p "$1"),"
  for extra in ${3//,/ }; do
    case "$have" in *",$extra,"*) ;; *) return 1 ;; esac
  done
}

_ensure_main_venv() {
  local venv="$ROOT/.venv" stamp extras have
  stamp="$(_stamp)"
  extras="$(_wanted_extras)"
  if _venv_is_current "$venv/.areal_stamp" "$stamp" "$extras"; then return 0; fi
  # Extras installed before (same sources) stay: the quickstart after the tests keeps [test].
  if [ -f "$venv/.areal_stamp" ] && [ "$(sed -n 1p "$venv/.areal_stamp")" = "$stamp" ]; then
    have="$(sed -n 2p "$venv/.areal_stamp")"
    extras="$(echo "${have:+$have,}$extras" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)"
  fi
  local py
  py="$(_find_python 3 12 0)" || { echo "error: no Python >= 3.12 found (TPU VM images ship 3.10): run \`pip install uv && uv python install 3.12\` (found automatically), or set AREAL_PYTHON=/path/to/python3.12" >&2; return 1; }
  echo "[env] building .venv with $py" >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$venv/bin/python" -m pip install -q -e "$ROOT${extras:+[$extras]}" >&2
  printf '%s\n%s\n' "$stamp" "$extras" > "$venv/.areal_stamp"
}

_ensure_reference_venv() {
  local venv="$ROOT/.venv-ref" want="torch==${AREAL_REF_TORCH:-2.13.0} transformers>=4.56 numpy safetensors jinja2 peft>=0.13"
  if [ -f "$venv/.areal_stamp" ] && [ "$(cat "$venv/.areal_stamp")" = "$want" ]; then return 0; fi
  local py
  py="$(_find_python 3 11 1)" || { echo "[env] no Python 3.11 found: reference venv not built" >&2; return 1; }
  echo "[env] building .venv-ref (transformers reference) with $py" >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q $want >&2
  echo "$want" > "$venv/.areal_stamp"
}

_ensure_main_venv
if [ "${AREAL_WITH_REFERENCE:-0}" = 1 ]; then _ensure_reference_venv; fi
# shellcheck disable=SC1091
source "$ROOT/.venv/bin/activate"
set +euo pipefail
