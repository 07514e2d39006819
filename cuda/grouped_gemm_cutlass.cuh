// The CUTLASS side of the grouped GEMMs: operand layouts of each op, the tile configurations, the
// layout of the per-group argument arrays inside the workspace, and one templated runner. Each
// (op, tile) configuration is instantiated in its own .cu file (they compile in parallel).
#ifndef JAX_MOE_GROUPED_GEMM_CUTLASS_CUH_
#define JAX_MOE_GROUPED_GEMM_CUTLASS_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "grouped_gemm_kernels.h"

namespace jax_moe::gemm {

using Element = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
using Shape = ProblemShape::UnderlyingProblemShape;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
constexpr int kAlign = static_cast<int>(kGemmAlignElements);
// Ptr-array strides in CUTLASS's (M, K, L) / (N, K, L) / (M, N, L) views, the batch mode unused:
// one run-time leading dimension each, the other mode contiguous.
using StrideKContiguous = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;   // row-major A, col-major B
using StrideMNContiguous = cute::Stride<cute::Int<1>, int64_t, cute::Int<0>>;  // col-major A, row-major B
using StrideD = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;            // row-major D
static_assert(sizeof(StrideKContiguous) == sizeof(int64_t) && sizeof(StrideMNContiguous) == sizeof(int64_t),
              "the workspace keeps one int64 per group and stride");

// Operand layouts of each op (grouped_gemm_kernels.h): forward rows [M_g, K] @ w[g] [K, N]; input grad
// d_out [M_g, N] @ w[g]^T, where w[g] read as [N, K] is K-contiguous ("column-major B"); weight
// grad rows_g^T [K, M_g] @ d_out_g [M_g, N], whose A is M-contiguous (column-major) and whose
// reduction runs over the group's rows: K differs per group.
template <GemmOp kOp>
struct OpLayouts;
template <>
struct OpLayouts<GemmOp::kForward> {
  using A = RowMajor;
  using B = RowMajor;
  using StrideA = StrideKContiguous;
  using StrideB = StrideMNContiguous;
};
template <>
struct OpLayouts<GemmOp::kInputGrad> {
  using A = RowMajor;
  using B = ColumnMajor;
  using StrideA = StrideKContiguous;
  using StrideB = StrideKContiguous;
};
template <>
struct OpLayouts<GemmOp::kWeightGrad> {
  using A = ColumnMajor;
  using B = RowMajor;
  using StrideA = StrideMNContiguous;
  using StrideB = StrideMNContiguous;
};

// Where each per-group array sits in the workspace: fixed by the group count alone, so the setup
// kernel and the host agree without passing offsets around. The CUTLASS workspace comes last.
struct WorkspaceLayout {
  size_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, cutlass;

  CUTLASS_HOST_DEVICE static constexpr size_t Round(size_t bytes) { return (bytes + 127) / 128 * 128; }
  CUTLASS_HOST_DEVICE explicit WorkspaceLayout(int64_t groups) {
    const size_t g = static_cast<size_t>(groups);
    shapes = 0;
    ptr_a = shapes + Round(g * sizeof(Shape));
    ptr_b = ptr_a + Round(g * sizeof(void*));
    ptr_d = ptr_b + Round(g * sizeof(void*));
    stride_a = ptr_d + Round(g * sizeof(void*));
    stride_b = stride_a + Round(g * sizeof(int64_t));
    stride_d = stride_b + Round(g * sizeof(int64_t));
    cutlass = stride_d + Round(g * sizeof(int64_t));
  }
};

// The epilogue CUTLASS's builder picks for a schedule: D = accumulator rounded to bf16, no C operand.
template <class TileShape, class ClusterShape, class EpilogueSchedule,
          class EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto>
using BuiltEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float, void,
    RowMajor*, kAlign, Element, RowMajor*, kAlign, EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<Element, float, void>>::CollectiveOp;

template <GemmOp kOp, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueOp>
struct Config {
  using LayoutA = typename OpLayouts<kOp>::A;
  using LayoutB = typename OpLayouts<kOp>::B;
  using Epilogue = EpilogueOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename OpLayouts<kOp>::StrideA;
  using StrideB = typename OpLayouts<kOp>::StrideB;
  static_assert(std::is_same_v<typename Kernel::InternalStrideA, StrideA>);
  static_assert(std::is_same_v<typename Kernel::InternalStrideB, StrideB>);
  static_assert(std::is_same_v<typename Kernel::InternalStrideD, StrideD>);
};

using SmallTile = cute::Shape<cute::_64, cute::_128, cute::_64>;
using MediumTile = cute::Shape<cute::_64, cute::_256, cute::_64>;
using LargeTile = cute::Shape<cute::_128, cute::_256, cute::_64>;
using NoCluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
using PairCluster = cute::Shape<cute::_1, cute::_2, cute::_1>;
template <GemmOp kOp>
using SmallM = Config<kOp, SmallTile, NoCluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                      BuiltEpilogue<SmallTile, NoCluster, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>>;
// Each warp group of the ping-pong kernel computes a whole 64 x 256 tile: the cooperative tile's
// per-warp-group work with half its M granularity, so ragged groups of a few hundred rows waste
// about half as many padded rows.
template <GemmOp kOp>
using MediumM = Config<kOp, MediumTile, NoCluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                       BuiltEpilogue<MediumTile, NoCluster, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>>;
template <GemmOp kOp>
using LargeM = Config<kOp, LargeTile, PairCluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                      BuiltEpilogue<LargeTile, PairCluster, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>>;
// The weight gradient writes El*K*N elements from a reduction over only each expert's rows, so its
// epilogue's TMA stores bound it at a few hundred rows per expert: 128 x 64 store tiles instead of
// the builder's 128 x 32 move twice the bytes per store (faster at tens of rows per expert, even
// at hundreds).
using WeightGradM =
    Config<GemmOp::kWeightGrad, LargeTile, PairCluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
           BuiltEpilogue<LargeTile, PairCluster, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
                         cute::Shape<cute::_128, cute::_64>>>;

// CUTLASS arguments over the per-group arrays in the workspace. No host problem shapes: the
// persistent tile scheduler reads the shapes on the device, so the host never learns group sizes.
template <class C>
typename C::Gemm::Arguments MakeArguments(const GroupedGemmArgs& args, int sm_count) {
  char* base = static_cast<char*>(args.workspace);
  const WorkspaceLayout layout(args.num_groups);
  using ElementPtr = const Element*;
  typename C::Gemm::Arguments arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(args.num_groups), reinterpret_cast<Shape*>(base + layout.shapes), nullptr},
      {reinterpret_cast<ElementPtr*>(base + layout.ptr_a), reinterpret_cast<typename C::StrideA*>(base + layout.stride_a),
       reinterpret_cast<ElementPtr*>(base + layout.ptr_b), reinterpret_cast<typename C::StrideB*>(base + layout.stride_b)},
      {{}, nullptr, nullptr, reinterpret_cast<Element**>(base + layout.ptr_d),
       reinterpret_cast<StrideD*>(base + layout.stride_d)},
      cutlass::KernelHardwareInfo{0, sm_count}};
  arguments.epilogue.thread.alpha = 1.0f;
  arguments.epilogue.thread.beta = 0.0f;
  return arguments;
}

// CUTLASS's own workspace (per-SM TMA descriptors and scheduler state) for kGemmMaxSms SMs.
template <class C>
size_t CutlassWorkspaceBytes(int64_t num_groups) {
  GroupedGemmArgs args{};
  args.num_groups = num_groups;
  return C::Gemm::get_workspace_size(MakeArguments<C>(args, kGemmMaxSms));
}

// Launches the GEMM on the arrays the setup kernel wrote. Host work only builds the kernel's
// parameters (TMA descriptors from placeholders); everything launched goes on `stream`.
template <class C>
cudaError_t RunGemm(const GroupedGemmArgs& args, int sm_count, cudaStream_t stream) {
  const WorkspaceLayout layout(args.num_groups);
  typename C::Gemm gemm;
  const auto arguments = MakeArguments<C>(args, sm_count);
  if (C::Gemm::get_workspace_size(arguments) > args.workspace_bytes - layout.cutlass) return cudaErrorInvalidValue;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  void* cutlass_workspace = static_cast<char*>(args.workspace) + layout.cutlass;
  if (gemm.initialize(arguments, cutlass_workspace, stream) != cutlass::Status::kSuccess) return cudaErrorUnknown;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

// One (op, tile) configuration's entry points, defined in its own .cu file:
// Run<Name>(args, sm_count, stream) and <Name>WorkspaceBytes(num_groups).
#define JAX_MOE_DEFINE_GEMM_CONFIG(NAME, CONFIG)                                          \
  cudaError_t Run##NAME(const GroupedGemmArgs& args, int sm_count, cudaStream_t stream) { \
    return RunGemm<CONFIG>(args, sm_count, stream);                                      \
  }                                                                                       \
  size_t NAME##WorkspaceBytes(int64_t num_groups) { return CutlassWorkspaceBytes<CONFIG>(num_groups); }

}  // namespace jax_moe::gemm

#endif  // JAX_MOE_GROUPED_GEMM_CUTLASS_CUH_
