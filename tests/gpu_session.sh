#!/bin/bash
# One device session on the GPU machine: build with CUDA, GPU tests, the stack tests on the GPU,
# compute-sanitizer, benchmark (set BENCH_ARGS; SKIP_TESTS / SKIP_STACK_TESTS / SKIP_SANITIZER skip).
# Usage (repo root): bash tests/gpu_session.sh [bench args...]; logs go to $OUT (default /tmp/jax_moe_gpu).
set -uo pipefail
OUT=${OUT:-/tmp/jax_moe_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
stage() { echo "== $1 ($(date +%T))"; }

stage build
source tests/gpu_build.sh "$OUT"

if [ -z "${SKIP_TESTS:-}" ]; then
  stage "gpu tests"
  # Every GPU test file, in parallel processes sharing the GPU (mostly XLA compiles: one process ran 273
  # of the 420 in 520 s on an H100), each capped to its share of the card's memory (uncapped, the first
  # to grow its pool starved the others: 183 of 380 failed out of memory on an H100); then the whole_gpu
  # tests (tests/conftest.py) alone in one process: they need more than a share.
  XLA_PYTHON_CLIENT_MEM_FRACTION=${GPU_TEST_MEM_FRACTION:-0.22} \
  python3 -m pytest -q -m "gpu and not whole_gpu" -n "${GPU_TEST_WORKERS:-4}" -p no:cacheprovider \
    ${GPU_TEST_ARGS:-} tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  python3 -m pytest -q -m "gpu and whole_gpu" -p no:cacheprovider ${GPU_TEST_ARGS:-} tests 2>&1 \
    | tee "$OUT/gpu_tests_whole_gpu.log" | tail -8
fi

if [ -z "${SKIP_STACK_TESTS:-}" ]; then
  stage "stack tests on the GPU"  # the CPU suite's stack files, run with the GPU as default device
  python3 -m pytest -q tests/test_layers.py tests/test_stack_memory.py tests/test_autodiff.py tests/test_routing.py 2>&1 \
    | tee "$OUT/stack_tests.log" | tail -8
fi

if [ -z "${SKIP_SANITIZER:-}" ]; then
  for tool in memcheck racecheck; do
    stage "compute-sanitizer $tool"
    compute-sanitizer --tool $tool --print-limit 20 python3 tests/sanitize_gpu.py >"$OUT/sanitizer_$tool.log" 2>&1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|live rows" "$OUT/sanitizer_$tool.log" | tail -6
  done
fi

if [ -n "${BENCH_ARGS:-}" ]; then
  stage bench
  python3 -m jax_moe.bench $BENCH_ARGS 2>&1 | tee "$OUT/bench.log" | tail -60
fi
# The device returns at most 8 files from $OUT: everything also goes back as one tarball.
tar czf "$OUT/gpu_session.tgz" -C "$OUT" --exclude='*.tgz' . 2>/dev/null
stage done
