// runner/moe_runner.cu — MoeRunner on an sm_90a GPU: argument checks, prepared weights, workspace
// plan and the launch sequence of one forward.
//
// forward:         route -> permute -> gather/quantize -> GEMM1+activation -> GEMM2 -> finalize
// forward_routed:  permute -> ...                            (same from permute on)
// Which launches run and which fuse into their neighbours is decided by runner::plan_forward
// (runner/forward_plan.hpp); run() fills the kernels' arguments from that plan and launches.
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
#include "kernels/permute_block.cuh"
#include "runner/device_checks.hpp"
#include "runner/forward_plan.hpp"
#include "runner/hopper_device.hpp"

namespace fp4moe {
namespace {
using runner::DevicePtr;
using runner::check_device_ptrs;

// The plan's copies of the kernels' limits and enums must be the kernels' own.
static_assert(runner::kRoutePermuteMaxEntries == kernels::permute_block::kSmallEntries);
static_assert(runner::kRoutePermuteMaxTokens == kernels::permute_block::kWarps);
static_assert(int(ScaleLayout::Linear) == int(kernels::ScaleLayout::Linear) &&
              int(ScaleLayout::Swizzled128x4) == int(kernels::ScaleLayout::Swizzled128x4));
static_assert(int(runner::EarlyStart::AfterWait) == int(kernels::GemmEarlyStart::AfterWait) &&
              int(runner::EarlyStart::TileTable) == int(kernels::GemmEarlyStart::TileTable) &&
              int(runner::EarlyStart::TileReady) == int(kernels::GemmEarlyStart::TileReady));
// Every split the registry allows is one the streaming launcher accepts.
static_assert([] {
  for (int s : kStreamSplitK)
    if (s < 1 || s > kernels::kMaxStreamSplitK) return false;
  return true;
}());

kernels::GemmEarlyStart early_start(runner::EarlyStart e) { return static_cast<kernels::GemmEarlyStart>(e); }

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

// What both GEMMs of one launch sequence share: the permutation's tile table and the tactic.
struct GemmLaunch {
  const kernels::PermuteArgs& permute;
  int64_t tiles;    // max_tiles of the entries for the tactic's tile
  int64_t entries;  // GEMM rows
  const MoeTactic& tactic;
};

void fill_gemm_common(kernels::ExpertGemmArgs& x, const GemmLaunch& g, const kernels::PrepackedWeights& pw,
                      const DeviceBytes& wb, const DeviceBytes& sb, const DeviceBytes& alpha, int64_t K, int64_t N) {
  x.w = wb.as<uint8_t>();
  x.w_scale = sb.as<uint8_t>();
  x.weights = pw;
  x.alpha = alpha.as<float>();
  x.expert_offsets = g.permute.expert_offsets;
  x.tile_expert = g.permute.tile_expert;
  x.tile_row_start = g.permute.tile_row_start;
  x.num_tiles = g.permute.num_tiles;
  x.max_tiles = g.tiles;
  x.num_experts = g.permute.num_experts;
  x.K = K;
  x.N = N;
  x.rows = g.entries;
  x.tactic = g.tactic;
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
                        CUevent_st* const* marks) override {
    return run(stream, args, routed, marks);
  }
  Status prepare(CUstream_st* stream, const PrepareArgs& args) override;
  Status experts(CUstream_st* stream, const ExpertsArgs& args) override;
  Status finalize(CUstream_st* stream, const FinalizeArgs& args) override;

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
  // What the forward and the experts stage share. The permutation of `rows` rows with top_k ids each into
  // the workspace's tables, clearing the counters the GEMMs of this launch sequence use.
  kernels::PermuteArgs permute_args(void* ws, const WorkspacePlan& plan, const int32_t* ids, int rows, int top_k,
                                    int tile_rows, int64_t tiles, bool clear_split1, bool clear_split2,
                                    bool tile_handoff) const;
  // GEMM1's arguments but its A operand (a, rows and the gather), GEMM2's but its outputs.
  kernels::Gemm1Args gemm1_args(const GemmLaunch& gl, void* ws, const WorkspacePlan& plan, runner::EarlyStart early,
                                bool tile_handoff) const;
  kernels::Gemm2Args gemm2_args(const GemmLaunch& gl, const kernels::Gemm1Args& g1, void* ws,
                                const WorkspacePlan& plan, runner::EarlyStart early, bool tile_handoff) const;

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
  const bool mxfp4 = p.weight_format == WeightFormat::MXFP4;  // w4a16 only (MoeProblem::validate)
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Status::failure(cuda_message("cudaSetDevice", e));
  for (auto [ptr, name] : {std::pair<const void*, const char*>{w.w13, "w13"}, {w.w13_scale, "w13_scale"},
                           {w.w2, "w2"}, {w.w2_scale, "w2_scale"}})
    if (!ptr) return Status::failure(detail::concat("prepare_weights: ", name, " is null"));
  if (!mxfp4)  // MXFP4 has no global scale: its NVFP4 equivalent below brings its own
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
  // The kernels take NVFP4: MXFP4 weights go through their exact NVFP4 equivalent (e4m3 scales per 16 and
  // a power-of-two alpha per expert; io::nvfp4_equivalent refuses ue8m0 codes spanning more than 18
  // powers of two). The problem itself stays MXFP4 (tactics, tuning keys, reports).
  const uint8_t* w13_scale = canonical.w13_scale.data();
  const uint8_t* w2_scale = canonical.w2_scale.data();
  const float* w13_scale_2 = w.w13_scale_2;
  const float* w2_scale_2 = w.w2_scale_2;
  io::Nvfp4EquivalentScales nv;
  if (mxfp4) {
    reference::MoeWeights cw = w;
    cw.w13 = canonical.w13.data();
    cw.w13_scale = w13_scale;
    cw.w2_scale = w2_scale;
    nv = io::nvfp4_equivalent(p, cw);
    w13_scale = nv.w13_scale.data();
    w2_scale = nv.w2_scale.data();
    w13_scale_2 = nv.w13_scale_2.data();
    w2_scale_2 = nv.w2_scale_2.data();
  }

  if (cudaError_t e = kernels::configure_expert_gemm(); e != cudaSuccess)
    return Status::failure(cuda_message("prepare_weights: configuring the expert GEMM", e));
  std::vector<uint8_t> packed, packed_scale;
  std::string m;
  w13_ = kernels::prepack_expert_weights(canonical.w13.data(), w13_scale, E, N13, H, packed, packed_scale);
  if (m = w13_bytes_.upload(packed.data(), packed.size(), "w13"); !m.empty()) return Status::failure(m);
  if (m = w13_scale_bytes_.upload(packed_scale.data(), packed_scale.size(), "w13_scale"); !m.empty()) return Status::failure(m);
  w2_ = kernels::prepack_expert_weights(w.w2, w2_scale, E, H, I, packed, packed_scale);
  if (m = w2_bytes_.upload(packed.data(), packed.size(), "w2"); !m.empty()) return Status::failure(m);
  if (m = w2_scale_bytes_.upload(packed_scale.data(), packed_scale.size(), "w2_scale"); !m.empty()) return Status::failure(m);

  // Global scales (docs/numerics.md, "The layer, step by step"): alpha1 = w13_scale_2 * a, alpha2 = w2_scale_2 (* w2_input_scale).
  std::vector<float> alpha1(E), alpha2(E), act_scale(E, 1.0f), input_scale;
  float a_scalar = 0.0f;
  if (p.act_quant == ActQuant::W4A4Scalar)
    a_scalar = w.w13_input_scale_max > 0.0f ? w.w13_input_scale_max  // the whole layer's (expert parallelism)
                                            : *std::max_element(w.w13_input_scale, w.w13_input_scale + E);
  for (int64_t e = 0; e < E; ++e) {
    switch (p.act_quant) {
      case ActQuant::W4A16: alpha1[e] = w13_scale_2[e]; alpha2[e] = w2_scale_2[e]; break;
      case ActQuant::W4A4Scalar: alpha1[e] = w13_scale_2[e] * a_scalar; break;
      case ActQuant::W4A4PerExpert: alpha1[e] = w13_scale_2[e] * w.w13_input_scale[e]; break;
    }
    if (w4a4) {
      alpha2[e] = w2_scale_2[e] * w.w2_input_scale[e];
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
  // A bias is read by deepseek_v3 only; the other methods accept one and ignore it (routing_uses_bias).
  const bool bias_read = a.routing_bias != nullptr && routing_uses_bias(problem_.routing.method);
  const size_t T = size_t(a.num_tokens), H = size_t(problem_.hidden), E = size_t(problem_.num_experts),
               k = size_t(problem_.top_k());
  const size_t logits_elem = a.logits_dtype == LogitsDType::F32 ? 4 : 2;
  // NOTE: a fixed array, not a vector: the forward path allocates nothing on the host either.
  const DevicePtr ptrs[] = {
      {a.hidden, "hidden", 16, T * H * 2, false, true},
      {a.output, "output", 16, T * H * (a.output_dtype == OutputDType::F32 ? 4 : 2), true, true},
      {a.topk_ids, "topk_ids", 4, T * k * 4, !routed, true},
      {a.topk_weights, "topk_weights", 4, T * k * 4, !routed, true},
      {a.workspace, "workspace", kAlign, a.workspace_bytes, true, true},
      {a.router_logits, "router_logits", logits_elem, T * E * logits_elem, false, !routed},
      {a.routing_bias, "routing_bias", 4, E * 4, false, bias_read}};
  return check_device_ptrs(fn, stream, ptrs, device_);
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
  const TacticSelector::Choice choice = choice_for(T);
  const MoeTactic& tactic = choice.tactic;
  // The registry decides which tactics exist (why_invalid); the launchers' own checks only bound them.
  if (!tactic_valid(p, tactic))
    return Status::failure(detail::concat(fn, ": tactic ", describe(tactic), " cannot run ", p.describe(), ": ",
                                          why_invalid(p, tactic)));
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Status::failure(cuda_message("cudaSetDevice", e));
  if (log_level() >= LogLevel::Debug)
    log_line(forced_tactic_ ? detail::concat("forward ", p.describe(), " T=", T, " tactic ", describe(tactic), " (forced)")
                            : describe_choice(p, T, choice),
             LogLevel::Debug);
  const runner::ForwardPlan fp =
      runner::plan_forward(p, T, tactic, routed, a.output_dtype, has_w2_bias_);
  if (fp.permute_in_route != (!routed && kernels::route_permute_fits(p.routing, T)))
    return Status::failure(detail::concat(fn, ": the forward plan and kernels::route_permute_fits disagree at T=", T));
  const WorkspacePlan ws_plan = plan(max_tokens_);
  void* ws = a.workspace;
  int32_t* ids = a.topk_ids;
  float* weights = a.topk_weights;
  const int64_t tiles = kernels::max_tiles(fp.entries, E, fp.tile_rows);

  kernels::PermuteArgs pa = permute_args(ws, ws_plan, ids, T, k, fp.tile_rows, tiles, fp.clear_split1,
                                         fp.clear_split2, fp.tile_handoff);
  if (fp.finalize_in_gemm2) {
    pa.zero_words[0] = region<int32_t>(ws, ws_plan.finalize_counters);
    pa.zero_count[0] = kernels::gemm2_finalize_counter_count(T, p.hidden);
  }

  // Stage marks are recorded for the stages a plan drops too (the bench's stage times).
  if (marks) record_mark(marks[0], stream);
  if (fp.route) {
    kernels::RouteArgs r;
    r.logits = a.router_logits;
    r.logits_bf16 = a.logits_dtype == LogitsDType::BF16;
    r.bias = a.routing_bias;
    r.num_tokens = T;
    r.num_experts = E;
    r.params = p.routing;
    r.topk_ids = ids;
    r.topk_weights = weights;
    if (fp.quantize_in_route) {
      r.quant_out = region<__nv_bfloat16>(ws, ws_plan.a1);
      r.hidden = static_cast<const __nv_bfloat16*>(a.hidden);
      r.hidden_size = static_cast<int>(p.hidden);
      r.input_scale = input_scale_.as<float>();
    }
    if (fp.permute_in_route) FP4MOE_LAUNCH(1, "route_permute", kernels::launch_route_permute(r, pa, stream));
    else FP4MOE_LAUNCH(1, "route", kernels::launch_route(r, stream));
  } else if (marks) {
    record_mark(marks[1], stream);
  }
  if (fp.permute_in_route) {
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
  g.a1 = region<__nv_bfloat16>(ws, ws_plan.a1);
  if (fp.gather_in_gemm1) {
    if (marks) record_mark(marks[3], stream);
  } else {
    FP4MOE_LAUNCH(3, "gather_quantize", kernels::launch_gather_quantize(g, stream));
  }

  const GemmLaunch gl{pa, tiles, fp.entries, tactic};
  kernels::Gemm1Args g1 = gemm1_args(gl, ws, ws_plan, fp.gemm1_early_start, fp.tile_handoff);
  g1.a = g.a1;
  if (fp.gather_in_gemm1) {
    g1.a = p.act_quant == ActQuant::W4A16 ? g.hidden : g.a1;  // [T, H]
    g1.rows = T;
    g1.a_row_to_entry = pa.row_to_entry;
    g1.a_top_k = k;
  }
  FP4MOE_LAUNCH(4, "gemm1_act", kernels::launch_gemm1_act(g1, stream));

  kernels::Gemm2Args g2 = gemm2_args(gl, g1, ws, ws_plan, fp.gemm2_early_start, fp.tile_handoff);
  g2.y = fp.fuse_finalize ? nullptr : region<float>(ws, ws_plan.y);
  if (!fp.finalize_launch) {
    g2.out = static_cast<__nv_bfloat16*>(a.output);
    g2.out_weights = fp.unit_weights ? nullptr : weights;
  }
  if (fp.finalize_in_gemm2) {
    g2.finalize_counters = pa.zero_words[0];
    g2.finalize_top_k = k;
  }
  FP4MOE_LAUNCH(5, "gemm2", kernels::launch_gemm2(g2, stream));
  if (!fp.finalize_launch) {
    if (marks) record_mark(marks[6], stream);
    return Status::success();
  }

  kernels::FinalizeArgs f;
  f.y = region<float>(ws, ws_plan.y);
  f.topk_weights = weights;
  f.num_tokens = T;
  f.top_k = k;
  f.hidden_size = static_cast<int>(p.hidden);
  f.unit_weights = fp.unit_weights;
  if (fp.finalize_checks_ids) {
    f.topk_ids = ids;
    f.num_experts = E;
    f.skip_foreign_ids = p.routing.skip_foreign_ids;
  }
  if (fp.finalize_bias) {
    f.topk_ids = ids;
    f.num_experts = E;
    f.bias = w2_bias_.as<float>();
  }
  if (fp.f32_output) f.out_f32 = static_cast<float*>(a.output);
  else f.out = static_cast<__nv_bfloat16*>(a.output);
  FP4MOE_LAUNCH(6, "finalize", kernels::launch_finalize(f, stream));
  return Status::success();
}

kernels::PermuteArgs GpuMoeRunner::permute_args(void* ws, const WorkspacePlan& plan, const int32_t* ids, int rows,
                                                int top_k, int tile_rows, int64_t tiles, bool clear_split1,
                                                bool clear_split2, bool tile_handoff) const {
  const MoeProblem& p = problem_;
  kernels::PermuteArgs pa;
  pa.topk_ids = ids;
  pa.num_tokens = rows;
  pa.top_k = top_k;
  pa.num_experts = static_cast<int>(p.num_experts);
  pa.tile_rows = tile_rows;
  pa.expert_offsets = region<int32_t>(ws, plan.expert_offsets);
  pa.row_to_entry = region<int32_t>(ws, plan.row_to_entry);
  pa.entry_to_row = region<int32_t>(ws, plan.entry_to_row);
  pa.tile_expert = region<int32_t>(ws, plan.tile_expert);
  pa.tile_row_start = region<int32_t>(ws, plan.tile_row_start);
  pa.num_tiles = region<int32_t>(ws, plan.num_tiles);
  pa.scratch = region<void>(ws, plan.permute_scratch);
  if (clear_split1) {
    pa.zero_words[1] = region<int32_t>(ws, plan.split1);
    pa.zero_count[1] = static_cast<int64_t>(kernels::gemm_stream_counter_bytes(tiles, p.w13_rows()) / sizeof(int32_t));
  }
  if (clear_split2) {
    pa.zero_words[2] = region<int32_t>(ws, plan.split2);
    pa.zero_count[2] = static_cast<int64_t>(kernels::gemm_stream_counter_bytes(tiles, p.hidden) / sizeof(int32_t));
  }
  if (tile_handoff) {
    pa.zero_words[3] = region<int32_t>(ws, plan.tile_ready);
    pa.zero_count[3] = tiles;
  }
  return pa;
}

kernels::Gemm1Args GpuMoeRunner::gemm1_args(const GemmLaunch& gl, void* ws, const WorkspacePlan& plan,
                                            runner::EarlyStart early, bool tile_handoff) const {
  const MoeProblem& p = problem_;
  kernels::Gemm1Args g1;
  fill_gemm_common(g1, gl, w13_, w13_bytes_, w13_scale_bytes_, alpha1_, p.hidden, p.w13_rows());
  g1.activation = p.activation;
  g1.mode = p.act_quant;
  g1.act_scale = act_scale_.as<float>();
  g1.act = region<__nv_bfloat16>(ws, plan.act);
  g1.bias = has_w13_bias_ ? w13_bias_.as<float>() : nullptr;
  g1.split_workspace = region<void>(ws, plan.split1);
  g1.early_start = early_start(early);
  if (tile_handoff) g1.tile_ready = gl.permute.zero_words[3];
  return g1;
}

kernels::Gemm2Args GpuMoeRunner::gemm2_args(const GemmLaunch& gl, const kernels::Gemm1Args& g1, void* ws,
                                            const WorkspacePlan& plan, runner::EarlyStart early,
                                            bool tile_handoff) const {
  const MoeProblem& p = problem_;
  kernels::Gemm2Args g2;
  fill_gemm_common(g2, gl, w2_, w2_bytes_, w2_scale_bytes_, alpha2_, p.inter, p.hidden);
  g2.a = g1.act;
  g2.row_to_entry = gl.permute.row_to_entry;
  g2.split_workspace = region<void>(ws, plan.split2);
  g2.early_start = early_start(early);
  if (tile_handoff) {
    g2.tile_ready = gl.permute.zero_words[3];
    g2.tile_ready_count = static_cast<int>(kernels::gemm_stream_ctas_along_n(p.w13_rows()));
  }
  return g2;
}

// ---- the layer as stages ----------------------------------------------------------------------------

// The checks every stage makes first.
Status check_stage(const char* fn, bool prepared, int64_t num_tokens, int64_t max_tokens) {
  if (!prepared) return Status::failure(detail::concat(fn, ": weights are not prepared (call prepare_weights first)"));
  if (num_tokens < 0 || num_tokens > max_tokens)
    return Status::failure(detail::concat(fn, ": num_tokens must be in [0, max_tokens=", max_tokens, "], got ", num_tokens));
  return Status::success();
}

// rows must have the shape `want` (prepared_rows of the same T): what prepare writes and what experts reads.
Status check_rows_shape(const char* fn, const StageRows& rows, const StageRows& want) {
  auto name = [](RowFormat f) { return f == RowFormat::BF16 ? "bf16" : "nvfp4"; };
  if (rows.format != want.format)
    return Status::failure(detail::concat(fn, ": rows.format must be ", name(want.format), " for this problem, got ",
                                          name(rows.format)));
  if (rows.num_rows != want.num_rows || rows.rows_top_k != want.rows_top_k)
    return Status::failure(detail::concat(fn, ": rows must be [", want.num_rows, " rows, ", want.rows_top_k,
                                          " ids each] (prepared_rows), got [", rows.num_rows, ", ", rows.rows_top_k, "]"));
  return Status::success();
}

Status GpuMoeRunner::prepare(cudaStream_t stream, const PrepareArgs& a) {
  const char* fn = "prepare";
  if (Status s = check_stage(fn, prepared_, a.num_tokens, max_tokens_); !s.ok()) return s;
  const MoeProblem& p = problem_;
  const StageRowsShape shape = runner::stage_rows_shape(p, a.num_tokens, a.rows.scale_layout);
  if (Status s = check_rows_shape(fn, a.rows, shape.rows); !s.ok()) return s;
  if (a.num_tokens == 0) return Status::success();
  // One row per entry where a token's slots differ (stage_rows_shape decides), else one per token; with
  // k = 1 the two index alike.
  const bool per_entry = shape.rows.rows_top_k == 1;
  const bool nvfp4 = shape.rows.format == RowFormat::NVFP4;
  const size_t T = size_t(a.num_tokens), H = size_t(p.hidden), k = size_t(p.top_k());
  const DevicePtr ptrs[] = {
      {a.hidden, "hidden", 16, T * H * 2, false, true},
      {a.topk_ids, "topk_ids", 4, T * k * 4, false, p.act_quant == ActQuant::W4A4PerExpert},
      {a.topk_weights, "topk_weights", 4, T * k * 4, false, p.routing.apply_router_weight_on_input},
      {a.rows.values, "rows.values", nvfp4 ? size_t(8) : size_t(16), shape.values_bytes, true, true},
      {a.rows.scales, "rows.scales", 1, shape.scales_bytes, true, nvfp4}};
  if (Status s = check_device_ptrs(fn, stream, ptrs, device_); !s.ok()) return s;
  (void)cudaGetLastError();
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Status::failure(cuda_message("cudaSetDevice", e));
  kernels::PrepareRowsArgs r;
  r.hidden = static_cast<const __nv_bfloat16*>(a.hidden);
  r.topk_ids = a.topk_ids;
  r.topk_weights = a.topk_weights;
  r.input_scale = input_scale_.as<float>();
  r.num_tokens = static_cast<int>(a.num_tokens);
  r.top_k = p.top_k();
  r.hidden_size = static_cast<int>(p.hidden);
  r.num_experts = static_cast<int>(p.num_experts);
  r.per_entry = per_entry;
  r.scale_by_weight = p.routing.apply_router_weight_on_input;
  r.mode = p.act_quant;
  r.scale_layout = static_cast<kernels::ScaleLayout>(a.rows.scale_layout);
  r.values = a.rows.values;
  r.scales = static_cast<uint8_t*>(a.rows.scales);
  const cudaEvent_t* marks = nullptr;  // FP4MOE_LAUNCH records no stage marks here
  FP4MOE_LAUNCH(0, "prepare_rows", kernels::launch_prepare_rows(r, stream));
  return Status::success();
}

Status GpuMoeRunner::experts(cudaStream_t stream, const ExpertsArgs& a) {
  const char* fn = "experts";
  const MoeProblem& p = problem_;
  const StageRows& rows = a.rows;
  if (!prepared_) return Status::failure("experts: weights are not prepared (call prepare_weights first)");
  if (rows.rows_top_k < 1 || rows.rows_top_k > p.top_k())
    return Status::failure(detail::concat(fn, ": rows.rows_top_k must be in [1, top_k=", p.top_k(), "], got ", rows.rows_top_k));
  const int64_t limit = max_tokens_ * p.top_k();
  if (rows.num_rows < 0 || rows.num_rows * rows.rows_top_k > limit)
    return Status::failure(detail::concat(fn, ": rows.num_rows * rows.rows_top_k must be in [0, max_tokens * top_k = ",
                                          limit, "], got ", rows.num_rows, " * ", rows.rows_top_k));
  const RowFormat want = p.act_quant == ActQuant::W4A16 ? RowFormat::BF16 : RowFormat::NVFP4;
  if (rows.format != want)
    return Status::failure(detail::concat(fn, ": rows.format must be ", want == RowFormat::BF16 ? "bf16" : "nvfp4",
                                          " for mode ", to_string(p.act_quant)));
  const size_t need = workspace_size(max_tokens_);
  if (a.workspace_bytes < need)
    return Status::failure(detail::concat(fn, ": workspace_bytes must be >= workspace_size(max_tokens) = ", need,
                                          ", got ", a.workspace_bytes));
  const int64_t S = rows.num_rows;
  if (S == 0) return Status::success();
  const StageRowsShape bytes = runner::stage_rows_of(p, S, rows.rows_top_k, rows.scale_layout);
  const bool nvfp4 = want == RowFormat::NVFP4;
  const size_t entries = size_t(S * rows.rows_top_k), H = size_t(p.hidden);
  const DevicePtr ptrs[] = {
      {rows.values, "rows.values", nvfp4 ? size_t(8) : size_t(16), bytes.values_bytes, false, true},
      {rows.scales, "rows.scales", 1, bytes.scales_bytes, false, nvfp4},
      {a.topk_ids, "topk_ids", 4, entries * 4, false, true},
      {a.y, "y", 16, entries * H * 4, true, true},
      {a.workspace, "workspace", kAlign, a.workspace_bytes, true, true}};
  if (Status s = check_device_ptrs(fn, stream, ptrs, device_); !s.ok()) return s;
  (void)cudaGetLastError();

  const int64_t tactic_T = runner::experts_tactic_tokens(p, S, rows.rows_top_k);
  const TacticSelector::Choice choice = choice_for(tactic_T);
  const MoeTactic& tactic = choice.tactic;
  if (!tactic_valid(p, tactic))
    return Status::failure(detail::concat(fn, ": tactic ", describe(tactic), " cannot run ", p.describe(), ": ",
                                          why_invalid(p, tactic)));
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Status::failure(cuda_message("cudaSetDevice", e));
  const runner::ExpertsPlan ep = runner::plan_experts(p, S, rows.rows_top_k, rows.format, tactic);
  if (log_level() >= LogLevel::Debug)
    log_line(detail::concat("experts ", p.describe(), " ", runner::describe(ep), " tactic ", describe(tactic)),
             LogLevel::Debug);
  const WorkspacePlan ws_plan = plan(max_tokens_);
  void* ws = a.workspace;
  const int E = static_cast<int>(p.num_experts);
  const int64_t tiles = kernels::max_tiles(ep.entries, E, ep.tile_rows);
  const cudaEvent_t* marks = nullptr;  // FP4MOE_LAUNCH records no stage marks here

  const kernels::PermuteArgs pa = permute_args(ws, ws_plan, a.topk_ids, static_cast<int>(S), rows.rows_top_k,
                                               ep.tile_rows, tiles, ep.clear_split1, ep.clear_split2,
                                               ep.tile_handoff);
  FP4MOE_LAUNCH(0, "permute", kernels::launch_permute(pa, stream));

  // GEMM1's operand rows [S, H] in bf16: the caller's (w4a16) or their decoded values in a1 (NVFP4).
  const __nv_bfloat16* a_rows = static_cast<const __nv_bfloat16*>(rows.values);
  if (ep.dequantize) {
    __nv_bfloat16* a1 = region<__nv_bfloat16>(ws, ws_plan.a1);
    FP4MOE_LAUNCH(0, "dequantize_rows",
                  kernels::launch_dequantize_rows(static_cast<const uint8_t*>(rows.values),
                                                  static_cast<const uint8_t*>(rows.scales),
                                                  static_cast<kernels::ScaleLayout>(rows.scale_layout), S, p.hidden, a1,
                                                  stream));
    a_rows = a1;
  }
  const GemmLaunch gl{pa, tiles, ep.entries, tactic};
  kernels::Gemm1Args g1 = gemm1_args(gl, ws, ws_plan, ep.gemm1_early_start, ep.tile_handoff);
  g1.a = a_rows;
  g1.rows = S;
  g1.a_row_to_entry = pa.row_to_entry;
  g1.a_top_k = rows.rows_top_k;
  FP4MOE_LAUNCH(0, "gemm1_act", kernels::launch_gemm1_act(g1, stream));

  kernels::Gemm2Args g2 = gemm2_args(gl, g1, ws, ws_plan, ep.gemm2_early_start, ep.tile_handoff);
  g2.y = a.y;
  FP4MOE_LAUNCH(0, "gemm2", kernels::launch_gemm2(g2, stream));
  return Status::success();
}

Status GpuMoeRunner::finalize(cudaStream_t stream, const FinalizeArgs& a) {
  const char* fn = "finalize";
  if (Status s = check_stage(fn, prepared_, a.num_tokens, max_tokens_); !s.ok()) return s;
  if (a.num_tokens == 0) return Status::success();
  const MoeProblem& p = problem_;
  const size_t T = size_t(a.num_tokens), H = size_t(p.hidden), k = size_t(p.top_k());
  const bool unit = p.routing.apply_router_weight_on_input;
  const DevicePtr ptrs[] = {
      {a.y, "y", 16, T * k * H * 4, false, true},
      {a.topk_ids, "topk_ids", 4, T * k * 4, false, true},
      {a.topk_weights, "topk_weights", 4, T * k * 4, false, !unit},
      {a.output, "output", 16, T * H * (a.output_dtype == OutputDType::F32 ? 4 : 2), true, true}};
  if (Status s = check_device_ptrs(fn, stream, ptrs, device_); !s.ok()) return s;
  (void)cudaGetLastError();
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Status::failure(cuda_message("cudaSetDevice", e));
  kernels::FinalizeArgs f;
  f.y = a.y;
  f.topk_weights = a.topk_weights;
  f.num_tokens = static_cast<int>(a.num_tokens);
  f.top_k = p.top_k();
  f.hidden_size = static_cast<int>(p.hidden);
  f.unit_weights = unit;
  f.topk_ids = a.topk_ids;
  f.num_experts = static_cast<int>(p.num_experts);
  f.skip_foreign_ids = p.routing.skip_foreign_ids;
  f.bias = has_w2_bias_ ? w2_bias_.as<float>() : nullptr;
  if (a.output_dtype == OutputDType::F32) f.out_f32 = static_cast<float*>(a.output);
  else f.out = static_cast<__nv_bfloat16*>(a.output);
  const cudaEvent_t* marks = nullptr;
  FP4MOE_LAUNCH(0, "finalize", kernels::launch_finalize(f, stream));
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
