// What the stand-alone kernel benchmarks (kernel_bench.cu, tile_bench.cu, launch_floor_bench.cu)
// share: a CUDA-status check that exits, and device time per launch from a CUDA graph.
#ifndef JAX_MOE_BENCH_TIMING_H_
#define JAX_MOE_BENCH_TIMING_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                      \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      printf("CUDA %s line %d\n", cudaGetErrorString(e), __LINE__);                \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

namespace jax_moe {

// Microseconds per call of fn(): a graph of `launches` calls replayed `repeats` times on `stream`
// (after one warm-up replay), the median replay divided by `launches`. No host launch overhead.
template <class Fn>
double GraphMicroseconds(cudaStream_t stream, int launches, int repeats, Fn fn) {
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < launches; ++i) fn();
  CK(cudaStreamEndCapture(stream, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaGraphLaunch(exec, stream));
  CK(cudaStreamSynchronize(stream));
  std::vector<float> ms;
  for (int r = 0; r < repeats; ++r) {
    CK(cudaEventRecord(start, stream));
    CK(cudaGraphLaunch(exec, stream));
    CK(cudaEventRecord(stop, stream));
    CK(cudaEventSynchronize(stop));
    float m;
    CK(cudaEventElapsedTime(&m, start, stop));
    ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  return ms[repeats / 2] * 1000.0 / launches;
}

}  // namespace jax_moe

#endif  // JAX_MOE_BENCH_TIMING_H_
