// python/dlpack_tensors.hpp — caller tensors through DLPack: the dtype, shape, layout and device checks
// of the extension's entry points (messages name the entry point, the tensor, the expected and the
// actual value), and host arrays handed out to Python (owned by a capsule; DLPack and the buffer
// protocol). Part of the extension fp4moe._fp4moe (python/module.cpp).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fp4moe/error.hpp"

namespace fp4moe::python {

namespace nb = nanobind;


using Code = nb::dlpack::dtype_code;
using Array = nb::ndarray<>;          // any dtype, device and layout: checked by TensorCheck
using InArray = nb::ndarray<nb::ro>;  // the same, read-only accepted (inputs)

// NOTE: DLPack device types (dlpack.h): kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3 (pinned host memory).
constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3;

// ---- tensor checks ---------------------------------------------------------------------------------
// F32OrBF16: logits, outputs; UE8M0: MXFP4 block scales (codes c, the scale 2^(c - 127))
enum class Elem { BF16, F32, I32, Packed, E4M3, UE8M0, Bytes, F32OrBF16 };

inline bool is(nb::dlpack::dtype d, Code code, int bits) { return d.code == uint8_t(code) && d.bits == bits && d.lanes == 1; }

inline bool matches(nb::dlpack::dtype d, Elem e) {
  switch (e) {
    case Elem::BF16: return is(d, Code::Bfloat, 16) || is(d, Code::Int, 16) || is(d, Code::UInt, 16);
    case Elem::F32: return is(d, Code::Float, 32);
    case Elem::I32: return is(d, Code::Int, 32);
    case Elem::Packed: return is(d, Code::UInt, 8) || is(d, Code::Int, 8);
    case Elem::E4M3: return is(d, Code::Float8_E4M3FN, 8) || is(d, Code::UInt, 8);
    case Elem::UE8M0: return is(d, Code::UInt, 8);
    case Elem::Bytes: return is(d, Code::UInt, 8) || is(d, Code::Int, 8);
    case Elem::F32OrBF16: return matches(d, Elem::F32) || matches(d, Elem::BF16);
  }
  return false;
}

inline const char* expected_dtype(Elem e) {
  switch (e) {
    case Elem::BF16: return "bfloat16 (or its bits as int16 / uint16)";
    case Elem::F32: return "float32";
    case Elem::I32: return "int32";
    case Elem::Packed: return "uint8 (two e2m1 codes per byte)";
    case Elem::E4M3: return "float8_e4m3fn (or its bits as uint8)";
    case Elem::UE8M0: return "uint8 (ue8m0 codes c, the scale 2^(c - 127); float8_e8m0fnu as its bits)";
    case Elem::Bytes: return "uint8 or int8";
    case Elem::F32OrBF16: return "float32 or bfloat16 (or its bits as int16 / uint16)";
  }
  return "?";
}

inline std::string dtype_name(nb::dlpack::dtype d) {
  std::string s;
  switch (Code(d.code)) {
    case Code::Int: s = "int"; break;
    case Code::UInt: s = "uint"; break;
    case Code::Float: s = "float"; break;
    case Code::Bfloat: s = "bfloat"; break;
    case Code::Bool: return "bool";
    case Code::Float8_E4M3FN: return "float8_e4m3fn";
    case Code::Float8_E5M2: return "float8_e5m2";
    default: return detail::concat("dtype(code=", int(d.code), ", bits=", int(d.bits), ")");
  }
  s += std::to_string(d.bits);
  if (d.lanes != 1) s += "x" + std::to_string(d.lanes);
  return s;
}

template <typename A>
std::string shape_of(const A& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

inline std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + (shape[i] < 0 ? "?" : std::to_string(shape[i]));
  return s + "]";
}

inline std::string device_name(int type, int id) {
  switch (type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(id);
    case kDLCUDAHost: return "cuda pinned host memory";
    default: return "DLPack device type " + std::to_string(type);
  }
}

// A caller's argument as an array (DLPack or the buffer protocol), or fp4moe.Error naming it: the
// entry points take Python objects, so that a wrong argument is an fp4moe.Error, never a TypeError of
// the binding. `A` is InArray (read-only accepted: inputs) or Array (writable: outputs).
template <typename A>
A as_array(const std::string& where, const char* name, const nb::handle& obj) {
  A a;
  if (nb::try_cast(obj, a, false)) return a;
  if constexpr (!std::is_same_v<A, InArray>) {
    InArray ro;
    if (nb::try_cast(obj, ro, false))
      throw Error(detail::concat(where, ": ", name, ": expected a writable tensor, got a read-only one"));
  }
  throw Error(detail::concat(where, ": ", name, ": expected a tensor (DLPack or the buffer protocol), got ",
                             nb::cast<std::string>(nb::str(obj.type()))));
}
template <typename A>
std::optional<A> as_optional_array(const std::string& where, const char* name, const nb::handle& obj) {
  if (obj.is_none()) return std::nullopt;
  return as_array<A>(where, name, obj);
}

// Checks a caller tensor against what an entry point expects, in the order that keeps every later check
// meaningful: the device first (a pointer is only read where it lives), then the dtype, the rank and
// shape (-1: any extent), the layout (row-major, dense) and the address's alignment. The messages name
// the entry point, the tensor, the expected and the actual value (docs/architecture.md, "Interfaces").
// A pointer is returned only once every check has passed.
struct TensorCheck {
  std::string where;   // e.g. "Layer.forward"
  bool on_cuda = false;
  int device = 0;      // the CUDA device when on_cuda

  template <typename A>
  void* operator()(const A& a, const char* name, Elem elem, const std::vector<int64_t>& shape,
                   const char* symbolic, size_t align = 0) const {
    auto fail = [&](auto&&... parts) { throw Error(detail::concat(where, ": ", name, ": ", parts...)); };
    check_device(a, name);
    if (!matches(a.dtype(), elem)) fail("expected dtype ", expected_dtype(elem), ", got ", dtype_name(a.dtype()));
    bool same = a.ndim() == shape.size();
    for (size_t i = 0; same && i < shape.size(); ++i) same = shape[i] < 0 || int64_t(a.shape(i)) == shape[i];
    if (!same) {  // a free extent reads as the tensor's own where the rank matches
      std::vector<int64_t> expected = shape;
      for (size_t i = 0; i < expected.size() && i < a.ndim(); ++i)
        if (expected[i] < 0) expected[i] = int64_t(a.shape(i));
      fail("expected shape ", symbolic, " = ", shape_text(expected), ", got ", shape_of(a));
    }
    check_layout(a, name);
    if (align == 0) align = size_t(a.dtype().bits / 8);
    const auto address = reinterpret_cast<uintptr_t>(a.data());
    if (a.size() != 0 && align > 1 && address % align != 0)
      fail("expected a ", align, "-byte aligned address, got ", reinterpret_cast<const void*>(address),
           " (a view at an odd offset: make it contiguous first)");
    return const_cast<void*>(static_cast<const void*>(a.data()));
  }

  template <typename A>
  void check_device(const A& a, const char* name) const {
    const int type = a.device_type(), id = a.device_id();
    const bool ok = on_cuda ? (type == kDLCUDA && id == device) : (type == kDLCPU || type == kDLCUDAHost);
    if (!ok)
      throw Error(detail::concat(where, ": ", name, ": expected a tensor on ",
                                 on_cuda ? device_name(kDLCUDA, device) : std::string("the cpu"),
                                 " (the layer's device), got ", device_name(type, id)));
  }

  // Row-major and dense (dimensions of extent 1, and empty tensors, may have any strides).
  template <typename A>
  void check_layout(const A& a, const char* name) const {
    if (a.size() == 0) return;
    int64_t expected = 1;
    for (size_t i = a.ndim(); i-- > 0;) {
      if (a.shape(i) != 1 && a.stride(i) != expected)
        throw Error(detail::concat(where, ": ", name, ": expected a contiguous row-major tensor, got strides ",
                                   strides_of(a), " (in elements) for shape ", shape_of(a),
                                   "; make it contiguous first"));
      expected *= int64_t(a.shape(i));
    }
  }

  template <typename A>
  static std::string strides_of(const A& a) {
    std::string s = "[";
    for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.stride(i));
    return s + "]";
  }
};

// The memory of a call's checked tensors: what a call writes (outputs, workspace) must not overlap
// what it reads or another output (the GPU stages read inputs after earlier stages wrote; the CPU layer
// follows the same rule). Empty tensors take no memory.
class Overlaps {
 public:
  template <typename A>
  void add(const A& a, const char* name, bool written) {
    if (a.size() == 0) return;
    const auto begin = reinterpret_cast<uintptr_t>(a.data());
    spans_.push_back({name, begin, begin + a.nbytes(), written});
  }
  void check(const std::string& where) const {
    for (size_t i = 0; i < spans_.size(); ++i)
      for (size_t j = 0; j < i; ++j) {
        const Span &a = spans_[i], &b = spans_[j];
        if ((a.written || b.written) && a.begin < b.end && b.begin < a.end)
          throw Error(detail::concat(where, ": ", a.written ? a.name : b.name, " overlaps ", a.written ? b.name : a.name,
                                     "; outputs and the workspace need memory of their own"));
      }
  }

 private:
  struct Span { const char* name; uintptr_t begin, end; bool written; };
  std::vector<Span> spans_;
};

// ---- host arrays out: owned by a capsule, exported through DLPack and the buffer protocol ---------
using HostArray = nb::ndarray<nb::array_api>;  // Python: an object with __dlpack__ and the buffer protocol

template <typename T>
HostArray to_array(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return HostArray(owned->data(), shape, owner, {}, nb::dtype<T>(), kDLCPU);
}

}  // namespace fp4moe::python
