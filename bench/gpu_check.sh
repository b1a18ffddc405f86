#!/usr/bin/env bash
# The one script for the GPU machine: build against the torch there, run the op tests (CUDA
# cases included), then the GPU benchmarks. Prints a short table; files land in ${OUT:-bench/out}.
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader || true
export MINIPAGED_CUDA_ARCHS=${MINIPAGED_CUDA_ARCHS:-}   # empty: the visible GPU's architecture
start=$(date +%s)
$PY -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | tail -20
echo "build: $(( $(date +%s) - start )) s; $($PY -c 'import minipaged_ops as m; print(m.build_info())')"
$PY -m pytest -q -x tests/test_paged_attention.py tests/test_reshape_and_cache.py tests/test_op_errors.py \
    tests/test_library.py 2>&1 | tail -5 | tee "$OUT/tests.txt"
$PY bench/decode_gpu.py --out "$OUT" 2>&1 | tee "$OUT/decode_gpu.txt"
$PY bench/decode_gpu.py --block-size 32 --iters 30 2>&1 | tail -5 | tee "$OUT/decode_gpu_block32.txt"
