// runner/unavailable — the GPU entry points of a build without CUDA: each one says so.
#include "fp4moe/expert_parallel.hpp"
#include "fp4moe/runner.hpp"

namespace fp4moe {
namespace {
[[noreturn]] void unavailable(const char* what) {
  throw Error(detail::concat(what, ": fp4moe was built without CUDA (no nvcc found at configure time); rebuild on a "
                                   "machine with the CUDA toolkit, or use --device cpu"));
}
}  // namespace

std::unique_ptr<MoeRunner> MoeRunner::create(const MoeProblem& problem, int64_t, int) {
  problem.validate();
  unavailable("MoeRunner");
}

std::unique_ptr<GpuRouter> GpuRouter::create(const RoutingParams&, int64_t, int) { unavailable("GpuRouter"); }

Status GpuRouter::route(CUstream_st*, int64_t, const void*, LogitsDType, const float*, int32_t*, float*) const {
  return Status::failure("GpuRouter::route: fp4moe was built without CUDA");
}

std::vector<std::unique_ptr<Communicator>> make_virtual_ranks(int, int, double) { unavailable("make_virtual_ranks"); }

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm*) { unavailable("make_nccl_communicator"); }

std::string nccl_unique_id() { unavailable("nccl_unique_id"); }

std::unique_ptr<Communicator> make_nccl_communicator(const std::string&, int, int, int) {
  unavailable("make_nccl_communicator");
}

std::vector<std::unique_ptr<Communicator>> make_nccl_ranks(const std::vector<int>&) { unavailable("make_nccl_ranks"); }

std::unique_ptr<ExpertParallelLayer> ExpertParallelLayer::create(const MoeProblem& problem, int64_t,
                                                                 Communicator&, const ExpertParallelOptions&, int) {
  problem.validate();
  unavailable("ExpertParallelLayer");
}

bool cuda_device_available(std::string* why_not) {
  if (why_not) *why_not = "fp4moe was built without CUDA";
  return false;
}

}  // namespace fp4moe
