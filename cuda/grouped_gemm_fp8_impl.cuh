// The FP8 grouped GEMM's CUTLASS configurations, per-group workspace and setup kernel: shared by
// the library (grouped_gemm_fp8.cu) and the configuration probe (fp8_tile_bench.cu). The setup
// kernel writes, per group, the problem shape, the operand and scale pointers, the strides and the
// scale layouts (cute layouts built on the device from the group's rows); then CUTLASS's
// KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise runs. It defines the setup
// kernel: one translation unit per binary includes it.
#ifndef JAX_MOE_GROUPED_GEMM_FP8_IMPL_CUH_
#define JAX_MOE_GROUPED_GEMM_FP8_IMPL_CUH_

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
// tiles along M first by default (the tiles sharing one expert's N block run together).
template <class Gemm>
typename Gemm::Arguments MakeArguments(const Fp8GroupedGemmArgs& args, int sm_count,
                                       RasterOrder raster = RasterOrder::AlongM, int swizzle = 1) {
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
  arguments.scheduler.raster_order = raster;
  arguments.scheduler.max_swizzle_size = swizzle;
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


template <class C>
cudaError_t RunGemm(const Fp8GroupedGemmArgs& args, int sm_count, void* cutlass_workspace, cudaStream_t stream,
                    RasterOrder raster = RasterOrder::AlongM, int swizzle = 1) {
  static_assert(kSameArguments<C>, "every configuration reads the setup kernel's per-group arguments");
  typename C::Gemm gemm;
  const auto arguments = MakeArguments<typename C::Gemm>(args, sm_count, raster, swizzle);
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(arguments, cutlass_workspace, stream) != cutlass::Status::kSuccess) return cudaErrorUnknown;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

}  // namespace fp8gemm
}  // namespace jax_moe

#endif  // JAX_MOE_GROUPED_GEMM_FP8_IMPL_CUH_
