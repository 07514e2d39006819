// Grouped GEMM launcher: a setup kernel turns expert_offsets into CUTLASS's per-group arguments
// (in the workspace) and zeroes the output rows of no group; then the CUTLASS kernel runs.
#include <algorithm>
#include <atomic>

#include "grouped_gemm.h"
#include "grouped_gemm_impl.cuh"

namespace jax_moe {
namespace gemm {

cudaError_t RunSmallM(const GroupedGemmArgs& args, int sm_count, cudaStream_t stream);
cudaError_t RunLargeM(const GroupedGemmArgs& args, int sm_count, cudaStream_t stream);
size_t SmallMWorkspaceBytes(int64_t num_groups);
size_t LargeMWorkspaceBytes(int64_t num_groups);

namespace {

constexpr int kSetupThreads = 256;
constexpr int kMaxSetupBlocks = 264;

struct SetupParams {
  const Element* rows;
  const Element* weights;
  const int32_t* expert_offsets;
  Element* out;
  char* workspace;
  int64_t out_rows, num_groups, k, n;
};

__device__ int64_t Clamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Threads first fill one group's arguments each, then all zero the rows past the last group with
// 16-byte stores (n is a multiple of 8 bf16). Offsets are clamped to [0, out_rows], so arguments
// never point outside rows or out, whatever the offsets hold.
__global__ void SetupKernel(SetupParams p) {
  const WorkspaceLayout layout(p.num_groups);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = thread; g < p.num_groups; g += threads) {
    const int64_t start = Clamp(p.expert_offsets[g], 0, p.out_rows);
    const int64_t end = Clamp(p.expert_offsets[g + 1], start, p.out_rows);
    reinterpret_cast<Shape*>(p.workspace + layout.shapes)[g] =
        Shape{static_cast<int>(end - start), static_cast<int>(p.n), static_cast<int>(p.k)};
    reinterpret_cast<const Element**>(p.workspace + layout.ptr_a)[g] = p.rows + start * p.k;
    reinterpret_cast<const Element**>(p.workspace + layout.ptr_b)[g] = p.weights + g * p.k * p.n;
    reinterpret_cast<Element**>(p.workspace + layout.ptr_d)[g] = p.out + start * p.n;
    StrideA stride_a{};
    cute::get<0>(stride_a) = p.k;
    StrideB stride_b{};
    cute::get<1>(stride_b) = p.n;
    StrideD stride_d{};
    cute::get<0>(stride_d) = p.n;
    reinterpret_cast<StrideA*>(p.workspace + layout.stride_a)[g] = stride_a;
    reinterpret_cast<StrideB*>(p.workspace + layout.stride_b)[g] = stride_b;
    reinterpret_cast<StrideD*>(p.workspace + layout.stride_d)[g] = stride_d;
  }
  const int64_t live = Clamp(p.expert_offsets[p.num_groups], 0, p.out_rows);
  uint4* tail = reinterpret_cast<uint4*>(p.out + live * p.n);
  const int64_t vectors = (p.out_rows - live) * p.n / 8;
  for (int64_t i = thread; i < vectors; i += threads) tail[i] = make_uint4(0, 0, 0, 0);
}

int SmCount() {
  // One query per device; later calls (also under graph capture) read the cache.
  static std::atomic<int> cache[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  int count = cache[device].load(std::memory_order_relaxed);
  if (count == 0 && cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) {
    cache[device].store(count, std::memory_order_relaxed);
  }
  return std::min(count, kGemmMaxSms);
}

}  // namespace
}  // namespace gemm

size_t GroupedGemmWorkspaceBytes(int64_t num_groups) {
  return gemm::WorkspaceLayout(num_groups).cutlass +
         std::max(gemm::SmallMWorkspaceBytes(num_groups), gemm::LargeMWorkspaceBytes(num_groups));
}

cudaError_t LaunchGroupedGemm(const GroupedGemmArgs& args, cudaStream_t stream) {
  if (args.workspace_bytes < GroupedGemmWorkspaceBytes(args.num_groups) || args.k % kGemmAlignElements != 0 ||
      args.n % kGemmAlignElements != 0 || args.num_groups < 1)
    return cudaErrorInvalidValue;
  const int sm_count = gemm::SmCount();
  if (sm_count <= 0) return cudaErrorInvalidDevice;
  gemm::SetupParams setup{static_cast<const gemm::Element*>(args.rows), static_cast<const gemm::Element*>(args.weights),
                          args.expert_offsets, static_cast<gemm::Element*>(args.out),
                          static_cast<char*>(args.workspace), args.out_rows, args.num_groups, args.k, args.n};
  const int64_t work = std::max(args.num_groups, args.out_rows * args.n / 8);
  const int blocks = static_cast<int>(std::clamp<int64_t>((work + gemm::kSetupThreads - 1) / gemm::kSetupThreads, 1,
                                                          gemm::kMaxSetupBlocks));
  gemm::SetupKernel<<<blocks, gemm::kSetupThreads, 0, stream>>>(setup);
  if (cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
  return args.tile == GemmTile::kLargeM ? gemm::RunLargeM(args, sm_count, stream)
                                        : gemm::RunSmallM(args, sm_count, stream);
}

}  // namespace jax_moe
