// runner/device_checks.hpp — the argument checks of every entry point that takes device pointers
// (MoeRunner's forward and stages, ExpertParallelLayer): null, alignment, device and overlap.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "fp4moe/error.hpp"

namespace fp4moe::runner {

// One device-memory argument of a forward or a stage: null, alignment, device and overlap checks.
struct DevicePtr {
  const void* p;
  const char* name;
  size_t align;
  size_t bytes;
  bool written;
  bool used;
};

// fn: the entry point the messages name. What a call writes must not overlap what it reads or another of
// its outputs: the kernels read their inputs after earlier launches of the same call have written.
inline Status check_device_ptrs(const char* fn, cudaStream_t stream, std::span<const DevicePtr> ptrs, int device) {
  auto fail = [fn](auto&&... parts) { return Status::failure(detail::concat(fn, ": ", parts...)); };
  // NOTE: pointer and stream queries are not stream operations, but CUDA counts them as unsafe while
  // a graph is captured in global mode; a capturing call checks what needs no query.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    return fail("the stream is not a valid CUDA stream");
  }
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  for (const DevicePtr& q : ptrs) {
    if (!q.used) continue;
    if (!q.p) return fail(q.name, " is null");
    if (reinterpret_cast<uintptr_t>(q.p) % q.align != 0)
      return fail(q.name, " must be ", q.align, "-byte aligned, got address ", q.p);
    if (capturing) continue;
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, q.p) != cudaSuccess || attr.type != cudaMemoryTypeDevice)
      return (void)cudaGetLastError(), fail(q.name, " must be device memory");
    if (attr.device != device) return fail(q.name, " is on device ", attr.device, " but the runner is on device ", device);
  }
  for (const DevicePtr& w : ptrs) {
    if (!w.used || !w.written) continue;
    const auto wb = reinterpret_cast<uintptr_t>(w.p);
    for (const DevicePtr& q : ptrs) {
      if (&q == &w || !q.used || (q.written && &q < &w)) continue;  // each pair of outputs once
      const auto qb = reinterpret_cast<uintptr_t>(q.p);
      if (wb < qb + q.bytes && qb < wb + w.bytes)
        return fail(w.name, " overlaps ", q.name, " (", w.bytes, " bytes at ", w.p, ", ", q.bytes, " bytes at ", q.p,
                    "); outputs and the workspace need memory of their own");
    }
  }
  if (stream && !capturing) {
    int stream_device = -1;
    if (cudaStreamGetDevice(stream, &stream_device) == cudaSuccess && stream_device != device)
      return fail("stream belongs to device ", stream_device, " but the runner is on device ", device);
    (void)cudaGetLastError();
  }
  return Status::success();
}

}  // namespace fp4moe::runner
