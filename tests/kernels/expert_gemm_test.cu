// tests/kernels/expert_gemm_test.cu — the expert GEMMs (launch_gemm1_act, launch_gemm2: ExpertGemmKernel.*;
// the streaming kernel launch_gemm1_act_stream, launch_gemm2_stream with split_k 1, 3, 5:
// ExpertGemmStream.*) and the weight prepack against the CPU oracle (format::dequantize_nvfp4, reference::apply_activation,
// format::quantize_nvfp4), on random problems with ragged experts (0, 1, 9, 17, 63, 64, 65, 4097 rows),
// shapes that are not tile multiples (K = 2880, 96; N = 192, 2880), every activation and quant mode.
//
// Tolerance (docs/numerics.md): the GPU sums the exact products a_i * w_i in fp32 (tensor-core order),
// the oracle in double rounded once; per output
//   h:    |h_gpu - h_ref| <= 1e-5 * |alpha| * sum_i |a_i w_i|          (err_h; ~30x the sqrt(K) * 2^-24
//                                                                        estimate for K <= 8192)
//   y:    GEMM2 output is h itself.
//   act:  w4a16: |gpu - ref| <= 1 bf16 ulp of ref + L * err_h, L a local Lipschitz bound of the
//         activation (4 (|u| + 1) + 2|g| for d/dg, |g| + 7 for d/du, covering all four kinds).
//         w4a4: the 16-blocks are compared: a block matches when each value is within that bound;
//         at most max(2, 0.5%) of the blocks may differ (a value near a rounding boundary of the
//         re-quantization may flip), and those only by less than half the block's amax.
// The layout test needs no GPU: it emulates each lane's fragment decode on the host.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"
#include "kernels/nvfp4/weight_layout.cuh"
#include "kernels/launch.hpp"
#include "kernels/gpu_test_util.hpp"
#include "kernels/permute_buffers.hpp"

namespace fp4moe {
namespace {

using test::DeviceBuffer;
namespace fl = kernels::nvfp4;

float bf16_bits_to_float(uint16_t b) { return format::bf16_to_float(b); }
float bf16_round(float x) { return format::bf16_to_float(format::bf16_from_float(x)); }
// Unit in the last place of a bf16 value of magnitude |x| (normal range; the subnormal quantum below).
double bf16_ulp(double x) {
  const double a = std::fabs(x);
  if (!(a >= 1.1754943508222875e-38)) return std::ldexp(1.0, -133);
  return std::ldexp(1.0, std::ilogb(a) - 7);
}

// Random canonical NVFP4 weights [E, N, K/2] + scales [E, N, K/16]: every e2m1 code; scales mostly
// 2^-3..2^3, with some zero, subnormal, negative and maximal (448) codes.
struct CanonicalWeights {
  std::vector<uint8_t> w, scale;
};
CanonicalWeights random_weights(std::mt19937& rng, int64_t E, int64_t N, int64_t K) {
  CanonicalWeights cw;
  cw.w.resize(static_cast<size_t>(E * N * K / 2));
  cw.scale.resize(static_cast<size_t>(E * N * K / 16));
  std::uniform_int_distribution<int> byte(0, 255), pick(0, 99), normal(0x20, 0x50), sub(1, 7);
  for (auto& b : cw.w) b = static_cast<uint8_t>(byte(rng));
  for (auto& s : cw.scale) {
    const int p = pick(rng);
    uint8_t c = static_cast<uint8_t>(normal(rng));
    if (p < 3) c = 0x00;
    else if (p < 6) c = static_cast<uint8_t>(sub(rng));
    else if (p < 7) c = 0x7E;
    if (pick(rng) < 4) c |= 0x80;  // a negative scale: q * sf with sf < 0
    s = c;
  }
  return cw;
}

// ---- layout (CPU only) --------------------------------------------------------------------------------
// Decodes the prepacked arrays the way lane 4g+t of a consumer does and checks that every element comes
// out as q * sf * 2^-8 of the canonical weights (bit-exact), at the column the fragment layout says.
void check_prepack_roundtrip(int64_t E, int64_t N, int64_t K, uint32_t seed) {
  std::mt19937 rng(seed);
  const CanonicalWeights cw = random_weights(rng, E, N, K);
  std::vector<uint8_t> pw, ps;
  const kernels::PrepackedWeights info = kernels::prepack_expert_weights(cw.w.data(), cw.scale.data(), E, N, K, pw, ps);
  ASSERT_EQ(info.padded_cols % fl::kChunkK, 0);
  ASSERT_GE(info.padded_cols, K);
  ASSERT_LT(info.padded_cols - K, fl::kChunkK);
  ASSERT_EQ(pw.size(), info.weight_bytes);
  ASSERT_EQ(ps.size(), info.scale_bytes);
  const int64_t groups = N / 8, chunks = info.padded_cols / fl::kChunkK;
  std::vector<float> ref(static_cast<size_t>(N * K));
  int64_t mismatches = 0;
  for (int64_t e = 0; e < E; ++e) {
    format::dequantize_nvfp4(cw.w.data() + e * N * K / 2, cw.scale.data() + e * N * K / 16, N, K, ref.data());
    for (int64_t grp = 0; grp < groups; ++grp)
      for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* wchunk = pw.data() + fl::weight_offset(e, grp, c, groups, chunks);
        const uint8_t* schunk = ps.data() + fl::scale_offset(e, grp, c, groups, chunks);
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          const int64_t n = grp * 8 + g;
          uint32_t scodes[2];
          std::memcpy(scodes, schunk + g * 8, 8);
          for (int q = 0; q < 4; ++q) {
            uint32_t word;
            std::memcpy(&word, wchunk + lane * 16 + q * 4, 4);
            uint32_t out[4];
            fl::decode_word(word, out);
            const uint32_t sc = fl::decode_scale_pair(scodes[q / 2], (q & 1) != 0);
            for (int j = 0; j < 4; ++j)
              for (int h = 0; h < 2; ++h) {
                const float wv = bf16_bits_to_float(static_cast<uint16_t>(out[j] >> (16 * h)));
                const float sv = bf16_bits_to_float(static_cast<uint16_t>(sc >> (16 * (j / 2))));  // steps 2q, 2q+1
                const float got = wv * sv;  // exact (the bf16 product is exact, so is this fp32 one)
                EXPECT_EQ(got, bf16_round(got)) << "decoded weight is not a bf16 value";
                const int64_t k = c * fl::kChunkK + fl::element_col(q, j, h, t);
                const float want = k < K ? std::ldexp(ref[static_cast<size_t>(n * K + k)], -8) : 0.0f;
                if (!(got == want) && mismatches++ < 10)
                  ADD_FAILURE() << "expert " << e << " row " << n << " col " << k << ": decoded " << got
                                << ", want " << want;
              }
          }
        }
      }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(ExpertGemmLayout, PrepackDecodeRoundTrip) {
  check_prepack_roundtrip(2, 16, 128, 1);
  check_prepack_roundtrip(3, 48, 96, 2);     // K < 128: padded chunk
  check_prepack_roundtrip(1, 32, 2880, 3);   // K % 128 == 64
  check_prepack_roundtrip(2, 64, 272, 4);
}

TEST(ExpertGemmLayout, DecodesEveryCodeAndScale) {
  // K = 128, the first row group: rows 0..7 see every e2m1 code against every scale class.
  const int64_t N = 16, K = 128;
  std::vector<uint8_t> w(N * K / 2), s(N * K / 16);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>(i * 37 + 11);
  const uint8_t scales[] = {0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x38, 0x7E, 0x80, 0x81, 0xB8, 0xFE, 0x0F};
  for (size_t i = 0; i < s.size(); ++i) s[i] = scales[i % 16];
  std::vector<uint8_t> pw, ps;
  kernels::prepack_expert_weights(w.data(), s.data(), 1, N, K, pw, ps);
  std::vector<float> ref(N * K);
  format::dequantize_nvfp4(w.data(), s.data(), N, K, ref.data());
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    uint32_t scodes[2];
    std::memcpy(scodes, ps.data() + g * 8, 8);
    for (int q = 0; q < 4; ++q) {
      uint32_t word, out[4];
      std::memcpy(&word, pw.data() + lane * 16 + q * 4, 4);
      fl::decode_word(word, out);
      const uint32_t sc = fl::decode_scale_pair(scodes[q / 2], (q & 1) != 0);
      for (int j = 0; j < 4; ++j)
        for (int h = 0; h < 2; ++h) {
          const float got = bf16_bits_to_float(static_cast<uint16_t>(out[j] >> (16 * h))) *
                            bf16_bits_to_float(static_cast<uint16_t>(sc >> (16 * (j / 2))));
          const int k = fl::element_col(q, j, h, t);
          EXPECT_EQ(got * fl::kAccumulatorScale, ref[g * K + k]) << "row " << g << " col " << k;
        }
    }
  }
}

TEST(ExpertGemmLayout, PrepackRejectsBadInput) {
  std::vector<uint8_t> w(16 * 32 / 2, 0x22), s(16 * 32 / 16, 0x38), pw, ps;
  EXPECT_THROW(kernels::prepack_expert_weights(w.data(), s.data(), 1, 16, 24, pw, ps), Error);  // K % 16
  EXPECT_THROW(kernels::prepack_expert_weights(w.data(), s.data(), 1, 8, 32, pw, ps), Error);   // N % 16
  s[5] = 0x7F;  // NaN scale
  EXPECT_THROW(kernels::prepack_expert_weights(w.data(), s.data(), 1, 16, 32, pw, ps), Error);
  s[5] = 0xFF;
  EXPECT_THROW(kernels::prepack_expert_weights(w.data(), s.data(), 1, 16, 32, pw, ps), Error);
}

// ---- GPU -----------------------------------------------------------------------------------------------
struct GemmCase {
  std::string name;
  int64_t E, H, I;
  std::vector<int64_t> rows;  // rows per expert (size E)
  ActivationParams act;
  ActQuant mode;
  uint32_t seed;
};

// The kernel under test: its tile size (the tile table is built for it), its launchers, split_k.
struct GemmKernelUnderTest {
  std::string name;
  int tile_rows;
  int split_k;
  cudaError_t (*gemm1)(const kernels::Gemm1Args&, int tile_rows, int split_k, cudaStream_t);
  cudaError_t (*gemm2)(const kernels::Gemm2Args&, int tile_rows, int split_k, cudaStream_t);
};
// The wgmma kernel through launch_gemm1_act / launch_gemm2, with the tactic of its tile size.
GemmKernelUnderTest wgmma_kernel(int tile_rows = kernels::gemm_tile_rows()) {
  return {"sm90_wgmma/t" + std::to_string(tile_rows), tile_rows, 1,
          [](const kernels::Gemm1Args& a, int tile, int, cudaStream_t s) {
            kernels::Gemm1Args b = a;
            b.tactic = {GemmKernel::Sm90Wgmma, tile, 1, 1};
            return kernels::launch_gemm1_act(b, s);
          },
          [](const kernels::Gemm2Args& a, int tile, int, cudaStream_t s) {
            kernels::Gemm2Args b = a;
            b.tactic = {GemmKernel::Sm90Wgmma, tile, 1, 1};
            return kernels::launch_gemm2(b, s);
          }};
}
// The three tile shapes of the wgmma kernel (64, 128 and 256 token rows).
std::vector<GemmKernelUnderTest> wgmma_kernels() { return {wgmma_kernel(64), wgmma_kernel(128), wgmma_kernel(256)}; }
GemmKernelUnderTest stream_kernel(int split_k, int tile_rows = 16) {
  return {"sm90_stream/t" + std::to_string(tile_rows) + "/s" + std::to_string(split_k), tile_rows, split_k,
          kernels::launch_gemm1_act_stream, kernels::launch_gemm2_stream};
}

// Rows permuted expert-major, the tile table of `tile` rows (entries past num_tiles poisoned).
struct Routing {
  std::vector<int32_t> offsets, tile_expert, tile_row_start, row_to_entry;
  int32_t num_tiles = 0;
  int64_t rows = 0, max_tiles = 0;
};
Routing make_routing(const std::vector<int64_t>& counts, std::mt19937& rng, int tile) {
  Routing r;
  const int64_t E = static_cast<int64_t>(counts.size());
  r.offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) r.offsets[e + 1] = r.offsets[e] + static_cast<int32_t>(counts[e]);
  r.rows = r.offsets[E];
  r.max_tiles = kernels::max_tiles(r.rows, E, tile);
  for (int64_t e = 0; e < E; ++e)
    for (int32_t s = r.offsets[e]; s < r.offsets[e + 1]; s += tile) {
      r.tile_expert.push_back(static_cast<int32_t>(e));
      r.tile_row_start.push_back(s);
    }
  r.num_tiles = static_cast<int32_t>(r.tile_expert.size());
  EXPECT_LE(r.num_tiles, r.max_tiles);
  r.tile_expert.resize(std::max<int64_t>(r.max_tiles, 1), -7);  // never read
  r.tile_row_start.resize(std::max<int64_t>(r.max_tiles, 1), -7);
  r.row_to_entry.resize(r.rows);
  std::iota(r.row_to_entry.begin(), r.row_to_entry.end(), 0);
  std::shuffle(r.row_to_entry.begin(), r.row_to_entry.end(), rng);
  return r;
}

// CPU: h[r][n] = alpha[e] * float(double dot) and sum_i |a_i w_i| (for the tolerance).
struct RefGemm {
  std::vector<float> h;
  std::vector<double> abs_sum;
};
RefGemm ref_gemm(const std::vector<float>& a, const CanonicalWeights& cw, const std::vector<float>& alpha,
                 const Routing& rt, int64_t E, int64_t N, int64_t K) {
  RefGemm out;
  out.h.assign(static_cast<size_t>(rt.rows * N), 0.0f);
  out.abs_sum.assign(static_cast<size_t>(rt.rows * N), 0.0);
  std::vector<float> W(static_cast<size_t>(N * K));
  for (int64_t e = 0; e < E; ++e) {
    if (rt.offsets[e + 1] == rt.offsets[e]) continue;
    format::dequantize_nvfp4(cw.w.data() + e * N * K / 2, cw.scale.data() + e * N * K / 16, N, K, W.data());
    for (int64_t r = rt.offsets[e]; r < rt.offsets[e + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0.0, s = 0.0;
        const float* ar = a.data() + r * K;
        const float* wr = W.data() + n * K;
        for (int64_t k = 0; k < K; ++k) {
          const double p = static_cast<double>(ar[k]) * wr[k];
          acc += p;
          s += std::fabs(p);
        }
        out.h[r * N + n] = alpha[e] * static_cast<float>(acc);
        out.abs_sum[r * N + n] = s * std::fabs(alpha[e]);
      }
  }
  return out;
}

// Random bf16 activations [rows, K] (values and bits).
void random_activations(std::mt19937& rng, int64_t rows, int64_t K, std::vector<float>& vals,
                        std::vector<uint16_t>& bits) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-3, 2);
  vals.resize(static_cast<size_t>(rows * K));
  bits.resize(vals.size());
  for (size_t i = 0; i < vals.size(); ++i) {
    bits[i] = format::bf16_from_float(std::ldexp(u(rng), ex(rng)));
    vals[i] = format::bf16_to_float(bits[i]);
  }
}

std::vector<float> random_alpha(std::mt19937& rng, int64_t E) {
  std::uniform_real_distribution<float> u(0.25f, 2.0f);
  std::vector<float> a(E);
  for (auto& x : a) x = u(rng);
  return a;
}

struct DeviceWeights {
  kernels::PrepackedWeights info;
  DeviceBuffer<uint8_t> w, s;
};
void upload_weights(const CanonicalWeights& cw, int64_t E, int64_t N, int64_t K, DeviceWeights& dw) {
  std::vector<uint8_t> pw, ps;
  dw.info = kernels::prepack_expert_weights(cw.w.data(), cw.scale.data(), E, N, K, pw, ps);
  dw.w = DeviceBuffer<uint8_t>(pw);
  dw.s = DeviceBuffer<uint8_t>(ps);
}

struct DeviceRouting {
  DeviceBuffer<int32_t> offsets, tile_expert, tile_row_start, num_tiles, row_to_entry;
};
void upload_routing(const Routing& rt, DeviceRouting& d) {
  d.offsets = DeviceBuffer<int32_t>(rt.offsets);
  d.tile_expert = DeviceBuffer<int32_t>(rt.tile_expert);
  d.tile_row_start = DeviceBuffer<int32_t>(rt.tile_row_start);
  d.num_tiles = DeviceBuffer<int32_t>(std::vector<int32_t>{rt.num_tiles});
  std::vector<int32_t> r2e = rt.row_to_entry;
  if (r2e.empty()) r2e.push_back(0);
  d.row_to_entry = DeviceBuffer<int32_t>(r2e);
}

void fill_common(kernels::ExpertGemmArgs& g, const DeviceWeights& dw, const DeviceRouting& dr, const Routing& rt,
                 const __nv_bfloat16* a, const float* alpha, int64_t E, int64_t N, int64_t K) {
  g.a = a;
  g.rows = rt.rows;
  g.w = dw.w.get();
  g.w_scale = dw.s.get();
  g.weights = dw.info;
  g.alpha = alpha;
  g.expert_offsets = dr.offsets.get();
  g.tile_expert = dr.tile_expert.get();
  g.tile_row_start = dr.tile_row_start.get();
  g.num_tiles = dr.num_tiles.get();
  g.max_tiles = rt.max_tiles;
  g.num_experts = static_cast<int>(E);
  g.K = K;
  g.N = N;
}

constexpr int64_t kGuardRows = 3;  // rows past the end of every output, must stay poisoned

// Runs `launch` (with the split-K workspace when split_k > 1) and downloads `out`. With split_k > 1 it
// runs twice, the output re-poisoned in between: both runs must agree bit for bit (fixed split order)
// and the arrival counters must be back at zero (graph replays need no memset).
template <class T, class Args, class Launch>
std::vector<T> launch_and_download(Args& g, const GemmKernelUnderTest& k, Launch launch, DeviceBuffer<T>& out,
                                   int64_t N) {
  DeviceBuffer<uint8_t> ws;
  const size_t ws_bytes =
      k.split_k > 1 ? kernels::gemm_stream_workspace_bytes(g.max_tiles, N, k.tile_rows, k.split_k) : 0;
  if (ws_bytes > 0) {
    ws = DeviceBuffer<uint8_t>(ws_bytes);
    ws.poison(0);  // zeroed once at allocation
    g.split_workspace = ws.get();
  }
  out.poison(0xFF);
  EXPECT_EQ(launch(g, k.tile_rows, k.split_k, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<T> first = out.download();
  if (ws_bytes == 0) return first;
  out.poison(0xFF);
  EXPECT_EQ(launch(g, k.tile_rows, k.split_k, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<T> second = out.download();
  EXPECT_EQ(0, std::memcmp(first.data(), second.data(), first.size() * sizeof(T))) << "split-K is not deterministic";
  const std::vector<uint8_t> wsh = ws.download();
  const int64_t outs = static_cast<int64_t>(kernels::gemm_stream_counter_bytes(g.max_tiles, N) / sizeof(int32_t));
  for (int64_t i = 0; i < outs; ++i) {
    int32_t c;
    std::memcpy(&c, wsh.data() + 4 * i, 4);
    if (c != 0) {
      ADD_FAILURE() << "split-K counter " << i << " not reset: " << c;
      break;
    }
  }
  return second;
}

// Local Lipschitz bound of the activations (see the header comment), times the h errors.
double act_error(float g, float u, double err_g, double err_u) {
  return (4.0 * (std::fabs(u) + 1.0) + 2.0 * std::fabs(g)) * err_g + (std::fabs(g) + 7.0) * err_u;
}

void run_gemm1(const GemmCase& c, const GemmKernelUnderTest& k = wgmma_kernel()) {
  SCOPED_TRACE(k.name + " " + c.name);
  std::mt19937 rng(c.seed);
  const bool gated = c.act.kind != Activation::Relu2;
  const int64_t E = c.E, K = c.H, I = c.I, N = gated ? 2 * I : I;
  const Routing rt = make_routing(c.rows, rng, k.tile_rows);
  const int64_t R = rt.rows;
  std::vector<float> a;
  std::vector<uint16_t> abits;
  random_activations(rng, R, K, a, abits);
  const CanonicalWeights cw = random_weights(rng, E, N, K);
  const std::vector<float> alpha = random_alpha(rng, E);
  const RefGemm ref = ref_gemm(a, cw, alpha, rt, E, N, K);
  const bool w4a4 = c.mode != ActQuant::W4A16;

  // Reference activation, and the input scale of the re-quantization: amax of the expert / (448 * 6).
  std::vector<float> act(static_cast<size_t>(R * I)), act_err(static_cast<size_t>(R * I));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const float g = ref.h[r * N + i], u = gated ? ref.h[r * N + I + i] : 0.0f;
      const double eg = 1e-5 * ref.abs_sum[r * N + i], eu = gated ? 1e-5 * ref.abs_sum[r * N + I + i] : 0.0;
      act[r * I + i] = reference::apply_activation(c.act, g, u);
      act_err[r * I + i] = static_cast<float>(act_error(g, u, eg, eu));
    }
  std::vector<float> act_scale(E, 1.0f);
  for (int64_t e = 0; e < E; ++e) {
    float amax = 0.0f;
    for (int64_t r = rt.offsets[e]; r < rt.offsets[e + 1]; ++r)
      for (int64_t i = 0; i < I; ++i) amax = std::max(amax, std::fabs(act[r * I + i]));
    if (amax > 0.0f) act_scale[e] = amax / (448.0f * 6.0f);
  }
  std::vector<float> want(act.size());
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = rt.offsets[e]; r < rt.offsets[e + 1]; ++r) {
      if (!w4a4) {
        for (int64_t i = 0; i < I; ++i) want[r * I + i] = bf16_round(act[r * I + i]);
      } else {
        std::vector<uint8_t> packed(I / 2), sf(I / 16);
        format::quantize_nvfp4(act.data() + r * I, 1, I, act_scale[e], packed.data(), sf.data());
        format::dequantize_nvfp4(packed.data(), sf.data(), 1, I, want.data() + r * I);
      }
    }

  DeviceWeights dw;
  upload_weights(cw, E, N, K, dw);
  DeviceRouting dr;
  upload_routing(rt, dr);
  std::vector<uint16_t> abuf = abits;
  if (abuf.empty()) abuf.push_back(0);
  DeviceBuffer<uint16_t> d_a(abuf);
  DeviceBuffer<float> d_alpha(alpha), d_act_scale(act_scale);
  DeviceBuffer<uint16_t> d_out(static_cast<size_t>((R + kGuardRows) * I));
  ASSERT_TRUE(d_a.ok() && d_out.ok() && dw.w.ok() && dw.s.ok());

  kernels::Gemm1Args g;
  fill_common(g, dw, dr, rt, reinterpret_cast<const __nv_bfloat16*>(d_a.get()), d_alpha.get(), E, N, K);
  g.activation = c.act;
  g.mode = c.mode;
  g.act_scale = d_act_scale.get();
  g.act = reinterpret_cast<__nv_bfloat16*>(d_out.get());
  const std::vector<uint16_t> out = launch_and_download(g, k, k.gemm1, d_out, N);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_EQ(out.size(), static_cast<size_t>((R + kGuardRows) * I));

  // The gather fused (a_row_to_entry): the same rows, read from an un-permuted activation through
  // row -> entry -> token (entry = token * 3 + slot), give the same bits (both kernels).
  if (R > 0) {
    constexpr int kTopK = 3;
    std::vector<int32_t> token_of(static_cast<size_t>(R));
    std::iota(token_of.begin(), token_of.end(), 0);
    std::shuffle(token_of.begin(), token_of.end(), rng);
    std::vector<uint16_t> src(abits.size());
    std::vector<int32_t> r2e(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) {
      std::copy_n(abits.begin() + r * K, K, src.begin() + token_of[r] * K);
      r2e[r] = token_of[r] * kTopK + static_cast<int32_t>(r % kTopK);
    }
    DeviceBuffer<uint16_t> d_src(src);
    DeviceBuffer<int32_t> d_r2e(r2e);
    ASSERT_TRUE(d_src.ok() && d_r2e.ok());
    kernels::Gemm1Args gg = g;
    gg.a = reinterpret_cast<const __nv_bfloat16*>(d_src.get());
    gg.a_row_to_entry = d_r2e.get();
    gg.a_top_k = kTopK;
    const std::vector<uint16_t> gathered = launch_and_download(gg, k, k.gemm1, d_out, N);
    ASSERT_EQ(gathered.size(), out.size());
    EXPECT_EQ(0, std::memcmp(gathered.data(), out.data(), out.size() * sizeof(uint16_t)))
        << "GEMM1 with the gather fused differs from GEMM1 on the permuted rows";
  }

  for (int64_t i = R * I; i < (R + kGuardRows) * I; ++i)
    ASSERT_EQ(out[i], 0xFFFF) << "write past the last row at element " << i;
  int64_t bad = 0, bad_blocks = 0;
  const int64_t blocks = R * I / 16;
  for (int64_t b = 0; b < blocks; ++b) {
    bool block_ok = true;
    double amax = 0.0;
    for (int64_t i = b * 16; i < b * 16 + 16; ++i) amax = std::max(amax, std::fabs(static_cast<double>(want[i])));
    for (int64_t i = b * 16; i < b * 16 + 16; ++i) {
      const float got = bf16_bits_to_float(out[i]);
      const double diff = std::fabs(static_cast<double>(got) - want[i]);
      const double tol = bf16_ulp(want[i]) + act_err[i];
      if (std::isnan(got) || !(diff <= tol)) {
        block_ok = false;
        // w4a4: a re-quantization flip is allowed, but only a small one.
        if (!w4a4 || std::isnan(got) || !(diff <= 0.5 * amax + tol)) {
          if (bad++ < 10)
            ADD_FAILURE() << "row " << i / I << " col " << i % I << ": got " << got << ", want " << want[i]
                          << " (tol " << tol << ")";
        }
      }
    }
    if (!block_ok) ++bad_blocks;
  }
  EXPECT_EQ(bad, 0);
  if (!w4a4) {
    EXPECT_EQ(bad_blocks, 0);
  } else {
    EXPECT_LE(bad_blocks, std::max<int64_t>(2, blocks / 200)) << "of " << blocks << " blocks";
  }
}

// fused: top-1 fused finalize (out = bf16(0 + w * y), random weights) instead of y.
void run_gemm2(const GemmCase& c, const GemmKernelUnderTest& k = wgmma_kernel(), bool fused = false) {
  SCOPED_TRACE(k.name + " " + c.name + (fused ? " fused" : ""));
  std::mt19937 rng(c.seed + 1000);
  const int64_t E = c.E, K = c.I, N = c.H;
  const Routing rt = make_routing(c.rows, rng, k.tile_rows);
  const int64_t R = rt.rows;
  std::vector<float> a;
  std::vector<uint16_t> abits;
  random_activations(rng, R, K, a, abits);
  const CanonicalWeights cw = random_weights(rng, E, N, K);
  const std::vector<float> alpha = random_alpha(rng, E);
  const RefGemm ref = ref_gemm(a, cw, alpha, rt, E, N, K);

  DeviceWeights dw;
  upload_weights(cw, E, N, K, dw);
  DeviceRouting dr;
  upload_routing(rt, dr);
  std::vector<uint16_t> abuf = abits;
  if (abuf.empty()) abuf.push_back(0);
  DeviceBuffer<uint16_t> d_a(abuf);
  DeviceBuffer<float> d_alpha(alpha);
  kernels::Gemm2Args g;
  fill_common(g, dw, dr, rt, reinterpret_cast<const __nv_bfloat16*>(d_a.get()), d_alpha.get(), E, N, K);
  g.row_to_entry = dr.row_to_entry.get();
  if (fused) {
    std::uniform_real_distribution<float> uw(0.1f, 1.0f);
    std::vector<float> wts(static_cast<size_t>(std::max<int64_t>(R, 1)));
    for (auto& x : wts) x = uw(rng);
    DeviceBuffer<float> d_w(wts);
    DeviceBuffer<uint16_t> d_o(static_cast<size_t>((R + kGuardRows) * N));
    ASSERT_TRUE(d_a.ok() && d_o.ok() && d_w.ok());
    g.out = reinterpret_cast<__nv_bfloat16*>(d_o.get());
    g.out_weights = d_w.get();
    const std::vector<uint16_t> o = launch_and_download(g, k, k.gemm2, d_o, N);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    for (int64_t i = R * N; i < (R + kGuardRows) * N; ++i)
      ASSERT_EQ(o[i], 0xFFFF) << "write past the last entry at element " << i;
    int64_t bad = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t entry = rt.row_to_entry[r];
      for (int64_t n = 0; n < N; ++n) {
        const float got = bf16_bits_to_float(o[entry * N + n]);
        const double want = static_cast<double>(wts[entry]) * ref.h[r * N + n];
        const double tol = bf16_ulp(want) + wts[entry] * (1e-5 * ref.abs_sum[r * N + n]) + 1e-30;
        if (!(std::fabs(got - want) <= tol) && bad++ < 10)
          ADD_FAILURE() << "row " << r << " (entry " << entry << ") n " << n << ": got " << got << ", want " << want
                        << " (tol " << tol << ")";
      }
    }
    EXPECT_EQ(bad, 0);
    return;
  }
  DeviceBuffer<float> d_y(static_cast<size_t>((R + kGuardRows) * N));
  ASSERT_TRUE(d_a.ok() && d_y.ok());
  g.y = d_y.get();
  const std::vector<float> y = launch_and_download(g, k, k.gemm2, d_y, N);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_EQ(y.size(), static_cast<size_t>((R + kGuardRows) * N));

  for (int64_t i = R * N; i < (R + kGuardRows) * N; ++i)
    ASSERT_EQ(test::float_bits(y[i]), 0xFFFFFFFFu) << "write past the last entry at element " << i;
  int64_t bad = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t entry = rt.row_to_entry[r];
    for (int64_t n = 0; n < N; ++n) {
      const float got = y[entry * N + n], want = ref.h[r * N + n];
      const double tol = 1e-5 * ref.abs_sum[r * N + n] + 1e-30;
      if (!(std::fabs(static_cast<double>(got) - want) <= tol) && bad++ < 10)
        ADD_FAILURE() << "row " << r << " (entry " << entry << ") n " << n << ": got " << got << ", want " << want
                      << " (tol " << tol << ")";
    }
  }
  EXPECT_EQ(bad, 0);

  // The streaming kernel with the top-k finalize fused (finalize_counters), entries = token * kk + slot:
  // the same y, out = finalize's arithmetic on it bit for bit, and the counters back at zero.
  const int kk = R % 3 == 0 ? 3 : (R % 2 == 0 ? 2 : 0);
  if (k.gemm2 != &kernels::launch_gemm2_stream || R == 0 || kk == 0) return;
  const int64_t T = R / kk;
  std::uniform_real_distribution<float> uw(0.1f, 1.0f);
  std::vector<float> wts(static_cast<size_t>(R));
  for (auto& x : wts) x = uw(rng);
  const int64_t counters = kernels::gemm2_finalize_counter_count(T, N);
  DeviceBuffer<float> d_w(wts), d_y2(static_cast<size_t>((R + kGuardRows) * N));
  DeviceBuffer<uint16_t> d_o(static_cast<size_t>((T + kGuardRows) * N));
  DeviceBuffer<int32_t> d_cnt(static_cast<size_t>(counters));
  ASSERT_TRUE(d_w.ok() && d_y2.ok() && d_o.ok() && d_cnt.ok());
  d_cnt.poison(0);
  kernels::Gemm2Args gf = g;
  gf.y = d_y2.get();
  gf.out = reinterpret_cast<__nv_bfloat16*>(d_o.get());
  gf.out_weights = d_w.get();
  gf.finalize_counters = d_cnt.get();
  gf.finalize_top_k = kk;
  d_y2.poison(0xFF);
  const std::vector<uint16_t> o = launch_and_download(gf, k, k.gemm2, d_o, N);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const std::vector<float> y2 = d_y2.download();
  EXPECT_EQ(0, std::memcmp(y2.data(), y.data(), static_cast<size_t>(R * N) * sizeof(float)))
      << "y differs with the fused finalize";
  for (int64_t i = T * N; i < (T + kGuardRows) * N; ++i)
    ASSERT_EQ(o[i], 0xFFFF) << "write past the last token at element " << i;
  int64_t wrong = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int j = 0; j < kk; ++j) {
        const volatile float prod = wts[t * kk + j] * y2[(t * kk + j) * N + n];  // never contracted into an FMA
        acc = acc + prod;
      }
      const uint16_t want = format::bf16_from_float(acc);
      if (o[t * N + n] != want && wrong++ < 10)
        ADD_FAILURE() << "fused finalize: token " << t << " n " << n << ": got bits " << o[t * N + n] << ", want "
                      << want;
    }
  EXPECT_EQ(wrong, 0);
  const std::vector<int32_t> cnt = d_cnt.download();
  EXPECT_EQ(std::count(cnt.begin(), cnt.end(), 0), counters) << "fused-finalize counters not reset";
}

ActivationParams act_of(Activation k) {
  ActivationParams p;
  p.kind = k;
  return p;
}

// Rows per expert: every wgmma width at both ends (1..8, 9..16, 17..32, 33..48, 49..64, 65..96,
// 97..128 with 128-token tiles; powers of two with the others), multi-tile experts and an empty one.
const std::vector<int64_t> kRagged16 = {0, 1, 9, 17, 33, 48, 49, 63, 64, 65, 96, 97, 128, 129, 4097, 200};

TEST(ExpertGemmKernel, Gemm1TinySwiglu) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : wgmma_kernels()) {
    run_gemm1({"tiny", 1, 32, 16, {1}, act_of(Activation::SwiGLU), ActQuant::W4A16, 11}, k);
    run_gemm1({"tiny-w4a4", 2, 64, 32, {3, 0}, act_of(Activation::SwiGLU), ActQuant::W4A4Scalar, 12}, k);
  }
}

TEST(ExpertGemmKernel, Gemm2Tiny) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : wgmma_kernels()) {
    run_gemm2({"tiny", 1, 32, 16, {1}, act_of(Activation::SwiGLU), ActQuant::W4A16, 13}, k);
    run_gemm2({"tiny-2", 2, 48, 96, {0, 7}, act_of(Activation::SwiGLU), ActQuant::W4A16, 14}, k);
  }
}

TEST(ExpertGemmKernel, Gemm1GptOssShapes) {  // K = 2880 (chunk tail), I = 96 (< 128 columns per CTA)
  FP4MOE_REQUIRE_SM90();
  const ActivationParams oai = act_of(Activation::SwiGLUOai);
  for (const auto& k : wgmma_kernels()) {
    run_gemm1({"oai-w4a16", 4, 2880, 96, {0, 1, 63, 65}, oai, ActQuant::W4A16, 21}, k);
    run_gemm1({"oai-w4a4", 4, 2880, 96, {2, 64, 0, 17}, oai, ActQuant::W4A4PerExpert, 22}, k);
  }
}

TEST(ExpertGemmKernel, Gemm2GptOssShapes) {  // K = 96 (padded to 128), N = 2880 (partial CTA)
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : wgmma_kernels()) {
    run_gemm2({"oai", 4, 2880, 96, {0, 1, 63, 65}, act_of(Activation::SwiGLU), ActQuant::W4A16, 23}, k);
  }
}

TEST(ExpertGemmKernel, Gemm1RaggedExperts) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : wgmma_kernels()) {
    run_gemm1({"swiglu-w4a16", 16, 256, 128, kRagged16, act_of(Activation::SwiGLU), ActQuant::W4A16, 31}, k);
    run_gemm1({"geglu-w4a4", 16, 256, 144, kRagged16, act_of(Activation::GeGLU), ActQuant::W4A4Scalar, 32}, k);
  }
}

TEST(ExpertGemmKernel, Gemm2RaggedExperts) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : wgmma_kernels()) {
    run_gemm2({"ragged", 16, 272, 256, kRagged16, act_of(Activation::SwiGLU), ActQuant::W4A16, 33}, k);
  }
}

TEST(ExpertGemmKernel, Gemm1Relu2) {  // not gated: w13 has I rows, N = I = 320 (partial second CTA)
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : wgmma_kernels()) {
    run_gemm1({"relu2-w4a16", 4, 384, 320, {70, 0, 1, 130}, act_of(Activation::Relu2), ActQuant::W4A16, 41}, k);
    run_gemm1({"relu2-w4a4", 4, 384, 320, {70, 0, 1, 130}, act_of(Activation::Relu2), ActQuant::W4A4PerExpert, 42}, k);
  }
}

TEST(ExpertGemmKernel, LargerShapes) {  // deeper K, several CTAs along N, one expert with every row
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : wgmma_kernels()) {
    run_gemm1({"deep", 2, 2048, 384, {300, 129}, act_of(Activation::SwiGLU), ActQuant::W4A16, 51}, k);
    run_gemm2({"deep", 2, 1024, 1536, {300, 129}, act_of(Activation::SwiGLU), ActQuant::W4A16, 52}, k);
  }
}

// top-1 with the finalize fused (out = bf16(0 + w * y), staged as bf16 and copied out per token row):
// every tile shape, ragged experts (every wgmma width, multi-tile experts, empty ones), N = 2880 (a
// partial last CTA along N) and N = 5120 (llama4-scout's hidden size).
TEST(ExpertGemmKernel, Gemm2FusedFinalize) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : wgmma_kernels()) {
    run_gemm2({"top1", 4, 272, 2880, {1, 0, 9, 20}, act_of(Activation::SwiGLU), ActQuant::W4A16, 57}, k, true);
    run_gemm2({"top1-ragged", 16, 256, 128, kRagged16, act_of(Activation::SwiGLU), ActQuant::W4A16, 58}, k, true);
    run_gemm2({"top1-llama4", 2, 512, 5120, {300, 129}, act_of(Activation::SwiGLU), ActQuant::W4A16, 59}, k, true);
  }
}

TEST(ExpertGemmKernel, NoRowsLaunchesNothing) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : wgmma_kernels()) {
    run_gemm1({"empty", 4, 64, 32, {0, 0, 0, 0}, act_of(Activation::SwiGLU), ActQuant::W4A16, 61}, k);
    run_gemm2({"empty", 4, 64, 32, {0, 0, 0, 0}, act_of(Activation::SwiGLU), ActQuant::W4A16, 62}, k);
  }
}

// Valid GEMM arguments on tiny buffers (1 expert, N = 32, K = 64) for the argument checks; `tactic`
// picks the kernel behind launch_gemm1_act / launch_gemm2.
struct BadArgsSetup {
  DeviceWeights dw;
  DeviceBuffer<int32_t> dummy{std::vector<int32_t>(8, 0)};
  DeviceBuffer<float> f{std::vector<float>(64, 1.0f)};
  DeviceBuffer<uint16_t> a{std::vector<uint16_t>(64, 0)};
  explicit BadArgsSetup(uint32_t seed) {
    std::mt19937 rng(seed);
    upload_weights(random_weights(rng, 1, 32, 64), 1, 32, 64, dw);
  }
  void base(kernels::ExpertGemmArgs& g, const MoeTactic& tactic) const {
    g.a = reinterpret_cast<const __nv_bfloat16*>(a.get());
    g.rows = 1;
    g.w = dw.w.get();
    g.w_scale = dw.s.get();
    g.weights = dw.info;
    g.alpha = f.get();
    g.expert_offsets = dummy.get();
    g.tile_expert = dummy.get();
    g.tile_row_start = dummy.get();
    g.num_tiles = dummy.get();
    g.max_tiles = 1;
    g.num_experts = 1;
    g.K = 64;
    g.N = 32;
    g.tactic = tactic;
  }
  kernels::Gemm2Args gemm2(const MoeTactic& tactic) const {
    kernels::Gemm2Args g2;
    base(g2, tactic);
    g2.row_to_entry = dummy.get();
    g2.y = f.get();
    return g2;
  }
  kernels::Gemm1Args gemm1(const MoeTactic& tactic) const {
    kernels::Gemm1Args g1;
    base(g1, tactic);
    g1.act = reinterpret_cast<__nv_bfloat16*>(a.get());
    return g1;
  }
};

// The checks every kernel makes (through the tactic dispatch of launch_gemm1_act / launch_gemm2).
void expect_common_rejections(const BadArgsSetup& s, const MoeTactic& tactic) {
  SCOPED_TRACE(describe(tactic));
  const kernels::Gemm2Args g2 = s.gemm2(tactic);
  kernels::Gemm2Args bad = g2;
  bad.K = 48;  // does not match the prepacked weights
  EXPECT_EQ(kernels::launch_gemm2(bad, nullptr), cudaErrorInvalidValue);
  bad = g2;
  bad.N = 24;  // not a multiple of 16
  EXPECT_EQ(kernels::launch_gemm2(bad, nullptr), cudaErrorInvalidValue);
  bad = g2;
  bad.y = nullptr;
  EXPECT_EQ(kernels::launch_gemm2(bad, nullptr), cudaErrorInvalidValue);
  bad = g2;
  bad.rows = 0;  // tiles but no activation rows
  EXPECT_EQ(kernels::launch_gemm2(bad, nullptr), cudaErrorInvalidValue);
  bad = g2;
  bad.a = reinterpret_cast<const __nv_bfloat16*>(reinterpret_cast<const char*>(s.a.get()) + 2);  // misaligned
  EXPECT_EQ(kernels::launch_gemm2(bad, nullptr), cudaErrorInvalidValue);
  kernels::Gemm1Args g1 = s.gemm1(tactic);
  g1.mode = ActQuant::W4A4Scalar;
  g1.act_scale = nullptr;  // needed by w4a4
  EXPECT_EQ(kernels::launch_gemm1_act(g1, nullptr), cudaErrorInvalidValue);
  g1.mode = ActQuant::W4A16;
  g1.act = nullptr;
  EXPECT_EQ(kernels::launch_gemm1_act(g1, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(ExpertGemmKernel, RejectsBadArguments) {
  FP4MOE_REQUIRE_SM90();
  const BadArgsSetup s(71);
  expect_common_rejections(s, {GemmKernel::Sm90Wgmma, 128, 1, 1});
  expect_common_rejections(s, {GemmKernel::Sm90Wgmma, 256, 1, 1});
  expect_common_rejections(s, {GemmKernel::Sm90Wgmma, 64, 1, 1});
  // Tactics no kernel has.
  for (const MoeTactic& t : {MoeTactic{GemmKernel::Sm90Wgmma, 32, 1, 1}, MoeTactic{GemmKernel::Sm90Wgmma, 128, 2, 2},
                             MoeTactic{GemmKernel::Sm90Stream, 64, 1, 1}}) {
    EXPECT_EQ(kernels::launch_gemm2(s.gemm2(t), nullptr), cudaErrorInvalidValue) << describe(t);
    EXPECT_EQ(kernels::launch_gemm1_act(s.gemm1(t), nullptr), cudaErrorInvalidValue) << describe(t);
  }
}

// ---- the streaming kernel (GemmKernel::Sm90Stream): the same cases, split_k 1 and 3 ----------------------
// K = 2880 (23 chunks: 23 = 8 + 8 + 7 with split 3), K = 256 (2 chunks: split 3 leaves an empty split),
// K = 2048 (16 chunks), K = 96 (one chunk), for 16- and 32-row tiles. The ragged rows cover every mma
// width (<= 8, <= 16, <= 32 rows) and multi-tile experts.
std::vector<GemmKernelUnderTest> stream_kernels() {
  return {stream_kernel(1), stream_kernel(3), stream_kernel(1, 32), stream_kernel(3, 32)};
}

TEST(ExpertGemmStream, Gemm1TinySwiglu) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : stream_kernels()) {
    run_gemm1({"tiny", 1, 32, 16, {1}, act_of(Activation::SwiGLU), ActQuant::W4A16, 11}, k);
    run_gemm1({"tiny-w4a4", 2, 64, 32, {3, 0}, act_of(Activation::SwiGLU), ActQuant::W4A4Scalar, 12}, k);
  }
}

TEST(ExpertGemmStream, Gemm2Tiny) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : stream_kernels()) {
    run_gemm2({"tiny", 1, 32, 16, {1}, act_of(Activation::SwiGLU), ActQuant::W4A16, 13}, k);
    run_gemm2({"tiny-2", 2, 48, 96, {0, 7}, act_of(Activation::SwiGLU), ActQuant::W4A16, 14}, k);
  }
}

TEST(ExpertGemmStream, Gemm1GptOssShapes) {
  FP4MOE_REQUIRE_SM90();
  ActivationParams oai = act_of(Activation::SwiGLUOai);
  for (const auto& k : stream_kernels()) {
    run_gemm1({"oai-w4a16", 4, 2880, 96, {0, 1, 63, 65}, oai, ActQuant::W4A16, 21}, k);
    run_gemm1({"oai-w4a4", 4, 2880, 96, {2, 64, 0, 17}, oai, ActQuant::W4A4PerExpert, 22}, k);
    run_gemm1({"oai-decode", 4, 2880, 96, {1, 8, 9, 16}, oai, ActQuant::W4A4Scalar, 24}, k);
  }
}

TEST(ExpertGemmStream, Gemm2GptOssShapes) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : stream_kernels()) {
    run_gemm2({"oai", 4, 2880, 96, {0, 1, 63, 65}, act_of(Activation::SwiGLU), ActQuant::W4A16, 23}, k);
    run_gemm2({"oai-k2880", 3, 96, 2880, {5, 16, 9}, act_of(Activation::SwiGLU), ActQuant::W4A16, 25}, k);
  }
}

TEST(ExpertGemmStream, Gemm1RaggedExperts) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : stream_kernels()) {
    run_gemm1({"swiglu-w4a16", 16, 256, 128, kRagged16, act_of(Activation::SwiGLU), ActQuant::W4A16, 31}, k);
    run_gemm1({"geglu-w4a4", 16, 256, 144, kRagged16, act_of(Activation::GeGLU), ActQuant::W4A4Scalar, 32}, k);
  }
}

TEST(ExpertGemmStream, Gemm2RaggedExperts) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : stream_kernels())
    run_gemm2({"ragged", 16, 272, 256, kRagged16, act_of(Activation::SwiGLU), ActQuant::W4A16, 33}, k);
}

TEST(ExpertGemmStream, Gemm1Relu2) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : stream_kernels()) {
    run_gemm1({"relu2-w4a16", 4, 384, 320, {70, 0, 1, 130}, act_of(Activation::Relu2), ActQuant::W4A16, 41}, k);
    run_gemm1({"relu2-w4a4", 4, 384, 320, {70, 0, 1, 130}, act_of(Activation::Relu2), ActQuant::W4A4PerExpert, 42},
              k);
  }
}

TEST(ExpertGemmStream, LargerShapes) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : {stream_kernel(1), stream_kernel(3), stream_kernel(5), stream_kernel(5, 32)}) {
    run_gemm1({"deep", 2, 2048, 384, {300, 129}, act_of(Activation::SwiGLU), ActQuant::W4A16, 51}, k);
    run_gemm2({"deep", 2, 1024, 1536, {300, 129}, act_of(Activation::SwiGLU), ActQuant::W4A16, 52}, k);
  }
}

TEST(ExpertGemmStream, Gemm2FusedFinalize) {  // top-1: out = bf16(0 + w * y), y not written
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : stream_kernels())
    run_gemm2({"top1", 4, 272, 2880, {1, 0, 9, 20}, act_of(Activation::SwiGLU), ActQuant::W4A16, 53}, k, true);
}

// More output tiles than fit on an H200 at once (36 tiles x 32 N tiles = 1152 > 4 x 132 CTAs of 16-row
// tiles), K = 256 (2 chunks: fewer than a ring's stages) and K = 768 (6 chunks), rows of 1..16 per tile:
// the shapes of a kernel that runs several output tiles per CTA.
TEST(ExpertGemmStream, Gemm2ManyTilesPerCta) {
  FP4MOE_REQUIRE_SM90();
  const std::vector<int64_t> rows = {200, 1, 33, 300};
  for (const auto& k : {stream_kernel(1), stream_kernel(3)}) {
    run_gemm2({"many-k256", 4, 4096, 256, rows, act_of(Activation::SwiGLU), ActQuant::W4A16, 54}, k);
    run_gemm2({"many-k768", 4, 4096, 768, rows, act_of(Activation::SwiGLU), ActQuant::W4A16, 55}, k);
    run_gemm2({"many-top1", 4, 4096, 768, rows, act_of(Activation::SwiGLU), ActQuant::W4A16, 56}, k, true);
  }
}

// The early start (kernels/launch.hpp GemmEarlyStart) in a chain the runner launches: permute ->
// gather_quantize -> GEMM1 -> GEMM2, back to back with dependent launch (so both GEMMs have the tile
// table two launches back), for every mode pair, GEMM2's per-tile wait for GEMM1 (TileReady, its counts
// cleared by the permute launch) included. Every pair must give the bits of the two launches that wait
// first, for repeated experts past one tile, ids outside [0, E) and experts without entries.
// K = 512 and 768: 4 and 6 chunks, past the 4-stage ring's first pass.
void run_early_start(const std::string& name, int T, int k, int E, const std::vector<int32_t>& ids,
                     const GemmKernelUnderTest& kern, uint32_t seed) {
  SCOPED_TRACE(kern.name + " " + name);
  using kernels::GemmEarlyStart;
  const int64_t H = 512, I = 768, N1 = 2 * I, n = static_cast<int64_t>(T) * k;
  ASSERT_EQ(static_cast<int64_t>(ids.size()), n);
  std::mt19937 rng(seed);
  const CanonicalWeights w13 = random_weights(rng, E, N1, H), w2 = random_weights(rng, E, H, I);
  const std::vector<float> alpha1 = random_alpha(rng, E), alpha2 = random_alpha(rng, E);
  std::vector<float> hvals;
  std::vector<uint16_t> hbits;
  random_activations(rng, T, H, hvals, hbits);
  DeviceWeights dw13, dw2;
  upload_weights(w13, E, N1, H, dw13);
  upload_weights(w2, E, H, I, dw2);
  const int64_t tiles = kernels::max_tiles(n, E, kern.tile_rows);
  DeviceBuffer<int32_t> d_ids(ids);
  test::PermuteBuffers perm(d_ids.get(), T, k, E, kern.tile_rows);
  DeviceBuffer<uint16_t> d_hidden(hbits), d_a1(static_cast<size_t>(n * H)),
      d_act(static_cast<size_t>((n + kGuardRows) * I));
  DeviceBuffer<float> d_alpha1(alpha1), d_alpha2(alpha2), d_y(static_cast<size_t>((n + kGuardRows) * H));
  const size_t ws1 = kernels::gemm_stream_workspace_bytes(tiles, N1, kern.tile_rows, kern.split_k);
  const size_t ws2 = kernels::gemm_stream_workspace_bytes(tiles, H, kern.tile_rows, kern.split_k);
  DeviceBuffer<uint8_t> d_ws1(std::max<size_t>(ws1, 16)), d_ws2(std::max<size_t>(ws2, 16));
  DeviceBuffer<int32_t> d_ready(static_cast<size_t>(std::max<int64_t>(tiles, 1)));
  ASSERT_TRUE(d_ids.ok() && perm.ok() && d_act.ok() && d_y.ok() && d_ws1.ok() && d_ws2.ok() && d_ready.ok() &&
              dw13.w.ok() && dw2.w.ok());
  d_ws1.poison(0);  // zeroed once at allocation
  d_ws2.poison(0);

  kernels::PermuteArgs pa = perm.args;
  pa.zero_words[3] = d_ready.get();  // the tile_ready counts, cleared by the permutation as in the runner
  pa.zero_count[3] = tiles;
  auto common = [&](kernels::ExpertGemmArgs& g, const DeviceWeights& dw, const float* alpha, int64_t K, int64_t N) {
    g.w = dw.w.get();
    g.w_scale = dw.s.get();
    g.weights = dw.info;
    g.alpha = alpha;
    g.expert_offsets = pa.expert_offsets;
    g.tile_expert = pa.tile_expert;
    g.tile_row_start = pa.tile_row_start;
    g.num_tiles = pa.num_tiles;
    g.max_tiles = tiles;
    g.num_experts = E;
    g.K = K;
    g.N = N;
  };
  kernels::GatherArgs ga;
  ga.hidden = reinterpret_cast<const __nv_bfloat16*>(d_hidden.get());
  ga.entry_to_row = pa.entry_to_row;
  ga.topk_ids = d_ids.get();
  ga.num_tokens = T;
  ga.top_k = k;
  ga.hidden_size = static_cast<int>(H);
  ga.num_experts = E;
  ga.mode = ActQuant::W4A16;
  ga.a1 = reinterpret_cast<__nv_bfloat16*>(d_a1.get());
  kernels::Gemm1Args g1;
  common(g1, dw13, d_alpha1.get(), H, N1);
  g1.a = ga.a1;
  g1.rows = n;
  g1.activation = act_of(Activation::SwiGLU);
  g1.act = reinterpret_cast<__nv_bfloat16*>(d_act.get());
  g1.split_workspace = d_ws1.get();
  kernels::Gemm2Args g2;
  common(g2, dw2, d_alpha2.get(), I, H);
  g2.a = g1.act;
  g2.rows = n;
  g2.row_to_entry = pa.row_to_entry;
  g2.y = d_y.get();
  g2.split_workspace = d_ws2.get();

  struct Out {
    std::vector<uint16_t> act;
    std::vector<float> y;
  };
  auto chain = [&](GemmEarlyStart m1, GemmEarlyStart m2, Out& out) {
    perm.poison();
    d_a1.poison(0xFF);
    d_act.poison(0xFF);
    d_y.poison(0xFF);
    d_ready.poison(0x01);  // 0x01010101 >= any count: a GEMM2 that read it uncleared would not wait
    g1.early_start = m1;
    g2.early_start = m2;
    const bool handoff = m2 == GemmEarlyStart::TileReady;
    g1.tile_ready = handoff ? d_ready.get() : nullptr;
    g2.tile_ready = handoff ? d_ready.get() : nullptr;
    g2.tile_ready_count = handoff ? static_cast<int>(kernels::gemm_stream_ctas_along_n(N1)) : 0;
    CUDA_EXPECT(kernels::launch_permute(pa, nullptr));
    CUDA_EXPECT(kernels::launch_gather_quantize(ga, nullptr));
    CUDA_EXPECT(kernels::launch_gemm1_act_stream(g1, kern.tile_rows, kern.split_k, nullptr));
    CUDA_EXPECT(kernels::launch_gemm2_stream(g2, kern.tile_rows, kern.split_k, nullptr));
    CUDA_EXPECT(cudaDeviceSynchronize());
    out.act = d_act.download();
    out.y = d_y.download();
  };
  Out base;
  chain(GemmEarlyStart::AfterWait, GemmEarlyStart::AfterWait, base);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  // The waiting chain computed every valid entry (finite y; the poison is NaN) and nothing else.
  int64_t valid = 0;
  for (int64_t j = 0; j < n; ++j) {
    const bool in_range = ids[j] >= 0 && ids[j] < E;
    valid += in_range ? 1 : 0;
    for (int64_t c = 0; c < H; c += 97)
      ASSERT_EQ(std::isfinite(base.y[j * H + c]), in_range) << "entry " << j << " column " << c;
  }
  ASSERT_GT(valid, 0);
  const std::pair<GemmEarlyStart, GemmEarlyStart> modes[] = {
      {GemmEarlyStart::TileTable, GemmEarlyStart::AfterWait},
      {GemmEarlyStart::TileTable, GemmEarlyStart::TileTable},
      {GemmEarlyStart::AfterWait, GemmEarlyStart::TileTable},
      {GemmEarlyStart::TileTable, GemmEarlyStart::TileReady},
      {GemmEarlyStart::AfterWait, GemmEarlyStart::TileReady}};
  for (const auto& [m1, m2] : modes) {
    SCOPED_TRACE("modes " + std::to_string(static_cast<int>(m1)) + "/" + std::to_string(static_cast<int>(m2)));
    for (int rep = 0; rep < 2; ++rep) {  // twice: the split-K counters are back at zero
      Out got;
      chain(m1, m2, got);
      EXPECT_EQ(0, std::memcmp(got.act.data(), base.act.data(), base.act.size() * sizeof(uint16_t)))
          << "GEMM1 output differs from the waiting launch";
      EXPECT_EQ(0, std::memcmp(got.y.data(), base.y.data(), base.y.size() * sizeof(float)))
          << "GEMM2 output differs from the waiting launch";
    }
  }
}

TEST(ExpertGemmStream, EarlyStartMatchesWaitingLaunch) {
  FP4MOE_REQUIRE_SM90();
  std::mt19937 rng(81);
  auto distinct = [&](int T, int k, int E) {  // k distinct experts per token, as the router gives
    std::vector<int32_t> ids;
    std::vector<int32_t> perm(E);
    for (int t = 0; t < T; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      ids.insert(ids.end(), perm.begin(), perm.begin() + k);
    }
    return ids;
  };
  // 20 entries on expert 3 (two 16-row tiles), expert 0 and 6 without entries, two ids out of range.
  std::vector<int32_t> skewed(32, 3);
  for (int j = 20; j < 30; ++j) skewed[j] = (j % 2 == 0) ? 5 : 1 + j % 3;
  skewed[30] = -1;
  skewed[31] = 8;
  const std::vector<int32_t> repeats = {4, 4, 2, 4, 7, 7};  // a token with the same expert twice
  for (const auto& kern : {stream_kernel(1), stream_kernel(2), stream_kernel(1, 32)}) {
    run_early_start("T1k8", 1, 8, 64, distinct(1, 8, 64), kern, 82);
    run_early_start("T4k8", 4, 8, 16, distinct(4, 8, 16), kern, 83);
    run_early_start("T32k1-skewed", 32, 1, 8, skewed, kern, 84);
    run_early_start("T3k2-repeats", 3, 2, 8, repeats, kern, 85);
  }
}

TEST(ExpertGemmStream, NoRowsLaunchesNothing) {
  FP4MOE_REQUIRE_SM90();
  for (const auto& k : stream_kernels()) {
    run_gemm1({"empty", 4, 64, 32, {0, 0, 0, 0}, act_of(Activation::SwiGLU), ActQuant::W4A16, 61}, k);
    run_gemm2({"empty", 4, 64, 32, {0, 0, 0, 0}, act_of(Activation::SwiGLU), ActQuant::W4A16, 62}, k);
  }
}

TEST(ExpertGemmStream, RejectsBadArguments) {
  FP4MOE_REQUIRE_SM90();
  const BadArgsSetup s(72);
  expect_common_rejections(s, {GemmKernel::Sm90Stream, 16, 1, 1});
  expect_common_rejections(s, {GemmKernel::Sm90Stream, 32, 1, 1});
  const kernels::Gemm2Args g2 = s.gemm2({GemmKernel::Sm90Stream, 16, 1, 1});
  EXPECT_EQ(kernels::launch_gemm2_stream(g2, 16, 0, nullptr), cudaErrorInvalidValue);  // split_k < 1
  EXPECT_EQ(kernels::launch_gemm2_stream(g2, 16, kernels::kMaxStreamSplitK + 1, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(kernels::launch_gemm2_stream(g2, 16, 2, nullptr), cudaErrorInvalidValue);  // split_k 2, no workspace
  kernels::Gemm2Args bad = g2;
  bad.split_workspace = reinterpret_cast<char*>(s.f.get()) + 4;  // misaligned workspace
  EXPECT_EQ(kernels::launch_gemm2_stream(bad, 16, 2, nullptr), cudaErrorInvalidValue);
  // The launcher itself (launch_gemm1_act would first lower the split to what this short K allows).
  const kernels::Gemm1Args g1 = s.gemm1({GemmKernel::Sm90Stream, 32, 3, 3});
  EXPECT_EQ(kernels::launch_gemm1_act_stream(g1, 32, 3, nullptr), cudaErrorInvalidValue);  // split_k 3, no workspace
  kernels::Gemm1Args gathered = s.gemm1({GemmKernel::Sm90Stream, 16, 1, 1});
  gathered.a_row_to_entry = s.dummy.get();
  gathered.a_top_k = 0;  // a gather needs top_k >= 1
  EXPECT_EQ(kernels::launch_gemm1_act(gathered, nullptr), cudaErrorInvalidValue);
  gathered.tactic = {GemmKernel::Sm90Wgmma, 128, 1, 1};  // the same check in the wgmma kernel
  EXPECT_EQ(kernels::launch_gemm1_act(gathered, nullptr), cudaErrorInvalidValue);
  kernels::Gemm2Args fin = g2;
  fin.finalize_counters = s.dummy.get();
  fin.out = reinterpret_cast<__nv_bfloat16*>(s.a.get());
  fin.finalize_top_k = 1;  // the fused finalize is for top_k >= 2
  EXPECT_EQ(kernels::launch_gemm2(fin, nullptr), cudaErrorInvalidValue);
  fin.finalize_top_k = 2;
  fin.out = nullptr;  // it writes out
  EXPECT_EQ(kernels::launch_gemm2(fin, nullptr), cudaErrorInvalidValue);
  fin.out = reinterpret_cast<__nv_bfloat16*>(s.a.get());
  fin.tactic = {GemmKernel::Sm90Wgmma, 128, 1, 1};  // the wgmma kernel has no fused top-k finalize
  EXPECT_EQ(kernels::launch_gemm2(fin, nullptr), cudaErrorInvalidValue);
  kernels::Gemm2Args early = g2;  // an early start that is none of the modes
  early.early_start = static_cast<kernels::GemmEarlyStart>(3);
  EXPECT_EQ(kernels::launch_gemm2_stream(early, 16, 1, nullptr), cudaErrorInvalidValue);
  // The per-tile hand-off: TileReady needs tile_ready and a count >= 1, is GEMM2's only, and a GEMM2
  // takes tile_ready only with it; the wgmma kernel takes neither.
  early.early_start = kernels::GemmEarlyStart::TileReady;
  EXPECT_EQ(kernels::launch_gemm2_stream(early, 16, 1, nullptr), cudaErrorInvalidValue);  // no tile_ready
  early.tile_ready = s.dummy.get();
  early.tile_ready_count = 0;
  EXPECT_EQ(kernels::launch_gemm2_stream(early, 16, 1, nullptr), cudaErrorInvalidValue);  // count 0
  early.tile_ready_count = 2;
  early.early_start = kernels::GemmEarlyStart::TileTable;
  EXPECT_EQ(kernels::launch_gemm2_stream(early, 16, 1, nullptr), cudaErrorInvalidValue);  // not waited for
  early.early_start = kernels::GemmEarlyStart::TileReady;
  early.tactic = {GemmKernel::Sm90Wgmma, 128, 1, 1};
  EXPECT_EQ(kernels::launch_gemm2(early, nullptr), cudaErrorInvalidValue);
  kernels::Gemm1Args ready1 = s.gemm1({GemmKernel::Sm90Stream, 16, 1, 1});
  ready1.early_start = kernels::GemmEarlyStart::TileReady;  // GEMM2's mode
  EXPECT_EQ(kernels::launch_gemm1_act(ready1, nullptr), cudaErrorInvalidValue);
  ready1.early_start = kernels::GemmEarlyStart::AfterWait;
  ready1.tile_ready = s.dummy.get();
  ready1.tactic = {GemmKernel::Sm90Wgmma, 128, 1, 1};
  EXPECT_EQ(kernels::launch_gemm1_act(ready1, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(kernels::launch_gemm2_stream(g2, 24, 1, nullptr), cudaErrorInvalidValue);  // no 24-row tiles
  EXPECT_EQ(kernels::launch_gemm2_stream(g2, 64, 1, nullptr), cudaErrorInvalidValue);
  EXPECT_TRUE(kernels::gemm_stream_tile_supported(16) && kernels::gemm_stream_tile_supported(32));
  EXPECT_EQ(kernels::gemm_stream_workspace_bytes(4, 256, 16, 1), 0u);
  EXPECT_GE(kernels::gemm_stream_workspace_bytes(4, 256, 16, 3), size_t{4 * 2 * 3 * 256 * 8 * 4});
  EXPECT_GE(kernels::gemm_stream_workspace_bytes(4, 256, 32, 3), size_t{4 * 2 * 3 * 256 * 16 * 4});
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace fp4moe
