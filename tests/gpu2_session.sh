#!/bin/bash
# One device session on a 2-GPU machine (nvidia-h200-x2): build with CUDA, then the named steps.
#   tests     expert-parallel checks on both GPUs, concurrently with the single-GPU tests on GPU 1
#             and compute-sanitizer racecheck on GPU 0 (correctness only: sharing is fine)
#   parallel  the parallel bench suite on both GPUs, then on GPU 0 alone (nothing else running)
#   gemm      the gemm suite, models split over the two GPUs (one process each, each measuring its
#             own baselines and copy ceiling), and the stack suite on GPU 1 after its share
# Usage (repo root): OUT=dir bash tests/gpu2_session.sh tests parallel gemm
# Logs and results land in $RUN (default /tmp/jax_moe_run), packed into $OUT/run.tgz after each step.
set -uo pipefail
OUT=${OUT:-/tmp/jax_moe_gpu2}
RUN=${RUN:-/tmp/jax_moe_run}
mkdir -p "$RUN" "$OUT"
# NVLink multicast stays off (the device README: it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
stage() { echo "== $1 ($(date +%T))"; }

stage build
source tests/gpu_build.sh "$RUN"
nvidia-smi topo -m >"$RUN/topology.txt" 2>&1

for step in "$@"; do
  case $step in
  tests)
    stage "tests (concurrent)"
    timeout 400 python3 -m pytest -q -m gpu tests/test_parallel.py >"$RUN/parallel_gpu_tests.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 400 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_gemm.py \
      >"$RUN/gpu_tests.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=0 timeout 400 compute-sanitizer --tool racecheck --print-limit 20 \
      python3 tests/sanitize_gpu.py >"$RUN/sanitizer_racecheck.log" 2>&1 &
    wait
    tail -4 "$RUN/parallel_gpu_tests.log" "$RUN/gpu_tests.log"
    grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$RUN"/sanitizer_*.log
    ;;
  parallel)
    stage "parallel bench, 2 GPUs"
    timeout 170 python3 -m jax_moe.bench --suite parallel --out "$RUN/parallel_gpu2" --time-limit 120 2>&1 | tail -12
    stage "parallel bench, 1 GPU"
    CUDA_VISIBLE_DEVICES=0 timeout 130 python3 -m jax_moe.bench --suite parallel --out "$RUN/parallel_gpu1" --time-limit 80 2>&1 | tail -10
    ;;
  gemm)
    stage "gemm suite, models split over the GPUs"
    CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m jax_moe.bench --suite gemm --models qwen3_30b deepseek_v3 --time-limit 330 \
      --out "$RUN/gemm_gpu0" >"$RUN/gemm_gpu0.log" 2>&1 &
    (CUDA_VISIBLE_DEVICES=1 timeout 210 python3 -m jax_moe.bench --suite gemm --models mixtral qwen35_397b --time-limit 170 \
       --out "$RUN/gemm_gpu1" >"$RUN/gemm_gpu1.log" 2>&1
     CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m jax_moe.bench --suite stack --models qwen3_30b deepseek_v3 --time-limit 150 \
       --out "$RUN/stack" >"$RUN/stack.log" 2>&1) &
    wait
    tail -30 "$RUN/gemm_gpu0.log" "$RUN/gemm_gpu1.log" "$RUN/stack.log"
    ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
  tar czf "$OUT/run.tgz" -C "$RUN" .  # after every step: a run cut short still brings back what ran
done
stage done
