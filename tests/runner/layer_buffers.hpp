// tests/runner/layer_buffers.hpp — the device buffers of one forward of the layer tests (hidden rows,
// router logits, top-k ids and weights, output, workspace) and the ForwardArgs that point at them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/runner.hpp"
#include "runner/device_buffer.hpp"

namespace fp4moe::test {

struct LayerBuffers {
  // Sized for `num_tokens` tokens of `p` with the workspace `runner` asks for; throws fp4moe::Error
  // when an allocation fails.
  LayerBuffers(const MoeProblem& p, int64_t num_tokens, const MoeRunner& runner)
      : tokens(num_tokens),
        hidden_size(p.hidden),
        experts(p.num_experts),
        hidden(num_tokens * p.hidden * 2, "LayerBuffers hidden"),
        logits(num_tokens * p.num_experts * 4, "LayerBuffers logits"),
        ids(num_tokens * p.top_k() * 4, "LayerBuffers ids"),
        weights(num_tokens * p.top_k() * 4, "LayerBuffers weights"),
        out(num_tokens * p.hidden * 2, "LayerBuffers output"),
        ws(runner.workspace_size(num_tokens), "LayerBuffers workspace") {
    args.num_tokens = num_tokens;
    args.hidden = hidden.ptr;
    args.router_logits = logits.ptr;
    args.topk_ids = ids.as<int32_t>();
    args.topk_weights = weights.as<float>();
    args.output = out.ptr;
    args.workspace = ws.ptr;
    args.workspace_bytes = runner.workspace_size(num_tokens);
  }

  // Copies the case's hidden rows (bf16) and router logits (fp32) in; returns the first CUDA error.
  cudaError_t upload(const io::MoeCase& c) const {
    const cudaError_t e = cudaMemcpy(hidden.ptr, c.hidden_states.data(), tokens * hidden_size * 2, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) return e;
    return cudaMemcpy(logits.ptr, c.router_logits.data(), tokens * experts * 4, cudaMemcpyHostToDevice);
  }
  // Fills the output with 0xFF bytes (bf16 NaN), so that a row the forward does not write fails.
  cudaError_t poison_output() const { return cudaMemset(out.ptr, 0xFF, tokens * hidden_size * 2); }
  // The output's bf16 bits; `error` gets the copy's status.
  std::vector<uint16_t> output(cudaError_t* error) const {
    std::vector<uint16_t> bits(tokens * hidden_size);
    *error = cudaMemcpy(bits.data(), out.ptr, bits.size() * 2, cudaMemcpyDeviceToHost);
    return bits;
  }

  int64_t tokens, hidden_size, experts;
  DeviceBuffer hidden, logits, ids, weights, out, ws;
  ForwardArgs args;
};

}  // namespace fp4moe::test
