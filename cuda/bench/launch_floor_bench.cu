// The latency floor under a decode MoE layer, without XLA and without weights to stream: what an
// empty launch, a launch waiting on one HBM read, the router's and unpermute's publish / count-in /
// last-block reduction, and a grid barrier cost on their own in a CUDA graph, and a two-launch
// "layer" of them (a router-like launch whose last block chooses, then an experts-like launch that
// reads what was chosen and whose last block combines). A layer at T = 1 cannot be faster than
// its weights' read time plus this skeleton's latency.
// Every read is cold: launch i reads its own 540 KB (132 blocks x 4 KB), 400 launches a graph, so a
// replay touches 216 MB and the L2 (about 60 MB) holds none of it from the replay before.
// Built with JAX_MOE_BENCH=ON (cuda/README.md); or on the GPU machine, from the repository root:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a cuda/bench/launch_floor_bench.cu -o /tmp/lfb && /tmp/lfb
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "bench_timing.h"

namespace {

constexpr int kThreads = 256;
constexpr int kLaunches = 400;                          // launches a graph (a replay reads 216 MB)
constexpr int64_t kBlockBytes = kThreads * 16;          // one 16-byte load a thread
constexpr int kMaxBlocks = kThreads;                   // the last block reads one value a thread

struct Sync {
  unsigned arrived;     // the count-in (reset by the last block)
  unsigned generation;  // the grid barrier's generation
  unsigned barrier;     // the grid barrier's arrivals
  unsigned chosen;      // what a "router" launch's last block chose, read by the next launch
  float published[kMaxBlocks];
  float result;
};

// A value no sum of the zeroed buffer takes: stored only if equal to it, so every load stays live.
constexpr float kNever = 1.2345f;

__device__ __forceinline__ void KeepLive(float v, Sync* s) {
  if (threadIdx.x == 0 && v == kNever) s->result = v;
}

__device__ __forceinline__ float ColdRead(const uint4* base) {
  const uint4 v = __ldcs(base + threadIdx.x);
  return __uint_as_float(v.x ^ v.y ^ v.z ^ v.w);
}

// A block's value summed over its threads (so every load is live), in thread 0.
__device__ __forceinline__ float BlockSum(float v) {
  __shared__ float warp_sums[kThreads / 32];
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(~0u, v, d);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  float sum = 0.0f;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) sum += warp_sums[w];
  return sum;
}

// Publish thread 0's value, count the block in; the last block sums everything published.
// Returns true in the last block (its sum in s->result).
__device__ __forceinline__ bool CountIn(float value, Sync* s) {
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    s->published[blockIdx.x] = value;
    __threadfence();
    is_last = atomicAdd(&s->arrived, 1) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return false;
  __threadfence();
  // Thread b reads block b's value (the loads in parallel, as the router's last block reads its sums).
  const float sum = BlockSum(threadIdx.x < gridDim.x ? __ldcg(&s->published[threadIdx.x]) : 0.0f);
  if (threadIdx.x == 0) {
    s->result = sum;
    s->arrived = 0;  // for the next launch (stream order publishes it)
  }
  return true;
}

__global__ void Empty() {}

__global__ void __launch_bounds__(kThreads) Read(const uint4* src, Sync* s) {
  KeepLive(BlockSum(ColdRead(src + blockIdx.x * (kBlockBytes / 16))), s);
}

__global__ void __launch_bounds__(kThreads) ReadCountIn(const uint4* src, Sync* s) {
  CountIn(BlockSum(ColdRead(src + blockIdx.x * (kBlockBytes / 16))), s);
}

// A cold read, a grid barrier (every block resident: one a SM), a second cold read.
__global__ void __launch_bounds__(kThreads) ReadBarrierRead(const uint4* src, const uint4* src2, Sync* s) {
  const float v = BlockSum(ColdRead(src + blockIdx.x * (kBlockBytes / 16)));
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned generation = *reinterpret_cast<volatile unsigned*>(&s->generation);
    __threadfence();
    if (atomicAdd(&s->barrier, 1) == gridDim.x - 1) {
      s->barrier = 0;
      __threadfence();
      atomicAdd(&s->generation, 1);
    } else {
      while (*reinterpret_cast<volatile unsigned*>(&s->generation) == generation) {
      }
    }
    __threadfence();
  }
  __syncthreads();
  KeepLive(v + BlockSum(ColdRead(src2 + blockIdx.x * (kBlockBytes / 16))), s);
}

// The router-like launch: cold read, count in; the last block "chooses" (writes a word).
__global__ void __launch_bounds__(kThreads) RouterLike(const uint4* src, Sync* s) {
  if (CountIn(BlockSum(ColdRead(src + blockIdx.x * (kBlockBytes / 16))), s) && threadIdx.x == 0)
    s->chosen = static_cast<unsigned>(s->result != kNever);  // 1, known only now
}

// The experts-like launch: read the choice, then a cold read at a place it decides, count in; the
// last block "combines".
__global__ void __launch_bounds__(kThreads) ExpertsLike(const uint4* src, Sync* s) {
  const unsigned chosen = __ldcg(&s->chosen);
  CountIn(BlockSum(ColdRead(src + (blockIdx.x * chosen) * (kBlockBytes / 16))), s);
}

}  // namespace

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int blocks = sms < kMaxBlocks ? sms : kMaxBlocks;
  const int64_t launch_bytes = blocks * kBlockBytes;
  const int64_t bytes = launch_bytes * (2 * kLaunches + 2);  // two reads a launch at most
  uint4* src;
  Sync* s;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMemset(src, 0, bytes));
  CK(cudaMalloc(&s, sizeof(Sync)));
  CK(cudaMemset(s, 0, sizeof(Sync)));
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  auto at = [&](int64_t i) { return src + i * (launch_bytes / 16); };
  constexpr int kRepeats = 20;
  int i = 0;  // the launch being captured
  const double empty1 = jax_moe::GraphMicroseconds(stream, kLaunches, kRepeats, [&] { Empty<<<1, 32, 0, stream>>>(); });
  const double empty = jax_moe::GraphMicroseconds(stream, kLaunches, kRepeats,
                                                  [&] { Empty<<<blocks, kThreads, 0, stream>>>(); });
  i = 0;
  const double read = jax_moe::GraphMicroseconds(stream, kLaunches, kRepeats,
                                                 [&] { Read<<<blocks, kThreads, 0, stream>>>(at(i++), s); });
  i = 0;
  const double count_in = jax_moe::GraphMicroseconds(
      stream, kLaunches, kRepeats, [&] { ReadCountIn<<<blocks, kThreads, 0, stream>>>(at(i++), s); });
  i = 0;
  const double barrier = jax_moe::GraphMicroseconds(stream, kLaunches / 2, kRepeats, [&] {
    ReadBarrierRead<<<blocks, kThreads, 0, stream>>>(at(i), at(i + 1), s);
    i += 2;
  });
  i = 0;
  const double layer = jax_moe::GraphMicroseconds(stream, kLaunches / 2, kRepeats, [&] {
    RouterLike<<<blocks, kThreads, 0, stream>>>(at(i), s);
    ExpertsLike<<<blocks, kThreads, 0, stream>>>(at(i + 1), s);
    i += 2;
  });
  CK(cudaDeviceSynchronize());
  std::printf("launch floor, %d SMs, %d-thread blocks, a CUDA graph of back-to-back launches (us a launch):\n",
              blocks, kThreads);
  std::printf("  empty, 1 block                          %6.2f\n", empty1);
  std::printf("  empty, %d blocks                       %6.2f\n", blocks, empty);
  std::printf("  one cold 16-byte load a thread           %6.2f  (+%.2f over empty)\n", read, read - empty);
  std::printf("  cold load + publish, count in, last sums %6.2f  (+%.2f over the load)\n", count_in,
              count_in - read);
  std::printf("  cold load, grid barrier, cold load       %6.2f  (+%.2f over one load)\n", barrier, barrier - read);
  std::printf("  router-like + experts-like launches      %6.2f  (a layer's skeleton: two dependent count-ins)\n",
              layer);
  CK(cudaFree(src));
  CK(cudaFree(s));
  return 0;
}
