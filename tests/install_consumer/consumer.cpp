// The public API from an installed fp4moe: a preset, a random case, the CPU reference, and the GPU
// runner (which, without a Hopper GPU, must refuse with an error that says why). Exits non-zero on
// any mismatch.
#include <cmath>
#include <cstdio>

#include "fp4moe/case_file.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"

int main() {
  using namespace fp4moe;
  const MoeProblem p = preset("tiny", ActQuant::W4A4Scalar);
  io::RandomCaseOptions options;
  options.seed = 7;
  const io::MoeCase c = io::make_random_case(p, 5, options);
  const reference::MoeResult r = reference::moe_forward(p, 5, c.hidden_states.data(), c.router(), c.weights());
  if (r.output.size() != size_t(5 * p.hidden)) {
    std::fprintf(stderr, "consumer: output has %zu values, expected %lld\n", r.output.size(),
                 static_cast<long long>(5 * p.hidden));
    return 1;
  }
  double sum = 0;
  for (uint16_t v : r.output) sum += std::fabs(format::bf16_to_float(v));
  if (!std::isfinite(sum) || sum == 0) {
    std::fprintf(stderr, "consumer: the reference output is not finite and non-zero (sum %g)\n", sum);
    return 1;
  }
  std::string why;
  if (cuda_device_available(&why)) {
    const auto runner = MoeRunner::create(p, 5);
    std::printf("consumer: %s, tactic %s\n", p.describe().c_str(), describe(runner->tactic_for(5)).c_str());
  } else {
    std::printf("consumer: %s, reference |out| sum %.4f; no GPU: %s\n", p.describe().c_str(), sum, why.c_str());
  }
  return 0;
}
