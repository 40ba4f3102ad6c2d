// reference/parallel.hpp — the thread helper of the CPU reference (and of io/random_packed_case.cpp).
//
// parallel_for(n, fn) runs fn(item, worker) for item in [0, n) on min(n, max_workers())
// std::threads that take items from a shared atomic counter (dynamic scheduling). `worker` is in
// [0, workers) and lets the caller keep per-thread scratch buffers. The first exception thrown by any
// item is rethrown on the calling thread after every thread has joined; the other items still run or
// are skipped. Results never depend on the thread count: every item writes its own outputs.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace fp4moe::reference::detail {

// The most workers a parallel_for of the calling thread uses; 0: hardware_concurrency. A caller that runs
// many small references at once on threads of its own (fp4moe soak) makes each of them serial with
// SerialScope: one problem per core uses the cores better than small problems split over all of them.
inline thread_local int worker_limit = 0;

inline int max_workers() {
  if (worker_limit > 0) return worker_limit;
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(hc);
}

// parallel_for runs on the calling thread alone while one lives.
class SerialScope {
 public:
  SerialScope() : saved_(worker_limit) { worker_limit = 1; }
  ~SerialScope() { worker_limit = saved_; }
  SerialScope(const SerialScope&) = delete;
  SerialScope& operator=(const SerialScope&) = delete;

 private:
  int saved_;
};

// Number of workers parallel_for uses for n items.
inline int workers_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n, max_workers())));
}

template <typename Fn>
void parallel_for(int64_t n, Fn&& fn) {
  if (n <= 0) return;
  const int workers = workers_for(n);
  if (workers == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto body = [&](int worker) {
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n || failed.load(std::memory_order_relaxed)) return;
      try {
        fn(i, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  try {
    for (int w = 1; w < workers; ++w) threads.emplace_back(body, w);
  } catch (const std::system_error&) {
    // Fewer threads than asked for (resource limits): the ones that started, and this one, do it all.
  }
  body(0);
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace fp4moe::reference::detail
