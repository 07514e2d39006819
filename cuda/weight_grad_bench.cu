// Weight-gradient GEMM epilogue variants at the four training models' shapes, without XLA: device
// time per call (a CUDA graph of 10 calls), output bytes per second against a cudaMemset of the
// same bytes, and each variant's result compared bitwise with the launcher's (LaunchGroupedGemm,
// which also runs the setup kernel that fills the per-group arguments the variants reuse).
// Results: notebooks/results/weight_grad_epilogue_h200.txt. On the GPU machine, repository root:
//   CUT=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
//   F="-O3 --fmad=false -DNDEBUG --expt-relaxed-constexpr -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda -I$CUT"
//   ls cuda/grouped_gemm*.cu cuda/weight_grad_bench.cu | xargs -P 8 -I{} sh -c "nvcc $F -c {} -o /tmp/\$(basename {}).o"
//   nvcc -gencode=arch=compute_90a,code=sm_90a /tmp/*grad_bench.cu.o /tmp/grouped_gemm*.cu.o -o /tmp/wgb && /tmp/wgb
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench_timing.h"
#include "grouped_gemm_impl.cuh"

namespace jax_moe::gemm {
namespace {
using Cooperative = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using CooperativeEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
template <class EpilogueTile>
using Variant = Config<GemmOp::kWeightGrad, LargeTile, PairCluster, Cooperative,
                       BuiltEpilogue<LargeTile, PairCluster, CooperativeEpilogue, EpilogueTile>>;
using Auto = cutlass::epilogue::collective::EpilogueTileAuto;  // 128 x 32 for this tile
using Wide = cute::Shape<cute::_128, cute::_64>;               // WeightGradM's
using Wider = cute::Shape<cute::_128, cute::_128>;
}  // namespace
}  // namespace jax_moe::gemm
using namespace jax_moe;
__global__ void Compare(const uint16_t* x, const uint16_t* y, const int* counts, int64_t per, int64_t n, unsigned long long* bad) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    if (counts[i / per] && x[i] != y[i]) ++local;
  if (local) atomicAdd(bad, local);
}
struct Case { const char* name; int E, k; int64_t T, K, N; };
int sms() { int c; CK(cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, 0)); return c; }
int main(int argc, char** argv) {
  Case cases[] = {
    {"qwen3 gu T1024", 128, 8, 1024, 2048, 1536}, {"qwen3 dn T1024", 128, 8, 1024, 768, 2048},
    {"qwen3 gu T4096", 128, 8, 4096, 2048, 1536}, {"qwen3 dn T4096", 128, 8, 4096, 768, 2048},
    {"qwen3 gu T16384", 128, 8, 16384, 2048, 1536},
    {"dsv3 gu T1024", 256, 8, 1024, 7168, 4096}, {"dsv3 dn T1024", 256, 8, 1024, 2048, 7168},
    {"dsv3 gu T4096", 256, 8, 4096, 7168, 4096}, {"dsv3 dn T4096", 256, 8, 4096, 2048, 7168},
    {"qwen35 gu T1024", 512, 10, 1024, 4096, 2048}, {"qwen35 dn T1024", 512, 10, 1024, 1024, 4096},
    {"qwen35 gu T4096", 512, 10, 4096, 4096, 2048},
    {"mixtral gu T4096", 8, 2, 4096, 4096, 28672}, {"mixtral dn T4096", 8, 2, 4096, 14336, 4096},
  };
  using Fn = cudaError_t (*)(const GroupedGemmArgs&, int, cudaStream_t);
  struct V { const char* name; Fn fn; } vs[] = {{"A auto128x32 S2", gemm::RunGemm<gemm::Variant<gemm::Auto>>},
      {"B 128x64 S2", gemm::RunGemm<gemm::Variant<gemm::Wide>>}, {"C 128x128 S2", gemm::RunGemm<gemm::Variant<gemm::Wider>>}};
  cudaStream_t st; CK(cudaStreamCreate(&st));
  const int sm = sms();
  for (auto c : cases) {
    const int64_t R = c.T * c.k, E = c.E;
    std::mt19937 g(1); std::vector<int> counts(E, 0);
    for (int64_t t = 0; t < c.T; ++t) { std::vector<int> p(E); for (int e = 0; e < E; ++e) p[e] = e; std::shuffle(p.begin(), p.end(), g); for (int j = 0; j < c.k; ++j) counts[p[j]]++; }
    std::vector<int32_t> off(E + 1, 0); for (int e = 0; e < E; ++e) off[e + 1] = off[e] + counts[e];
    void *rows, *dout, *out, *ref, *ws; int32_t* doff;
    const size_t out_bytes = size_t(E) * c.K * c.N * 2;
    CK(cudaMalloc(&rows, R * c.K * 2)); CK(cudaMalloc(&dout, R * c.N * 2)); CK(cudaMalloc(&out, out_bytes)); CK(cudaMalloc(&ref, out_bytes));
    size_t wsb = GroupedGemmWorkspaceBytes(E) + (64 << 20); CK(cudaMalloc(&ws, wsb)); CK(cudaMalloc(&doff, (E + 1) * 4));
    CK(cudaMemcpy(doff, off.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
    { std::vector<__nv_bfloat16> h(std::max(R * c.K, R * c.N)); std::mt19937 r(2); std::uniform_real_distribution<float> u(-1, 1);
      for (auto& x : h) x = __float2bfloat16(u(r));
      CK(cudaMemcpy(rows, h.data(), R * c.K * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dout, h.data(), R * c.N * 2, cudaMemcpyHostToDevice)); }
    GroupedGemmArgs args{}; args.a = rows; args.b = dout; args.expert_offsets = doff; args.out = ref; args.workspace = ws;
    args.workspace_bytes = wsb; args.out_rows = R; args.num_groups = E; args.k = c.K; args.n = c.N; args.op = GemmOp::kWeightGrad; args.tile = GemmTile::kLargeM;
    CK(LaunchGroupedGemm(args, st)); CK(cudaStreamSynchronize(st));
    auto timeit = [&](auto fn) { return GraphMicroseconds(st, 10, 5, fn); };
    double tset = timeit([&] { CK(cudaMemsetAsync(out, 0, out_bytes, st)); });
    double flops = 2.0 * R * c.K * c.N;
    printf("%-18s E=%d rows/expert=%.0f out %.0f MB: memset %.1f us (%.2f TB/s)\n", c.name, c.E, double(R) / E, out_bytes / 1e6, tset, out_bytes / tset / 1e6);
    args.out = out;
    CK(LaunchGroupedGemm(args, st));  // the per-group pointers now point at out
    int* dcounts; unsigned long long* dbad; CK(cudaMalloc(&dcounts, E * 4)); CK(cudaMalloc(&dbad, 8));
    CK(cudaMemcpy(dcounts, counts.data(), E * 4, cudaMemcpyHostToDevice));
    for (auto v : vs) {
      CK(cudaMemsetAsync(out, 0xff, out_bytes, st));
      cudaError_t e = v.fn(args, sm, st);
      if (e != cudaSuccess) { printf("  %-16s failed: %s\n", v.name, cudaGetErrorString(e)); cudaGetLastError(); continue; }
      CK(cudaStreamSynchronize(st));
      CK(cudaMemsetAsync(dbad, 0, 8, st));
      Compare<<<1024, 256, 0, st>>>((const uint16_t*)out, (const uint16_t*)ref, dcounts, c.K * c.N, E * c.K * c.N, dbad);
      unsigned long long bad = 0; CK(cudaMemcpy(&bad, dbad, 8, cudaMemcpyDeviceToHost));
      double t = timeit([&] { CK(v.fn(args, sm, st)); });
      printf("  %-16s %9.1f us  %5.2f TB/s written (%3.0f%% of memset)  %5.0f TFLOP/s  mismatches %llu\n", v.name, t, out_bytes / t / 1e6, 100 * tset / t, flops / t / 1e6, bad);
    }
    cudaFree(rows); cudaFree(dout); cudaFree(out); cudaFree(ref); cudaFree(ws); cudaFree(doff); cudaFree(dcounts); cudaFree(dbad);
  }
}
