// fp4moe/checkpoint.hpp — NVFP4 MoE checkpoints (Hugging Face directories): config, loading one
// layer into the canonical layout (docs/case-file.md), inspection, and small fixtures for tests.
//
// A checkpoint directory holds config.json, the quantization description (hf_quant_config.json of
// NVIDIA ModelOpt, or config.json's "quantization_config" of compressed-tensors / ModelOpt) and the
// weights: one model.safetensors or shards listed by model.safetensors.index.json ("weight_map":
// tensor name -> shard file). Shards are memory-mapped (SafetensorsFile) and only the shards that
// hold the tensors asked for are opened.
//
// Formats (per expert projection P = gate / up / down; "dequant direction" = the value multiplies
// the stored number, docs/numerics.md, "Formats and block quantization"):
//   ModelOpt NVFP4        P.weight U8 [out, in/2], P.weight_scale F8_E4M3 [out, in/16],
//                         P.weight_scale_2 F32 [] or [1], P.input_scale F32 [] or [1]  (dequant direction)
//   compressed-tensors    P.weight_packed, P.weight_scale (same as above), P.weight_global_scale,
//   (nvfp4-pack-quantized) P.input_global_scale: the two global scales are stored in the QUANTIZE
//                         direction; the loader inverts them in fp32: scale_2 = 1.0f / weight_global_scale,
//                         input_scale = 1.0f / input_global_scale.  Without "input_activations" in the
//                         config group the checkpoint is weight-only (act_quant w4a16): input scales
//                         are then not read and are set to 1.0f (unused by w4a16).
//
//   gpt-oss MXFP4         (config.json "quantization_config": {"quant_method": "mxfp4",
//                         "modules_to_not_convert": [...]}); the experts of a layer are fused tensors:
//                         experts.gate_up_proj_blocks U8 [E, 2I, H/32, 16], gate_up_proj_scales U8
//                         [E, 2I, H/32], gate_up_proj_bias BF16 [E, 2I], down_proj_blocks U8
//                         [E, H, I/32, 16], down_proj_scales U8 [E, H, I/32], down_proj_bias BF16 [E, H].
//                         Blocks run along K (the input features) of each output row, 32 e2m1 codes in
//                         16 bytes, element 2j in the low nibble of byte j: the bytes of one row's
//                         blocks are the canonical packed row. Scales are ue8m0 codes (2^(c - 127); 255
//                         is refused). gate_up rows are interleaved (row 2i gate i, row 2i+1 up i; the
//                         bias alike): the loader de-interleaves them into [gate; up]. weight_format
//                         mxfp4, act_quant w4a16, biases fp32 (exact from bf16), no global or input
//                         scales (their [E] vectors stay empty).
//
// Model families (layer prefix, expert names, router), chosen by config.json's model_type
// (family_of_model_type: DeepSeek-V3 / V3.2, Kimi-K2 and GLM-4.5/4.6 are deepseek_v3; Qwen3-Next is
// qwen3_moe):
//   deepseek_v3  model.layers.L.mlp.experts.E.{gate,up,down}_proj, router mlp.gate.weight and
//                mlp.gate.e_score_correction_bias; layers < first_k_dense_replace are dense; the shared
//                expert mlp.shared_experts is reported by inspect but is not part of the routed MoE.
//   qwen3_moe    model.layers.L.mlp.experts.E.{gate,up,down}_proj, router mlp.gate.weight
//   llama4       [language_model.]model.layers.L.feed_forward.experts.E.{gate,up,down}_proj,
//                router feed_forward.router.weight (shared expert feed_forward.shared_expert)
//   mixtral      model.layers.L.block_sparse_moe.experts.E.{w1,w2,w3}, router block_sparse_moe.gate.weight
//                (w1 = gate, w3 = up, w2 = down)
//   gpt_oss      model.layers.L.mlp.experts.{gate_up_proj,down_proj}_{blocks,scales,bias} (above),
//                router mlp.router.weight BF16 [E, H] and mlp.router.bias BF16 [E]: logits = x . W^T + b
//                (router_bias), routing renormalize (top-k of the logits, softmax over the k),
//                activation swiglu_oai (alpha 1.702, beta 1, limit = config.json's swiglu_limit).
//                Every layer is a MoE layer.
//
// w1/w3 fusion: w13 = [gate; up] shares one scale_2 per expert. When gate and up carry different
// weight_scale_2, the policy decides: rescale_to_max (default) re-expresses both halves under
// s = max(gate, up): every e4m3 block scale b of the half with the smaller s_h becomes
// e4m3_rne(float(b) * (s_h / s)); the report counts the block scales whose code changed and the worst
// relative change |float(b') * s - float(b) * s_h| / (float(b) * s_h) of an effective block scale.
// The input scale of w13 is max(gate.input_scale, up.input_scale) (both quantize the same tokens; the
// larger one never clips).
//
// Expert parallelism: rank r of n loads the contiguous expert range [r*E/n, (r+1)*E/n) (E/n rounded
// so that the first E % n ranks get one more). The loaded problem's num_experts is the local count;
// the router weight and bias stay whole ([E_total, H], [E_total]) because the router scores all
// experts: a caller routes over E_total and maps a global id g to local g - expert_begin when
// expert_begin <= g < expert_end, and to -1 otherwise (another rank's expert: precomputed routing with
// RoutingParams::skip_foreign_ids leaves it out of the rank's partial output). w13_input_scale_max is
// the whole layer's, so that a rank's w4a4_scalar activation scale is the whole layer's.
//
// Tensor parallelism: rank r of n holds a contiguous range of whole 16-column blocks of the intermediate
// size I of every expert (io::tensor_parallel_range / tensor_parallel_shard, fp4moe/weight_layout.hpp);
// its problem has inter = its share of I and the ranks' outputs sum to the layer's (the caller
// all-reduces them). I / 16 must be >= n.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/problem.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::io {

enum class CheckpointFormat { ModelOpt, CompressedTensors, Mxfp4 };
enum class ModelFamily { DeepSeekV3, Qwen3Moe, Llama4, Mixtral, GptOss };
enum class ScaleFusionPolicy { RescaleToMax, Error };

std::string_view to_string(CheckpointFormat f);   // "modelopt", "compressed-tensors", "mxfp4"
std::string_view to_string(ModelFamily f);        // "deepseek_v3", "qwen3_moe", "llama4", "mixtral", "gpt_oss"
std::string_view to_string(ScaleFusionPolicy p);  // "rescale_to_max", "error"
CheckpointFormat parse_checkpoint_format(std::string_view name);  // throws fp4moe::Error
ModelFamily parse_model_family(std::string_view name);            // also accepts "deepseek", "qwen3", "gpt-oss"
// The family of a config.json model_type: deepseek_v3, deepseek_v32, kimi_k2, glm4_moe -> deepseek_v3;
// qwen3_moe, qwen3_next -> qwen3_moe; llama4, llama4_text -> llama4; mixtral; gpt_oss. Throws fp4moe::Error.
// The mxfp4 format goes with the gpt_oss family only, and gpt_oss with the mxfp4 format only.
ModelFamily family_of_model_type(std::string_view model_type);
ScaleFusionPolicy parse_scale_fusion_policy(std::string_view name);

// What config.json (+ the quantization config) says about the MoE layers.
struct CheckpointConfig {
  CheckpointFormat format = CheckpointFormat::ModelOpt;
  std::string model_type;                 // config.json "model_type" (llama4: of text_config)
  ModelFamily family = ModelFamily::DeepSeekV3;
  int64_t num_layers = 0;                 // num_hidden_layers
  int64_t first_k_dense_replace = 0;      // deepseek_v3
  int64_t moe_layer_freq = 1;             // deepseek_v3 moe_layer_freq, qwen3 decoder_sparse_step,
                                          // llama4 interleave_moe_layer_step
  std::vector<int64_t> mlp_only_layers;   // qwen3_moe: dense layers listed explicitly
  std::vector<int64_t> moe_layers;        // llama4 "moe_layers" when given (overrides the step)
  int64_t n_shared_experts = 0;           // deepseek_v3 (llama4: 1)
  MoeProblem problem;                     // E = routed experts, H, I, routing, swiglu, act_quant
  std::vector<std::string> excluded_modules;  // not quantized (ModelOpt exclude_modules / CT ignore /
                                              // mxfp4 modules_to_not_convert)

  bool is_moe_layer(int64_t layer) const;
  // "dense (first_k_dense_replace=3)" style reason when not a MoE layer, empty when it is one.
  std::string dense_reason(int64_t layer) const;
};

// Parses config.json text and the quantization config text (hf_quant_config.json; empty when the
// checkpoint has none, then config.json's "quantization_config" is used). `where` names the
// checkpoint (a directory) in every message. Throws fp4moe::Error on anything malformed,
// unsupported or inconsistent; never crashes on arbitrary bytes.
CheckpointConfig parse_checkpoint_config(std::string_view config_json, std::string_view quant_config_json,
                                         const std::string& where);

// Result of the w1/w3 fusion of one layer (of the block scales a rank loads: its experts, its
// columns of I).
struct ScaleFusionReport {
  int64_t experts_rescaled = 0;       // experts whose gate and up scale_2 differed
  int64_t block_scales_changed = 0;   // e4m3 block scales whose code changed
  double worst_relative_change = 0;   // of an effective block scale (float(b) * s_2)
};

// One MoE layer in the canonical layout (docs/case-file.md), owned in host memory. Scales by
// problem.weight_format: NVFP4 e4m3 [.., K/16] with the [E] global and input scales; MXFP4 ue8m0 codes
// [.., K/32] with the four [E] vectors empty (reference::MoeWeights, null there).
struct MoeLayerWeights {
  MoeProblem problem;            // num_experts = the local expert count
  int64_t layer = 0;
  int64_t total_experts = 0;     // E of the whole layer
  int64_t expert_begin = 0, expert_end = 0;  // global ids [begin, end) held here
  int64_t total_inter = 0;                   // I of the whole layer
  int64_t inter_begin = 0, inter_end = 0;    // tensor parallelism: columns [begin, end) of I held here
  std::vector<uint8_t> w13, w13_scale;              // [E, 2I, H/2], [E, 2I, H/16] (MXFP4: H/32)  rows [gate; up]
  std::vector<float> w13_scale_2, w13_input_scale;  // [E] (MXFP4: empty)
  std::vector<uint8_t> w2, w2_scale;                // [E, H, I/2], [E, H, I/16] (MXFP4: I/32)
  std::vector<float> w2_scale_2, w2_input_scale;    // [E] (MXFP4: empty)
  // Expert biases (gpt_oss), fp32: w13_bias [E, 2I] rows [gate; up] (a tensor-parallel rank's rows),
  // w2_bias [E, H] (added once per output: tensor-parallel rank 0 only, empty on the others); empty
  // for checkpoints without them.
  std::vector<float> w13_bias, w2_bias;
  float w13_input_scale_max = 0.0f;  // max of w13_input_scale over the whole layer's experts (w4a4 checkpoints)
  std::vector<uint16_t> router_weight;  // [total_experts, H] bf16 bits
  std::vector<float> routing_bias;      // [total_experts] (deepseek_v3 e_score_correction_bias) or empty
  std::vector<float> router_bias;       // [total_experts] the router's own bias (gpt_oss), added to the
                                        // logits by router_logits(), or empty
  ScaleFusionReport fusion;

  // Sizes the expert tensors for problem.num_experts local experts of problem's H and I (gate and up
  // rows both present) and weight_format (MXFP4: no [E] scale vectors), contents zero; with
  // `biases`, w13_bias and w2_bias too.
  void allocate_experts(bool biases = false);
  reference::MoeWeights weights() const;  // views into this object (null for empty vectors)
  // Router logits [T, total_experts] = x . router^T (+ router_bias), fp32 accumulation over the bf16
  // values in index order, then the bias added in fp32 (hidden is bf16 bits [T, H]).
  std::vector<float> router_logits(const uint16_t* hidden, int64_t num_tokens) const;
  // A case with these weights, the given hidden states and logits computed by router_logits()
  // (whole layers only: expert_begin == 0 and expert_end == total_experts).
  MoeCase to_case(std::vector<uint16_t> hidden_states, int64_t num_tokens) const;
};

struct LoadOptions {
  ScaleFusionPolicy fusion = ScaleFusionPolicy::RescaleToMax;
  int ep_rank = 0;   // expert-parallel rank
  int ep_size = 1;   // number of ranks
  int tp_rank = 0;   // tensor-parallel rank (a slice of I; combines with expert parallelism)
  int tp_size = 1;
};

// Random bf16 hidden states [T, H] (standard normal, splitmix64 + Box-Muller), the input of
// `fp4moe run --checkpoint --seed S`.
std::vector<uint16_t> random_hidden_states(int64_t num_tokens, int64_t hidden, uint64_t seed);

// Expert range [begin, end) of rank r of n for E experts (see the header comment).
std::pair<int64_t, int64_t> expert_range(int64_t num_experts, int rank, int size);

// A checkpoint directory, opened: config parsed, index read and checked (every shard it names
// exists), shards opened lazily on first use.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& dir);
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  const std::string& dir() const;
  const CheckpointConfig& config() const;
  // Layer prefix, e.g. "model.layers.3.mlp" (llama4: with "language_model." when the files use it).
  std::string layer_prefix(int64_t layer) const;
  // Every tensor name of the checkpoint with its shard file name (relative to dir).
  const std::map<std::string, std::string>& weight_map() const;
  // Loads layer L. Throws fp4moe::Error naming the file and tensor on anything missing or wrong;
  // asking for a dense layer is an error that says so.
  MoeLayerWeights load_layer(int64_t layer, const LoadOptions& options = {}) const;

  struct Impl;

 private:
  explicit Checkpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---- inspection (`fp4moe inspect`) -----------------------------------------------------------------
struct ScaleStats {
  int64_t tensors = 0, count = 0, zeros = 0, non_finite = 0, negative = 0;
  double min = 0, max = 0;  // over the finite values
};

struct InspectReport {
  std::string dir;
  CheckpointConfig config;
  bool config_ok = false;
  std::vector<int64_t> moe_layers;       // layers with routed experts per config
  std::vector<int64_t> loaded_layers;    // of those, the ones that loaded cleanly
  std::set<std::string> shared_experts;  // prefixes of shared experts found (not part of the routed MoE)
  ScaleFusionReport fusion;              // summed over the loaded layers
  std::map<std::string, ScaleStats> scale_stats;  // by tensor kind (weight_scale, weight_scale_2, ...)
  std::vector<std::string> problems;
  bool servable() const { return config_ok && problems.empty() && !moe_layers.empty(); }
  std::string to_text() const;
};

// Never throws for a bad checkpoint: every problem is recorded (max_layers < 0: all layers).
InspectReport inspect_checkpoint(const std::string& dir, int64_t max_layers = -1);

// ---- fixtures ---------------------------------------------------------------------------------------
// gpt_oss fixtures (format mxfp4, family gpt_oss; both must be given together): the published layout
// (interleaved gate/up rows, bf16 biases and router); the weights are random MXFP4 codes (the ue8m0
// scales 118..122), every layer a MoE layer.
struct FixtureOptions {
  CheckpointFormat format = CheckpointFormat::ModelOpt;
  ModelFamily family = ModelFamily::DeepSeekV3;
  int64_t num_layers = 2;        // deepseek_v3: layer 0 is dense (first_k_dense_replace = 1)
  int64_t num_experts = 8;
  int64_t hidden = 64;
  int64_t inter = 32;
  int top_k = 2;                 // llama4: 1
  int num_shards = 2;            // 1: a single model.safetensors without index
  std::string model_type;        // config.json's model_type; empty: the family's own name
  bool llama4_language_model_prefix = true;
  float up_scale_2_factor = 1.0f;  // != 1: up's weight_scale_2 = gate's * factor (fusion tests)
  std::vector<std::string> excluded_modules = {"lm_head"};  // exclude_modules (ModelOpt) / ignore (CT)
  uint64_t seed = 1;
};

// The fixture as written, plus the canonical layer each MoE layer must load as (whole layer).
struct Fixture {
  CheckpointConfig config;
  std::map<int64_t, MoeLayerWeights> layers;  // expected canonical layers, by layer index
};

// Writes a small checkpoint (config.json, quantization config, shards + index) to `dir` (created)
// from random weights quantized with format::quantize_nvfp4 (gpt_oss: random MXFP4 codes, see
// FixtureOptions). With up_scale_2_factor != 1 the expected layers are those of the rescale_to_max
// policy. H and I must be multiples of 16 (gpt_oss: of 32).
Fixture write_fixture(const std::string& dir, const FixtureOptions& options);

}  // namespace fp4moe::io
