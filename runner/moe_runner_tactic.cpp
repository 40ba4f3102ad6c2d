// runner/moe_runner_tactic.cpp — which tactic a forward uses, and the shape of the stage rows (CPU code,
// also in builds without CUDA).
#include "fp4moe/error.hpp"
#include "fp4moe/runner.hpp"
#include "runner/forward_plan.hpp"

namespace fp4moe {
namespace {

void print_warnings(const TacticSelector& s) {
  for (const std::string& w : s.warnings()) log_warning(w);
}

}  // namespace

void MoeRunner::init_tactics(const DeviceKey& device) {
  device_key_ = device;
  selector_.emplace(TacticSelector::from_file(problem_, device_key_, ""));
  print_warnings(*selector_);
}

void MoeRunner::use_tune_cache(const std::string& path) {
  check(!path.empty(), "MoeRunner::use_tune_cache: empty path");
  selector_.emplace(TacticSelector::from_file(problem_, device_key_, path));
  print_warnings(*selector_);
}

TacticSelector::Choice MoeRunner::choice_for(int64_t num_tokens) const {
  check(selector_.has_value(), "MoeRunner: no tactic selector (the backend did not call init_tactics)");
  TacticSelector::Choice c = selector_->select(num_tokens);
  if (forced_tactic_) c.tactic = *forced_tactic_;
  return c;
}

void MoeRunner::force_tactic(std::optional<MoeTactic> tactic) {
  if (tactic) {
    const std::string why = why_invalid(problem_, *tactic);
    check(why.empty(), "MoeRunner::force_tactic: ", describe(*tactic), " cannot run ", problem_.describe(), ": ", why);
  }
  forced_tactic_ = tactic;
}

StageRowsShape MoeRunner::prepared_rows(int64_t num_tokens, ScaleLayout layout) const {
  check(num_tokens >= 0 && num_tokens <= max_tokens_, "MoeRunner::prepared_rows: num_tokens must be in [0, max_tokens=",
        max_tokens_, "], got ", num_tokens);
  return runner::stage_rows_shape(problem_, num_tokens, layout);
}

StageRowsShape MoeRunner::rows_shape(int64_t num_rows, int rows_top_k, ScaleLayout layout) const {
  return runner::stage_rows_of(problem_, num_rows, rows_top_k, layout);
}

}  // namespace fp4moe
