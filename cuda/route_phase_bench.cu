// How long each phase of the decode router (route_kernels.cu) takes, at the four models' T = 1 and
// T = 2 shapes, without XLA. The router's blocks each reduce a slice of H for a tile of experts,
// publish their sums and count themselves in; the last to arrive sums the slices and routes alone.
// ncu put Qwen3-30B's router at 10 us with its SMs busy a fraction of that
// (notebooks/results/decode_router_ncu_h200.txt). This bench splits that time into phases.
// It defines route_kernels.cu's phase marks to record each block's %globaltimer (ns, comparable
// across SMs) and clock64 (cycles of its own SM) at:
//   0 start, 1 products reduced to the warps' parts, 2 sums published and counted in (every block);
//   3 slices summed, 4 scores and choices, 5 group limit, 6 top k, 7 weights written (the last block).
// Per case it prints the kernel's time with the router's weights in L2 (a graph of launches), cold
// (L2 overwritten before each launch, as in a layer, where the experts' weights evict it), and cold
// with its code too (a kernel of 256 KB of code runs on every SM before each launch, as the experts'
// launches do in a layer), then the phases of the last, averaged, and a hash of its results (equal
// across builds that route alike). Last, the prefill choice kernel (ChooseExperts) at T = 4096, warm.
// On the GPU machine, repository root:
//   nvcc -std=c++17 -O3 --fmad=false -gencode=arch=compute_90a,code=sm_90a cuda/route_phase_bench.cu -o /tmp/rpb && /tmp/rpb
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "bench_timing.h"

namespace jax_moe_bench {

constexpr int kMarks = 8;
constexpr int kMaxBlocks = 1024;
__device__ unsigned long long g_time[kMaxBlocks][kMarks];  // %globaltimer, ns
__device__ long long g_clock[kMaxBlocks][kMarks];          // clock64 of the block's SM

__device__ __forceinline__ void RouteMark(int phase) {
  if (threadIdx.x != 0) return;
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  g_time[block][phase] = now;
  g_clock[block][phase] = clock64();
}

}  // namespace jax_moe_bench

#define JAX_MOE_ROUTE_MARK(phase) ::jax_moe_bench::RouteMark(phase)
#include "route_kernels.cu"

namespace {

using jax_moe::DecodeRouteArgs;

constexpr int kRoutePhases = jax_moe_bench::kMarks - 3;  // marks 3 to 7: the routing block's phases

struct Case {
  const char* name;
  int64_t hidden, experts, top_k;
  bool sigmoid, renormalize, bias;
  float epsilon, scaling;
  int64_t n_group, topk_group;
};

// The models' routers (jax_moe/bench/models.py, README's routing table).
const Case kCases[] = {
    {"qwen3_30b", 2048, 128, 8, false, true, false, 0.0f, 1.0f, 1, 1},
    {"deepseek_v3", 7168, 256, 8, true, true, true, 1e-20f, 2.5f, 8, 4},
    {"qwen35_397b", 4096, 512, 10, false, true, false, 0.0f, 1.0f, 1, 1},
    {"mixtral", 4096, 8, 2, false, true, false, 0.0f, 1.0f, 1, 1},
};

// FNV-1a over arrays of 32-bit values' bits, in order: equal across builds whose results are.
struct Fnv1a {
  uint64_t hash = 1469598103934665603ull;
  template <class T>
  void Add(const std::vector<T>& values) {
    static_assert(sizeof(T) == sizeof(uint32_t), "32-bit values");
    for (const T& value : values) {
      uint32_t word;
      std::memcpy(&word, &value, sizeof(word));
      hash = (hash ^ word) * 1099511628211ull;
    }
  }
};

// Deterministic values in [-1, 1) (a 32-bit LCG), scaled.
std::vector<float> Draw(size_t n, uint32_t seed, float scale) {
  std::vector<float> v(n);
  for (auto& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = (static_cast<float>(seed >> 8) / 8388608.0f - 1.0f) * scale;
  }
  return v;
}

template <class T>
T* Upload(const std::vector<T>& host) {
  T* device;
  CK(cudaMalloc(&device, host.size() * sizeof(T)));
  CK(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

std::vector<__nv_bfloat16> ToBf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

// 16384 distinct fused multiply-adds (256 KB of code) on every SM: the router's code leaves the SMs'
// instruction caches, and L2 after the eviction's memset.
__global__ void EvictCode(float* out, float seed) {
  float v = seed + static_cast<float>(threadIdx.x);
#pragma unroll
  for (int i = 0; i < 16384; ++i) v = __fmaf_rn(v, 1.0001f, static_cast<float>(i) * 0.5f);
  if (v == 12345.0f) out[0] = v;
}

void Run(const Case& c, int64_t tokens, uint8_t* evict, size_t evict_bytes, cudaStream_t stream) {
  const int64_t slices = jax_moe::DecodeRouteSlices(c.hidden);
  const int64_t blocks = (c.experts + 63) / 64 * slices * ((tokens + 7) / 8);
  if (!jax_moe::DecodeRouteFits(tokens, c.hidden, c.experts, c.top_k, c.n_group, c.topk_group) ||
      blocks > jax_moe_bench::kMaxBlocks) {
    printf("%-12s T=%ld: does not fit the kernel\n", c.name, static_cast<long>(tokens));
    return;
  }
  auto router = Upload(ToBf16(Draw(c.hidden * c.experts, 7, 1.0f / 45.0f)));
  auto x = Upload(ToBf16(Draw(tokens * c.hidden, 11, 1.7f)));
  auto bias = Upload(Draw(c.experts, 13, 0.125f));
  float *partials, *logits, *weights;
  int32_t *ids, *counter;
  CK(cudaMalloc(&partials, slices * tokens * c.experts * sizeof(float)));
  CK(cudaMalloc(&logits, tokens * c.experts * sizeof(float)));
  CK(cudaMalloc(&weights, tokens * c.top_k * sizeof(float)));
  CK(cudaMalloc(&ids, tokens * c.top_k * sizeof(int32_t)));
  CK(cudaMalloc(&counter, sizeof(int32_t)));
  CK(cudaMemset(counter, 0, sizeof(int32_t)));
  DecodeRouteArgs a{};
  a.x = x, a.router = router, a.bias = c.bias ? bias : nullptr, a.partials = partials, a.logits = logits;
  a.topk_weights = weights, a.topk_ids = ids, a.counter = counter;
  a.num_tokens = tokens, a.hidden = c.hidden, a.num_experts = c.experts, a.top_k = c.top_k;
  a.sigmoid = c.sigmoid, a.renormalize = c.renormalize, a.renormalize_epsilon = c.epsilon, a.scaling = c.scaling;
  a.n_group = c.n_group, a.topk_group = c.topk_group;

  const double warm_us = jax_moe::GraphMicroseconds(stream, 20, 21, [&] { CK(jax_moe::LaunchDecodeRoute(a, stream)); });

  // Cold: L2 overwritten before each launch; events around the launch alone.
  constexpr int kCold = 30;
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  std::vector<float> cold_ms, code_cold_ms;
  std::vector<double> phase_ns(kRoutePhases, 0.0), phase_cycles(kRoutePhases, 0.0);
  double counted_in_median_ns = 0, counted_in_max_ns = 0, last_arrival_ns = 0, block_work_ns = 0;
  for (int r = 0; r < 2 * kCold; ++r) {
    const bool code_cold = r >= kCold;  // the phases: of these launches
    std::vector<unsigned long long> t(jax_moe_bench::kMaxBlocks * jax_moe_bench::kMarks, 0);
    // Zero the marks: this launch's last block may not be the previous one's.
    CK(cudaMemcpyToSymbol(jax_moe_bench::g_time, t.data(), t.size() * sizeof(t[0])));
    CK(cudaMemsetAsync(evict, r & 0xff, evict_bytes, stream));
    if (code_cold) EvictCode<<<264, 128, 0, stream>>>(reinterpret_cast<float*>(evict), static_cast<float>(r));
    CK(cudaEventRecord(start, stream));
    CK(jax_moe::LaunchDecodeRoute(a, stream));
    CK(cudaEventRecord(stop, stream));
    CK(cudaEventSynchronize(stop));
    float ms;
    CK(cudaEventElapsedTime(&ms, start, stop));
    (code_cold ? code_cold_ms : cold_ms).push_back(ms);
    if (!code_cold) continue;
    std::vector<long long> clk(t.size());
    CK(cudaMemcpyFromSymbol(t.data(), jax_moe_bench::g_time, t.size() * sizeof(t[0])));
    CK(cudaMemcpyFromSymbol(clk.data(), jax_moe_bench::g_clock, clk.size() * sizeof(clk[0])));
    auto at = [&](int64_t b, int m) { return t[b * jax_moe_bench::kMarks + m]; };
    unsigned long long first = ~0ull;
    int64_t last = -1;
    for (int64_t b = 0; b < blocks; ++b) first = std::min(first, at(b, 0));
    std::vector<double> counted_in;
    for (int64_t b = 0; b < blocks; ++b) {
      counted_in.push_back(static_cast<double>(at(b, 2) - first));
      block_work_ns += static_cast<double>(at(b, 1) - at(b, 0)) / blocks;
      if (at(b, 7) >= at(b, 2) && at(b, 3) >= at(b, 2) && (last < 0 || at(b, 7) > at(last, 7))) last = b;
    }
    std::sort(counted_in.begin(), counted_in.end());
    counted_in_median_ns += counted_in[counted_in.size() / 2];
    counted_in_max_ns += counted_in.back();
    if (last >= 0) {
      last_arrival_ns += static_cast<double>(at(last, 2) - first);
      for (int m = 3; m < jax_moe_bench::kMarks; ++m) {
        phase_ns[m - 3] += static_cast<double>(at(last, m) - at(last, m - 1));
        phase_cycles[m - 3] += static_cast<double>(clk[last * jax_moe_bench::kMarks + m] -
                                                   clk[last * jax_moe_bench::kMarks + m - 1]);
      }
    }
  }
  std::sort(cold_ms.begin(), cold_ms.end());
  std::sort(code_cold_ms.begin(), code_cold_ms.end());

  // Sanity: the counter is back at zero, every token's ids are distinct and in range.
  int32_t count_after;
  std::vector<int32_t> host_ids(tokens * c.top_k);
  CK(cudaMemcpy(&count_after, counter, sizeof(int32_t), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(host_ids.data(), ids, host_ids.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  bool ok = count_after == 0;
  for (int64_t tk = 0; tk < tokens; ++tk)
    for (int64_t j = 0; j < c.top_k; ++j) {
      const int32_t id = host_ids[tk * c.top_k + j];
      ok = ok && id >= 0 && id < c.experts;
      for (int64_t m = 0; m < j; ++m) ok = ok && host_ids[tk * c.top_k + m] != id;
    }

  // The ids', weights' and logits' bits hashed: equal across builds that route the same.
  std::vector<float> host_weights(tokens * c.top_k), host_logits(tokens * c.experts);
  CK(cudaMemcpy(host_weights.data(), weights, host_weights.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(host_logits.data(), logits, host_logits.size() * sizeof(float), cudaMemcpyDeviceToHost));
  Fnv1a results;
  results.Add(host_ids);
  results.Add(host_weights);
  results.Add(host_logits);
  printf("%-12s T=%ld  %ld blocks  warm %6.2f us  cold %6.2f us  code cold too %6.2f us (medians of %d)  %s  fnv %016llx\n",
         c.name, static_cast<long>(tokens), static_cast<long>(blocks), warm_us, cold_ms[kCold / 2] * 1000.0,
         code_cold_ms[kCold / 2] * 1000.0, kCold, ok ? "ids ok" : "BAD IDS OR COUNTER",
         static_cast<unsigned long long>(results.hash));
  printf("    code cold, from the first block's start, ns: products reduced %.0f (a block's mean), counted in %.0f (median) "
         "%.0f (last), the routing block's arrival %.0f\n", block_work_ns / kCold, counted_in_median_ns / kCold,
         counted_in_max_ns / kCold, last_arrival_ns / kCold);
  const char* names[] = {"slices summed", "scores", "group limit", "top k", "weights"};
  printf("    the routing block (code cold), ns (cycles):");
  for (int m = 0; m < kRoutePhases; ++m) printf("  %s %.0f (%.0f)", names[m], phase_ns[m] / kCold, phase_cycles[m] / kCold);
  printf("\n");
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  for (void* p : {static_cast<void*>(router), static_cast<void*>(x), static_cast<void*>(bias),
                  static_cast<void*>(partials), static_cast<void*>(logits), static_cast<void*>(weights),
                  static_cast<void*>(ids), static_cast<void*>(counter)})
    CK(cudaFree(p));
}

// The prefill choice kernel (ChooseExperts, which shares the group limit) at T = 4096, warm (a graph of launches).
void RunChoose(const Case& c, cudaStream_t stream) {
  constexpr int64_t kTokens = 4096;
  if (!jax_moe::ChooseExpertsFits(c.experts, c.top_k, c.n_group, c.topk_group)) return;
  auto choice = Upload(Draw(kTokens * c.experts, 17, 1.0f));
  int32_t* ids;
  CK(cudaMalloc(&ids, kTokens * c.top_k * sizeof(int32_t)));
  jax_moe::ChooseExpertsArgs a{};
  a.choice = choice, a.topk_ids = ids, a.num_tokens = kTokens, a.num_experts = c.experts, a.top_k = c.top_k;
  a.n_group = c.n_group, a.topk_group = c.topk_group;
  const double us = jax_moe::GraphMicroseconds(stream, 20, 21, [&] { CK(jax_moe::LaunchChooseExperts(a, stream)); });
  std::vector<int32_t> host(kTokens * c.top_k);
  CK(cudaMemcpy(host.data(), ids, host.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  Fnv1a chosen;  // the ids' hash: the same in every build
  chosen.Add(host);
  printf("%-12s choose experts T=%ld warm %7.2f us  ids fnv %016llx\n", c.name, static_cast<long>(kTokens), us,
         static_cast<unsigned long long>(chosen.hash));
  CK(cudaFree(choice));
  CK(cudaFree(ids));
}

}  // namespace

int main() {
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  const size_t evict_bytes = size_t{256} << 20;  // past the 50-60 MB L2
  uint8_t* evict;
  CK(cudaMalloc(&evict, evict_bytes));
  for (const Case& c : kCases)
    for (int64_t tokens : {1, 2}) Run(c, tokens, evict, evict_bytes, stream);
  for (const Case& c : kCases) RunChoose(c, stream);
  CK(cudaFree(evict));
  CK(cudaStreamDestroy(stream));
  return 0;
}
