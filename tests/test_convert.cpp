// `moetron convert` through the binary: dtype changes equal round-to-nearest-even, re-sharding by size,
// optimizer state kept (exact resume) or dropped, pickle-only inputs and unsafe outputs refused.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "interrupt_cli.h"
#include "temp_dir.h"
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "model/params.h"
#include "model/weights.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;
using namespace moetron;
using nlohmann::json;

namespace {

const fs::path kGolden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "mixtral_gqa";

struct TempDir : moetron::testing::TestDir {
  TempDir() : TestDir("convert") {}
};

using moetron::testing::read_text;

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

CliRun convert(const TempDir& t, const std::string& args) {
  const fs::path out = t.path / "stdout.txt", err = t.path / "stderr.txt";
  const std::string cmd =
      std::string(MOETRON_BINARY) + " convert " + args + " > " + out.string() + " 2> " + err.string();
  const int status = std::system(cmd.c_str());
  CliRun r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

void expect_refused(const CliRun& r, const std::vector<std::string>& needles) {
  EXPECT_EQ(r.exit_code, 1) << r.err;
  for (const std::string& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << "missing '" << n << "' in: " << r.err;
}

// Every tensor of `dir` as fp32, by name.
std::map<std::string, std::vector<float>> tensors_f32(const fs::path& dir, DType want_dtype) {
  const ModelTensors m = ModelTensors::open(dir.string());
  std::map<std::string, std::vector<float>> out;
  for (const std::string& n : m.names()) {
    EXPECT_EQ(m.get(n).dtype, want_dtype) << dir << " " << n;
    out[n] = to_f32(m.get(n));
  }
  return out;
}

std::vector<std::string> entries_of(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(Convert, Fp32ToBf16ToFp32EqualsBf16Rounding) {
  TempDir t;
  const fs::path bf = t.path / "bf16", back = t.path / "fp32", half = t.path / "fp16";
  CliRun r = convert(t, "--input " + kGolden.string() + " --output " + bf.string() + " --dtype bf16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = convert(t, "--input " + bf.string() + " --output " + back.string() + " --dtype fp32");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = convert(t, "--input " + kGolden.string() + " --output " + half.string() + " --dtype fp16");
  ASSERT_EQ(r.exit_code, 0) << r.err;

  const auto orig = tensors_f32(kGolden, DType::F32);
  const auto b = tensors_f32(bf, DType::BF16);
  const auto f = tensors_f32(back, DType::F32);
  const auto h = tensors_f32(half, DType::F16);
  ASSERT_EQ(b.size(), orig.size());
  ASSERT_EQ(f.size(), orig.size());
  for (const auto& [name, x] : orig)
    for (size_t i = 0; i < x.size(); i++) {
      const float rb = bf16_to_f32(f32_to_bf16(x[i]));
      ASSERT_EQ(b.at(name)[i], rb) << name << "[" << i << "]";
      ASSERT_EQ(f.at(name)[i], rb) << name << "[" << i << "]";
      ASSERT_EQ(h.at(name)[i], f16_to_f32(f32_to_f16(x[i]))) << name << "[" << i << "]";
    }
  // config.json: both dtype keys updated, everything else as in the input.
  json want = json::parse(read_text(kGolden / "config.json"));
  const json got = json::parse(read_text(bf / "config.json"));
  EXPECT_EQ(got["torch_dtype"], "bfloat16");
  EXPECT_EQ(got["dtype"], "bfloat16");
  want["torch_dtype"] = "bfloat16";
  want["dtype"] = "bfloat16";
  EXPECT_EQ(got, want);
  EXPECT_EQ(json::parse(read_text(back / "config.json"))["torch_dtype"], "float32");
  EXPECT_EQ(json::parse(read_text(half / "config.json"))["torch_dtype"], "float16");
  // The golden directory's other safetensors (test inputs) are not weights of the model: not copied.
  EXPECT_EQ(entries_of(bf), (std::vector<std::string>{"config.json", "generation_config.json", "model.safetensors"}));
  EXPECT_EQ(read_text(bf / "generation_config.json"), read_text(kGolden / "generation_config.json"));
  // The result is a model moetron loads.
  const ModelConfig cfg = load_model_config((bf / "config.json").string());
  const ParamTable table(cfg);
  std::vector<float> p(table.total());
  load_hf_weights(ModelTensors::open(back.string()), table, p.data(), back.string());
}

TEST(Convert, ReshardingBySizeWritesAnIndex) {
  TempDir t;
  const fs::path sharded = t.path / "sharded", single = t.path / "single";
  CliRun r = convert(t, "--input " + kGolden.string() + " --output " + sharded.string() + " --max-shard-size 50KB");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // 255616 bytes of F32 tensors, each at most 32768 bytes, in files of at most 50000 bytes -> 6 files.
  const json index = json::parse(read_text(sharded / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 255616);
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  EXPECT_EQ(files, (std::set<std::string>{"model-00001-of-00006.safetensors", "model-00002-of-00006.safetensors",
                                          "model-00003-of-00006.safetensors", "model-00004-of-00006.safetensors",
                                          "model-00005-of-00006.safetensors", "model-00006-of-00006.safetensors"}));
  for (const std::string& f : files) EXPECT_LE(fs::file_size(sharded / f), 50000u + 4096u) << f;  // + header
  EXPECT_FALSE(fs::exists(sharded / "model.safetensors"));
  // Natural order: layer 0 is written before layer 1.
  EXPECT_LE(index["weight_map"]["model.layers.0.block_sparse_moe.experts.3.w2.weight"].get<std::string>(),
            index["weight_map"]["model.layers.1.self_attn.q_proj.weight"].get<std::string>());

  r = convert(t, "--input " + sharded.string() + " --output " + single.string() + " --max-shard-size 5GB");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(single / "model.safetensors.index.json"));
  // Same dtype: the bytes are carried over unchanged, through both re-shardings.
  const SafetensorsFile a = SafetensorsFile::open((kGolden / "model.safetensors").string());
  const SafetensorsFile b = SafetensorsFile::open((single / "model.safetensors").string());
  const ModelTensors m = ModelTensors::open(sharded.string());
  ASSERT_EQ(a.names(), b.names());
  ASSERT_EQ(a.names(), m.names());
  for (const std::string& n : a.names()) {
    ASSERT_EQ(a.get(n).nbytes, b.get(n).nbytes);
    EXPECT_EQ(std::memcmp(a.get(n).data, b.get(n).data, a.get(n).nbytes), 0) << n;
    EXPECT_EQ(std::memcmp(a.get(n).data, m.get(n).data, a.get(n).nbytes), 0) << n;
    EXPECT_EQ(a.get(n).shape, b.get(n).shape) << n;
  }
}

TEST(Convert, CheckpointKeepsOrDropsOptimizerState) {
  TempDir t;
  const ModelConfig cfg = load_model_config((kGolden / "config.json").string());
  const ParamTable table(cfg);
  std::mt19937 gen(5);
  std::normal_distribution<float> nd;
  std::vector<float> p(table.total()), m(table.total()), v(table.total());
  for (size_t i = 0; i < p.size(); i++) p[i] = nd(gen), m[i] = nd(gen), v[i] = nd(gen) * nd(gen);
  CheckpointContents c;
  c.model_config = &cfg;
  c.table = &table;
  c.params = p.data();
  c.exp_avg = m.data();
  c.exp_avg_sq = v.data();
  c.optimizer_steps = 11;
  c.trainer_state = {{"step", 11}, {"consumed_samples", 88}};
  SaveOptions o;
  o.max_shard_bytes = 100000;
  const fs::path tok = t.path / "tok";
  fs::create_directories(tok);
  std::ofstream(tok / "tokenizer.model") << "spm";
  o.tokenizer_source_dir = tok.string();
  const fs::path ckpt = save_checkpoint((t.path / "run").string(), 11, c, o);

  // Kept: bf16 model files, fp32 optimizer re-sharded into one file, checksums rewritten; resume is exact.
  const fs::path kept = t.path / "kept", release = t.path / "release";
  CliRun r = convert(t, "--input " + ckpt.string() + " --output " + kept.string() + " --dtype bf16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(entries_of(kept), (std::vector<std::string>{"config.json", "generation_config.json", "model.safetensors",
                                                         "optimizer", "tokenizer.model", "trainer_state.json"}));
  EXPECT_EQ(entries_of(kept / "optimizer"), (std::vector<std::string>{"optimizer.safetensors"}));
  std::vector<float> p2(table.total()), m2(table.total()), v2(table.total());
  const LoadedCheckpoint l = load_checkpoint(kept.string(), cfg, table, p2.data(), m2.data(), v2.data());
  EXPECT_EQ(std::memcmp(p.data(), p2.data(), p.size() * 4), 0);
  EXPECT_EQ(std::memcmp(m.data(), m2.data(), m.size() * 4), 0);
  EXPECT_EQ(std::memcmp(v.data(), v2.data(), v.size() * 4), 0);
  EXPECT_EQ(l.trainer_state, c.trainer_state);
  EXPECT_EQ(l.optimizer_steps, 11);
  EXPECT_EQ(json::parse(read_text(kept / "config.json"))["torch_dtype"], "bfloat16");

  // Dropped: a plain HF model directory.
  r = convert(t, "--input " + ckpt.string() + " --output " + release.string() + " --dtype bf16 --drop-optimizer");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(entries_of(release),
            (std::vector<std::string>{"config.json", "generation_config.json", "model.safetensors", "tokenizer.model"}));
  std::vector<float> p3(table.total());
  load_hf_weights(ModelTensors::open(release.string()), table, p3.data(), release.string());
  for (size_t i = 0; i < p.size(); i++) ASSERT_EQ(p3[i], bf16_to_f32(f32_to_bf16(p[i]))) << i;

  // A corrupt checkpoint is refused, naming the file, and nothing is written.
  std::fstream f(ckpt / "model-00002-of-00003.safetensors", std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good());
  f.seekp(-3, std::ios::end);
  f.put('\x55');
  f.close();
  r = convert(t, "--input " + ckpt.string() + " --output " + (t.path / "bad").string());
  expect_refused(r, {(ckpt / "model-00002-of-00003.safetensors").string(), "checksum mismatch"});
  EXPECT_FALSE(fs::exists(t.path / "bad"));
}

TEST(Convert, RefusesPickleOnlyDirectory) {
  TempDir t;
  const fs::path in = t.path / "pickled";
  fs::create_directories(in);
  fs::copy_file(kGolden / "config.json", in / "config.json");
  std::ofstream(in / "pytorch_model.bin") << "PK\x03\x04 not really a zip";
  const CliRun r = convert(t, "--input " + in.string() + " --output " + (t.path / "out").string());
  expect_refused(r, {"pytorch_model.bin", "pickle", "save_pretrained", "safe_serialization=True"});
  EXPECT_FALSE(fs::exists(t.path / "out"));
  EXPECT_EQ(entries_of(t.path), (std::vector<std::string>{"pickled", "stderr.txt", "stdout.txt"}));  // no temp dir
}

TEST(Convert, RefusesToOverwrite) {
  TempDir t;
  const fs::path copy = t.path / "model";
  fs::copy(kGolden, copy);
  const std::string before = read_text(copy / "model.safetensors");
  expect_refused(convert(t, "--input " + copy.string() + " --output " + copy.string() + " --dtype bf16"),
                 {"input directory"});
  expect_refused(convert(t, "--input " + copy.string() + " --output " + (t.path / "model" / ".." / "model").string()),
                 {"input directory"});
  fs::create_directories(t.path / "exists");
  expect_refused(convert(t, "--input " + copy.string() + " --output " + (t.path / "exists").string()),
                 {"already exists"});
  EXPECT_EQ(read_text(copy / "model.safetensors"), before);
}

TEST(Convert, RefusesBadOptions) {
  TempDir t;
  const std::string io = "--input " + kGolden.string() + " --output " + (t.path / "out").string();
  expect_refused(convert(t, io + " --dtype int8"), {"--dtype", "int8"});
  expect_refused(convert(t, io + " --max-shard-size 5XB"), {"--max-shard-size", "5XB"});
  expect_refused(convert(t, "--input " + (t.path / "none").string() + " --output " + (t.path / "out").string()),
                 {"not a directory"});
  EXPECT_FALSE(fs::exists(t.path / "out"));
}

// Finite weights beyond f16's range (65504) are refused naming the tensor and the element, by
// --dtype fp16 and by --merge-lora --dtype fp16 (the review's runs wrote Inf with exit 0); nothing is
// left behind.  bf16 holds the value.
TEST(Convert, WeightsBeyondF16AreRefusedNotWrittenAsInf) {
  TempDir t;
  const fs::path lora = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "lora" / "mixtral";
  const fs::path big = t.path / "big";
  fs::create_directories(big);
  for (const char* f : {"config.json", "generation_config.json"}) fs::copy_file(lora / f, big / f);
  {
    const ModelTensors m = ModelTensors::open(lora.string());
    SafetensorsWriter w;
    std::vector<float> v;
    for (const std::string& n : m.names()) {
      if (n == "model.layers.1.self_attn.o_proj.weight") {
        v = to_f32(m.get(n));
        v[5] = 70000.0f;
        w.add_f32(n, m.get(n).shape, v.data());
      } else {
        w.add_copy(n, m.get(n).dtype, m.get(n).shape, m.get(n).data);
      }
    }
    w.write((big / "model.safetensors").string());
  }
  const std::string in = "--input " + big.string() + " --output " + (t.path / "out").string() + " --dtype ";
  for (const std::string& extra : {std::string(), " --merge-lora " + (lora / "adapter_final").string()}) {
    SCOPED_TRACE(extra);
    const CliRun r = convert(t, in + "fp16" + extra);
    expect_refused(r, {"model.layers.1.self_attn.o_proj.weight", "element 5", "70000", "65504"});
    EXPECT_EQ(entries_of(t.path), (std::vector<std::string>{"big", "stderr.txt", "stdout.txt"}));  // no temp dir
  }
  ASSERT_EQ(convert(t, in + "bf16").exit_code, 0);
}

// Ctrl-C while convert writes (the review found .NAME.tmp-PID directories of hundreds of MB that no
// later run removed): the command unwinds, removes its temporary directory and exits 130.
TEST(Convert, CtrlCMidWriteLeavesNoTemporary) {
  TempDir t;
  const fs::path model = t.path / "model", out = t.path / "out";
  ASSERT_TRUE(moetron::testing::make_model_to_interrupt(model.string()));
  // Writing: the temporary directory holds a file (a shard being written).
  auto writing = [&] {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(t.path, ec))
      if (e.path().filename().string().rfind(".out.tmp-", 0) == 0 && !fs::is_empty(e.path(), ec)) return true;
    return false;
  };
  const moetron::testing::Interrupted r = moetron::testing::interrupt_mid_write(
      {"convert", "--input", model.string(), "--output", out.string(), "--dtype", "fp32"}, writing);
  EXPECT_TRUE(r.mid_write) << "convert finished before its write was seen";
  EXPECT_EQ(r.exit_status, 130);
  EXPECT_EQ(entries_of(t.path), std::vector<std::string>{"model"});
}
