// The FP8 grouped GEMM and the rows' quantisation
// (grouped_gemm_fp8.h). The setup kernel writes, per group, the problem shape, the operand and
// scale pointers, the strides and the scale layouts (cute layouts built on the device from the
// group's rows), then CUTLASS's KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise runs.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "bf16_vector.cuh"
#include "grouped_gemm.h"
#include "grouped_gemm_fp8.h"

namespace jax_moe {
namespace fp8gemm {

using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
using Shape = ProblemShape::UnderlyingProblemShape;
constexpr int kAlignAB = 16;  // elements of 16 bytes
constexpr int kAlignD = 8;
constexpr int kScaleBlock = 128;
// Per row and 128 of K for the rows, per 128 x 128 block for the weights; both K-major: a row's
// scales are contiguous (written by QuantizeRows), the weights' are the checkpoint's [N/128, K/128].
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock, cute::GMMA::Major::K,
                                                               cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
using LayoutA = cutlass::layout::RowMajor;     // rows [M, K]
using LayoutB = cutlass::layout::ColumnMajor;  // w [N, K] read as (N, K), K contiguous
using LayoutD = cutlass::layout::RowMajor;
using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;

// One CUTLASS kernel per row tile: 128 rows on two cooperating warpgroups, or 64 rows per
// warpgroup in ping-pong (less padding when the groups hold a few tens to a few hundred rows).
template <class TileShape, class KernelSchedule, class EpilogueSchedule>
struct Config {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<ElementD, float, void>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
      ElementAB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
using Rows128 = Config<cute::Shape<cute::_128, cute::_128, cute::_128>,
                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
using Rows64 = Config<cute::Shape<cute::_64, cute::_128, cute::_128>,
                      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                      cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
using StrideA = typename Rows128::Kernel::InternalStrideA;
using StrideB = typename Rows128::Kernel::InternalStrideB;
using StrideD = typename Rows128::Kernel::InternalStrideD;
static_assert(std::is_same_v<StrideA, typename Rows64::Kernel::InternalStrideA> &&
                  std::is_same_v<StrideB, typename Rows64::Kernel::InternalStrideB> &&
                  std::is_same_v<StrideD, typename Rows64::Kernel::InternalStrideD>,
              "both tiles read the same per-group arguments");

// Where each per-group array sits in the workspace (fixed by the group count alone).
struct WorkspaceLayout {
  size_t shapes, ptr_a, ptr_b, ptr_sfa, ptr_sfb, ptr_d, stride_a, stride_b, stride_d, layout_sfa, layout_sfb, cutlass;

  CUTLASS_HOST_DEVICE static constexpr size_t Round(size_t bytes) { return (bytes + 127) / 128 * 128; }
  CUTLASS_HOST_DEVICE explicit WorkspaceLayout(int64_t groups) {
    const size_t g = static_cast<size_t>(groups);
    shapes = 0;
    ptr_a = shapes + Round(g * sizeof(Shape));
    ptr_b = ptr_a + Round(g * sizeof(void*));
    ptr_sfa = ptr_b + Round(g * sizeof(void*));
    ptr_sfb = ptr_sfa + Round(g * sizeof(void*));
    ptr_d = ptr_sfb + Round(g * sizeof(void*));
    stride_a = ptr_d + Round(g * sizeof(void*));
    stride_b = stride_a + Round(g * sizeof(StrideA));
    stride_d = stride_b + Round(g * sizeof(StrideB));
    layout_sfa = stride_d + Round(g * sizeof(StrideD));
    layout_sfb = layout_sfa + Round(g * sizeof(LayoutSFA));
    cutlass = layout_sfb + Round(g * sizeof(LayoutSFB));
  }
};

template <class Gemm>
typename Gemm::Arguments MakeArguments(const Fp8GroupedGemmArgs& args, int sm_count) {
  char* base = static_cast<char*>(args.workspace);
  const WorkspaceLayout layout(args.num_groups);
  typename Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(args.num_groups), reinterpret_cast<Shape*>(base + layout.shapes), nullptr},
      {reinterpret_cast<const ElementAB**>(base + layout.ptr_a), reinterpret_cast<StrideA*>(base + layout.stride_a),
       reinterpret_cast<const ElementAB**>(base + layout.ptr_b), reinterpret_cast<StrideB*>(base + layout.stride_b),
       reinterpret_cast<const float**>(base + layout.ptr_sfa), reinterpret_cast<LayoutSFA*>(base + layout.layout_sfa),
       reinterpret_cast<const float**>(base + layout.ptr_sfb), reinterpret_cast<LayoutSFB*>(base + layout.layout_sfb)},
      {{}, nullptr, nullptr, reinterpret_cast<ElementD**>(base + layout.ptr_d),
       reinterpret_cast<StrideD*>(base + layout.stride_d)},
      cutlass::KernelHardwareInfo{0, sm_count}};
  arguments.epilogue.thread.alpha = 1.0f;
  arguments.epilogue.thread.beta = 0.0f;
  return arguments;
}

constexpr size_t kWorkspaceAlignSlack = 128;
constexpr int kSetupThreads = 256;
constexpr int kMaxSetupBlocks = 264;

__device__ int64_t Clamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// One group's arguments per thread, then zeros on the rows past the last group.
__global__ void SetupKernel(Fp8GroupedGemmArgs p) {
  const WorkspaceLayout layout(p.num_groups);
  char* ws = static_cast<char*>(p.workspace);
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t k_blocks = p.k / kScaleBlock, n_blocks = p.n / kScaleBlock;
  for (int64_t g = thread; g < p.num_groups; g += threads) {
    const int64_t start = Clamp(p.expert_offsets[g], 0, p.out_rows);
    const int64_t end = Clamp(p.expert_offsets[g + 1], start, p.out_rows);
    const int rows = static_cast<int>(end - start), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
    reinterpret_cast<Shape*>(ws + layout.shapes)[g] = Shape{rows, n, k};
    reinterpret_cast<const ElementAB**>(ws + layout.ptr_a)[g] = static_cast<const ElementAB*>(p.a) + start * p.k;
    reinterpret_cast<const ElementAB**>(ws + layout.ptr_b)[g] = static_cast<const ElementAB*>(p.b) + g * p.n * p.k;
    reinterpret_cast<const float**>(ws + layout.ptr_sfa)[g] = p.a_scale + start * k_blocks;
    reinterpret_cast<const float**>(ws + layout.ptr_sfb)[g] = p.b_scale + g * n_blocks * k_blocks;
    reinterpret_cast<ElementD**>(ws + layout.ptr_d)[g] = static_cast<ElementD*>(p.out) + start * p.n;
    StrideA stride_a{};
    StrideB stride_b{};
    StrideD stride_d{};
    cute::get<0>(stride_a) = p.k;
    cute::get<0>(stride_b) = p.k;
    cute::get<0>(stride_d) = p.n;
    reinterpret_cast<StrideA*>(ws + layout.stride_a)[g] = stride_a;
    reinterpret_cast<StrideB*>(ws + layout.stride_b)[g] = stride_b;
    reinterpret_cast<StrideD*>(ws + layout.stride_d)[g] = stride_d;
    reinterpret_cast<LayoutSFA*>(ws + layout.layout_sfa)[g] =
        ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(rows, n, k, 1));
    reinterpret_cast<LayoutSFB*>(ws + layout.layout_sfb)[g] =
        ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(rows, n, k, 1));
  }
  const int64_t live = Clamp(p.expert_offsets[p.num_groups], 0, p.out_rows);
  uint4* out = reinterpret_cast<uint4*>(static_cast<ElementD*>(p.out) + live * p.n);
  for (int64_t i = thread; i < (p.out_rows - live) * p.n / 8; i += threads) out[i] = make_uint4(0, 0, 0, 0);
}


// Half a warp per 1 x 128 group of a row: 16 lanes x 8 values, 16-byte loads. Each thread's 8
// values are the thread index's 16 bytes of the rows, so the grid is one thread per 8 values and
// every lane of a warp reaches the shuffles (lanes past the last group load zeros, store nothing).
// The math is jax_moe.fp8.quantize_rows' in IEEE float32 (no FMA, no approximate division), so the
// bytes equal the CPU's: scale = max|x| * (1 / 448), q = rne_satfinite(x * (1 / scale)).
__global__ void QuantizeRowsKernel(const uint4* rows, uint2* q, float* scale, int64_t groups) {
  constexpr float kInvFp8Max = 1.0f / 448.0f;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t group = thread >> 4;
  const bool live = group < groups;
  float v[8], most = 0.0f;
  Unpack(live ? __ldg(rows + thread) : make_uint4(0, 0, 0, 0), v);
#pragma unroll
  for (int i = 0; i < 8; ++i) most = fmaxf(most, fabsf(v[i]));
#pragma unroll
  for (int d = 8; d > 0; d >>= 1) most = fmaxf(most, __shfl_xor_sync(~0u, most, d));
  const float s = most > 0.0f ? __fmul_rn(most, kInvFp8Max) : 1.0f;
  const float inv = __fdiv_rn(1.0f, s);
  uint32_t packed[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = make_float2(__fmul_rn(v[2 * i], inv), __fmul_rn(v[2 * i + 1], inv));
    packed[i / 2] |= static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3)) << (16 * (i % 2));
  }
  if (!live) return;
  q[thread] = make_uint2(packed[0], packed[1]);
  if ((thread & 15) == 0) scale[group] = s;  // group = row * K / 128 + block: [R, K / 128] row-major
}

template <class Gemm>
cudaError_t RunGemm(const Fp8GroupedGemmArgs& args, int sm_count, void* cutlass_workspace, cudaStream_t stream) {
  Gemm gemm;
  const auto arguments = MakeArguments<Gemm>(args, sm_count);
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(arguments, cutlass_workspace, stream) != cutlass::Status::kSuccess) return cudaErrorUnknown;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

}  // namespace fp8gemm

size_t Fp8GroupedGemmWorkspaceBytes(int64_t num_groups) {
  using namespace fp8gemm;
  Fp8GroupedGemmArgs args{};
  args.num_groups = num_groups;
  return kWorkspaceAlignSlack + WorkspaceLayout(num_groups).cutlass +
         std::max(Rows128::Gemm::get_workspace_size(MakeArguments<Rows128::Gemm>(args, kGemmMaxSms)),
                  Rows64::Gemm::get_workspace_size(MakeArguments<Rows64::Gemm>(args, kGemmMaxSms)));
}

cudaError_t LaunchFp8GroupedGemm(const Fp8GroupedGemmArgs& args, cudaStream_t stream) {
  using namespace fp8gemm;
  if (args.k % kScaleBlock != 0 || args.n % kScaleBlock != 0 || args.num_groups < 1 ||
      (args.tile_rows != 64 && args.tile_rows != 128) ||
      reinterpret_cast<uintptr_t>(args.workspace) % 128 != 0 ||
      args.workspace_bytes + kWorkspaceAlignSlack < Fp8GroupedGemmWorkspaceBytes(args.num_groups))
    return cudaErrorInvalidValue;
  const int sm_count = GemmSmCount();
  if (sm_count <= 0) return cudaErrorInvalidDevice;
  const int64_t work = std::max<int64_t>(args.num_groups, args.out_rows * args.n / 8);
  const int blocks = static_cast<int>(std::clamp<int64_t>((work + kSetupThreads - 1) / kSetupThreads, 1, kMaxSetupBlocks));
  SetupKernel<<<blocks, kSetupThreads, 0, stream>>>(args);
  if (cudaGetLastError() != cudaSuccess) return cudaErrorLaunchFailure;
  void* cutlass_workspace = static_cast<char*>(args.workspace) + WorkspaceLayout(args.num_groups).cutlass;
  return args.tile_rows == 64 ? RunGemm<Rows64::Gemm>(args, sm_count, cutlass_workspace, stream)
                              : RunGemm<Rows128::Gemm>(args, sm_count, cutlass_workspace, stream);
}

cudaError_t LaunchQuantizeRows(const void* rows, void* q, float* scale, int64_t num_rows, int64_t k,
                               cudaStream_t stream) {
  using namespace fp8gemm;
  if (k % kScaleBlock != 0 || num_rows < 0 || reinterpret_cast<uintptr_t>(rows) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 8 != 0)
    return cudaErrorInvalidValue;
  const int64_t groups = num_rows * (k / kScaleBlock);
  if (groups == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (groups * 16 + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  QuantizeRowsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint4*>(rows), static_cast<uint2*>(q), scale, groups);
  return cudaGetLastError();
}

}  // namespace jax_moe
