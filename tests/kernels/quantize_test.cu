// tests/kernels/quantize_test.cu — the device NVFP4 codecs (kernels/nvfp4/codec.cuh),
// launch_quantize_nvfp4 and launch_gather_quantize against format/ (bit-exact).
//
//   codecs:   e4m3 / e2m1 encode of every rounding boundary (+-1 ulp), a dense sweep and random bit
//             patterns (NaN, inf, subnormals); decode of all 256 / 16 codes; the branch-free e2m1
//             rounding (e2m1_round_value) against encode + decode for every float bit pattern; the
//             branch-free division (kernels/div_rn.cuh) against __fdiv_rn.
//   quantize: H in {16, 64, 2880, 7168} x rows in {1, 127, 128, 129, 300}, linear and swizzled scales
//             (padding must be zero), blocks of all zeros, saturating blocks, tiny blocks, NaN / inf.
//   gather:   w4a16, w4a4 scalar and per-expert, with and without scale_by_weight, against the q*sf
//             values of format::quantize_nvfp4 / dequantize_nvfp4 of the permuted token rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fp4moe/format.hpp"
#include "kernels/gpu_test_util.hpp"
#include "kernels/div_rn.cuh"
#include "kernels/launch.hpp"
#include "kernels/nvfp4/codec.cuh"

namespace fp4moe {
namespace {

using test::DeviceBuffer;

float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// ---- device codecs -----------------------------------------------------------------------------
__global__ void encode_kernel(const float* x, int64_t n, uint8_t* e4m3, uint8_t* e2m1) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  e4m3[i] = static_cast<uint8_t>(kernels::nvfp4::e4m3_from_float(x[i]));
  e2m1[i] = static_cast<uint8_t>(kernels::nvfp4::e2m1_from_float(x[i]));
}

__global__ void decode_kernel(float* e4m3, float* e2m1) {
  const int c = threadIdx.x;  // 256 threads
  e4m3[c] = kernels::nvfp4::e4m3_to_float(static_cast<uint32_t>(c));
  if (c < 16) e2m1[c] = kernels::nvfp4::e2m1_to_float(static_cast<uint32_t>(c));
}

// e2m1_round_value against e2m1_to_float(e2m1_from_float(x)) (itself checked against format/ below) for
// every float bit pattern: the number of mismatches and the first mismatching pattern.
__global__ void round_value_every_float_kernel(unsigned long long* mismatches, uint32_t* first) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t u = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u <= 0xFFFFFFFFull; u += stride) {
    const float x = __uint_as_float(static_cast<uint32_t>(u));
    const float got = kernels::nvfp4::e2m1_round_value(x);
    const float want = kernels::nvfp4::e2m1_to_float(kernels::nvfp4::e2m1_from_float(x));
    if (__float_as_uint(got) != __float_as_uint(want)) {
      if (atomicAdd(mismatches, 1ull) == 0) *first = static_cast<uint32_t>(u);
    }
  }
}

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || test::float_bits(a) == test::float_bits(b);
}

// ---- the branch-free division (kernels/div_rn.cuh) against __fdiv_rn --------------------------------
// Counts of the pairs that divrn::fast_ok accepted and of those whose divrn::fast differs from
// __fdiv_rn in any bit, and the first such pair.
struct DivCheck {
  unsigned long long checked, mismatches;
  uint32_t first_a, first_b;
};

__device__ __forceinline__ void div_check_pair(float a, float b, DivCheck* out, unsigned long long& checked) {
  if (!kernels::divrn::fast_ok(a, b)) return;
  ++checked;
  if (__float_as_uint(kernels::divrn::fast(a, b)) != __float_as_uint(__fdiv_rn(a, b))) {
    if (atomicAdd(&out->mismatches, 1ull) == 0) {
      out->first_a = __float_as_uint(a);
      out->first_b = __float_as_uint(b);
    }
  }
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A float of the fast path's range: sign, exponent in [-62, 61] and mantissa from the bits of r.
__device__ __forceinline__ float in_range_float(uint64_t r) {
  const uint32_t exp = static_cast<uint32_t>((r >> 24) % 124) + 127 - 62;
  return __uint_as_float(static_cast<uint32_t>(r >> 63) << 31 | exp << 23 | static_cast<uint32_t>(r & 0x7FFFFFu));
}

// Part 1: every fp32 bit pattern as the numerator, with each divisor of `divisors`.
// Part 2: every divisor mantissa in [1, 2) at a few exponents (both signs), with each numerator of
//         `numerators`.
// Part 3: `random_pairs` pairs drawn over the whole range.
__global__ void div_rn_check_kernel(const float* divisors, int num_divisors, const float* numerators,
                                    int num_numerators, uint64_t random_pairs, DivCheck* out) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned long long checked = 0;
  for (uint64_t u = tid; u <= 0xFFFFFFFFull; u += stride) {
    const float a = __uint_as_float(static_cast<uint32_t>(u));
    for (int d = 0; d < num_divisors; ++d) div_check_pair(a, divisors[d], out, checked);
  }
  constexpr int kExps[] = {-62, -20, 0, 23, 61};
  for (uint64_t m = tid; m < (5ull << 23); m += stride) {
    const uint32_t e = static_cast<uint32_t>(kExps[m >> 23] + 127);
    const float b = __uint_as_float(static_cast<uint32_t>(m & 1) << 31 | e << 23 | static_cast<uint32_t>(m & 0x7FFFFF));
    for (int n = 0; n < num_numerators; ++n) div_check_pair(numerators[n], b, out, checked);
  }
  for (uint64_t i = tid; i < random_pairs; i += stride) {
    const uint64_t r = splitmix64(i);
    div_check_pair(in_range_float(r), in_range_float(splitmix64(r)), out, checked);
  }
  atomicAdd(&out->checked, checked);
}

TEST(Nvfp4Device, DecodeEveryCode) {
  FP4MOE_REQUIRE_SM90();
  DeviceBuffer<float> d4(256), d2(16);
  d4.poison();
  d2.poison();
  decode_kernel<<<1, 256>>>(d4.get(), d2.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  const auto g4 = d4.download(), g2 = d2.download();
  for (int c = 0; c < 256; ++c)
    EXPECT_TRUE(same_float(g4[c], format::e4m3_to_float(static_cast<uint8_t>(c)))) << "e4m3 code " << c;
  for (int c = 0; c < 16; ++c)
    EXPECT_TRUE(same_float(g2[c], format::e2m1_to_float(static_cast<uint8_t>(c)))) << "e2m1 code " << c;
}

TEST(Nvfp4Device, EncodeMatchesFormat) {
  FP4MOE_REQUIRE_SM90();
  std::vector<float> xs;
  auto with_neighbours = [&](float v) {
    for (float s : {v, -v}) {
      xs.push_back(s);
      xs.push_back(std::nextafter(s, INFINITY));
      xs.push_back(std::nextafter(s, -INFINITY));
    }
  };
  // every e4m3 value and every midpoint between neighbours (the RNE ties), beyond 448 too
  std::vector<float> grid;
  for (int c = 0; c < 0x7F; ++c) grid.push_back(format::e4m3_to_float(static_cast<uint8_t>(c)));
  grid.push_back(480.0f);
  for (size_t i = 0; i < grid.size(); ++i) {
    with_neighbours(grid[i]);
    if (i + 1 < grid.size()) with_neighbours(0.5f * (grid[i] + grid[i + 1]));
  }
  // e2m1 grid and midpoints
  const float e2[] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f};
  for (int i = 0; i < 8; ++i) {
    with_neighbours(e2[i]);
    with_neighbours(0.5f * (e2[i] + e2[i + 1]));
  }
  for (float v : {INFINITY, std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::min(), 1e-30f, 1e30f})
    with_neighbours(v);
  xs.push_back(std::numeric_limits<float>::quiet_NaN());
  xs.push_back(-std::numeric_limits<float>::quiet_NaN());
  xs.push_back(from_bits(0xFF800001u));  // negative signalling-pattern NaN
  // sweep: every 37th fp32 in [2^-12, 512)
  const uint32_t lo = test::float_bits(0x1p-12f), hi = test::float_bits(512.0f);
  for (uint32_t u = lo; u < hi; u += 37) {
    xs.push_back(from_bits(u));
    xs.push_back(-from_bits(u));
  }
  // random bit patterns
  std::mt19937_64 rng(77);
  for (int i = 0; i < (1 << 22); ++i) xs.push_back(from_bits(static_cast<uint32_t>(rng())));

  const int64_t n = static_cast<int64_t>(xs.size());
  DeviceBuffer<float> dx(xs);
  DeviceBuffer<uint8_t> d4(n), d2(n);
  ASSERT_TRUE(dx.ok() && d4.ok() && d2.ok());
  d4.poison();
  d2.poison();
  encode_kernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(dx.get(), n, d4.get(), d2.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  const auto g4 = d4.download(), g2 = d2.download();
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 16; ++i) {
    const uint8_t w4 = format::e4m3_from_float(xs[i]), w2 = format::e2m1_from_float(xs[i]);
    if (g4[i] != w4 || g2[i] != w2) {
      ADD_FAILURE() << "x = " << xs[i] << " (bits 0x" << std::hex << test::float_bits(xs[i])
                    << "): e4m3 got 0x" << int(g4[i]) << " want 0x" << int(w4) << ", e2m1 got 0x"
                    << int(g2[i]) << " want 0x" << int(w2) << std::dec;
      ++bad;
    }
  }
}

// ---- bf16 test data ----------------------------------------------------------------------------
// Rows of `cols` bf16 values; each 16-block gets its own character: random magnitudes spread over
// many binades, all zeros, saturating (huge), tiny (scale underflow), mixed signs with -0, NaN, inf.
std::vector<uint16_t> make_activations(int64_t rows, int64_t cols, std::mt19937_64& rng, bool specials) {
  std::vector<uint16_t> x(static_cast<size_t>(rows * cols));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-20, 12);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / 16; ++b) {
      const int kind = static_cast<int>(rng() % 16);
      const float scale = std::ldexp(1.0f, binade(rng));
      for (int i = 0; i < 16; ++i) {
        float v = normal(rng) * scale;
        switch (kind) {
          case 0: v = 0.0f; break;                            // all-zero block
          case 1: v = (i % 3 == 0) ? -0.0f : 0.0f; break;     // signed zeros
          case 2: v = normal(rng) * 1e30f; break;              // saturates e4m3 (gs * amax / 6 > 448)
          case 3: v = normal(rng) * 1e-30f; break;             // scale underflows to 0 / subnormal
          case 4: if (specials && i == 5) v = std::nanf(""); break;
          case 5: if (specials && i == 9) v = (rng() % 2) ? INFINITY : -INFINITY; break;
          case 6: v = 448.0f * static_cast<float>(i % 7) - 1000.0f; break;  // exact grid-ish values
          default: break;
        }
        x[static_cast<size_t>(r * cols + b * 16 + i)] = format::bf16_from_float(v);
      }
    }
  return x;
}

std::vector<float> widen(const std::vector<uint16_t>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = format::bf16_to_float(x[i]);
  return f;
}

void check_quantize(int64_t rows, int64_t cols, kernels::ScaleLayout layout, float input_scale,
                    uint64_t seed) {
  std::ostringstream name;
  name << "rows=" << rows << " cols=" << cols << " layout="
       << (layout == kernels::ScaleLayout::Linear ? "linear" : "swizzled") << " input_scale=" << input_scale
       << " seed=" << seed;
  SCOPED_TRACE(name.str());
  std::mt19937_64 rng(seed);
  const std::vector<uint16_t> x = make_activations(rows, cols, rng, true);
  const std::vector<float> xf = widen(x);
  const int64_t nb = cols / 16;
  std::vector<uint8_t> want_packed(static_cast<size_t>(rows * cols / 2)), want_linear(static_cast<size_t>(rows * nb));
  format::quantize_nvfp4(xf.data(), rows, cols, input_scale, want_packed.data(), want_linear.data());
  std::vector<uint8_t> want_scales = want_linear;
  if (layout == kernels::ScaleLayout::Swizzled128x4) {
    want_scales.assign(static_cast<size_t>(format::swizzled_scales_size(1, rows, nb)), 0xAB);
    format::scales_linear_to_swizzled(want_linear.data(), 1, rows, nb, want_scales.data());
  }

  DeviceBuffer<uint16_t> dx(x);
  DeviceBuffer<float> ds(std::vector<float>{input_scale});
  DeviceBuffer<uint8_t> dp(want_packed.size()), dsf(want_scales.size());
  ASSERT_TRUE(dx.ok() && ds.ok() && dp.ok() && dsf.ok());
  dp.poison();
  dsf.poison();
  CUDA_ASSERT(kernels::launch_quantize_nvfp4(reinterpret_cast<const __nv_bfloat16*>(dx.get()), rows, cols,
                                             ds.get(), dp.get(), dsf.get(), layout, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  const auto gp = dp.download(), gs = dsf.download();
  int bad = 0;
  for (size_t i = 0; i < gp.size() && bad < 8; ++i)
    if (gp[i] != want_packed[i]) {
      ADD_FAILURE() << "packed byte " << i << " (row " << i / (cols / 2) << "): got 0x" << std::hex
                    << int(gp[i]) << " want 0x" << int(want_packed[i]) << std::dec;
      ++bad;
    }
  for (size_t i = 0; i < gs.size() && bad < 16; ++i)
    if (gs[i] != want_scales[i]) {
      ADD_FAILURE() << "scale byte " << i << ": got 0x" << std::hex << int(gs[i]) << " want 0x"
                    << int(want_scales[i]) << std::dec;
      ++bad;
    }
}

TEST(Nvfp4Device, RoundValueMatchesEncodeDecodeForEveryFloat) {
  FP4MOE_REQUIRE_SM90();
  DeviceBuffer<unsigned long long> mismatches(1);
  DeviceBuffer<uint32_t> first(1);
  ASSERT_TRUE(mismatches.ok() && first.ok());
  CUDA_ASSERT(cudaMemset(mismatches.get(), 0, sizeof(unsigned long long)));
  CUDA_ASSERT(cudaMemset(first.get(), 0, sizeof(uint32_t)));
  round_value_every_float_kernel<<<1024, 256>>>(mismatches.get(), first.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  EXPECT_EQ(mismatches.download()[0], 0ull) << "first mismatch at bits 0x" << std::hex << first.download()[0];
}

TEST(Nvfp4Device, DivRnFastPathMatchesIeee) {
  FP4MOE_REQUIRE_SM90();
  // 1 - 2^-24: the steps round 1 / b wrong with a reciprocal one ulp low (DivRn.NeedsTheHardwareReciprocal).
  const std::vector<float> divisors = {1.0f,          0x1.fffffep-1f, 0x1.000002p0f, 1.5f,     3.0f,
                                       0x1.5bf0a8p1f, 7.0f,           1000.0f,       -5.0f,    0x1.fffffep0f,
                                       0x1.234568p20f, -0x1.8p-40f,   0x1p-62f,      0x1p62f, 0x1.fffffep61f};
  std::vector<float> numerators = {1.0f,  0x1.fffffep0f, 0x1.000002p0f, 1.5f,          3.0f,    -7.5f,
                                   1e-10f, 0x1.555556p-2f, 0x1p-62f,    0x1.fffffep61f, 1e15f,  -0x1.921fb6p1f};
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> g(-30.0f, 30.0f);
  while (numerators.size() < 48) numerators.push_back(g(rng));
  DeviceBuffer<float> dd(divisors), dn(numerators);
  DeviceBuffer<DivCheck> out(1);
  ASSERT_TRUE(dd.ok() && dn.ok() && out.ok());
  CUDA_ASSERT(cudaMemset(out.get(), 0, sizeof(DivCheck)));
  const uint64_t random_pairs = 1ull << 30;
  div_rn_check_kernel<<<1056, 256>>>(dd.get(), static_cast<int>(divisors.size()), dn.get(),
                                     static_cast<int>(numerators.size()), random_pairs, out.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  const DivCheck c = out.download()[0];
  // Part 1 accepts 124 exponents of each sign for every divisor (2 x 124 x 2^23 numerators each).
  const unsigned long long part1 = divisors.size() * 2ull * 124 * (1ull << 23);
  EXPECT_GE(c.checked, part1 + random_pairs);
  EXPECT_EQ(c.mismatches, 0ull) << std::hex << "first mismatch: a 0x" << c.first_a << " b 0x" << c.first_b;
}

TEST(QuantizeKernel, MatchesFormatBothLayouts) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 10;
  const float scales[] = {1.0f, 0.0123f, 3.75f, 1e-3f, 250.0f};
  int s = 0;
  for (int64_t cols : {16, 64, 2880, 7168})
    for (int64_t rows : {1, 127, 128, 129, 300})
      for (auto layout : {kernels::ScaleLayout::Linear, kernels::ScaleLayout::Swizzled128x4})
        check_quantize(rows, cols, layout, scales[s++ % 5], ++seed);
}

TEST(QuantizeKernel, EmptyInputIsANoOp) {
  FP4MOE_REQUIRE_SM90();
  EXPECT_EQ(kernels::launch_quantize_nvfp4(nullptr, 0, 64, nullptr, nullptr, nullptr,
                                           kernels::ScaleLayout::Swizzled128x4, nullptr),
            cudaSuccess);
  EXPECT_EQ(kernels::launch_quantize_nvfp4(nullptr, 4, 24, nullptr, nullptr, nullptr,
                                           kernels::ScaleLayout::Linear, nullptr),
            cudaErrorInvalidValue);  // cols not a multiple of 16
}

// quantize_block16 -> dequantize_block16 on the device against format::dequantize_nvfp4.
__global__ void block_roundtrip_kernel(const float* x, int64_t blocks, float input_scale, float* out) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  float v[16];
  for (int i = 0; i < 16; ++i) v[i] = x[b * 16 + i];
  const float gs = kernels::nvfp4::global_inv_scale(input_scale);
  const kernels::nvfp4::Block16 q = kernels::nvfp4::quantize_block16(v, gs, __fdiv_rn(1.0f, gs));
  float d[16];
  kernels::nvfp4::dequantize_block16(q, d);
  for (int i = 0; i < 16; ++i) out[b * 16 + i] = d[i];
}

TEST(Nvfp4Device, BlockRoundTripMatchesDequantize) {
  FP4MOE_REQUIRE_SM90();
  std::mt19937_64 rng(91);
  const int64_t rows = 64, cols = 1024;
  const std::vector<float> x = widen(make_activations(rows, cols, rng, true));
  const float input_scale = 0.037f;
  std::vector<uint8_t> packed(rows * cols / 2), sf(rows * cols / 16);
  std::vector<float> want(rows * cols);
  format::quantize_nvfp4(x.data(), rows, cols, input_scale, packed.data(), sf.data());
  format::dequantize_nvfp4(packed.data(), sf.data(), rows, cols, want.data());
  DeviceBuffer<float> dx(x), dout(x.size());
  dout.poison();
  const int64_t blocks = rows * cols / 16;
  block_roundtrip_kernel<<<static_cast<unsigned>((blocks + 127) / 128), 128>>>(dx.get(), blocks, input_scale,
                                                                              dout.get());
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  const auto got = dout.download();
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 8; ++i)
    if (!same_float(got[i], want[i])) {
      ADD_FAILURE() << "element " << i << ": got " << got[i] << " want " << want[i];
      ++bad;
    }
}

// ---- gather_quantize ---------------------------------------------------------------------------
struct GatherCase {
  int T = 1, k = 1, E = 8, H = 64;
  ActQuant mode = ActQuant::W4A16;
  bool scale_by_weight = false;
  uint64_t seed = 1;
};

void check_gather(const GatherCase& c) {
  std::ostringstream name;
  name << "T=" << c.T << " k=" << c.k << " E=" << c.E << " H=" << c.H << " mode=" << to_string(c.mode)
       << " scale_by_weight=" << c.scale_by_weight << " seed=" << c.seed;
  SCOPED_TRACE(name.str());
  std::mt19937_64 rng(c.seed);
  const int64_t n = static_cast<int64_t>(c.T) * c.k, H = c.H;
  const std::vector<uint16_t> hidden = make_activations(c.T, H, rng, false);
  // routing: k distinct experts per token, weights in (0, 2)
  std::vector<int32_t> ids(n);
  std::vector<float> weights(n);
  std::vector<int32_t> perm(c.E);
  std::iota(perm.begin(), perm.end(), 0);
  std::uniform_real_distribution<float> uw(0.01f, 2.0f);
  for (int t = 0; t < c.T; ++t)
    for (int j = 0; j < c.k; ++j) {
      const int pick = j + static_cast<int>(rng() % (c.E - j));
      std::swap(perm[j], perm[pick]);
      ids[t * c.k + j] = perm[j];
      weights[t * c.k + j] = uw(rng);
    }
  // stable expert-major permutation
  std::vector<int32_t> row_to_entry(n);
  std::iota(row_to_entry.begin(), row_to_entry.end(), 0);
  std::stable_sort(row_to_entry.begin(), row_to_entry.end(), [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  std::vector<float> input_scale(c.E);
  std::uniform_real_distribution<float> us(0.001f, 0.5f);
  for (auto& s : input_scale) s = us(rng);

  // expected bf16 bits of a1
  std::vector<uint16_t> want(static_cast<size_t>(n * H));
  std::vector<float> row(H), deq(H);
  std::vector<uint8_t> packed(H / 2), sf(H / 16);
  const float scalar_scale = *std::max_element(input_scale.begin(), input_scale.end());
  for (int64_t r = 0; r < n; ++r) {
    const int32_t entry = row_to_entry[r];
    const int64_t t = entry / c.k;
    const float wb = format::bf16_to_float(format::bf16_from_float(weights[entry]));
    for (int64_t i = 0; i < H; ++i) {
      const float xv = format::bf16_to_float(hidden[t * H + i]);
      row[i] = c.scale_by_weight ? format::bf16_to_float(format::bf16_from_float(xv * wb)) : xv;
    }
    if (c.mode != ActQuant::W4A16) {
      const float s = c.mode == ActQuant::W4A4Scalar ? scalar_scale : input_scale[ids[entry]];
      format::quantize_nvfp4(row.data(), 1, H, s, packed.data(), sf.data());
      format::dequantize_nvfp4(packed.data(), sf.data(), 1, H, deq.data());
      row = deq;
    }
    for (int64_t i = 0; i < H; ++i) want[r * H + i] = format::bf16_from_float(row[i]);
  }

  DeviceBuffer<uint16_t> d_hidden(hidden), d_a1(static_cast<size_t>(n * H));
  std::vector<int32_t> entry_to_row(n);
  for (int64_t r = 0; r < n; ++r) entry_to_row[row_to_entry[r]] = static_cast<int32_t>(r);
  DeviceBuffer<int32_t> d_e2r(entry_to_row), d_ids(ids);
  DeviceBuffer<float> d_w(weights);
  DeviceBuffer<float> d_scale(c.mode == ActQuant::W4A4Scalar ? std::vector<float>{scalar_scale} : input_scale);
  ASSERT_TRUE(d_hidden.ok() && d_a1.ok() && d_e2r.ok() && d_ids.ok() && d_w.ok() && d_scale.ok());
  d_a1.poison();
  kernels::GatherArgs a;
  a.hidden = reinterpret_cast<const __nv_bfloat16*>(d_hidden.get());
  a.entry_to_row = d_e2r.get();
  a.topk_ids = d_ids.get();
  a.topk_weights = d_w.get();
  a.input_scale = d_scale.get();
  a.num_tokens = c.T;
  a.top_k = c.k;
  a.hidden_size = c.H;
  a.num_experts = c.E;
  a.mode = c.mode;
  a.scale_by_weight = c.scale_by_weight;
  a.a1 = reinterpret_cast<__nv_bfloat16*>(d_a1.get());
  CUDA_ASSERT(kernels::launch_gather_quantize(a, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  const auto got = d_a1.download();
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 8; ++i) {
    const float g = format::bf16_to_float(got[i]), w = format::bf16_to_float(want[i]);
    const bool both_nan = std::isnan(g) && std::isnan(w);
    if (got[i] != want[i] && !both_nan) {
      ADD_FAILURE() << "a1 row " << i / H << " col " << i % H << ": got " << g << " (0x" << std::hex << got[i]
                    << ") want " << w << " (0x" << want[i] << ")" << std::dec;
      ++bad;
    }
  }
}

TEST(GatherQuantizeKernel, EveryModeAndScaleByWeight) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 50;
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert})
    for (bool sbw : {false, true})
      for (int H : {16, 64, 2880, 7168}) {
        GatherCase c;
        c.mode = mode;
        c.scale_by_weight = sbw;
        c.H = H;
        c.k = sbw ? 1 : 8;       // the router weight goes on the input with k = 1 only (Llama-4)
        c.E = sbw ? 16 : 128;
        c.T = H >= 2880 ? 17 : 255;
        c.seed = ++seed;
        check_gather(c);
      }
}

TEST(GatherQuantizeKernel, TokenCounts) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 80;
  for (int T : {0, 1, 3, 17, 255, 1000, 8191, 8193}) {
    GatherCase c;
    c.T = T;
    c.k = T > 1000 ? 2 : 4;
    c.E = 64;
    c.H = 128;
    c.mode = (T % 2) ? ActQuant::W4A4PerExpert : ActQuant::W4A4Scalar;
    c.seed = ++seed;
    check_gather(c);
  }
}

TEST(GatherQuantizeKernel, TopKLimit) {
  FP4MOE_REQUIRE_SM90();
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4PerExpert}) {  // k = 32, the router's limit, works
    GatherCase c;
    c.T = 5;
    c.k = 32;
    c.E = 40;
    c.H = 64;
    c.mode = mode;
    c.seed = 99;
    check_gather(c);
  }
  DeviceBuffer<uint16_t> hidden(std::vector<uint16_t>(64, 0)), a1(static_cast<size_t>(33 * 64));
  DeviceBuffer<int32_t> e2r(std::vector<int32_t>(33, 0));
  ASSERT_TRUE(hidden.ok() && a1.ok() && e2r.ok());
  kernels::GatherArgs a;
  a.hidden = reinterpret_cast<const __nv_bfloat16*>(hidden.get());
  a.entry_to_row = e2r.get();
  a.a1 = reinterpret_cast<__nv_bfloat16*>(a1.get());
  a.num_tokens = 1;
  a.top_k = 33;  // past the limit: refused before any launch
  a.hidden_size = 64;
  a.mode = ActQuant::W4A16;
  EXPECT_EQ(kernels::launch_gather_quantize(a, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace fp4moe
