# Sourced by ./dev: find or build the Python environment, build the native extension in place,
# and set the process-level knobs every command here needs.
#
# The environment lives outside the clone, keyed by the lock file, so a fresh clone (CI) reuses
# it instead of reinstalling several GB of torch; a new machine builds it from nothing.
set -euo pipefail

RLCORE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RLCORE_CACHE="${RLCORE_CACHE:-$HOME/.cache/rlcore}"
PYTHON="${PYTHON:-python3}"

lock_key() {
  cat "$RLCORE_ROOT/requirements/lock.txt" | sha256sum | cut -c1-16
}

ensure_env() {
  local key env_dir
  key="$($PYTHON -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')-$(lock_key)"
  env_dir="$RLCORE_CACHE/envs/$key"
  if [ ! -f "$env_dir/.complete" ]; then
    echo "[rlcore] building environment $env_dir (first time on this machine; torch is large)" >&2
    rm -rf "$env_dir"
    mkdir -p "$RLCORE_CACHE/envs"
    "$PYTHON" -m venv "$env_dir"
    "$env_dir/bin/python" -m pip install -q --upgrade pip
    "$env_dir/bin/python" -m pip install -q -r "$RLCORE_ROOT/requirements/lock.txt"
    touch "$env_dir/.complete"
  fi
  # A stable, ignored pointer inside the clone for editors and for `source .venv/bin/activate`.
  ln -sfn "$env_dir" "$RLCORE_ROOT/.venv"
  # shellcheck disable=SC1091
  source "$env_dir/bin/activate"
}

build_native() {
  # Cargo's build cache is kept outside the clone too; a no-op rebuild takes about a second.
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$RLCORE_CACHE/cargo-target}"
  (cd "$RLCORE_ROOT" && maturin develop --release --skip-install -q >/dev/null 2>"$RLCORE_CACHE/maturin.log") || {
    cat "$RLCORE_CACHE/maturin.log" >&2
    echo "[rlcore] building the native extension failed" >&2
    return 1
  }
}

ensure_env
# RLCORE_SKIP_NATIVE_BUILD=1 reuses the extension already built in place (parallel work on rust/).
if [ "${RLCORE_SKIP_NATIVE_BUILD:-0}" != 1 ] || ! ls "$RLCORE_ROOT"/rlcore/_native*.so >/dev/null 2>&1; then
  build_native
fi

export PYTHONPATH="$RLCORE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Two cores: oversubscribed BLAS/OpenMP threads make torch 10-60x slower.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
# No network here: no telemetry, no hub look-ups.
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export RAY_USAGE_STATS_ENABLED=0
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
