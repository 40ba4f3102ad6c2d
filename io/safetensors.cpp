// io/safetensors.cpp — safetensors reads (memory-mapped, strictly validated) and writes.
//
// File layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data region.
// The JSON object maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the data region) and may hold "__metadata__": {string: string}.
//
// Reading, in order (every failure throws fp4moe::Error naming the file and, where there is one, the
// tensor or key):
//   1. map the whole file read-only; it must hold at least the 8-byte length prefix;
//   2. the header length must fit in the file and stay under kMaxHeaderBytes;
//   3. the header bytes must be valid UTF-8 (no overlong forms, surrogates or code points > U+10FFFF);
//   4. the JSON must parse, be an object, and have no duplicate key in any object;
//   5. "__metadata__" must be an object of strings; every other entry must be an object with exactly
//      the fields dtype (a supported name), shape (non-negative integers) and data_offsets
//      (two integers, begin <= end <= data region size), and numel * dtype size == end - begin;
//   6. the non-empty byte ranges of the tensors must not overlap (gaps are allowed).
// Writing lays the tensors out back to back in the given order and pads the header with spaces so
// that the data region starts at a multiple of 8 bytes.
#include "fp4moe/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "fp4moe/error.hpp"

namespace fp4moe::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; fp4moe copies it as host bytes");

namespace {

// The reference implementation refuses headers above 100 MB; a real header is a few hundred KB.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

constexpr const char* kSupportedDtypes = "BF16, F32, F8_E4M3, U8, I32";

// Offset of the first byte that does not start a valid UTF-8 sequence, or npos.
size_t find_invalid_utf8(const unsigned char* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    const unsigned c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    uint32_t cp = 0, min_cp = 0;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min_cp = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min_cp = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min_cp = 0x10000;
    } else {
      return i;  // a continuation byte or 0xF8..0xFF where a sequence must start
    }
    if (n - i < len) return i;
    for (size_t j = 1; j < len; ++j) {
      const unsigned cc = s[i + j];
      if ((cc & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string::npos;
}

// numel * elem_size, or false on overflow.
bool byte_size(const std::vector<int64_t>& shape, size_t elem_size, uint64_t& bytes) {
  uint64_t n = elem_size;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  bytes = n;
  return true;
}

// Records the first duplicate key of any object while nlohmann parses (it would keep the last one).
class DuplicateKeyFinder {
 public:
  bool operator()(int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      keys_.emplace_back();
    } else if (event == E::object_end) {
      if (!keys_.empty()) keys_.pop_back();
    } else if (event == E::key && !keys_.empty() && parsed.is_string()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!keys_.back().insert(k).second && duplicate_.empty()) duplicate_ = k;
    }
    return true;
  }
  const std::string& duplicate() const { return duplicate_; }

 private:
  std::vector<std::set<std::string>> keys_;
  std::string duplicate_;
};

// A JSON integer as uint64 / int64, with a clear error otherwise.
template <typename Fail>
uint64_t json_to_u64(const nlohmann::json& v, const Fail& fail, const char* what) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if (x < 0) fail(what, " must be non-negative, got ", x);
    return static_cast<uint64_t>(x);
  }
  fail(what, " must be an integer, got ", v.dump());
  return 0;  // unreachable
}

}  // namespace

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

// ---- dtypes ---------------------------------------------------------------------------------------

std::string_view to_string(DType d) {
  switch (d) {
    case DType::BF16: return "BF16";
    case DType::F32: return "F32";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::U8: return "U8";
    case DType::I32: return "I32";
  }
  return "?";
}

size_t dtype_size(DType d) {
  switch (d) {
    case DType::BF16: return 2;
    case DType::F32: return 4;
    case DType::F8_E4M3: return 1;
    case DType::U8: return 1;
    case DType::I32: return 4;
  }
  throw Error(detail::concat("dtype_size: invalid DType value ", static_cast<int>(d)));
}

DType parse_dtype(std::string_view name) {
  if (name == "BF16") return DType::BF16;
  if (name == "F32") return DType::F32;
  if (name == "F8_E4M3") return DType::F8_E4M3;
  if (name == "U8") return DType::U8;
  if (name == "I32") return DType::I32;
  static const std::set<std::string_view> kKnownElsewhere = {
      "BOOL", "U16", "U32", "U64", "I8", "I16", "I64", "F16", "F64", "F8_E5M2", "F8_E8M0", "F4",
      "F6_E2M3", "F6_E3M2", "C64"};
  if (kKnownElsewhere.count(name))
    throw Error(detail::concat("unsupported dtype '", name, "' (fp4moe reads ", kSupportedDtypes, ")"));
  throw Error(detail::concat("unsupported dtype '", name, "': not a safetensors dtype name (fp4moe reads ",
                             kSupportedDtypes, ")"));
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- reading --------------------------------------------------------------------------------------

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  const std::string where = "safetensors file '" + path + "'";
  auto fail = [&](auto&&... parts) {
    throw Error(detail::concat(where, ": ", std::forward<decltype(parts)>(parts)...));
  };

  SafetensorsFile f;
  f.path_ = path;

  // 1. Map the file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail("cannot stat: ", std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("not a regular file");
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    fail("truncated: the file has ", file_size,
         " bytes, fewer than the 8-byte header length prefix");
  }
  void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (map == MAP_FAILED) fail("cannot mmap ", file_size, " bytes: ", std::strerror(map_errno));
  f.map_ = map;  // from here on the destructor of f unmaps on any error
  f.map_size_ = file_size;
  const auto* bytes = static_cast<const unsigned char*>(map);

  // 2. Header length.
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes, 8);  // little-endian host (static_assert above)
  if (header_len > file_size - 8)
    fail("truncated or corrupt: header length ", header_len, " goes beyond the end of the file (",
         file_size, " bytes, so at most ", file_size - 8, " header bytes)");
  if (header_len > kMaxHeaderBytes)
    fail("header length ", header_len, " is absurdly large (limit ", kMaxHeaderBytes, " bytes)");
  const uint64_t data_begin = 8 + header_len;
  const uint64_t data_size = file_size - data_begin;
  const auto* header = bytes + 8;

  // 3. UTF-8.
  if (const size_t bad = find_invalid_utf8(header, header_len); bad != std::string::npos) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", header[bad]);
    fail("header is not valid UTF-8: invalid byte ", hex, " at header offset ", bad);
  }

  // 4. JSON.
  nlohmann::json root;
  DuplicateKeyFinder dups;
  try {
    root = nlohmann::json::parse(header, header + header_len, std::ref(dups));
  } catch (const nlohmann::json::exception& e) {
    fail("malformed JSON header: ", e.what());
  }
  if (!dups.duplicate().empty()) fail("malformed JSON header: duplicate key '", dups.duplicate(), "'");
  if (!root.is_object()) fail("JSON header must be an object, got ", root.type_name());

  // 5. Entries.
  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail("__metadata__ must be an object of strings, got ", v.type_name());
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail("__metadata__ value of key '", m.key(), "' must be a string, got ", m.value().type_name(),
               " ", m.value().dump());
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto tfail = [&](auto&&... parts) {
      fail("tensor '", name, "': ", std::forward<decltype(parts)>(parts)...);
    };
    if (!v.is_object()) tfail("entry must be an object, got ", v.type_name());
    for (auto field = v.begin(); field != v.end(); ++field) {
      if (field.key() != "dtype" && field.key() != "shape" && field.key() != "data_offsets")
        tfail("unexpected field '", field.key(), "' (fields are dtype, shape, data_offsets)");
    }
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!v.contains(field)) tfail("missing field '", field, "'");

    const nlohmann::json& jd = v.at("dtype");
    if (!jd.is_string()) tfail("dtype must be a string, got ", jd.dump());
    DType dtype{};
    try {
      dtype = parse_dtype(jd.get_ref<const std::string&>());
    } catch (const Error& e) {
      tfail(e.what());
    }

    const nlohmann::json& js = v.at("shape");
    if (!js.is_array()) tfail("shape must be an array of integers, got ", js.dump());
    std::vector<int64_t> shape;
    for (const auto& d : js) {
      if (d.is_number_integer() && !d.is_number_unsigned() && d.get<int64_t>() < 0)
        tfail("shape ", js.dump(), " has a negative dimension");
      const uint64_t u = json_to_u64(d, tfail, "every shape dimension");
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        tfail("shape dimension ", u, " is too large");
      shape.push_back(static_cast<int64_t>(u));
    }

    const nlohmann::json& jo = v.at("data_offsets");
    if (!jo.is_array() || jo.size() != 2)
      tfail("data_offsets must be an array [begin, end], got ", jo.dump());
    const uint64_t begin = json_to_u64(jo[0], tfail, "data_offsets begin");
    const uint64_t end = json_to_u64(jo[1], tfail, "data_offsets end");
    if (begin > end) tfail("data_offsets [", begin, ", ", end, "] has begin > end");
    if (end > data_size)
      tfail("data_offsets [", begin, ", ", end, "] out of range: the data region has ", data_size,
            " bytes");

    uint64_t nbytes = 0;
    if (!byte_size(shape, dtype_size(dtype), nbytes))
      tfail("shape ", shape_string(shape), " overflows 64-bit byte counts");
    if (nbytes != end - begin)
      tfail("shape ", shape_string(shape), " of ", to_string(dtype), " needs ", nbytes,
            " bytes, but data_offsets [", begin, ", ", end, "] span ", end - begin, " bytes");

    TensorView view{dtype, std::move(shape),
                    std::span<const std::byte>(reinterpret_cast<const std::byte*>(bytes + data_begin + begin),
                                               static_cast<size_t>(nbytes))};
    auto [pos, inserted] = f.tensors_.emplace(name, std::move(view));
    (void)inserted;  // keys of a JSON object are unique (duplicates rejected above)
    if (nbytes > 0) ranges.push_back({begin, end, &pos->first});
  }

  // 6. Overlaps between non-empty tensors.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const Range& prev = ranges[i - 1];
    const Range& cur = ranges[i];
    if (cur.begin < prev.end)
      fail("tensors '", *prev.name, "' [", prev.begin, ", ", prev.end, ") and '", *cur.name, "' [",
           cur.begin, ", ", cur.end, ") overlap in the data region");
  }
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      map_(std::exchange(o.map_, nullptr)),
      map_size_(std::exchange(o.map_size_, 0)),
      tensors_(std::move(o.tensors_)),
      metadata_(std::move(o.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    if (map_) ::munmap(map_, map_size_);
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_size_ = std::exchange(o.map_size_, 0);
    tensors_ = std::move(o.tensors_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorView& SafetensorsFile::tensor(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end())
    throw Error(detail::concat("safetensors file '", path_, "': no tensor named '", name, "'"));
  return it->second;
}

// ---- writing --------------------------------------------------------------------------------------

void write_safetensors(const std::string& path, const std::vector<TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string where = "write_safetensors('" + path + "')";
  auto fail = [&](auto&&... parts) {
    throw Error(detail::concat(where, ": ", std::forward<decltype(parts)>(parts)...));
  };
  auto utf8_ok = [](const std::string& s) {
    return find_invalid_utf8(reinterpret_cast<const unsigned char*>(s.data()), s.size()) ==
           std::string::npos;
  };

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) {
      if (!utf8_ok(k) || !utf8_ok(v)) fail("metadata key '", k, "' or its value is not valid UTF-8");
      meta[k] = v;
    }
    header["__metadata__"] = std::move(meta);
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorData& t : tensors) {
    if (t.name.empty()) fail("a tensor has an empty name");
    if (t.name == "__metadata__") fail("'__metadata__' is reserved and cannot name a tensor");
    if (!utf8_ok(t.name)) fail("tensor name is not valid UTF-8");
    if (!names.insert(t.name).second) fail("duplicate tensor name '", t.name, "'");
    uint64_t nbytes = 0;
    if (!byte_size(t.shape, dtype_size(t.dtype), nbytes))
      fail("tensor '", t.name, "': invalid shape ", shape_string(t.shape));
    if (nbytes != t.bytes.size())
      fail("tensor '", t.name, "': shape ", shape_string(t.shape), " of ", to_string(t.dtype), " needs ",
           nbytes, " bytes, got ", t.bytes.size());
    header[t.name] = {{"dtype", std::string(to_string(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data region starts 8-byte aligned
  const uint64_t header_len = text.size();

  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (!out) fail("cannot create the file: ", std::strerror(errno));
  bool ok = std::fwrite(&header_len, 8, 1, out) == 1 &&
            std::fwrite(text.data(), 1, text.size(), out) == text.size();
  for (const TensorData& t : tensors) {
    if (!ok) break;
    if (!t.bytes.empty()) ok = std::fwrite(t.bytes.data(), 1, t.bytes.size(), out) == t.bytes.size();
  }
  const int write_errno = errno;
  if (std::fclose(out) != 0 && ok) fail("cannot finish writing: ", std::strerror(errno));
  if (!ok) fail("cannot write: ", std::strerror(write_errno));
}

}  // namespace fp4moe::io
