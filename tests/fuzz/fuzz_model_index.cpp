// Fuzz target: `model.safetensors.index.json` (the weight map of a sharded model directory), read by
// ModelTensors (model directories) and ShardedSafetensors (checkpoints' model and optimizer files).
// The directory holds two real shards, a shard reached through a symlink (as in the Hugging Face hub
// cache) and a file outside the directory that no weight map may reach.
#include <filesystem>

#include "fuzz_common.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "train/checkpoint.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

std::string make_dir() {
  const fuzz::Scratch& s = fuzz::scratch();
  const fs::path model = fs::path(s.dir()) / "model";
  fs::create_directories(model / "blobs");
  const float v[4] = {1, 2, 3, 4};
  SafetensorsWriter w1;
  w1.add_f32("model.embed_tokens.weight", {2, 2}, v);
  w1.add_f32("model.norm.weight", {2}, v, DType::BF16);
  w1.write((model / "model-00001-of-00002.safetensors").string());
  SafetensorsWriter w2;
  w2.add_f32("lm_head.weight", {2, 2}, v, DType::F16);
  w2.write((model / "model-00002-of-00002.safetensors").string());
  SafetensorsWriter w3;
  w3.add_f32("linked.weight", {4}, v);
  w3.write((model / "blobs" / "0123abcd").string());
  fs::create_symlink("blobs/0123abcd", model / "linked.safetensors");
  SafetensorsWriter outside;
  outside.add_f32("secret", {1}, v);
  outside.write((fs::path(s.dir()) / "outside.safetensors").string());
  return model.string();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = make_dir();
  const std::string index = dir + "/model.safetensors.index.json";
  FILE* f = std::fopen(index.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  fuzz::expect_ok_or_error([&] {
    const ModelTensors m = ModelTensors::open(dir);
    for (const std::string& name : m.names())
      if (name == "secret") std::abort();  // a weight map reached outside the model directory
  });
  fuzz::expect_ok_or_error([&] {
    const ShardedSafetensors sh = ShardedSafetensors::open(dir, "model");
    for (const std::string& name : sh.names())
      if (name == "secret") std::abort();
  });
  return 0;
}
