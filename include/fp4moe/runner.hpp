// fp4moe/runner.hpp — MoeRunner: the NVFP4 MoE layer on a Hopper GPU (sm_90a).
//
//   auto runner = MoeRunner::create(problem, max_tokens);      // checks the problem
//   runner->prepare_weights(host_weights, options);            // once: upload + convert layouts
//   size_t ws = runner->workspace_size(max_tokens);            // caller allocates ws bytes of device memory
//   runner->forward(stream, args);                             // no host sync, no allocation, graph-capturable
//
// CUDA graphs: kernel grids depend on the token count T given on the host, so a captured graph is
// valid for the T it was captured with; capture one graph per T (or per padded bucket of T) and
// replay it. Everything a forward touches lives in the prepared weights, the caller's tensors and
// the caller's workspace, so replays need no re-preparation.
//
// This header needs no CUDA headers: streams are passed as CUstream_st* (cudaStream_t). Benchmarks,
// case files on the GPU and the clock monitor are tools of the repository (fp4moe/bench.hpp, the
// fp4moe_tools target), not part of this interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "fp4moe/error.hpp"
#include "fp4moe/problem.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/tactic.hpp"
#include "fp4moe/tune.hpp"
#include "fp4moe/weight_layout.hpp"

struct CUstream_st;
struct CUevent_st;

namespace fp4moe {

enum class LogitsDType { F32, BF16 };
// The layer output: bf16 (the contract's one rounding), or the fp32 sums before it, for callers that
// add partial outputs first (tensor / expert parallelism: an fp32 all-reduce, then one rounding, keeps
// the sum of the ranks equal to the whole layer's up to fp32 summation order; docs/numerics.md).
enum class OutputDType { BF16, F32 };

// Device pointers, row-major. Outputs are fully written by forward.
struct ForwardArgs {
  int64_t num_tokens = 0;                 // T, 0 <= T <= max_tokens
  const void* hidden = nullptr;           // [T, H] bf16
  const void* router_logits = nullptr;    // [T, E] (forward only)
  LogitsDType logits_dtype = LogitsDType::F32;
  const float* routing_bias = nullptr;    // [E] f32 or nullptr (DeepSeekV3)
  int32_t* topk_ids = nullptr;            // [T, k] out of forward, in for forward_routed
  float* topk_weights = nullptr;          // [T, k] out of forward, in for forward_routed
  void* output = nullptr;                 // [T, H] bf16, or fp32 with output_dtype F32
  OutputDType output_dtype = OutputDType::BF16;
  void* workspace = nullptr;              // workspace_size(max_tokens) bytes, 256-byte aligned
  size_t workspace_bytes = 0;
};

// ---- the layer as separate stages (docs/architecture.md, "The layer as stages") ----------------------
// forward = route -> prepare -> experts -> finalize, with the same bits as the fused forward, for callers
// that put communication between them (expert parallelism sends prepared rows to the ranks that hold
// their experts and the experts' outputs back). Each stage runs on the caller's stream and buffers, no
// host synchronisation or allocation, graph-capturable.

// How the rows between prepare and experts store their values.
enum class RowFormat { BF16, NVFP4 };
// NVFP4 row scales: [S, H/16] e4m3, or the 128x4-swizzled matrix (format::swizzled_scales_size(1, S, H/16)
// bytes, rows padded to 128 and scale columns to 4, padding zero) that FlashInfer and CUTLASS use.
enum class ScaleLayout { Linear, Swizzled128x4 };

// The rows of the GEMM1 operand: S rows, each going to rows_top_k experts (ids [S, rows_top_k]).
// Per token (S = T, rows_top_k = k) where the operand is the same for a token's k slots (w4a16, scalar
// w4a4); per entry (S = T*k, rows_top_k = 1, row t*k + j for slot j of token t) with per-expert input
// scales or the router weight on the input. Either way, entry s * rows_top_k + j is the fused forward's
// t * k + j.
struct StageRows {
  int64_t num_rows = 0;                    // S
  int rows_top_k = 0;                      // ids per row
  RowFormat format = RowFormat::BF16;      // BF16 in w4a16, NVFP4 in w4a4
  ScaleLayout scale_layout = ScaleLayout::Linear;
  void* values = nullptr;                  // bf16 [S, H] (16-byte aligned) or packed e2m1 [S, H/2] (8-byte aligned)
  void* scales = nullptr;                  // NVFP4: e4m3 scales as scale_layout says; BF16: unused
};
// The shape prepare gives T tokens of a problem (values and scales null), and the bytes it needs.
struct StageRowsShape {
  StageRows rows;
  size_t values_bytes = 0;
  size_t scales_bytes = 0;
};

struct PrepareArgs {
  int64_t num_tokens = 0;                  // T
  const void* hidden = nullptr;            // [T, H] bf16
  const int32_t* topk_ids = nullptr;       // [T, k] (read with per-expert input scales)
  const float* topk_weights = nullptr;     // [T, k] (read with the router weight on the input)
  StageRows rows;                          // out: prepared_rows(T, layout).rows with the caller's buffers
};
struct ExpertsArgs {
  StageRows rows;                          // in: from prepare, or received from another rank
  const int32_t* topk_ids = nullptr;       // [S, rows_top_k]; an id outside [0, E) has no GEMM row
  float* y = nullptr;                      // out [S * rows_top_k, H] fp32: y = alpha2 * (act . w2^T) per entry,
                                           // without w2_bias (finalize adds it); entries without a GEMM row
                                           // are not written
  void* workspace = nullptr;               // workspace_size(max_tokens) bytes, as for forward
  size_t workspace_bytes = 0;
};
struct FinalizeArgs {
  int64_t num_tokens = 0;                  // T
  const float* y = nullptr;                // [T * k, H] fp32 (experts' output)
  const int32_t* topk_ids = nullptr;       // [T, k]: ids outside [0, E) make the token's row NaN, or add
                                           // nothing with RoutingParams::skip_foreign_ids
  const float* topk_weights = nullptr;     // [T, k]
  void* output = nullptr;                  // [T, H] bf16, or fp32 with output_dtype F32
  OutputDType output_dtype = OutputDType::BF16;
};

class MoeRunner {
 public:
  // Throws fp4moe::Error when the problem is invalid or no suitable GPU is present.
  static std::unique_ptr<MoeRunner> create(const MoeProblem& problem, int64_t max_tokens,
                                           int device = -1);
  virtual ~MoeRunner() = default;

  const MoeProblem& problem() const { return problem_; }
  int64_t max_tokens() const { return max_tokens_; }

  // Host weights in the canonical layout (docs/architecture.md, "Interfaces"; see
  // reference::MoeWeights). Allocates and uploads; not part of the forward path.
  virtual Status prepare_weights(const reference::MoeWeights& weights,
                                 const WeightPrepOptions& options = {}) = 0;
  // Depends on the tactic choice (split-K tactics need more): ask after force_tactic / use_tune_cache.
  virtual size_t workspace_size(int64_t max_tokens) const = 0;

  // Routing from logits, then the layer. Arguments are checked before any launch.
  virtual Status forward(CUstream_st* stream, const ForwardArgs& args) = 0;
  // The layer from precomputed topk_ids / topk_weights. An id outside [0, E) has no GEMM row: it makes
  // its token's output row NaN (bad input poisons only its own token), or, with
  // RoutingParams::skip_foreign_ids (expert parallelism: another rank's expert), adds nothing.
  virtual Status forward_routed(CUstream_st* stream, const ForwardArgs& args) = 0;

  // ---- the layer as stages (see StageRows); arguments are checked before any launch ----
  // The rows prepare writes for T tokens; layout applies to NVFP4 rows.
  StageRowsShape prepared_rows(int64_t num_tokens, ScaleLayout layout = ScaleLayout::Linear) const;
  // The shape and bytes of any S rows with rows_top_k ids each in this problem's row format (rows that
  // arrive from other ranks).
  StageRowsShape rows_shape(int64_t num_rows, int rows_top_k, ScaleLayout layout = ScaleLayout::Linear) const;
  // hidden -> rows: the activation quantization (w4a4) or bf16 passthrough, per token or per entry.
  virtual Status prepare(CUstream_st* stream, const PrepareArgs& args) = 0;
  // rows -> y: permutation by expert, GEMM1 + activation, GEMM2, with the tactic of
  // ceil(S * rows_top_k / k) tokens (the fused forward's). S * rows_top_k <= max_tokens * k.
  virtual Status experts(CUstream_st* stream, const ExpertsArgs& args) = 0;
  // y -> output: the weighted sum over each token's slots in slot order (+ w2_bias), as forward's.
  virtual Status finalize(CUstream_st* stream, const FinalizeArgs& args) = 0;

  // ---- tactics (fp4moe/tactic.hpp, fp4moe/tune.hpp) ----
  // Each forward of T tokens runs the tactic of T's bucket: from the tuning cache when it has an entry
  // for this GPU, fp4moe version and problem, else the heuristic. create() loads the cache named by
  // FP4MOE_TUNE_CACHE (if set); use_tune_cache loads another file (warnings go to stderr once, a bad
  // file never fails: the heuristic serves). FP4MOE_LOG=debug prints each forward's choice.
  void use_tune_cache(const std::string& path);
  // The tactic a forward of T tokens uses and where it comes from.
  TacticSelector::Choice choice_for(int64_t num_tokens) const;
  MoeTactic tactic_for(int64_t num_tokens) const { return choice_for(num_tokens).tactic; }
  const DeviceKey& device_key() const { return device_key_; }
  // Tuning and tests: every forward uses `tactic` instead of the selector's choice (nullopt: back to
  // the selector). Throws fp4moe::Error when the tactic is not valid for the problem.
  void force_tactic(std::optional<MoeTactic> tactic);

 protected:
  MoeRunner(const MoeProblem& p, int64_t max_tokens) : problem_(p), max_tokens_(max_tokens) {}
  // Called by the backend's constructor: the device key and the selector from FP4MOE_TUNE_CACHE.
  void init_tactics(const DeviceKey& device);
  // Benchmark diagnostics, reached through fp4moe/bench.hpp (forward_marked): forward (routed=false) or
  // forward_routed (routed=true) that records marks[0] before the first launch and marks[1..6] after the
  // stages route, permute, gather_quantize, gemm1_act, gemm2, finalize (marks[1] right after marks[0]
  // when routed; a stage that a forward fuses into another still gets its mark).
  virtual Status forward_marked(CUstream_st* stream, const ForwardArgs& args, bool routed,
                                CUevent_st* const* marks) = 0;
  friend struct RunnerDiagnostics;
  MoeProblem problem_;
  int64_t max_tokens_;
  DeviceKey device_key_;
  std::optional<TacticSelector> selector_;
  std::optional<MoeTactic> forced_tactic_;
};

// Routing alone on the GPU (docs/numerics.md, "Routing methods"): the top-k ids and weights of T tokens from router logits
// over E experts, the same bits as MoeRunner::forward's routing. For expert parallelism, where every
// rank routes over the whole layer's experts and then runs its own (RoutingParams::skip_foreign_ids).
// No allocation, no host synchronisation, graph-capturable.
class GpuRouter {
 public:
  // Throws fp4moe::Error for invalid params (as MoeProblem::validate), precomputed routing, E > 512,
  // or no suitable GPU.
  static std::unique_ptr<GpuRouter> create(const RoutingParams& params, int64_t num_experts, int device = -1);
  // logits [T, E] (fp32 or bf16), bias [E] f32 or nullptr (deepseek_v3), topk_ids / topk_weights [T, k]:
  // device pointers. Arguments are checked before the launch.
  Status route(CUstream_st* stream, int64_t num_tokens, const void* logits, LogitsDType logits_dtype,
               const float* bias, int32_t* topk_ids, float* topk_weights) const;
  const RoutingParams& params() const { return params_; }
  int64_t num_experts() const { return num_experts_; }
  int device() const { return device_; }

 private:
  GpuRouter(const RoutingParams& params, int64_t num_experts, int device)
      : params_(params), num_experts_(num_experts), device_(device) {}
  RoutingParams params_;
  int64_t num_experts_;
  int device_;
};

// True when a CUDA device of compute capability 9.0 is visible and the library was built with CUDA.
bool cuda_device_available(std::string* why_not = nullptr);

}  // namespace fp4moe
