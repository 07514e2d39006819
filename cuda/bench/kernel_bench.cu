// Kernel-only benchmark of the CUDA launchers, without XLA: each op captured 20 times in a CUDA
// graph and replayed (device time per launch, no host launch overhead), against cudaMemcpyAsync
// of the same bytes. bf16 rows, identity expert map, T_max = T. Built with JAX_MOE_BENCH=ON
// (cuda/README.md); or on the GPU machine, from the repository root:
//   nvcc -O3 --fmad=false -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda \
//     cuda/bench/kernel_bench.cu cuda/permute_kernels.cu -o /tmp/kernel_bench && /tmp/kernel_bench
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
#include "bench_timing.h"
#include "permute_kernels.h"
using namespace jax_moe;
struct Shape { const char* name; int E, k, H, T; };
int main() {
  Shape shapes[] = {{"dsv3",256,8,7168,1},{"dsv3",256,8,7168,16},{"dsv3",256,8,7168,128},{"dsv3",256,8,7168,1024},{"dsv3",256,8,7168,4096},{"dsv3",256,8,7168,16384},
                    {"qwen3",128,8,2048,16},{"qwen3",128,8,2048,1024},{"qwen3",128,8,2048,16384},{"qwen35",512,10,4096,64},{"qwen35",512,10,4096,16384},{"mixtral",8,2,4096,16384}};
  cudaStream_t st; CK(cudaStreamCreate(&st));
  for (auto s : shapes) {
    int64_t T = s.T, k = s.k, H = s.H, E = s.E, R = T * k, cap = R;
    int64_t tiles = (R + kTileRoutes - 1) / kTileRoutes;
    std::vector<int32_t> ids(R), map(E); std::mt19937 g(1);
    for (int64_t t = 0; t < T; ++t) { std::vector<int> p(E); for (int e = 0; e < E; ++e) p[e] = e; std::shuffle(p.begin(), p.end(), g); for (int j = 0; j < k; ++j) ids[t*k+j] = p[j]; }
    for (int e = 0; e < E; ++e) map[e] = e;
    void *x, *perm, *out, *w; int32_t *dids, *dmap, *src, *dest, *gs, *off, *ws;
    CK(cudaMalloc(&x, T*H*2)); CK(cudaMalloc(&perm, cap*H*2)); CK(cudaMalloc(&out, T*H*2)); CK(cudaMalloc(&w, R*4));
    CK(cudaMalloc(&dids, R*4)); CK(cudaMalloc(&dmap, E*4)); CK(cudaMalloc(&src, cap*4)); CK(cudaMalloc(&dest, R*4));
    CK(cudaMalloc(&gs, E*4)); CK(cudaMalloc(&off, (E+1)*4)); CK(cudaMalloc(&ws, E*(tiles+1)*4));
    CK(cudaMemcpy(dids, ids.data(), R*4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dmap, map.data(), E*4, cudaMemcpyHostToDevice));
    CK(cudaMemset(x, 0x3c, T*H*2)); CK(cudaMemset(w, 0, R*4));
    PermuteArgs p{x, dids, nullptr, perm, src, dest, gs, off, ws, T, k, E, E, cap, H*2, 1, E*(tiles+1)};
    UnpermuteArgs u{perm, w, dest, out, T, k, H, cap, FloatType::kBF16, FloatType::kF32};
    auto timeit = [&](auto fn) { return GraphMicroseconds(st, 20, 7, fn); };
    double tp = timeit([&] { CK(LaunchPermute(p, st)); });
    double tu = timeit([&] { CK(LaunchUnpermute(u, st)); });
    int64_t bytes = (T + R) * H * 2;
    void* big; CK(cudaMalloc(&big, bytes));
    double tc = timeit([&] { CK(cudaMemcpyAsync(big, perm, bytes / 2, cudaMemcpyDeviceToDevice, st)); });
    printf("%-8s T=%6ld permute %8.1f us (%5.1f%% of copy) unpermute %8.1f us (%5.1f%%) copy %8.1f us %.2f TB/s\n", s.name, T, tp, 100*tc/tp, tu, 100*tc/tu, tc, bytes/tc/1e6);
    cudaFree(x); cudaFree(perm); cudaFree(out); cudaFree(w); cudaFree(dids); cudaFree(dmap); cudaFree(src); cudaFree(dest); cudaFree(gs); cudaFree(off); cudaFree(ws); cudaFree(big);
  }
}
