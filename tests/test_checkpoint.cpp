// Checkpoints (src/train/checkpoint.h): bitwise round trip, the on-disk format pinned name by name,
// keep_last pruning, crash safety under SIGKILL at every stage and at random times, corruption and
// config-mismatch detection. The crash tests re-execute this binary (fork + exec, so no OpenMP state
// crosses a fork) running CheckpointChild.SaveUntilKilled, which saves until it is killed.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "temp_dir.h"
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/xxh64.h"
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
  TempDir() : TestDir("ckpt") {}
};

using moetron::testing::read_text;
json read_json(const fs::path& p) { return json::parse(read_text(p)); }

ModelConfig golden_config() { return load_model_config((kGolden / "config.json").string()); }

// A larger model (~1.2M parameters) for the timed-kill test, so a save takes a while.
ModelConfig big_config() {
  json j = read_json(kGolden / "config.json");
  j["vocab_size"] = 1024;
  j["hidden_size"] = 128;
  j["intermediate_size"] = 256;
  return model_config_from_json(j, "big_config");
}

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

// Model + optimizer state of a run at `step`, a pure function of the step.
struct Snapshot {
  std::vector<float> p, m, v;
  json state;
  long optimizer_steps = 0;
};
Snapshot snapshot(const ParamTable& table, long step) {
  Snapshot s;
  s.p = random_floats(table.total(), static_cast<uint32_t>(3 * step + 1));
  s.m = random_floats(table.total(), static_cast<uint32_t>(3 * step + 2));
  s.v = random_floats(table.total(), static_cast<uint32_t>(3 * step + 3));
  for (float& x : s.v) x = x * x;
  s.state = {{"step", step},
             {"consumed_samples", step * 8},
             {"consumed_tokens", step * 8 * 512},
             {"loader_state", {{"epoch", 0}, {"position", step * 8}}},
             {"rng", {{"seed", 1234}, {"counter", std::numeric_limits<uint64_t>::max() - step}}},
             {"lr_schedule", {{"last_lr", 1e-5 / (step + 1)}}},
             {"config", {{"name", "tiny \u00e9"}, {"micro_batch_size", 2}}}};
  s.optimizer_steps = step;
  return s;
}
CheckpointContents contents(const ModelConfig& cfg, const ParamTable& table, const Snapshot& s, bool moments = true) {
  CheckpointContents c;
  c.model_config = &cfg;
  c.table = &table;
  c.params = s.p.data();
  c.exp_avg = moments ? s.m.data() : nullptr;
  c.exp_avg_sq = moments ? s.v.data() : nullptr;
  c.optimizer_steps = s.optimizer_steps;
  c.trainer_state = s.state;
  return c;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Loads `dir` and checks it holds exactly snapshot(step).
void expect_holds_step(const std::string& dir, const ModelConfig& cfg, const ParamTable& table, long step) {
  std::vector<float> p(table.total(), -7.0f), m(table.total(), -7.0f), v(table.total(), -7.0f);
  const LoadedCheckpoint l = load_checkpoint(dir, cfg, table, p.data(), m.data(), v.data());
  const Snapshot s = snapshot(table, step);
  EXPECT_TRUE(same_bits(p, s.p)) << dir;
  EXPECT_TRUE(same_bits(m, s.m)) << dir;
  EXPECT_TRUE(same_bits(v, s.v)) << dir;
  EXPECT_EQ(l.trainer_state, s.state) << dir;
  EXPECT_EQ(l.optimizer_steps, s.optimizer_steps);
}

std::vector<std::string> files_under(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out.push_back(fs::relative(e.path(), dir).generic_string());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> entries_of(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The Hub names and shapes of the golden model, written out from its config by hand.
std::map<std::string, std::vector<int64_t>> golden_hf_shapes() {
  const int64_t V = 128, C = 32, I = 64, E = 4, H = 4 * 8, KV = 2 * 8;
  std::map<std::string, std::vector<int64_t>> s;
  s["model.embed_tokens.weight"] = {V, C};
  s["model.norm.weight"] = {C};
  s["lm_head.weight"] = {V, C};
  for (int l = 0; l < 2; l++) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    s[p + "input_layernorm.weight"] = {C};
    s[p + "post_attention_layernorm.weight"] = {C};
    s[p + "self_attn.q_proj.weight"] = {H, C};
    s[p + "self_attn.k_proj.weight"] = {KV, C};
    s[p + "self_attn.v_proj.weight"] = {KV, C};
    s[p + "self_attn.o_proj.weight"] = {C, H};
    s[p + "block_sparse_moe.gate.weight"] = {E, C};
    for (int e = 0; e < E; e++) {
      const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
      s[x + "w1.weight"] = {I, C};
      s[x + "w3.weight"] = {I, C};
      s[x + "w2.weight"] = {C, I};
    }
  }
  return s;
}

void flip_byte(const fs::path& p, long offset_from_end) {
  ASSERT_TRUE(fs::is_regular_file(p)) << p;
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-offset_from_end, std::ios::end);
  char c;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(-offset_from_end, std::ios::end);
  f.write(&c, 1);
}

// Expects load_checkpoint to throw an Error whose message contains every string in `needles`.
void expect_load_error(const std::string& dir, const ModelConfig& cfg, const std::vector<std::string>& needles) {
  const ParamTable table(cfg);
  std::vector<float> p(table.total()), m(table.total()), v(table.total());
  try {
    load_checkpoint(dir, cfg, table, p.data(), m.data(), v.data());
    ADD_FAILURE() << "load of " << dir << " succeeded; expected an error containing " << needles[0];
  } catch (const Error& e) {
    for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

// ---- child process for the crash tests ----

// Runs CheckpointChild.SaveUntilKilled in a fresh process; kill_after_ms >= 0 kills it after that long.
int run_child(const fs::path& run, long first, long last, long kill_at_event, bool big, int kill_after_ms) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("MOETRON_CKPT_CHILD_RUN", run.c_str(), 1);
    ::setenv("MOETRON_CKPT_CHILD_STEPS", (std::to_string(first) + ":" + std::to_string(last)).c_str(), 1);
    ::setenv("MOETRON_CKPT_CHILD_KILL_AT", std::to_string(kill_at_event).c_str(), 1);
    if (big) ::setenv("MOETRON_CKPT_CHILD_BIG", "1", 1);
    const int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, 1);
    char filter[] = "--gtest_filter=CheckpointChild.SaveUntilKilled";
    char name[] = "test_checkpoint";
    char* argv[] = {name, filter, nullptr};
    ::execv("/proc/self/exe", argv);
    ::_exit(127);
  }
  if (kill_after_ms >= 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kill_after_ms));
    ::kill(pid, SIGKILL);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

}  // namespace

TEST(CheckpointChild, SaveUntilKilled) {
  const char* run = std::getenv("MOETRON_CKPT_CHILD_RUN");
  if (run == nullptr) GTEST_SKIP() << "helper of the crash tests; does something only in their child processes";
  long first = 0, last = 0;
  std::sscanf(std::getenv("MOETRON_CKPT_CHILD_STEPS"), "%ld:%ld", &first, &last);
  const long kill_at = std::atol(std::getenv("MOETRON_CKPT_CHILD_KILL_AT"));
  const ModelConfig cfg = std::getenv("MOETRON_CKPT_CHILD_BIG") ? big_config() : golden_config();
  const ParamTable table(cfg);
  long events = 0;
  SaveOptions o;
  o.keep_last = 2;
  // Several model and optimizer shards, so there are many kill points.
  o.max_shard_bytes = std::getenv("MOETRON_CKPT_CHILD_BIG") ? 2'000'000 : 100'000;
  o.on_progress = [&](const std::string&) {
    if (events++ == kill_at) ::raise(SIGKILL);
  };
  for (long step = first; step <= last; step++) save_checkpoint(run, step, contents(cfg, table, snapshot(table, step)), o);
}

TEST(Xxh64, MatchesTheReferenceImplementation) {
  // Reference values: libxxhash 0.8.1 XXH64(data, len, seed 0), called through Python ctypes.
  std::string s773;
  for (int r = 0; r < 3; r++)
    for (int i = 0; i < 256; i++) s773 += static_cast<char>(i);
  s773 += "xyz12";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "ef46db3751d8e999"},
      {"a", "d24ec4f1a98c6e5b"},
      {"abc", "44bc2cf5ad770999"},
      {"0123456789abcdef0123456789abcdef0", "e87684f08d6d0816"},
      {s773, "9b7d50c047818b1b"}};
  for (const auto& [data, want] : cases) {
    EXPECT_EQ(xxh64_hex(xxh64(data.data(), data.size())), want) << data.size() << " bytes";
    for (size_t chunk : {1, 7, 31, 32, 33, 100}) {  // streaming in pieces gives the same digest
      Xxh64 x;
      for (size_t i = 0; i < data.size(); i += chunk) x.update(data.data() + i, std::min(chunk, data.size() - i));
      EXPECT_EQ(xxh64_hex(x.digest()), want) << data.size() << " bytes in chunks of " << chunk;
    }
  }
  TempDir t;
  std::ofstream(t.path / "f", std::ios::binary) << s773;
  uint64_t size = 0;
  EXPECT_EQ(xxh64_hex(xxh64_file((t.path / "f").string(), &size)), "9b7d50c047818b1b");
  EXPECT_EQ(size, 773u);
}

TEST(Checkpoint, SaveLoadRoundTripIsBitwise) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  for (DType dtype : {DType::F32, DType::BF16}) {
    TempDir t;
    Snapshot s = snapshot(table, 7);
    // Values a lossy path would change: -0, subnormals, the largest finite magnitudes (a bf16 rounding
    // would make them infinite), fp32 noise below bf16 precision (every random value has it).  NaN and
    // infinities are refused on load (NonFiniteOptimizerStateIsRefused; training never saves them).
    s.p[0] = -0.0f;
    s.p[1] = 1e-42f;
    s.p[2] = std::numeric_limits<float>::max();
    s.m[3] = -std::numeric_limits<float>::max();
    s.v[4] = f32_from_bits(0x00000001u);
    SaveOptions o;
    o.model_dtype = dtype;
    const std::string dir = save_checkpoint(t.path.string(), 7, contents(cfg, table, s), o);
    EXPECT_EQ(dir, (t.path / "checkpoints" / "step-000007").string());
    std::vector<float> p(table.total(), 3.0f), m(table.total(), 3.0f), v(table.total(), 3.0f);
    const LoadedCheckpoint l = load_checkpoint(dir, cfg, table, p.data(), m.data(), v.data());
    EXPECT_TRUE(same_bits(p, s.p)) << dtype_name(dtype);
    EXPECT_TRUE(same_bits(m, s.m)) << dtype_name(dtype);
    EXPECT_TRUE(same_bits(v, s.v)) << dtype_name(dtype);
    EXPECT_EQ(l.trainer_state, s.state);
    EXPECT_EQ(l.optimizer_steps, 7);
    // Parameters only (e.g. for eval) also come from the exact fp32 masters.
    std::vector<float> p2(table.total(), 3.0f);
    load_checkpoint(dir, cfg, table, p2.data(), nullptr, nullptr);
    EXPECT_TRUE(same_bits(p2, s.p));
  }
}

TEST(Checkpoint, FormatIsPinned) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  const fs::path tok = t.path / "tok";
  fs::create_directories(tok);
  std::ofstream(tok / "tokenizer.model", std::ios::binary) << "sentencepiece model bytes\x01\x02";
  std::ofstream(tok / "tokenizer_config.json") << "{\"add_bos_token\": true}\n";
  std::ofstream(tok / "unrelated.txt") << "not copied\n";
  const Snapshot s = snapshot(table, 7);
  SaveOptions o;
  o.model_dtype = DType::BF16;
  o.max_shard_bytes = 100000;  // model: 127808 bytes in BF16 -> 2 shards; optimizer: 766848 -> 8
  o.tokenizer_source_dir = tok.string();
  const fs::path dir = save_checkpoint(t.path.string(), 7, contents(cfg, table, s), o);

  EXPECT_EQ(entries_of(t.path / "checkpoints"), (std::vector<std::string>{"latest", "step-000007"}));
  EXPECT_EQ(read_text(t.path / "checkpoints" / "latest"), "step-000007\n");
  const std::vector<std::string> want_files = {
      "config.json",
      "generation_config.json",
      "model-00001-of-00002.safetensors",
      "model-00002-of-00002.safetensors",
      "model.safetensors.index.json",
      "optimizer/optimizer-00001-of-00008.safetensors",
      "optimizer/optimizer-00002-of-00008.safetensors",
      "optimizer/optimizer-00003-of-00008.safetensors",
      "optimizer/optimizer-00004-of-00008.safetensors",
      "optimizer/optimizer-00005-of-00008.safetensors",
      "optimizer/optimizer-00006-of-00008.safetensors",
      "optimizer/optimizer-00007-of-00008.safetensors",
      "optimizer/optimizer-00008-of-00008.safetensors",
      "optimizer/optimizer.safetensors.index.json",
      "tokenizer.model",
      "tokenizer_config.json",
      "trainer_state.json"};
  EXPECT_EQ(files_under(dir), want_files);
  EXPECT_EQ(read_text(dir / "tokenizer.model"), read_text(tok / "tokenizer.model"));

  // config.json: HF keys, the architecture and the dtype of the model files.
  const json c = read_json(dir / "config.json");
  EXPECT_EQ(c["architectures"], json::array({"MixtralForCausalLM"}));
  EXPECT_EQ(c["model_type"], "mixtral");
  EXPECT_EQ(c["torch_dtype"], "bfloat16");
  for (const char* k : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
                        "rms_norm_eps", "rope_theta", "max_position_embeddings", "router_aux_loss_coef",
                        "tie_word_embeddings", "hidden_act", "bos_token_id", "eos_token_id", "sliding_window"})
    EXPECT_TRUE(c.contains(k)) << k;
  EXPECT_EQ(c["num_hidden_layers"], 2);
  EXPECT_EQ(c["num_local_experts"], 4);
  EXPECT_EQ(read_json(dir / "generation_config.json"),
            json({{"_from_model_config", true}, {"bos_token_id", 1}, {"eos_token_id", 2}}));

  // Model: the index and the tensors (Hub names, BF16, shapes from the config).
  const auto shapes = golden_hf_shapes();
  const json index = read_json(dir / "model.safetensors.index.json");
  EXPECT_EQ(index.size(), 2u);
  EXPECT_EQ(index["metadata"].size(), 1u);
  std::set<std::string> wm_names;
  uint64_t total = 0;
  for (const auto& [name, file] : index["weight_map"].items()) {
    wm_names.insert(name);
    ASSERT_TRUE(shapes.count(name)) << name;
    const SafetensorsFile f = SafetensorsFile::open((dir / file.get<std::string>()).string());
    EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
    const TensorView& tv = f.get(name);
    EXPECT_EQ(tv.dtype, DType::BF16) << name;
    EXPECT_EQ(tv.shape, shapes.at(name)) << name;
    total += tv.nbytes;
  }
  EXPECT_EQ(wm_names.size(), shapes.size());
  EXPECT_EQ(index["metadata"]["total_size"], total);
  // Values: round to nearest even of the fp32 masters.
  const ModelTensors mt = ModelTensors::open(dir.string());
  const TensorView& emb = mt.get("model.embed_tokens.weight");
  std::vector<float> got = to_f32(emb);
  for (size_t i = 0; i < got.size(); i++) ASSERT_EQ(got[i], bf16_to_f32(f32_to_bf16(s.p[i]))) << i;

  // Optimizer: NAME.{master,exp_avg,exp_avg_sq}, F32, whole tensors of NAME's shape.
  const json oindex = read_json(dir / "optimizer" / "optimizer.safetensors.index.json");
  EXPECT_EQ(oindex.size(), 2u);
  EXPECT_EQ(oindex["weight_map"].size(), 3 * shapes.size());
  const ShardedSafetensors opt = ShardedSafetensors::open((dir / "optimizer").string(), "optimizer");
  uint64_t ototal = 0;
  for (const auto& [name, shape] : shapes)
    for (const char* suffix : {".master", ".exp_avg", ".exp_avg_sq"}) {
      const TensorView* tv = opt.find(name + suffix);
      ASSERT_NE(tv, nullptr) << name + suffix;
      EXPECT_EQ(tv->dtype, DType::F32);
      EXPECT_EQ(tv->shape, shape);
      ototal += tv->nbytes;
    }
  EXPECT_EQ(oindex["metadata"]["total_size"], ototal);
  const TensorView* m0 = opt.find("model.layers.1.block_sparse_moe.experts.3.w2.weight.exp_avg");
  const HfTensorRef* r0 = table.find_hf("model.layers.1.block_sparse_moe.experts.3.w2.weight");
  ASSERT_TRUE(m0 && r0);
  EXPECT_EQ(std::memcmp(m0->data, s.m.data() + r0->offset, m0->nbytes), 0);

  // trainer_state.json: the caller's keys, the format keys, a checksum per file, its own checksum.
  const json st = read_json(dir / "trainer_state.json");
  std::set<std::string> keys;
  for (const auto& [k, v] : st.items()) keys.insert(k);
  std::set<std::string> want_keys = {"format", "format_version", "optimizer_steps", "files", "trainer_state_xxh64"};
  for (const auto& [k, v] : s.state.items()) want_keys.insert(k);
  EXPECT_EQ(keys, want_keys);
  EXPECT_EQ(st["format"], "moetron-checkpoint");
  EXPECT_EQ(st["format_version"], 1);
  EXPECT_EQ(st["optimizer_steps"], 7);
  EXPECT_EQ(st["step"], 7);
  std::vector<std::string> listed;
  for (const auto& [rel, info] : st["files"].items()) {
    listed.push_back(rel);
    uint64_t size = 0;
    EXPECT_EQ(info["xxh64"], xxh64_hex(xxh64_file((dir / rel).string(), &size))) << rel;
    EXPECT_EQ(info["size"], size) << rel;
  }
  std::vector<std::string> others = want_files;
  others.erase(std::find(others.begin(), others.end(), "trainer_state.json"));
  EXPECT_EQ(listed, others);
}

TEST(Checkpoint, SingleFileLayoutWithoutShardsOrTokenizer) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  const fs::path dir = save_checkpoint(t.path.string(), 123, contents(cfg, table, snapshot(table, 1)), SaveOptions{});
  EXPECT_EQ(dir.filename(), "step-000123");
  EXPECT_EQ(files_under(dir), (std::vector<std::string>{"config.json", "generation_config.json", "model.safetensors",
                                                        "optimizer/optimizer.safetensors", "trainer_state.json"}));
  EXPECT_EQ(read_json(dir / "config.json")["torch_dtype"], "float32");
  EXPECT_EQ(SafetensorsFile::open((dir / "model.safetensors").string()).size(), golden_hf_shapes().size());
}

// The golden HF model saved as a checkpoint is tensor-for-tensor the same model. With
// MOETRON_CHECKPOINT_EXPORT_DIR set, also leaves checkpoints there for tools/check_checkpoint_hf.py.
TEST(Checkpoint, GoldenModelSurvivesSave) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  std::vector<float> p(table.total());
  load_hf_weights(ModelTensors::open(kGolden.string()), table, p.data(), kGolden.string());
  TempDir t;
  CheckpointContents c;
  c.model_config = &cfg;
  c.table = &table;
  c.params = p.data();
  const std::string dir = save_checkpoint(t.path.string(), 1, c, SaveOptions{});
  const SafetensorsFile golden = SafetensorsFile::open((kGolden / "model.safetensors").string());
  const ModelTensors saved = ModelTensors::open(dir);
  EXPECT_EQ(saved.names(), golden.names());
  for (const std::string& name : golden.names()) {
    const TensorView& a = golden.get(name);
    const TensorView& b = saved.get(name);
    EXPECT_EQ(a.shape, b.shape) << name;
    ASSERT_EQ(a.nbytes, b.nbytes) << name;
    EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes), 0) << name;
  }
  if (const char* out = std::getenv("MOETRON_CHECKPOINT_EXPORT_DIR")) {
    const std::vector<float> m(table.total(), 0.001f), v(table.total(), 1e-6f);
    c.exp_avg = m.data();  // a full training checkpoint: transformers must ignore optimizer/
    c.exp_avg_sq = v.data();
    SaveOptions o;
    o.keep_last = 0;
    o.max_shard_bytes = 100000;  // sharded, with an index
    save_checkpoint(out, 1, c, o);
    o.model_dtype = DType::BF16;
    save_checkpoint(out, 2, c, o);
  }
}

TEST(Checkpoint, KeepLastKeepsTheNewestCompleteOnes) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  const fs::path ck = t.path / "checkpoints";
  fs::create_directories(ck / ".tmp-step-000003-99999");  // a crashed save: never deleted, never used
  std::ofstream(ck / ".tmp-step-000003-99999" / "config.json") << "{}";
  fs::create_directories(ck / "step-000000");  // not complete: left alone
  SaveOptions o;
  o.keep_last = 2;
  for (long step = 1; step <= 5; step++) {
    save_checkpoint(t.path.string(), step, contents(cfg, table, snapshot(table, step)), o);
    EXPECT_EQ(find_latest_checkpoint(t.path.string()), (ck / fmt::format("step-{:06d}", step)).string());
  }
  EXPECT_EQ(entries_of(ck), (std::vector<std::string>{".tmp-step-000003-99999", "latest", "step-000000", "step-000004",
                                                       "step-000005"}));
  expect_holds_step((ck / "step-000004").string(), cfg, table, 4);
  expect_holds_step((ck / "step-000005").string(), cfg, table, 5);
  // Saving an older step again never deletes the checkpoint just written, and re-saving an existing
  // step replaces it.
  o.keep_last = 1;
  save_checkpoint(t.path.string(), 4, contents(cfg, table, snapshot(table, 40)), o);
  EXPECT_EQ(entries_of(ck), (std::vector<std::string>{".tmp-step-000003-99999", "latest", "step-000000", "step-000004",
                                                       "step-000005"}));
  expect_holds_step((ck / "step-000004").string(), cfg, table, 40);
  EXPECT_EQ(read_text(ck / "latest"), "step-000004\n");
  // keep_last <= 0 keeps everything.
  o.keep_last = 0;
  save_checkpoint(t.path.string(), 6, contents(cfg, table, snapshot(table, 6)), o);
  EXPECT_TRUE(fs::exists(ck / "step-000004") && fs::exists(ck / "step-000005") && fs::exists(ck / "step-000006"));
}

TEST(Checkpoint, FindLatest) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  const fs::path ck = t.path / "checkpoints";
  EXPECT_EQ(find_latest_checkpoint(t.path.string()), "");
  EXPECT_EQ(find_latest_checkpoint((t.path / "nonexistent").string()), "");
  save_checkpoint(t.path.string(), 2, contents(cfg, table, snapshot(table, 2)), SaveOptions{});
  save_checkpoint(t.path.string(), 3, contents(cfg, table, snapshot(table, 3)), SaveOptions{});
  EXPECT_EQ(find_latest_checkpoint(t.path.string()), (ck / "step-000003").string());

  auto expect_error = [&](const std::string& needle) {
    try {
      find_latest_checkpoint(t.path.string());
      ADD_FAILURE() << "expected an error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("latest"), std::string::npos) << e.what();
    }
  };
  std::ofstream(ck / "latest") << "step-000009\n";
  expect_error("does not exist");
  for (const char* escape : {"../../etc\n", "/etc\n", "step-000002/../../..\n", "../step-000002\n"}) {
    std::ofstream(ck / "latest") << escape;
    expect_error("not a checkpoint directory name");
  }
  std::ofstream(ck / "latest") << "step-000002\n";
  EXPECT_EQ(find_latest_checkpoint(t.path.string()), (ck / "step-000002").string());
  fs::resize_file(ck / "step-000002" / "model.safetensors", 100);
  expect_error("not a complete checkpoint");
  // No `latest` (a crash right after the first rename): the highest complete step-* directory.
  fs::remove(ck / "latest");
  EXPECT_EQ(find_latest_checkpoint(t.path.string()), (ck / "step-000003").string());
}

// SIGKILL after each stage of a save (every file, the rename, `latest`, the pruning): `latest` always
// names a complete checkpoint that loads and holds exactly what was saved at its step.
TEST(Checkpoint, KilledAtEveryStageLeavesALoadableLatest) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  // The stages of one save, recorded in process.
  std::vector<std::string> stages;
  {
    TempDir t;
    SaveOptions o;
    o.max_shard_bytes = 100'000;  // as the child does
    o.on_progress = [&](const std::string& s) { stages.push_back(s); };
    save_checkpoint(t.path.string(), 1, contents(cfg, table, snapshot(table, 1)), o);
  }
  ASSERT_GT(stages.size(), 10u);
  const long renamed = std::find(stages.begin(), stages.end(), "renamed") - stages.begin();
  const long latest = std::find(stages.begin(), stages.end(), "latest") - stages.begin();
  ASSERT_EQ(stages.back(), "pruned");

  for (bool first_save : {true, false}) {
    for (long k = 0; k < static_cast<long>(stages.size()); k++) {
      SCOPED_TRACE(fmt::format("{} save killed after stage {} ({})", first_save ? "first" : "second", k, stages[k]));
      TempDir t;
      if (!first_save) save_checkpoint(t.path.string(), 1, contents(cfg, table, snapshot(table, 1)), SaveOptions{});
      const long step = first_save ? 1 : 2;
      const int status = run_child(t.path, step, step, k, false, -1);
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "child status " << status;
      const std::string found = find_latest_checkpoint(t.path.string());
      long want = -1;
      if (first_save)
        want = k >= renamed ? 1 : -1;
      else
        want = k >= latest ? 2 : 1;
      if (want < 0) {
        EXPECT_EQ(found, "");
      } else {
        EXPECT_EQ(found, (t.path / "checkpoints" / fmt::format("step-{:06d}", want)).string());
        expect_holds_step(found, cfg, table, want);
      }
      // A new save after the crash works and does not trip over the leftovers.
      save_checkpoint(t.path.string(), 5, contents(cfg, table, snapshot(table, 5)), SaveOptions{});
      expect_holds_step(find_latest_checkpoint(t.path.string()), cfg, table, 5);
    }
  }
}

// SIGKILL at random moments while a process saves checkpoint after checkpoint of a larger model.
TEST(Checkpoint, KilledAtRandomTimesLeavesALoadableLatest) {
  const ModelConfig cfg = big_config();
  const ParamTable table(cfg);
  // Kill times relative to how long a child takes to start and one save takes on this machine.
  using clock = std::chrono::steady_clock;
  double start_ms = 0, save_ms = 0;
  {
    TempDir t;
    auto t0 = clock::now();
    run_child(t.path, 1, 0, -1, true, -1);  // starts, saves nothing, exits
    auto t1 = clock::now();
    SaveOptions o;
    o.max_shard_bytes = 2'000'000;
    save_checkpoint(t.path.string(), 1, contents(cfg, table, snapshot(table, 1)), o);
    auto t2 = clock::now();
    start_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    save_ms = std::chrono::duration<double, std::milli>(t2 - t1).count();
  }
  std::mt19937 gen(42);
  int seen_some = 0;
  for (int trial = 0; trial < 8; trial++) {
    TempDir t;
    const int delay_ms =
        static_cast<int>(start_ms + save_ms * std::uniform_real_distribution<double>(0.3, 4.0)(gen));
    SCOPED_TRACE(fmt::format("trial {}: killed after {} ms", trial, delay_ms));
    const int status = run_child(t.path, 1, 1000, -1, true, delay_ms);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "child status " << status;
    const std::string found = find_latest_checkpoint(t.path.string());
    if (found.empty()) continue;  // killed before the first save completed
    seen_some++;
    const long step = std::stol(fs::path(found).filename().string().substr(5));
    expect_holds_step(found, cfg, table, step);
    for (const std::string& name : entries_of(t.path / "checkpoints"))
      EXPECT_TRUE(name == "latest" || name.rfind("step-", 0) == 0 || name.rfind(".tmp-", 0) == 0 ||
                  name.rfind(".trash-", 0) == 0 || name.rfind("latest.tmp-", 0) == 0)
          << name;
  }
  EXPECT_GT(seen_some, 0) << "no trial got as far as a complete checkpoint; the test checked nothing";
}

TEST(Checkpoint, CorruptionIsDetectedNamingTheFile) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  SaveOptions o;
  o.max_shard_bytes = 100000;  // model (F32): 3 shards, optimizer: 8
  const fs::path good = save_checkpoint(t.path.string(), 1, contents(cfg, table, snapshot(table, 1)), o);
  int n = 0;
  auto fresh_copy = [&]() {
    const fs::path d = t.path / ("copy" + std::to_string(n++));
    fs::copy(good, d, fs::copy_options::recursive);
    return d;
  };
  // A flipped byte in tensor data (past the header, so the file still parses) in a model shard and in an
  // optimizer shard, and in the JSON files.
  for (const char* rel : {"model-00002-of-00003.safetensors", "optimizer/optimizer-00005-of-00008.safetensors",
                          "config.json", "model.safetensors.index.json", "generation_config.json"}) {
    SCOPED_TRACE(rel);
    const fs::path d = fresh_copy();
    flip_byte(d / rel, 5);
    expect_load_error(d.string(), cfg, {(d / rel).string(), "checksum mismatch"});
  }
  {  // Truncated by one byte.
    const fs::path d = fresh_copy();
    const fs::path f = d / "model-00003-of-00003.safetensors";
    fs::resize_file(f, fs::file_size(f) - 1);
    expect_load_error(d.string(), cfg, {f.string(), "truncated"});
  }
  {  // A missing file.
    const fs::path d = fresh_copy();
    fs::remove(d / "optimizer" / "optimizer-00008-of-00008.safetensors");
    expect_load_error(d.string(), cfg, {(d / "optimizer" / "optimizer-00008-of-00008.safetensors").string(), "missing"});
  }
  {  // trainer_state.json: a changed digit (still valid JSON) and a truncation.
    const fs::path d = fresh_copy();
    std::string text = read_text(d / "trainer_state.json");
    const size_t at = text.find("\"consumed_samples\": 8");
    ASSERT_NE(at, std::string::npos);
    text[at + std::strlen("\"consumed_samples\": ")] = '9';
    std::ofstream(d / "trainer_state.json", std::ios::binary) << text;
    expect_load_error(d.string(), cfg, {(d / "trainer_state.json").string(), "checksum mismatch"});
    fs::resize_file(d / "trainer_state.json", text.size() / 2);
    expect_load_error(d.string(), cfg, {(d / "trainer_state.json").string(), "not valid JSON"});
  }
  // The untouched original still loads.
  expect_holds_step(good.string(), cfg, table, 1);
}

TEST(Checkpoint, DifferentModelConfigIsRefusedNamingTheField) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  const fs::path dir = save_checkpoint(t.path.string(), 1, contents(cfg, table, snapshot(table, 1)), SaveOptions{});
  ModelConfig deeper = cfg;
  deeper.num_hidden_layers = 3;
  expect_load_error(dir.string(), deeper, {(dir / "config.json").string(), "num_hidden_layers: checkpoint 2, expected 3"});
  ModelConfig theta = cfg;
  theta.rope_theta = 10000.0;
  expect_load_error(dir.string(), theta, {"rope_theta: checkpoint 1000000, expected 10000"});
  ModelConfig two = cfg;
  two.num_experts_per_tok = 1;
  two.hidden_act = "gelu";
  expect_load_error(dir.string(), two, {"2 fields", "num_experts_per_tok: checkpoint 2, expected 1", "hidden_act"});
  // Training knobs may change between runs.
  ModelConfig knobs = cfg;
  knobs.router_aux_loss_coef = 0.5;
  knobs.max_position_embeddings = 4096;
  expect_holds_step(dir.string(), knobs, table, 1);
}

TEST(Checkpoint, ReleaseCheckpointWithoutOptimizerState) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  const Snapshot s = snapshot(table, 1);
  SaveOptions o;
  o.model_dtype = DType::BF16;
  const fs::path dir = save_checkpoint(t.path.string(), 1, contents(cfg, table, s, /*moments=*/false), o);
  EXPECT_FALSE(fs::exists(dir / "optimizer"));
  std::vector<float> p(table.total());
  const LoadedCheckpoint l = load_checkpoint(dir.string(), cfg, table, p.data(), nullptr, nullptr);
  EXPECT_EQ(l.trainer_state, s.state);
  for (size_t i = 0; i < p.size(); i++) ASSERT_EQ(p[i], bf16_to_f32(f32_to_bf16(s.p[i]))) << i;
  expect_load_error(dir.string(), cfg, {"no optimizer state"});
}

TEST(Checkpoint, FailedSaveLeavesNothingBehind) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  save_checkpoint(t.path.string(), 1, contents(cfg, table, snapshot(table, 1)), SaveOptions{});
  SaveOptions o;
  o.tokenizer_source_dir = (t.path / "no_such_dir").string();
  EXPECT_THROW(save_checkpoint(t.path.string(), 2, contents(cfg, table, snapshot(table, 2)), o), Error);
  EXPECT_EQ(entries_of(t.path / "checkpoints"), (std::vector<std::string>{"latest", "step-000001"}));
  Snapshot s = snapshot(table, 2);
  CheckpointContents c = contents(cfg, table, s);
  c.exp_avg_sq = nullptr;
  EXPECT_THROW(save_checkpoint(t.path.string(), 2, c, SaveOptions{}), Error);
  c = contents(cfg, table, s);
  c.trainer_state = json::array({1, 2});
  EXPECT_THROW(save_checkpoint(t.path.string(), 2, c, SaveOptions{}), Error);
  EXPECT_EQ(entries_of(t.path / "checkpoints"), (std::vector<std::string>{"latest", "step-000001"}));
}

// ---- trainer_state.json validation ------------------------------------------------------------------

namespace {

// Rewrites DIR/trainer_state.json through `edit` and recomputes its own checksum, as an attacker (or
// a careless script) would: the file then verifies, and only validate_trainer_state can refuse it.
void reseal_trainer_state(const fs::path& dir, const std::function<void(json&)>& edit) {
  json j = read_json(dir / "trainer_state.json");
  edit(j);
  j.erase("trainer_state_xxh64");
  const std::string body = j.dump();
  j["trainer_state_xxh64"] = xxh64_hex(xxh64(body.data(), body.size()));
  std::ofstream(dir / "trainer_state.json", std::ios::binary | std::ios::trunc) << j.dump(2) << "\n";
}

}  // namespace

// Every field resume relies on, mutated one at a time: each is refused naming the source and the
// field (the review's cases: step -5, negative optimizer_steps, "files": {} -- which switched file
// verification off --, and no loader_state, which surfaced as "unexpected error: [json.exception...]").
TEST(Checkpoint, TrainerStateValidationNamesTheField) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  const fs::path dir = save_checkpoint(t.path.string(), 3, contents(cfg, table, snapshot(table, 3)), SaveOptions{});
  json good = read_trainer_state(dir.string());
  good["loader_state"] = {{"epoch", 0}, {"next_block", 8}, {"seed", 7}, {"documents", 40},
                          {"seq_length", 128}, {"packing", true}};
  const std::string src = "SRC/trainer_state.json";
  validate_trainer_state(good, src, TrainerStateUse::resume);  // the unmodified state passes

  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    TrainerStateUse use;
    std::vector<std::string> needles;
  };
  using U = TrainerStateUse;
  const std::vector<Case> cases = {
      {"negative step", [](json& j) { j["step"] = -5; }, U::resume, {"'step'", "[0, 2^53]"}},
      {"huge step", [](json& j) { j["step"] = uint64_t{1} << 60; }, U::resume, {"'step'"}},
      {"float step", [](json& j) { j["step"] = 2.5; }, U::resume, {"'step'"}},
      {"no step", [](json& j) { j.erase("step"); }, U::resume, {"'step' is missing"}},
      {"negative optimizer_steps", [](json& j) { j["optimizer_steps"] = -1; }, U::any, {"'optimizer_steps'"}},
      {"string optimizer_steps", [](json& j) { j["optimizer_steps"] = "3"; }, U::any, {"'optimizer_steps'"}},
      {"negative consumed_samples", [](json& j) { j["consumed_samples"] = -8; }, U::resume, {"'consumed_samples'"}},
      {"string consumed_tokens", [](json& j) { j["consumed_tokens"] = "x"; }, U::resume, {"'consumed_tokens'"}},
      {"no loader_state", [](json& j) { j.erase("loader_state"); }, U::resume, {"'loader_state' is missing"}},
      {"loader_state without epoch", [](json& j) { j["loader_state"].erase("epoch"); }, U::resume,
       {"'loader_state'", "'epoch'"}},
      {"loader_state not an object", [](json& j) { j["loader_state"] = 3; }, U::resume, {"'loader_state'"}},
      {"empty files", [](json& j) { j["files"] = json::object(); }, U::any, {"'files' is empty"}},
      {"no files", [](json& j) { j.erase("files"); }, U::any, {"'files'"}},
      {"files an array", [](json& j) { j["files"] = json::array(); }, U::any, {"'files'"}},
      {"files without config.json", [](json& j) { j["files"].erase("config.json"); }, U::any, {"config.json"}},
      {"files without the weights",
       [](json& j) {
         j["files"].erase("model.safetensors");
         j["files"].erase("model.safetensors.index.json");
       },
       U::any, {"model.safetensors"}},
      {"bad hash", [](json& j) { j["files"]["config.json"]["xxh64"] = "xyz"; }, U::any, {"'config.json'", "hex"}},
      {"negative size", [](json& j) { j["files"]["config.json"]["size"] = -1; }, U::any, {"'config.json'"}},
      {"wrong format", [](json& j) { j["format"] = "other"; }, U::any, {"'format'"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    json j = good;
    c.edit(j);
    try {
      validate_trainer_state(j, src, c.use);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind(src + ": ", 0), 0u) << msg;
      for (const std::string& n : c.needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
    }
  }
  // The manifest's names: plain file names of the directory, or optimizer/NAME.
  for (const std::string& name : std::vector<std::string>{"../x", "/etc/passwd", "a/b", "optimizer/../config.json", "optimizer/a/b", "./x",
                                 "x/", "", std::string("config.json\0.bak", 16), "tab\there"}) {
    SCOPED_TRACE(name);
    json j = good;
    j["files"][name] = j["files"]["config.json"];
    EXPECT_THROW(validate_trainer_state(j, src), Error);
  }
  json ok = good;
  ok["files"]["optimizer/x.safetensors"] = ok["files"]["config.json"];
  ok["files"]["tokenizer.model"] = ok["files"]["config.json"];
  validate_trainer_state(ok, src);
}

// On disk: a resealed trainer_state.json that would switch verification off, or one whose manifest
// leaves a file out, is refused by load_checkpoint naming the file; nothing is changed.
TEST(Checkpoint, ResealedManifestIsRefused) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  SaveOptions o;
  o.max_shard_bytes = 100000;
  const fs::path good = save_checkpoint(t.path.string(), 1, contents(cfg, table, snapshot(table, 1)), o);
  int n = 0;
  auto fresh_copy = [&]() {
    const fs::path d = t.path / ("copy" + std::to_string(n++));
    fs::copy(good, d, fs::copy_options::recursive);
    return d;
  };
  {
    const fs::path d = fresh_copy();
    reseal_trainer_state(d, [](json& j) { j["files"] = json::object(); });
    flip_byte(d / "model-00002-of-00003.safetensors", 5);  // would have gone unnoticed
    expect_load_error(d.string(), cfg, {(d / "trainer_state.json").string(), "'files' is empty"});
    std::string why;
    EXPECT_FALSE(is_complete_checkpoint(d.string(), &why));
  }
  {  // A shard left out of the manifest, then altered.
    const fs::path d = fresh_copy();
    reseal_trainer_state(d, [](json& j) { j["files"].erase("model-00002-of-00003.safetensors"); });
    flip_byte(d / "model-00002-of-00003.safetensors", 5);
    expect_load_error(d.string(), cfg, {(d / "model-00002-of-00003.safetensors").string(), "not listed"});
  }
  {  // A file added after the save.
    const fs::path d = fresh_copy();
    std::ofstream(d / "model.safetensors") << "x";
    expect_load_error(d.string(), cfg, {(d / "model.safetensors").string(), "not listed"});
  }
  {
    const fs::path d = fresh_copy();
    reseal_trainer_state(d, [](json& j) { j["optimizer_steps"] = -4; });
    expect_load_error(d.string(), cfg, {(d / "trainer_state.json").string(), "'optimizer_steps'"});
  }
  expect_holds_step(good.string(), cfg, table, 1);
}

// NaN or Inf in the optimizer state (master weights or moments) is refused on load, naming the tensor.
TEST(Checkpoint, NonFiniteOptimizerStateIsRefused) {
  const ModelConfig cfg = golden_config();
  const ParamTable table(cfg);
  TempDir t;
  Snapshot s = snapshot(table, 1);
  const HfTensorRef& ref = table.hf_tensors()[3];
  s.m[ref.offset + 2] = std::nanf("");
  const fs::path dir = save_checkpoint(t.path.string(), 1, contents(cfg, table, s), SaveOptions{});
  expect_load_error(dir.string(), cfg, {ref.name + ".exp_avg", "non-finite", "optimizer.safetensors"});
}
