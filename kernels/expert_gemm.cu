// kernels/expert_gemm.cu — launchers of the expert GEMMs (the wgmma kernel: kernels/sm90_expert_gemm_wgmma.cuh).
//
//   1. Check the arguments (cudaErrorInvalidValue on anything inconsistent: shapes, the prepacked
//      weights' shape, null or misaligned pointers).
//   2. The tactic picks the kernel (args.tactic): the wgmma kernel with 64-, 128- or 256-token tiles here,
//      the streaming kernel (expert_gemm_stream.cu) for sm90_stream.
//   3. The bulk tensor copy maps of the launch (activations, weights, scales), encoded on the host.
//   4. Grid: max_tiles token tiles x CTAs along N (the CTA's weight rows: 256 with 128-token tiles,
//      128 with 64- and 256-token tiles; GEMM1 gated: half of them intermediate columns), one dimension;
//      CTAs past *num_tiles leave at once.
//   5. One kernel instantiation per tile shape serves GEMM1 (gated or relu2, bf16 or NVFP4 output) and GEMM2.
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <utility>

#include "kernels/expert_gemm_common.cuh"
#include "kernels/sm90_expert_gemm_wgmma.cuh"
#include "kernels/launch.hpp"

namespace fp4moe::kernels {

cudaError_t configure_expert_gemm() {
  // The shared-memory opt-in is set once per device.
  static std::atomic<uint64_t> configured{0};
  return gemm_detail::once_per_device(configured, [] {
    const auto opt_in = [](auto kernel, size_t bytes) {
      return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    };
    // NOTE: the 64-token tile runs two CTAs per SM only with the whole shared-memory carveout.
    const auto max_carveout = [](auto kernel) {
      return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    };
    for (cudaError_t e : {opt_in(sm90gemm::expert_gemm_kernel<64>, sm90gemm::TileConfig<64>::kSmemBytes),
                          max_carveout(sm90gemm::expert_gemm_kernel<64>),
                          opt_in(sm90gemm::expert_gemm_kernel<128>, sm90gemm::TileConfig<128>::kSmemBytes),
                          opt_in(sm90gemm::expert_gemm_kernel<256>, sm90gemm::TileConfig<256>::kSmemBytes)})
      if (e != cudaSuccess) return e;
    return configure_expert_gemm_stream();
  });
}

namespace {

bool wgmma_tactic(const MoeTactic& t) {
  const bool tile_ok = t.tile_tokens == 64 || t.tile_tokens == 128 || t.tile_tokens == 256;
  return t.kernel == GemmKernel::Sm90Wgmma && tile_ok && t.split_k1 == 1 && t.split_k2 == 1;
}
bool stream_tactic(const MoeTactic& t) {
  auto split_ok = [](int s) { return s >= 1 && s <= kMaxStreamSplitK; };
  return t.kernel == GemmKernel::Sm90Stream && gemm_stream_tile_supported(t.tile_tokens) && split_ok(t.split_k1) &&
         split_ok(t.split_k2);
}

// The maps of TmaMaps (kernels/sm90_expert_gemm_wgmma.cuh). Out-of-bounds parts of a box are zero-filled:
// activation columns past K, rows past p.rows, weight row groups past N (or past I when gated).
template <class C>
cudaError_t make_maps(const expert_gemm::Params& p, sm90gemm::TmaMaps& maps) {
  const cuuint64_t act_dims[2] = {static_cast<cuuint64_t>(p.K), static_cast<cuuint64_t>(p.rows)};
  const cuuint64_t act_strides[1] = {static_cast<cuuint64_t>(p.K) * 2};
  const cuuint32_t act_box[2] = {64, static_cast<cuuint32_t>(C::kActBoxRows)};  // 128 B x box rows
  const cuuint32_t act_tile_box[2] = {64, static_cast<cuuint32_t>(C::kTileRows)};  // 128 B x tile rows
  for (auto [map, box] : {std::pair{&maps.act, act_box}, std::pair{&maps.act_tile, act_tile_box}})
    if (cudaError_t e = gemm_detail::encode_map(*map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, p.a, act_dims, act_strides,
                                                box, CU_TENSOR_MAP_SWIZZLE_128B);
        e != cudaSuccess)
      return e;
  return gemm_detail::encode_weight_maps(p, C::kSlots, maps.w, maps.scale);
}

template <int TileTokens>
cudaError_t launch_wgmma(const expert_gemm::Params& p, bool gated_gemm1, int64_t cols, cudaStream_t stream) {
  using C = sm90gemm::TileConfig<TileTokens>;
  const int64_t cols_per_cta = gated_gemm1 ? C::kBlockN / 2 : C::kBlockN;
  const int64_t n_ctas = (cols + cols_per_cta - 1) / cols_per_cta;
  const int64_t ctas = static_cast<int64_t>(p.max_tiles) * n_ctas;
  if (ctas > INT_MAX) return cudaErrorInvalidConfiguration;
  expert_gemm::Params q = p;
  q.n_ctas = static_cast<int>(n_ctas);
  if (cudaError_t e = configure_expert_gemm(); e != cudaSuccess) return e;
  sm90gemm::TmaMaps maps;
  if (cudaError_t e = make_maps<C>(q, maps); e != cudaSuccess) return e;
  return launch_dependent(sm90gemm::expert_gemm_kernel<TileTokens>, dim3(static_cast<unsigned>(ctas)),
                          dim3(sm90gemm::kThreads), C::kSmemBytes, stream, q, maps);
}

// The one place where a tactic becomes a kernel instantiation (the streaming kernel: see the launchers).
cudaError_t launch(const expert_gemm::Params& p, const MoeTactic& t, bool gated_gemm1, int64_t cols, cudaStream_t stream) {
  if (p.max_tiles == 0) return cudaSuccess;
  switch (t.tile_tokens) {
    case 64: return launch_wgmma<64>(p, gated_gemm1, cols, stream);
    case 256: return launch_wgmma<256>(p, gated_gemm1, cols, stream);
    default: return launch_wgmma<128>(p, gated_gemm1, cols, stream);
  }
}

}  // namespace

int gemm_tile_rows() { return sm90gemm::TileConfig<128>::kTileRows; }
int gemm_tile_rows(const MoeTactic& t) { return t.tile_tokens; }

cudaError_t launch_gemm1_act(const Gemm1Args& args, cudaStream_t stream) {
  if (stream_tactic(args.tactic))
    return launch_gemm1_act_stream(args, args.tactic.tile_tokens, args.tactic.split_k1, stream);
  expert_gemm::Params p;
  if (!wgmma_tactic(args.tactic) || args.tile_ready || !gemm_detail::gemm1_params(args, p))
    return cudaErrorInvalidValue;
  return launch(p, args.tactic, p.epilogue == expert_gemm::Epilogue::Gemm1Gated, p.out_cols, stream);
}

cudaError_t launch_gemm2(const Gemm2Args& args, cudaStream_t stream) {
  if (stream_tactic(args.tactic))
    return launch_gemm2_stream(args, args.tactic.tile_tokens, args.tactic.split_k2, stream);
  expert_gemm::Params p;
  // NOTE: the fused top-k finalize (finalize_counters) is the streaming kernel's only.
  // NOTE: the per-tile hand-off (tile_ready, GemmEarlyStart::TileReady) is the streaming kernel's only.
  if (!wgmma_tactic(args.tactic) || args.finalize_counters || args.tile_ready ||
      args.early_start == GemmEarlyStart::TileReady || !gemm_detail::gemm2_params(args, p))
    return cudaErrorInvalidValue;
  return launch(p, args.tactic, false, args.N, stream);
}

}  // namespace fp4moe::kernels
