// Loading parameters from HF model directories: Hub names and transformers-5 packed MoE names give
// the same parameters; a missing or misshapen tensor is an error naming it.
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/error.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "model/params.h"
#include "model/weights.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

const fs::path kGolden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "mixtral_gqa";

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("moetron_weights_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::vector<float> load(const fs::path& dir, const ParamTable& table) {
  std::vector<float> p(table.total(), 0.0f);
  load_hf_weights(ModelTensors::open(dir.string()), table, p.data(), dir.string());
  return p;
}

}  // namespace

TEST(Weights, TransformersFivePackedNamesLoadLikeHubNames) {
  const ModelConfig cfg = load_model_config((kGolden / "config.json").string());
  const ParamTable table(cfg);
  const std::vector<float> hub = load(kGolden, table);

  // Write the same model with the packed names: mlp.gate.weight, mlp.experts.gate_up_proj [E,2I,C],
  // mlp.experts.down_proj [E,C,I]; everything else under its usual name.
  const ModelTensors src = ModelTensors::open(kGolden.string());
  const int E = cfg.num_local_experts, I = cfg.intermediate_size, C = cfg.hidden_size;
  std::vector<std::vector<float>> keep;
  std::vector<ModelTensorToWrite> out;
  for (const std::string& name : src.names()) {
    if (name.find("block_sparse_moe") != std::string::npos) continue;
    keep.push_back(to_f32(src.get(name)));
    out.push_back({name, DType::F32, src.get(name).shape, keep.back().data()});
  }
  keep.reserve(keep.size() + 3 * cfg.num_hidden_layers);
  for (int l = 0; l < cfg.num_hidden_layers; l++) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    keep.push_back(to_f32(src.get(p + "block_sparse_moe.gate.weight")));
    out.push_back({p + "mlp.gate.weight", DType::F32, {E, C}, keep.back().data()});
    std::vector<float> gate_up, down;
    for (int e = 0; e < E; e++) {
      const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
      for (const char* w : {"w1", "w3"}) {
        const std::vector<float> v = to_f32(src.get(x + w + ".weight"));
        gate_up.insert(gate_up.end(), v.begin(), v.end());
      }
      const std::vector<float> v = to_f32(src.get(x + "w2.weight"));
      down.insert(down.end(), v.begin(), v.end());
    }
    keep.push_back(std::move(gate_up));
    out.push_back({p + "mlp.experts.gate_up_proj", DType::F32, {E, 2 * I, C}, keep.back().data()});
    keep.push_back(std::move(down));
    out.push_back({p + "mlp.experts.down_proj", DType::F32, {E, C, I}, keep.back().data()});
  }
  TempDir dir("packed");
  write_model_safetensors(dir.path.string(), out);
  const std::vector<float> packed = load(dir.path, table);
  ASSERT_EQ(packed.size(), hub.size());
  EXPECT_EQ(std::memcmp(packed.data(), hub.data(), hub.size() * sizeof(float)), 0);
}

TEST(Weights, MissingTensorIsNamed) {
  const ModelConfig cfg = load_model_config((kGolden / "config.json").string());
  const ParamTable table(cfg);
  const ModelTensors src = ModelTensors::open(kGolden.string());
  std::vector<std::vector<float>> keep;
  std::vector<ModelTensorToWrite> out;
  keep.reserve(src.names().size());
  for (const std::string& name : src.names()) {
    if (name == "model.layers.1.block_sparse_moe.experts.2.w3.weight") continue;
    keep.push_back(to_f32(src.get(name)));
    out.push_back({name, DType::BF16, src.get(name).shape, keep.back().data()});
  }
  TempDir dir("missing");
  write_model_safetensors(dir.path.string(), out);
  try {
    load(dir.path, table);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.1.block_sparse_moe.experts.2.w3.weight"), std::string::npos)
        << e.what();
  }
}

// DeepSeek-V3's checkpoints hold a multi-token-prediction layer past the last one (model.layers.61.*
// for num_nextn_predict_layers 1): skipped and counted, as transformers skips it; a tensor of a layer
// past that is still refused.
TEST(Weights, MultiTokenPredictionLayersAreSkippedAndNamed) {
  const fs::path golden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "deepseek_v3_mla_yarn";
  const ModelConfig cfg = load_model_config((golden / "config.json").string());
  ASSERT_EQ(cfg.extra.at("num_nextn_predict_layers"), 1);
  const ParamTable table(cfg);
  EXPECT_EQ(table.mtp_layers(), 1);
  const ModelTensors src = ModelTensors::open(golden.string());
  std::vector<std::vector<float>> keep;
  std::vector<ModelTensorToWrite> out;
  keep.reserve(src.names().size() + 3);
  for (const std::string& name : src.names()) {
    keep.push_back(to_f32(src.get(name)));
    out.push_back({name, DType::F32, src.get(name).shape, keep.back().data()});
  }
  keep.push_back(std::vector<float>(32 * 64, 0.5f));
  out.push_back({"model.layers.3.eh_proj.weight", DType::F32, {32, 64}, keep.back().data()});
  keep.push_back(std::vector<float>(32, 1.0f));
  out.push_back({"model.layers.3.enorm.weight", DType::F32, {32}, keep.back().data()});
  TempDir dir("mtp");
  write_model_safetensors(dir.path.string(), out);
  const ModelTensors files = ModelTensors::open(dir.path.string());
  const size_t skipped = check_weights_size(files, table, dir.path.string());
  EXPECT_EQ(skipped, 2u);
  EXPECT_NE(mtp_note(skipped, table, "d").find("model.layers.3.*"), std::string::npos);
  EXPECT_EQ(load(dir.path, table), load(golden, table));
  // A layer past the prediction layers is not skipped.
  keep.push_back(std::vector<float>(32, 1.0f));
  out.push_back({"model.layers.4.enorm.weight", DType::F32, {32}, keep.back().data()});
  TempDir bad("mtp_bad");
  write_model_safetensors(bad.path.string(), out);
  try {
    check_weights_size(ModelTensors::open(bad.path.string()), table, bad.path.string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.4.enorm.weight"), std::string::npos) << e.what();
  }
}

TEST(Weights, Bf16CheckpointsConvertOnLoad) {
  const ModelConfig cfg = load_model_config((kGolden / "config.json").string());
  const ParamTable table(cfg);
  const std::vector<float> f32 = load(kGolden, table);
  const ModelTensors src = ModelTensors::open(kGolden.string());
  std::vector<std::vector<float>> keep;
  std::vector<ModelTensorToWrite> out;
  keep.reserve(src.names().size());
  for (const std::string& name : src.names()) {
    keep.push_back(to_f32(src.get(name)));
    out.push_back({name, DType::BF16, src.get(name).shape, keep.back().data()});
  }
  TempDir dir("bf16");
  write_model_safetensors(dir.path.string(), out, /*max_shard_bytes=*/20000);  // several shards
  EXPECT_TRUE(fs::exists(dir.path / "model.safetensors.index.json"));
  const std::vector<float> bf = load(dir.path, table);
  // Loading a bf16 file gives exactly the bf16 rounding of the fp32 weights (tests/test_dtype.cpp
  // checks that rounding itself), and it does change the values.
  size_t changed = 0;
  for (size_t i = 0; i < f32.size(); i++) {
    ASSERT_EQ(bf[i], bf16_to_f32(f32_to_bf16(f32[i]))) << i;
    changed += bf[i] != f32[i];
  }
  EXPECT_GT(changed, f32.size() / 2);
}

// A NaN or an infinity in the weights would make every logit NaN (forward "succeeded" with exit 0,
// generate streamed garbage): loading refuses it, naming the tensor and the file that holds it, for
// F32 and BF16 files alike.
TEST(Weights, NonFiniteValuesAreRefusedNamingTensorAndFile) {
  const ModelConfig cfg = load_model_config((kGolden / "config.json").string());
  const ParamTable table(cfg);
  const ModelTensors src = ModelTensors::open(kGolden.string());
  struct Case {
    std::string tensor;
    float value;
    DType dtype;
  };
  const std::vector<Case> cases = {
      {"model.layers.1.self_attn.k_proj.weight", std::nanf(""), DType::F32},
      {"model.layers.0.block_sparse_moe.experts.3.w2.weight", INFINITY, DType::BF16},
      {"lm_head.weight", -INFINITY, DType::F32},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.tensor);
    std::vector<std::vector<float>> keep;
    std::vector<ModelTensorToWrite> out;
    keep.reserve(src.names().size());
    for (const std::string& name : src.names()) {
      keep.push_back(to_f32(src.get(name)));
      if (name == c.tensor) keep.back()[keep.back().size() / 2 + 1] = c.value;
      out.push_back({name, c.dtype, src.get(name).shape, keep.back().data()});
    }
    TempDir dir("nonfinite");
    write_model_safetensors(dir.path.string(), out, /*max_shard_bytes=*/20000);
    try {
      load(dir.path, table);
      FAIL() << "expected an error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'" + c.tensor + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("non-finite"), std::string::npos) << msg;
      EXPECT_NE(msg.find(dir.path.string() + "/model-000"), std::string::npos) << "names the shard file: " << msg;
    }
  }
}

TEST(Weights, FirstNonFiniteFindsTheFirstNanOrInf) {
  for (size_t n : {size_t{0}, size_t{7}, size_t{1} << 17}) {
    std::vector<float> v(n, 1.5f);
    EXPECT_EQ(first_non_finite(v.data(), n), n);
    if (n == 0) continue;
    v[n - 1] = INFINITY;
    EXPECT_EQ(first_non_finite(v.data(), n), n - 1);
    v[n / 3] = -NAN;
    EXPECT_EQ(first_non_finite(v.data(), n), n / 3);
    v[n / 3] = 3.4e38f;  // the largest finite values and subnormals are finite
    v[n - 1] = 1e-45f;
    EXPECT_EQ(first_non_finite(v.data(), n), n);
  }
}
