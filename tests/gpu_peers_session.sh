#!/bin/bash
# One device call on the GPU machine: one suite of jax_moe against the JAX peers (tokamax, Pallas Mosaic GPU,
# ragged_dot; jax_moe/bench/jax_peers.py) for the models and token counts given. tokamax and the
# dependencies the machine lacks come as wheels carried in .whl/ (no network there; never jax or jaxlib).
# Usage (repo root): OUT=dir [BUDGET=540] bash tests/gpu_peers_session.sh SUITE MODEL... [T...]
#   e.g. bash tests/gpu_peers_session.sh gemm qwen3_30b deepseek_v3 16 4096   (T default: 16 4096)
# SUITE is gemm, train or decode (train and decode without the PyTorch peer: its own session). The suite
# writes its results after every shape and stops starting shapes a minute before BUDGET ends, so what
# ran survives. Results, the log and one tarball of both (the device returns few files): $OUT.
set -uo pipefail
SUITE=${1:?usage: bash tests/gpu_peers_session.sh gemm|train|decode MODEL... [T...]}
shift
MODELS=() TOKENS=()
for arg in "$@"; do [[ $arg =~ ^[0-9]+$ ]] && TOKENS+=("$arg") || MODELS+=("$arg"); done
[ ${#TOKENS[@]} -eq 0 ] && TOKENS=(16 4096)
OUT=${OUT:-/tmp/jax_moe_peers}
BUDGET=${BUDGET:-540}
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

name=${SUITE}_$(IFS=_; echo "${MODELS[*]}")
cap=$((BUDGET - SECONDS - 10))
peer=(); [ "$SUITE" != gemm ] && peer=(--no-peer)
stage "$name (${cap}s)"
timeout -k 10 "$cap" python3 -m jax_moe.bench --out "$OUT/$name" --time-limit $((cap - 60)) --suite "$SUITE" \
  "${peer[@]}" --models "${MODELS[@]}" --tokens "${TOKENS[@]}" >"$OUT/$name.log" 2>&1
grep -E "^\| |not run|failed|error" "$OUT/$name.log" | tail -30
tar czf "$OUT/peers_$name.tgz" -C "$OUT" --exclude='*.tgz' . 2>/dev/null
stage done
