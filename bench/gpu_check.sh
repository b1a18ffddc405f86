#!/usr/bin/env bash
# The one command for a GPU machine: environment, build, CUDA op tests, a CUDA-graph replay,
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on every kernel once, and the
# decode and cache-write benchmarks. No failure stops the later steps: each runs under its own
# time limit with its full output in $OUT/<step>.log, and the summary (one line per step, then the
# figures) is printed last and kept in $OUT/summary.txt. At most 8 files land in $OUT; the whole
# run stays under about 7 minutes (steps that would not fit in what is left are skipped, and say so).
#   bash bench/gpu_check.sh            # OUT=bench/out by default
# The GPU machine reaches no package registry: wheels for anything missing there (pytest,
# scikit-build-core, ...) go in bench/wheels/ (or $WHEELS) beside the checkout and install offline.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-bench/out}
PY=${PY:-python3}
WHEELS=${WHEELS:-bench/wheels}
BUDGET=${BUDGET:-420}  # seconds for the whole run
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 PYTHONUNBUFFERED=1 PY WHEELS
export MINIPAGED_CUDA_ARCHS=${MINIPAGED_CUDA_ARCHS:-}  # empty: the visible GPU's architecture
FAILED=0

# step NAME LOG SECONDS CMD...: runs CMD (a program or a function below) under its own limit, at
# most what is left of the budget; appends its output to $OUT/LOG.log and one line to the summary.
step() {
  local name=$1 log="$OUT/$2.log" limit=$3 start=$SECONDS rc
  shift 3
  (( limit > BUDGET - SECONDS )) && limit=$((BUDGET - SECONDS))
  if (( limit < 10 )); then
    echo "SKIP  $name: the ${BUDGET} s budget is spent" | tee -a "$SUMMARY"
    FAILED=1
    return 0
  fi
  echo "=== $name: $*" >> "$log"
  if declare -F "$1" > /dev/null; then
    timeout -k 10 "$limit" bash -c "$(declare -f "$1"); $*" >> "$log" 2>&1
  else
    timeout -k 10 "$limit" "$@" >> "$log" 2>&1
  fi
  rc=$?
  if (( rc == 0 )); then
    echo "ok    $name ($((SECONDS - start)) s)" | tee -a "$SUMMARY"
  else
    (( rc == 124 || rc == 137 )) && rc="$rc, timed out after ${limit} s"
    echo "FAIL  $name ($((SECONDS - start)) s, exit $rc): see $log" | tee -a "$SUMMARY"
    FAILED=1
  fi
}

environment() {
  local bad=0
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || { echo "driver: none"; bad=1; }
  { command -v nvcc && nvcc --version | tail -2; } || { echo "nvcc: missing"; bad=1; }
  echo "compute-sanitizer: $(command -v compute-sanitizer || echo missing)"
  "$PY" - <<'PYEOF'
import importlib.util, os, sys, sysconfig
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "NONE")
header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
print("Python.h:", header if os.path.exists(header) else "MISSING")
missing = [m for m in ("scikit_build_core", "cmake", "ninja", "pytest", "numpy") if not importlib.util.find_spec(m)]
print("missing Python packages:", missing or "none")
sys.exit(1 if missing or not torch.cuda.is_available() or not os.path.exists(header) else 0)
PYEOF
  (( $? == 0 && bad == 0 ))
}

install_wheels() {
  [ -d "$WHEELS" ] || { echo "no $WHEELS folder: nothing to install"; return 0; }
  "$PY" -m pip install --no-index --find-links "$WHEELS" "$WHEELS"/*.whl
}

sanitizers() {
  command -v compute-sanitizer > /dev/null || { echo "compute-sanitizer: missing"; return 1; }
  local tool rc=0
  for tool in memcheck racecheck synccheck initcheck; do
    echo "--- $tool"
    # No caching allocator, so memcheck sees each tensor's own bounds.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 5 70 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --print-limit 20 "$PY" bench/gpu_kernels_once.py || { echo "--- $tool: exit $?"; rc=1; }
  done
  return $rc
}

step environment env 30 environment
step wheels env 60 install_wheels
step build build 240 "$PY" -m pip install --no-build-isolation --no-deps -v -e .
step "op tests on CUDA" tests 150 "$PY" -m pytest -q -p no:cacheprovider -k cuda tests/test_paged_attention.py \
  tests/test_reshape_and_cache.py tests/test_op_errors.py tests/test_library.py
step "CUDA graph replay" graph 60 "$PY" bench/gpu_kernels_once.py --graph
step "compute-sanitizer x4" sanitizer 300 sanitizers
step "decode benchmark" bench 90 "$PY" bench/decode_gpu.py --out "$OUT" --iters 30
step "cache-write benchmark" bench 45 "$PY" bench/cache_write.py --device cuda --tokens 16384

{
  echo "--- build: $(grep -h "minipaged: backends" "$OUT/build.log" | tail -1)"
  echo "--- op tests: $(grep -hE "[0-9]+ (passed|failed)" "$OUT/tests.log" | tail -1)"
  grep -hE "^FAILED|^ERROR" "$OUT/tests.log" | head -10
  echo "--- sanitizers:"
  grep -hE "^--- |ERROR SUMMARY|RACECHECK SUMMARY|hazard|Invalid|Barrier|Uninitialized" "$OUT/sanitizer.log" | head -20
  echo "--- benchmarks:"
  grep -hvE "^===" "$OUT/bench.log" | tail -16
  echo "--- files: $(find "$OUT" -type f | wc -l) in $OUT; total $SECONDS s of ${BUDGET}"
} >> "$SUMMARY" 2>/dev/null
echo "======== summary"
cat "$SUMMARY"
exit $FAILED
