// kernels/sm90/mbarrier.cuh — shared-memory mbarriers (PTX ISA mbarrier, shared::cta), by 32-bit
// shared address: the full/empty barriers of the GEMMs' rings.
#pragma once

#include <cstdint>

namespace fp4moe::kernels::sm90 {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// After the initialising thread's mbar_init calls: the barriers are visible to the async proxy (TMA).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Waits until the phase of the given parity has completed.
// NOTE: the retry loop lives inside the asm block (labels are local to its braces): the C++ loop around
// a try_wait made ptxas wrap every wait in BSSY/BSYNC with a YIELD, ~4 of the ~21 loop-control
// instructions per chunk of the streaming GEMM (SASS).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// One arrival that also expects `bytes` of asynchronous copies (complete_tx) in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

}  // namespace fp4moe::kernels::sm90
