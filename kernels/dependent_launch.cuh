// kernels/dependent_launch.cuh — programmatic dependent launch (PDL, sm_90) for the kernels of one
// forward: each kernel is launched with the programmatic-stream-serialization attribute, so the GPU
// may start launching it while the previous kernel of the stream still runs; the kernel's first
// statement waits (griddepcontrol.wait) until that previous grid has completed and its memory is
// visible, and then allows the next kernel to start launching (griddepcontrol.launch_dependents).
//
// NOTE: the wait comes before any global memory access, so every kernel still sees all of its
// predecessor's writes and no predecessor can still read what it overwrites: the data dependencies
// are those of plain stream order; only the launch latency (a few us per kernel boundary, which at
// decode is a large part of the layer) overlaps the previous kernel's tail. Without the attribute
// (e.g. after an event record) both instructions are no-ops.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace fp4moe::kernels {

// The two halves of the prologue, for a kernel that does work before its wait (the streaming GEMM's
// early start, kernels/launch.hpp GemmEarlyStart): wait until the previous grid has completed and its
// memory is visible; allow the next kernel to start launching.
// NOTE (transitivity): every kernel of a forward allows its successor only after its own wait. So when
// kernel N starts, kernel N-2 has completed: N may read N-2's outputs before its wait, through L2
// (ld.global.cg: never an L1 line cached before N-2 wrote it), but nothing of N-1's.
__device__ __forceinline__ void dependent_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void dependent_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// First statement of every kernel launched with launch_dependent().
__device__ __forceinline__ void dependent_launch_prologue() {
  dependent_wait();
  dependent_trigger();
}

// FP4MOE_PDL=0 (read once per process) launches every kernel without the attribute: plain stream
// order, for measuring what dependent launch gains or costs.
inline bool dependent_launch_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("FP4MOE_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_dependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = dependent_launch_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace fp4moe::kernels
