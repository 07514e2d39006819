#!/bin/bash
# Builds jax_moe with CUDA on the GPU machine (no network there: the CUTLASS headers come from a
# carried wheel in .whl/, see README). Logs go to the folder $1. Sourced by the gpu*_session scripts.
LOGS=${1:?usage: tests/gpu_build.sh LOG_DIR}
# Modules prebuilt elsewhere for this Python (tests/gpu_prebuild.sh, carried in .prebuilt): use
# them from the source tree and skip the build.
suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
if ls .prebuilt/_jax_moe_cuda"$suffix" >/dev/null 2>&1; then
  cp .prebuilt/_jax_moe_*"$suffix" jax_moe/
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c "import jax, jax_moe._native as n; print(jax.devices(), 'cpu', n.HAS_CPU, 'cuda', n.HAS_CUDA, 'bench', n.HAS_BENCH, '(prebuilt)')"
  return 0 2>/dev/null || exit 0
fi
if ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .whl/nvidia_cutlass-*.whl >"$LOGS/cutlass_install.log" 2>&1
fi
python3 -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.JAX_MOE_CUDA=ON \
  -Ccmake.define.JAX_MOE_BENCH=ON >"$LOGS/build.log" 2>&1 \
  || { tail -40 "$LOGS/build.log"; exit 1; }
python3 -c "import jax, jax_moe._native as n; print(jax.devices(), 'cpu', n.HAS_CPU, 'cuda', n.HAS_CUDA, 'bench', n.HAS_BENCH)"
