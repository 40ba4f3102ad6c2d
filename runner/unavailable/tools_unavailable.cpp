// runner/unavailable — the tools' GPU entry points (fp4moe/bench.hpp) in a build without CUDA: each one
// says so.
#include "fp4moe/bench.hpp"

namespace fp4moe {
namespace {
[[noreturn]] void unavailable(const char* what) {
  throw Error(detail::concat(what, ": fp4moe was built without CUDA (no nvcc found at configure time); rebuild on a "
                                   "machine with the CUDA toolkit, or use --device cpu"));
}
}  // namespace

reference::MoeResult run_case_on_gpu(const io::MoeCase&, double*, std::optional<MoeTactic>) { unavailable("run_case_on_gpu"); }

Ceilings measure_ceilings() { unavailable("bench"); }

std::vector<BenchRow> bench_model(const std::string&, const MoeProblem&, const std::vector<int64_t>&, const Ceilings&,
                                  const BenchOptions&, bool) {
  unavailable("bench");
}

std::vector<BenchRow> bench_weights(const std::string&, const MoeProblem&, const reference::MoeWeights&,
                                    const std::vector<int64_t>&, const Ceilings&, const BenchOptions&, bool) {
  unavailable("bench");
}

std::vector<ExpertParallelBenchRow> bench_expert_parallel(const std::string&, const MoeProblem&,
                                                          const std::vector<int64_t>&, const ExpertParallelGroup&,
                                                          const BenchOptions&, bool) {
  unavailable("bench");
}

std::vector<TuneEntry> tune_problem(const std::string&, const MoeProblem&, const TuneProfileOptions&) {
  unavailable("tune");
}

}  // namespace fp4moe
