// Loading parts of a model for parallel layouts: read_f32_slice (rows, columns, any dimension),
// WeightShard selections (tensor-parallel splits, layer ranges, expert ranges), Hub and packed names,
// and the release of mapped pages after a tensor is read.
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/error.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "model/params.h"
#include "model/weights.h"
#include "temp_dir.h"

using namespace moetron;
using moetron::testing::TempDir;

namespace {

// Values exactly representable in bf16 and f16, so every storage dtype reads back exactly.
std::vector<float> ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++) v[i] = static_cast<float>(static_cast<int>(i % 97) - 48) * 0.25f;
  return v;
}

// t[d0][d1][d2] sliced on `dim` to [b, e), computed naively.
std::vector<float> naive_slice(const std::vector<float>& v, const std::vector<int64_t>& shape, int dim, int64_t b,
                               int64_t e) {
  std::vector<float> out;
  for (int64_t i = 0; i < shape[0]; i++)
    for (int64_t j = 0; j < shape[1]; j++)
      for (int64_t k = 0; k < shape[2]; k++) {
        const int64_t idx[3] = {i, j, k};
        if (idx[dim] < b || idx[dim] >= e) continue;
        out.push_back(v[static_cast<size_t>((i * shape[1] + j) * shape[2] + k)]);
      }
  return out;
}

long rss_file_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("RssFile:", 0) == 0) return std::stol(line.substr(8));
  return -1;
}

ModelConfig tiny_moe(int vocab = 37) {
  return model_config_from_json(
      {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"}, {"vocab_size", vocab},
       {"hidden_size", 16}, {"intermediate_size", 12}, {"num_hidden_layers", 3}, {"num_attention_heads", 4},
       {"num_key_value_heads", 2}, {"num_local_experts", 4}, {"num_experts_per_tok", 2}},
      "tiny test model");
}

// A model directory holding `params` under the Hub names (packed = false) or with the experts and
// router in transformers-5's packed tensors (packed = true), stored as `storage`.
void write_model(const std::string& dir, const ParamTable& table, const std::vector<float>& params, bool packed,
                 DType storage) {
  std::vector<ModelTensorToWrite> out;
  std::set<size_t> packed_specs;
  for (const HfTensorRef& ref : table.hf_tensors()) {
    const ParamSpec& spec = table.spec_of(ref);
    const bool moe_tensor = spec.kind == ParamKind::router || spec.n_stacked > 0;
    if (!packed || !moe_tensor) {
      out.push_back({ref.name, storage, ref.shape, params.data() + ref.offset});
      continue;
    }
    if (!packed_specs.insert(ref.spec_index).second) continue;
    const std::string p = "model.layers." + std::to_string(spec.layer) + ".mlp.";
    const std::string name = spec.kind == ParamKind::router    ? p + "gate.weight"
                             : spec.kind == ParamKind::ffn_w13 ? p + "experts.gate_up_proj"
                                                               : p + "experts.down_proj";
    out.push_back({name, storage, spec.shape, params.data() + spec.offset});
  }
  write_model_safetensors(dir, out);
}

struct ShardRead {
  std::map<std::string, std::vector<float>> values;  // by Hub name
  std::map<std::string, HfTensorSlice> slices;
};

ShardRead read_shard(const ModelTensors& files, const ModelConfig& cfg, const ParamTable& table,
                     const WeightShard& shard) {
  ShardRead r;
  for (const HfTensorSlice& s : shard_slices(cfg, table, shard)) {
    std::vector<float> v(s.numel());
    read_hf_slice(files, table, s, v.data(), files.dir());
    r.values[s.ref->name] = std::move(v);
    r.slices[s.ref->name] = s;
  }
  return r;
}

// Places a 2-D slice (dim 0 or 1 restricted) back into a full [rows, cols] buffer, counting writes.
void scatter(const HfTensorSlice& s, const std::vector<float>& v, std::vector<float>& full, std::vector<int>& hits) {
  const int64_t rows = s.ref->shape[0], cols = s.ref->shape.size() > 1 ? s.ref->shape[1] : 1;
  const int64_t r0 = s.dim == 0 ? s.begin : 0, r1 = s.dim == 0 ? s.end : rows;
  const int64_t c0 = s.dim == 1 ? s.begin : 0, c1 = s.dim == 1 ? s.end : cols;
  size_t i = 0;
  for (int64_t r = r0; r < r1; r++)
    for (int64_t c = c0; c < c1; c++) {
      full[static_cast<size_t>(r * cols + c)] = v[i++];
      hits[static_cast<size_t>(r * cols + c)]++;
    }
  ASSERT_EQ(i, v.size());
}

}  // namespace

TEST(ReadF32Slice, EveryDimensionAndStorageDtypeMatchesNaiveSlicing) {
  TempDir dir("slice");
  const std::vector<int64_t> shape = {3, 5, 4};
  const std::vector<float> v = ramp(60);
  for (DType storage : {DType::F32, DType::BF16, DType::F16}) {
    SafetensorsWriter w;
    w.add_f32("t", shape, v.data(), storage);
    w.write(dir.file("t.safetensors"));
    const SafetensorsFile f = SafetensorsFile::open(dir.file("t.safetensors"));
    for (int dim = 0; dim < 3; dim++)
      for (int64_t b = 0; b <= shape[dim]; b++)
        for (int64_t e = b; e <= shape[dim]; e++) {
          const std::vector<float> want = naive_slice(v, shape, dim, b, e);
          std::vector<float> got(want.size(), -999.0f);
          read_f32_slice(f.get("t"), dim, b, e, got.data());
          ASSERT_EQ(got, want) << dtype_name(storage) << " dim " << dim << " [" << b << ", " << e << ")";
        }
    // select_index: one [5, 4] matrix of the stack, then its columns.
    const TensorView second = select_index(f.get("t"), 1);
    ASSERT_EQ(second.shape, (std::vector<int64_t>{5, 4}));
    std::vector<float> cols(5 * 2);
    read_f32_slice(second, 1, 1, 3, cols.data());
    for (int r = 0; r < 5; r++)
      for (int c = 0; c < 2; c++) EXPECT_EQ(cols[r * 2 + c], v[20 + r * 4 + 1 + c]);
  }
}

TEST(ReadF32Slice, BadDimensionOrRangeIsAnErrorNamingTheTensor) {
  TempDir dir("slice_err");
  const std::vector<float> v = ramp(12);
  SafetensorsWriter w;
  w.add_f32("model.w", {3, 4}, v.data());
  w.write(dir.file("m.safetensors"));
  const SafetensorsFile f = SafetensorsFile::open(dir.file("m.safetensors"));
  std::vector<float> out(12);
  auto message = [&](auto fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { read_f32_slice(f.get("model.w"), 2, 0, 1, out.data()); }).find("'model.w': read_f32_slice dim 2"),
            std::string::npos);
  EXPECT_NE(message([&] { read_f32_slice(f.get("model.w"), 1, 3, 5, out.data()); }).find("slice [3, 5) of dim 1 is outside [0, 4)"),
            std::string::npos);
  EXPECT_NE(message([&] { read_f32_slice(f.get("model.w"), 0, 2, 1, out.data()); }).find("outside"), std::string::npos);
  EXPECT_NE(message([&] { select_index(f.get("model.w"), 3); }).find("index 3 is outside [0, 3)"), std::string::npos);
}

TEST(ReleasePages, ReadTensorLeavesTheResidentSetAndRereadsTheSameBytes) {
  if (rss_file_kib() < 0) GTEST_SKIP() << "/proc/self/status has no RssFile line on this kernel";
  TempDir dir("release");
  const size_t n = size_t{16} << 20;  // 64 MiB of fp32
  std::vector<float> v = ramp(n);
  {
    SafetensorsWriter w;
    w.add_f32("big", {static_cast<int64_t>(n)}, v.data());
    w.write(dir.file("big.safetensors"));
  }
  const SafetensorsFile f = SafetensorsFile::open(dir.file("big.safetensors"));
  const TensorView& t = f.get("big");
  std::vector<float> out(n);

  // Touching the mapping without releasing it (to_f32) keeps ~64 MiB of file pages resident...
  const long before = rss_file_kib();
  std::vector<float> copy = to_f32(t);
  const long touched = rss_file_kib();
  EXPECT_GT(touched - before, 48 * 1024) << "RssFile before " << before << " KiB, after " << touched << " KiB";
  release_pages(t);
  EXPECT_LT(rss_file_kib() - before, 8 * 1024);

  // ...read_f32 releases them itself, and the bytes read again are the same.
  read_f32(t, out.data(), n);
  EXPECT_LT(rss_file_kib() - before, 8 * 1024);
  EXPECT_EQ(out, v);
  read_f32_rows(t, 0, static_cast<int64_t>(n), out.data());
  EXPECT_LT(rss_file_kib() - before, 8 * 1024);
  EXPECT_EQ(out, copy);
}

TEST(ShardRange, BalancedContiguousCover) {
  for (int64_t n : {0, 1, 7, 37, 64})
    for (int parts = 1; parts <= 5; parts++) {
      int64_t next = 0;
      for (int p = 0; p < parts; p++) {
        const auto [b, e] = shard_range(n, parts, p);
        EXPECT_EQ(b, next);
        EXPECT_TRUE(e - b == n / parts || e - b == n / parts + 1);
        next = e;
      }
      EXPECT_EQ(next, n);
    }
}

class WeightShards : public ::testing::TestWithParam<bool> {};  // param: packed names

TEST_P(WeightShards, TensorParallelRanksTogetherHoldTheWholeModel) {
  const ModelConfig cfg = tiny_moe();
  const ParamTable table(cfg);
  std::vector<float> params(table.total());
  init_parameters(table, cfg, 7, params.data());
  TempDir dir("tp");
  write_model(dir.path().string(), table, params, GetParam(), DType::BF16);
  const ModelTensors files = ModelTensors::open(dir.path().string());
  std::vector<float> whole(table.total());
  load_hf_weights(files, table, whole.data(), dir.path().string());

  const int HD = cfg.head_dim;
  for (int tp : {1, 2, 4}) {
    std::map<std::string, std::vector<float>> full;
    std::map<std::string, std::vector<int>> hits;
    for (const HfTensorRef& ref : table.hf_tensors()) {
      full[ref.name].assign(ref.numel, 0.0f);
      hits[ref.name].assign(ref.numel, 0);
    }
    for (int r = 0; r < tp; r++) {
      const ShardRead shard = read_shard(files, cfg, table, {.tp_rank = r, .tp_size = tp});
      ASSERT_EQ(shard.values.size(), table.hf_tensors().size()) << "tp " << tp;
      for (const auto& [name, s] : shard.slices) {
        scatter(s, shard.values.at(name), full[name], hits[name]);
        // The Megatron split: which dimension each tensor is cut along.
        const bool is_kv = name.find(".k_proj.") != std::string::npos || name.find(".v_proj.") != std::string::npos;
        const bool rows = name.find("q_proj") != std::string::npos || is_kv || name.find(".w1.") != std::string::npos ||
                          name.find(".w3.") != std::string::npos || name.find("embed_tokens") != std::string::npos ||
                          name.find("lm_head") != std::string::npos;
        const bool cols = name.find("o_proj") != std::string::npos || name.find(".w2.") != std::string::npos;
        EXPECT_EQ(s.dim, tp == 1 ? -1 : rows ? 0 : cols ? 1 : -1) << name << " tp " << tp;
        // 2 kv heads over 4 ranks: ranks 0,1 hold head 0, ranks 2,3 head 1 (replicated).
        if (is_kv && tp == 4) {
          EXPECT_EQ(s.begin, (r / 2) * HD) << name << " rank " << r;
          EXPECT_EQ(s.end - s.begin, HD) << name;
        }
      }
    }
    for (const HfTensorRef& ref : table.hf_tensors()) {
      const std::vector<float> want(whole.begin() + ref.offset, whole.begin() + ref.offset + ref.numel);
      EXPECT_EQ(full[ref.name], want) << ref.name << " tp " << tp;
      const bool replicated = tp > 1 && (ref.name.find("norm") != std::string::npos || ref.name.find(".gate.") != std::string::npos ||
                                         ((ref.name.find("k_proj") != std::string::npos || ref.name.find("v_proj") != std::string::npos) && tp == 4));
      const int expected_hits = replicated ? (ref.name.find("_proj") != std::string::npos ? 2 : tp) : 1;
      for (int h : hits[ref.name]) ASSERT_EQ(h, expected_hits) << ref.name << " tp " << tp;
    }
  }
}

TEST_P(WeightShards, LayerAndExpertRangesSelectExactlyTheirTensors) {
  const ModelConfig cfg = tiny_moe();
  const ParamTable table(cfg);
  std::vector<float> params(table.total());
  init_parameters(table, cfg, 3, params.data());
  TempDir dir("ranges");
  write_model(dir.path().string(), table, params, GetParam(), DType::F32);
  const ModelTensors files = ModelTensors::open(dir.path().string());

  auto names = [&](const WeightShard& s) {
    std::set<std::string> out;
    for (const auto& [name, v] : read_shard(files, cfg, table, s).values) {
      const HfTensorRef* ref = table.find_hf(name);
      EXPECT_EQ(v, std::vector<float>(params.begin() + ref->offset, params.begin() + ref->offset + ref->numel)) << name;
      out.insert(name);
    }
    return out;
  };
  auto expected = [&](auto keep) {
    std::set<std::string> out;
    for (const HfTensorRef& ref : table.hf_tensors())
      if (keep(ref, table.spec_of(ref))) out.insert(ref.name);
    return out;
  };
  // Pipeline stages: the first holds the embedding, the last the final norm and head.
  EXPECT_EQ(names({.layer_begin = 0, .layer_end = 1}), expected([](const HfTensorRef&, const ParamSpec& s) {
              return s.layer == 0 || s.kind == ParamKind::embedding;
            }));
  EXPECT_EQ(names({.layer_begin = 1, .layer_end = 2}),
            expected([](const HfTensorRef&, const ParamSpec& s) { return s.layer == 1; }));
  EXPECT_EQ(names({.layer_begin = 2, .layer_end = 3}), expected([](const HfTensorRef&, const ParamSpec& s) {
              return s.layer == 2 || s.kind == ParamKind::final_norm || s.kind == ParamKind::lm_head;
            }));
  // Expert parallel: experts [1, 3) of every layer; the router stays whole.
  const std::set<std::string> ep = names({.expert_begin = 1, .expert_end = 3});
  EXPECT_EQ(ep, expected([](const HfTensorRef& r, const ParamSpec& s) {
              return s.n_stacked == 0 || (r.stacked_index >= 1 && r.stacked_index < 3);
            }));
  EXPECT_TRUE(ep.count("model.layers.0.block_sparse_moe.experts.1.w3.weight"));
  EXPECT_FALSE(ep.count("model.layers.0.block_sparse_moe.experts.3.w1.weight"));
  // Combined: stage 2 of 3, experts [2, 4), tp rank 1 of 2.
  const ShardRead both = read_shard(files, cfg, table,
                                    {.layer_begin = 1, .layer_end = 2, .expert_begin = 2, .expert_end = 4,
                                     .tp_rank = 1, .tp_size = 2});
  const HfTensorSlice& w2 = both.slices.at("model.layers.1.block_sparse_moe.experts.3.w2.weight");
  EXPECT_EQ(w2.dim, 1);
  EXPECT_EQ(w2.begin, 6);
  EXPECT_EQ(w2.end, 12);
  EXPECT_EQ(both.slices.count("model.layers.1.block_sparse_moe.experts.1.w2.weight"), 0u);
}

INSTANTIATE_TEST_SUITE_P(Names, WeightShards, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "TransformersFivePacked" : "Hub"; });

TEST(WeightShardErrors, LayoutsThatDoNotFitTheModelNameTheField) {
  const ModelConfig cfg = tiny_moe();
  const ParamTable table(cfg);
  auto message = [&](const WeightShard& s) {
    try {
      shard_slices(cfg, table, s);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({.tp_rank = 0, .tp_size = 3}).find("tp 3 does not divide num_attention_heads 4"), std::string::npos);
  EXPECT_NE(message({.tp_rank = 2, .tp_size = 2}).find("tp_rank 2 is outside [0, tp_size 2)"), std::string::npos);
  EXPECT_NE(message({.layer_begin = 2, .layer_end = 4}).find("layer range [2, 4) is outside the model's 3 layers"),
            std::string::npos);
  EXPECT_NE(message({.expert_begin = 3, .expert_end = 5}).find("expert range [3, 5) is outside the model's 4 experts"),
            std::string::npos);
  EXPECT_NE(message({.expert_begin = 2, .expert_end = 2}).find("expert range [2, 2)"), std::string::npos);
}
