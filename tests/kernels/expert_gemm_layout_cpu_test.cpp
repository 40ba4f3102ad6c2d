// tests/kernels/expert_gemm_layout_cpu_test.cpp — the prepacked layout's bit table (kSlot) against its
// register decoder (decode_word) and the scale decoder, on the host: no GPU, so CI checks that a change
// of either keeps them matched. (The prepack itself and the kernels are checked by the GPU tests,
// expert_gemm_test.cu.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>

#include "fp4moe/format.hpp"
#include "kernels/nvfp4/weight_layout.cuh"

namespace fp4moe {
namespace {

namespace fl = kernels::nvfp4;

// The bf16 bit position of each field in a decoded half (sign, exponent bits 1 and 0, mantissa).
constexpr int kFieldBit[4] = {15, 8, 7, 6};

int field_source(const fl::SlotBits& s, int f) { return f == 0 ? s.sign : f == 1 ? s.e1 : f == 2 ? s.e0 : s.m; }

// The word holding e2m1 code `code` in (output j, half h) and zeros elsewhere, as the prepack places it.
uint32_t word_with_code(int j, int h, uint32_t code) {
  const fl::SlotBits& s = fl::kSlot[j][h];
  return ((code >> 3) & 1u) << s.sign | ((code >> 2) & 1u) << s.e1 | ((code >> 1) & 1u) << s.e0 | (code & 1u) << s.m;
}

TEST(ExpertGemmLayoutCpu, EveryWordBitHasOneSlot) {
  int owners[32] = {};
  for (int j = 0; j < 4; ++j)
    for (int h = 0; h < 2; ++h)
      for (int f = 0; f < 4; ++f) {
        const int b = field_source(fl::kSlot[j][h], f);
        ASSERT_GE(b, 0);
        ASSERT_LT(b, 32);
        ++owners[b];
      }
  for (int b = 0; b < 32; ++b) EXPECT_EQ(owners[b], 1) << "word bit " << b;
}

TEST(ExpertGemmLayoutCpu, DecodeMovesEachBitToItsField) {
  for (int j = 0; j < 4; ++j)
    for (int h = 0; h < 2; ++h)
      for (int f = 0; f < 4; ++f) {
        const int b = field_source(fl::kSlot[j][h], f);
        uint32_t out[4];
        fl::decode_word(1u << b, out);
        for (int o = 0; o < 4; ++o)
          EXPECT_EQ(out[o], o == j ? 1u << (kFieldBit[f] + 16 * h) : 0u)
              << "word bit " << b << " (output " << j << ", half " << h << ", field " << f << "), output " << o;
      }
}

TEST(ExpertGemmLayoutCpu, DecodeIsBitwise) {
  // decode_word of any word is the OR of the decodes of its bits (no carries between fields), so the
  // single-bit test above covers every word.
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const uint32_t w = rng();
    uint32_t got[4], want[4] = {};
    fl::decode_word(w, got);
    for (int b = 0; b < 32; ++b)
      if (w >> b & 1u) {
        uint32_t one[4];
        fl::decode_word(1u << b, one);
        for (int o = 0; o < 4; ++o) want[o] |= one[o];
      }
    for (int o = 0; o < 4; ++o) EXPECT_EQ(got[o], want[o]) << "word " << w << ", output " << o;
  }
}

TEST(ExpertGemmLayoutCpu, EveryCodeDecodesToItsValueTimesTwoToMinus126) {
  for (int j = 0; j < 4; ++j)
    for (int h = 0; h < 2; ++h)
      for (uint32_t code = 0; code < 16; ++code) {
        uint32_t out[4];
        fl::decode_word(word_with_code(j, h, code), out);
        const float got = format::bf16_to_float(static_cast<uint16_t>(out[j] >> (16 * h)));
        EXPECT_EQ(got, std::ldexp(format::e2m1_to_float(static_cast<uint8_t>(code)), -126))
            << "code " << code << " in output " << j << ", half " << h;
        EXPECT_EQ(out[j] >> (16 * (1 - h)) & 0xFFFFu, 0u) << "the other half of output " << j;
      }
}

TEST(ExpertGemmLayoutCpu, EveryScaleDecodesToItsValueTimesTwoTo118) {
  for (int mag = 1; mag < 0x7F; ++mag) {  // e4m3 magnitudes, zero and NaN excluded
    const uint32_t sc = fl::scale_code_from_e4m3(static_cast<uint8_t>(mag));
    const float want = std::ldexp(format::e4m3_to_float(static_cast<uint8_t>(mag)), 118);
    for (int p_odd = 0; p_odd < 2; ++p_odd)
      for (int pos = 0; pos < 2; ++pos) {  // the code as the first or second k-block of the pair
        const uint32_t codes = sc << (8 * (2 * p_odd + pos));
        const uint32_t pair = fl::decode_scale_pair(codes, p_odd != 0);
        EXPECT_EQ(format::bf16_to_float(static_cast<uint16_t>(pair >> (16 * pos))), want)
            << "e4m3 magnitude " << mag << ", pair " << p_odd << ", k-block " << pos;
      }
  }
}

}  // namespace
}  // namespace fp4moe
