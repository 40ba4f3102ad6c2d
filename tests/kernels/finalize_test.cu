// tests/kernels/finalize_test.cu — launch_finalize against a CPU loop of the same arithmetic.
//
// out[t, h] = bf16(acc), acc = 0; acc = acc + w[t,j] * y[t*k+j, h] for j in slot order, every
// operation a separately rounded fp32 operation (the CPU reference's finalize). Bit-exact bf16 for
// T in {0, 1, 3, 17, 255, 1000, 8191, 8193}, k in {1, 2, 4, 8, 32}, several H, unit weights, and a
// token with a NaN in y (it must poison that token's row only).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fp4moe/format.hpp"
#include "kernels/gpu_test_util.hpp"
#include "kernels/launch.hpp"

namespace fp4moe {
namespace {

using test::DeviceBuffer;

// NOTE: the host compiler targets x86-64 without FMA here, so `acc + w * y` is two rounded operations,
// like the kernel's __fadd_rn(acc, __fmul_rn(w, y)); the product is kept in a named variable anyway.
std::vector<uint16_t> cpu_finalize(const std::vector<float>& y, const std::vector<float>& w, int T, int k,
                                   int H, bool unit) {
  std::vector<uint16_t> out(static_cast<size_t>(T) * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t entry = t * k + j;
        const float weight = unit ? 1.0f : w[entry];
        volatile float prod = weight * y[entry * H + h];
        acc = acc + prod;
      }
      out[t * H + h] = format::bf16_from_float(acc);
    }
  return out;
}

void run_case(int T, int k, int H, bool unit, bool with_nan, uint64_t seed) {
  std::ostringstream name;
  name << "T=" << T << " k=" << k << " H=" << H << " unit=" << unit << " nan=" << with_nan << " seed=" << seed;
  SCOPED_TRACE(name.str());
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uw(0.0f, 1.0f);
  const int64_t n = static_cast<int64_t>(T) * k;
  std::vector<float> y(static_cast<size_t>(n * H)), w(n);
  for (auto& v : y) v = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 16) - 8);
  for (auto& v : w) v = uw(rng);
  int64_t nan_token = -1;
  if (with_nan && T > 0) {
    nan_token = static_cast<int64_t>(rng() % T);
    y[(nan_token * k + (k - 1)) * H + (H / 2)] = std::nanf("");
  }
  const std::vector<uint16_t> want = cpu_finalize(y, w, T, k, H, unit);

  DeviceBuffer<float> d_y(y), d_w(w);
  DeviceBuffer<uint16_t> d_out(static_cast<size_t>(T) * H);
  ASSERT_TRUE(d_y.ok() && d_w.ok() && d_out.ok());
  d_out.poison();
  kernels::FinalizeArgs a;
  a.y = d_y.get();
  a.topk_weights = unit ? nullptr : d_w.get();
  a.num_tokens = T;
  a.top_k = k;
  a.hidden_size = H;
  a.unit_weights = unit;
  a.out = reinterpret_cast<__nv_bfloat16*>(d_out.get());
  CUDA_ASSERT(kernels::launch_finalize(a, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  const auto got = d_out.download();
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 8; ++i) {
    const float g = format::bf16_to_float(got[i]), x = format::bf16_to_float(want[i]);
    const bool both_nan = std::isnan(g) && std::isnan(x);
    if (got[i] != want[i] && !both_nan) {
      ADD_FAILURE() << "out[" << i / H << ", " << i % H << "]: got " << g << " (0x" << std::hex << got[i]
                    << ") want " << x << " (0x" << want[i] << ")" << std::dec;
      ++bad;
    }
    if (std::isnan(g)) EXPECT_EQ(static_cast<int64_t>(i / H), nan_token) << "NaN outside the poisoned token";
  }
}

TEST(FinalizeKernel, EveryTokenCountAndTopK) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 9000;
  for (int T : {0, 1, 3, 17, 255, 1000, 8191, 8193})
    for (int k : {1, 2, 4, 8, 32}) {
      const int H = T >= 1000 ? (k >= 8 ? 64 : 256) : (T >= 255 ? 2880 : 7168);
      run_case(T, k, H, false, false, ++seed);
    }
}

TEST(FinalizeKernel, UnitWeightsAndNaN) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 9100;
  for (int H : {16, 64, 2880, 7168}) {
    run_case(17, 1, H, true, false, ++seed);
    run_case(17, 4, H, true, true, ++seed);
    run_case(33, 8, H, false, true, ++seed);
  }
}

TEST(FinalizeKernel, RejectsBadArguments) {
  kernels::FinalizeArgs a;
  a.num_tokens = 1;
  a.top_k = 1;
  a.hidden_size = 12;  // not a multiple of 8
  EXPECT_EQ(kernels::launch_finalize(a, nullptr), cudaErrorInvalidValue);
  a.num_tokens = 0;
  a.hidden_size = 64;
  EXPECT_EQ(kernels::launch_finalize(a, nullptr), cudaSuccess);  // T = 0: nothing to do
}

}  // namespace
}  // namespace fp4moe
