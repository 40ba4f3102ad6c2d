// runner/virtual_ranks.cu — make_virtual_ranks (fp4moe/expert_parallel.hpp): N ranks of one process on
// one GPU. A rank's exchange is device copies on its own stream, ordered after every source's queued
// work by that source's event, and every source's later work is ordered after the copies that read it.
//
// exchange_counts: post the host array, barrier, read every sender's values for this rank, barrier.
// One call on rank r (all_to_all_v):
//   1. record ready[r] on r's stream; post the exchanges; barrier
//   2. for each source s: wait ready[s], copy s's bytes for r into r's receive buffer
//   3. record done[r]; barrier; wait done[d] of every other rank d (d's copies read r's send buffer)
// A rank re-records its events only after the next call's first barrier, which every rank reaches
// after its waits of this call, so no wait sees a later record.
#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "fp4moe/expert_parallel.hpp"
#include "runner/hopper_device.hpp"

namespace fp4moe {
namespace {

std::string cuda_message(const char* what, cudaError_t e) {
  return detail::concat("virtual ranks: ", what, ": ", cudaGetErrorString(e));
}

// The state the ranks share: a barrier with a timeout, and each rank's posted call.
class VirtualGroup {
 public:
  VirtualGroup(int size, int device, double timeout_seconds)
      : size_(size), device_(device), timeout_(timeout_seconds), posted_(size_t(size)), ready_(size_t(size)),
        done_(size_t(size)) {
    for (int r = 0; r < size; ++r) {
      check(cudaEventCreateWithFlags(&ready_[r], cudaEventDisableTiming) == cudaSuccess &&
                cudaEventCreateWithFlags(&done_[r], cudaEventDisableTiming) == cudaSuccess,
            "make_virtual_ranks: cudaEventCreate failed");
    }
  }
  ~VirtualGroup() {
    for (int r = 0; r < size_; ++r) {
      if (ready_[r]) cudaEventDestroy(ready_[r]);
      if (done_[r]) cudaEventDestroy(done_[r]);
    }
  }

  // Every rank arrives, or the group fails (timeout: the group is unusable from then on).
  Status barrier(int rank, const char* where) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (failed_) return Status::failure(detail::concat("virtual ranks: rank ", rank, ": ", where, ": ", failure_));
    const uint64_t gen = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return Status::success();
    }
    const bool woke = cv_.wait_for(lock, std::chrono::duration<double>(timeout_),
                                   [&] { return generation_ != gen || failed_; });
    if (!woke) {
      failed_ = true;
      failure_ = detail::concat("rank ", rank, " waited more than ", timeout_, " s for the other ranks in ", where,
                                " (a rank did not make the matching call)");
      cv_.notify_all();
    }
    if (failed_) return Status::failure(detail::concat("virtual ranks: rank ", rank, ": ", where, ": ", failure_));
    return Status::success();
  }
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_) failure_ = why;
    failed_ = true;
    cv_.notify_all();
  }

  struct Posted {
    const Communicator::Exchange* exchanges = nullptr;
    int count = 0;                    // exchanges, or values per rank for exchange_counts
    const int64_t* counts = nullptr;  // exchange_counts: the sender's [size * count] values
  };

  const int size_, device_;
  const double timeout_;
  std::vector<Posted> posted_;
  std::vector<cudaEvent_t> ready_, done_;

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool failed_ = false;
  std::string failure_;
};

class VirtualRank final : public Communicator {
 public:
  VirtualRank(std::shared_ptr<VirtualGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size_; }

  Status exchange_counts(const int64_t* send, int64_t* recv, int per_rank) override {
    VirtualGroup& g = *group_;
    const int n = g.size_;
    g.posted_[rank_] = {nullptr, per_rank, send};
    if (Status s = g.barrier(rank_, "exchange_counts"); !s.ok()) return s;
    std::string error;
    for (int src = 0; src < n; ++src) {
      const VirtualGroup::Posted& from = g.posted_[src];
      if (from.count != per_rank) {
        error = detail::concat("virtual ranks: exchange_counts: rank ", src, " sends ", from.count, " values per rank, rank ",
                               rank_, " expects ", per_rank);
        break;
      }
      for (int i = 0; i < per_rank; ++i) recv[size_t(src) * per_rank + i] = from.counts[size_t(rank_) * per_rank + i];
    }
    // The senders' arrays stay untouched until every rank has read them.
    if (Status s = g.barrier(rank_, "exchange_counts"); !s.ok()) return s;
    return error.empty() ? Status::success() : Status::failure(error);
  }

  Status all_to_all_v(CUstream_st* stream, const Exchange* exchanges, int count) override {
    VirtualGroup& g = *group_;
    const int n = g.size_;
    if (cudaError_t e = cudaSetDevice(g.device_); e != cudaSuccess) {
      g.fail(cuda_message("cudaSetDevice", e));
      return Status::failure(cuda_message("cudaSetDevice", e));
    }
    std::string error;
    auto note = [&](std::string m) {
      if (error.empty()) error = std::move(m);
    };
    if (cudaError_t e = cudaEventRecord(g.ready_[rank_], stream); e != cudaSuccess) note(cuda_message("cudaEventRecord", e));
    g.posted_[rank_] = {exchanges, count, nullptr};
    if (Status s = g.barrier(rank_, "all_to_all_v"); !s.ok()) return s;

    for (int src = 0; src < n && error.empty(); ++src) {
      const VirtualGroup::Posted& from = g.posted_[src];
      if (from.count != count) {
        note(detail::concat("virtual ranks: rank ", src, " exchanges ", from.count, " buffers, rank ", rank_, " ", count));
        break;
      }
      if (cudaError_t e = cudaStreamWaitEvent(stream, g.ready_[src], 0); e != cudaSuccess) {
        note(cuda_message("cudaStreamWaitEvent", e));
        break;
      }
      for (int i = 0; i < count; ++i) {
        const Exchange& sx = from.exchanges[i];
        const Exchange& rx = exchanges[i];
        const int64_t bytes = sx.send_end(rank_) - sx.send_offsets[rank_];
        const int64_t room = rx.recv_offsets[src + 1] - rx.recv_offsets[src];
        if (bytes != room) {
          note(detail::concat("virtual ranks: exchange ", i, ": rank ", src, " sends ", bytes, " bytes to rank ", rank_,
                              ", which expects ", room));
          break;
        }
        if (bytes == 0) continue;
        const cudaError_t e = cudaMemcpyAsync(static_cast<char*>(rx.recv) + rx.recv_offsets[src],
                                              static_cast<const char*>(sx.send) + sx.send_offsets[rank_],
                                              size_t(bytes), cudaMemcpyDeviceToDevice, stream);
        if (e != cudaSuccess) {
          note(cuda_message("cudaMemcpyAsync", e));
          break;
        }
      }
    }
    if (cudaError_t e = cudaEventRecord(g.done_[rank_], stream); e != cudaSuccess) note(cuda_message("cudaEventRecord", e));
    if (Status s = g.barrier(rank_, "all_to_all_v"); !s.ok()) return s;
    for (int d = 0; d < n; ++d)
      if (d != rank_)
        if (cudaError_t e = cudaStreamWaitEvent(stream, g.done_[d], 0); e != cudaSuccess)
          note(cuda_message("cudaStreamWaitEvent", e));
    if (!error.empty()) return Status::failure(error);
    return Status::success();
  }

 private:
  std::shared_ptr<VirtualGroup> group_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_virtual_ranks(int size, int device, double timeout_seconds) {
  check(size >= 1, "make_virtual_ranks: size must be >= 1, got ", size);
  check(timeout_seconds > 0, "make_virtual_ranks: timeout_seconds must be > 0, got ", timeout_seconds);
  std::string why;
  check(cuda_device_available(&why), "make_virtual_ranks: ", why);
  if (device < 0) check(cudaGetDevice(&device) == cudaSuccess, "make_virtual_ranks: cudaGetDevice failed");
  const ScopedDevice on(device, "make_virtual_ranks");  // the group's events on its GPU
  auto group = std::make_shared<VirtualGroup>(size, device, timeout_seconds);
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (int r = 0; r < size; ++r) ranks.push_back(std::make_unique<VirtualRank>(group, r));
  return ranks;
}

}  // namespace fp4moe
