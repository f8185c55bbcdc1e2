#!/usr/bin/env bash
# The whole GPU check in one call on the lent GPU machine (README "The GPU check").
#   here:   ./dev python scripts/gpu_carry.py prepare     # fills .gpu_carry/ (wheels, the built extension)
#   there:  bash scripts/gpu_check_device.sh              # from the tree's root, .gpu_carry carried
# It installs what the machine lacks into $TMPDIR (scripts/gpu_carry.py install), runs
# benchmarks/gpu_check.py (every phase), then the GPU-marked tests with the time left, all within
# GPU_CHECK_BUDGET_S seconds (default 450: one device call of at most 8 minutes with its start), and
# leaves in $OUT: install.json, gpu_check.json (rewritten after every phase), gpu_check.log,
# gpu_tests.log and gpu_tests.xml. Its last lines on stdout are the numbers to read first.
# Exit status: 0 when the check and the tests passed, 1 otherwise, 2-3 when nothing could run.
# GPU_CHECK_ARGS: more arguments for gpu_check.py (a rehearsal on a CPU machine:
#   OMP_NUM_THREADS=1 PYTHON=~/.cache/rlcore/trl-env/bin/python GPU_CHECK_ARGS=--smoke OUT=/tmp/out bash scripts/gpu_check_device.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
budget="${GPU_CHECK_BUDGET_S:-450}"
tests_reserve="${GPU_TESTS_RESERVE_S:-60}"  # kept back from gpu_check for the GPU-marked tests
out="${OUT:-$PWD/gpu_check_out}"
carry="${GPU_CARRY:-.gpu_carry}"
py="${PYTHON:-$(command -v python3 || command -v python)}"
site="${TMPDIR:-/tmp}/rlcore-gpu-site"
left() { echo $((budget - (SECONDS - start))); }
mkdir -p "$out"

if [ ! -d "$carry/wheels" ]; then
  echo "gpu_check_device: no $carry/wheels here: run 'scripts/gpu_carry.py prepare' and carry $carry" >&2
  exit 2
fi
"$py" scripts/gpu_carry.py install --dir "$carry" --target "$site" --report "$out/install.json" >/dev/null || exit 3
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

deadline=$(($(left) - tests_reserve))
echo "gpu_check_device: gpu_check.py, every phase, --deadline-s $deadline" >&2
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of words
timeout --kill-after=10 $((deadline + 30)) "$py" benchmarks/gpu_check.py --deadline-s "$deadline" \
  --out "$out/gpu_check.json" ${GPU_CHECK_ARGS:-} >/dev/null 2>"$out/gpu_check.log"
check_rc=$?

tests_rc=0
mapfile -t gpu_files < <(grep -l "mark.gpu" tests/test_*.py)
if [ "$(left)" -gt 20 ]; then
  echo "gpu_check_device: GPU-marked tests in ${#gpu_files[@]} files, $(left) s left" >&2
  timeout --kill-after=10 "$(left)" "$py" -m pytest -o addopts= -p no:cacheprovider -q -m gpu \
    --junitxml "$out/gpu_tests.xml" "${gpu_files[@]}" >"$out/gpu_tests.log" 2>&1
  tests_rc=$?
else
  echo "no time left for the GPU-marked tests" >"$out/gpu_tests.log"
  tests_rc=1
fi

echo "== install: $("$py" -c 'import json,sys; r=json.load(open(sys.argv[1])); print("installed", r["install"], "unmet", r["unmet"])' "$out/install.json")"
echo "== gpu_check.py (exit $check_rc, $out/gpu_check.json):"
"$py" - "$out/gpu_check.json" <<'PY' || tail -20 "$out/gpu_check.log"
import json, sys

result = json.load(open(sys.argv[1]))
for key, value in result.get("headline", {}).items():
    print(f"  {key}: {value}")
trl = result.get("trl", {})
for system in ("rlcore", "trl"):
    if system in trl:
        print(f"  trl phase, {system}: {json.dumps(trl[system])}")
print(f"  finished: {result.get('finished')}; seconds: {result.get('seconds')}; errors: {result.get('errors')}")
PY
echo "== GPU-marked tests (exit $tests_rc): $(tail -1 "$out/gpu_tests.log")"
echo "== $((SECONDS - start)) s of a $budget s budget"
[ "$check_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ]
