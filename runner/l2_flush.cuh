// runner/l2_flush.cuh — the read L2 flush of `fp4moe bench` and `fp4moe tune` (BenchOptions::l2_flush), also
// used by the standalone microbenchmarks of bench/micro (build lines there).
// A kernel reads a buffer several times the L2's size: the L2 then holds clean lines of that buffer, so
// the weights a timed launch reads are cold in HBM and replacing those lines writes nothing back (a
// memset of the buffer leaves them dirty instead, and their write-back then counts in the layer's time).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fp4moe::l2flush {

// Reads every 16 bytes of p (n of them). NOTE: the sink store depends on every load, so none is
// dropped; it never happens for a buffer that was memset to a byte other than 0xFF.
static __global__ void read_kernel(const uint4* __restrict__ p, size_t n, uint32_t* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    x |= ~(v.x & v.y & v.z & v.w);
  }
  if (x == 0) *sink = 1;
}

// One flush of `bytes` (a multiple of 16) at buf on `stream`; sink: 4 bytes of device memory.
inline void launch_read(const void* buf, size_t bytes, uint32_t* sink, int sm_count, cudaStream_t stream) {
  read_kernel<<<4 * sm_count, 512, 0, stream>>>(static_cast<const uint4*>(buf), bytes / 16, sink);
}

}  // namespace fp4moe::l2flush
