// runner/run_case.cu — run_case_on_gpu (fp4moe/bench.hpp, the fp4moe_tools target): a host-memory case
// through MoeRunner (tools and tests).
#include <cuda_runtime.h>

#include <vector>

#include "fp4moe/bench.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/runner.hpp"
#include "runner/device_buffer.hpp"

namespace fp4moe {
namespace {

void cuda_check(cudaError_t e, const char* what) { throw_on_cuda_error(e, "run_case_on_gpu", what); }

// Device buffer freed on scope exit.
struct Buffer : DeviceBuffer {
  explicit Buffer(size_t bytes) : DeviceBuffer(bytes, "run_case_on_gpu") {}
};

template <typename T>
void upload(Buffer& b, const std::vector<T>& v) {
  cuda_check(cudaMemcpy(b.ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
}

}  // namespace

reference::MoeResult run_case_on_gpu(const io::MoeCase& c, double* ms, std::optional<MoeTactic> tactic) {
  const MoeProblem& p = c.problem;
  const int64_t T = c.num_tokens, k = p.top_k();
  const bool routed = p.routing.method == RoutingMethod::Precomputed;
  auto runner = MoeRunner::create(p, T);
  runner->force_tactic(tactic);
  if (Status s = runner->prepare_weights(c.weights()); !s.ok()) throw Error(s.message);

  Buffer hidden(c.hidden_states.size() * 2), logits(c.router_logits.size() * 4), bias(c.routing_bias.size() * 4);
  Buffer ids(T * k * 4), weights(T * k * 4), out(T * p.hidden * 2);
  const size_t ws_bytes = runner->workspace_size(T);
  Buffer ws(ws_bytes);
  upload(hidden, c.hidden_states);
  if (routed) {
    upload(ids, c.topk_ids);
    upload(weights, c.topk_weights);
  } else {
    upload(logits, c.router_logits);
  }
  if (!c.routing_bias.empty()) upload(bias, c.routing_bias);
  cuda_check(cudaMemset(out.ptr, 0xFF, T * p.hidden * 2), "poison output");  // every element must be written

  ForwardArgs a;
  a.num_tokens = T;
  a.hidden = hidden.ptr;
  a.router_logits = routed ? nullptr : logits.ptr;
  a.logits_dtype = LogitsDType::F32;  // bf16 case logits were widened on load
  a.routing_bias = c.routing_bias.empty() ? nullptr : bias.as<float>();
  a.topk_ids = ids.as<int32_t>();
  a.topk_weights = weights.as<float>();
  a.output = out.ptr;
  a.workspace = ws.ptr;
  a.workspace_bytes = ws_bytes;
  auto forward = [&] {
    Status s = routed ? runner->forward_routed(nullptr, a) : runner->forward(nullptr, a);
    if (!s.ok()) throw Error(s.message);
  };
  forward();
  cuda_check(cudaDeviceSynchronize(), "forward");

  reference::MoeResult r;
  r.output.resize(T * p.hidden);
  r.topk_ids.resize(T * k);
  r.topk_weights.resize(T * k);
  cuda_check(cudaMemcpy(r.output.data(), out.ptr, r.output.size() * 2, cudaMemcpyDeviceToHost), "download output");
  cuda_check(cudaMemcpy(r.topk_ids.data(), ids.ptr, r.topk_ids.size() * 4, cudaMemcpyDeviceToHost), "download topk_ids");
  cuda_check(cudaMemcpy(r.topk_weights.data(), weights.ptr, r.topk_weights.size() * 4, cudaMemcpyDeviceToHost),
             "download topk_weights");

  if (ms) {
    cudaEvent_t start, stop;
    cuda_check(cudaEventCreate(&start), "cudaEventCreate");
    cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
    forward();  // warm-up
    constexpr int kReps = 10;
    cuda_check(cudaEventRecord(start), "cudaEventRecord");
    for (int i = 0; i < kReps; ++i) forward();
    cuda_check(cudaEventRecord(stop), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(stop), "timing");
    float total = 0;
    cuda_check(cudaEventElapsedTime(&total, start, stop), "cudaEventElapsedTime");
    *ms = total / kReps;
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  return r;
}

}  // namespace fp4moe
