// kernels/weight_prepack.cu — host code: canonical NVFP4 expert weights -> the prepacked layout of
// kernels/nvfp4/weight_layout.cuh (built once, at weight preparation).
//
// Per expert, row group (8 rows) and 128-wide K chunk:
//   1. Scales: for each of the 8 rows x 8 k-blocks, take the e4m3 code; reject NaN; a negative scale
//      flips the signs of its 16 weights (q * -|sf| == -q * |sf|); store the 8-bit code of |sf|
//      (scale_code_from_e4m3). A zero scale zeroes its 16 weights. K-blocks past K get code 0.
//   2. Weights: lane 4g+t, word q gets the 8 nibbles of row g at the columns element_col(q, j, h, t)
//      (4 canonical bytes), each nibble's sign/E1/E0/M bits moved to the word bits kSlot[j][h] lists
//      (a 256-entry table per output register). Columns past K are zero.
// Plain C++ (compiled by nvcc only because kernels/*.cu is what the build globs).
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "fp4moe/error.hpp"
#include "kernels/nvfp4/weight_layout.cuh"
#include "kernels/launch.hpp"

namespace fp4moe::kernels {

PrepackedWeights prepack_expert_weights(const uint8_t* w, const uint8_t* w_scale, int64_t E, int64_t N,
                                        int64_t K, std::vector<uint8_t>& w_out,
                                        std::vector<uint8_t>& scale_out) {
  using namespace nvfp4;
  check(E >= 0, "prepack_expert_weights: number of experts must be >= 0, got ", E);
  check(N > 0 && N % 16 == 0, "prepack_expert_weights: rows N must be a positive multiple of 16, got ", N);
  check(K > 0 && K % 16 == 0, "prepack_expert_weights: cols K must be a positive multiple of 16, got ", K);
  check(E == 0 || (w != nullptr && w_scale != nullptr), "prepack_expert_weights: w and w_scale must be non-null");

  PrepackedWeights pw;
  pw.num_experts = E;
  pw.rows = N;
  pw.cols = K;
  pw.padded_cols = (K + kChunkK - 1) / kChunkK * kChunkK;
  const int64_t groups = N / kRowsPerGroup, chunks = pw.padded_cols / kChunkK;
  pw.weight_bytes = static_cast<size_t>(E * N * pw.padded_cols / 2);
  pw.scale_bytes = static_cast<size_t>(E * N * pw.padded_cols / 16);
  w_out.assign(pw.weight_bytes, 0);
  scale_out.assign(pw.scale_bytes, 0);

  // table[j][byte]: the word bits of output register j for the two nibbles of one canonical byte
  // (low nibble -> half 0, high nibble -> half 1; columns 2c and 2c+1 of the fragment).
  static const auto table = [] {
    std::vector<uint32_t> t(4 * 256, 0);
    for (int j = 0; j < 4; ++j)
      for (int byte = 0; byte < 256; ++byte) {
        uint32_t word = 0;
        for (int h = 0; h < 2; ++h) {
          const uint32_t c = (byte >> (4 * h)) & 0xF;
          const SlotBits& b = kSlot[j][h];
          word |= ((c >> 3) & 1u) << b.sign | ((c >> 2) & 1u) << b.e1 | ((c >> 1) & 1u) << b.e0 | (c & 1u) << b.m;
        }
        t[j * 256 + byte] = word;
      }
    return t;
  }();

  const int64_t kb_count = K / 16;
  std::vector<uint8_t> rb(static_cast<size_t>(pw.padded_cols / 2));  // one row, sign-folded, zero-padded
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t row = e * N + n;
      const uint8_t* wr = w + row * (K / 2);
      const uint8_t* sr = w_scale + row * kb_count;
      const int64_t grp = n / kRowsPerGroup, g = n % kRowsPerGroup;
      std::fill(rb.begin(), rb.end(), uint8_t{0});
      for (int64_t kb = 0; kb < kb_count; ++kb) {
        const uint8_t sf = sr[kb];
        const uint8_t mag = sf & 0x7F;
        check(mag != 0x7F, "prepack_expert_weights: e4m3 scale of expert ", e, ", row ", n, ", k-block ", kb,
              " is NaN (code 0x", std::hex, static_cast<int>(sf), std::dec, ")");
        if (mag != 0) {  // a zero scale leaves its 16 weights zero
          const uint8_t flip = (sf & 0x80) ? 0x88 : 0x00;  // negative scale: flip both nibbles' signs
          for (int i = 0; i < 8; ++i) rb[static_cast<size_t>(kb * 8 + i)] = static_cast<uint8_t>(wr[kb * 8 + i] ^ flip);
        }
        const int64_t chunk = kb / 8, kb_in_chunk = kb % 8;
        scale_out[static_cast<size_t>(scale_offset(e, grp, chunk, groups, chunks) + g * 8 + kb_in_chunk)] =
            scale_code_from_e4m3(mag);
      }
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        uint8_t* dst = w_out.data() + weight_offset(e, grp, chunk, groups, chunks);
        const uint8_t* cb = rb.data() + chunk * (kChunkK / 2);
        for (int t = 0; t < 4; ++t) {
          const int lane = 4 * static_cast<int>(g) + t;
          for (int q = 0; q < 4; ++q) {
            // element_col(q, j, h, t) = 32q + 8j + 2t + h lives in byte 16q + 4j + t of the chunk
            const uint8_t* b = cb + 16 * q + t;
            const uint32_t word = table[b[0]] | table[256 + b[4]] | table[512 + b[8]] | table[768 + b[12]];
            std::memcpy(dst + lane * 16 + q * 4, &word, 4);  // little-endian, as the GPU loads it
          }
        }
      }
    }
  }
  return pw;
}

}  // namespace fp4moe::kernels
