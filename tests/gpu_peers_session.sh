#!/bin/bash
# One device session on the GPU machine: jax_moe against the JAX peers (tokamax, Pallas Mosaic GPU,
# ragged_dot; jax_moe/bench/jax_peers.py) in the gemm, train and decode suites. tokamax and the
# dependencies the machine lacks come as wheels carried in .whl/ (no network there; never jax or jaxlib).
# Usage (repo root): OUT=dir bash tests/gpu_peers_session.sh PART   (PART 1, 2 or 3; BUDGET seconds, default 540)
#   1: Qwen3-30B-A3B and DeepSeek-V3 at T = 16 and 4096: the block and the layer, forward and training
#   2: the same for Mixtral and Qwen3.5-397B
#   3: every model at T = 1, 1024 and 16384 (training: 1024, 16384), as far as the budget goes
# Each command has a timeout within the part's budget; a suite writes its results after every shape, so
# what ran survives a timeout. Results and logs: $OUT/<suite>_<models>/ and $OUT/*.log.
set -uo pipefail
PART=${1:?usage: bash tests/gpu_peers_session.sh 1|2}
OUT=${OUT:-/tmp/jax_moe_peers}
DEADLINE=$((SECONDS + ${BUDGET:-540}))
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stage() { echo "== $1 ($(date +%T), ${SECONDS}s)"; }

stage "install the peers' wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v nvidia_cutlass) >"$OUT/wheels.log" 2>&1 || tail -5 "$OUT/wheels.log"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
stage build
source tests/gpu_build.sh "$OUT"
python3 -c "from jax_moe.bench import jax_peers as p; [print(k, v if isinstance(v, str) else 'runs') for k, v in p.peers(128).items()]" \
  2>&1 | tail -6

bench() {  # bench NAME CAP_S ARGS...: the suite within CAP_S seconds, fewer where the part's budget ends first
  local name=$1 cap=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 60 ]; then echo "== $name: not run, ${left}s left"; return; fi
  stage "$name (${cap}s)"
  # No new shape in the last minute: the one running has that long to finish and be written.
  timeout -k 10 "$cap" python3 -m jax_moe.bench --out "$OUT/$name" --time-limit $((cap - 60)) "$@" \
    >"$OUT/$name.log" 2>&1
  grep -E "^\| |not run|failed|error" "$OUT/$name.log" | tail -30
}

case $PART in
1)
  bench gemm_qwen3_dsv3 190 --suite gemm --models qwen3_30b deepseek_v3 --tokens 16 4096
  bench train_qwen3_dsv3 180 --suite train --no-peer --models qwen3_30b deepseek_v3 --tokens 4096 16
  bench decode_qwen3_dsv3 150 --suite decode --no-peer --models qwen3_30b deepseek_v3 --tokens 16 4096
  ;;
2)
  bench gemm_mixtral_qwen35 190 --suite gemm --models mixtral qwen35_397b --tokens 16 4096
  bench train_mixtral_qwen35 180 --suite train --no-peer --models mixtral qwen35_397b --tokens 4096 16
  bench decode_mixtral_qwen35 150 --suite decode --no-peer --models mixtral qwen35_397b --tokens 16 4096
  ;;
3)
  bench gemm_other_t 200 --suite gemm --models qwen3_30b deepseek_v3 mixtral qwen35_397b --tokens 1 1024 16384
  bench train_other_t 190 --suite train --no-peer --models qwen3_30b deepseek_v3 mixtral qwen35_397b --tokens 1024 16384
  bench decode_other_t 140 --suite decode --no-peer --models qwen3_30b deepseek_v3 --tokens 1 1024
  ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
tar czf "$OUT/peers_part$PART.tgz" -C "$OUT" --exclude='*.tgz' . 2>/dev/null
stage done
