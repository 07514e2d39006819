// The FP8 grouped GEMM and the rows' quantisation (grouped_gemm_fp8.h); the CUTLASS configurations
// and the setup kernel are in grouped_gemm_fp8_impl.cuh.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "bf16_vector.cuh"
#include "fp8_quantize.cuh"
#include "grouped_gemm.h"
#include "grouped_gemm_fp8.h"
#include "grouped_gemm_fp8_impl.cuh"

namespace jax_moe {
namespace fp8gemm {

// The library's two: 128 rows (cooperative) or 64 (ping-pong), both with the 1 x 2 cluster
// (measured: notebooks/results/bench_gemm_fp8_tiles_h200.md).
using Rows128 = Cooperative<128, Cluster1x2>;
using Rows64 = Pingpong<64, Cluster1x2>;

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
  return args.tile_rows == 64 ? RunGemm<Rows64>(args, sm_count, cutlass_workspace, stream)
                              : RunGemm<Rows128>(args, sm_count, cutlass_workspace, stream);
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
