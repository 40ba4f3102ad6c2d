// runner/bench.cu — ceilings and layer benchmarks (include/fp4moe/bench.hpp).
//
// Steps of bench_model:
//   1. random NVFP4 or MXFP4 weights (the problem's weight_format) for the whole model (io::make_random_packed_case) or given ones (a
//      checkpoint's layer), one runner, prepared once
//   2. per T: fresh random hidden states and logits, one forward whose first tokens are checked against
//      the CPU reference (experts hit from its routing)
//   3. capture one forward in a CUDA graph; warm-up replays; then `reps` replays, each after an L2
//      flush, each timed with its own event pair -> median, min
//   4. a graph of forward_marked (an event record node after each stage), 5 replays -> stage times (medians)
// The SM clock and board power are sampled (runner/clock_monitor.hpp) during step 3's replays.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

#include "fp4moe/bench.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/expert_parallel.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"
#include "runner/clock_monitor.hpp"
#include "runner/device_buffer.hpp"
#include "runner/l2_flush.cuh"

namespace fp4moe {
namespace {

void ck(cudaError_t e, const char* what) { throw_on_cuda_error(e, "bench", what); }
void ck(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw Error(detail::concat("bench: ", what, ": cuBLAS status ", int(s)));
}

struct Buffer : DeviceBuffer {
  explicit Buffer(size_t bytes) : DeviceBuffer(bytes, "bench") {}
};

struct Events {
  std::vector<cudaEvent_t> ev;
  explicit Events(size_t n) : ev(n) {
    for (auto& e : ev) ck(cudaEventCreate(&e), "cudaEventCreate");
  }
  ~Events() {
    for (auto e : ev) cudaEventDestroy(e);
  }
  float ms(size_t a, size_t b) const {
    float t = 0;
    ck(cudaEventElapsedTime(&t, ev[a], ev[b]), "cudaEventElapsedTime");
    return t;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Random activations, logits (and DeepSeek bias) for T tokens, or (precomputed routing: expert
// parallelism) the activations and a rank's ids and weights.
struct LayerInputs {
  std::vector<uint16_t> hidden;  // [T, H] bf16 bits
  std::vector<float> logits;     // [T, E], empty with precomputed routing
  std::vector<float> bias;       // [E] for DeepSeekV3, else empty
  std::vector<int32_t> ids;      // [T, k] precomputed routing only (-1: another rank's expert)
  std::vector<float> weights;    // [T, k] precomputed routing only
};

// Checks the first few tokens of a benchmark forward against the CPU reference (routing identical,
// output within the layer tolerance of tests/runner: relative L2 < 5e-3). Throws on a mismatch.
void refcheck(const MoeProblem& p, const reference::MoeWeights& weights, const LayerInputs& in, int64_t T,
              const void* d_ids, const void* d_out) {
  const int64_t n = std::min<int64_t>(T, 4), H = p.hidden, k = p.top_k();
  reference::RouterInput router;
  if (p.routing.method == RoutingMethod::Precomputed) {
    router.topk_ids = in.ids.data();
    router.topk_weights = in.weights.data();
  } else {
    router.logits = in.logits.data();
    router.bias = in.bias.empty() ? nullptr : in.bias.data();
  }
  const reference::MoeResult ref = reference::moe_forward(p, n, in.hidden.data(), router, weights);
  std::vector<int32_t> ids(n * k);
  std::vector<uint16_t> out(n * H);
  ck(cudaMemcpy(ids.data(), d_ids, ids.size() * 4, cudaMemcpyDeviceToHost), "download ids");
  ck(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost), "download output");
  check(ids == ref.topk_ids, "bench refcheck: topk_ids differ from the CPU reference");
  double num = 0, den = 0;
  for (int64_t i = 0; i < n * H; ++i) {
    const double g = format::bf16_to_float(out[i]), r = format::bf16_to_float(ref.output[i]);
    num += (g - r) * (g - r);
    den += r * r;
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  check(rel < 5e-3, "bench refcheck: output of the first ", n, " tokens has relative L2 error ", rel,
        " against the CPU reference (limit 5e-3)");
}

// Random activations, logits (and DeepSeek bias) for T tokens: normal-ish values from a xorshift.
LayerInputs random_inputs(const MoeProblem& p, int64_t T, uint64_t seed) {
  uint64_t z = (seed + 1) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(T);
  auto normalish = [&z] {  // sum of 4 uniforms, unit variance
    double sum = 0;
    for (int r = 0; r < 4; ++r) {
      z ^= z << 13; z ^= z >> 7; z ^= z << 17;
      sum += double(z >> 11) / double(1ull << 53);
    }
    return float((sum - 2.0) * 1.7320508);
  };
  LayerInputs in;
  in.hidden.resize(T * p.hidden);
  in.logits.resize(T * p.num_experts);
  for (auto& v : in.hidden) v = format::bf16_from_float(normalish());
  for (auto& v : in.logits) v = normalish();
  if (p.routing.method == RoutingMethod::DeepSeekV3) {
    in.bias.resize(p.num_experts);
    for (auto& v : in.bias) v = 0.1f * normalish();
  }
  return in;
}

// The L2 flush before every timed replay (BenchOptions::l2_flush): a 256 MiB buffer, > 4x the 60 MB
// L2, read (runner/l2_flush.cuh) or overwritten by cudaMemset.
class L2Flusher {
 public:
  explicit L2Flusher(L2Flush kind) : kind_(kind), buf_(kBytes), sink_(4) {
    ck(cudaMemset(buf_.ptr, 0, kBytes), "L2 flush buffer");  // written once: its dirty lines leave at the first read
    ck(cudaDeviceSynchronize(), "L2 flush buffer");
    int dev = 0;
    ck(cudaGetDevice(&dev), "cudaGetDevice");
    ck(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev), "SM count");
  }
  // Flush number i of a series (the memset's byte value varies with it).
  void operator()(cudaStream_t stream, int i) const {
    if (kind_ == L2Flush::Write) {
      ck(cudaMemsetAsync(buf_.ptr, i & 0xFF, kBytes, stream), "L2 flush");
      return;
    }
    l2flush::launch_read(buf_.ptr, kBytes, static_cast<uint32_t*>(sink_.ptr), sms_, stream);
    ck(cudaGetLastError(), "L2 flush");
  }

 private:
  static constexpr size_t kBytes = size_t(256) << 20;
  L2Flush kind_;
  Buffer buf_, sink_;
  int sms_ = 0;
};

// One stream capture of enqueue(stream) (which returns the forward's Status), instantiated; the graph
// lives as long as this object.
class CapturedGraph {
 public:
  template <class Enqueue>
  CapturedGraph(cudaStream_t stream, Enqueue&& enqueue) {
    ck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
    const Status s = enqueue(stream);
    ck(cudaStreamEndCapture(stream, &graph_), "end capture");
    if (!s.ok()) {
      cudaGraphDestroy(graph_);
      throw Error(s.message);
    }
    if (cudaError_t e = cudaGraphInstantiate(&exec_, graph_, 0); e != cudaSuccess) {
      cudaGraphDestroy(graph_);
      ck(e, "graph instantiate");
    }
  }
  ~CapturedGraph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void launch(cudaStream_t stream) const { ck(cudaGraphLaunch(exec_, stream), "graph launch"); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Captures one forward in a CUDA graph and times `reps` replays, each after an L2 flush (warm-up
// replays first); returns the per-replay microseconds. With give_up_us > 0, stops after the first
// timed replay when it exceeds give_up_us (the result then has one element). With clocks, the monitor
// samples from the end of the warm-up to the end of the timed replays.
std::vector<double> time_replays(MoeRunner& runner, cudaStream_t stream, const ForwardArgs& a, const L2Flusher& flush,
                                 int warmup, int reps, double give_up_us = 0, int warmup_ms = 0,
                                 ClockMonitor* clocks = nullptr, bool routed = false) {
  const CapturedGraph graph(stream, [&](cudaStream_t s) {
    return routed ? runner.forward_routed(s, a) : runner.forward(s, a);
  });
  Events ev(2 * reps);
  for (int i = 0; i < warmup; ++i) graph.launch(stream);
  bool idle = false;  // the stream has nothing in flight
  if (warmup_ms > 0) {  // replays as the timed ones (flush, forward) for warmup_ms of wall time
    ck(cudaStreamSynchronize(stream), "warm-up");
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() < warmup_ms) {
      for (int i = 0; i < 8; ++i) {  // a batch in flight between host checks
        flush(stream, i);
        graph.launch(stream);
      }
      ck(cudaStreamSynchronize(stream), "warm-up");
    }
    idle = true;  // the loop ends with a synchronisation
  }
  if (clocks) {
    if (!idle) ck(cudaStreamSynchronize(stream), "warm-up");  // the window holds the timed replays only
    clocks->start();
  }
  int timed = 0;  // replays recorded
  for (int i = 0; i < reps; ++i) {
    flush(stream, i);
    ck(cudaEventRecord(ev.ev[2 * i], stream), "record");
    graph.launch(stream);
    ck(cudaEventRecord(ev.ev[2 * i + 1], stream), "record");
    ++timed;
    if (i == 0 && give_up_us > 0) {
      ck(cudaStreamSynchronize(stream), "replay");
      if (1e3 * ev.ms(0, 1) > give_up_us) break;
    }
  }
  ck(cudaStreamSynchronize(stream), "replays");
  std::vector<double> t_us;
  for (int i = 0; i < timed; ++i) t_us.push_back(1e3 * ev.ms(2 * i, 2 * i + 1));
  for (double v : t_us) check(v > 0, "bench: a replay measured ", v, " us");
  return t_us;
}

// The rows of one prepared layer: inputs(T) gives each row's inputs (precomputed routing: ids and
// weights, the layer run by forward_routed).
using InputSource = std::function<LayerInputs(int64_t num_tokens)>;
std::vector<BenchRow> bench_rows(const std::string& model, const MoeProblem& p, const reference::MoeWeights& weights,
                                 const std::vector<int64_t>& tokens, const Ceilings& ceil, const BenchOptions& opt,
                                 bool progress, const InputSource& inputs);

}  // namespace

Ceilings measure_ceilings() {
  Ceilings c;
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  c.gpu_name = prop.name;
  c.sm_count = prop.multiProcessorCount;
  cudaStream_t s;
  ck(cudaStreamCreate(&s), "cudaStreamCreate");
  {  // copy: 2 GiB -> 2 GiB, far beyond L2; bytes read + written
    const size_t bytes = size_t(2) << 30;
    Buffer a(bytes), b(bytes);
    ck(cudaMemsetAsync(a.ptr, 1, bytes, s), "memset");
    Events ev(2);
    std::vector<double> t;
    for (int i = 0; i < 12; ++i) {
      ck(cudaEventRecord(ev.ev[0], s), "record");
      ck(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice, s), "copy");
      ck(cudaEventRecord(ev.ev[1], s), "record");
      ck(cudaEventSynchronize(ev.ev[1]), "sync");
      if (i >= 2) t.push_back(ev.ms(0, 1));
    }
    c.copy_tbps = 2.0 * bytes / (median(t) * 1e-3) / 1e12;
  }
  {  // bf16 GEMM 8192^3 through cuBLAS on random-ish (non-zero) data
    const int n = 8192;
    Buffer a(size_t(n) * n * 2), b(size_t(n) * n * 2), d(size_t(n) * n * 2);
    std::vector<__nv_bfloat16> host(size_t(n) * n);
    uint32_t x = 12345;
    for (auto& v : host) {
      x = x * 1664525u + 1013904223u;
      v = __float2bfloat16(float(int(x >> 9) % 2001 - 1000) / 1000.0f);
    }
    ck(cudaMemcpy(a.ptr, host.data(), host.size() * 2, cudaMemcpyHostToDevice), "upload");
    ck(cudaMemcpy(b.ptr, host.data(), host.size() * 2, cudaMemcpyHostToDevice), "upload");
    cublasHandle_t h;
    ck(cublasCreate(&h), "cublasCreate");
    ck(cublasSetStream(h, s), "cublasSetStream");
    const float one = 1.0f, zero = 0.0f;
    auto gemm = [&] {
      ck(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.ptr, CUDA_R_16BF, n, b.ptr, CUDA_R_16BF, n,
                      &zero, d.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
         "cublasGemmEx");
    };
    Events ev(2);
    std::vector<double> t;
    for (int i = 0; i < 13; ++i) {
      ck(cudaEventRecord(ev.ev[0], s), "record");
      gemm();
      ck(cudaEventRecord(ev.ev[1], s), "record");
      ck(cudaEventSynchronize(ev.ev[1]), "sync");
      if (i >= 3) t.push_back(ev.ms(0, 1));
    }
    c.bf16_tflops = 2.0 * n * n * double(n) / (median(t) * 1e-3) / 1e12;
    cublasDestroy(h);
  }
  cudaStreamDestroy(s);
  return c;
}

std::vector<BenchRow> bench_model(const std::string& model, const MoeProblem& p, const std::vector<int64_t>& tokens,
                                  const Ceilings& ceil, const BenchOptions& opt, bool progress) {
  check(opt.ep_size >= 1 && opt.ep_size <= p.num_experts, "bench: ep_size must be in [1, E = ", p.num_experts,
        "], got ", opt.ep_size);
  check(opt.ep_size == 1 || p.routing.method != RoutingMethod::Precomputed,
        "bench: expert parallelism routes the whole layer, which a precomputed problem cannot");
  // Expert parallelism: rank 0's experts [0, n_local) on precomputed routing (the whole layer's, mapped).
  const int64_t n_local = io::expert_range(p.num_experts, 0, opt.ep_size).second;
  const MoeProblem local = opt.ep_size > 1 ? p.expert_parallel_rank(n_local) : p;
  if (progress)
    std::fprintf(stderr, "bench %s: preparing random %s weights ...\n", model.c_str(),
                 p.weight_format == WeightFormat::MXFP4 ? "MXFP4" : "NVFP4");
  io::MoeCase random = io::make_random_packed_case(local, 0, opt.seed);
  if (opt.expert_biases) io::add_random_expert_biases(random, opt.seed);
  if (opt.ep_size == 1)
    return bench_rows(model, p, random.weights(), tokens, ceil, opt, progress,
                      [&](int64_t T) { return random_inputs(p, T, opt.seed); });
  return bench_rows(model, local, random.weights(), tokens, ceil, opt, progress, [&](int64_t T) {
    LayerInputs in = random_inputs(p, T, opt.seed);  // the whole layer's logits, routed on the CPU
    const reference::Routing r =
        reference::route(p.routing, T, p.num_experts, in.logits.data(), in.bias.empty() ? nullptr : in.bias.data());
    in.ids = r.ids;
    for (int32_t& id : in.ids) id = id < n_local ? id : -1;  // rank 0 holds experts [0, n_local)
    in.weights = r.weights;
    in.logits.clear();
    in.bias.clear();
    return in;
  });
}

std::vector<BenchRow> bench_weights(const std::string& model, const MoeProblem& p, const reference::MoeWeights& weights,
                                    const std::vector<int64_t>& tokens, const Ceilings& ceil, const BenchOptions& opt,
                                    bool progress) {
  check(p.routing.method != RoutingMethod::Precomputed,
        "bench: a problem with precomputed routing cannot be benchmarked from logits");
  return bench_rows(model, p, weights, tokens, ceil, opt, progress,
                    [&](int64_t T) { return random_inputs(p, T, opt.seed); });
}

namespace {

std::vector<BenchRow> bench_rows(const std::string& model, const MoeProblem& p, const reference::MoeWeights& weights,
                                 const std::vector<int64_t>& tokens, const Ceilings& ceil, const BenchOptions& opt,
                                 bool progress, const InputSource& inputs) {
  check(opt.reps >= 20, "bench: reps must be >= 20, got ", opt.reps);
  check(!tokens.empty(), "bench: no token counts given");
  for (int64_t t : tokens) check(t >= 1, "bench: token counts must be >= 1, got ", t);
  const int64_t max_t = *std::max_element(tokens.begin(), tokens.end());
  const int64_t E = p.num_experts, H = p.hidden, I = p.inter, k = p.top_k(), N13 = p.w13_rows();
  const bool routed = p.routing.method == RoutingMethod::Precomputed;  // expert parallelism

  auto runner = MoeRunner::create(p, max_t);
  if (Status s = runner->prepare_weights(weights); !s.ok()) throw Error(s.message);
  runner->force_tactic(opt.tactic);

  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const size_t ws_bytes = runner->workspace_size(max_t);
  Buffer ws(ws_bytes), hidden(max_t * H * 2), logits(max_t * E * 4), bias(E * 4), ids(max_t * k * 4),
      wts(max_t * k * 4), out(max_t * H * 2);
  const L2Flusher flush(opt.l2_flush);
  int dev = 0;
  char bus_id[32] = {};
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  ck(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), dev), "cudaDeviceGetPCIBusId");
  ClockMonitor clocks(bus_id);
  if (progress && !clocks.available())
    std::fprintf(stderr, "bench: rows without SM clock and power: %s\n", clocks.reason().c_str());

  std::vector<BenchRow> rows;
  for (int64_t T : tokens) {
    const LayerInputs in = inputs(T);
    const std::vector<float>& bs = in.bias;
    ck(cudaMemcpy(hidden.ptr, in.hidden.data(), in.hidden.size() * 2, cudaMemcpyHostToDevice), "upload hidden");
    if (routed) {
      ck(cudaMemcpy(ids.ptr, in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice), "upload ids");
      ck(cudaMemcpy(wts.ptr, in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice), "upload weights");
    } else {
      ck(cudaMemcpy(logits.ptr, in.logits.data(), in.logits.size() * 4, cudaMemcpyHostToDevice), "upload logits");
    }
    const bool has_bias = !bs.empty();
    if (has_bias) ck(cudaMemcpy(bias.ptr, bs.data(), E * 4, cudaMemcpyHostToDevice), "upload bias");

    ForwardArgs a;
    a.num_tokens = T;
    a.hidden = hidden.ptr;
    a.router_logits = routed ? nullptr : logits.ptr;
    a.routing_bias = has_bias ? static_cast<const float*>(bias.ptr) : nullptr;
    a.topk_ids = static_cast<int32_t*>(ids.ptr);
    a.topk_weights = static_cast<float*>(wts.ptr);
    a.output = out.ptr;
    a.workspace = ws.ptr;
    a.workspace_bytes = ws_bytes;
    if (Status s = routed ? runner->forward_routed(stream, a) : runner->forward(stream, a); !s.ok())
      throw Error(s.message);
    ck(cudaStreamSynchronize(stream), "forward");

    if (opt.refcheck) refcheck(p, weights, in, T, ids.ptr, out.ptr);

    BenchRow row;
    row.model = model;
    row.mode = p.act_quant;
    row.tokens = T;
    row.tactic = describe(runner->tactic_for(T));
    int64_t local_slots = T * k;  // the (token, slot) pairs this layer computes
    {
      std::vector<int32_t> got(T * k);
      ck(cudaMemcpy(got.data(), ids.ptr, got.size() * 4, cudaMemcpyDeviceToHost), "download ids");
      std::set<int32_t> hit(got.begin(), got.end());
      if (routed) {  // expert parallelism: -1 is another rank's slot
        hit.erase(-1);
        local_slots = std::count_if(got.begin(), got.end(), [](int32_t id) { return id >= 0; });
      }
      row.experts_hit = static_cast<int64_t>(hit.size());
    }

    if (opt.idle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(opt.idle_ms));
    // NOTE: the clock window opens after the rest and the warm-up (time_replays starts it): neither is the row's.
    const std::vector<double> t_us =
        time_replays(*runner, stream, a, flush, opt.warmup, opt.reps, 0.0, opt.warmup_ms, &clocks, routed);
    row.clock = clocks.stop();
    row.median_us = median(t_us);
    row.min_us = *std::min_element(t_us.begin(), t_us.end());
    row.replay_us = t_us;

    // Stage times: a graph of the forward with an event record node after each stage, replayed 5 times
    // (L2 flushed before each), so that no stage depends on how fast the host launches. NOTE: the nodes
    // serialise the stages (no launch overlaps the one before it), so the stages add up to more than
    // the layer, and a stage without a kernel still reads ~1.2 us (two event nodes). The stream-ordered
    // forward it replaces gave the same times within noise on an H200 (qwen3-30b-a3b T = 1: route 6.8
    // -> 7.2 us, GEMM1 13.5 -> 13.8, GEMM2 12.0 -> 11.3).
    Events marks(kForwardStages + 1);
    std::vector<std::vector<double>> st(kForwardStages);
    {
      const CapturedGraph marked(
          stream, [&](cudaStream_t s) { return forward_marked(*runner, s, a, routed, marks.ev.data()); });
      for (int i = 0; i < 5; ++i) {
        flush(stream, i);
        marked.launch(stream);
        ck(cudaStreamSynchronize(stream), "instrumented forward");
        for (int j = 0; j < kForwardStages; ++j) st[j].push_back(1e3 * marks.ms(j, j + 1));
      }
    }
    row.stages = {median(st[0]), median(st[1]), median(st[2]), median(st[3]), median(st[4]), median(st[5])};

    const double params_per_expert = double(N13) * H + double(H) * I;
    // Bytes per weight in the problem's own format: 1/2 + one scale byte per block (NVFP4 16, MXFP4 32).
    // NOTE: the MXFP4 kernels read the NVFP4-equivalent scales (one byte per 16); the floor counts what the
    // format needs, so that difference shows as lost time.
    row.weight_bytes = row.experts_hit * params_per_expert * (0.5 + 1.0 / double(p.weight_block()));
    // Activations in and out, and the router input: logits, or (expert parallelism) ids and weights.
    row.bytes = row.weight_bytes + double(T) * H * 2 * 2 + (routed ? double(T) * k * 8 : double(T) * E * 4);
    row.flops = 2.0 * double(local_slots) * params_per_expert;
    row.floor_us = std::max(row.bytes / (ceil.copy_tbps * 1e12), row.flops / (ceil.bf16_tflops * 1e12)) * 1e6;
    row.pct_of_floor = 100.0 * row.floor_us / row.median_us;
    row.tflops = row.flops / (row.median_us * 1e-6) / 1e12;
    row.weight_tbps = row.weight_bytes / (row.median_us * 1e-6) / 1e12;
    if (progress) {
      std::string clock;
      if (row.clock.samples > 0)
        clock = detail::concat(", SM ", static_cast<int>(row.clock.mean_sm_mhz), " MHz, ",
                               static_cast<int>(row.clock.mean_power_w), " W");
      std::fprintf(stderr, "bench %s %s T=%lld: %.1f us (floor %.1f us, %.0f%%%s)\n", model.c_str(),
                   std::string(to_string(p.act_quant)).c_str(), static_cast<long long>(T), row.median_us,
                   row.floor_us, row.pct_of_floor, clock.c_str());
    }
    rows.push_back(row);
  }
  cudaStreamDestroy(stream);
  return rows;
}

}  // namespace

std::vector<TuneEntry> tune_problem(const std::string& label, const MoeProblem& p, const TuneProfileOptions& o) {
  check(o.reps >= 5, "tune: reps must be >= 5, got ", o.reps);
  check(!o.tokens.empty() || o.max_tokens >= 1, "tune: max_tokens must be >= 1, got ", o.max_tokens);
  check(p.routing.method != RoutingMethod::Precomputed, "tune: a problem with precomputed routing cannot be tuned from logits");
  const std::vector<int> buckets = buckets_to_tune(o.max_tokens, o.tokens);  // never bucket 0 (T = 0)
  check(!buckets.empty(), o.tokens.empty() ? detail::concat("tune: no bucket up to max_tokens ", o.max_tokens)
                                           : std::string("tune: no token count >= 1 given"));
  const int64_t max_t = bucket_range(buckets.back()).representative;
  const std::vector<MoeTactic> candidates = candidate_tactics(p);
  if (o.progress) std::fprintf(stderr, "tune %s: preparing random NVFP4 weights ...\n", label.c_str());
  const io::MoeCase random = io::make_random_packed_case(p, 0, o.seed);
  auto runner = MoeRunner::create(p, max_t);
  if (Status s = runner->prepare_weights(random.weights()); !s.ok()) throw Error(s.message);
  size_t ws_bytes = 0;  // the largest workspace of any candidate
  for (const MoeTactic& t : candidates) {
    runner->force_tactic(t);
    ws_bytes = std::max(ws_bytes, runner->workspace_size(max_t));
  }
  const int64_t E = p.num_experts, H = p.hidden, k = p.top_k();
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  Buffer ws(ws_bytes), hidden(max_t * H * 2), logits(max_t * E * 4), bias(E * 4), ids(max_t * k * 4),
      wts(max_t * k * 4), out(max_t * H * 2);
  const L2Flusher flush(o.l2_flush);

  std::vector<TuneEntry> entries;
  for (size_t bi = 0; bi < buckets.size(); ++bi) {
    const int b = buckets[bi];
    const int64_t T = bucket_range(b).representative;
    const LayerInputs in = random_inputs(p, T, o.seed);
    ck(cudaMemcpy(hidden.ptr, in.hidden.data(), in.hidden.size() * 2, cudaMemcpyHostToDevice), "upload hidden");
    ck(cudaMemcpy(logits.ptr, in.logits.data(), in.logits.size() * 4, cudaMemcpyHostToDevice), "upload logits");
    if (!in.bias.empty()) ck(cudaMemcpy(bias.ptr, in.bias.data(), E * 4, cudaMemcpyHostToDevice), "upload bias");
    ForwardArgs a;
    a.num_tokens = T;
    a.hidden = hidden.ptr;
    a.router_logits = logits.ptr;
    a.routing_bias = in.bias.empty() ? nullptr : static_cast<const float*>(bias.ptr);
    a.topk_ids = static_cast<int32_t*>(ids.ptr);
    a.topk_weights = static_cast<float*>(wts.ptr);
    a.output = out.ptr;
    a.workspace = ws.ptr;
    a.workspace_bytes = ws_bytes;

    const MoeTactic heuristic = heuristic_tactic(p, T);
    // The heuristic first: it sets the bar the others must beat.
    std::vector<MoeTactic> order = {heuristic};
    for (const MoeTactic& t : candidates)
      if (!(t == heuristic)) order.push_back(t);
    TuneEntry e;
    e.device = runner->device_key();
    e.problem = p;
    e.bucket = b;
    e.heuristic = heuristic;
    // 1. Screening: every candidate once, the heuristic first.
    std::vector<std::pair<double, MoeTactic>> screened;  // (median us, tactic)
    double best = 0;
    int reps = o.reps;
    for (const MoeTactic& t : order) {
      runner->force_tactic(t);
      // NOTE: a candidate whose first replay is 1.5x the best median is not within noise of winning.
      const std::vector<double> us =
          time_replays(*runner, stream, a, flush, 1, reps, best > 0 ? 1.5 * best : 0.0);
      const double m = median(us);
      // Long layers vary less (~1% at 1 ms and above): about 100 ms of replays per candidate is enough.
      if (best == 0) reps = static_cast<int>(std::clamp(1e5 / m, 7.0, static_cast<double>(o.reps)));
      if (best == 0 || m < best) best = m;
      screened.emplace_back(m, t);
      if (log_level() >= LogLevel::Debug)
        log_line(detail::concat("tune ", label, " T=", T, ": screen ", describe(t), " ", m, " us (", us.size(),
                                " replays)"),
                 LogLevel::Debug);
    }
    // 2. Confirmation: the heuristic and the two fastest others, timed again in turns (kRounds rounds),
    // and chosen by the median of those replays alone.
    // NOTE: a single pass decides on one median per candidate, taken at its own moment; timing the
    // finalists again in turns puts a slow phase of the device (clock, power) on all of them. It does
    // not explain every gap between tune and bench: deepseek-r1 w4a4_scalar T = 256 is tuned to the
    // streaming kernel (1691 us in the tune) while the bench times wgmma t128 at 1459 us and the
    // streaming kernel at 1591 us.
    std::stable_sort(screened.begin() + 1, screened.end(),
                     [](const auto& x, const auto& y) { return x.first < y.first; });
    screened.resize(std::min<size_t>(screened.size(), 3));  // [0] is the heuristic
    std::vector<std::vector<double>> confirm(screened.size());
    constexpr int kRounds = 2;
    for (int round = 0; round < kRounds; ++round)
      for (size_t i = 0; i < screened.size(); ++i) {
        runner->force_tactic(screened[i].second);
        const std::vector<double> us = time_replays(*runner, stream, a, flush, 1, reps);
        confirm[i].insert(confirm[i].end(), us.begin(), us.end());
      }
    if (log_level() >= LogLevel::Debug)
      for (size_t i = 0; i < screened.size(); ++i)
        log_line(detail::concat("tune ", label, " T=", T, ": confirm ", describe(screened[i].second), " ",
                                median(confirm[i]), " us (", confirm[i].size(), " replays)"),
                 LogLevel::Debug);
    e.heuristic_us = median(confirm[0]);
    e.tactic = heuristic;
    e.tactic_us = e.heuristic_us;
    for (size_t i = 1; i < screened.size(); ++i) {
      const double m = median(confirm[i]);
      // NOTE: a win inside the replay noise (~1.5%) is not a win: keep the heuristic then, so that a
      // tuned choice never trades a known default for a coin flip.
      if (m < e.tactic_us && m < 0.985 * e.heuristic_us) {
        e.tactic = screened[i].second;
        e.tactic_us = m;
      }
    }
    entries.push_back(e);
    if (o.progress)
      std::fprintf(stderr, "\rtune %s: [%3zu/%3zu] T=%-6lld best %-20s %9.1f us (heuristic %9.1f us)   ", label.c_str(),
                   bi + 1, buckets.size(), static_cast<long long>(T), describe(e.tactic).c_str(), e.tactic_us,
                   e.heuristic_us);
  }
  if (o.progress) std::fprintf(stderr, "\n");
  runner->force_tactic(std::nullopt);
  cudaStreamDestroy(stream);
  return entries;
}


// ---- expert parallelism: the ExpertParallelLayer group, virtual ranks or NCCL --------------------------

namespace {

// What the ranks' threads of one bench row share: step s of rank r is stages[s * ranks + r].
struct EpSteps {
  int steps = 0;
  std::barrier<>* sync = nullptr;
  std::vector<double> step_us;  // written by rank 0
  std::vector<ExpertParallelStageTimes> stages;
  std::vector<std::string> errors;  // per rank; a failed rank keeps arriving at the barrier
};

// One rank's thread: `steps` forwards, each started and ended together with the other ranks'.
void run_ep_rank_steps(EpSteps& run, ExpertParallelLayer& layer, ExpertParallelArgs args, int rank, int ranks,
                       int device) {
  std::string& error = run.errors[size_t(rank)];
  cudaStream_t stream = nullptr;
  if (cudaSetDevice(device) != cudaSuccess || cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
    error = "cudaStreamCreate failed";
  for (int i = 0; i < run.steps; ++i) {
    run.sync->arrive_and_wait();
    const auto t0 = std::chrono::steady_clock::now();
    if (error.empty()) {
      const Status s = layer.forward(stream, args);
      if (!s.ok()) error = s.message;
      else if (cudaStreamSynchronize(stream) != cudaSuccess) error = "the forward's stream failed";
    }
    run.sync->arrive_and_wait();  // the step ends when every rank's forward has
    if (rank == 0)
      run.step_us[size_t(i)] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (error.empty())
      if (Status s = layer.last_stage_times(run.stages[size_t(i) * size_t(ranks) + size_t(rank)]); !s.ok())
        error = s.message;
  }
  if (stream) cudaStreamDestroy(stream);
}

}  // namespace

std::vector<ExpertParallelBenchRow> bench_expert_parallel(const std::string& model, const MoeProblem& p,
                                                          const std::vector<int64_t>& tokens,
                                                          const ExpertParallelGroup& group, const BenchOptions& opt,
                                                          bool progress) {
  const int ranks = group.ranks;
  const ExpertParallelScheme scheme = group.scheme;
  check(ranks >= 1 && ranks <= p.num_experts, "bench --parallel ep_all2all/dp_allgather: --ep-size must be in [1, E = ",
        p.num_experts, "], got ", ranks);
  check(p.routing.method != RoutingMethod::Precomputed,
        "bench --parallel ep_all2all/dp_allgather: every rank routes random logits, which a precomputed problem cannot");
  check(opt.reps >= 20, "bench: reps must be >= 20, got ", opt.reps);
  check(!tokens.empty(), "bench: no token counts given");
  for (int64_t t : tokens) check(t >= 1, "bench: token counts must be >= 1, got ", t);
  const int64_t max_t = *std::max_element(tokens.begin(), tokens.end());
  const int64_t H = p.hidden, E = p.num_experts, k = p.top_k();
  if (group.nccl) {
    int count = 0;
    ck(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    check(count >= ranks, "bench --nccl: ", ranks, " ranks need ", ranks, " GPUs; this machine has ", count);
  }
  if (progress)
    std::fprintf(stderr, "bench %s: preparing random weights for %d %s ...\n", model.c_str(), ranks,
                 group.nccl ? "NCCL ranks (one per GPU)" : "virtual ranks");
  io::MoeCase whole = io::make_random_packed_case(p, 0, opt.seed);
  if (opt.expert_biases) io::add_random_expert_biases(whole, opt.seed);
  int current = 0;
  ck(cudaGetDevice(&current), "cudaGetDevice");
  std::vector<int> devices(size_t(ranks), current);  // rank r's GPU: all the current one, or GPU r with NCCL
  if (group.nccl) std::iota(devices.begin(), devices.end(), 0);
  std::vector<std::unique_ptr<Communicator>> comms = group.nccl ? make_nccl_ranks(devices) : make_virtual_ranks(ranks);
  std::vector<std::unique_ptr<ExpertParallelLayer>> layers;
  std::vector<std::unique_ptr<DeviceBuffer>> hidden, logits, bias, ids, wts, out;
  for (int r = 0; r < ranks; ++r) {
    ExpertParallelOptions lo;
    lo.time_stages = true;
    lo.scheme = scheme;
    ck(cudaSetDevice(devices[r]), "cudaSetDevice");  // the rank's input and output buffers on its GPU
    layers.push_back(ExpertParallelLayer::create(p, max_t, *comms[r], lo, devices[r]));
    const ExpertParallelWeights w = expert_parallel_weights(p, whole.weights(), r, ranks);
    if (Status s = layers.back()->prepare_weights(w); !s.ok()) throw Error(s.message);
    hidden.push_back(std::make_unique<DeviceBuffer>(size_t(max_t * H * 2), "bench hidden"));
    logits.push_back(std::make_unique<DeviceBuffer>(size_t(max_t * E * 4), "bench logits"));
    bias.push_back(std::make_unique<DeviceBuffer>(size_t(E * 4), "bench bias"));
    ids.push_back(std::make_unique<DeviceBuffer>(size_t(max_t * k * 4), "bench ids"));
    wts.push_back(std::make_unique<DeviceBuffer>(size_t(max_t * k * 4), "bench weights"));
    out.push_back(std::make_unique<DeviceBuffer>(size_t(max_t * H * 2), "bench output"));
  }
  ck(cudaSetDevice(current), "cudaSetDevice");
  std::vector<ExpertParallelBenchRow> rows;
  for (int64_t T : tokens) {
    std::vector<LayerInputs> in;
    for (int r = 0; r < ranks; ++r) {  // every rank its own tokens
      in.push_back(random_inputs(p, T, opt.seed + 1000 * uint64_t(r + 1)));
      ck(cudaMemcpy(hidden[r]->ptr, in[r].hidden.data(), in[r].hidden.size() * 2, cudaMemcpyHostToDevice), "upload hidden");
      ck(cudaMemcpy(logits[r]->ptr, in[r].logits.data(), in[r].logits.size() * 4, cudaMemcpyHostToDevice), "upload logits");
      if (!in[r].bias.empty())
        ck(cudaMemcpy(bias[r]->ptr, in[r].bias.data(), in[r].bias.size() * 4, cudaMemcpyHostToDevice), "upload bias");
    }
    const int steps = opt.warmup + opt.reps;
    EpSteps run;
    run.steps = steps;
    run.step_us.assign(size_t(steps), 0.0);
    run.stages.assign(size_t(steps) * size_t(ranks), ExpertParallelStageTimes{});
    run.errors.assign(size_t(ranks), std::string());
    std::barrier sync(ranks);
    run.sync = &sync;
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      ExpertParallelArgs a;
      a.num_tokens = T;
      a.hidden = hidden[r]->ptr;
      a.router_logits = logits[r]->ptr;
      a.routing_bias = in[r].bias.empty() ? nullptr : bias[r]->as<float>();
      a.topk_ids = ids[r]->as<int32_t>();
      a.topk_weights = wts[r]->as<float>();
      a.output = out[r]->ptr;
      threads.emplace_back(run_ep_rank_steps, std::ref(run), std::ref(*layers[r]), a, r, ranks, devices[r]);
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < ranks; ++r)
      check(run.errors[r].empty(), "bench --parallel ep_all2all/dp_allgather: rank ", r, ": ", run.errors[r]);
    if (opt.refcheck) refcheck(p, whole.weights(), in[0], T, ids[0]->ptr, out[0]->ptr);  // rank 0 is the whole layer's
    std::vector<double> timed(run.step_us.begin() + opt.warmup, run.step_us.end());
    std::sort(timed.begin(), timed.end());
    ExpertParallelBenchRow row;
    row.model = model;
    row.scheme = scheme;
    row.mode = p.act_quant;
    row.ranks = ranks;
    row.tokens_per_rank = T;
    row.median_us = timed[timed.size() / 2];
    row.min_us = timed.front();
    auto stage_median = [&](double ExpertParallelStageTimes::*field) {
      std::vector<double> slowest;
      for (int i = opt.warmup; i < steps; ++i) {
        double m = 0;
        for (int r = 0; r < ranks; ++r) m = std::max(m, run.stages[size_t(i) * size_t(ranks) + size_t(r)].*field);
        slowest.push_back(m);
      }
      std::sort(slowest.begin(), slowest.end());
      return slowest[slowest.size() / 2];
    };
    row.dispatch_us = stage_median(&ExpertParallelStageTimes::dispatch_us);
    row.experts_us = stage_median(&ExpertParallelStageTimes::experts_us);
    row.combine_us = stage_median(&ExpertParallelStageTimes::combine_us);
    row.exchange_us = stage_median(&ExpertParallelStageTimes::exchange_us);
    for (int r = 0; r < ranks; ++r) {
      const ExpertParallelTraffic t = layers[r]->last_traffic();
      row.rows_sent += t.rows_sent;
      row.dispatch_bytes += t.dispatch_bytes;
      row.combine_bytes += t.combine_bytes;
    }
    const int rows_top_k = layers[0]->rows_top_k();
    row.row_bytes_expected = (p.act_quant == ActQuant::W4A16 ? 2 * H : H / 2 + H / 16) +
                             (scheme == ExpertParallelScheme::AllToAll ? 4 : 8) * rows_top_k;
    rows.push_back(row);
    if (progress)
      std::fprintf(stderr, "bench %s %s N=%d T=%lld/rank: %.1f us per step (dispatch %.1f, experts %.1f, "
                   "combine %.1f, exchanges %.1f us)\n", model.c_str(), to_string(scheme), ranks,
                   static_cast<long long>(T), row.median_us, row.dispatch_us, row.experts_us, row.combine_us,
                   row.exchange_us);
  }
  return rows;
}

}  // namespace fp4moe
