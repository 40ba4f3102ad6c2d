// tests/io/safetensors_test.cpp — safetensors write/read round trips and every header error, with the
// bad files crafted byte by byte.
#include "fp4moe/safetensors.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "test_dir.hpp"

namespace fp4moe::io {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string tmp_path(const std::string& suffix = "") { return test::test_file_path("io", suffix + ".safetensors"); }

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good());
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

// A file with the given header text (its true length) and `data_bytes` zero bytes of data.
std::string craft(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\0');
}

// Opens a crafted file and returns the error message (empty when it opened).
std::string open_error(const std::string& path) {
  try {
    SafetensorsFile::open(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string crafted_error(const std::string& header, size_t data_bytes) {
  const std::string path = tmp_path();
  write_bytes(path, craft(header, data_bytes));
  return open_error(path);
}

template <typename T>
std::vector<std::byte> as_bytes(const std::vector<T>& v) {
  std::vector<std::byte> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<std::byte> span_bytes(std::span<const std::byte> s) { return {s.begin(), s.end()}; }

// ---- dtypes ---------------------------------------------------------------------------------------

TEST(SafetensorsDtype, NamesSizesAndParsing) {
  const std::vector<std::pair<DType, size_t>> all = {
      {DType::BF16, 2}, {DType::F32, 4}, {DType::F8_E4M3, 1}, {DType::U8, 1}, {DType::I32, 4}};
  for (auto [d, size] : all) {
    EXPECT_EQ(parse_dtype(to_string(d)), d);
    EXPECT_EQ(dtype_size(d), size) << to_string(d);
  }
  EXPECT_EQ(to_string(DType::F8_E4M3), "F8_E4M3");
  EXPECT_EQ(to_string(DType::BF16), "BF16");
  for (const char* other : {"F16", "F64", "I64", "BOOL", "F8_E5M2", "bf16", "", "FLOAT"}) {
    try {
      parse_dtype(other);
      ADD_FAILURE() << "parse_dtype accepted '" << other << "'";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), AllOf(HasSubstr("unsupported dtype '" + std::string(other) + "'"),
                                  HasSubstr("BF16, F32, F8_E4M3, U8, I32")));
    }
  }
}

// ---- round trip -----------------------------------------------------------------------------------

TEST(SafetensorsRoundTrip, EveryDtypeWithMetadata) {
  const std::string path = tmp_path();
  const std::vector<uint16_t> bf16 = {0x3F80, 0xBF80, 0x0000, 0x8000, 0x7F80, 0x4049};
  const std::vector<float> f32 = {1.5f, -2.25f, 3.0e-39f, 1e30f};
  const std::vector<uint8_t> f8 = {0x00, 0x7E, 0xFE, 0x38, 0x01, 0x80, 0x08, 0x40};
  const std::vector<uint8_t> u8 = {0, 1, 127, 128, 255};
  const std::vector<int32_t> i32 = {-2147483647 - 1, 0, 2147483647};
  const std::vector<float> scalar = {42.0f};
  const std::vector<int32_t> empty;
  std::vector<TensorData> ts = {
      make_tensor("bf16", DType::BF16, {2, 3}, bf16),
      make_tensor("f32", DType::F32, {4}, f32),
      make_tensor("f8", DType::F8_E4M3, {2, 2, 2}, f8),
      make_tensor("u8", DType::U8, {5}, u8),
      make_tensor("i32", DType::I32, {3, 1}, i32),
      make_tensor("scalar", DType::F32, {}, scalar),
      make_tensor("empty", DType::I32, {0, 4}, empty),
  };
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"top_k", "8"}, {"unicode \xC3\xA9", "\xE2\x9C\x93 \"quoted\" \\"}, {"empty", ""}};
  write_safetensors(path, ts, meta);

  // Layout: 8-byte length, header padded with spaces to a multiple of 8, data back to back in order.
  const std::string raw = read_all(path);
  ASSERT_GE(raw.size(), 8u);
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  size_t data_bytes = 0;
  for (const auto& t : ts) data_bytes += t.bytes.size();
  EXPECT_EQ(raw.size(), 8 + n + data_bytes);
  EXPECT_EQ(raw[8], '{');
  const size_t close = raw.find_last_of('}', 8 + n - 1);
  for (size_t i = close + 1; i < 8 + n; ++i) EXPECT_EQ(raw[i], ' ') << "padding byte " << i;

  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.metadata(), meta);
  ASSERT_EQ(f.tensors().size(), ts.size());
  for (const auto& t : ts) {
    ASSERT_TRUE(f.contains(t.name)) << t.name;
    const TensorView& v = f.tensor(t.name);
    EXPECT_EQ(v.dtype, t.dtype) << t.name;
    EXPECT_EQ(v.shape, t.shape) << t.name;
    EXPECT_EQ(static_cast<size_t>(v.numel()) * dtype_size(v.dtype), v.data.size()) << t.name;
    EXPECT_EQ(span_bytes(v.data), t.bytes) << t.name;
  }
  EXPECT_EQ(f.tensor("scalar").numel(), 1);
  EXPECT_EQ(f.tensor("empty").numel(), 0);
}

TEST(SafetensorsRoundTrip, NoMetadataAndNoTensors) {
  const std::string path = tmp_path();
  write_safetensors(path, {}, {});
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_TRUE(f.metadata().empty());
}

TEST(SafetensorsRoundTrip, MovedFileKeepsItsViews) {
  const std::string path = tmp_path();
  const std::vector<float> vals = {1.0f, 2.0f, 3.0f};
  write_safetensors(path, {make_tensor("x", DType::F32, {3}, vals)}, {});
  SafetensorsFile a = SafetensorsFile::open(path);
  const std::byte* p = a.tensor("x").data.data();
  SafetensorsFile b(std::move(a));
  EXPECT_EQ(b.tensor("x").data.data(), p);
  SafetensorsFile c = SafetensorsFile::open(path);
  c = std::move(b);
  EXPECT_EQ(span_bytes(c.tensor("x").data), as_bytes(vals));
}

TEST(SafetensorsRoundTrip, ReadsFilesWithUnpaddedHeadersAndGaps) {
  // Other writers need not pad; a gap between tensors is harmless.
  const std::string header =
      R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})";
  const std::string bytes = le64(header.size()) + header + std::string("\x01\x02\x03\x00\x04\x05", 6);
  const std::string path = tmp_path();
  write_bytes(path, bytes);
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(span_bytes(f.tensor("a").data), as_bytes(std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(span_bytes(f.tensor("b").data), as_bytes(std::vector<uint8_t>{4, 5}));
}

// ---- errors: file level -----------------------------------------------------------------------------

TEST(SafetensorsErrors, MissingFile) {
  const std::string path = tmp_path();
  std::filesystem::remove(path);
  EXPECT_THAT(open_error(path), AllOf(HasSubstr(path), HasSubstr("cannot open")));
}

TEST(SafetensorsErrors, FileShorterThanTheLengthPrefix) {
  const std::string path = tmp_path();
  for (size_t size : {0, 1, 7}) {
    write_bytes(path, std::string(size, '\x01'));
    EXPECT_THAT(open_error(path), AllOf(HasSubstr(path), HasSubstr("truncated"),
                                        HasSubstr("has " + std::to_string(size) + " bytes")));
  }
}

TEST(SafetensorsErrors, HeaderLengthBeyondTheFile) {
  const std::string path = tmp_path();
  const std::string header = R"({"__metadata__":{}})";
  write_bytes(path, le64(1000) + header);  // claims 1000 header bytes, has 19
  EXPECT_THAT(open_error(path), AllOf(HasSubstr(path), HasSubstr("header length 1000 goes beyond the end")));
  write_bytes(path, le64(~0ull) + header);
  EXPECT_THAT(open_error(path), HasSubstr("header length 18446744073709551615 goes beyond the end"));
  // A valid file cut short inside its header.
  const std::string full = craft(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 4);
  write_bytes(path, full.substr(0, 20));
  EXPECT_THAT(open_error(path), HasSubstr("goes beyond the end"));
}

TEST(SafetensorsErrors, AbsurdHeaderLength) {
  // A sparse file large enough to hold the claimed header, which is over the 100 MB limit.
  const std::string path = tmp_path();
  const uint64_t claimed = 100'000'001;
  write_bytes(path, le64(claimed));
  std::filesystem::resize_file(path, 8 + claimed + 8);
  EXPECT_THAT(open_error(path), AllOf(HasSubstr(path), HasSubstr("absurdly large")));
  std::filesystem::remove(path);
}

TEST(SafetensorsErrors, TruncatedDataRegion) {
  // The header is intact but the data stops early: the offsets no longer fit.
  const std::string path = tmp_path();
  const std::string full = craft(R"({"weights":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 16);
  write_bytes(path, full.substr(0, full.size() - 5));
  EXPECT_THAT(open_error(path),
              AllOf(HasSubstr("tensor 'weights'"), HasSubstr("out of range"), HasSubstr("has 11 bytes")));
}

// ---- errors: header encoding and JSON ----------------------------------------------------------------

TEST(SafetensorsErrors, NonUtf8Header) {
  const std::vector<std::string> bad = {
      "\xFF",              // never valid
      "\xC0\xAF",          // overlong '/'
      "\xE0\x80\xAF",      // overlong
      "\xED\xA0\x80",      // UTF-16 surrogate
      "\xF4\x90\x80\x80",  // above U+10FFFF
      "\xC3",              // cut short
      "\x80",              // lone continuation byte
  };
  for (const auto& b : bad) {
    const std::string msg = crafted_error(R"({"__metadata__":{"k":")" + b + R"("}})", 0);
    EXPECT_THAT(msg, AllOf(HasSubstr("not valid UTF-8"), HasSubstr("header offset 22"))) << msg;
  }
  // Valid multi-byte text is accepted.
  EXPECT_EQ(crafted_error("{\"__metadata__\":{\"k\":\"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\"}}", 0), "");
}

TEST(SafetensorsErrors, MalformedJson) {
  for (const std::string h : {R"({"a": )", R"({"a":{"dtype":"U8",}})", "", "   ", R"({"a" 1})", "{}}"}) {
    EXPECT_THAT(crafted_error(h, 0), HasSubstr("malformed JSON header")) << "header: " << h;
  }
}

TEST(SafetensorsErrors, JsonNotAnObject) {
  EXPECT_THAT(crafted_error("[1, 2]", 0), HasSubstr("JSON header must be an object, got array"));
  EXPECT_THAT(crafted_error("\"x\"", 0), HasSubstr("JSON header must be an object, got string"));
}

TEST(SafetensorsErrors, DuplicateKeys) {
  EXPECT_THAT(crafted_error(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                            R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                            2),
              AllOf(HasSubstr("duplicate key 'a'")));
  EXPECT_THAT(crafted_error(R"({"a":{"dtype":"U8","dtype":"I32","shape":[1],"data_offsets":[0,1]}})", 1),
              HasSubstr("duplicate key 'dtype'"));
}

// ---- errors: metadata -----------------------------------------------------------------------------

TEST(SafetensorsErrors, MetadataValuesMustBeStrings) {
  EXPECT_THAT(crafted_error(R"({"__metadata__":{"top_k":8}})", 0),
              AllOf(HasSubstr("__metadata__ value of key 'top_k' must be a string"), HasSubstr("number")));
  EXPECT_THAT(crafted_error(R"({"__metadata__":{"ok":"1","bad":null}})", 0),
              HasSubstr("key 'bad' must be a string, got null"));
  EXPECT_THAT(crafted_error(R"({"__metadata__":["a"]})", 0),
              HasSubstr("__metadata__ must be an object of strings, got array"));
}

// ---- errors: tensor entries -----------------------------------------------------------------------

TEST(SafetensorsErrors, UnknownDtype) {
  std::string msg = crafted_error(R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", 4);
  EXPECT_THAT(msg, AllOf(HasSubstr("tensor 'w'"), HasSubstr("unsupported dtype 'F16'")));
  msg = crafted_error(R"({"w":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,4]}})", 4);
  EXPECT_THAT(msg, AllOf(HasSubstr("tensor 'w'"), HasSubstr("unsupported dtype 'Q4_K'")));
  msg = crafted_error(R"({"w":{"dtype":7,"shape":[2],"data_offsets":[0,4]}})", 4);
  EXPECT_THAT(msg, AllOf(HasSubstr("tensor 'w'"), HasSubstr("dtype must be a string")));
}

TEST(SafetensorsErrors, MissingOrInvalidFields) {
  struct Case {
    std::string header, expect;
  };
  const std::vector<Case> cases = {
      {R"({"w":{"shape":[2],"data_offsets":[0,2]}})", "missing field 'dtype'"},
      {R"({"w":{"dtype":"U8","data_offsets":[0,2]}})", "missing field 'shape'"},
      {R"({"w":{"dtype":"U8","shape":[2]}})", "missing field 'data_offsets'"},
      {R"({"w":[1,2]})", "entry must be an object, got array"},
      {R"({"w":{"dtype":"U8","shape":2,"data_offsets":[0,2]}})", "shape must be an array"},
      {R"({"w":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}})", "every shape dimension must be an integer"},
      {R"({"w":{"dtype":"U8","shape":["2"],"data_offsets":[0,2]}})", "every shape dimension must be an integer"},
      {R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0]}})", "data_offsets must be an array [begin, end]"},
      {R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2,4]}})", "data_offsets must be an array [begin, end]"},
      {R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,"2"]}})", "data_offsets end must be an integer"},
      {R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[-1,1]}})", "data_offsets begin must be non-negative"},
      {R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[2,0]}})", "has begin > end"},
      {R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"extra":1}})", "unexpected field 'extra'"},
      {R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,2]}})", "overflows"},
  };
  for (const auto& c : cases) {
    EXPECT_THAT(crafted_error(c.header, 8), AllOf(HasSubstr("tensor 'w'"), HasSubstr(c.expect))) << c.header;
  }
}

TEST(SafetensorsErrors, NegativeDimension) {
  EXPECT_THAT(crafted_error(R"({"w13":{"dtype":"U8","shape":[-2,2],"data_offsets":[0,4]}})", 4),
              AllOf(HasSubstr("tensor 'w13'"), HasSubstr("negative dimension")));
}

TEST(SafetensorsErrors, ShapeSizeMismatch) {
  EXPECT_THAT(crafted_error(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 24),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("shape [2, 3] of F32 needs 24 bytes"),
                    HasSubstr("span 20 bytes")));
  EXPECT_THAT(crafted_error(R"({"ids":{"dtype":"I32","shape":[],"data_offsets":[0,0]}})", 4),
              AllOf(HasSubstr("tensor 'ids'"), HasSubstr("needs 4 bytes")));
}

TEST(SafetensorsErrors, OffsetsOutOfTheDataRegion) {
  EXPECT_THAT(crafted_error(R"({"w":{"dtype":"U8","shape":[24],"data_offsets":[0,24]}})", 16),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("data_offsets [0, 24] out of range"),
                    HasSubstr("data region has 16 bytes")));
  EXPECT_THAT(crafted_error(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[17,17]}})", 16),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("out of range")));
  EXPECT_THAT(crafted_error(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551615]}})", 16),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("out of range")));
}

TEST(SafetensorsErrors, OverlappingTensors) {
  EXPECT_THAT(crafted_error(R"({"first":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                            R"("second":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                            16),
              AllOf(HasSubstr("'first' [0, 8)"), HasSubstr("'second' [4, 12)"), HasSubstr("overlap")));
  // One tensor inside another, listed first.
  EXPECT_THAT(crafted_error(R"({"inner":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},)"
                            R"("outer":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
                            16),
              AllOf(HasSubstr("'outer'"), HasSubstr("'inner'"), HasSubstr("overlap")));
  // Same range twice.
  EXPECT_THAT(crafted_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                            R"("b":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
                            4),
              HasSubstr("overlap"));
  // Empty tensors occupy no bytes and overlap nothing.
  EXPECT_EQ(crafted_error(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("z":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})",
                          4),
            "");
}

TEST(SafetensorsErrors, AbsentTensorNamesFileAndTensor) {
  const std::string path = tmp_path();
  write_safetensors(path, {make_tensor("x", DType::U8, {1}, std::vector<uint8_t>{1})}, {});
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_FALSE(f.contains("y"));
  try {
    f.tensor("y");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(path), HasSubstr("no tensor named 'y'")));
  }
}

// ---- errors: writing --------------------------------------------------------------------------------

TEST(SafetensorsErrors, WriterRejectsInconsistentTensors) {
  const std::string path = tmp_path();
  const std::vector<float> three = {1, 2, 3};
  auto write_error = [&](const std::vector<TensorData>& ts) -> std::string {
    try {
      write_safetensors(path, ts, {});
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_THAT(write_error({make_tensor("x", DType::F32, {2, 2}, three)}),
              AllOf(HasSubstr("tensor 'x'"), HasSubstr("needs 16 bytes, got 12")));
  EXPECT_THAT(write_error({make_tensor("x", DType::F32, {3}, three), make_tensor("x", DType::F32, {3}, three)}),
              HasSubstr("duplicate tensor name 'x'"));
  EXPECT_THAT(write_error({make_tensor("__metadata__", DType::F32, {3}, three)}), HasSubstr("reserved"));
  EXPECT_THAT(write_error({make_tensor("x", DType::F32, {-3}, three)}),
              AllOf(HasSubstr("tensor 'x'"), HasSubstr("invalid shape [-3]")));
  EXPECT_THAT(write_error({make_tensor("", DType::F32, {3}, three)}), HasSubstr("empty name"));
  try {
    write_safetensors((std::filesystem::path(FP4MOE_TEST_TMPDIR) / "no-such-dir" / "x.safetensors").string(),
                      {}, {});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("no-such-dir"), HasSubstr("cannot create")));
  }
}

}  // namespace
}  // namespace fp4moe::io
