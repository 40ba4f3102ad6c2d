// fuzz/safetensors_fuzz.cpp — libFuzzer target for the safetensors reader (header parser and checks).
//
// Each input is a whole file:
//   1. write the bytes to one scratch file (tmpfs when available) and SafetensorsFile::open it, so the
//      real entry point runs: size checks, mmap, length prefix, UTF-8, JSON, entries, overlaps;
//   2. fp4moe::Error is the expected outcome for bad input; its message must name the file;
//   3. when the file opens, check every tensor against an independent reading of the header: its bytes
//      are exactly the input's bytes at 8 + header length + begin, of numel * dtype size bytes;
//   4. and round-trip it: write_safetensors the tensors and metadata, reopen, compare.
// Anything else (a crash, another exception type, a sanitizer report, a failed check) is a finding:
// the target aborts with a message.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fp4moe/error.hpp"
#include "fp4moe/safetensors.hpp"

namespace {

using fp4moe::io::SafetensorsFile;

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "safetensors_fuzz: FINDING: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// A scratch folder on tmpfs when there is one (the target writes a file per input).
std::string scratch_dir() {
  if (const char* d = std::getenv("FP4MOE_FUZZ_TMPDIR"); d && *d) return d;
  if (::access("/dev/shm", W_OK) == 0) return "/dev/shm";
  if (const char* d = std::getenv("TMPDIR"); d && *d) return d;
  return "/tmp";
}

struct Scratch {
  std::string input, copy;
  Scratch() {
    const std::string base = scratch_dir() + "/fp4moe_fuzz_st_" + std::to_string(::getpid());
    input = base + ".safetensors";
    copy = base + ".copy.safetensors";
  }
  ~Scratch() {
    ::unlink(input.c_str());
    ::unlink(copy.c_str());
  }
};

const Scratch& scratch() {
  static const Scratch s;
  return s;
}

void write_file(const std::string& path, const uint8_t* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) finding("cannot create the scratch file " + path + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) finding("cannot write the scratch file " + path + ": " + std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

// Step 3: the views agree with an independent reading of the (already validated) header.
void check_views(const SafetensorsFile& f, const uint8_t* data, size_t size) {
  uint64_t header_len = 0;
  std::memcpy(&header_len, data, 8);
  const nlohmann::json root = nlohmann::json::parse(data + 8, data + 8 + header_len);
  const uint8_t* region = data + 8 + header_len;
  const size_t region_size = size - 8 - header_len;
  size_t entries = 0;
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (f.metadata().size() != it.value().size()) finding("metadata entry count differs");
      continue;
    }
    ++entries;
    if (!f.contains(it.key())) finding("tensor '" + it.key() + "' of the header is missing");
    const auto& v = f.tensor(it.key());
    const uint64_t begin = it.value().at("data_offsets")[0].get<uint64_t>();
    const uint64_t end = it.value().at("data_offsets")[1].get<uint64_t>();
    if (v.numel() < 0 || static_cast<uint64_t>(v.numel()) * fp4moe::io::dtype_size(v.dtype) != v.data.size())
      finding("tensor '" + it.key() + "': view size is not numel * dtype size");
    if (begin > end || end > region_size || v.data.size() != end - begin)
      finding("tensor '" + it.key() + "': view does not match data_offsets");
    if (!v.data.empty() && std::memcmp(v.data.data(), region + begin, v.data.size()) != 0)
      finding("tensor '" + it.key() + "': view bytes differ from the file bytes at data_offsets");
  }
  if (entries != f.tensors().size()) finding("tensor count differs from the header");
}

// Step 4: write what was read, read it back, compare.
void round_trip(const SafetensorsFile& f) {
  std::vector<fp4moe::io::TensorData> tensors;
  for (const auto& [name, v] : f.tensors()) {
    // NOTE: the reader accepts an empty tensor name (a valid JSON key), the writer refuses one.
    if (name.empty()) return;
    fp4moe::io::TensorData t{name, v.dtype, v.shape, {}};
    t.bytes.assign(v.data.begin(), v.data.end());
    tensors.push_back(std::move(t));
  }
  const std::string& path = scratch().copy;
  try {
    fp4moe::io::write_safetensors(path, tensors, f.metadata());
  } catch (const fp4moe::Error& e) {
    finding(std::string("write_safetensors refused what open accepted: ") + e.what());
  }
  SafetensorsFile g = [&] {
    try {
      return SafetensorsFile::open(path);
    } catch (const fp4moe::Error& e) {
      finding(std::string("reopening the written copy failed: ") + e.what());
    }
  }();
  if (g.metadata() != f.metadata()) finding("round trip changed the metadata");
  if (g.tensors().size() != f.tensors().size()) finding("round trip changed the tensor count");
  for (const auto& [name, v] : f.tensors()) {
    const auto& w = g.tensor(name);
    if (w.dtype != v.dtype || w.shape != v.shape || w.data.size() != v.data.size() ||
        (!v.data.empty() && std::memcmp(w.data.data(), v.data.data(), v.data.size()) != 0))
      finding("round trip changed tensor '" + name + "'");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = scratch().input;
  write_file(path, data, size);
  try {
    const SafetensorsFile f = SafetensorsFile::open(path);
    check_views(f, data, size);
    round_trip(f);
  } catch (const fp4moe::Error& e) {
    if (std::string(e.what()).find(path) == std::string::npos)
      finding(std::string("fp4moe::Error does not name the file: ") + e.what());
  } catch (const std::exception& e) {
    finding(std::string("unexpected exception (not fp4moe::Error): ") + e.what());
  } catch (...) {
    finding("unexpected non-std exception");
  }
  return 0;
}
