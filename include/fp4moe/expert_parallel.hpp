// fp4moe/expert_parallel.hpp — the layer over the ranks of an expert-parallel group, with all-to-all
// dispatch and combine, or (ExpertParallelScheme::AllGather) all-gathered rows and fp32 partial
// outputs summed on the tokens' ranks (docs/architecture.md, "Expert-parallel layer").
//
//   auto ranks = make_virtual_ranks(4);                            // or any Communicator of the group
//   auto layer = ExpertParallelLayer::create(problem, max_tokens, *ranks[r]);          // one per rank
//   layer->prepare_weights({local_weights, layer_input_scales, layer_w2_bias});
//   layer->forward(stream, args);                                  // every rank, each on its host thread
//
// A forward of T tokens on rank r of N (rank d holds experts io::expert_range(E, d, N)):
//   1. route: the whole layer's routing (GpuRouter), or the caller's ids and weights (precomputed)
//   2. prepare: the rows quantized once (w4a4: NVFP4 with the layer's activation scale(s); w4a16: bf16)
//   3. plan: which rows go to which rank with which local ids (kernels::launch_ep_plan), rows packed
//      per destination (values, linear scales)
//   4. dispatch: the counts exchanged on the host, then rows, scales and local ids all-to-all
//   5. experts: this rank's MoeRunner on the rows it received (MoeRunner::experts, no re-quantization)
//   6. combine: each received row's fp32 y back to its source, gathered into entry order
//   7. finalize with the whole layer's ids, weights and w2_bias, in slot order: the single-GPU layer's
//      sum (docs/numerics.md, "Expert parallelism")
//
// AllGather replaces 3, 4 and 6: every rank's T exchanged, the rows, ids and weights sent to every
// rank, the experts on all of them, this rank's slots finalized into an fp32 partial of every gathered
// token, the partials all-to-all to the tokens' ranks and summed there in rank order.
//
// NOTE: step 4 waits on the host for the stream (the send counts are read back before the variable-size
// exchange), so a forward is not graph-capturable; every other step is asynchronous on the stream.
// The layer owns its buffers, allocated by create() for max_tokens; a forward allocates nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/problem.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"
#include "fp4moe/tactic.hpp"

struct CUstream_st;
struct ncclComm;  // ncclComm_t of nccl.h

namespace fp4moe {

// The transport of one expert-parallel group: counts on the host and device bytes between the ranks,
// ordered on a CUDA stream. Every rank of the group makes the same calls in the same order.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Host values, per_rank for each pair: send[d * per_rank + i] goes to rank d, recv[s * per_rank + i]
  // gets what rank s sent to this one. Returns when every rank has called it.
  virtual Status exchange_counts(const int64_t* send, int64_t* recv, int per_rank) = 0;
  // One variable-size exchange of device bytes. Byte offsets on the host, size() + 1 each:
  // send [send_offsets[d], send_offsets[d+1]) goes to rank d and lands in recv at
  // [recv_offsets[s], recv_offsets[s+1]) of rank d for source s; the two sizes must agree. With
  // send_ends (size() values) the bytes for rank d are [send_offsets[d], send_ends[d]) instead, and the
  // ranges may overlap (an all-gather sends the same bytes to every rank).
  struct Exchange {
    const void* send = nullptr;
    const int64_t* send_offsets = nullptr;
    void* recv = nullptr;
    const int64_t* recv_offsets = nullptr;
    const int64_t* send_ends = nullptr;
    int64_t send_end(int d) const { return send_ends ? send_ends[d] : send_offsets[d + 1]; }
  };
  // The exchanges as one group, after the work already queued on `stream`: work queued on `stream`
  // afterwards sees the received bytes and may overwrite the send buffers.
  virtual Status all_to_all_v(CUstream_st* stream, const Exchange* exchanges, int count) = 0;
};

// `size` ranks in this process on one GPU (device; -1: the current one): the exchanges are device
// copies ordered by events between the ranks' streams. Each rank's calls come from its own host thread
// (a call waits for the other ranks' matching calls, up to timeout_seconds; then it and every later call
// of the group fail). For tests and single-GPU benchmarks of the expert-parallel layer.
std::vector<std::unique_ptr<Communicator>> make_virtual_ranks(int size, int device = -1,
                                                              double timeout_seconds = 120.0);

// A rank of an NCCL communicator the caller made (ncclCommInitRank, or torch.distributed's; not
// destroyed here). NCCL is loaded at run time (libnccl.so.2: the copy already in the process, else the
// system's); throws fp4moe::Error when it is not found. The counts go through the communicator's own
// stream and are read back on the host; the exchanges are one ncclSend/ncclRecv group on the caller's
// stream.
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm* comm);
// The bootstrap of a group whose processes share no ncclComm_t (torch.distributed's own is not
// reachable from Python): one rank makes the id (ncclGetUniqueId, 128 bytes), the caller's group
// broadcasts it, and every rank calls make_nccl_communicator with it (ncclCommInitRank on `device`,
// collective: returns once all `size` ranks have joined). The communicator owns its ncclComm_t.
std::string nccl_unique_id();
std::unique_ptr<Communicator> make_nccl_communicator(const std::string& unique_id, int rank, int size, int device);
// One process driving every GPU of `devices` (ncclCommInitAll): communicator r on devices[r], owning its
// NCCL communicator. Each rank's calls come from its own host thread.
std::vector<std::unique_ptr<Communicator>> make_nccl_ranks(const std::vector<int>& devices);

// What one rank prepares: its own experts, and the two tensors of the whole layer that the token's
// rank needs (the activation scale at prepare, the expert biases at finalize).
struct ExpertParallelWeights {
  reference::MoeWeights local;                 // experts io::expert_range(E, rank, size), canonical layout
  const float* layer_w13_input_scale = nullptr;  // [E] the whole layer's (NVFP4 w4a4); ignored otherwise
  const float* layer_w2_bias = nullptr;        // [E, H] the whole layer's; required iff local.w2_bias is set
};

// Rank `rank` of `size`'s ExpertParallelWeights as views into the whole layer's canonical weights
// (linear scale layout; experts io::expert_range(E, rank, size) are contiguous in every tensor).
ExpertParallelWeights expert_parallel_weights(const MoeProblem& layer, const reference::MoeWeights& whole, int rank,
                                              int size);

// How a forward moves the rows (docs/numerics.md, "All-to-all expert parallelism").
enum class ExpertParallelScheme {
  // Each row goes only to the ranks that hold one of its experts; each computed entry's fp32 y comes
  // back to the token's rank, which sums the token's k slots in slot order.
  AllToAll,
  // Every rank gets every rank's rows, ids and router weights (an all-gather); each rank finalizes its
  // own experts' slots of every token into an fp32 partial output and sends each rank its tokens'
  // partials (the all-to-all of a reduce-scatter), summed there in rank order and rounded once: the
  // data-parallel prepare/finalize.
  AllGather,
};
const char* to_string(ExpertParallelScheme scheme);

struct ExpertParallelOptions {
  // Rows one rank can receive in a forward (buffers sized once); a forward in which some rank would get
  // more fails on every rank before any row is sent. 0: size() * max_tokens (a rank may get every row
  // when every rank's max_tokens is this one's; AllGather: every rank gets every row).
  int64_t receive_capacity_rows = 0;
  // Every rank's experts run this tactic (tests: the single-GPU layer's, for identical bits); nullopt:
  // each rank's selector for its own load.
  std::optional<MoeTactic> tactic;
  // Record events between the stages of every forward (last_stage_times); off: no events.
  bool time_stages = false;
  ExpertParallelScheme scheme = ExpertParallelScheme::AllToAll;
};

// Device pointers, row-major, of this rank's tokens.
struct ExpertParallelArgs {
  int64_t num_tokens = 0;                 // T, 0 <= T <= max_tokens
  const void* hidden = nullptr;           // [T, H] bf16
  const void* router_logits = nullptr;    // [T, E] (routing from logits), or nullptr with precomputed
  LogitsDType logits_dtype = LogitsDType::F32;
  const float* routing_bias = nullptr;    // [E] f32 or nullptr (deepseek_v3)
  int32_t* topk_ids = nullptr;            // [T, k] the whole layer's ids: out with logits, in when precomputed
  float* topk_weights = nullptr;          // [T, k] likewise
  void* output = nullptr;                 // [T, H] bf16, or fp32 with output_dtype F32
  OutputDType output_dtype = OutputDType::BF16;
};

// Rows and bytes of the last forward on this rank (host values, known after the count exchange).
// AllGather: the rows go to every rank with the token's whole [k] ids and weights (8k bytes per
// token), and the combine sends the fp32 partial output of every gathered token (4H bytes each).
struct ExpertParallelTraffic {
  int64_t rows_sent = 0;       // row copies this rank sent (to itself included)
  int64_t rows_received = 0;   // rows its experts ran on
  int64_t dispatch_bytes = 0;  // AllToAll: rows_sent * ep::dispatch_row_bytes (values, scales, local ids);
                               // AllGather: rows_sent * (values + scales) + size() * T * 8k
  int64_t combine_bytes = 0;   // AllToAll: fp32 y rows sent back (computed entries * 4H);
                               // AllGather: gathered tokens * 4H
};

// Device time of the last forward's stages on this rank, from events on its stream (time_stages).
// The exchanges (the count exchange, the dispatch and combine all-to-alls, and the waits for the other
// ranks that they include) are in exchange_us and in none of the others.
struct ExpertParallelStageTimes {
  double dispatch_us = 0;  // route, prepare (quantize), plan and pack (AllGather: route and prepare)
  double experts_us = 0;   // the local experts on the received rows (AllGather: with the id mapping)
  double combine_us = 0;   // compact, gather into slot order, finalize (AllGather: the partial, the sum)
  double exchange_us = 0;  // from the end of the pack to the experts' start, and the combine all-to-all
};

class ExpertParallelLayer {
 public:
  // problem: the whole layer (E experts, routing from logits or precomputed; not skip_foreign_ids).
  // Throws fp4moe::Error for an invalid problem, comm.size() outside [1, E], or no suitable GPU.
  static std::unique_ptr<ExpertParallelLayer> create(const MoeProblem& problem, int64_t max_tokens,
                                                     Communicator& comm, const ExpertParallelOptions& options = {},
                                                     int device = -1);
  virtual ~ExpertParallelLayer() = default;
  virtual Status prepare_weights(const ExpertParallelWeights& weights, const WeightPrepOptions& options = {}) = 0;
  // Arguments are checked before anything is exchanged; a failure after the exchange has started is
  // reported on every rank (the capacity check) or is a CUDA error.
  virtual Status forward(CUstream_st* stream, const ExpertParallelArgs& args) = 0;
  virtual ExpertParallelTraffic last_traffic() const = 0;
  // Waits for the last forward's events; an error when the layer was created without time_stages or
  // no forward has run.
  virtual Status last_stage_times(ExpertParallelStageTimes& times) const = 0;
  // Ids per dispatched row: k (one row per token) or 1 (one per entry: per-expert input scales, or the
  // router weight on the input).
  virtual int rows_top_k() const = 0;

  const MoeProblem& problem() const { return problem_; }
  // This rank's problem: its experts, precomputed routing with skip_foreign_ids (as its runner runs it).
  virtual const MoeProblem& local_problem() const = 0;
  int64_t max_tokens() const { return max_tokens_; }

 protected:
  ExpertParallelLayer(const MoeProblem& p, int64_t max_tokens) : problem_(p), max_tokens_(max_tokens) {}
  MoeProblem problem_;
  int64_t max_tokens_;
};

}  // namespace fp4moe
