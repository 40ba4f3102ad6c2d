// kernels/expert_gemm_stream.cu — launchers of the streaming expert GEMM
// (kernels/sm90_expert_gemm_stream.cuh, GemmKernel::Sm90Stream).
//
//   1. Check the arguments as launch_gemm1_act / launch_gemm2 do (cudaErrorInvalidValue), plus
//      tile_rows in {16, 32}, split_k in [1, kMaxStreamSplitK] and, for split_k > 1, the workspace; the
//      early start (GemmEarlyStart) is one of its modes (TileReady: GEMM2, with tile_ready and its count).
//   2. The bulk tensor copy maps of the weights and scales (16 row groups per box), encoded on the host.
//   3. Grid (1-D): max_tiles tiles x split_k x CTAs along N (128 weight rows; gated GEMM1: 64
//      intermediate columns), 256 threads, StreamTile<>::kSmemBytes of dynamic shared memory (opted in
//      once per device by configure_expert_gemm_stream); CTAs past *num_tiles leave.
//   4. Six instantiations: the gated GEMM1, the plain (relu2) GEMM1 (either with bf16 or NVFP4 output,
//      at run time) and GEMM2, for each tile size.
// Workspace (split_k > 1): [counters: outs int32, padded to 256 B][partials: outs * split_k * 8 / 16
// KiB], outs = max_tiles * ceil(N / 128).
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "kernels/expert_gemm_common.cuh"
#include "kernels/sm90_expert_gemm_stream.cuh"
#include "kernels/launch.hpp"

namespace fp4moe::kernels {
namespace {

using gemm_detail::aligned;
namespace ss = sm90stream;

int64_t n_ctas_of(int64_t N_rows) { return (N_rows + ss::kRowsPerCta - 1) / ss::kRowsPerCta; }
int64_t counter_bytes(int64_t outs) { return (outs * 4 + 255) / 256 * 256; }

// split_k and the workspace; fills the split fields of sp.
bool split_valid(const ExpertGemmArgs& a, int split_k, ss::StreamParams& sp) {
  if (split_k < 1 || split_k > kMaxStreamSplitK) return false;
  sp.split_k = split_k;
  sp.chunks_per_split = (sp.base.chunks + split_k - 1) / split_k;
  sp.counters = nullptr;
  sp.partials = nullptr;
  if (split_k == 1 || a.max_tiles == 0) return true;
  if (!a.split_workspace || !aligned(a.split_workspace, 16)) return false;
  const int64_t outs = a.max_tiles * n_ctas_of(a.N);
  sp.counters = static_cast<int32_t*>(a.split_workspace);
  sp.partials = reinterpret_cast<float*>(static_cast<uint8_t*>(a.split_workspace) + counter_bytes(outs));
  return true;
}

// The early start (GemmEarlyStart) and the per-tile hand-off into sp; false for a value that is none of
// the modes, TileReady on GEMM1 or without its counts, tile_ready on a GEMM2 that does not wait for it.
bool early_valid(const ExpertGemmArgs& a, bool gemm2, ss::StreamParams& sp) {
  sp.early = a.early_start;
  sp.tile_ready = a.tile_ready;
  sp.tile_ready_count = a.tile_ready_count;
  if (a.early_start == GemmEarlyStart::TileReady)
    return gemm2 && a.tile_ready != nullptr && aligned(a.tile_ready, 4) && a.tile_ready_count >= 1;
  if (gemm2 && a.tile_ready != nullptr) return false;
  return a.early_start == GemmEarlyStart::AfterWait || a.early_start == GemmEarlyStart::TileTable;
}

int64_t partial_floats(int tile_rows) {
  return tile_rows == 32 ? ss::StreamTile<32>::kPartialFloats : ss::StreamTile<16>::kPartialFloats;
}

// The one place where a streaming tactic's tile size and the GEMM's op (sp.base.epilogue) become a
// kernel instantiation.
template <expert_gemm::Epilogue kOp>
cudaError_t launch_op(ss::StreamParams sp, int tile_rows, cudaStream_t stream) {
  if (sp.base.max_tiles == 0) return cudaSuccess;
  const int64_t n_ctas = n_ctas_of(sp.base.N);
  const int64_t ctas = static_cast<int64_t>(sp.base.max_tiles) * sp.split_k * n_ctas;
  if (ctas > INT_MAX) return cudaErrorInvalidConfiguration;
  sp.base.n_ctas = static_cast<int>(n_ctas);
  if (cudaError_t e = configure_expert_gemm_stream(); e != cudaSuccess) return e;
  ss::StreamMaps maps;
  if (cudaError_t e = gemm_detail::encode_weight_maps(sp.base, ss::kGroupsPerCta, maps.w, maps.scale); e != cudaSuccess)
    return e;
  const dim3 grid(static_cast<unsigned>(ctas)), block(ss::kThreads);
  if (tile_rows == 32)
    return launch_dependent(ss::expert_gemm_stream_kernel<kOp, 32>, grid, block, ss::StreamTile<32>::kSmemBytes,
                            stream, sp, maps);
  return launch_dependent(ss::expert_gemm_stream_kernel<kOp, 16>, grid, block, ss::StreamTile<16>::kSmemBytes,
                          stream, sp, maps);
}

cudaError_t launch(const ss::StreamParams& sp, int tile_rows, cudaStream_t stream) {
  using expert_gemm::Epilogue;
  switch (sp.base.epilogue) {
    case Epilogue::Gemm1Gated: return launch_op<Epilogue::Gemm1Gated>(sp, tile_rows, stream);
    case Epilogue::Gemm1Plain: return launch_op<Epilogue::Gemm1Plain>(sp, tile_rows, stream);
    case Epilogue::Gemm2: return launch_op<Epilogue::Gemm2>(sp, tile_rows, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t configure_expert_gemm_stream() {
  // The shared-memory opt-in (> 48 KiB of dynamic shared memory) is set once per device.
  static std::atomic<uint64_t> configured{0};
  return gemm_detail::once_per_device(configured, [] {
    const auto opt_in = [](auto kernel, int bytes) {
      return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    };
    using expert_gemm::Epilogue;
    constexpr int k16 = ss::StreamTile<16>::kSmemBytes, k32 = ss::StreamTile<32>::kSmemBytes;
    for (cudaError_t e : {opt_in(ss::expert_gemm_stream_kernel<Epilogue::Gemm1Gated, 16>, k16),
                          opt_in(ss::expert_gemm_stream_kernel<Epilogue::Gemm1Plain, 16>, k16),
                          opt_in(ss::expert_gemm_stream_kernel<Epilogue::Gemm2, 16>, k16),
                          opt_in(ss::expert_gemm_stream_kernel<Epilogue::Gemm1Gated, 32>, k32),
                          opt_in(ss::expert_gemm_stream_kernel<Epilogue::Gemm1Plain, 32>, k32),
                          opt_in(ss::expert_gemm_stream_kernel<Epilogue::Gemm2, 32>, k32)})
      if (e != cudaSuccess) return e;
    return cudaSuccess;
  });
}

bool gemm_stream_tile_supported(int tile_rows) { return tile_rows == 16 || tile_rows == 32; }

size_t gemm_stream_workspace_bytes(int64_t max_tiles, int64_t N_rows, int tile_rows, int split_k) {
  if (split_k <= 1 || max_tiles <= 0 || N_rows <= 0 || !gemm_stream_tile_supported(tile_rows)) return 0;
  const int64_t outs = max_tiles * n_ctas_of(N_rows);
  return static_cast<size_t>(counter_bytes(outs) + outs * split_k * partial_floats(tile_rows) * 4);
}

size_t gemm_stream_counter_bytes(int64_t max_tiles, int64_t N_rows) {
  if (max_tiles <= 0 || N_rows <= 0) return 0;
  return static_cast<size_t>(counter_bytes(max_tiles * n_ctas_of(N_rows)));
}

cudaError_t launch_gemm1_act_stream(const Gemm1Args& args, int tile_rows, int split_k, cudaStream_t stream) {
  ss::StreamParams sp{};
  if (!gemm_stream_tile_supported(tile_rows) || !gemm_detail::gemm1_params(args, sp.base) ||
      !split_valid(args, split_k, sp) || !early_valid(args, false, sp))
    return cudaErrorInvalidValue;
  return launch(sp, tile_rows, stream);
}

cudaError_t launch_gemm2_stream(const Gemm2Args& args, int tile_rows, int split_k, cudaStream_t stream) {
  ss::StreamParams sp{};
  if (!gemm_stream_tile_supported(tile_rows) || !gemm_detail::gemm2_params(args, sp.base) ||
      !split_valid(args, split_k, sp) || !early_valid(args, true, sp))
    return cudaErrorInvalidValue;
  return launch(sp, tile_rows, stream);
}

}  // namespace fp4moe::kernels
