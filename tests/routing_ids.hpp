// tests/routing_ids.hpp — random top-k ids as a router gives them (distinct experts per row), with a
// share of invalid ids (above E or negative), for the expert-parallel plan's CPU and GPU tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace fp4moe::test {

// [rows, k] ids over E experts (k <= E); each id is replaced by an invalid one with probability `invalid`.
inline std::vector<int32_t> random_ids(int64_t rows, int k, int64_t E, uint64_t seed, double invalid = 0.0) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(rows * k));
  std::vector<int32_t> pool(static_cast<size_t>(E));
  for (int64_t s = 0; s < rows; ++s) {
    for (int64_t e = 0; e < E; ++e) pool[e] = static_cast<int32_t>(e);
    std::shuffle(pool.begin(), pool.end(), rng);  // distinct experts per row, as a router gives
    for (int j = 0; j < k; ++j) ids[s * k + j] = pool[j];
  }
  std::bernoulli_distribution bad(invalid);
  for (auto& id : ids)
    if (bad(rng)) id = (rng() & 1) ? static_cast<int32_t>(E + rng() % 5) : -1 - static_cast<int32_t>(rng() % 3);
  return ids;
}

}  // namespace fp4moe::test
