// tests/io/random_packed_case_test.cpp — make_random_packed_case: its FP4 codes and e4m3 scales are drawn
// in fixed blocks by generators of their own (io/random_packed_case.cpp). The same seed gives the same
// bytes; the blocks' streams do not repeat each other; scale codes cover exactly 0x30..0x48 and code
// nibbles all 16 values, each about evenly.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <unordered_set>
#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/presets.hpp"

namespace fp4moe {
namespace {

// tiny's routing and activation with 8 experts of H = 1024, I = 512: w13 holds 4 MiB of codes (4 blocks
// of the generator), w2 2 MiB, their scales 1/8 of that.
MoeProblem four_block_problem() {
  MoeProblem p = preset("tiny");
  p.hidden = 1024;
  p.inter = 512;
  return p;
}

TEST(RandomPackedCase, SameSeedSameBytesOtherSeedOtherBytes) {
  const MoeProblem p = four_block_problem();
  const io::MoeCase a = io::make_random_packed_case(p, 3, 21);
  const io::MoeCase b = io::make_random_packed_case(p, 3, 21);
  const io::MoeCase c = io::make_random_packed_case(p, 3, 22);
  EXPECT_EQ(a.w13, b.w13);
  EXPECT_EQ(a.w13_scale, b.w13_scale);
  EXPECT_EQ(a.w2, b.w2);
  EXPECT_EQ(a.w2_scale, b.w2_scale);
  EXPECT_EQ(a.hidden_states, b.hidden_states);
  EXPECT_EQ(a.router_logits, b.router_logits);
  EXPECT_EQ(a.w13_scale_2, b.w13_scale_2);
  EXPECT_NE(a.w13, c.w13);
  EXPECT_NE(a.w2_scale, c.w2_scale);
}

// Every 8-byte word of both code tensors distinct: 786432 words, where random words collide with
// probability ~2e-8, while blocks whose streams were shifted copies of each other (starts a multiple
// of the generator's increment apart) would repeat most of their words.
TEST(RandomPackedCase, BlocksDoNotRepeatEachOther) {
  const io::MoeCase c = io::make_random_packed_case(four_block_problem(), 0, 5);
  ASSERT_EQ(c.w13.size(), size_t(4) << 20);
  ASSERT_EQ(c.w2.size(), size_t(2) << 20);
  std::unordered_set<uint64_t> seen;
  seen.reserve((c.w13.size() + c.w2.size()) / 8);
  for (const std::vector<uint8_t>* t : {&c.w13, &c.w2}) {
    for (size_t i = 0; i + 8 <= t->size(); i += 8) {
      uint64_t w;
      std::memcpy(&w, t->data() + i, 8);
      ASSERT_TRUE(seen.insert(w).second) << "word at byte " << i << " repeats an earlier one";
    }
  }
}

TEST(RandomPackedCase, ScaleCodesAndNibblesAreEvenlySpread) {
  const io::MoeCase c = io::make_random_packed_case(four_block_problem(), 0, 9);
  std::array<int64_t, 256> scales{};
  for (const std::vector<uint8_t>* t : {&c.w13_scale, &c.w2_scale})
    for (uint8_t b : *t) ++scales[b];
  const int64_t n_scales = static_cast<int64_t>(c.w13_scale.size() + c.w2_scale.size());
  for (int v = 0; v < 256; ++v) {
    if (v < 0x30 || v > 0x48) {
      EXPECT_EQ(scales[v], 0) << "scale code " << v << " outside 0x30..0x48";
    } else {  // 10 or 11 of 256 byte values map to each code: shares 0.039 or 0.043, +-10%
      const double share = double(scales[v]) / n_scales;
      EXPECT_GT(share, 0.9 * 10 / 256) << "scale code " << v;
      EXPECT_LT(share, 1.1 * 11 / 256) << "scale code " << v;
    }
  }
  std::array<int64_t, 16> nibbles{};
  for (uint8_t b : c.w13) {
    ++nibbles[b & 15];
    ++nibbles[b >> 4];
  }
  for (int v = 0; v < 16; ++v) {
    const double share = double(nibbles[v]) / (2.0 * c.w13.size());
    EXPECT_NEAR(share, 1.0 / 16, 0.002) << "e2m1 code " << v;
  }
}


// MXFP4: ue8m0 codes base[e] + 0..3 with a per-expert base in 117..120, the same bytes for a seed, no
// global or input scales; an NVFP4 case of the same seed keeps its bytes (the MXFP4 draws are extra).
TEST(RandomPackedCase, Mxfp4CodesPerExpertBaseAndOffsets) {
  MoeProblem p = four_block_problem();
  p.weight_format = WeightFormat::MXFP4;
  const io::MoeCase a = io::make_random_packed_case(p, 3, 21);
  const io::MoeCase b = io::make_random_packed_case(p, 3, 21);
  EXPECT_EQ(a.w13_scale, b.w13_scale);
  EXPECT_EQ(a.w2_scale, b.w2_scale);
  EXPECT_EQ(a.w13, b.w13);
  EXPECT_TRUE(a.w13_scale_2.empty() && a.w2_scale_2.empty() && a.w13_input_scale.empty() && a.w2_input_scale.empty());
  const int64_t E = p.num_experts;
  ASSERT_EQ(a.w13_scale.size(), size_t(E * p.w13_rows() * p.hidden / 32));
  ASSERT_EQ(a.w2_scale.size(), size_t(E * p.hidden * p.inter / 32));
  for (const auto* s : {&a.w13_scale, &a.w2_scale}) {
    const int64_t per_expert = static_cast<int64_t>(s->size()) / E;
    for (int64_t e = 0; e < E; ++e) {
      const auto [lo, hi] = std::minmax_element(s->begin() + e * per_expert, s->begin() + (e + 1) * per_expert);
      EXPECT_GE(*lo, 117);
      EXPECT_LE(*hi, 123);
      EXPECT_EQ(*hi - *lo, 3) << "expert " << e;  // all four offsets occur
      EXPECT_LE(*lo, 120);
    }
  }
  const io::MoeCase nv = io::make_random_packed_case(four_block_problem(), 3, 21);
  EXPECT_EQ(nv.w13, a.w13);  // the codes' stream is the same one
  EXPECT_EQ(nv.hidden_states, a.hidden_states);
}

}  // namespace
}  // namespace fp4moe
