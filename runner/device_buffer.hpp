// runner/device_buffer.hpp — host-side helpers of the runner's tools (run_case_on_gpu, benchmarks):
// a CUDA error turned into fp4moe::Error, and an owned device allocation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "fp4moe/error.hpp"

namespace fp4moe {

// Throws fp4moe::Error "<context>: <what>: <CUDA error string>" unless e is cudaSuccess.
inline void throw_on_cuda_error(cudaError_t e, const char* context, const char* what) {
  if (e != cudaSuccess) throw Error(detail::concat(context, ": ", what, ": ", cudaGetErrorString(e)));
}

// cudaMalloc'd bytes (at least 1), freed on scope exit; allocation failure throws with `context`.
class DeviceBuffer {
 public:
  DeviceBuffer(size_t bytes, const char* context) {
    throw_on_cuda_error(cudaMalloc(&ptr, bytes ? bytes : 1), context, "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }

  void* ptr = nullptr;
};

}  // namespace fp4moe
