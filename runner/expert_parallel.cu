// runner/expert_parallel.cu — ExpertParallelLayer (fp4moe/expert_parallel.hpp): one rank of the layer
// with all-to-all dispatch and combine over a Communicator.
//
// The tensors of one forward on rank r of N (S rows of rows_top_k ids: per token, or per entry where a
// token's slots quantize differently; P = S * min(N, rows_top_k) row copies at most; C the receive
// capacity in rows):
//   ids, weights            [T, k]            the caller's (routing writes them)     -> prepare, plan, finalize
//   rows_values/_scales     [S, H/2 | 2H] / [S, H/16]  prepare (kernels::launch_prepare_rows) -> pack
//   send_offsets, send_rows, send_ids, send_entry_offsets, gather_index   the plan (kernels::launch_ep_plan)
//   send_values/_scales     [P, ...]           pack (gather_rows by send_rows)        -> dispatch
//   recv_values/_scales/_ids [C, ...]          dispatch                               -> experts
//   y_recv                  [C * rows_top_k, H] fp32, experts (the local MoeRunner)   -> compact
//   y_send                  [C * rows_top_k, H] the computed entries (compact_entries) -> combine
//   y_comb                  [S * rows_top_k, H] combine: every rank's returned entries in rank order
//   y                       [S * rows_top_k, H] entry order (gather_rows by gather_index) -> finalize
// The receive side is sized for C rows; the local runner's max_tokens is the C rows' entries over k.
//
// ExpertParallelScheme::AllGather (G gathered tokens of the group, R = G * rows per token <= C):
//   rows_values/_scales, ids, weights  this rank's                     -> all-gather (the same bytes to all)
//   recv_values/_scales [R, ...], recv_ids/_weights [G, k]   every rank's, source-major
//   local_ids           [G, k]            kernels::launch_localize_ids (another rank's expert: -1)
//   y_recv              [R * rows_top_k, H] fp32, experts                   -> finalize (own slots only)
//   partial             [G, H] fp32       the rank's share of every gathered token -> all-to-all by token rank
//   partials_in         [N, T, H] fp32    every rank's share of this rank's tokens -> kernels::launch_sum_partials
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/expert_parallel.hpp"
#include "fp4moe/format.hpp"
#include "kernels/launch.hpp"
#include "runner/device_buffer.hpp"
#include "runner/device_checks.hpp"
#include "runner/ep_dispatch.hpp"
#include "runner/forward_plan.hpp"
#include "runner/hopper_device.hpp"

namespace fp4moe {
namespace {

std::string cuda_message(const char* what, cudaError_t e) {
  return detail::concat("ExpertParallelLayer::forward: ", what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
                        ")");
}

// Pinned host memory for the send offsets read back before the exchange.
class PinnedInts {
 public:
  explicit PinnedInts(size_t n) { throw_on_cuda_error(cudaMallocHost(&ptr_, n * sizeof(int32_t)), "ExpertParallelLayer", "cudaMallocHost"); }
  ~PinnedInts() { cudaFreeHost(ptr_); }
  PinnedInts(const PinnedInts&) = delete;
  PinnedInts& operator=(const PinnedInts&) = delete;
  int32_t* get() const { return ptr_; }

 private:
  int32_t* ptr_ = nullptr;
};

// The stage boundaries of one forward (ExpertParallelOptions::time_stages).
enum StageEvent { kStart, kPacked, kDispatched, kExpertsDone, kCompacted, kCombined, kFinalized, kStageEvents };

class StageEvents {
 public:
  StageEvents() {
    for (cudaEvent_t& e : events_)
      throw_on_cuda_error(cudaEventCreate(&e), "ExpertParallelLayer", "cudaEventCreate");
  }
  ~StageEvents() {
    for (cudaEvent_t e : events_)
      if (e) cudaEventDestroy(e);
  }
  StageEvents(const StageEvents&) = delete;
  StageEvents& operator=(const StageEvents&) = delete;
  cudaError_t record(StageEvent s, cudaStream_t stream) { return cudaEventRecord(events_[s], stream); }
  Status times(ExpertParallelStageTimes& t) const {
    if (cudaError_t e = cudaEventSynchronize(events_[kFinalized]); e != cudaSuccess)
      return Status::failure(detail::concat("ExpertParallelLayer::last_stage_times: ", cudaGetErrorName(e)));
    float ms[kStageEvents] = {};
    for (int i = 1; i < kStageEvents; ++i)
      if (cudaError_t e = cudaEventElapsedTime(&ms[i], events_[i - 1], events_[i]); e != cudaSuccess)
        return Status::failure(detail::concat("ExpertParallelLayer::last_stage_times: ", cudaGetErrorName(e)));
    t.dispatch_us = 1e3 * ms[kPacked];
    t.exchange_us = 1e3 * (ms[kDispatched] + ms[kCombined]);
    t.experts_us = 1e3 * ms[kExpertsDone];
    t.combine_us = 1e3 * (ms[kCompacted] + ms[kFinalized]);
    return Status::success();
  }

 private:
  cudaEvent_t events_[kStageEvents] = {};
};

// out[i] = v[i] * bytes (exchange offsets in bytes from offsets in rows or entries).
void scale_offsets(const std::vector<int64_t>& v, int64_t bytes, std::vector<int64_t>& out) {
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] * bytes;
}

// Rank `rank` of `size`'s problem: its experts io::expert_range(E, rank, size).
MoeProblem rank_problem(const MoeProblem& p, int rank, int size) {
  const auto [begin, end] = io::expert_range(p.num_experts, rank, size);
  return p.expert_parallel_rank(end - begin);
}

class GpuExpertParallelLayer final : public ExpertParallelLayer {
 public:
  GpuExpertParallelLayer(const MoeProblem& p, int64_t max_tokens, Communicator& comm,
                         const ExpertParallelOptions& options, int device)
      : ExpertParallelLayer(p, max_tokens),
        comm_(comm),
        N_(comm.size()),
        rank_(comm.rank()),
        device_(device),
        local_(rank_problem(p, rank_, N_)),
        first_expert_(io::expert_range(p.num_experts, rank_, N_).first),
        scheme_(options.scheme) {
    const ScopedDevice on(device_, "ExpertParallelLayer::create");  // every buffer below on the layer's GPU
    const int64_t k = p.top_k(), H = p.hidden;
    const StageRowsShape one = runner::stage_rows_shape(p, 1, ScaleLayout::Linear);
    rows_top_k_ = one.rows.rows_top_k;
    format_ = one.rows.format;
    value_bytes_ = int64_t(one.values_bytes);  // per row
    scale_bytes_ = int64_t(one.scales_bytes);
    max_rows_ = rows_top_k_ == 1 ? max_tokens * k : max_tokens;
    const int64_t copies = max_rows_ * std::min<int64_t>(N_, rows_top_k_);
    capacity_ = options.receive_capacity_rows > 0 ? options.receive_capacity_rows : N_ * max_rows_;
    check(capacity_ * rows_top_k_ < (int64_t(1) << 31) && copies * rows_top_k_ < (int64_t(1) << 31),
          "ExpertParallelLayer::create: the received entries (", capacity_, " rows of ", rows_top_k_,
          " slots) must fit int32; give a smaller receive_capacity_rows or max_tokens");
    runner_ = MoeRunner::create(local_, (capacity_ * rows_top_k_ + k - 1) / k, device_);
    if (options.tactic) runner_->force_tactic(*options.tactic);
    if (p.routing.method != RoutingMethod::Precomputed) router_ = GpuRouter::create(p.routing, p.num_experts, device_);

    auto buffer = [](int64_t bytes, const char* what) { return std::make_unique<DeviceBuffer>(size_t(bytes), what); };
    rows_values_ = buffer(max_rows_ * value_bytes_, "ExpertParallelLayer rows");
    rows_scales_ = buffer(max_rows_ * scale_bytes_, "ExpertParallelLayer row scales");
    recv_values_ = buffer(capacity_ * value_bytes_, "ExpertParallelLayer received rows");
    recv_scales_ = buffer(capacity_ * scale_bytes_, "ExpertParallelLayer received scales");
    recv_ids_ = buffer(4 * capacity_ * rows_top_k_, "ExpertParallelLayer received ids");
    y_recv_ = buffer(4 * H * capacity_ * rows_top_k_, "ExpertParallelLayer experts' y");
    if (scheme_ == ExpertParallelScheme::AllGather) {
      // The received entries are the group's tokens' k slots: capacity_ * rows_top_k_ / k tokens.
      const int64_t tokens = capacity_ * rows_top_k_ / k;
      recv_weights_ = buffer(4 * capacity_ * rows_top_k_, "ExpertParallelLayer received router weights");
      local_ids_ = buffer(4 * capacity_ * rows_top_k_, "ExpertParallelLayer local ids");
      partial_ = buffer(4 * H * tokens, "ExpertParallelLayer partial output");
      partials_in_ = buffer(4 * H * N_ * max_tokens, "ExpertParallelLayer received partial outputs");
    } else {
      send_offsets_ = buffer(4 * (N_ + 1), "ExpertParallelLayer send offsets");
      send_entry_offsets_ = buffer(4 * (N_ + 1), "ExpertParallelLayer send entry offsets");
      send_rows_ = buffer(4 * copies, "ExpertParallelLayer send rows");
      send_ids_ = buffer(4 * copies * rows_top_k_, "ExpertParallelLayer send ids");
      gather_index_ = buffer(4 * max_rows_ * rows_top_k_, "ExpertParallelLayer gather index");
      send_values_ = buffer(copies * value_bytes_, "ExpertParallelLayer send rows");
      send_scales_ = buffer(copies * scale_bytes_, "ExpertParallelLayer send scales");
      compact_list_ = buffer(4 * capacity_ * rows_top_k_, "ExpertParallelLayer computed entries");
      y_send_ = buffer(4 * H * capacity_ * rows_top_k_, "ExpertParallelLayer returned y");
      y_comb_ = buffer(4 * H * max_rows_ * rows_top_k_, "ExpertParallelLayer combined y");
      y_ = buffer(4 * H * max_rows_ * rows_top_k_, "ExpertParallelLayer y");
    }
    host_offsets_ = std::make_unique<PinnedInts>(size_t(2 * (N_ + 1)));
    counts_out_.assign(size_t(N_) * 2 * N_, 0);
    counts_in_.assign(size_t(N_) * 2 * N_, 0);
    rows_matrix_.assign(size_t(N_) * N_, 0);
    for (std::vector<int64_t>* v : {&send_rows_h_, &recv_rows_h_, &send_entries_h_, &recv_entries_h_})
      v->assign(size_t(N_) + 1, 0);
    for (std::vector<int64_t>& v : byte_offsets_) v.assign(size_t(N_) + 1, 0);
    if (options.time_stages) events_ = std::make_unique<StageEvents>();
  }

  const MoeProblem& local_problem() const override { return local_; }
  ExpertParallelTraffic last_traffic() const override { return traffic_; }
  Status last_stage_times(ExpertParallelStageTimes& times) const override {
    if (!events_) return Status::failure("ExpertParallelLayer::last_stage_times: the layer was created without time_stages");
    if (!timed_) return Status::failure("ExpertParallelLayer::last_stage_times: no forward has run");
    return events_->times(times);
  }
  int rows_top_k() const override { return rows_top_k_; }

  Status prepare_weights(const ExpertParallelWeights& w, const WeightPrepOptions& options) override {
    std::optional<ScopedDevice> on;
    try {
      on.emplace(device_, "ExpertParallelLayer::prepare_weights");
    } catch (const Error& e) {
      return Status::failure(e.what());
    }
    const MoeProblem& p = problem_;
    const int64_t E = p.num_experts, H = p.hidden;
    const bool w4a4 = p.act_quant != ActQuant::W4A16;
    if (w4a4 && !w.layer_w13_input_scale)
      return Status::failure("ExpertParallelLayer::prepare_weights: layer_w13_input_scale (the whole layer's [E]) is "
                             "required in mode " + std::string(to_string(p.act_quant)));
    if ((w.local.w2_bias != nullptr) != (w.layer_w2_bias != nullptr))
      return Status::failure("ExpertParallelLayer::prepare_weights: layer_w2_bias (the whole layer's [E, H]) must be given "
                             "exactly when the rank's weights have w2_bias");
    reference::MoeWeights local = w.local;
    std::vector<float> input_scale = {1.0f};
    if (w4a4) {
      const float max_scale = *std::max_element(w.layer_w13_input_scale, w.layer_w13_input_scale + E);
      if (p.act_quant == ActQuant::W4A4Scalar) {
        local.w13_input_scale_max = max_scale;  // the rank's GEMM1 alpha uses the layer's one scale
        input_scale = {max_scale};
      } else {
        input_scale.assign(w.layer_w13_input_scale, w.layer_w13_input_scale + E);
      }
    }
    if (Status s = runner_->prepare_weights(local, options); !s.ok()) return s;
    try {
      input_scale_ = std::make_unique<DeviceBuffer>(input_scale.size() * 4, "ExpertParallelLayer input scale");
      throw_on_cuda_error(cudaMemcpy(input_scale_->ptr, input_scale.data(), input_scale.size() * 4, cudaMemcpyHostToDevice),
                          "ExpertParallelLayer::prepare_weights", "uploading the input scale");
      w2_bias_.reset();
      if (w.layer_w2_bias) {
        w2_bias_ = std::make_unique<DeviceBuffer>(size_t(E * H * 4), "ExpertParallelLayer w2_bias");
        throw_on_cuda_error(cudaMemcpy(w2_bias_->ptr, w.layer_w2_bias, size_t(E * H * 4), cudaMemcpyHostToDevice),
                            "ExpertParallelLayer::prepare_weights", "uploading w2_bias");
      }
      workspace_bytes_ = runner_->workspace_size(runner_->max_tokens());
      workspace_ = std::make_unique<DeviceBuffer>(workspace_bytes_, "ExpertParallelLayer runner workspace");
    } catch (const Error& e) {
      return Status::failure(e.what());
    }
    prepared_ = true;
    return Status::success();
  }

  Status forward(CUstream_st* stream, const ExpertParallelArgs& a) override {
    const char* fn = "ExpertParallelLayer::forward";
    const MoeProblem& p = problem_;
    if (!prepared_) return Status::failure(detail::concat(fn, ": weights are not prepared (call prepare_weights first)"));
    if (a.num_tokens < 0 || a.num_tokens > max_tokens_)
      return Status::failure(detail::concat(fn, ": num_tokens must be in [0, max_tokens=", max_tokens_, "], got ", a.num_tokens));
    const bool routed = p.routing.method == RoutingMethod::Precomputed;
    if (routed && a.router_logits)
      return Status::failure(detail::concat(fn, ": the problem has precomputed routing: pass topk_ids and topk_weights, "
                                                "not router_logits"));
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::failure(detail::concat(fn, ": the stream is not a valid CUDA stream"));
    }
    if (capture != cudaStreamCaptureStatusNone)
      return Status::failure(detail::concat(fn, ": cannot be captured in a CUDA graph (the send counts are read back on "
                                                "the host before the exchange); run it eagerly, or capture the "
                                                "MoeRunner stages between exchanges of your own"));
    const size_t T = size_t(a.num_tokens), H = size_t(p.hidden), k = size_t(p.top_k());
    const bool unit = p.routing.apply_router_weight_on_input;
    const runner::DevicePtr ptrs[] = {
        {a.hidden, "hidden", 16, T * H * 2, false, T > 0},
        {a.router_logits, "router_logits", 4, T * size_t(p.num_experts) * 4, false, T > 0 && !routed},
        {a.topk_ids, "topk_ids", 4, T * k * 4, !routed, T > 0},
        {a.topk_weights, "topk_weights", 4, T * k * 4, !routed, T > 0},
        {a.output, "output", 16, T * H * (a.output_dtype == OutputDType::F32 ? 4 : 2), true, T > 0}};
    if (Status s = runner::check_device_ptrs(fn, stream, ptrs, device_); !s.ok()) return s;
    (void)cudaGetLastError();
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Status::failure(cuda_message("cudaSetDevice", e));

    timed_ = false;
    if (Status s = mark(kStart, stream); !s.ok()) return s;
    // 1. route
    if (!routed && T > 0)
      if (Status s = router_->route(stream, a.num_tokens, a.router_logits, a.logits_dtype, a.routing_bias, a.topk_ids,
                                    a.topk_weights);
          !s.ok())
        return s;
    const int64_t S = rows_top_k_ == 1 ? int64_t(T * k) : int64_t(T);
    const int rk = rows_top_k_;
    // 2. prepare
    kernels::PrepareRowsArgs pr;
    pr.hidden = static_cast<const __nv_bfloat16*>(a.hidden);
    pr.topk_ids = a.topk_ids;
    pr.topk_weights = a.topk_weights;
    pr.input_scale = input_scale_->as<float>();
    pr.num_tokens = int(T);
    pr.top_k = int(k);
    pr.hidden_size = int(H);
    pr.num_experts = int(p.num_experts);
    pr.per_entry = rk == 1;  // with k = 1 both index alike (MoeRunner::prepare's rule)
    pr.scale_by_weight = unit;
    pr.mode = p.act_quant;
    pr.scale_layout = kernels::ScaleLayout::Linear;
    pr.values = rows_values_->ptr;
    pr.scales = rows_scales_->as<uint8_t>();
    if (cudaError_t e = kernels::launch_prepare_rows(pr, stream); e != cudaSuccess) return Status::failure(cuda_message("prepare_rows", e));
    if (scheme_ == ExpertParallelScheme::AllGather) return forward_all_gather(stream, a, int64_t(T), S);
    // 3. plan and pack
    kernels::EpPlanArgs plan;
    plan.ids = a.topk_ids;  // [T, k] is [S, rows_top_k] either way
    plan.num_rows = int(S);
    plan.rows_top_k = rk;
    plan.num_experts = int(p.num_experts);
    plan.ranks = N_;
    plan.send_offsets = send_offsets_->as<int32_t>();
    plan.send_rows = send_rows_->as<int32_t>();
    plan.send_ids = send_ids_->as<int32_t>();
    plan.send_entry_offsets = send_entry_offsets_->as<int32_t>();
    plan.gather_index = gather_index_->as<int32_t>();
    if (cudaError_t e = kernels::launch_ep_plan(plan, stream); e != cudaSuccess) return Status::failure(cuda_message("ep_plan", e));
    const int copies = int(S * std::min(N_, rk));
    if (Status s = gather(stream, send_rows_->as<int32_t>(), copies, plan.send_offsets + N_, rows_values_->ptr,
                          send_values_->ptr, value_bytes_);
        !s.ok())
      return s;
    if (scale_bytes_ > 0)
      if (Status s = gather(stream, send_rows_->as<int32_t>(), copies, plan.send_offsets + N_, rows_scales_->ptr,
                            send_scales_->ptr, scale_bytes_);
          !s.ok())
        return s;

    if (Status s = mark(kPacked, stream); !s.ok()) return s;

    // 4. counts: every rank learns every rank's row and entry counts (the capacity check needs them all).
    int32_t* host = host_offsets_->get();
    if (cudaError_t e = cudaMemcpyAsync(host, send_offsets_->ptr, 4 * (N_ + 1), cudaMemcpyDeviceToHost, stream);
        e != cudaSuccess)
      return Status::failure(cuda_message("reading the send offsets", e));
    if (cudaError_t e = cudaMemcpyAsync(host + N_ + 1, send_entry_offsets_->ptr, 4 * (N_ + 1), cudaMemcpyDeviceToHost,
                                        stream);
        e != cudaSuccess)
      return Status::failure(cuda_message("reading the send offsets", e));
    if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess)
      return Status::failure(cuda_message("waiting for the send offsets", e));
    const int m = 2 * N_;  // per destination: this rank's rows for 0..N-1, then its entries for 0..N-1
    for (int d = 0; d < N_; ++d)
      for (int x = 0; x < N_; ++x) {
        counts_out_[size_t(d) * m + x] = host[x + 1] - host[x];
        counts_out_[size_t(d) * m + N_ + x] = host[N_ + 1 + x + 1] - host[N_ + 1 + x];
      }
    if (Status s = comm_.exchange_counts(counts_out_.data(), counts_in_.data(), m); !s.ok()) return s;
    // counts_in_[src * m + x]: rows (entries at N + x) that src sends to rank x.
    for (int src = 0; src < N_; ++src)
      for (int x = 0; x < N_; ++x) rows_matrix_[size_t(src) * N_ + x] = counts_in_[size_t(src) * m + x];
    try {
      ep::check_receive_capacity(rows_matrix_, N_, capacity_);
    } catch (const Error& e) {
      return Status::failure(detail::concat(fn, ": ", e.what()));
    }
    std::vector<int64_t>&send_rows = send_rows_h_, &recv_rows = recv_rows_h_, &send_entries = send_entries_h_,
                        &recv_entries = recv_entries_h_;
    for (int x = 0; x < N_; ++x) {
      send_rows[x + 1] = host[x + 1];
      send_entries[x + 1] = host[N_ + 1 + x + 1];
      recv_rows[x + 1] = recv_rows[x] + counts_in_[size_t(x) * m + rank_];
      recv_entries[x + 1] = recv_entries[x] + counts_in_[size_t(x) * m + N_ + rank_];
    }
    const int64_t R = recv_rows[N_], V = recv_entries[N_];

    // 4. dispatch: values, scales and local ids in one group
    std::vector<int64_t>&sv = byte_offsets_[0], &rv = byte_offsets_[1], &ss = byte_offsets_[2], &rs = byte_offsets_[3],
                        &si = byte_offsets_[4], &ri = byte_offsets_[5], &sy = byte_offsets_[6], &ry = byte_offsets_[7];
    scale_offsets(send_rows, value_bytes_, sv);
    scale_offsets(recv_rows, value_bytes_, rv);
    scale_offsets(send_rows, scale_bytes_, ss);
    scale_offsets(recv_rows, scale_bytes_, rs);
    scale_offsets(send_rows, 4 * rk, si);
    scale_offsets(recv_rows, 4 * rk, ri);
    Communicator::Exchange dispatch[3] = {
        {send_values_->ptr, sv.data(), recv_values_->ptr, rv.data()},
        {send_ids_->ptr, si.data(), recv_ids_->ptr, ri.data()},
        {send_scales_->ptr, ss.data(), recv_scales_->ptr, rs.data()}};
    if (Status s = comm_.all_to_all_v(stream, dispatch, scale_bytes_ > 0 ? 3 : 2); !s.ok()) return s;
    if (Status s = mark(kDispatched, stream); !s.ok()) return s;

    // 5. experts on the received rows
    if (R > 0)
      if (Status s = run_experts(stream, R, recv_ids_->as<int32_t>()); !s.ok()) return s;
    if (Status s = mark(kExpertsDone, stream); !s.ok()) return s;

    // 6. combine: the computed entries back to their sources, then into entry order
    kernels::CompactEntriesArgs ce;
    ce.ids = recv_ids_->as<int32_t>();
    ce.num_entries = int(R * rk);
    ce.list = compact_list_->as<int32_t>();
    if (cudaError_t e = kernels::launch_compact_entries(ce, stream); e != cudaSuccess)
      return Status::failure(cuda_message("compact_entries", e));
    const int64_t y_row = 4 * int64_t(H);
    if (Status s = gather(stream, compact_list_->as<int32_t>(), int(V), nullptr, y_recv_->ptr, y_send_->ptr, y_row); !s.ok())
      return s;
    if (Status s = mark(kCompacted, stream); !s.ok()) return s;
    scale_offsets(recv_entries, y_row, sy);
    scale_offsets(send_entries, y_row, ry);
    Communicator::Exchange combine = {y_send_->ptr, sy.data(), y_comb_->ptr, ry.data()};
    if (Status s = comm_.all_to_all_v(stream, &combine, 1); !s.ok()) return s;
    if (Status s = mark(kCombined, stream); !s.ok()) return s;
    if (Status s = gather(stream, gather_index_->as<int32_t>(), int(S * rk), nullptr, y_comb_->ptr, y_->ptr, y_row); !s.ok())
      return s;

    // 7. finalize with the whole layer's ids, weights and biases
    kernels::FinalizeArgs f;
    f.y = y_->as<float>();
    f.topk_weights = a.topk_weights;
    f.num_tokens = int(T);
    f.top_k = int(k);
    f.hidden_size = int(H);
    f.unit_weights = unit;
    f.topk_ids = a.topk_ids;
    f.num_experts = int(p.num_experts);
    f.skip_foreign_ids = false;
    f.bias = w2_bias_ ? w2_bias_->as<float>() : nullptr;
    if (a.output_dtype == OutputDType::F32) f.out_f32 = static_cast<float*>(a.output);
    else f.out = static_cast<__nv_bfloat16*>(a.output);
    if (cudaError_t e = kernels::launch_finalize(f, stream); e != cudaSuccess) return Status::failure(cuda_message("finalize", e));
    if (Status s = mark(kFinalized, stream); !s.ok()) return s;
    timed_ = events_ != nullptr;

    traffic_.rows_sent = send_rows[N_];
    traffic_.rows_received = R;
    traffic_.dispatch_bytes = send_rows[N_] * ep::dispatch_row_bytes(p, rk);
    traffic_.combine_bytes = V * ep::combine_entry_bytes(p);
    return Status::success();
  }

 private:
  // The rank's experts on the received rows (recv_values_ / recv_scales_) with their local ids [rows,
  // rows_top_k] into y_recv_.
  Status run_experts(cudaStream_t stream, int64_t rows, const int32_t* ids) {
    ExpertsArgs ea;
    ea.rows.num_rows = rows;
    ea.rows.rows_top_k = rows_top_k_;
    ea.rows.format = format_;
    ea.rows.scale_layout = ScaleLayout::Linear;
    ea.rows.values = recv_values_->ptr;
    ea.rows.scales = scale_bytes_ > 0 ? recv_scales_->ptr : nullptr;
    ea.topk_ids = ids;
    ea.y = y_recv_->as<float>();
    ea.workspace = workspace_->ptr;
    ea.workspace_bytes = workspace_bytes_;
    return runner_->experts(stream, ea);
  }

  // The stage boundary `ev` on the stream (time_stages; nothing otherwise).
  Status mark(StageEvent ev, cudaStream_t stream) {
    if (!events_) return Status::success();
    if (cudaError_t e = events_->record(ev, stream); e != cudaSuccess)
      return Status::failure(cuda_message("cudaEventRecord", e));
    return Status::success();
  }

  // ExpertParallelScheme::AllGather, after route and prepare (S rows of this rank's T tokens in
  // rows_values_ / rows_scales_): the counts, the all-gather of rows, ids and weights, the rank's experts
  // on every gathered row, its finalize of every gathered token into an fp32 partial (its own slots only),
  // the partials' all-to-all to the tokens' ranks and their sum in rank order.
  Status forward_all_gather(cudaStream_t stream, const ExpertParallelArgs& a, int64_t T, int64_t S) {
    const char* fn = "ExpertParallelLayer::forward";
    const MoeProblem& p = problem_;
    const int64_t H = p.hidden, k = p.top_k();
    const int rk = rows_top_k_;
    const int64_t rows_per_token = rk == 1 ? k : 1;
    if (Status s = mark(kPacked, stream); !s.ok()) return s;
    // counts: every rank's T (every rank gets the same table, so a capacity failure is every rank's)
    for (int d = 0; d < N_; ++d) counts_out_[size_t(d)] = T;
    if (Status s = comm_.exchange_counts(counts_out_.data(), counts_in_.data(), 1); !s.ok()) return s;
    std::vector<int64_t>& token_first = recv_rows_h_;  // [N + 1]: the gathered tokens of rank s start at [s]
    token_first[0] = 0;
    for (int s = 0; s < N_; ++s) token_first[size_t(s) + 1] = token_first[size_t(s)] + counts_in_[size_t(s)];
    const int64_t tokens = token_first[size_t(N_)], rows = tokens * rows_per_token;
    if (rows > capacity_)
      return Status::failure(detail::concat(fn, ": the group's ", tokens, " tokens are ", rows,
                                            " rows, over the receive capacity of ", capacity_, " rows per rank"));
    // all-gather: the same bytes to every rank (send_ends), landing source-major
    std::vector<int64_t>& zeros = byte_offsets_[0];
    std::fill(zeros.begin(), zeros.end(), 0);
    const int64_t per_token[4] = {rows_per_token * value_bytes_, 4 * k, 4 * k, rows_per_token * scale_bytes_};
    const void* sends[4] = {rows_values_->ptr, a.topk_ids, a.topk_weights, rows_scales_->ptr};
    void* recvs[4] = {recv_values_->ptr, recv_ids_->ptr, recv_weights_->ptr, recv_scales_->ptr};
    Communicator::Exchange gather_all[4];
    for (int i = 0; i < 4; ++i) {
      std::vector<int64_t>&ends = byte_offsets_[1 + i], &recv = byte_offsets_[5 + i];
      std::fill(ends.begin(), ends.end(), T * per_token[i]);
      scale_offsets(token_first, per_token[i], recv);
      gather_all[i] = {sends[i], zeros.data(), recvs[i], recv.data(), ends.data()};
    }
    if (Status s = comm_.all_to_all_v(stream, gather_all, scale_bytes_ > 0 ? 4 : 3); !s.ok()) return s;
    if (Status s = mark(kDispatched, stream); !s.ok()) return s;

    // the rank's experts on every gathered row: the whole layer's ids mapped to the rank's (-1: another's)
    kernels::LocalizeIdsArgs li;
    li.ids = recv_ids_->as<int32_t>();
    li.num_ids = int(tokens * k);
    li.first_expert = int(first_expert_);
    li.num_local_experts = int(local_.num_experts);
    li.local = local_ids_->as<int32_t>();
    if (cudaError_t e = kernels::launch_localize_ids(li, stream); e != cudaSuccess)
      return Status::failure(cuda_message("localize_ids", e));
    // [tokens, k] local ids are [rows, rows_top_k] either way
    if (rows > 0)
      if (Status s = run_experts(stream, rows, local_ids_->as<int32_t>()); !s.ok()) return s;
    if (Status s = mark(kExpertsDone, stream); !s.ok()) return s;

    // the rank's partial of every gathered token: its own slots, in slot order, fp32
    kernels::FinalizeArgs f;
    f.y = y_recv_->as<float>();
    f.topk_weights = recv_weights_->as<float>();
    f.num_tokens = int(tokens);
    f.top_k = int(k);
    f.hidden_size = int(H);
    f.unit_weights = p.routing.apply_router_weight_on_input;
    f.topk_ids = local_ids_->as<int32_t>();
    f.num_experts = int(local_.num_experts);
    f.skip_foreign_ids = true;
    f.bias = w2_bias_ ? w2_bias_->as<float>() + first_expert_ * H : nullptr;
    f.out_f32 = partial_->as<float>();
    if (tokens > 0)
      if (cudaError_t e = kernels::launch_finalize(f, stream); e != cudaSuccess)
        return Status::failure(cuda_message("finalize", e));
    if (Status s = mark(kCompacted, stream); !s.ok()) return s;

    // the partials' reduce-scatter: rank d's tokens' rows of every rank's partial to d, summed there
    std::vector<int64_t>&send = byte_offsets_[9], &recv = byte_offsets_[10];
    scale_offsets(token_first, 4 * H, send);
    for (int s = 0; s <= N_; ++s) recv[size_t(s)] = int64_t(s) * T * 4 * H;
    Communicator::Exchange scatter = {partial_->ptr, send.data(), partials_in_->ptr, recv.data()};
    if (Status s = comm_.all_to_all_v(stream, &scatter, 1); !s.ok()) return s;
    if (Status s = mark(kCombined, stream); !s.ok()) return s;
    kernels::SumPartialsArgs sp;
    sp.partials = partials_in_->as<float>();
    sp.ranks = N_;
    sp.num_tokens = int(T);
    sp.hidden_size = int(H);
    if (a.output_dtype == OutputDType::F32) sp.out_f32 = static_cast<float*>(a.output);
    else sp.out = static_cast<__nv_bfloat16*>(a.output);
    sp.topk_ids = a.topk_ids;
    sp.top_k = int(k);
    sp.num_experts = int(p.num_experts);
    if (cudaError_t e = kernels::launch_sum_partials(sp, stream); e != cudaSuccess)
      return Status::failure(cuda_message("sum_partials", e));
    if (Status s = mark(kFinalized, stream); !s.ok()) return s;
    timed_ = events_ != nullptr;

    traffic_.rows_sent = S * N_;
    traffic_.rows_received = rows;
    traffic_.dispatch_bytes = N_ * (S * (value_bytes_ + scale_bytes_) + T * 8 * k);
    traffic_.combine_bytes = tokens * 4 * H;
    return Status::success();
  }

  Status gather(cudaStream_t stream, const int32_t* index, int rows, const int32_t* device_count, const void* src,
                void* dst, int64_t row_bytes) {
    kernels::GatherRowsArgs g;
    g.index = index;
    g.max_rows = rows;
    g.device_count = device_count;
    g.src = src;
    g.dst = dst;
    g.row_bytes = row_bytes;
    if (cudaError_t e = kernels::launch_gather_rows(g, stream); e != cudaSuccess)
      return Status::failure(cuda_message("gather_rows", e));
    return Status::success();
  }
  Communicator& comm_;
  const int N_, rank_, device_;
  const MoeProblem local_;
  const int64_t first_expert_;  // the rank's experts are [first_expert_, first_expert_ + local_.num_experts)
  const ExpertParallelScheme scheme_;
  int rows_top_k_ = 1;
  RowFormat format_ = RowFormat::BF16;
  int64_t value_bytes_ = 0, scale_bytes_ = 0, max_rows_ = 0, capacity_ = 0;
  std::unique_ptr<MoeRunner> runner_;
  std::unique_ptr<GpuRouter> router_;
  std::unique_ptr<DeviceBuffer> rows_values_, rows_scales_, send_offsets_, send_entry_offsets_, send_rows_, send_ids_,
      gather_index_, send_values_, send_scales_, recv_values_, recv_scales_, recv_ids_, compact_list_, y_recv_, y_send_,
      y_comb_, y_, input_scale_, w2_bias_, workspace_;
  std::unique_ptr<DeviceBuffer> recv_weights_, local_ids_, partial_, partials_in_;  // AllGather
  size_t workspace_bytes_ = 0;
  std::unique_ptr<PinnedInts> host_offsets_;
  // Host tables of the count exchange, sized at create (no host allocation in forward): counts_in_
  // [src * 2N + x], rows_matrix_ [src * N + dst], the row/entry offsets [N + 1] and their byte offsets.
  std::vector<int64_t> counts_out_, counts_in_, rows_matrix_, send_rows_h_, recv_rows_h_, send_entries_h_,
      recv_entries_h_;
  std::vector<int64_t> byte_offsets_[12];
  std::unique_ptr<StageEvents> events_;
  bool timed_ = false;
  bool prepared_ = false;
  ExpertParallelTraffic traffic_;
};

}  // namespace

std::unique_ptr<ExpertParallelLayer> ExpertParallelLayer::create(const MoeProblem& problem, int64_t max_tokens,
                                                                 Communicator& comm, const ExpertParallelOptions& options,
                                                                 int device) {
  problem.validate();
  check(!problem.routing.skip_foreign_ids, "ExpertParallelLayer::create: the problem is the whole layer's; "
                                           "skip_foreign_ids belongs to a rank's own problem");
  check(comm.size() >= 1 && comm.size() <= problem.num_experts, "ExpertParallelLayer::create: the group size must be in [1, E=",
        problem.num_experts, "], got ", comm.size());
  check(comm.rank() >= 0 && comm.rank() < comm.size(), "ExpertParallelLayer::create: rank ", comm.rank(),
        " is outside the group of ", comm.size());
  check(max_tokens >= 0, "ExpertParallelLayer::create: max_tokens must be >= 0, got ", max_tokens);
  check(options.receive_capacity_rows >= 0, "ExpertParallelLayer::create: receive_capacity_rows must be >= 0, got ",
        options.receive_capacity_rows);
  require_hopper_device(device, "ExpertParallelLayer::create");
  return std::make_unique<GpuExpertParallelLayer>(problem, max_tokens, comm, options, device);
}

}  // namespace fp4moe
