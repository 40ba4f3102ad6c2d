// fuzz/make_seeds.cpp — writes the seed corpora of safetensors_fuzz (fuzz/corpus/safetensors/) and
// checkpoint_layer_fuzz (fuzz/corpus/checkpoint_layer/).
//
// The seeds are committed; this program documents how they were made and remakes them:
//   fuzz_make_seeds DIR [LAYER_DIR]
// LAYER_DIR: one-file checkpoints as config.json, a NUL, model.safetensors, written by
// io::write_fixture: gpt-oss MXFP4 (fused interleaved experts, biases, router bias), a copy with a ue8m0
// code 255, one with a missing router bias, a truncated one, and a compressed-tensors NVFP4 Mixtral.
// Steps: 1. valid files through io::write_safetensors (every dtype, scalars, empty tensors, metadata,
// a ModelOpt-style NVFP4 expert projection); 2. truncated copies of a valid file (inside the length
// prefix, the header and the data region); 3. headers crafted byte by byte that each break one rule
// of the reader (length, UTF-8, JSON, duplicate key, fields, dtype, shape, offsets, overlap).
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/safetensors.hpp"

namespace {

using namespace fp4moe::io;

std::string read_all(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.good()) throw std::runtime_error("cannot write " + p.string());
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

std::string craft(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\x11');
}

std::vector<uint8_t> iota_u8(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 37 + 11);
  return v;
}

// config.json + NUL + model.safetensors of a one-shard fixture, the safetensors optionally edited.
std::string checkpoint_seed(const std::filesystem::path& scratch, const FixtureOptions& o,
                            void (*edit)(std::vector<TensorData>&) = nullptr) {
  std::filesystem::remove_all(scratch);
  write_fixture(scratch.string(), o);
  const std::string weights = (scratch / "model.safetensors").string();
  if (edit) {
    std::vector<TensorData> ts;
    {
      const SafetensorsFile f = SafetensorsFile::open(weights);
      for (const auto& [name, t] : f.tensors()) {
        TensorData d{name, t.dtype, t.shape, {}};
        d.bytes.assign(t.data.begin(), t.data.end());
        ts.push_back(std::move(d));
      }
    }
    edit(ts);
    write_safetensors(weights, ts, {{"format", "pt"}});
  }
  std::string out = read_all(scratch / "config.json");
  out.push_back('\0');
  out += read_all(weights);
  std::filesystem::remove_all(scratch);
  return out;
}

void write_layer_seeds(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const std::filesystem::path scratch = dir / "scratch.tmp";
  FixtureOptions g;
  g.format = CheckpointFormat::Mxfp4;
  g.family = ModelFamily::GptOss;
  g.num_layers = 2;
  g.num_experts = 2;
  g.hidden = 32;
  g.inter = 64;  // two 32-blocks: tensor-parallel rank 1 of 2 exists
  g.top_k = 1;
  g.num_shards = 1;
  const std::string gpt_oss = checkpoint_seed(scratch, g);
  write_bytes(dir / "gpt_oss_mxfp4.ckpt", gpt_oss);
  write_bytes(dir / "gpt_oss_nan_scale.ckpt", checkpoint_seed(scratch, g, [](std::vector<TensorData>& ts) {
                for (auto& t : ts)
                  if (t.name == "model.layers.1.mlp.experts.down_proj_scales") t.bytes[3] = std::byte{0xFF};
              }));
  write_bytes(dir / "gpt_oss_no_router_bias.ckpt", checkpoint_seed(scratch, g, [](std::vector<TensorData>& ts) {
                std::erase_if(ts, [](const TensorData& t) { return t.name == "model.layers.0.mlp.router.bias"; });
              }));
  write_bytes(dir / "gpt_oss_truncated.ckpt", gpt_oss.substr(0, gpt_oss.size() - 100));
  FixtureOptions m;
  m.format = CheckpointFormat::CompressedTensors;
  m.family = ModelFamily::Mixtral;
  m.num_layers = 1;
  m.num_experts = 2;
  m.hidden = 16;
  m.inter = 16;
  m.top_k = 1;
  m.num_shards = 1;
  write_bytes(dir / "mixtral_compressed_tensors.ckpt", checkpoint_seed(scratch, m));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s DIR [LAYER_DIR]\n", argv[0]);
    return 2;
  }
  if (argc == 3) write_layer_seeds(argv[2]);
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  auto path = [&](const char* name) { return (dir / name).string(); };

  // 1. Valid files.
  write_safetensors(path("valid_empty.safetensors"), {}, {});
  write_safetensors(path("valid_metadata_only.safetensors"), {}, {{"format", "pt"}, {"fp4moe", "seed"}});
  write_safetensors(path("valid_f32.safetensors"),
                    {make_tensor("x", DType::F32, {2, 3}, std::vector<float>{1, -2, 0.5f, 3, 4, -0.f})},
                    {{"format", "pt"}});
  write_safetensors(
      path("valid_all_dtypes.safetensors"),
      {make_tensor("bf16", DType::BF16, {4}, std::vector<uint16_t>{0x3f80, 0xbf80, 0x7f80, 0x0000}),
       make_tensor("f32_scalar", DType::F32, {}, std::vector<float>{0.25f}),
       make_tensor("e4m3", DType::F8_E4M3, {2, 2}, std::vector<uint8_t>{0x38, 0x40, 0x7e, 0x00}),
       make_tensor("u8", DType::U8, {3}, std::vector<uint8_t>{1, 2, 255}),
       make_tensor("i32", DType::I32, {2}, std::vector<int32_t>{-1, 7}),
       make_tensor("empty", DType::F32, {0, 4}, std::vector<float>{})},
      {});
  // A ModelOpt NVFP4 expert projection: weight u8 [out, in/2], weight_scale e4m3 [out, in/16],
  // weight_scale_2 and input_scale f32 scalars. out = 4, in = 32.
  const std::string p = "model.layers.1.mlp.experts.0.gate_proj.";
  write_safetensors(path("valid_modelopt_expert.safetensors"),
                    {make_tensor(p + "weight", DType::U8, {4, 16}, iota_u8(64)),
                     make_tensor(p + "weight_scale", DType::F8_E4M3, {4, 2}, iota_u8(8)),
                     make_tensor(p + "weight_scale_2", DType::F32, {}, std::vector<float>{0.0125f}),
                     make_tensor(p + "input_scale", DType::F32, {}, std::vector<float>{0.5f})},
                    {{"format", "pt"}});
  // Non-ASCII (valid UTF-8) tensor name and metadata.
  write_safetensors(path("valid_utf8_names.safetensors"),
                    {make_tensor("gewicht_\xc3\xa4\xe2\x82\xac\xf0\x9f\x98\x80", DType::U8, {2},
                                 std::vector<uint8_t>{9, 8})},
                    {{"k\xc3\xa9", "v\xe2\x82\xac"}});

  // 2. Truncated copies of a valid file.
  const std::string full = read_all(path("valid_modelopt_expert.safetensors"));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(full[i]);
  write_bytes(path("trunc_prefix.safetensors"), full.substr(0, 5));
  write_bytes(path("trunc_header.safetensors"), full.substr(0, 8 + header_len / 2));
  write_bytes(path("trunc_data.safetensors"), full.substr(0, full.size() - 7));

  // 3. Crafted bad headers, each breaking one rule.
  const std::string ok_entry = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  write_bytes(path("bad_len_huge.safetensors"), le64(~uint64_t{0}) + "{}");
  write_bytes(path("bad_utf8.safetensors"), craft("{\"a\xff\":" + ok_entry + "}", 8));
  write_bytes(path("bad_utf8_overlong.safetensors"), craft("{\"\xc0\xaf\":" + ok_entry + "}", 8));
  write_bytes(path("bad_json.safetensors"), craft(R"({"a":{"dtype":"F32",)", 8));
  write_bytes(path("bad_not_object.safetensors"), craft("[1,2,3]", 0));
  write_bytes(path("bad_duplicate.safetensors"), craft("{\"a\":" + ok_entry + ",\"a\":" + ok_entry + "}", 8));
  write_bytes(path("bad_extra_field.safetensors"),
              craft(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8));
  write_bytes(path("bad_dtype.safetensors"), craft(R"({"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}})", 2));
  write_bytes(path("bad_shape_negative.safetensors"),
              craft(R"({"a":{"dtype":"U8","shape":[-1,2],"data_offsets":[0,2]}})", 2));
  write_bytes(path("bad_shape_overflow.safetensors"),
              craft(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0));
  write_bytes(path("bad_offsets_range.safetensors"),
              craft(R"({"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}})", 8));
  write_bytes(path("bad_overlap.safetensors"),
              craft(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                    R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                    16));
  write_bytes(path("bad_metadata.safetensors"), craft(R"({"__metadata__":{"k":1}})", 0));
  std::printf("wrote the seeds in %s\n", dir.string().c_str());
  return 0;
}
