// The CUTLASS side of the FP8 grouped GEMM: its configurations, the layout of the per-group
// arguments inside the workspace, and one templated runner. The setup kernel (fp8_gemm_kernels.cu)
// writes, per group, the problem shape, the operand and scale pointers, the strides and the scale
// layouts (cute layouts built on the device from the group's rows); then CUTLASS's
// KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise runs. Each configuration is
// instantiated in its own .cu file (fp8_gemm_rows64.cu, fp8_gemm_rows128.cu: they compile in parallel).
#ifndef JAX_MOE_FP8_GEMM_CUTLASS_CUH_
#define JAX_MOE_FP8_GEMM_CUTLASS_CUH_

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
#include "constants.h"
#include "fp8_gemm_kernels.h"
#include "grouped_gemm_kernels.h"

namespace jax_moe {
namespace fp8gemm {

using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
using Shape = ProblemShape::UnderlyingProblemShape;
constexpr int kAlignAB = 16;  // elements of 16 bytes
constexpr int kAlignD = 8;
constexpr int kScaleBlock = static_cast<int>(kFp8ScaleBlock);
// Per row and 128 of K for the rows, per 128 x 128 block for the weights; both K-major: a row's
// scales are contiguous (written by QuantizeRows), the weights' are the checkpoint's [N/128, K/128].
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock, cute::GMMA::Major::K,
                                                               cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
using LayoutA = cutlass::layout::RowMajor;     // rows [M, K]
using LayoutB = cutlass::layout::ColumnMajor;  // w [N, K] read as (N, K), K contiguous
using LayoutD = cutlass::layout::RowMajor;

// One CUTLASS kernel per tile, cluster and schedule. The scales' 128-wide K blocks fix the tile's K
// at 128; the blockwise mainloop keeps two float32 accumulators per warpgroup (the MMA's and the
// scaled sum), so a warpgroup holds at most 64 x 128 of them: 128 rows on two cooperating
// warpgroups, or 64 rows per warpgroup in ping-pong.
template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
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
template <int kRows, class ClusterShape>
using Cooperative = Config<cute::Shape<cute::Int<kRows>, cute::_128, cute::_128>, ClusterShape,
                           cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                           cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
template <int kRows, class ClusterShape>
using Pingpong = Config<cute::Shape<cute::Int<kRows>, cute::_128, cute::_128>, ClusterShape,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
using Cluster1x2 = cute::Shape<cute::_1, cute::_2, cute::_1>;  // two N tiles share the rows' loads
// The library's two: 128 rows (cooperative) or 64 (ping-pong), both with the 1 x 2 cluster (the
// fastest of the configurations tried at prefill shapes).
using Rows128 = Cooperative<128, Cluster1x2>;
using Rows64 = Pingpong<64, Cluster1x2>;
// The per-group arguments the setup kernel writes: the same for every tile and cluster.
using Reference = Cooperative<128, Cluster1x2>;
using StrideA = typename Reference::Kernel::InternalStrideA;
using StrideB = typename Reference::Kernel::InternalStrideB;
using StrideD = typename Reference::Kernel::InternalStrideD;
template <class C>
constexpr bool kSameArguments = std::is_same_v<StrideA, typename C::Kernel::InternalStrideA> &&
                                std::is_same_v<StrideB, typename C::Kernel::InternalStrideB> &&
                                std::is_same_v<StrideD, typename C::Kernel::InternalStrideD>;

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

using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;

// CUTLASS's arguments over the workspace's per-group arrays. The group scheduler walks each group's
// tiles along M first (the tiles sharing one expert's N block run together).
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
  arguments.scheduler.raster_order = RasterOrder::AlongM;
  arguments.scheduler.max_swizzle_size = 1;
  return arguments;
}

template <class C>
cudaError_t RunGemm(const Fp8GroupedGemmArgs& args, int sm_count, void* cutlass_workspace, cudaStream_t stream) {
  static_assert(kSameArguments<C>, "every configuration reads the setup kernel's per-group arguments");
  typename C::Gemm gemm;
  const auto arguments = MakeArguments<typename C::Gemm>(args, sm_count);
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(arguments, cutlass_workspace, stream) != cutlass::Status::kSuccess) return cudaErrorUnknown;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

// One configuration's entry points, defined in its own .cu file:
// Run<Name>(args, sm_count, cutlass_workspace, stream) and <Name>WorkspaceBytes(num_groups), the
// CUTLASS workspace it needs for kGemmMaxSms SMs.
#define JAX_MOE_DEFINE_FP8_GEMM_CONFIG(NAME, CONFIG)                                                  \
  cudaError_t Run##NAME(const Fp8GroupedGemmArgs& args, int sm_count, void* cutlass_workspace,       \
                        cudaStream_t stream) {                                                        \
    return RunGemm<CONFIG>(args, sm_count, cutlass_workspace, stream);                                \
  }                                                                                                   \
  size_t NAME##WorkspaceBytes(int64_t num_groups) {                                                   \
    Fp8GroupedGemmArgs args{};                                                                        \
    args.num_groups = num_groups;                                                                     \
    return CONFIG::Gemm::get_workspace_size(MakeArguments<CONFIG::Gemm>(args, kGemmMaxSms));          \
  }

}  // namespace fp8gemm
}  // namespace jax_moe

#endif  // JAX_MOE_FP8_GEMM_CUTLASS_CUH_
