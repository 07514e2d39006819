#!/bin/bash
# Builds the native modules on THIS machine for the GPU machine's Python (3.12 there), into
# .prebuilt/, so a device session spends no device time compiling CUTLASS (cuda/CMakeLists.txt
# says how long on how many cores; a rebuild recompiles only what changed). nvcc 13.0 is on both
# machines; cudart is linked statically. The benchmark module too (JAX_MOE_BENCH=ON: the bench
# suites' copy ceiling). Then carry .prebuilt in the device call: tests/gpu_build.sh installs those
# modules instead of building.
#   bash tests/gpu_prebuild.sh [python3.12 executable]
set -euo pipefail
# (a pyenv shim for python3.12 may exist and still fail: try it before using it)
PY=${1:-$(python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || echo /root/.pyenv/versions/3.12.1/bin/python)}
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PREBUILD_VENV:-/tmp/jax_moe_prebuild_venv}"
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
"$venv/bin/pip" install -q pybind11 "jaxlib==0.10.2" nvidia-cutlass==4.2.0.0 numpy
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
build="${PREBUILD_DIR:-/tmp/jax_moe_prebuild_build}"  # kept between runs: a rebuild recompiles only what changed
cmake -S "$repo/cuda" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_MOE_CUDA=ON -DJAX_MOE_BENCH=ON \
  -DJAX_MOE_CUDA_ARCHITECTURES=90a -Dpybind11_DIR="$site/pybind11/share/cmake/pybind11" \
  -DPython_EXECUTABLE="$venv/bin/python" >/dev/null
cmake --build "$build" -j "$(nproc)"
mkdir -p "$repo/.prebuilt"
rm -f "$repo"/.prebuilt/_jax_moe_*.so
cp "$build"/_jax_moe_*.so "$build"/bench/_jax_moe_*.so "$repo/.prebuilt/"  # only the modules travel (the call's size limit)
ls -la "$repo"/.prebuilt/*.so
