// runner/unavailable — the MoeRunner of a build without CUDA: every entry point says so.
#include "fp4moe/bench.hpp"
#include "fp4moe/runner.hpp"

namespace fp4moe {

std::unique_ptr<MoeRunner> MoeRunner::create(const MoeProblem& problem, int64_t, int) {
  problem.validate();
  throw Error("MoeRunner: fp4moe was built without CUDA (no nvcc found at configure time); "
              "rebuild on a machine with the CUDA toolkit, or use --device cpu");
}

bool cuda_device_available(std::string* why_not) {
  if (why_not) *why_not = "fp4moe was built without CUDA";
  return false;
}

}  // namespace fp4moe

namespace fp4moe {
reference::MoeResult run_case_on_gpu(const io::MoeCase&, double*) {
  throw Error("run_case_on_gpu: fp4moe was built without CUDA; use --device cpu");
}
}  // namespace fp4moe

namespace fp4moe {
Ceilings measure_ceilings() { throw Error("bench: fp4moe was built without CUDA"); }
std::vector<BenchRow> bench_model(const std::string&, const MoeProblem&, const std::vector<int64_t>&, const Ceilings&,
                                  const BenchOptions&, bool) {
  throw Error("bench: fp4moe was built without CUDA");
}
}  // namespace fp4moe
