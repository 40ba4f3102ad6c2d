// fp4moe/safetensors.hpp — safetensors files: memory-mapped, strictly validated reads; writes.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace fp4moe::io {

enum class DType { BF16, F32, F8_E4M3, U8, I32 };
std::string_view to_string(DType d);             // checkpoint names: "BF16", "F32", "F8_E4M3", ...
size_t dtype_size(DType d);
DType parse_dtype(std::string_view name);        // throws fp4moe::Error on an unknown name
std::string shape_string(const std::vector<int64_t>& shape);  // "[d0, d1, ...]", as error messages print it

struct TensorView {
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;  // exactly numel * dtype_size bytes
  int64_t numel() const;
};

// A safetensors file opened read-only and memory-mapped. The header is validated completely on
// open: length within the file, UTF-8 JSON, known dtypes, shapes matching byte sizes, offsets in
// range and not overlapping. Every failure throws fp4moe::Error naming the file (and tensor).
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws fp4moe::Error naming the file and tensor when absent.
  const TensorView& tensor(const std::string& name) const;
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: the bytes are copied as given (little-endian host layout).
struct TensorData {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

template <typename T>
TensorData make_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                       const std::vector<T>& values);

// Writes tensors (in the given order, 8-byte aligned header) and string metadata.
void write_safetensors(const std::string& path, const std::vector<TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata);

template <typename T>
TensorData make_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                       const std::vector<T>& values) {
  TensorData t{std::move(name), dtype, std::move(shape), {}};
  t.bytes.resize(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

}  // namespace fp4moe::io
