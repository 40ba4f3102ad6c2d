// runner/nccl_communicator.cu — the Communicator over NCCL (fp4moe/expert_parallel.hpp), NCCL loaded
// at run time: dlopen("libnccl.so.2") finds the copy already in the process (torch's, when torch made
// the communicator) by its soname, else the system's; fp4moe itself does not link NCCL, so a machine
// without it runs everything else.
//
//   exchange_counts: host values -> device (the communicator's own stream), one group of ncclSend /
//                    ncclRecv of per_rank int64 per peer, back to the host, stream synchronised
//   all_to_all_v:    one group of ncclSend / ncclRecv (bytes) per exchange and peer on the caller's
//                    stream; NCCL orders them after the stream's earlier work, later work after them
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "fp4moe/expert_parallel.hpp"
#include "runner/device_buffer.hpp"
#include "runner/hopper_device.hpp"

namespace fp4moe {
namespace {

struct NcclApi {
  void* lib = nullptr;
  std::string why_not;
  ncclResult_t (*group_start)() = nullptr;
  ncclResult_t (*group_end)() = nullptr;
  ncclResult_t (*send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*count)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*user_rank)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*cu_device)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*init_all)(ncclComm_t*, int, const int*) = nullptr;
  ncclResult_t (*unique_id)(ncclUniqueId*) = nullptr;
  ncclResult_t (*init_rank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*destroy)(ncclComm_t) = nullptr;
  const char* (*error_string)(ncclResult_t) = nullptr;

  NcclApi() {
    lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      why_not = "NCCL (libnccl.so.2) not found: install NCCL or load it first (torch.distributed does)";
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && why_not.empty()) why_not = std::string("libnccl.so.2 has no ") + name;
    };
    sym(group_start, "ncclGroupStart");
    sym(group_end, "ncclGroupEnd");
    sym(send, "ncclSend");
    sym(recv, "ncclRecv");
    sym(count, "ncclCommCount");
    sym(user_rank, "ncclCommUserRank");
    sym(cu_device, "ncclCommCuDevice");
    sym(init_all, "ncclCommInitAll");
    sym(unique_id, "ncclGetUniqueId");
    sym(init_rank, "ncclCommInitRank");
    sym(destroy, "ncclCommDestroy");
    sym(error_string, "ncclGetErrorString");
  }
};

const NcclApi& nccl() {
  static const NcclApi api;  // NOTE: never dlclose'd: communicators may outlive any owner object
  return api;
}

const NcclApi& require_nccl(const char* who) {
  const NcclApi& api = nccl();
  check(api.why_not.empty(), who, ": ", api.why_not);
  return api;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, bool owned) : api_(require_nccl("make_nccl_communicator")), comm_(comm), owned_(owned) {
    check(comm != nullptr, "make_nccl_communicator: comm is null");
    check(api_.count(comm, &size_) == ncclSuccess && api_.user_rank(comm, &rank_) == ncclSuccess &&
              api_.cu_device(comm, &device_) == ncclSuccess,
          "make_nccl_communicator: the NCCL communicator does not answer its size, rank and device");
    const ScopedDevice on(device_, "make_nccl_communicator");  // the stream on the communicator's GPU
    throw_on_cuda_error(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "make_nccl_communicator",
                        "cudaStreamCreate");
  }
  ~NcclCommunicator() override {
    if (stream_) cudaStreamDestroy(stream_);
    if (owned_) api_.destroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status exchange_counts(const int64_t* send, int64_t* recv, int per_rank) override {
    const char* fn = "NCCL exchange_counts";
    if (per_rank < 1) return Status::failure(detail::concat(fn, ": per_rank must be >= 1, got ", per_rank));
    const size_t bytes = size_t(size_) * size_t(per_rank) * sizeof(int64_t);
    if (cudaSetDevice(device_) != cudaSuccess) return Status::failure(detail::concat(fn, ": cudaSetDevice failed"));
    if (!counts_ || counts_bytes_ < bytes) {  // grows once to the caller's size (the layer's is fixed)
      try {
        counts_ = std::make_unique<DeviceBuffer>(2 * bytes, "NCCL exchange_counts");
      } catch (const Error& e) {
        return Status::failure(e.what());
      }
      counts_bytes_ = bytes;
    }
    char* dsend = static_cast<char*>(counts_->ptr);
    char* drecv = dsend + bytes;
    const size_t row = size_t(per_rank) * sizeof(int64_t);
    if (cudaMemcpyAsync(dsend, send, bytes, cudaMemcpyHostToDevice, stream_) != cudaSuccess)
      return Status::failure(detail::concat(fn, ": copying the counts to the device failed"));
    if (Status s = group(fn, [&] {
          for (int peer = 0; peer < size_; ++peer) {
            if (ncclResult_t r = api_.send(dsend + peer * row, row, ncclChar, peer, comm_, stream_); r != ncclSuccess) return r;
            if (ncclResult_t r = api_.recv(drecv + peer * row, row, ncclChar, peer, comm_, stream_); r != ncclSuccess) return r;
          }
          return ncclSuccess;
        });
        !s.ok())
      return s;
    if (cudaMemcpyAsync(recv, drecv, bytes, cudaMemcpyDeviceToHost, stream_) != cudaSuccess ||
        cudaStreamSynchronize(stream_) != cudaSuccess)
      return Status::failure(detail::concat(fn, ": reading the counts back failed"));
    return Status::success();
  }

  Status all_to_all_v(CUstream_st* stream, const Exchange* exchanges, int count) override {
    const char* fn = "NCCL all_to_all_v";
    if (cudaSetDevice(device_) != cudaSuccess) return Status::failure(detail::concat(fn, ": cudaSetDevice failed"));
    return group(fn, [&] {
      for (int i = 0; i < count; ++i) {
        const Exchange& x = exchanges[i];
        for (int peer = 0; peer < size_; ++peer) {
          const int64_t out = x.send_end(peer) - x.send_offsets[peer];
          const int64_t in = x.recv_offsets[peer + 1] - x.recv_offsets[peer];
          if (out > 0)
            if (ncclResult_t r = api_.send(static_cast<const char*>(x.send) + x.send_offsets[peer], size_t(out), ncclChar,
                                           peer, comm_, stream);
                r != ncclSuccess)
              return r;
          if (in > 0)
            if (ncclResult_t r = api_.recv(static_cast<char*>(x.recv) + x.recv_offsets[peer], size_t(in), ncclChar, peer,
                                           comm_, stream);
                r != ncclSuccess)
              return r;
        }
      }
      return ncclSuccess;
    });
  }

 private:
  template <typename Body>
  Status group(const char* fn, Body body) {
    if (ncclResult_t r = api_.group_start(); r != ncclSuccess) return failure(fn, "ncclGroupStart", r);
    const ncclResult_t inner = body();
    const ncclResult_t end = api_.group_end();
    if (inner != ncclSuccess) return failure(fn, "ncclSend/ncclRecv", inner);
    if (end != ncclSuccess) return failure(fn, "ncclGroupEnd", end);
    return Status::success();
  }
  Status failure(const char* fn, const char* what, ncclResult_t r) const {
    return Status::failure(detail::concat(fn, ": ", what, " failed: ", api_.error_string(r)));
  }

  const NcclApi& api_;
  ncclComm_t comm_;
  bool owned_;
  int size_ = 0, rank_ = 0, device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceBuffer> counts_;
  size_t counts_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(ncclComm* comm) {
  return std::make_unique<NcclCommunicator>(comm, /*owned=*/false);
}

std::string nccl_unique_id() {
  const NcclApi& api = require_nccl("nccl_unique_id");
  ncclUniqueId id;
  if (ncclResult_t r = api.unique_id(&id); r != ncclSuccess)
    throw Error(detail::concat("nccl_unique_id: ncclGetUniqueId failed: ", api.error_string(r)));
  return std::string(id.internal, sizeof(id.internal));
}

std::unique_ptr<Communicator> make_nccl_communicator(const std::string& unique_id, int rank, int size, int device) {
  const NcclApi& api = require_nccl("make_nccl_communicator");
  ncclUniqueId id;
  check(unique_id.size() == sizeof(id.internal), "make_nccl_communicator: the unique id must be ", sizeof(id.internal),
        " bytes (nccl_unique_id), got ", unique_id.size());
  check(size >= 1 && rank >= 0 && rank < size, "make_nccl_communicator: rank ", rank, " is outside a group of ", size);
  int count = 0;
  check(cudaGetDeviceCount(&count) == cudaSuccess && device >= 0 && device < count, "make_nccl_communicator: device ",
        device, " is not one of this machine's ", count, " GPUs");
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  const ScopedDevice on(device, "make_nccl_communicator");  // ncclCommInitRank binds the current GPU
  ncclComm_t comm = nullptr;
  if (ncclResult_t r = api.init_rank(&comm, size, id, rank); r != ncclSuccess)
    throw Error(detail::concat("make_nccl_communicator: ncclCommInitRank (rank ", rank, " of ", size, ") failed: ",
                               api.error_string(r)));
  return std::make_unique<NcclCommunicator>(comm, /*owned=*/true);
}

std::vector<std::unique_ptr<Communicator>> make_nccl_ranks(const std::vector<int>& devices) {
  const NcclApi& api = require_nccl("make_nccl_ranks");
  check(!devices.empty(), "make_nccl_ranks: no devices given");
  std::vector<ncclComm_t> comms(devices.size());
  if (ncclResult_t r = api.init_all(comms.data(), int(devices.size()), devices.data()); r != ncclSuccess)
    throw Error(detail::concat("make_nccl_ranks: ncclCommInitAll failed: ", api.error_string(r)));
  std::vector<std::unique_ptr<Communicator>> out;
  for (ncclComm_t c : comms) out.push_back(std::make_unique<NcclCommunicator>(c, /*owned=*/true));
  return out;
}

}  // namespace fp4moe
