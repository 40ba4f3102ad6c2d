// runner/router.cu — GpuRouter: the route kernel of the layer (kernels/route.cu) on its own, for
// callers that route over more experts than they run (expert parallelism).
#include <cuda_runtime.h>

#include <cstdint>
#include <tuple>

#include "fp4moe/runner.hpp"
#include "kernels/launch.hpp"
#include "runner/hopper_device.hpp"

namespace fp4moe {

std::unique_ptr<GpuRouter> GpuRouter::create(const RoutingParams& params, int64_t num_experts, int device) {
  check(params.method != RoutingMethod::Precomputed, "GpuRouter::create: routing method precomputed has nothing "
                                                     "to route");
  MoeProblem routing_only;  // the routing checks of MoeProblem::validate (H and I are not used)
  routing_only.num_experts = num_experts;
  routing_only.hidden = routing_only.inter = 16;
  routing_only.routing = params;
  routing_only.validate();
  check(num_experts <= 512, "GpuRouter::create: the GPU routing supports up to 512 experts, got E=", num_experts);
  require_hopper_device(device, "GpuRouter::create");
  return std::unique_ptr<GpuRouter>(new GpuRouter(params, num_experts, device));
}

Status GpuRouter::route(CUstream_st* stream, int64_t num_tokens, const void* logits, LogitsDType logits_dtype,
                        const float* bias, int32_t* topk_ids, float* topk_weights) const {
  auto fail = [](auto&&... parts) { return Status::failure(detail::concat("GpuRouter::route: ", parts...)); };
  if (num_tokens < 0 || num_tokens * params_.top_k >= (int64_t(1) << 31))
    return fail("num_tokens must be >= 0 with num_tokens * top_k < 2^31, got ", num_tokens);
  if (!routing_uses_bias(params_.method)) bias = nullptr;  // accepted and ignored (fp4moe/problem.hpp)
  if (num_tokens == 0) return Status::success();
  const size_t logits_align = logits_dtype == LogitsDType::F32 ? 4 : 2;
  for (auto [p, name, align] : {std::tuple<const void*, const char*, size_t>{logits, "logits", logits_align},
                                {topk_ids, "topk_ids", 4}, {topk_weights, "topk_weights", 4}}) {
    if (!p) return fail(name, " is null");
    if (reinterpret_cast<uintptr_t>(p) % align != 0) return fail(name, " must be ", align, "-byte aligned");
  }
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess)
    return fail("cudaSetDevice: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  kernels::RouteArgs r;
  r.logits = logits;
  r.logits_bf16 = logits_dtype == LogitsDType::BF16;
  r.bias = bias;
  r.num_tokens = static_cast<int>(num_tokens);
  r.num_experts = static_cast<int>(num_experts_);
  r.params = params_;
  r.topk_ids = topk_ids;
  r.topk_weights = topk_weights;
  if (cudaError_t e = kernels::launch_route(r, stream); e != cudaSuccess)
    return fail("kernel route: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  return Status::success();
}

}  // namespace fp4moe
