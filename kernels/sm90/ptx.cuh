// kernels/sm90/ptx.cuh — small PTX wrappers of the sm_90a GEMMs: shared-memory addresses, loads and
// stores by 32-bit shared address, proxy fences, named barriers, register reallocation, and the
// gpu-scope atomics and clock of the GEMMs' cross-CTA hand-offs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fp4moe::kernels::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Shared-memory loads by 32-bit shared address (volatile: they stay after the mbarrier wait).
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint64_t lds_u64(uint32_t addr) {
  uint64_t v;
  asm volatile("ld.shared.u64 %0, [%1];" : "=l"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts128_zero(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0u) : "memory");
}
// Keeps x in a register at this point of the program (an empty asm that "modifies" it).
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }

// NOTE: wgmma and bulk copies read shared memory through the async proxy; cp.async and st.shared
// writes are generic-proxy writes, so a fence sits between them: the writer's before it publishes
// (the GEMM2 epilogue: before the barrier that precedes its bulk stores), or the reader's after its
// barrier wait (the gathered GEMM1's cp.async rows: see the wgmma kernel's producer_gather). TMA
// writes need no fence; the streaming kernel's cp.async activation rows are read by ldmatrix, a
// generic-proxy read, so need none either.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Named barrier kId (1..15; 0 is __syncthreads) over kThreads threads (a multiple of 32).
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}

// NOTE: registers are allocated per warpgroup; setmaxnreg moves them between warpgroups (a producer
// warpgroup gives most of its registers to the consumer warpgroups).
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

// ---- gpu-scope ordering -----------------------------------------------------------------------------
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int32_t* address, int value) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(address), "r"(value) : "memory");
  return old;
}
__device__ __forceinline__ void red_add_release_gpu(int32_t* address) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(address) : "memory");
}
__device__ __forceinline__ int ld_acquire_gpu(const int32_t* address) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(address) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace fp4moe::kernels::sm90
