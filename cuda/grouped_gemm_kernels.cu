// Grouped GEMM launcher: a setup kernel turns expert_offsets into CUTLASS's per-group arguments
// (in the workspace) and zeroes what no group covers; then the CUTLASS kernel of the op runs.
#include <algorithm>
#include <atomic>

#include "grouped_gemm_kernels.h"
#include "grouped_gemm_cutlass.cuh"

namespace jax_moe {
namespace gemm {

// One per (op, tile) configuration, each in its own .cu file (JAX_MOE_DEFINE_GEMM_CONFIG).
#define JAX_MOE_DECLARE_GEMM_CONFIG(NAME)                                                 \
  cudaError_t Run##NAME(const GroupedGemmArgs& args, int sm_count, cudaStream_t stream); \
  size_t NAME##WorkspaceBytes(int64_t num_groups);
JAX_MOE_DECLARE_GEMM_CONFIG(ForwardSmallM)
JAX_MOE_DECLARE_GEMM_CONFIG(ForwardMediumM)
JAX_MOE_DECLARE_GEMM_CONFIG(ForwardLargeM)
JAX_MOE_DECLARE_GEMM_CONFIG(InputGradSmallM)
JAX_MOE_DECLARE_GEMM_CONFIG(InputGradMediumM)
JAX_MOE_DECLARE_GEMM_CONFIG(InputGradLargeM)
JAX_MOE_DECLARE_GEMM_CONFIG(WeightGrad)
#undef JAX_MOE_DECLARE_GEMM_CONFIG

namespace {

constexpr size_t kWorkspaceAlignSlack = 128;  // the handler aligns the workspace up to 128 bytes
constexpr int kSetupThreads = 256;
constexpr int kMaxSetupBlocks = 264;
constexpr int kSetupListedGroups = 1024;  // empty experts a setup block lists at a time

struct SetupParams {
  const Element* a;
  const Element* b;
  const int32_t* expert_offsets;
  Element* out;
  char* workspace;
  int64_t out_rows, num_groups, k, n;
  const int32_t* out_layer;  // GroupedGemmArgs::out_layer and the slice it picks
  int64_t out_layers, out_layer_elements, out_offset;
};

__device__ int64_t Clamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Group g's rows [start, end), clamped to [0, out_rows]: arguments never point outside the
// operands, whatever the offsets hold.
__device__ void GroupRows(const SetupParams& p, int64_t g, int64_t* start, int64_t* end) {
  *start = Clamp(p.expert_offsets[g], 0, p.out_rows);
  *end = Clamp(p.expert_offsets[g + 1], *start, p.out_rows);
}

__device__ void ZeroVectors(Element* begin, int64_t vectors, int64_t thread, int64_t threads) {
  uint4* out = reinterpret_cast<uint4*>(begin);
  for (int64_t i = thread; i < vectors; i += threads) out[i] = make_uint4(0, 0, 0, 0);
}

// Threads first fill one group's arguments each, then all zero what no group covers with 16-byte
// stores (k and n are multiples of 8 bf16): the rows past the last group (forward, input grad),
// or the weight gradient of every expert without rows (CUTLASS would leave a K = 0 problem's
// accumulators unwritten, so such groups get M = 0 and no tiles at all).
template <GemmOp kOp>
__global__ void SetupKernel(SetupParams p) {
  using Strides = OpLayouts<kOp>;
  const WorkspaceLayout layout(p.num_groups);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  Element* const out = p.out_layer == nullptr
                           ? p.out
                           : p.out + Clamp(*p.out_layer, 0, p.out_layers - 1) * p.out_layer_elements + p.out_offset;
  for (int64_t g = thread; g < p.num_groups; g += threads) {
    int64_t start, end;
    GroupRows(p, g, &start, &end);
    const int rows = static_cast<int>(end - start);
    Shape shape;
    const Element *a, *b;
    Element* d;
    typename Strides::StrideA stride_a{};
    typename Strides::StrideB stride_b{};
    StrideD stride_d{};
    if constexpr (kOp == GemmOp::kForward) {  // [rows, K] @ [K, N]
      shape = Shape{rows, static_cast<int>(p.n), static_cast<int>(p.k)};
      a = p.a + start * p.k, b = p.b + g * p.k * p.n, d = out + start * p.n;
      cute::get<0>(stride_a) = p.k, cute::get<1>(stride_b) = p.n, cute::get<0>(stride_d) = p.n;
    } else if constexpr (kOp == GemmOp::kInputGrad) {  // [rows, N] @ [K, N]^T
      shape = Shape{rows, static_cast<int>(p.k), static_cast<int>(p.n)};
      a = p.a + start * p.n, b = p.b + g * p.k * p.n, d = out + start * p.k;
      cute::get<0>(stride_a) = p.n, cute::get<0>(stride_b) = p.n, cute::get<0>(stride_d) = p.k;
    } else {  // [rows, K]^T @ [rows, N]
      shape = Shape{rows > 0 ? static_cast<int>(p.k) : 0, static_cast<int>(p.n), rows};
      a = p.a + start * p.k, b = p.b + start * p.n, d = out + g * p.k * p.n;
      cute::get<1>(stride_a) = p.k, cute::get<1>(stride_b) = p.n, cute::get<0>(stride_d) = p.n;
    }
    reinterpret_cast<Shape*>(p.workspace + layout.shapes)[g] = shape;
    reinterpret_cast<const Element**>(p.workspace + layout.ptr_a)[g] = a;
    reinterpret_cast<const Element**>(p.workspace + layout.ptr_b)[g] = b;
    reinterpret_cast<Element**>(p.workspace + layout.ptr_d)[g] = d;
    reinterpret_cast<typename Strides::StrideA*>(p.workspace + layout.stride_a)[g] = stride_a;
    reinterpret_cast<typename Strides::StrideB*>(p.workspace + layout.stride_b)[g] = stride_b;
    reinterpret_cast<StrideD*>(p.workspace + layout.stride_d)[g] = stride_d;
  }
  if constexpr (kOp == GemmOp::kWeightGrad) {
    // Each block lists the empty experts once (usually none), then all its threads zero them: no
    // thread walks every expert's offsets (that walk alone took ~20 us per call at 128 experts).
    __shared__ int empty[kSetupListedGroups];
    __shared__ int num_empty;
    for (int64_t first = 0; first < p.num_groups; first += kSetupListedGroups) {
      const int64_t last = first + kSetupListedGroups < p.num_groups ? first + kSetupListedGroups : p.num_groups;
      if (threadIdx.x == 0) num_empty = 0;
      __syncthreads();
      for (int64_t g = first + threadIdx.x; g < last; g += blockDim.x) {
        int64_t start, end;
        GroupRows(p, g, &start, &end);
        if (end == start) empty[atomicAdd(&num_empty, 1)] = static_cast<int>(g - first);
      }
      __syncthreads();
      for (int i = 0; i < num_empty; ++i)
        ZeroVectors(out + (first + empty[i]) * p.k * p.n, p.k * p.n / 8, thread, threads);
      __syncthreads();  // before the next chunk resets the list
    }
  } else {
    const int64_t width = kOp == GemmOp::kForward ? p.n : p.k;
    const int64_t live = Clamp(p.expert_offsets[p.num_groups], 0, p.out_rows);
    ZeroVectors(out + live * width, (p.out_rows - live) * width / 8, thread, threads);
  }
}


using GemmRunner = cudaError_t (*)(const GroupedGemmArgs&, int, cudaStream_t);

// One op's configuration for a tile (checked by IsGemmTile first).
GemmRunner ByTile(GemmTile tile, GemmRunner small, GemmRunner medium, GemmRunner large) {
  return tile == GemmTile::kLargeM ? large : tile == GemmTile::kMediumM ? medium : small;
}

template <GemmOp kOp>
cudaError_t LaunchSetup(const GroupedGemmArgs& args, cudaStream_t stream) {
  SetupParams setup{static_cast<const Element*>(args.a), static_cast<const Element*>(args.b), args.expert_offsets,
                    static_cast<Element*>(args.out), static_cast<char*>(args.workspace), args.out_rows,
                    args.num_groups, args.k, args.n, args.out_layer, args.out_layers,
                    args.out_layer_elements, args.out_offset};
  // Enough threads for the zeroing the op may need (its extent is known only on the device).
  const int64_t zeroed = kOp == GemmOp::kWeightGrad ? args.k * args.n
                                                    : args.out_rows * (kOp == GemmOp::kForward ? args.n : args.k);
  const int64_t work = std::max(args.num_groups, zeroed / 8);
  const int blocks =
      static_cast<int>(std::clamp<int64_t>((work + kSetupThreads - 1) / kSetupThreads, 1, kMaxSetupBlocks));
  SetupKernel<kOp><<<blocks, kSetupThreads, 0, stream>>>(setup);
  return cudaGetLastError();
}

}  // namespace
}  // namespace gemm

int GemmSmCount() {
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

size_t GroupedGemmWorkspaceBytes(int64_t num_groups) {
  using namespace gemm;
  return kWorkspaceAlignSlack + WorkspaceLayout(num_groups).cutlass +
         std::max({ForwardSmallMWorkspaceBytes(num_groups), ForwardMediumMWorkspaceBytes(num_groups),
                   ForwardLargeMWorkspaceBytes(num_groups), InputGradSmallMWorkspaceBytes(num_groups),
                   InputGradMediumMWorkspaceBytes(num_groups), InputGradLargeMWorkspaceBytes(num_groups),
                   WeightGradWorkspaceBytes(num_groups)});
}

cudaError_t LaunchGroupedGemm(const GroupedGemmArgs& args, cudaStream_t stream) {
  using namespace gemm;
  if (args.workspace_bytes + kWorkspaceAlignSlack < GroupedGemmWorkspaceBytes(args.num_groups) ||
      reinterpret_cast<uintptr_t>(args.workspace) % 128 != 0 || args.k % kGemmAlignElements != 0 ||
      args.n % kGemmAlignElements != 0 || args.num_groups < 1)
    return cudaErrorInvalidValue;
  const int sm_count = GemmSmCount();
  if (sm_count <= 0) return cudaErrorInvalidDevice;
  if (!IsGemmTile(static_cast<int64_t>(args.tile))) return cudaErrorInvalidValue;
  if (args.out_layer != nullptr && !OutSliceFits(args)) return cudaErrorInvalidValue;
  cudaError_t status = cudaSuccess;
  switch (args.op) {
    case GemmOp::kForward:
      status = LaunchSetup<GemmOp::kForward>(args, stream);
      if (status != cudaSuccess) return status;
      return ByTile(args.tile, RunForwardSmallM, RunForwardMediumM, RunForwardLargeM)(args, sm_count, stream);
    case GemmOp::kInputGrad:
      status = LaunchSetup<GemmOp::kInputGrad>(args, stream);
      if (status != cudaSuccess) return status;
      return ByTile(args.tile, RunInputGradSmallM, RunInputGradMediumM, RunInputGradLargeM)(args, sm_count, stream);
    case GemmOp::kWeightGrad:
      status = LaunchSetup<GemmOp::kWeightGrad>(args, stream);
      if (status != cudaSuccess) return status;
      return RunWeightGrad(args, sm_count, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_moe
