// The FP8 grouped GEMM's CUTLASS configurations at prefill shapes, without XLA: device time per call
// (a CUDA graph of 10 calls, the setup kernel included), useful TFLOP/s, weight bytes per us, and
// each configuration's output compared bitwise with the library's (128-row cooperative tile, 1 x 2
// cluster, M-first raster). Groups are sized by random top-k routing. On the GPU machine,
// repository root (the CUTLASS include folder as for the library build):
//   nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -I$CUTLASS/include cuda/fp8_tile_bench.cu -o /tmp/fp8tb && /tmp/fp8tb [sustained] [CASE]
// "sustained" also times each configuration after about 2 s of back-to-back calls: under sustained
// GEMM load the H200 holds its 700 W cap by lowering the SM clock (1980 -> about 1500 MHz measured),
// so a short burst and a long prefill rank configurations differently. CASE keeps the cases whose
// name contains it.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "bench_timing.h"
#include "grouped_gemm_fp8_impl.cuh"

using namespace jax_moe;
using namespace jax_moe::fp8gemm;

namespace {

__global__ void FillFp8(uint8_t* out, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    const float v = (static_cast<float>(h & 0xffff) / 32768.0f - 1.0f) * 400.0f;
    out[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
}
__global__ void FillFloat(float* out, int64_t n, float value) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = value * (1.0f + 0.001f * static_cast<float>(i % 97));
}
__global__ void Compare(const uint16_t* x, const uint16_t* y, int64_t n, unsigned long long* bad) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    if (x[i] != y[i]) ++local;
  if (local) atomicAdd(bad, local);
}

using Cluster1x1 = cute::Shape<cute::_1, cute::_1, cute::_1>;
using Cluster2x1 = cute::Shape<cute::_2, cute::_1, cute::_1>;
using Cluster1x4 = cute::Shape<cute::_1, cute::_4, cute::_1>;  // four N tiles share the rows' loads
using Cluster1x8 = cute::Shape<cute::_1, cute::_8, cute::_1>;

struct Variant {
  const char* name;
  cudaError_t (*run)(const Fp8GroupedGemmArgs&, int, void*, cudaStream_t, RasterOrder, int);
  RasterOrder raster;
  int swizzle;
};
template <class C>
cudaError_t Run(const Fp8GroupedGemmArgs& a, int sms, void* ws, cudaStream_t s, RasterOrder r, int sw) {
  return RunGemm<C>(a, sms, ws, s, r, sw);
}
template <class C>
size_t CutlassWorkspace(int64_t groups) {
  Fp8GroupedGemmArgs a{};
  a.num_groups = groups;
  return C::Gemm::get_workspace_size(MakeArguments<typename C::Gemm>(a, 132));
}

struct Case { const char* name; int E, k; int64_t T, K, N; };

}  // namespace

int main(int argc, char** argv) {
  bool sustained = false;
  const char* only = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "sustained")) sustained = true;
    else only = argv[i];
  }
  const Case cases[] = {
      {"dsv3 gu T4096", 256, 8, 4096, 7168, 4096}, {"dsv3 dn T4096", 256, 8, 4096, 2048, 7168},
      {"dsv3 gu T1024", 256, 8, 1024, 7168, 4096}, {"dsv3 dn T1024", 256, 8, 1024, 2048, 7168},
      {"dsv3 gu T16384", 256, 8, 16384, 7168, 4096},
      {"qwen3 gu T4096", 128, 8, 4096, 2048, 1536}, {"qwen3 dn T4096", 128, 8, 4096, 768, 2048},
      {"dsv3 shared gu T4096", 1, 1, 4096, 7168, 4096},
  };
  // The first is the reference every other configuration's output is compared with.
  const Variant variants[] = {
      {"coop128 1x2 M-first (library)", Run<Cooperative<128, Cluster1x2>>, RasterOrder::AlongM, 1},
      {"coop128 1x2 N-first", Run<Cooperative<128, Cluster1x2>>, RasterOrder::AlongN, 1},
      {"coop128 1x2 swizzle 2", Run<Cooperative<128, Cluster1x2>>, RasterOrder::AlongM, 2},
      {"coop128 1x2 swizzle 8", Run<Cooperative<128, Cluster1x2>>, RasterOrder::AlongM, 8},
      {"coop128 2x1", Run<Cooperative<128, Cluster2x1>>, RasterOrder::AlongM, 1},
      {"coop128 1x4", Run<Cooperative<128, Cluster1x4>>, RasterOrder::AlongM, 1},
      {"coop128 1x8", Run<Cooperative<128, Cluster1x8>>, RasterOrder::AlongM, 1},
      {"coop128 1x1", Run<Cooperative<128, Cluster1x1>>, RasterOrder::AlongM, 1},
      {"pingpong64 1x2 (library)", Run<Pingpong<64, Cluster1x2>>, RasterOrder::AlongM, 1},
      {"pingpong64 1x4", Run<Pingpong<64, Cluster1x4>>, RasterOrder::AlongM, 1},
      {"pingpong64 1x1", Run<Pingpong<64, Cluster1x1>>, RasterOrder::AlongM, 1},
  };
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  for (const Case& c : cases) {
    if (only != nullptr && strstr(c.name, only) == nullptr) continue;
    const int64_t R = c.T * c.k, E = c.E;
    std::mt19937 g(1);
    std::vector<int> counts(E, 0);
    for (int64_t t = 0; t < c.T; ++t) {
      std::vector<int> p(E);
      for (int e = 0; e < E; ++e) p[e] = e;
      std::shuffle(p.begin(), p.end(), g);
      for (int j = 0; j < c.k; ++j) counts[p[j]]++;
    }
    std::vector<int32_t> off(E + 1, 0);
    int tiles128 = 0, tiles64 = 0;
    for (int e = 0; e < E; ++e) {
      off[e + 1] = off[e] + counts[e];
      tiles128 += (counts[e] + 127) / 128;
      tiles64 += (counts[e] + 63) / 64;
    }
    uint8_t *a, *b;
    float *sa, *sb;
    void *out, *ref, *ws;
    int32_t* doff;
    unsigned long long* dbad;
    CK(cudaMalloc(&a, R * c.K));
    CK(cudaMalloc(&b, E * c.N * c.K));
    CK(cudaMalloc(&sa, R * (c.K / 128) * 4));
    CK(cudaMalloc(&sb, E * (c.N / 128) * (c.K / 128) * 4));
    CK(cudaMalloc(&out, R * c.N * 2));
    CK(cudaMalloc(&ref, R * c.N * 2));
    CK(cudaMalloc(&doff, (E + 1) * 4));
    CK(cudaMalloc(&dbad, 8));
    size_t cutlass_bytes = 0;
    cutlass_bytes = std::max({CutlassWorkspace<Cooperative<128, Cluster1x2>>(E), CutlassWorkspace<Cooperative<128, Cluster1x4>>(E),
                              CutlassWorkspace<Cooperative<128, Cluster1x8>>(E), CutlassWorkspace<Cooperative<128, Cluster1x1>>(E),
                              CutlassWorkspace<Cooperative<128, Cluster2x1>>(E), CutlassWorkspace<Pingpong<64, Cluster1x2>>(E),
                              CutlassWorkspace<Pingpong<64, Cluster1x4>>(E), CutlassWorkspace<Pingpong<64, Cluster1x1>>(E)});
    const size_t wsb = WorkspaceLayout(E).cutlass + cutlass_bytes;
    CK(cudaMalloc(&ws, wsb));
    CK(cudaMemcpy(doff, off.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
    FillFp8<<<1024, 256, 0, st>>>(a, R * c.K, 1);
    FillFp8<<<1024, 256, 0, st>>>(b, E * c.N * c.K, 2);
    FillFloat<<<1024, 256, 0, st>>>(sa, R * (c.K / 128), 1.0f / 448);
    FillFloat<<<1024, 256, 0, st>>>(sb, E * (c.N / 128) * (c.K / 128), 1.0f / 448);
    CK(cudaStreamSynchronize(st));
    Fp8GroupedGemmArgs args{a, sa, b, sb, doff, ref, ws, wsb, R, E, c.K, c.N, 128};
    const double flops = 2.0 * R * c.K * c.N, weight_bytes = double(E) * c.N * c.K;
    printf("%-20s E=%d rows/expert=%.0f  128-row tiles %d (waste %.0f%%), 64-row %d (waste %.0f%%)\n", c.name, c.E,
           double(R) / E, tiles128, 100.0 * (1 - double(R) / (tiles128 * 128.0)), tiles64,
           100.0 * (1 - double(R) / (tiles64 * 64.0)));
    for (const Variant& v : variants) {
      args.out = &v == variants ? ref : out;
      CK(cudaMemsetAsync(args.out, 0xff, R * c.N * 2, st));
      auto call = [&] {
        const int blocks = static_cast<int>(std::min<int64_t>((std::max<int64_t>(E, R * c.N / 8) + 255) / 256, 264));
        SetupKernel<<<blocks, 256, 0, st>>>(args);
        CK(v.run(args, sms, static_cast<char*>(ws) + WorkspaceLayout(E).cutlass, st, v.raster, v.swizzle));
      };
      call();
      CK(cudaStreamSynchronize(st));
      CK(cudaMemsetAsync(dbad, 0, 8, st));
      Compare<<<1024, 256, 0, st>>>(static_cast<const uint16_t*>(args.out), static_cast<const uint16_t*>(ref), R * c.N, dbad);
      unsigned long long bad = 0;
      CK(cudaMemcpy(&bad, dbad, 8, cudaMemcpyDeviceToHost));
      if (sustained) sleep(1);  // the clock back up after the previous configuration's load
      const double us = GraphMicroseconds(st, 10, 5, call);
      printf("  %-32s %8.1f us %6.0f TFLOP/s %6.0f GB/s of weights  mismatches %llu", v.name, us, flops / us / 1e6,
             weight_bytes / us / 1e3, bad);
      if (sustained) {
        GraphMicroseconds(st, 10, std::max(5, static_cast<int>(2e6 / (10 * us))), call);  // about 2 s of calls
        const double hot = GraphMicroseconds(st, 10, 5, call);
        printf("  sustained %8.1f us %6.0f TFLOP/s", hot, flops / hot / 1e6);
      }
      printf("\n");
    }
    cudaFree(a); cudaFree(b); cudaFree(sa); cudaFree(sb); cudaFree(out); cudaFree(ref); cudaFree(ws); cudaFree(doff);
    cudaFree(dbad);
  }
  return 0;
}
