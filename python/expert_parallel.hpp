// python/expert_parallel.hpp — the extension's expert-parallel all-to-all layer (fp4moe/expert_parallel.hpp):
// its communicators and ExpertParallelLayer with DLPack tensors. Part of the extension fp4moe._fp4moe
// (python/module.cpp); python/fp4moe/torch_ops.py's FusedMoE(parallel="ep_all2all") is its user.
//
//   Communicator               a rank of a group: virtual_ranks(n) (one GPU, one thread per rank) or
//                              nccl_communicator(unique_id, rank, size, device) (one process per rank)
//   ExpertParallelLayer        one rank of the layer (scheme "all_to_all" or "all_gather"): the whole
//                              layer's problem and weights (host arrays; the rank prepares its own
//                              experts), forward into caller tensors
//
// Every call that waits for the other ranks (the constructor's NCCL init, forward) releases the
// Python lock, so that the ranks' Python threads of a virtual group run side by side.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/expert_parallel.hpp"
#include "python/dlpack_tensors.hpp"
#include "python/layer.hpp"

namespace fp4moe::python {

// The Python class fp4moe._fp4moe.Communicator: owns a Communicator; a layer made with it keeps it alive.
class PyCommunicator {
 public:
  explicit PyCommunicator(std::unique_ptr<Communicator> c) : impl_(std::move(c)) {}
  int rank() const { return impl_->rank(); }
  int size() const { return impl_->size(); }
  const std::shared_ptr<Communicator>& get() const { return impl_; }

 private:
  std::shared_ptr<Communicator> impl_;
};

inline std::vector<std::shared_ptr<PyCommunicator>> virtual_ranks(int size, int device_index, double timeout_seconds) {
  std::vector<std::shared_ptr<PyCommunicator>> out;
  for (auto& c : make_virtual_ranks(size, device_index, timeout_seconds))
    out.push_back(std::make_shared<PyCommunicator>(std::move(c)));
  return out;
}

inline nb::bytes nccl_unique_id_bytes() {
  const std::string id = nccl_unique_id();
  return nb::bytes(id.data(), id.size());
}

inline std::shared_ptr<PyCommunicator> nccl_communicator(const nb::bytes& unique_id, int rank, int size, int device) {
  const std::string id(unique_id.c_str(), unique_id.size());
  std::unique_ptr<Communicator> c;
  {
    nb::gil_scoped_release release;  // ncclCommInitRank returns once every rank has joined
    c = make_nccl_communicator(id, rank, size, device);
  }
  return std::make_shared<PyCommunicator>(std::move(c));
}

// The Python class fp4moe._fp4moe.ExpertParallelLayer.
class PyExpertParallelLayer {
 public:
  PyExpertParallelLayer(const MoeProblem& problem, const nb::dict& weights, const std::shared_ptr<PyCommunicator>& comm,
                        int64_t max_tokens, int device_index, int64_t receive_capacity_rows, bool w13_up_gate,
                        const std::string& scheme)
      : comm_(comm) {
    static const std::string where = "ExpertParallelLayer";
    check(comm != nullptr, where, ": communicator is None");
    problem.validate();
    const WeightPrepOptions options{/*scales_swizzled=*/false, w13_up_gate};
    // The whole layer's weights, checked as Layer checks them; the rank's experts are views into them.
    const HostWeights host(problem, weights, options, where + ": weights");
    try {
      reference::check_biases(host.view, problem);
    } catch (const Error& e) {
      throw Error(where + ": " + e.what());
    }
    ExpertParallelOptions o;
    o.receive_capacity_rows = receive_capacity_rows;
    check(scheme == "all_to_all" || scheme == "all_gather", where, ": scheme must be 'all_to_all' or 'all_gather', got '",
          scheme, "'");
    o.scheme = scheme == "all_gather" ? ExpertParallelScheme::AllGather : ExpertParallelScheme::AllToAll;
    Communicator& c = *comm_->get();
    layer_ = ExpertParallelLayer::create(problem, max_tokens, c, o, device_index);
    device_ = device_index;
    scheme_ = scheme;
    const ExpertParallelWeights w = expert_parallel_weights(problem, host.view, c.rank(), c.size());
    Status s;
    {
      nb::gil_scoped_release release;
      s = layer_->prepare_weights(w, options);
    }
    if (!s.ok()) throw Error(where + ": " + s.message);
  }

  const MoeProblem& problem() const { return layer_->problem(); }
  const MoeProblem& local_problem() const { return layer_->local_problem(); }
  int64_t max_tokens() const { return layer_->max_tokens(); }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  std::string scheme() const { return scheme_; }
  nb::dict last_traffic() const {
    const ExpertParallelTraffic t = layer_->last_traffic();
    nb::dict d;
    d["rows_sent"] = t.rows_sent;
    d["rows_received"] = t.rows_received;
    d["dispatch_bytes"] = t.dispatch_bytes;
    d["combine_bytes"] = t.combine_bytes;
    return d;
  }

  // The rank's tokens: hidden [T, H] bf16; router_logits [T, E] (or None with precomputed routing);
  // topk_ids / topk_weights [T, k], written by the routing or read when precomputed; output [T, H]
  // bf16 or float32. Waits for the other ranks; not capturable in a CUDA graph.
  void forward(const nb::handle& hidden_obj, const nb::handle& logits_obj, const nb::handle& bias_obj,
               const nb::handle& ids_obj, const nb::handle& weights_obj, const nb::handle& output_obj,
               uintptr_t stream) {
    static const std::string where = "ExpertParallelLayer.forward";
    const TensorCheck t{where, true, device_};
    ExpertParallelArgs a;
    Overlaps memory;
    check_forward_tensors(where, layer_->problem(), layer_->max_tokens(), t, memory, hidden_obj, logits_obj, bias_obj,
                          ids_obj, weights_obj, output_obj, a);
    memory.check(where);
    Status s;
    {
      nb::gil_scoped_release release;
      s = layer_->forward(reinterpret_cast<CUstream_st*>(stream), a);
    }
    if (!s.ok()) throw Error(where + ": " + s.message);
  }

 private:
  std::shared_ptr<PyCommunicator> comm_;  // outlives the layer, which holds a reference to it
  std::unique_ptr<ExpertParallelLayer> layer_;
  int device_ = 0;
  std::string scheme_;
};

}  // namespace fp4moe::python
