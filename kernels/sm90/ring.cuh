// kernels/sm90/ring.cuh — the weight ring of the GEMMs: a producer's place in a ring of kStages
// shared-memory stages (full/empty mbarriers), and the bulk tensor copies of one K chunk of a CTA's
// prepacked weight row groups and their scales into a stage.
//
// The weight and scale maps are those of gemm_detail::encode_weight_maps (kernels/expert_gemm_common.cuh):
// gated GEMM1 (5-D: word, chunk, group within the half, half, expert), a box of [slots/2 gate groups]
// [slots/2 up groups]; otherwise (4-D: word, chunk, group, expert) `slots` consecutive groups.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "kernels/sm90/copy.cuh"
#include "kernels/sm90/mbarrier.cuh"

namespace fp4moe::kernels::sm90 {

// The producers' place in the ring: the stage of chunk kt and the parity of that stage's `empty`
// barrier's next completion (its first completion is the consumers' release of chunk kt - kStages).
// empty[s] is the mbarrier at bar_base + 8 * (kStages + s).
template <int kStages>
struct RingSlot {
  int stage = 0, phase = 0;
  // Waits until the consumers released the stage; the first kStages chunks find their stages free.
  __device__ __forceinline__ void wait_free(uint32_t bar_base, int kt) const {
    if (kt >= kStages) mbar_wait(bar_base + 8 * (kStages + stage), phase);
  }
  // On to chunk kt + 1.
  __device__ __forceinline__ void advance(int kt) {
    if (++stage == kStages) {
      stage = 0;
      if (kt >= kStages) phase ^= 1;
    }
  }
};

// The two bulk tensor copies of chunk `chunk` of the row groups from group0 (within the half when
// gated: the box spans both halves) of `expert`: weights to w_dst, scales to s_dst, completing on `full`.
__device__ __forceinline__ void copy_weight_chunk(const CUtensorMap* w_map, const CUtensorMap* s_map, uint32_t w_dst,
                                                  uint32_t s_dst, uint32_t full, int chunk, int group0, int expert,
                                                  bool gated) {
  if (gated) {  // (expert, half, group, chunk): slots [gate groups][up groups]
    tma_load_5d(w_dst, w_map, full, 0, chunk, group0, 0, expert);
    tma_load_5d(s_dst, s_map, full, 0, chunk, group0, 0, expert);
  } else {  // (expert, group, chunk): consecutive groups
    tma_load_4d(w_dst, w_map, full, 0, chunk, group0, expert);
    tma_load_4d(s_dst, s_map, full, 0, chunk, group0, expert);
  }
}

}  // namespace fp4moe::kernels::sm90
