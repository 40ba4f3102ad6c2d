// tests/runner/stages_test.cpp — the layer as separate stages (MoeRunner::prepare / experts / finalize)
// against the fused forward on fresh random cases: the same output bits for every quantization mode,
// routing with the weight on the input, expert biases, both scale layouts and every kind of tactic;
// prepared NVFP4 rows equal the CPU quantization byte for byte; rows in another order (as they arrive
// from other ranks) give the same y per entry; bad stage arguments are errors naming the argument.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/runner.hpp"
#include "fp4moe/tune.hpp"
#include "runner/device_buffer.hpp"
#include "runner/layer_buffers.hpp"
#include "small_problem.hpp"

namespace fp4moe {
namespace {

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call
#define SKIP_WITHOUT_GPU()                                \
  do {                                                    \
    std::string why_;                                     \
    if (!cuda_device_available(&why_)) GTEST_SKIP() << why_; \
  } while (0)

template <typename T>
std::vector<T> download(const void* p, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

// One runner with a case's weights and the buffers of the fused forward and of the stages.
struct StageRig {
  StageRig(const io::MoeCase& c, std::optional<MoeTactic> tactic, ScaleLayout layout)
      : c(c), runner(MoeRunner::create(c.problem, c.num_tokens)) {
    if (tactic) runner->force_tactic(*tactic);
    const Status s = runner->prepare_weights(c.weights());
    EXPECT_TRUE(s.ok()) << s.message;
    buf.emplace(c.problem, c.num_tokens, *runner);
    shape = runner->prepared_rows(c.num_tokens, layout);
    values.emplace(shape.values_bytes, "StageRig values");
    scales.emplace(std::max<size_t>(shape.scales_bytes, 1), "StageRig scales");
    const int64_t T = c.num_tokens, H = c.problem.hidden, k = c.problem.top_k();
    y.emplace(size_t(T * k * H * 4), "StageRig y");
    out.emplace(size_t(T * H * 2), "StageRig out");
    rows = shape.rows;
    rows.values = values->ptr;
    rows.scales = shape.scales_bytes ? scales->ptr : nullptr;
  }

  // The fused forward (routing from logits, or forward_routed for precomputed routing): output bits.
  std::vector<uint16_t> fused() {
    if (c.problem.routing.method != RoutingMethod::Precomputed) {
      EXPECT_EQ(buf->upload(c), cudaSuccess);
    } else {  // no logits: the hidden rows, the case's ids and weights
      EXPECT_EQ(cudaMemcpy(buf->hidden.ptr, c.hidden_states.data(), c.hidden_states.size() * 2, cudaMemcpyHostToDevice),
                cudaSuccess);
      EXPECT_EQ(cudaMemcpy(buf->args.topk_ids, c.topk_ids.data(), c.topk_ids.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      EXPECT_EQ(cudaMemcpy(buf->args.topk_weights, c.topk_weights.data(), c.topk_weights.size() * 4,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    EXPECT_EQ(buf->poison_output(), cudaSuccess);
    const bool routed = c.problem.routing.method == RoutingMethod::Precomputed;
    ForwardArgs a = buf->args;
    if (routed) a.router_logits = nullptr;
    const Status s = routed ? runner->forward_routed(nullptr, a) : runner->forward(nullptr, a);
    EXPECT_TRUE(s.ok()) << s.message;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaError_t e;
    return buf->output(&e);
  }

  // prepare -> experts -> finalize on the ids and weights the fused forward used (in buf); every
  // buffer poisoned first.
  std::vector<uint16_t> staged() {
    const int64_t T = c.num_tokens, H = c.problem.hidden, k = c.problem.top_k();
    EXPECT_EQ(cudaMemset(values->ptr, 0xFF, shape.values_bytes), cudaSuccess);
    if (shape.scales_bytes) EXPECT_EQ(cudaMemset(scales->ptr, 0xFF, shape.scales_bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(y->ptr, 0xFF, size_t(T * k * H * 4)), cudaSuccess);
    EXPECT_EQ(cudaMemset(out->ptr, 0xFF, size_t(T * H * 2)), cudaSuccess);
    PrepareArgs pa;
    pa.num_tokens = T;
    pa.hidden = buf->args.hidden;
    pa.topk_ids = buf->args.topk_ids;
    pa.topk_weights = buf->args.topk_weights;
    pa.rows = rows;
    Status s = runner->prepare(nullptr, pa);
    EXPECT_TRUE(s.ok()) << s.message;
    ExpertsArgs ea;
    ea.rows = rows;
    ea.topk_ids = buf->args.topk_ids;
    ea.y = y->as<float>();
    ea.workspace = buf->args.workspace;
    ea.workspace_bytes = buf->args.workspace_bytes;
    s = runner->experts(nullptr, ea);
    EXPECT_TRUE(s.ok()) << s.message;
    FinalizeArgs fa;
    fa.num_tokens = T;
    fa.y = y->as<float>();
    fa.topk_ids = buf->args.topk_ids;
    fa.topk_weights = buf->args.topk_weights;
    fa.output = out->ptr;
    s = runner->finalize(nullptr, fa);
    EXPECT_TRUE(s.ok()) << s.message;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return download<uint16_t>(out->ptr, size_t(T * H));
  }

  io::MoeCase c;
  std::unique_ptr<MoeRunner> runner;
  std::optional<test::LayerBuffers> buf;
  StageRowsShape shape;
  StageRows rows;
  std::optional<DeviceBuffer> values, scales, y, out;
};

using test::small_problem;

void expect_stages_equal_fused(const io::MoeCase& c, std::optional<MoeTactic> tactic, ScaleLayout layout,
                               const std::string& label) {
  StageRig rig(c, tactic, layout);
  const std::vector<uint16_t> fused = rig.fused();
  const std::vector<uint16_t> staged = rig.staged();
  ASSERT_EQ(fused.size(), staged.size());
  int64_t differ = 0;
  for (size_t i = 0; i < fused.size(); ++i) differ += fused[i] != staged[i];
  EXPECT_EQ(differ, 0) << label << ": " << differ << " of " << fused.size() << " output elements differ";
}

TEST(LayerStages, EqualTheFusedForwardInEveryMode) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 100;
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert})
    for (RoutingMethod m : {RoutingMethod::Renormalize, RoutingMethod::Llama4, RoutingMethod::DeepSeekV3,
                            RoutingMethod::Precomputed})
      for (int64_t T : {1, 37, 300})
        for (ScaleLayout layout : {ScaleLayout::Linear, ScaleLayout::Swizzled128x4}) {
          if (mode == ActQuant::W4A16 && layout == ScaleLayout::Swizzled128x4) continue;  // no scales
          const MoeProblem p = small_problem(mode, m, Activation::SwiGLU);
          expect_stages_equal_fused(io::make_random_packed_case(p, T, ++seed), std::nullopt, layout,
                                    std::string(to_string(mode)) + " " + std::string(to_string(m)) + " T=" + std::to_string(T) +
                                        (layout == ScaleLayout::Linear ? " linear" : " swizzled"));
        }
}

TEST(LayerStages, EqualTheFusedForwardWithBiasesAndEveryTactic) {
  SKIP_WITHOUT_GPU();
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar}) {
    MoeProblem p = small_problem(mode, RoutingMethod::Renormalize, Activation::SwiGLUOai);
    p.hidden = 512;
    p.inter = 640;
    for (int64_t T : {1, 24, 200}) {
      io::MoeCase c = io::make_random_packed_case(p, T, 300 + T);
      io::add_random_expert_biases(c, 400 + T);
      for (const MoeTactic& t : candidate_tactics(p))
        expect_stages_equal_fused(c, t, ScaleLayout::Swizzled128x4,
                                  std::string(to_string(mode)) + " bias T=" + std::to_string(T) + " " + describe(t));
    }
  }
}

// Scalar w4a4 rows are NVFP4(x, input scale) of each token: the CPU's quantization, byte for byte.
TEST(LayerStages, PreparedRowsAreTheCpuQuantization) {
  SKIP_WITHOUT_GPU();
  const MoeProblem p = small_problem(ActQuant::W4A4Scalar, RoutingMethod::Renormalize, Activation::SwiGLU);
  const int64_t T = 133, H = p.hidden;
  const io::MoeCase c = io::make_random_packed_case(p, T, 77);
  for (ScaleLayout layout : {ScaleLayout::Linear, ScaleLayout::Swizzled128x4}) {
    StageRig rig(c, std::nullopt, layout);
    (void)rig.fused();  // uploads hidden, routes
    (void)rig.staged();
    ASSERT_EQ(rig.shape.rows.num_rows, T);
    std::vector<float> x(size_t(T * H));
    for (size_t i = 0; i < x.size(); ++i) x[i] = format::bf16_to_float(c.hidden_states[i]);
    float scale = 0;  // the layer's one activation scale: the max over the experts' input scales
    for (float s : c.w13_input_scale) scale = std::max(scale, s);
    std::vector<uint8_t> packed(size_t(T * H / 2)), linear(size_t(T * H / 16));
    format::quantize_nvfp4(x.data(), T, H, scale, packed.data(), linear.data());
    std::vector<uint8_t> want_scales = linear;
    if (layout == ScaleLayout::Swizzled128x4) {
      want_scales.assign(size_t(format::swizzled_scales_size(1, T, H / 16)), 0);
      format::scales_linear_to_swizzled(linear.data(), 1, T, H / 16, want_scales.data());
    }
    EXPECT_EQ(download<uint8_t>(rig.values->ptr, packed.size()), packed);
    EXPECT_EQ(download<uint8_t>(rig.scales->ptr, want_scales.size()), want_scales);
  }
}

// Rows in any order (as another rank's dispatch delivers them) give each entry the same y bits.
TEST(LayerStages, ExpertsOfReorderedRowsGiveTheSameEntries) {
  SKIP_WITHOUT_GPU();
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar}) {
    const MoeProblem p = small_problem(mode, RoutingMethod::Renormalize, Activation::SwiGLU);
    const int64_t T = 90, H = p.hidden, k = p.top_k();
    StageRig rig(io::make_random_packed_case(p, T, 500), std::nullopt, ScaleLayout::Linear);
    (void)rig.fused();
    (void)rig.staged();
    const std::vector<float> y = download<float>(rig.y->ptr, size_t(T * k * H));
    const std::vector<int32_t> ids = download<int32_t>(rig.buf->args.topk_ids, size_t(T * k));
    // Reverse the rows: row s of the new order is row T-1-s, with its ids; linear scales move with it.
    const size_t row_bytes = rig.shape.values_bytes / size_t(T), scale_row = rig.shape.scales_bytes / size_t(T);
    const std::vector<uint8_t> vals = download<uint8_t>(rig.values->ptr, rig.shape.values_bytes);
    const std::vector<uint8_t> scs = download<uint8_t>(rig.scales->ptr, rig.shape.scales_bytes);
    std::vector<uint8_t> rvals(vals.size()), rscs(scs.size());
    std::vector<int32_t> rids(ids.size());
    for (int64_t s = 0; s < T; ++s) {
      const int64_t from = T - 1 - s;
      std::memcpy(&rvals[s * row_bytes], &vals[from * row_bytes], row_bytes);
      if (scale_row) std::memcpy(&rscs[s * scale_row], &scs[from * scale_row], scale_row);
      for (int64_t j = 0; j < k; ++j) rids[s * k + j] = ids[from * k + j];
    }
    DeviceBuffer dv(vals.size(), "reordered values"), ds(std::max<size_t>(scs.size(), 1), "reordered scales"),
        di(rids.size() * 4, "reordered ids"), dy(y.size() * 4, "reordered y");
    CK(cudaMemcpy(dv.ptr, rvals.data(), rvals.size(), cudaMemcpyHostToDevice));
    if (!rscs.empty()) CK(cudaMemcpy(ds.ptr, rscs.data(), rscs.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(di.ptr, rids.data(), rids.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(dy.ptr, 0xFF, y.size() * 4));
    ExpertsArgs ea;
    ea.rows = rig.rows;
    ea.rows.values = dv.ptr;
    ea.rows.scales = rscs.empty() ? nullptr : ds.ptr;
    ea.topk_ids = di.as<int32_t>();
    ea.y = dy.as<float>();
    ea.workspace = rig.buf->args.workspace;
    ea.workspace_bytes = rig.buf->args.workspace_bytes;
    const Status st = rig.runner->experts(nullptr, ea);
    ASSERT_TRUE(st.ok()) << st.message;
    CK(cudaDeviceSynchronize());
    const std::vector<float> ry = download<float>(dy.ptr, y.size());
    int64_t differ = 0;
    for (int64_t s = 0; s < T; ++s)
      for (int64_t j = 0; j < k; ++j)
        differ += std::memcmp(&ry[(s * k + j) * H], &y[((T - 1 - s) * k + j) * H], size_t(H) * 4) != 0;
    EXPECT_EQ(differ, 0) << to_string(mode) << ": entries whose y differs";
  }
}

TEST(LayerStages, BadArgumentsAreErrorsNamingThem) {
  SKIP_WITHOUT_GPU();
  const MoeProblem p = small_problem(ActQuant::W4A4Scalar, RoutingMethod::Renormalize, Activation::SwiGLU);
  StageRig rig(io::make_random_packed_case(p, 8, 9), std::nullopt, ScaleLayout::Linear);
  (void)rig.fused();
  auto expect_error = [](const Status& s, const std::string& needle) {
    ASSERT_FALSE(s.ok()) << "expected an error naming " << needle;
    EXPECT_NE(s.message.find(needle), std::string::npos) << s.message;
  };
  PrepareArgs pa;
  pa.num_tokens = 8;
  pa.hidden = rig.buf->args.hidden;
  pa.rows = rig.rows;
  pa.rows.format = RowFormat::BF16;
  expect_error(rig.runner->prepare(nullptr, pa), "rows.format");
  pa.rows = rig.rows;
  pa.rows.num_rows = 7;
  expect_error(rig.runner->prepare(nullptr, pa), "rows must be [8 rows");
  pa.rows = rig.rows;
  pa.rows.scales = nullptr;
  expect_error(rig.runner->prepare(nullptr, pa), "rows.scales is null");
  pa.rows = rig.rows;
  pa.num_tokens = 9;
  expect_error(rig.runner->prepare(nullptr, pa), "num_tokens must be in [0, max_tokens=8]");
  pa.num_tokens = 8;
  pa.hidden = static_cast<const char*>(rig.buf->args.hidden) + 2;
  expect_error(rig.runner->prepare(nullptr, pa), "hidden must be 16-byte aligned");

  ExpertsArgs ea;
  ea.rows = rig.rows;
  ea.topk_ids = rig.buf->args.topk_ids;
  ea.y = rig.y->as<float>();
  ea.workspace = rig.buf->args.workspace;
  ea.workspace_bytes = rig.buf->args.workspace_bytes - 1;
  expect_error(rig.runner->experts(nullptr, ea), "workspace_bytes must be >=");
  ea.workspace_bytes = rig.buf->args.workspace_bytes;
  ea.rows.rows_top_k = 5;
  expect_error(rig.runner->experts(nullptr, ea), "rows.rows_top_k must be in [1, top_k=4]");
  ea.rows = rig.rows;
  ea.rows.num_rows = 9;
  expect_error(rig.runner->experts(nullptr, ea), "rows.num_rows * rows.rows_top_k");
  ea.rows = rig.rows;
  ea.y = reinterpret_cast<float*>(rig.values->ptr);  // y overlaps the rows it reads
  expect_error(rig.runner->experts(nullptr, ea), "y overlaps rows.values");
  std::vector<float> host_y(8);
  ea.y = host_y.data();
  expect_error(rig.runner->experts(nullptr, ea), "y must be device memory");

  FinalizeArgs fa;
  fa.num_tokens = 8;
  fa.y = rig.y->as<float>();
  fa.topk_ids = rig.buf->args.topk_ids;
  fa.topk_weights = nullptr;
  fa.output = rig.out->ptr;
  expect_error(rig.runner->finalize(nullptr, fa), "topk_weights is null");
  fa.topk_weights = rig.buf->args.topk_weights;
  fa.output = rig.y->ptr;
  expect_error(rig.runner->finalize(nullptr, fa), "output overlaps y");
}

}  // namespace
}  // namespace fp4moe
