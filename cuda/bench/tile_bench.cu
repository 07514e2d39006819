// The grouped GEMM's forward and input-gradient tiles (GemmTile: small 64 x 128, medium 64 x 256,
// large 128 x 256) at the four training models' shapes, without XLA: device time per call (a CUDA
// graph of 10 launcher calls, the setup kernel included), useful TFLOP/s, and each tile's result
// compared bitwise with the large tile's: the measurements behind jax_moe's tile rule, to rerun on a
// new card. Built with JAX_MOE_BENCH=ON (cuda/README.md).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench_timing.h"
#include "grouped_gemm_kernels.h"

using namespace jax_moe;
__global__ void Compare(const uint16_t* x, const uint16_t* y, int64_t n, unsigned long long* bad) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    if (x[i] != y[i]) ++local;
  if (local) atomicAdd(bad, local);
}
struct Case { const char* name; int E, k; int64_t T, K, N; };
int main() {
  Case cases[] = {
    {"qwen3 gu T1024", 128, 8, 1024, 2048, 1536}, {"qwen3 dn T1024", 128, 8, 1024, 768, 2048},
    {"qwen3 gu T4096", 128, 8, 4096, 2048, 1536}, {"qwen3 dn T4096", 128, 8, 4096, 768, 2048},
    {"qwen3 gu T16384", 128, 8, 16384, 2048, 1536}, {"qwen3 dn T16384", 128, 8, 16384, 768, 2048},
    {"dsv3 gu T1024", 256, 8, 1024, 7168, 4096}, {"dsv3 dn T1024", 256, 8, 1024, 2048, 7168},
    {"dsv3 gu T4096", 256, 8, 4096, 7168, 4096}, {"dsv3 dn T4096", 256, 8, 4096, 2048, 7168},
    {"qwen35 gu T1024", 512, 10, 1024, 4096, 2048}, {"qwen35 dn T1024", 512, 10, 1024, 1024, 4096},
    {"qwen35 gu T4096", 512, 10, 4096, 4096, 2048}, {"qwen35 dn T4096", 512, 10, 4096, 1024, 4096},
    {"mixtral gu T1024", 8, 2, 1024, 4096, 28672}, {"mixtral dn T1024", 8, 2, 1024, 14336, 4096},
    {"mixtral gu T4096", 8, 2, 4096, 4096, 28672}, {"mixtral dn T4096", 8, 2, 4096, 14336, 4096},
  };
  struct V { const char* name; GemmTile tile; } vs[] = {
      {"large 128x256", GemmTile::kLargeM}, {"small 64x128", GemmTile::kSmallM}, {"medium 64x256", GemmTile::kMediumM}};
  cudaStream_t st; CK(cudaStreamCreate(&st));
  auto timeit = [&](auto fn) { return GraphMicroseconds(st, 10, 5, fn); };
  for (auto c : cases) {
    const int64_t R = c.T * c.k, E = c.E;
    std::mt19937 g(1); std::vector<int> counts(E, 0);
    for (int64_t t = 0; t < c.T; ++t) { std::vector<int> p(E); for (int e = 0; e < E; ++e) p[e] = e; std::shuffle(p.begin(), p.end(), g); for (int j = 0; j < c.k; ++j) counts[p[j]]++; }
    std::vector<int32_t> off(E + 1, 0); for (int e = 0; e < E; ++e) off[e + 1] = off[e] + counts[e];
    int tiles128 = 0, tiles64 = 0; for (int e = 0; e < E; ++e) { tiles128 += (counts[e] + 127) / 128; tiles64 += (counts[e] + 63) / 64; }
    const int64_t wide = std::max(c.K, c.N);
    void *act, *w, *out, *ref, *ws; int32_t* doff;
    CK(cudaMalloc(&act, R * wide * 2)); CK(cudaMalloc(&w, size_t(E) * c.K * c.N * 2)); CK(cudaMalloc(&out, R * wide * 2)); CK(cudaMalloc(&ref, R * wide * 2));
    size_t wsb = GroupedGemmWorkspaceBytes(E); CK(cudaMalloc(&ws, wsb)); CK(cudaMalloc(&doff, (E + 1) * 4));
    CK(cudaMemcpy(doff, off.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
    { std::vector<__nv_bfloat16> h(1 << 24); std::mt19937 r(2); std::uniform_real_distribution<float> u(-1, 1);
      for (auto& x : h) x = __float2bfloat16(u(r));
      for (int64_t o = 0; o < R * wide; o += h.size()) CK(cudaMemcpy((char*)act + 2 * o, h.data(), 2 * std::min<int64_t>(h.size(), R * wide - o), cudaMemcpyHostToDevice));
      for (int64_t o = 0; o < E * c.K * c.N; o += h.size()) CK(cudaMemcpy((char*)w + 2 * o, h.data(), 2 * std::min<int64_t>(h.size(), E * c.K * c.N - o), cudaMemcpyHostToDevice)); }
    const double flops = 2.0 * R * c.K * c.N;
    printf("%-17s E=%d rows/expert=%.0f  128-row tiles waste %.0f%%, 64-row %.0f%%\n", c.name, c.E, double(R) / E,
           100.0 * (1 - double(R) / (tiles128 * 128.0)), 100.0 * (1 - double(R) / (tiles64 * 64.0)));
    for (int op = 0; op < 2; ++op) {
      GroupedGemmArgs args{}; args.a = act; args.b = w; args.expert_offsets = doff; args.out = ref; args.workspace = ws;
      args.workspace_bytes = wsb; args.out_rows = R; args.num_groups = E; args.k = c.K; args.n = c.N;
      args.op = op == 0 ? GemmOp::kForward : GemmOp::kInputGrad;
      const int64_t out_elems = R * (op == 0 ? c.N : c.K);
      unsigned long long* dbad; CK(cudaMalloc(&dbad, 8));
      for (auto v : vs) {
        args.tile = v.tile;
        args.out = v.tile == GemmTile::kLargeM ? ref : out;  // the first (large) is the reference
        CK(cudaMemsetAsync(args.out, 0xff, out_elems * 2, st));
        CK(LaunchGroupedGemm(args, st)); CK(cudaStreamSynchronize(st));
        CK(cudaMemsetAsync(dbad, 0, 8, st));
        Compare<<<1024, 256, 0, st>>>((const uint16_t*)args.out, (const uint16_t*)ref, out_elems, dbad);
        unsigned long long bad = 0; CK(cudaMemcpy(&bad, dbad, 8, cudaMemcpyDeviceToHost));
        double t = timeit([&] { CK(LaunchGroupedGemm(args, st)); });
        printf("  %s %-14s %8.1f us %5.0f TFLOP/s  mismatches %llu\n", op == 0 ? "fwd" : "igr", v.name, t, flops / t / 1e6, bad);
      }
      cudaFree(dbad);
    }
    cudaFree(act); cudaFree(w); cudaFree(out); cudaFree(ref); cudaFree(ws); cudaFree(doff);
  }
}
