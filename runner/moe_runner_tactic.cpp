// runner/moe_runner_tactic.cpp — which tactic a forward uses (CPU code, also in builds without CUDA).
#include "fp4moe/error.hpp"
#include "fp4moe/runner.hpp"

namespace fp4moe {

MoeTactic MoeRunner::tactic_for(int64_t num_tokens) const {
  if (forced_tactic_) return *forced_tactic_;
  // Tokens per expert with balanced routing: from 256 on, 256-token tiles (each decoded weight
  // fragment feeds twice the tokens); below, 128-token tiles (less padding in an expert's last tile).
  const int64_t per_expert = num_tokens * problem_.top_k() / problem_.num_experts;
  MoeTactic t;
  t.kernel = GemmKernel::Sm90Wgmma;
  t.tile_tokens = per_expert >= 256 ? 256 : 128;
  return t;
}

void MoeRunner::force_tactic(std::optional<MoeTactic> tactic) {
  if (tactic) {
    const MoeTactic& t = *tactic;
    const bool ok = t.kernel == GemmKernel::Sm90Wgmma && (t.tile_tokens == 128 || t.tile_tokens == 256) &&
                    t.split_k == 1;
    check(ok, "MoeRunner::force_tactic: tactic ", describe(t), " is not available for ", problem_.describe());
  }
  forced_tactic_ = tactic;
}

}  // namespace fp4moe
