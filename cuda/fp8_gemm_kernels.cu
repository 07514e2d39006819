// The FP8 grouped GEMM's launcher and setup kernel, and the rows' quantisation (fp8_gemm_kernels.h);
// the CUTLASS configurations are in fp8_gemm_cutlass.cuh, each instantiated in a file of its own.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "bf16_vector.cuh"
#include "fp8_gemm_cutlass.cuh"
#include "fp8_gemm_kernels.h"
#include "fp8_quantize.cuh"
#include "grouped_gemm_kernels.h"

namespace jax_moe {
namespace fp8gemm {

// One per configuration, each in its own .cu file (JAX_MOE_DEFINE_FP8_GEMM_CONFIG).
#define JAX_MOE_DECLARE_FP8_GEMM_CONFIG(NAME)                                                   \
  cudaError_t Run##NAME(const Fp8GroupedGemmArgs& args, int sm_count, void* cutlass_workspace, \
                        cudaStream_t stream);                                                   \
  size_t NAME##WorkspaceBytes(int64_t num_groups);
JAX_MOE_DECLARE_FP8_GEMM_CONFIG(Rows128)
JAX_MOE_DECLARE_FP8_GEMM_CONFIG(Rows64)
#undef JAX_MOE_DECLARE_FP8_GEMM_CONFIG

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


// `thread` indexes the 8-value pieces of the quantised rows, so a group's 16 pieces sit in one half
// warp (QuantizeGroupPiece); lanes past the last group pass zeros and store nothing.
__device__ __forceinline__ void QuantizePiece(const float (&v)[8], int64_t thread, bool live, uint2* q, float* scale) {
  uint2 packed;
  const float s = QuantizeGroupPiece(v, &packed);
  if (!live) return;
  q[thread] = packed;
  if ((thread & 15) == 0) scale[thread >> 4] = s;  // group = row * K / 128 + block: [R, K / 128] row-major
}

// Rows [R, K] bf16, one thread per 16 bytes.
__global__ void QuantizeRowsKernel(const uint4* rows, uint2* q, float* scale, int64_t groups) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool live = (thread >> 4) < groups;
  float v[8];
  Unpack(live ? __ldg(rows + thread) : make_uint4(0, 0, 0, 0), v);
  QuantizePiece(v, thread, live, q, scale);
}

// SwiGLU's activation of hidden [R, 2F] bf16 (gate | up), quantised: thread t owns the activation's
// 8 values t (row t / (F / 8)); silu(gate) * up in float32 rounded to bf16 (the layer's activation,
// jax_moe.gemm.gated_silu), then QuantizePiece. F is a multiple of 128, so no group crosses a row.
__global__ void SwigluQuantizeKernel(const uint4* hidden, uint2* q, float* scale, int64_t groups, int64_t pieces_per_row) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool live = (thread >> 4) < groups;
  const int64_t row = thread / pieces_per_row, piece = thread - row * pieces_per_row;
  const uint4* gate = hidden + row * 2 * pieces_per_row + piece;
  float g[8], u[8];
  Unpack(live ? __ldg(gate) : make_uint4(0, 0, 0, 0), g);
  Unpack(live ? __ldg(gate + pieces_per_row) : make_uint4(0, 0, 0, 0), u);
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(g[i] / (1.0f + expf(-g[i])) * u[i]));
  QuantizePiece(v, thread, live, q, scale);
}

}  // namespace fp8gemm

size_t Fp8GroupedGemmWorkspaceBytes(int64_t num_groups) {
  using namespace fp8gemm;
  return kWorkspaceAlignSlack + WorkspaceLayout(num_groups).cutlass +
         std::max(Rows128WorkspaceBytes(num_groups), Rows64WorkspaceBytes(num_groups));
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
  return args.tile_rows == 64 ? RunRows64(args, sm_count, cutlass_workspace, stream)
                              : RunRows128(args, sm_count, cutlass_workspace, stream);
}

namespace {
// One thread per 8 quantised values (16 per 1 x 128 group), 256 to a block.
cudaError_t QuantizeGrid(int64_t groups, unsigned* blocks) {
  constexpr int64_t kThreads = 256;
  const int64_t n = (groups * 16 + kThreads - 1) / kThreads;
  if (n > 0x7fffffff) return cudaErrorInvalidValue;
  *blocks = static_cast<unsigned>(n);
  return cudaSuccess;
}
}  // namespace

cudaError_t LaunchQuantizeRows(const void* rows, void* q, float* scale, int64_t num_rows, int64_t k,
                               cudaStream_t stream) {
  using namespace fp8gemm;
  if (k % kScaleBlock != 0 || num_rows < 0 || reinterpret_cast<uintptr_t>(rows) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 8 != 0)
    return cudaErrorInvalidValue;
  const int64_t groups = num_rows * (k / kScaleBlock);
  unsigned blocks = 0;
  if (groups == 0) return cudaSuccess;
  if (QuantizeGrid(groups, &blocks) != cudaSuccess) return cudaErrorInvalidValue;
  QuantizeRowsKernel<<<blocks, 256, 0, stream>>>(static_cast<const uint4*>(rows), static_cast<uint2*>(q), scale, groups);
  return cudaGetLastError();
}

cudaError_t LaunchSwigluQuantize(const void* hidden, void* q, float* scale, int64_t num_rows, int64_t ffn,
                                 cudaStream_t stream) {
  using namespace fp8gemm;
  if (ffn % kScaleBlock != 0 || num_rows < 0 || reinterpret_cast<uintptr_t>(hidden) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 8 != 0)
    return cudaErrorInvalidValue;
  const int64_t groups = num_rows * (ffn / kScaleBlock);
  unsigned blocks = 0;
  if (groups == 0) return cudaSuccess;
  if (QuantizeGrid(groups, &blocks) != cudaSuccess) return cudaErrorInvalidValue;
  SwigluQuantizeKernel<<<blocks, 256, 0, stream>>>(static_cast<const uint4*>(hidden), static_cast<uint2*>(q), scale,
                                                   groups, ffn / 8);
  return cudaGetLastError();
}

}  // namespace jax_moe
