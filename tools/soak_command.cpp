// tools/soak_command.cpp — `fp4moe soak` (tools/soak_command.hpp).
#include "tools/soak_command.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <exception>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/bench.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/runner.hpp"
#include "reference/parallel.hpp"
#include "tools/soak_problem.hpp"

namespace fp4moe::tools {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
  check(static_cast<bool>(f), "soak: cannot write '", path.string(), "'");
}

void append_line(const std::filesystem::path& path, const std::string& line) {
  std::ofstream f(path, std::ios::app);
  f << line << '\n';
  check(static_cast<bool>(f), "soak: cannot append to '", path.string(), "'");
}

// The tested backend's outcome on the whole case.
soak::Outcome run_backend(const soak::SoakProblem& sp, const io::MoeCase& c, bool gpu) {
  soak::Outcome o;
  try {
    o.result = gpu ? run_case_on_gpu(c, nullptr, sp.tactic)
                   : reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
  } catch (const Error& e) {
    o.refused = true;
    o.message = e.what();
  }
  return o;
}

// After a GPU call failed: whether the device still runs a small known-good layer (a failed kernel
// can leave the CUDA context unusable, and every later problem would then fail for its sake).
bool gpu_still_works(std::string* why) {
  try {
    const io::MoeCase c = io::make_random_packed_case(preset("tiny", ActQuant::W4A16), 4, 1);
    (void)run_case_on_gpu(c);
    return true;
  } catch (const Error& e) {
    *why = e.what();
    return false;
  }
}

// The problems' cases and reference outcomes, computed ahead of the tested backend on threads of their
// own and handed out in index order: the tested backend (one GPU) runs one problem at a time on the
// calling thread while the other cores make the next problems' references. A small problem's
// reference runs serially (many small problems at once use the cores better than one split over all
// of them); a large one's uses every core. At most `window` problems are made ahead of the one taken.
class ReferencesAhead {
 public:
  struct Item {
    soak::SoakProblem sp;
    io::MoeCase c;
    std::vector<int64_t> tokens;
    soak::Outcome ref;
  };

  ReferencesAhead(uint64_t seed, int64_t begin, int64_t end, int threads)
      : seed_(seed), next_(begin), taken_(begin), end_(end), window_(2 * int64_t(threads)) {
    for (int t = 0; t < threads; ++t) threads_.emplace_back([this] { work(); });
  }
  ~ReferencesAhead() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    space_.notify_all();
    for (auto& t : threads_) t.join();
  }
  ReferencesAhead(const ReferencesAhead&) = delete;
  ReferencesAhead& operator=(const ReferencesAhead&) = delete;

  // Problem i (the next in order); rethrows what making it threw.
  Item take(int64_t i) {
    std::unique_lock<std::mutex> lock(m_);
    ready_cv_.wait(lock, [&] { return ready_.count(i) > 0; });
    Slot slot = std::move(ready_.at(i));
    ready_.erase(i);
    taken_ = i + 1;
    lock.unlock();
    space_.notify_all();
    if (slot.error) std::rethrow_exception(slot.error);
    return std::move(slot.item);
  }

 private:
  struct Slot {
    Item item;
    std::exception_ptr error;
  };

  void work() {
    for (;;) {
      int64_t i;
      {
        std::unique_lock<std::mutex> lock(m_);
        space_.wait(lock, [&] { return stop_ || next_ >= end_ || next_ < taken_ + window_; });
        if (stop_ || next_ >= end_) return;
        i = next_++;
      }
      Slot slot;
      try {
        slot.item.sp = soak::make_problem(seed_, i);
        std::optional<reference::detail::SerialScope> serial;
        if (!slot.item.sp.large) serial.emplace();
        slot.item.c = soak::make_case(slot.item.sp);
        slot.item.tokens = soak::reference_tokens(slot.item.sp, slot.item.c);
        slot.item.ref = soak::reference_outcome(slot.item.c, slot.item.tokens);
      } catch (...) {
        slot.error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(m_);
        ready_.emplace(i, std::move(slot));
      }
      ready_cv_.notify_all();
    }
  }

  const uint64_t seed_;
  int64_t next_, taken_;
  const int64_t end_, window_;
  std::mutex m_;
  std::condition_variable space_, ready_cv_;
  std::map<int64_t, Slot> ready_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// Progress lines from a thread of their own, so that one long problem does not silence them.
class Progress {
 public:
  Progress(const SoakOptions& o) : o_(o), t0_(Clock::now()), thread_([this] { loop(); }) {}
  ~Progress() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  std::atomic<int64_t> done{0}, mismatches{0}, crashes{0}, current{-1};
  double elapsed() const { return seconds_since(t0_); }
  void print(const char* what) {
    std::lock_guard<std::mutex> lock(print_m_);
    const double s = elapsed();
    std::printf("soak: %s %lld/%lld problems, %lld mismatches, %lld crashes, %.2f problems/s, at problem %lld\n", what,
                static_cast<long long>(done), static_cast<long long>(o_.problems), static_cast<long long>(mismatches),
                static_cast<long long>(crashes), s > 0 ? done / s : 0.0, static_cast<long long>(current));
    std::fflush(stdout);
  }
  void say(const std::string& line) {
    std::lock_guard<std::mutex> lock(print_m_);
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(m_);
    while (!cv_.wait_for(lock, std::chrono::duration<double>(o_.progress_seconds), [this] { return stop_; }))
      print("progress:");
  }
  const SoakOptions& o_;
  Clock::time_point t0_;
  std::mutex m_, print_m_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

void add_soak_command(CLI::App& app, SoakOptions& o) {
  CLI::App* c = app.add_subcommand("soak", "Run random problems through the GPU runner, each against the CPU reference");
  c->add_option("--problems", o.problems, "Number of problems")->capture_default_str()->check(CLI::Range(int64_t(0), int64_t(1) << 40));
  c->add_option("--seed", o.seed, "Seed: problem i is derived from (seed, i) alone")->capture_default_str();
  c->add_option("--start", o.start, "Index of the first problem (resume, or replay one with --problems 1)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(0), int64_t(1) << 50));
  c->add_option("--out", o.out, "Output folder: mismatching cases, logs, progress markers")->required();
  c->add_option("--device", o.device, "Backend checked against the reference: cuda (the GPU runner) or cpu (the reference itself)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cuda", "cpu"}));
  c->add_option("--time-limit", o.time_limit, "Start no problem after this many seconds (0: no limit); DIR/next says where to resume")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  c->add_option("--progress-seconds", o.progress_seconds, "Seconds between progress lines")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  o.command = c;
}

int run_soak_command(const SoakOptions& o) {
  const bool gpu = o.device == "cuda";
  if (gpu) {
    std::string why;
    check(cuda_device_available(&why), "soak --device cuda: no usable GPU (", why,
          "); the soak checks the GPU runner against the CPU reference and needs an sm_90 GPU "
          "(--device cpu checks the reference against itself)");
  }
  const std::filesystem::path dir(o.out);
  std::filesystem::create_directories(dir);
  const std::filesystem::path mismatch_log = dir / "mismatches.log", crash_log = dir / "crashes.log";
  std::printf("soak: seed %llu, problems %lld..%lld, device %s, output %s\n", static_cast<unsigned long long>(o.seed),
              static_cast<long long>(o.start), static_cast<long long>(o.start + o.problems - 1), o.device.c_str(),
              o.out.c_str());
  std::fflush(stdout);

  Progress progress(o);
  const int threads = std::max(1, reference::detail::max_workers() - 1);  // one core runs the tested backend
  ReferencesAhead ahead(o.seed, o.start, o.start + o.problems, threads);
  int64_t i = o.start;
  int status = 0;
  for (; i < o.start + o.problems; ++i) {
    if (o.time_limit > 0 && progress.elapsed() >= o.time_limit) {
      progress.say("soak: time limit of " + std::to_string(o.time_limit) + " s reached before problem " +
                   std::to_string(i));
      break;
    }
    progress.current = i;
    write_file(dir / "current", std::to_string(i) + "\n");
    const ReferencesAhead::Item item = ahead.take(i);
    const soak::SoakProblem& sp = item.sp;
    const io::MoeCase& c = item.c;
    const std::vector<int64_t>& tokens = item.tokens;
    const soak::Outcome& ref = item.ref;
    const soak::Outcome tested = run_backend(sp, c, gpu);
    const std::string diff = soak::check_outcome(c, tokens, ref, tested, /*bad_id_rows_nan=*/gpu);
    bool broken = false;
    std::string broken_why;
    if (gpu && tested.refused) broken = !gpu_still_works(&broken_why);
    ++progress.done;
    if (diff.empty() && !broken) continue;

    const std::string stem = "soak-" + std::to_string(o.seed) + "-" + std::to_string(i);
    const std::filesystem::path case_path = dir / (stem + ".safetensors");
    std::string saved = case_path.string();
    try {
      soak::save_problem_case(case_path.string(), sp, c);
    } catch (const Error& e) {
      saved = std::string("(not saved: ") + e.what() + ")";
    }
    const std::string replay = "fp4moe soak --seed " + std::to_string(o.seed) + " --start " + std::to_string(i) +
                               " --problems 1 --device " + o.device + " --out DIR";
    // A case file holds neither a forced tactic nor skip_foreign_ids (its metadata notes them), and its
    // loader refuses ids outside [0, E): `fp4moe run` replays only the other problems exactly.
    const bool run_replays = !sp.tactic && !sp.problem.routing.skip_foreign_ids && sp.invalid_id_tokens == 0;
    const std::string run_cmd = "fp4moe run --case " + case_path.string() + " --device " + o.device + " --out OUT.safetensors" +
                                (run_replays ? "" : "  (not exact: the case file cannot hold its forced tactic, "
                                                    "skip_foreign_ids or invalid ids; see its soak_* metadata)");
    std::string what = broken ? "device failed after the problem: " + broken_why +
                                    (tested.refused ? " (the problem's error: " + tested.message + ")" : "")
                              : diff;
    std::string report = sp.describe() + "\n" + what + "\nreplay: " + replay + "\n        " + run_cmd + "\ncase file: " + saved +
                         "\nreference tokens: " + std::to_string(tokens.size()) + " of " + std::to_string(sp.num_tokens) + "\n";
    write_file(dir / (stem + ".txt"), report);
    if (broken) {
      ++progress.crashes;
      append_line(crash_log, sp.describe() + ": " + what + " | replay: " + replay);
      progress.say("soak: CRASH " + sp.describe() + "\n  " + what + "\n  replay: " + replay);
      status = 4;
      ++i;
      break;
    }
    ++progress.mismatches;
    append_line(mismatch_log, sp.describe() + ": " + what + " | replay: " + replay);
    progress.say("soak: MISMATCH " + sp.describe() + "\n  " + what + "\n  replay: " + replay + "\n          " + run_cmd);
    status = 1;
  }
  write_file(dir / "next", std::to_string(i) + "\n");
  progress.current = i;
  progress.print("done:");
  std::printf("soak: %lld problems, %lld mismatches, %lld crashes\n", static_cast<long long>(progress.done.load()),
              static_cast<long long>(progress.mismatches.load()), static_cast<long long>(progress.crashes.load()));
  if (i < o.start + o.problems)
    std::printf("soak: resume with --seed %llu --start %lld --problems %lld\n", static_cast<unsigned long long>(o.seed),
                static_cast<long long>(i), static_cast<long long>(o.start + o.problems - i));
  return status == 4 ? 4 : (progress.mismatches > 0 ? 1 : 0);
}

}  // namespace fp4moe::tools
