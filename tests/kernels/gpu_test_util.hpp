// tests/kernels/gpu_test_util.hpp — helpers shared by the GPU tests (gtest).
//
//   CUDA_ASSERT(expr) / CUDA_EXPECT(expr)  fail the test with the CUDA error name and the expression
//   DeviceBuffer<T>                        RAII device allocation with upload / download / poison
//   FP4MOE_REQUIRE_SM90()                  GTEST_SKIP unless an sm_90 device is present
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace fp4moe::test {

// Fails the current test (fatal: returns from the test function) when expr is not cudaSuccess.
#define CUDA_ASSERT(expr)                                                                   \
  do {                                                                                      \
    const cudaError_t fp4moe_err_ = (expr);                                                 \
    ASSERT_EQ(fp4moe_err_, cudaSuccess) << #expr << " -> " << cudaGetErrorName(fp4moe_err_) \
                                        << ": " << cudaGetErrorString(fp4moe_err_);         \
  } while (0)

// Non-fatal variant (usable in helpers that do not return void).
#define CUDA_EXPECT(expr)                                                                   \
  do {                                                                                      \
    const cudaError_t fp4moe_err_ = (expr);                                                 \
    EXPECT_EQ(fp4moe_err_, cudaSuccess) << #expr << " -> " << cudaGetErrorName(fp4moe_err_) \
                                        << ": " << cudaGetErrorString(fp4moe_err_);         \
  } while (0)

// True when device 0 is a compute capability 9.x GPU (the kernels are built for sm_90a only).
inline bool have_sm90_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();  // clear the sticky-free error of a machine without a driver/device
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  return prop.major == 9;
}

#define FP4MOE_REQUIRE_SM90()                                                    \
  do {                                                                           \
    if (!::fp4moe::test::have_sm90_device()) GTEST_SKIP() << "no sm_90 GPU present"; \
  } while (0)

// A device allocation of `count` elements of T. Never throws; allocation failures are reported by
// gtest (ADD_FAILURE) and leave a null buffer, so tests should ASSERT_TRUE(buf.ok()) when it matters.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) { allocate(count); }
  explicit DeviceBuffer(const std::vector<T>& host) {
    allocate(host.size());
    upload(host);
  }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }

  void allocate(size_t count) {
    release();
    count_ = count;
    if (count == 0) return;  // a zero-sized buffer stays null
    const cudaError_t err = cudaMalloc(&ptr_, count * sizeof(T));
    if (err != cudaSuccess) {
      ADD_FAILURE() << "cudaMalloc(" << count * sizeof(T) << " bytes) -> " << cudaGetErrorName(err);
      ptr_ = nullptr;
      count_ = 0;
    }
  }

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  bool ok() const { return count_ == 0 || ptr_ != nullptr; }

  // Synchronous copies (the default stream synchronises with the legacy behaviour of cudaMemcpy).
  void upload(const std::vector<T>& host) { upload(host.data(), host.size()); }
  void upload(const T* host, size_t count) {
    if (count > count_) {
      ADD_FAILURE() << "DeviceBuffer::upload: " << count << " elements into a buffer of " << count_;
      return;
    }
    if (count) CUDA_EXPECT(cudaMemcpy(ptr_, host, count * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const { return download(count_); }
  std::vector<T> download(size_t count) const {
    std::vector<T> host(count);
    if (count > count_) {
      ADD_FAILURE() << "DeviceBuffer::download: " << count << " elements from a buffer of " << count_;
      host.resize(count_);
      count = count_;
    }
    if (count) CUDA_EXPECT(cudaMemcpy(host.data(), ptr_, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every byte with `byte`: 0xFF makes fp32/bf16 NaN, int32 -1 and e4m3 0xFF (NaN).
  void poison(uint8_t byte = 0xFF) {
    if (count_) CUDA_EXPECT(cudaMemset(ptr_, byte, count_ * sizeof(T)));
  }

 private:
  void release() {
    if (ptr_) (void)cudaFree(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

template <typename T>
void poison(DeviceBuffer<T>& buf, uint8_t byte = 0xFF) {
  buf.poison(byte);
}

// Bit pattern of a float (for exact comparisons that also hold for NaN payloads and -0).
inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

}  // namespace fp4moe::test
