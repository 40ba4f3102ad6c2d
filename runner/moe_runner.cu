// runner/moe_runner.cu — MoeRunner on an sm_90a GPU: argument checks, prepared weights, workspace
// plan and the launch sequence of one forward.
//
// forward:         route -> permute -> gather/quantize -> GEMM1+activation -> GEMM2 -> finalize
//                  (streaming kernel, w4a16 or scalar w4a4: no gather/quantize, GEMM1 gathers the
//                  hidden rows or the rows the route kernel quantized;
//                  top-1, or top-k on the streaming kernel: no finalize, GEMM2 writes the output)
// forward_routed:  validate ids -> permute -> ...            (same from permute on)
//
// Every launch is asynchronous on the caller's stream; nothing here synchronises or allocates after
// prepare_weights, so a forward can be captured in a CUDA graph (one graph per token count T).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

#include "fp4moe/runner.hpp"
#include "kernels/launch.hpp"
#include "runner/hopper_device.hpp"

namespace fp4moe {
namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

std::string cuda_message(const char* what, cudaError_t e) {
  return detail::concat(what, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// Device memory owned by the runner (weights and per-expert scalars), freed with it.
class DeviceBytes {
 public:
  DeviceBytes() = default;
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() { reset(); }
  void reset() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
  }
  // Uploads `bytes` bytes; returns an error message or "".
  std::string upload(const void* host, size_t bytes, const char* name) {
    reset();
    cudaError_t e = cudaMalloc(&ptr_, std::max<size_t>(bytes, 1));
    if (e != cudaSuccess) return detail::concat("prepare_weights: allocating ", name, " (", bytes, " bytes): ", cudaGetErrorString(e));
    e = cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) return detail::concat("prepare_weights: uploading ", name, ": ", cudaGetErrorString(e));
    return {};
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

// Smallest tile of any tactic: the tile table is sized for it.
constexpr int kMinTileRows = 16;

// Offsets of the workspace regions for a given max token count.
struct WorkspacePlan {
  size_t expert_offsets, row_to_entry, entry_to_row, tile_expert, tile_row_start, num_tiles;
  size_t permute_scratch, a1, act, y, split1, split2, finalize_counters, tile_ready;
  size_t total;
  int64_t max_tiles;

  // split1_bytes / split2_bytes: the streaming GEMMs' split-K workspaces (partial sums) of the largest
  // need among the tactics the runner may use (0 when none splits).
  WorkspacePlan(const MoeProblem& p, int64_t max_tokens, size_t split1_bytes, size_t split2_bytes) {
    const int64_t entries = max_tokens * p.top_k();
    max_tiles = kernels::max_tiles(entries, p.num_experts, kMinTileRows);
    size_t at = 0;
    auto take = [&at](size_t bytes) { size_t here = at; at += align_up(bytes); return here; };
    expert_offsets = take(sizeof(int32_t) * (p.num_experts + 1));
    row_to_entry = take(sizeof(int32_t) * entries);
    entry_to_row = take(sizeof(int32_t) * entries);
    tile_expert = take(sizeof(int32_t) * max_tiles);
    tile_row_start = take(sizeof(int32_t) * max_tiles);
    num_tiles = take(sizeof(int32_t));
    permute_scratch = take(kernels::permute_scratch_bytes(entries, p.num_experts));
    a1 = take(sizeof(__nv_bfloat16) * entries * p.hidden);
    act = take(sizeof(__nv_bfloat16) * entries * p.inter);
    y = take(sizeof(float) * entries * p.hidden);
    split1 = take(split1_bytes);
    split2 = take(split2_bytes);
    finalize_counters = take(sizeof(int32_t) * kernels::gemm2_finalize_counter_count(max_tokens, p.hidden));
    tile_ready = take(sizeof(int32_t) * max_tiles);
    total = at;
  }
};

template <typename T>
T* region(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

class GpuMoeRunner final : public MoeRunner {
 public:
  GpuMoeRunner(const MoeProblem& p, int64_t max_tokens, int device, const DeviceKey& key)
      : MoeRunner(p, max_tokens), device_(device) {
    init_tactics(key);
  }

  Status prepare_weights(const reference::MoeWeights& w, const WeightPrepOptions& options) override;
  size_t workspace_size(int64_t max_tokens) const override { return plan(max_tokens).total; }
  Status forward(CUstream_st* stream, const ForwardArgs& args) override {
    return run(stream, args, /*routed=*/false, nullptr);
  }
  Status forward_routed(CUstream_st* stream, const ForwardArgs& args) override {
    return run(stream, args, /*routed=*/true, nullptr);
  }
  Status forward_marked(CUstream_st* stream, const ForwardArgs& args, bool routed,
                        CUevent_st* const marks[kForwardStages + 1]) override {
    return run(stream, args, routed, marks);
  }

 private:
  Status prepare_weights_or_throw(const reference::MoeWeights& w, const WeightPrepOptions& options);
  Status check_args(cudaStream_t stream, const ForwardArgs& args, bool routed) const;
  // The workspace of the current tactic choice (selector or forced): split-K tactics add the streaming
  // GEMMs' partial sums for the largest T they serve.
  WorkspacePlan plan(int64_t max_tokens) const {
    size_t split1 = 0, split2 = 0;
    auto add = [&](const MoeTactic& t, int64_t T) {  // the split-K workspaces of tactic t at up to T tokens
      if (t.kernel != GemmKernel::Sm90Stream || (t.split_k1 <= 1 && t.split_k2 <= 1)) return;
      const int64_t tiles = kernels::max_tiles(T * problem_.top_k(), problem_.num_experts, t.tile_tokens);
      split1 = std::max(split1, kernels::gemm_stream_workspace_bytes(tiles, problem_.w13_rows(), t.tile_tokens,
                                                                     t.split_k1));
      split2 = std::max(split2, kernels::gemm_stream_workspace_bytes(tiles, problem_.hidden, t.tile_tokens,
                                                                     t.split_k2));
    };
    // NOTE: an expert-parallel rank chooses by tactic_tokens (fewer than T): a bucket's tactic may
    // then serve up to max_tokens tokens, so its split workspace is sized for them.
    const bool scaled = tactic_tokens(problem_, max_tokens) != max_tokens;
    if (forced_tactic_) {
      add(*forced_tactic_, max_tokens);
    } else {
      for (int b = 0; b < num_buckets(); ++b) {
        const BucketRange r = bucket_range(b);
        if (r.lo > max_tokens) break;
        add(selector_->choices()[b].tactic, scaled ? max_tokens : std::min(r.hi, max_tokens));
      }
    }
    return WorkspacePlan(problem_, max_tokens, split1, split2);
  }
  Status run(cudaStream_t stream, const ForwardArgs& args, bool routed, cudaEvent_t const* marks);

  int device_;
  bool prepared_ = false;
  kernels::PrepackedWeights w13_, w2_;           // layout chosen by the GEMM kernels
  DeviceBytes w13_bytes_, w13_scale_bytes_, w2_bytes_, w2_scale_bytes_;
  DeviceBytes alpha1_, alpha2_, act_scale_, input_scale_;  // [E] fp32 each; input_scale_ [1] or [E]
  DeviceBytes w13_bias_, w2_bias_;  // optional expert biases: [E, w13_rows] (rows [gate; up]), [E, H] fp32
  bool has_w13_bias_ = false, has_w2_bias_ = false;
};

// Validates one per-expert scale vector: finite and > 0.
std::string check_scales(const float* v, int64_t n, const char* name) {
  if (!v) return detail::concat("prepare_weights: ", name, " is null (expected [", n, "] f32)");
  for (int64_t e = 0; e < n; ++e)
    if (!std::isfinite(v[e]) || !(v[e] > 0.0f))
      return detail::concat("prepare_weights: ", name, "[", e, "] must be finite and > 0, got ", v[e]);
  return {};
}

Status GpuMoeRunner::prepare_weights(const reference::MoeWeights& w, const WeightPrepOptions& options) {
  try {
    return prepare_weights_or_throw(w, options);
  } catch (const Error& e) {  // e.g. a NaN block scale found while pre-arranging the weights
    return Status::failure(detail::concat("prepare_weights: ", e.what()));
  }
}

Status GpuMoeRunner::prepare_weights_or_throw(const reference::MoeWeights& w, const WeightPrepOptions& options) {
  const MoeProblem& p = problem_;
  const int64_t E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows();
  const bool w4a4 = p.act_quant != ActQuant::W4A16;
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Status::failure(cuda_message("cudaSetDevice", e));
  for (auto [ptr, name] : {std::pair<const void*, const char*>{w.w13, "w13"}, {w.w13_scale, "w13_scale"},
                           {w.w2, "w2"}, {w.w2_scale, "w2_scale"}})
    if (!ptr) return Status::failure(detail::concat("prepare_weights: ", name, " is null"));
  for (auto [v, name] : {std::pair<const float*, const char*>{w.w13_scale_2, "w13_scale_2"}, {w.w2_scale_2, "w2_scale_2"}})
    if (auto m = check_scales(v, E, name); !m.empty()) return Status::failure(m);
  if (w4a4)
    for (auto [v, name] : {std::pair<const float*, const char*>{w.w13_input_scale, "w13_input_scale"},
                           {w.w2_input_scale, "w2_input_scale"}})
      if (auto m = check_scales(v, E, name); !m.empty()) return Status::failure(m);

  reference::check_input_scale_max(w, E, p.act_quant);
  reference::check_biases(w, p);
  // Canonical layout first: linear scales, [gate; up] row order.
  const io::CanonicalExpertWeights canonical = io::canonical_expert_weights(p, w, options);

  if (cudaError_t e = kernels::configure_expert_gemm(); e != cudaSuccess)
    return Status::failure(cuda_message("prepare_weights: configuring the expert GEMM", e));
  std::vector<uint8_t> packed, packed_scale;
  std::string m;
  w13_ = kernels::prepack_expert_weights(canonical.w13.data(), canonical.w13_scale.data(), E, N13, H, packed, packed_scale);
  if (m = w13_bytes_.upload(packed.data(), packed.size(), "w13"); !m.empty()) return Status::failure(m);
  if (m = w13_scale_bytes_.upload(packed_scale.data(), packed_scale.size(), "w13_scale"); !m.empty()) return Status::failure(m);
  w2_ = kernels::prepack_expert_weights(w.w2, canonical.w2_scale.data(), E, H, I, packed, packed_scale);
  if (m = w2_bytes_.upload(packed.data(), packed.size(), "w2"); !m.empty()) return Status::failure(m);
  if (m = w2_scale_bytes_.upload(packed_scale.data(), packed_scale.size(), "w2_scale"); !m.empty()) return Status::failure(m);

  // Global scales (DESIGN.md §1): alpha1 = w13_scale_2 * a, alpha2 = w2_scale_2 (* w2_input_scale).
  std::vector<float> alpha1(E), alpha2(E), act_scale(E, 1.0f), input_scale;
  float a_scalar = 0.0f;
  if (p.act_quant == ActQuant::W4A4Scalar)
    a_scalar = w.w13_input_scale_max > 0.0f ? w.w13_input_scale_max  // the whole layer's (expert parallelism)
                                            : *std::max_element(w.w13_input_scale, w.w13_input_scale + E);
  for (int64_t e = 0; e < E; ++e) {
    switch (p.act_quant) {
      case ActQuant::W4A16: alpha1[e] = w.w13_scale_2[e]; alpha2[e] = w.w2_scale_2[e]; break;
      case ActQuant::W4A4Scalar: alpha1[e] = w.w13_scale_2[e] * a_scalar; break;
      case ActQuant::W4A4PerExpert: alpha1[e] = w.w13_scale_2[e] * w.w13_input_scale[e]; break;
    }
    if (w4a4) {
      alpha2[e] = w.w2_scale_2[e] * w.w2_input_scale[e];
      act_scale[e] = w.w2_input_scale[e];
    }
  }
  if (p.act_quant == ActQuant::W4A4Scalar) input_scale = {a_scalar};
  else if (p.act_quant == ActQuant::W4A4PerExpert) input_scale.assign(w.w13_input_scale, w.w13_input_scale + E);
  else input_scale = {1.0f};
  if (m = alpha1_.upload(alpha1.data(), E * sizeof(float), "alpha1"); !m.empty()) return Status::failure(m);
  if (m = alpha2_.upload(alpha2.data(), E * sizeof(float), "alpha2"); !m.empty()) return Status::failure(m);
  if (m = act_scale_.upload(act_scale.data(), E * sizeof(float), "w2_input_scale"); !m.empty()) return Status::failure(m);
  if (m = input_scale_.upload(input_scale.data(), input_scale.size() * sizeof(float), "w13_input_scale"); !m.empty())
    return Status::failure(m);
  // Expert biases: w13's in the canonical row order (the GEMM1 epilogue indexes it by output column),
  // w2's as given.
  has_w13_bias_ = !canonical.w13_bias.empty();
  has_w2_bias_ = w.w2_bias != nullptr;
  if (has_w13_bias_)
    if (m = w13_bias_.upload(canonical.w13_bias.data(), canonical.w13_bias.size() * sizeof(float), "w13_bias");
        !m.empty())
      return Status::failure(m);
  if (has_w2_bias_)
    if (m = w2_bias_.upload(w.w2_bias, E * H * sizeof(float), "w2_bias"); !m.empty()) return Status::failure(m);
  prepared_ = true;
  return Status::success();
}

Status GpuMoeRunner::check_args(cudaStream_t stream, const ForwardArgs& a, bool routed) const {
  const char* fn = routed ? "forward_routed" : "forward";
  auto fail = [fn](auto&&... parts) { return Status::failure(detail::concat(fn, ": ", parts...)); };
  if (!prepared_) return fail("weights are not prepared (call prepare_weights first)");
  if (a.num_tokens < 0 || a.num_tokens > max_tokens_)
    return fail("num_tokens must be in [0, max_tokens=", max_tokens_, "], got ", a.num_tokens);
  const size_t need = workspace_size(max_tokens_);
  if (a.workspace_bytes < need)
    return fail("workspace_bytes must be >= workspace_size(max_tokens) = ", need, ", got ", a.workspace_bytes,
                " (the size depends on the tactics: ask again after force_tactic / use_tune_cache)");
  if (routed && problem_.routing.method != RoutingMethod::Precomputed && a.router_logits)
    return fail("router_logits given to forward_routed; use forward to route from logits");
  if (!routed && problem_.routing.method == RoutingMethod::Precomputed)
    return fail("routing method is precomputed: call forward_routed with topk_ids/topk_weights");
  if (a.num_tokens == 0) return Status::success();
  // NOTE: pointer and stream queries are not stream operations, but CUDA counts them as unsafe while
  // a graph is captured in global mode; a capturing call checks what needs no query.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    return fail("the stream is not a valid CUDA stream");
  }
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  // A bias is read by deepseek_v3 only; the other methods accept one and ignore it (routing_uses_bias).
  const bool bias_read = a.routing_bias != nullptr && routing_uses_bias(problem_.routing.method);
  const size_t T = size_t(a.num_tokens), H = size_t(problem_.hidden), E = size_t(problem_.num_experts),
               k = size_t(problem_.top_k());
  const size_t logits_elem = a.logits_dtype == LogitsDType::F32 ? 4 : 2;
  struct Ptr { const void* p; const char* name; size_t align; size_t bytes; bool written; bool used; };
  // NOTE: a fixed array, not a vector: the forward path allocates nothing on the host either.
  const Ptr ptrs[] = {
      {a.hidden, "hidden", 16, T * H * 2, false, true},
      {a.output, "output", 16, T * H * (a.output_dtype == OutputDType::F32 ? 4 : 2), true, true},
      {a.topk_ids, "topk_ids", 4, T * k * 4, !routed, true},
      {a.topk_weights, "topk_weights", 4, T * k * 4, !routed, true},
      {a.workspace, "workspace", kAlign, a.workspace_bytes, true, true},
      {a.router_logits, "router_logits", logits_elem, T * E * logits_elem, false, !routed},
      {a.routing_bias, "routing_bias", 4, E * 4, false, bias_read}};
  for (const Ptr& q : ptrs) {
    if (!q.used) continue;
    if (!q.p) return fail(q.name, " is null");
    if (reinterpret_cast<uintptr_t>(q.p) % q.align != 0)
      return fail(q.name, " must be ", q.align, "-byte aligned, got address ", q.p);
    if (capturing) continue;
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, q.p) != cudaSuccess || attr.type != cudaMemoryTypeDevice)
      return (void)cudaGetLastError(), fail(q.name, " must be device memory");
    if (attr.device != device_) return fail(q.name, " is on device ", attr.device, " but the runner is on device ", device_);
  }
  // What the forward writes must not overlap what it reads or another of its outputs: the kernels
  // read their inputs after earlier stages have written.
  for (const Ptr& w : ptrs) {
    if (!w.used || !w.written) continue;
    const auto wb = reinterpret_cast<uintptr_t>(w.p);
    for (const Ptr& q : ptrs) {
      if (&q == &w || !q.used || (q.written && &q < &w)) continue;  // each pair of outputs once
      const auto qb = reinterpret_cast<uintptr_t>(q.p);
      if (wb < qb + q.bytes && qb < wb + w.bytes)
        return fail(w.name, " overlaps ", q.name, " (", w.bytes, " bytes at ", w.p, ", ", q.bytes, " bytes at ", q.p,
                    "); outputs and the workspace need memory of their own");
    }
  }
  if (stream && !capturing) {
    int stream_device = -1;
    if (cudaStreamGetDevice(stream, &stream_device) == cudaSuccess && stream_device != device_)
      return fail("stream belongs to device ", stream_device, " but the runner is on device ", device_);
    (void)cudaGetLastError();
  }
  return Status::success();
}

// A stage mark of forward_marked. NOTE: external, so that a stream capture of the forward turns it into
// an event record node of the graph (timed at replay) instead of a dependency-only event.
inline void record_mark(cudaEvent_t mark, cudaStream_t stream) {
  cudaEventRecordWithFlags(mark, stream, cudaEventRecordExternal);
}

// Launches one stage; on failure returns the kernel's name and the CUDA error. With marks, records
// the stage's end event.
#define FP4MOE_LAUNCH(stage, name, call)                                                             \
  do {                                                                                               \
    if (cudaError_t e_ = (call); e_ != cudaSuccess)                                                  \
      return Status::failure(detail::concat(fn, ": kernel ", name, ": ", cudaGetErrorName(e_), " (", \
                                            cudaGetErrorString(e_), ")"));                           \
    if (marks) record_mark(marks[stage], stream);                                                    \
  } while (0)

Status GpuMoeRunner::run(cudaStream_t stream, const ForwardArgs& a, bool routed, cudaEvent_t const* marks) {
  const char* fn = routed ? "forward_routed" : "forward";
  if (Status s = check_args(stream, a, routed); !s.ok()) return s;
  (void)cudaGetLastError();  // a stale error of earlier, unrelated work must not be blamed on our kernels
  const MoeProblem& p = problem_;
  const int T = static_cast<int>(a.num_tokens), k = p.top_k(), E = static_cast<int>(p.num_experts);
  if (T == 0) return Status::success();
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Status::failure(cuda_message("cudaSetDevice", e));
  const WorkspacePlan plan = this->plan(max_tokens_);
  const int64_t entries = int64_t(T) * k;
  void* ws = a.workspace;
  auto* ids = a.topk_ids;
  auto* weights = a.topk_weights;
  const TacticSelector::Choice choice = choice_for(T);
  const MoeTactic& tactic = choice.tactic;
  if (log_level() >= LogLevel::Debug)
    log_line(forced_tactic_ ? detail::concat("forward ", p.describe(), " T=", T, " tactic ", describe(tactic), " (forced)")
                            : describe_choice(p, T, choice),
             LogLevel::Debug);
  const int tile_rows = kernels::gemm_tile_rows(tactic);
  const int64_t tiles = kernels::max_tiles(entries, E, tile_rows);

  if (marks) record_mark(marks[0], stream);
  if (routed && marks) record_mark(marks[1], stream);
  // NOTE: GEMM1 (either kernel) gathers its activation rows itself (row -> entry -> token), so the
  // gather_quantize launch is skipped: w4a16 reads the hidden rows, scalar w4a4 the rows that the route
  // kernel quantized once per token (into a1 as [T, H]). One launch and T*k row copies (written, then
  // read again by GEMM1) fewer. Per-expert w4a4 (a scale per copy), the router weight on the input and
  // caller-given ids with w4a4 keep it. (The route kernel quantizes in the CTA of each token for
  // DeepSeekV3 routing, in blocks of its own beside the routing warps for the other methods.)
  const bool gather_ok = !p.routing.apply_router_weight_on_input;
  const bool quantize_in_route = gather_ok && !routed && p.act_quant == ActQuant::W4A4Scalar;
  const bool gather_in_gemm1 = gather_ok && (p.act_quant == ActQuant::W4A16 || quantize_in_route);
  kernels::PermuteArgs pa;
  pa.topk_ids = ids;
  pa.num_tokens = T;
  pa.top_k = k;
  pa.num_experts = E;
  pa.tile_rows = tile_rows;
  pa.expert_offsets = region<int32_t>(ws, plan.expert_offsets);
  pa.row_to_entry = region<int32_t>(ws, plan.row_to_entry);
  pa.entry_to_row = region<int32_t>(ws, plan.entry_to_row);
  pa.tile_expert = region<int32_t>(ws, plan.tile_expert);
  pa.tile_row_start = region<int32_t>(ws, plan.tile_row_start);
  pa.num_tiles = region<int32_t>(ws, plan.num_tiles);
  pa.scratch = region<void>(ws, plan.permute_scratch);
  // NOTE: with at most finalize_in_gemm2_entries entries the streaming GEMM2 finalizes top-k > 1 itself
  // (arrival counters per token and N tile, the last row's CTA sums the slots in order): one launch
  // fewer, and y is re-read right after it is written. The permutation clears the counters. With more
  // entries the finalize launch is faster: the hand-off (a CTA barrier, a gpu-scope fence and atomic,
  // then the slot loads) holds every GEMM2 CTA's slot for its round trips (~10% of GEMM2's warp
  // samples at deepseek-r1 T = 64, ncu), while the finalize launch reads y once (A/B 40 decode rows
  // T = 8..128: geomean 0.995 in both modes, qwen3-30b-a3b T = 128 -2.4%; docs/perf.md, thirteenth
  // session). With the slot loads issued first (nvfp4::finalize_token8) the fused finalize also wins at
  // 64 entries: fused up to 512 against the launch, w4a16 (sixteenth session): T = 8 (64 entries)
  // qwen3-30b-a3b 0.965, qwen3-235b-a22b 0.982, deepseek-r1 1.001; T = 16 0.989-1.007; T = 64 1.007-1.018.
  // With GEMM2 waiting per tile (GemmEarlyStart::TileReady), up to 128 entries where H <= 4096 (A/B,
  // twentieth session, T = 9 / 12 / 16 w4a16, twice: qwen3-30b-a3b 0.95 / 0.97 / 0.97, qwen3-235b-a22b
  // 0.99-1.00; deepseek-r1, H = 7168, 1.00 / 1.01 / 1.01, so it stays at 64 there).
  // Caller-given ids keep the separate finalize, which turns an out-of-range id (a token with
  // fewer than k GEMM rows) into a NaN row.
  const int64_t finalize_in_gemm2_entries = p.hidden <= 4096 ? 128 : 64;
  // NOTE: fp32 outputs (partials of tensor / expert parallelism) take the separate finalize, whose
  // store has both forms; the fused finalizes store bf16 only.
  // NOTE: so do expert biases: the separate finalize adds w2_bias (y + b, one fp32 add, then w * (y + b)).
  const bool f32_output = a.output_dtype == OutputDType::F32;
  const bool finalize_in_gemm2 = k > 1 && !routed && !f32_output && !has_w2_bias_ &&
                                 tactic.kernel == GemmKernel::Sm90Stream && entries <= finalize_in_gemm2_entries;
  if (finalize_in_gemm2) {
    pa.zero_words[0] = region<int32_t>(ws, plan.finalize_counters);
    pa.zero_count[0] = kernels::gemm2_finalize_counter_count(T, p.hidden);
  }
  // NOTE: the split-K arrival counters must be zero when the GEMMs start, and the workspace may be
  // shared with other work between forwards: the permute launch clears them too (a memset node before
  // the route kernel cost the chain of dependent launches its start).
  // GEMM1 splits tactic.split_k1 ways, GEMM2 tactic.split_k2 ways.
  if (tactic.split_k1 > 1) {
    pa.zero_words[1] = region<int32_t>(ws, plan.split1);
    pa.zero_count[1] = static_cast<int64_t>(kernels::gemm_stream_counter_bytes(tiles, p.w13_rows()) / sizeof(int32_t));
  }
  if (tactic.split_k2 > 1) {
    pa.zero_words[2] = region<int32_t>(ws, plan.split2);
    pa.zero_count[2] = static_cast<int64_t>(kernels::gemm_stream_counter_bytes(tiles, p.hidden) / sizeof(int32_t));
  }
  // NOTE (GEMM1 -> GEMM2 per tile, kernels/launch.hpp GemmEarlyStart::TileReady): with the streaming
  // kernel, each GEMM2 CTA waits for its own tile's GEMM1 CTAs instead of for the whole GEMM1, so the
  // GEMM2 CTAs that take the slots of GEMM1's last wave work while it drains. The counts are cleared here.
  const bool tile_handoff = tactic.kernel == GemmKernel::Sm90Stream;
  if (tile_handoff) {
    pa.zero_words[3] = region<int32_t>(ws, plan.tile_ready);
    pa.zero_count[3] = tiles;
  }
  // NOTE: with few entries the route launch permutes its ids in its one block (launch_route_permute):
  // one boundary fewer in the chain of dependent launches. The stage mark stays, for the bench.
  const bool permute_in_route = !routed && kernels::route_permute_fits(p.routing, T);
  if (!routed) {
    kernels::RouteArgs r;
    r.logits = a.router_logits;
    r.logits_bf16 = a.logits_dtype == LogitsDType::BF16;
    r.bias = a.routing_bias;
    r.num_tokens = T;
    r.num_experts = E;
    r.params = p.routing;
    r.topk_ids = ids;
    r.topk_weights = weights;
    if (quantize_in_route) {
      r.quant_out = region<__nv_bfloat16>(ws, plan.a1);
      r.hidden = static_cast<const __nv_bfloat16*>(a.hidden);
      r.hidden_size = static_cast<int>(p.hidden);
      r.input_scale = input_scale_.as<float>();
    }
    if (permute_in_route) FP4MOE_LAUNCH(1, "route_permute", kernels::launch_route_permute(r, pa, stream));
    else FP4MOE_LAUNCH(1, "route", kernels::launch_route(r, stream));
  }

  if (permute_in_route) {
    if (marks) record_mark(marks[2], stream);
  } else {
    FP4MOE_LAUNCH(2, "permute", kernels::launch_permute(pa, stream));
  }

  kernels::GatherArgs g;
  g.hidden = static_cast<const __nv_bfloat16*>(a.hidden);
  g.entry_to_row = pa.entry_to_row;
  g.topk_ids = ids;
  g.topk_weights = weights;
  g.input_scale = input_scale_.as<float>();
  g.num_tokens = T;
  g.top_k = k;
  g.hidden_size = static_cast<int>(p.hidden);
  g.num_experts = E;
  g.mode = p.act_quant;
  g.scale_by_weight = p.routing.apply_router_weight_on_input;
  g.a1 = region<__nv_bfloat16>(ws, plan.a1);
  if (gather_in_gemm1) {  // the stage mark stays, for the bench's stage times
    if (marks) record_mark(marks[3], stream);
  } else {
    FP4MOE_LAUNCH(3, "gather_quantize", kernels::launch_gather_quantize(g, stream));
  }

  auto common = [&](kernels::ExpertGemmArgs& x, const kernels::PrepackedWeights& pw, const DeviceBytes& wb,
                    const DeviceBytes& sb, const DeviceBytes& alpha, int64_t K, int64_t N) {
    x.w = wb.as<uint8_t>();
    x.w_scale = sb.as<uint8_t>();
    x.weights = pw;
    x.alpha = alpha.as<float>();
    x.expert_offsets = pa.expert_offsets;
    x.tile_expert = pa.tile_expert;
    x.tile_row_start = pa.tile_row_start;
    x.num_tiles = pa.num_tiles;
    x.max_tiles = tiles;
    x.num_experts = E;
    x.K = K;
    x.N = N;
    x.rows = entries;
    x.tactic = tactic;
  };
  kernels::Gemm1Args g1;
  common(g1, w13_, w13_bytes_, w13_scale_bytes_, alpha1_, p.hidden, p.w13_rows());
  g1.a = g.a1;
  if (gather_in_gemm1) {
    g1.a = p.act_quant == ActQuant::W4A16 ? g.hidden : g.a1;  // [T, H]
    g1.rows = T;
    g1.a_row_to_entry = pa.row_to_entry;
    g1.a_top_k = k;
  }
  g1.activation = p.activation;
  g1.mode = p.act_quant;
  g1.act_scale = act_scale_.as<float>();
  g1.act = region<__nv_bfloat16>(ws, plan.act);
  g1.bias = has_w13_bias_ ? w13_bias_.as<float>() : nullptr;
  g1.split_workspace = region<void>(ws, plan.split1);
  // NOTE (early start, kernels/launch.hpp GemmEarlyStart): what a streaming GEMM may read before its
  // dependency wait follows from this launch order. After a gather_quantize launch the tile table is two
  // launches old, so GEMM1 issues its first weight copies while the gather runs. GEMM2 always has GEMM1
  // between it and the permutation, so it always starts early: A/B 20 decode rows T = 8..128 w4a16
  // geomean 0.993 against starting early only up to 32 entries (qwen3-30b-a3b T = 8 86.0 -> 82.2 us;
  // docs/perf.md, thirteenth session), where the eleventh session's run 1 had measured a loss with
  // another change mixed in.
  const bool stream_kernel = tactic.kernel == GemmKernel::Sm90Stream;
  if (stream_kernel && !gather_in_gemm1) g1.early_start = kernels::GemmEarlyStart::TileTable;
  if (tile_handoff) g1.tile_ready = pa.zero_words[3];
  FP4MOE_LAUNCH(4, "gemm1_act", kernels::launch_gemm1_act(g1, stream));

  kernels::Gemm2Args g2;
  common(g2, w2_, w2_bytes_, w2_scale_bytes_, alpha2_, p.inter, p.hidden);
  g2.a = g1.act;
  g2.row_to_entry = pa.row_to_entry;
  g2.y = region<float>(ws, plan.y);
  g2.split_workspace = region<void>(ws, plan.split2);
  if (stream_kernel) g2.early_start = kernels::GemmEarlyStart::TileTable;
  if (tile_handoff) {
    g2.early_start = kernels::GemmEarlyStart::TileReady;
    g2.tile_ready = pa.zero_words[3];
    g2.tile_ready_count = static_cast<int>(kernels::gemm_stream_ctas_along_n(p.w13_rows()));
  }
  // NOTE: with top-1 routing the finalize is one multiply per element: GEMM2 writes the output itself
  // (saves writing and re-reading y). Precomputed ids keep the separate finalize, which turns an
  // out-of-range id (a token without a GEMM row) into a NaN row.
  const bool fuse_finalize = k == 1 && !routed && !f32_output && !has_w2_bias_;
  if (fuse_finalize || finalize_in_gemm2) {
    g2.out = static_cast<__nv_bfloat16*>(a.output);
    g2.out_weights = p.routing.apply_router_weight_on_input ? nullptr : weights;
  }
  if (fuse_finalize) g2.y = nullptr;  // top-1: y is not written
  if (finalize_in_gemm2) {  // top-k: y, then the finalize of each (token, N tile) by its last CTA
    g2.finalize_counters = pa.zero_words[0];
    g2.finalize_top_k = k;
  }
  FP4MOE_LAUNCH(5, "gemm2", kernels::launch_gemm2(g2, stream));
  if (fuse_finalize || finalize_in_gemm2) {
    if (marks) record_mark(marks[6], stream);
    return Status::success();
  }

  kernels::FinalizeArgs f;
  f.y = region<float>(ws, plan.y);
  f.topk_weights = weights;
  f.num_tokens = T;
  f.top_k = k;
  f.hidden_size = static_cast<int>(p.hidden);
  f.unit_weights = p.routing.apply_router_weight_on_input;
  if (routed) {  // caller-given ids may be out of range: bad input, or another rank's experts
    f.topk_ids = ids;
    f.num_experts = E;
    f.skip_foreign_ids = p.routing.skip_foreign_ids;
  }
  if (has_w2_bias_) {  // each slot's bias row by its expert id
    f.topk_ids = ids;
    f.num_experts = E;
    f.bias = w2_bias_.as<float>();
  }
  if (f32_output) f.out_f32 = static_cast<float*>(a.output);
  else f.out = static_cast<__nv_bfloat16*>(a.output);
  FP4MOE_LAUNCH(6, "finalize", kernels::launch_finalize(f, stream));
  return Status::success();
}

}  // namespace

std::unique_ptr<MoeRunner> MoeRunner::create(const MoeProblem& problem, int64_t max_tokens, int device) {
  problem.validate();
  check(max_tokens >= 0, "MoeRunner::create: max_tokens must be >= 0, got ", max_tokens);
  check(problem.num_experts <= 512, "MoeRunner::create: the GPU routing supports up to 512 experts, got E=",
        problem.num_experts);
  check(max_tokens * problem.top_k() < (int64_t(1) << 31), "MoeRunner::create: max_tokens * top_k must fit int32, got ",
        max_tokens * problem.top_k());
  const cudaDeviceProp prop = require_hopper_device(device, "MoeRunner::create");
  DeviceKey key;
  key.fp4moe_version = std::string(fp4moe_version());
  key.gpu_name = prop.name;
  key.sm_count = prop.multiProcessorCount;
  check(cudaRuntimeGetVersion(&key.cuda_runtime) == cudaSuccess, "MoeRunner::create: cudaRuntimeGetVersion failed");
  return std::make_unique<GpuMoeRunner>(problem, max_tokens, device, key);
}

bool cuda_device_available(std::string* why_not) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    if (why_not) *why_not = e != cudaSuccess ? cuda_message("cudaGetDeviceCount", e) : "no CUDA device";
    (void)cudaGetLastError();
    return false;
  }
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess && prop.major == 9 && prop.minor == 0) return true;
  }
  if (why_not) *why_not = "no device of compute capability 9.0 (Hopper) is visible";
  return false;
}

}  // namespace fp4moe
