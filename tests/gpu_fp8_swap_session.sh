#!/bin/bash
# Branch fp8-swap-ab, written without a GPU (session 24): the swap-AB FP8 grouped GEMM's first runs,
# in two device calls of under 10 minutes each, from the repository root, carrying .prebuilt (this
# branch's modules, tests/gpu_prebuild.sh) and .probe (fp8tb: cuda/fp8_tile_bench.cu built as its
# header says, with --fmad=false -lineinfo as the library):
#   bash tests/gpu_fp8_swap_session.sh kernels   # then
#   bash tests/gpu_fp8_swap_session.sh layer
# Logs under $OUT:
#   kernels: fp8_swap_probe.txt     every CUTLASS configuration at the prefill shapes, against the library's
#            fp8_swap_tests.log     the FP8 GEMM's GPU tests, every tile of gemm.FP8_TILE_ROWS
#            fp8_swap_memcheck.txt  compute-sanitizer memcheck over the FP8 GEMM, every tile, ragged groups
#   layer:   fp8_swap_tiles.json    gemm's tiles through XLA (jax_moe.bench.fp8_tile_probe)
#            fp8_swap_layer_M_*.txt the FP8 layer at T = 4096 per kernel, the pick and each swap tile
source tests/gpu_build.sh "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if [ "$1" = kernels ]; then
  for case in dsv3 qwen3; do timeout 120 .probe/fp8tb "$case"; done > "$OUT/fp8_swap_probe.txt" 2>&1
  grep -E "T[0-9]|library|swap" "$OUT/fp8_swap_probe.txt" | head -60
  timeout 300 python3 -m pytest -q -m gpu tests/test_fp8.py -k "forward" > "$OUT/fp8_swap_tests.log" 2>&1
  tail -3 "$OUT/fp8_swap_tests.log"
  timeout 120 compute-sanitizer --tool memcheck --print-limit 20 python3 -c "
import jax, numpy as np
from jax_moe import fp8, gemm
rng = np.random.default_rng(0)
sizes = [5, 0, 130, 1, 64, 0, 200, 3]
offsets = jax.numpy.asarray(np.concatenate([[0], np.cumsum(sizes)]), jax.numpy.int32)
rows = jax.numpy.asarray(rng.standard_normal((sum(sizes) + 7, 256)), jax.numpy.bfloat16)
gu = jax.jit(fp8.quantize)(rng.standard_normal((8, 512, 256)) / 16)
dn = jax.jit(fp8.quantize)(rng.standard_normal((8, 256, 256)) / 16)
for tile in gemm.FP8_TILE_ROWS:
    out, _ = jax.jit(lambda *a: gemm.fp8_forward(*a, rows.shape[0], tile))(rows, *gu, offsets, gemm.fp8_workspace(8))
    sw, _ = jax.jit(lambda *a: gemm.fp8_swiglu_forward(*a, rows.shape[0], tile, decode_rows=0))(
        rows, *gu, *dn, offsets, gemm.fp8_workspace(8))
    print(tile, bool(np.isfinite(np.asarray(out, np.float32)).all()), bool(np.isfinite(np.asarray(sw, np.float32)).all()))
" > "$OUT/fp8_swap_memcheck.txt" 2>&1; echo "rc=$?" >> "$OUT/fp8_swap_memcheck.txt"
  grep -E "SUMMARY|rc=|^[0-9]" "$OUT/fp8_swap_memcheck.txt"
elif [ "$1" = layer ]; then
  timeout 200 python3 -m jax_moe.bench.fp8_tile_probe > "$OUT/fp8_swap_tiles.json" 2>&1; tail -7 "$OUT/fp8_swap_tiles.json"
  for model in deepseek_v3 qwen3_30b; do
    for tile in pick 64 128; do
      timeout 90 python3 -c "
import sys
from jax_moe import gemm
from jax_moe.bench import train_profile
if sys.argv[2] != 'pick':
    gemm.fp8_tile_rows = lambda rows, groups: gemm.FP8_WEIGHTS_AS_A | int(sys.argv[2])
train_profile.main(['--forward', '--fp8', '--model', sys.argv[1], '--tokens', '4096', '--layers', '2', '--top', '8'])
" "$model" "$tile" > "$OUT/fp8_swap_layer_${model}_$tile.txt" 2>&1
      tail -10 "$OUT/fp8_swap_layer_${model}_$tile.txt"
    done
  done
else
  echo "usage: bash tests/gpu_fp8_swap_session.sh kernels|layer"; exit 2
fi
