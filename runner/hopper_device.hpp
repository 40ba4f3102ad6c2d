// runner/hopper_device.hpp — the device checks of MoeRunner::create and GpuRouter::create.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "fp4moe/error.hpp"
#include "fp4moe/runner.hpp"

namespace fp4moe {

// Resolves `device` (< 0: the current device) and checks that it is an sm_90 GPU; returns its
// properties. Throws fp4moe::Error beginning with `who` otherwise.
inline cudaDeviceProp require_hopper_device(int& device, const char* who) {
  std::string why;
  check(cuda_device_available(&why), who, ": ", why);
  if (device < 0) check(cudaGetDevice(&device) == cudaSuccess, who, ": cudaGetDevice failed");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device) == cudaSuccess, who, ": no CUDA device ", device);
  check(prop.major == 9 && prop.minor == 0, who, ": device ", device, " (", prop.name, ") has compute capability ",
        prop.major, ".", prop.minor, "; fp4moe's kernels are built for sm_90a (Hopper)");
  return prop;
}

// `device` current for a scope, the caller's device again after it: a constructor's allocations land on
// the object's GPU whatever device the caller has current.
class ScopedDevice {
 public:
  ScopedDevice(int device, const char* who) {
    check(cudaGetDevice(&previous_) == cudaSuccess && cudaSetDevice(device) == cudaSuccess, who, ": cudaSetDevice(",
          device, ") failed");
  }
  ~ScopedDevice() { cudaSetDevice(previous_); }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace fp4moe
