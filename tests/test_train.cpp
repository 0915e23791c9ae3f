// The training loop end to end on a tiny random Mixtral and a synthetic token dataset: run
// directory contents, determinism, exact resume (also from mid-epoch), preemption by SIGTERM, and
// divergence handling.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "core/sha256.h"
#include "core/xxh64.h"
#include "io/indexed_dataset.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "infer/model.h"
#include "io/hf_config.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/evaluate.h"
#include "train/report.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

constexpr int kVocab = 256;

// Documents of 8..120 tokens; the first quarter of each is "prompt" (mask 0).
void write_split(const fs::path& dir, const std::string& name, int docs, uint64_t seed) {
  IndexedDatasetWriter tokens((dir / name).string(), IndexedDType::u16);
  IndexedDatasetWriter mask((dir / (name + "_mask")).string(), IndexedDType::u8);
  for (int d = 0; d < docs; d++) {
    const int len = 8 + (int)(mix64(seed * 1000 + d) % 113);
    std::vector<int32_t> t(len), m(len);
    t[0] = 1;  // BOS
    for (int i = 1; i < len; i++) t[i] = 3 + (int)(mix64(seed * 7919 + d * 131 + i) % (kVocab - 3));
    // A learnable pattern: every third token repeats the previous one.
    for (int i = 3; i < len; i += 3) t[i] = t[i - 1];
    for (int i = 0; i < len; i++) m[i] = i >= len / 4;
    tokens.add_sequence(t.data(), t.size());
    tokens.end_document();
    mask.add_sequence(m.data(), m.size());
    mask.end_document();
  }
  tokens.finalize();
  mask.finalize();
}

class TrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("moetron_train_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "data");
    write_split(root_ / "data", "train", 40, 1);
    write_split(root_ / "data", "valid", 6, 2);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string yaml(const std::string& run) const {
    return "run_dir: " + (root_ / run).string() + "\n" +
           "seed: 7\n"
           "model:\n"
           "  init: random\n"
           "  config: {architectures: [MixtralForCausalLM], model_type: mixtral, vocab_size: 256, hidden_size: 32,\n"
           "           intermediate_size: 48, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,\n"
           "           num_local_experts: 4, num_experts_per_tok: 2, router_aux_loss_coef: 0.02, rope_theta: 10000.0,\n"
           "           rms_norm_eps: 1.0e-5, tie_word_embeddings: false}\n"
           "data: {path: " +
           (root_ / "data").string() +
           ", seq_length: 128}\n"
           "train: {global_batch_size: 4, micro_batch_size: 2, max_steps: 10, lr: 3.0e-3, min_lr: 3.0e-4,\n"
           "        warmup_steps: 2, schedule: cosine}\n"
           "checkpoint: {every_steps: 4, keep_last: 2}\n"
           "eval: {every_steps: 5, batches: 2}\n";
  }
  TrainConfig config(const std::string& run, const std::vector<std::string>& overrides = {}) const {
    return train_config_from_yaml_text(yaml(run), "test.yaml", overrides);
  }
  std::vector<nlohmann::json> metrics(const std::string& run, const char* key) const {
    std::vector<nlohmann::json> out;
    std::ifstream f(root_ / run / "metrics.jsonl");
    for (std::string line; std::getline(f, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains(key)) out.push_back(j);
    }
    return out;
  }
  std::vector<double> losses(const std::string& run) const {
    std::vector<double> v;
    for (const auto& j : metrics(run, "loss")) v.push_back(j["loss"].get<double>());
    return v;
  }
  // All tensors of a checkpoint's model and optimizer files, as raw bytes by name.
  std::map<std::string, std::string> checkpoint_bytes(const fs::path& dir) const {
    std::map<std::string, std::string> out;
    for (const auto& entry : fs::recursive_directory_iterator(dir)) {
      if (entry.path().extension() != ".safetensors") continue;
      const SafetensorsFile f = SafetensorsFile::open(entry.path().string());
      for (const std::string& n : f.names()) {
        const TensorView& t = f.get(n);
        out[n] = std::string(reinterpret_cast<const char*>(t.data), t.nbytes);
      }
    }
    return out;
  }

  fs::path root_;
};

}  // namespace

TEST_F(TrainTest, WritesTheRunDirectoryAndLearns) {
  const TrainSummary s = run_training(config("run"));
  EXPECT_EQ(s.last_step, 10);
  EXPECT_FALSE(s.interrupted);
  const fs::path run = root_ / "run";
  EXPECT_TRUE(fs::exists(run / "config.yaml"));
  EXPECT_TRUE(fs::exists(run / "log.txt"));
  ASSERT_TRUE(fs::exists(run / "checkpoints" / "latest"));
  EXPECT_EQ(fs::path(s.last_checkpoint).filename(), "step-000010");
  EXPECT_TRUE(fs::exists(run / "checkpoints" / "step-000008")) << "keep_last 2 keeps the two newest";
  EXPECT_FALSE(fs::exists(run / "checkpoints" / "step-000004"));
  bool tb = false;
  for (const auto& e : fs::directory_iterator(run / "tb")) tb |= e.path().filename().string().rfind("events.out.tfevents", 0) == 0;
  EXPECT_TRUE(tb);

  const auto steps = metrics("run", "loss");
  ASSERT_EQ(steps.size(), 10u);
  for (size_t i = 0; i < steps.size(); i++) {
    const auto& m = steps[i];
    EXPECT_EQ(m["step"].get<long>(), (long)i + 1);
    for (const char* k : {"loss", "ce_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "param_norm", "mfu"})
      EXPECT_TRUE(m.contains(k) && std::isfinite(m[k].get<double>())) << k << " at step " << i + 1;
    // loss = ce + coef * aux with the model's coefficient 0.02 (one aux per micro-batch, averaged)
    EXPECT_NEAR(m["loss"].get<double>(), m["ce_loss"].get<double>() + 0.02 * m["aux_loss"].get<double>(), 1e-9);
    ASSERT_TRUE(m.contains("moe"));
    EXPECT_EQ(m["moe"].size(), 2u);
  }
  EXPECT_NEAR(steps[0]["lr"].get<double>(), 1.5e-3, 1e-12) << "warmup step 1 of 2";
  EXPECT_NEAR(steps[9]["lr"].get<double>(), 3e-4, 1e-12) << "cosine ends at min_lr";
  std::string trajectory;
  for (const auto& m : steps) trajectory += std::to_string(m["ce_loss"].get<double>()) + " ";
  // The data repeats every third token, so a learning model gains ~0.2 nats in 10 steps; the
  // step-to-step noise of this tiny run is ~0.03.
  EXPECT_LT(steps.back()["ce_loss"].get<double>(), steps.front()["ce_loss"].get<double>() - 0.1) << trajectory;
  const auto evals = metrics("run", "val_loss");
  ASSERT_EQ(evals.size(), 2u);
  EXPECT_EQ(evals[0]["step"].get<long>(), 5);
  EXPECT_LT(evals[1]["val_loss"].get<double>(), evals[0]["val_loss"].get<double>());
}

// `moetron report` on a real run directory: the curves and one expert-share heatmap per MoE layer.
TEST_F(TrainTest, ReportOfARealRunHasCurvesAndHeatmaps) {
  run_training(config("run", {"log.every_steps=1"}));
  const std::string html = render_report_html((root_ / "run").string());
  for (const char* id : {"id=\"chart-loss\"", "id=\"chart-val_loss\"", "id=\"chart-lr\"", "id=\"chart-grad_norm\"",
                         "id=\"heatmap-layer-0\"", "id=\"heatmap-layer-1\""})
    EXPECT_NE(html.find(id), std::string::npos) << id;
  size_t cells = 0;
  for (size_t p = html.find("<rect class=\"cell"); p != std::string::npos; p = html.find("<rect class=\"cell", p + 1)) cells++;
  EXPECT_EQ(cells, 2u * 4u * 10u) << "layers x experts x logged steps";
}

// `moetron eval` runs the trainer's evaluation on a checkpoint: the newest checkpoint's figure is the
// val_loss the run logged at that step, to the bit; an older checkpoint gives its own figure.
TEST_F(TrainTest, EvalOfACheckpointEqualsTheValLossTheRunLogged) {
  const TrainConfig cfg = config("run", {"eval.every_steps=2"});
  run_training(cfg);
  std::map<long, double> logged;
  for (const auto& j : metrics("run", "val_loss")) logged[j["step"].get<long>()] = j["val_loss"].get<double>();
  ASSERT_TRUE(logged.count(8) && logged.count(10));
  ASSERT_NE(logged[8], logged[10]);

  const std::string latest = resolve_eval_model(cfg, "");
  EXPECT_EQ(fs::path(latest).filename(), "step-000010");
  const EvalResult r = evaluate_model(cfg, latest, cfg.eval.batches);
  EXPECT_EQ(r.loss, logged[10]);
  EXPECT_EQ(r.perplexity, std::exp(logged[10]));
  EXPECT_EQ(r.batches, 2);
  EXPECT_GT(r.loss_tokens, 0);
  const fs::path step8 = root_ / "run" / "checkpoints" / "step-000008";
  EXPECT_EQ(evaluate_model(cfg, step8.string(), cfg.eval.batches).loss, logged[8]);

  // The command: the same figure, --all covers the whole split (6 documents fit one 2-row batch).
  const fs::path yaml_path = root_ / "eval.yaml";
  std::ofstream(yaml_path) << yaml("run");
  const fs::path out = root_ / "eval.out";
  const std::string cmd = std::string(MOETRON_BINARY) + " eval -c " + yaml_path.string() + " --json > " +
                          out.string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream f(out);
  std::string line, last;
  while (std::getline(f, line))
    if (!line.empty() && line[0] == '{') last = line;
  ASSERT_FALSE(last.empty());
  const auto j = nlohmann::json::parse(last);
  EXPECT_EQ(j["val_loss"].get<double>(), logged[10]);
  EXPECT_EQ(j["batches"].get<long>(), 2);
  // --all: every loss token of the validation split once (write_split's masks: positions >= len/4 of
  // each of its 6 documents; none is longer than a block, so none is split).
  const EvalResult all = evaluate_model(cfg, latest, 0);
  long expected_tokens = 0;
  for (int d = 0; d < 6; d++) {
    const int len = 8 + (int)(mix64(2 * 1000 + d) % 113);
    expected_tokens += len - len / 4;
  }
  EXPECT_EQ(all.loss_tokens, expected_tokens);
}

TEST_F(TrainTest, EvalErrorsExitTwoWithTheReason) {
  const fs::path yaml_path = root_ / "eval.yaml";
  std::ofstream(yaml_path) << yaml("never-trained");
  auto run = [&](const std::string& args) {
    const fs::path out = root_ / "eval.out";
    const int rc = std::system((std::string(MOETRON_BINARY) + " eval -c " + yaml_path.string() + " " + args + " > " +
                                out.string() + " 2>&1")
                                   .c_str());
    std::ifstream f(out);
    return std::make_pair(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, std::string((std::istreambuf_iterator<char>(f)), {}));
  };
  auto [rc, text] = run("");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(text.find("has no checkpoint and model.init is 'random'"), std::string::npos) << text;
  std::tie(rc, text) = run("--model " + (root_ / "nowhere").string());
  EXPECT_EQ(rc, 2);
  EXPECT_NE(text.find("has no config.json"), std::string::npos) << text;
  fs::remove(root_ / "data" / "valid.idx");
  std::tie(rc, text) = run("--model " + (root_ / "nowhere").string());
  EXPECT_EQ(rc, 2);
  EXPECT_NE(text.find("has no validation split"), std::string::npos) << text;
  EXPECT_FALSE(fs::exists(root_ / "never-trained"));
}

// data.seq_length beyond the model's max_position_embeddings: train and plan refused it, eval
// evaluated 128-token sequences on a model with 1 position.
TEST_F(TrainTest, EvalRefusesSequencesLongerThanTheModelsPositions) {
  const fs::path model = root_ / "model";
  fs::copy(fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "mixtral_gqa", model);
  nlohmann::json c = nlohmann::json::parse(std::ifstream(model / "config.json"));
  c["max_position_embeddings"] = 1;
  std::ofstream(model / "config.json") << c.dump(2);
  try {
    evaluate_model(config("eval"), model.string(), 1);
    FAIL() << "evaluated";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("data.seq_length 128"), std::string::npos) << msg;
    EXPECT_NE(msg.find("max_position_embeddings 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find((model / "config.json").string()), std::string::npos) << msg;
  }
  // The same rule as train's.
  EXPECT_THROW(run_training(config("t", {"model.config.max_position_embeddings=64"})), Error);
  EXPECT_FALSE(fs::exists(root_ / "t"));
}

TEST_F(TrainTest, SameSeedSameLossesBitwise) {
  run_training(config("a"));
  run_training(config("b"));
  const auto a = losses("a"), b = losses("b");
  ASSERT_EQ(a.size(), 10u);
  ASSERT_EQ(a, b);
  run_training(config("c", {"seed=8"}));
  EXPECT_NE(losses("c")[0], a[0]);
}

// 10 steps straight vs 3 steps, exit (train.exit_interval), resume, 7 steps: identical losses at every
// step and identical final weights and optimizer state, bit for bit.  40 documents of ~64 tokens in
// 128-token blocks give about 5 steps per epoch, so the stop at step 3 is mid-epoch and the
// resumed run crosses an epoch boundary.
TEST_F(TrainTest, ExactResumeFromMidEpoch) {
  run_training(config("straight"));
  const TrainSummary first = run_training(config("resumed", {"train.exit_interval=3", "checkpoint.keep_last=10"}));
  EXPECT_TRUE(first.interrupted);
  EXPECT_EQ(first.last_step, 3);
  const TrainSummary second = run_training(config("resumed", {"checkpoint.keep_last=10"}));
  EXPECT_EQ(second.first_step, 4);
  EXPECT_EQ(second.last_step, 10);
  const auto a = losses("straight"), b = losses("resumed");
  ASSERT_EQ(a.size(), 10u);
  ASSERT_EQ(b.size(), 10u);
  for (size_t i = 0; i < a.size(); i++) EXPECT_EQ(std::memcmp(&a[i], &b[i], sizeof(double)), 0) << "step " << i + 1;
  const auto wa = checkpoint_bytes(root_ / "straight" / "checkpoints" / "step-000010");
  const auto wb = checkpoint_bytes(root_ / "resumed" / "checkpoints" / "step-000010");
  ASSERT_FALSE(wa.empty());
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, bytes] : wa) EXPECT_TRUE(wb.at(name) == bytes) << name;
  // The stop really was mid-epoch.
  std::ifstream st(root_ / "resumed" / "checkpoints" / "step-000003" / "trainer_state.json");
  ASSERT_TRUE(st) << "the exit checkpoint at step 3 exists";
  const auto state = nlohmann::json::parse(st);
  EXPECT_EQ(state["loader_state"]["epoch"].get<long>(), 0);
  EXPECT_GT(state["loader_state"]["next_block"].get<long>(), 0);
}

TEST_F(TrainTest, DivergenceAbortsWithoutABadCheckpoint) {
  try {
    run_training(config("diverge", {"train.lr=1.0e+30", "train.min_lr=0", "train.warmup_steps=0",
                                    "checkpoint.every_steps=1", "train.nan_skip_limit=2"}));
    FAIL() << "expected the run to abort";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
  }
  // Every checkpoint that exists holds finite weights.
  const fs::path ck = root_ / "diverge" / "checkpoints";
  if (fs::exists(ck))
    for (const auto& e : fs::directory_iterator(ck)) {
      if (!e.is_directory()) continue;
      for (const auto& [name, bytes] : checkpoint_bytes(e.path())) {
        const float* v = reinterpret_cast<const float*>(bytes.data());
        for (size_t i = 0; i < bytes.size() / 4; i++) ASSERT_TRUE(std::isfinite(v[i])) << e.path() << " " << name;
      }
    }
}

// Runs `moetron train -c CONFIG args...` in a child process with output to LOG; returns its pid.
pid_t spawn_train(const fs::path& config, const fs::path& log, const std::vector<std::string>& args) {
  const pid_t pid = fork();
  if (pid == 0) {
    std::freopen(log.c_str(), "w", stdout);
    std::freopen(log.c_str(), "a", stderr);
    std::vector<std::string> argv_s = {MOETRON_BINARY, "train", "-c", config.string()};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(MOETRON_BINARY, argv.data());
    _exit(127);
  }
  return pid;
}

int wait_exit_code(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

// SIGTERM (Slurm preemption) finishes the current step, saves and exits 0; resuming then gives
// exactly the losses of an uninterrupted run.
TEST_F(TrainTest, SigtermSavesExitsZeroAndResumesExactly) {
  const fs::path cfg = root_ / "sig.yaml";
  std::ofstream(cfg) << yaml("sig");
  const std::vector<std::string> args = {"train.max_steps=60", "checkpoint.every_steps=0", "eval.every_steps=0"};
  const pid_t pid = spawn_train(cfg, root_ / "sig.out", args);
  ASSERT_GT(pid, 0);
  const fs::path m = root_ / "sig" / "metrics.jsonl";
  for (int i = 0; i < 600; i++) {  // wait until a few steps are logged
    std::ifstream f(m);
    int lines = 0;
    for (std::string l; std::getline(f, l);) lines++;
    if (lines >= 3) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  EXPECT_EQ(wait_exit_code(pid), 0);
  const auto steps = metrics("sig", "loss");
  ASSERT_GE(steps.size(), 3u);
  const long stopped = steps.back()["step"].get<long>();
  ASSERT_LT(stopped, 60) << "the signal must arrive mid-run for this test to mean anything";
  std::ifstream latest(root_ / "sig" / "checkpoints" / "latest");
  std::string name;
  latest >> name;
  char expect[32];
  std::snprintf(expect, sizeof(expect), "step-%06ld", stopped);
  EXPECT_EQ(name, expect) << "the checkpoint is the last completed step";

  // Resume to the end, and compare with an uninterrupted run.
  EXPECT_EQ(wait_exit_code(spawn_train(cfg, root_ / "sig2.out", args)), 0);
  const std::string straight_yaml = yaml("straight");
  const fs::path cfg2 = root_ / "straight.yaml";
  std::ofstream(cfg2) << straight_yaml;
  EXPECT_EQ(wait_exit_code(spawn_train(cfg2, root_ / "straight.out", args)), 0);
  const auto a = losses("straight"), b = losses("sig");
  ASSERT_EQ(a.size(), 60u);
  ASSERT_EQ(b.size(), 60u);
  for (size_t i = 0; i < a.size(); i++) EXPECT_EQ(std::memcmp(&a[i], &b[i], sizeof(double)), 0) << "step " << i + 1;
}

// SIGTERM during an evaluation (eval.batches has no upper bound) stops it at the next batch: the
// run saves the step's checkpoint and exits 0 at once, with no val_loss for that step.
TEST_F(TrainTest, SigtermDuringEvaluationStopsItAndCheckpoints) {
  const fs::path cfg = root_ / "sigeval.yaml";
  std::ofstream(cfg) << yaml("sigeval");
  const std::vector<std::string> args = {"train.max_steps=5", "checkpoint.every_steps=0", "eval.every_steps=1",
                                         "eval.batches=100000000"};
  const pid_t pid = spawn_train(cfg, root_ / "sigeval.out", args);
  ASSERT_GT(pid, 0);
  const fs::path m = root_ / "sigeval" / "metrics.jsonl";
  bool logged = false;
  for (int i = 0; i < 1500 && !logged; i++) {  // step 1's line is written just before its evaluation
    std::ifstream f(m);
    std::string l;
    logged = static_cast<bool>(std::getline(f, l));
    if (!logged) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(logged);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  EXPECT_EQ(wait_exit_code(pid), 0);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(waited, 30.0) << "the evaluation of 10^8 batches was not cut short";
  EXPECT_TRUE(metrics("sigeval", "val_loss").empty()) << "an interrupted evaluation logs no val_loss";
  std::ifstream latest(root_ / "sigeval" / "checkpoints" / "latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-000001");
  std::ifstream log(root_ / "sigeval" / "log.txt");
  const std::string text((std::istreambuf_iterator<char>(log)), {});
  EXPECT_NE(text.find("step 1: evaluation stopped by a signal"), std::string::npos) << text;
}

std::string file_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// A fresh start (nothing to resume) never writes over another run: a finished run trained again
// with checkpoint.resume=none, or a run_dir holding only a metrics.jsonl, is refused with exit 2 and
// every file left as it was (the review found metrics truncated, config.yaml rewritten and `latest`
// moved back).
TEST_F(TrainTest, AFreshStartNeverWritesOverAnotherRun) {
  const fs::path cfg = root_ / "fresh.yaml";
  std::ofstream(cfg) << yaml("fresh");
  const std::vector<std::string> args = {"train.max_steps=2", "eval.every_steps=0"};
  ASSERT_EQ(wait_exit_code(spawn_train(cfg, root_ / "fresh1.out", args)), 0);
  const fs::path run = root_ / "fresh";
  const std::string metrics = file_text(run / "metrics.jsonl"), config = file_text(run / "config.yaml"),
                    latest = file_text(run / "checkpoints" / "latest");
  std::vector<std::string> again = args;
  again.push_back("checkpoint.resume=none");
  again.push_back("train.lr=1e-2");  // a different run: config.yaml would change
  EXPECT_EQ(wait_exit_code(spawn_train(cfg, root_ / "fresh2.out", again)), 2);
  EXPECT_NE(file_text(root_ / "fresh2.out").find("already holds a run"), std::string::npos)
      << file_text(root_ / "fresh2.out");
  EXPECT_EQ(file_text(run / "metrics.jsonl"), metrics);
  EXPECT_EQ(file_text(run / "config.yaml"), config);
  EXPECT_EQ(file_text(run / "checkpoints" / "latest"), latest);
  // Only a metrics.jsonl (a run that left no checkpoint): refused too.
  const fs::path other = root_ / "other";
  fs::create_directories(other);
  std::ofstream(other / "metrics.jsonl") << "{\"step\": 1, \"loss\": 1.0}\n";
  EXPECT_EQ(wait_exit_code(spawn_train(cfg, root_ / "fresh3.out", {"train.max_steps=1", "run_dir=" + other.string()})),
            2);
  EXPECT_EQ(file_text(other / "metrics.jsonl"), "{\"step\": 1, \"loss\": 1.0}\n");
  EXPECT_FALSE(fs::exists(other / "config.yaml"));
}

// A checkpoints/step-N directory that is not a complete moetron checkpoint (a user's own) is never
// replaced: the save of step N fails naming it, and its files stay.
TEST_F(TrainTest, AForeignStepDirectoryIsNeverReplaced) {
  const fs::path cfg = root_ / "foreign.yaml";
  std::ofstream(cfg) << yaml("foreign");
  ASSERT_EQ(wait_exit_code(spawn_train(cfg, root_ / "foreign1.out",
                                       {"train.max_steps=4", "checkpoint.every_steps=4", "eval.every_steps=0"})),
            0);
  const fs::path mine = root_ / "foreign" / "checkpoints" / "step-000008";
  fs::create_directories(mine);
  std::ofstream(mine / "notes.txt") << "my own files";
  EXPECT_EQ(wait_exit_code(spawn_train(cfg, root_ / "foreign2.out",
                                       {"train.max_steps=8", "checkpoint.every_steps=4", "eval.every_steps=0"})),
            1);
  EXPECT_NE(file_text(root_ / "foreign2.out").find("step-000008: exists and is not a complete moetron checkpoint"),
            std::string::npos)
      << file_text(root_ / "foreign2.out");
  EXPECT_EQ(file_text(mine / "notes.txt"), "my own files");
  for (const auto& e : fs::directory_iterator(root_ / "foreign" / "checkpoints"))
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << "a temporary directory was left: " << e.path();
  EXPECT_EQ(file_text(root_ / "foreign" / "checkpoints" / "latest"), "step-000004\n");
}

// An injected NaN gradient skips that update and is logged; nan_skip_limit in a row abort with a
// non-zero exit and no checkpoint of the bad state.
TEST_F(TrainTest, InjectedNanIsSkippedThenRepeatedNansAbort) {
  const fs::path cfg = root_ / "nan.yaml";
  std::ofstream(cfg) << yaml("nan");
  EXPECT_EQ(wait_exit_code(spawn_train(cfg, root_ / "nan.out", {"--debug-inject-nan", "2", "checkpoint.every_steps=1"})), 0);
  const auto steps = metrics("nan", "loss");
  ASSERT_EQ(steps.size(), 10u);
  EXPECT_TRUE(steps[1]["skipped"].get<bool>());
  EXPECT_FALSE(steps[2]["skipped"].get<bool>());
  std::ifstream log(root_ / "nan" / "log.txt");
  const std::string text((std::istreambuf_iterator<char>(log)), {});
  EXPECT_NE(text.find("step 2: non-finite gradient"), std::string::npos) << text;

  EXPECT_EQ(wait_exit_code(spawn_train(cfg, root_ / "nan2.out",
                                       {"--debug-inject-nan", "4,5,6", "run_dir=" + (root_ / "nan2").string(),
                                        "train.nan_skip_limit=3", "checkpoint.every_steps=1"})),
            1);
  std::ifstream latest(root_ / "nan2" / "checkpoints" / "latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-000005") << "steps 4 and 5 were skipped (unchanged weights, still good); 6 aborted";
  EXPECT_FALSE(fs::exists(root_ / "nan2" / "checkpoints" / "step-000006"));
}

// A trainer_state.json edited and resealed (its checksum recomputed, so it verifies) is refused on
// resume naming the file and the field, and the run directory is left as it was: step -5 would have
// run steps -4..10, a missing loader_state surfaced as "unexpected error: [json.exception...]".
TEST_F(TrainTest, ResealedTrainerStateIsRefusedOnResume) {
  run_training(config("run", {"train.max_steps=4", "eval.every_steps=0"}));
  const fs::path ckpt = root_ / "run" / "checkpoints" / "step-000004";
  const fs::path state = ckpt / "trainer_state.json";
  ASSERT_TRUE(fs::exists(state));
  const std::string original = [&] {
    std::ifstream f(state);
    return std::string((std::istreambuf_iterator<char>(f)), {});
  }();
  auto reseal = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = nlohmann::json::parse(original);
    edit(j);
    j.erase("trainer_state_xxh64");
    const std::string body = j.dump();
    j["trainer_state_xxh64"] = xxh64_hex(xxh64(body.data(), body.size()));
    std::ofstream(state, std::ios::trunc) << j.dump(2) << "\n";
  };
  struct Case {
    const char* field;
    std::function<void(nlohmann::json&)> edit;
  };
  const std::vector<Case> cases = {
      {"'step'", [](nlohmann::json& j) { j["step"] = -5; }},
      {"'optimizer_steps'", [](nlohmann::json& j) { j["optimizer_steps"] = -2; }},
      {"'files' is empty", [](nlohmann::json& j) { j["files"] = nlohmann::json::object(); }},
      {"'loader_state' is missing", [](nlohmann::json& j) { j.erase("loader_state"); }},
      {"'consumed_samples'", [](nlohmann::json& j) { j["consumed_samples"] = "many"; }},
  };
  const TrainConfig cfg = config("run", {"train.max_steps=10", "eval.every_steps=0"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    reseal(c.edit);
    try {
      run_training(cfg);
      ADD_FAILURE() << "resumed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(state.string()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.field), std::string::npos) << e.what();
    }
    EXPECT_EQ(losses("run").size(), 4u) << "metrics.jsonl unchanged";
  }
  // Through the command: exit 2 and the message, not an "unexpected error".
  reseal([](nlohmann::json& j) { j.erase("loader_state"); });
  const fs::path yaml_path = root_ / "resume.yaml";
  std::ofstream(yaml_path) << yaml("run");
  EXPECT_EQ(wait_exit_code(spawn_train(yaml_path, root_ / "resume.out", {"train.max_steps=10", "eval.every_steps=0"})), 2);
  std::ifstream f(root_ / "resume.out");
  const std::string out((std::istreambuf_iterator<char>(f)), {});
  EXPECT_NE(out.find("'loader_state' is missing"), std::string::npos) << out;
  EXPECT_EQ(out.find("unexpected"), std::string::npos) << out;
  // The untouched state resumes.
  std::ofstream(state, std::ios::trunc) << original;
  EXPECT_EQ(run_training(cfg).last_step, 10);
}

// Config errors: one message, exit code 2, nothing done.
TEST_F(TrainTest, ConfigErrorsExitTwoBeforeAnyWork) {
  const fs::path cfg = root_ / "c.yaml";
  std::ofstream(cfg) << yaml("never");
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"train.learning_rate=0.1"}, {"train.max_steps=ten"}, {"data.path=/nonexistent/data"}}) {
    EXPECT_EQ(wait_exit_code(spawn_train(cfg, root_ / "c.out", args)), 2) << args[0];
    std::ifstream f(root_ / "c.out");
    const std::string out((std::istreambuf_iterator<char>(f)), {});
    EXPECT_NE(out.find("error"), std::string::npos) << out;
    EXPECT_FALSE(fs::exists(root_ / "never")) << args[0];
  }
}

TEST_F(TrainTest, ConfigErrorsComeBeforeAnyWork) {
  EXPECT_THROW(run_training(config("bad", {"data.path=/nonexistent"})), Error);
  EXPECT_FALSE(fs::exists(root_ / "bad"));
  EXPECT_THROW(run_training(config("bad", {"parallel.tp=2"})), Error);
  EXPECT_FALSE(fs::exists(root_ / "bad"));
}

namespace {

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

// A model trained from random init on prepared data gets the data's tokenizer as its checkpoints'
// tokenizer.model, so generate/serve find it in the model directory.  Loading never follows the
// path recorded in the data's dataset.json (a file of the model directory could name anything).
TEST_F(TrainTest, CheckpointsCarryThePreparedDataTokenizer) {
  const std::string tok = std::string(MOETRON_SOURCE_DIR) + "/tests/golden/generate/mixtral_gqa/tokenizer.model";
  std::ofstream(root_ / "data" / "dataset.json")
      << nlohmann::json{{"tokenizer", {{"path", tok}, {"sha256", sha256_file(tok)}}}}.dump();
  run_training(config("run", {"train.max_steps=1", "eval.every_steps=0"}));
  const fs::path ckpt = root_ / "run" / "checkpoints" / "step-000001";
  ASSERT_TRUE(fs::exists(ckpt / "tokenizer.model"));
  EXPECT_EQ(file_bytes(ckpt / "tokenizer.model"), file_bytes(tok));
  std::string why;
  EXPECT_TRUE(is_complete_checkpoint(ckpt.string(), &why)) << why;  // the copy is in the manifest

  // Without its own tokenizer.model, the checkpoint needs --tokenizer: the data's path is not followed.
  fs::remove(ckpt / "tokenizer.model");
  const ModelConfig cfg = load_model_config((ckpt / "config.json").string());
  try {
    load_model_tokenizer(ckpt.string(), "", cfg, true);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pass --tokenizer"), std::string::npos) << e.what();
  }

  // A tokenizer changed since `data prepare` is not copied (the data was not made with it); the log says so.
  std::ofstream(root_ / "data" / "dataset.json")
      << nlohmann::json{{"tokenizer", {{"path", tok}, {"sha256", std::string(64, '0')}}}}.dump();
  run_training(config("run2", {"train.max_steps=1", "eval.every_steps=0"}));
  EXPECT_FALSE(fs::exists(root_ / "run2" / "checkpoints" / "step-000001" / "tokenizer.model"));
  EXPECT_NE(file_bytes(root_ / "run2" / "log.txt").find("has changed since `data prepare`"), std::string::npos);
}

// The same for a tokenizer.json: the copy keeps its name and takes the tokenizer_config.json beside it
// (the BOS/EOS), so the checkpoint loads with the same special ids.
TEST_F(TrainTest, CheckpointsCarryAPreparedTokenizerJson) {
  const fs::path tokdir = root_ / "tokjson";
  fs::create_directories(tokdir);
  fs::copy_file(std::string(MOETRON_SOURCE_DIR) + "/tests/data/tiny-bytelevel-tokenizer.json", tokdir / "tokenizer.json",
                fs::copy_options::overwrite_existing);
  std::ofstream(tokdir / "tokenizer_config.json") << R"({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})";
  const std::string tok = (tokdir / "tokenizer.json").string();
  std::ofstream(root_ / "data" / "dataset.json")
      << nlohmann::json{{"tokenizer", {{"path", tok}, {"sha256", sha256_file(tok)}}}}.dump();
  run_training(config("runjson", {"train.max_steps=1", "eval.every_steps=0"}));
  const fs::path ckpt = root_ / "runjson" / "checkpoints" / "step-000001";
  EXPECT_FALSE(fs::exists(ckpt / "tokenizer.model"));
  ASSERT_TRUE(fs::exists(ckpt / "tokenizer.json"));
  EXPECT_EQ(file_bytes(ckpt / "tokenizer.json"), file_bytes(tok));
  EXPECT_EQ(file_bytes(ckpt / "tokenizer_config.json"), file_bytes(tokdir / "tokenizer_config.json"));
  std::string why;
  EXPECT_TRUE(is_complete_checkpoint(ckpt.string(), &why)) << why;
  const Tokenizer t = Tokenizer::load((ckpt / "tokenizer.json").string());
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_EQ(t.pad_id(), 0);
}

// LoRA (model/lora.h) through `moetron train`: only the adapters train (the checkpoints hold PEFT
// adapters and their optimizer state, not the base), the loss falls, and an interrupted run resumes
// bit for bit (the frozen base is re-read from model.init, the adapters from the checkpoint).
TEST_F(TrainTest, LoraTrainsTheAdaptersAndResumesExactly) {
  const std::vector<std::string> lora = {"lora.rank=4", "lora.alpha=8", "lora.targets=[attention, experts]",
                                         "train.lr=3.0e-2", "train.min_lr=3.0e-3"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> o = lora;
    o.insert(o.end(), extra.begin(), extra.end());
    return o;
  };
  run_training(config("straight", with({})));
  const auto a = losses("straight");
  ASSERT_EQ(a.size(), 10u);
  // A random base learns slowly through rank-4 adapters in 10 steps; the loss and the validation loss fall.
  EXPECT_LT(a.back(), a.front() - 0.02) << "LoRA training does not learn";
  const auto val = metrics("straight", "val_loss");
  ASSERT_EQ(val.size(), 2u);
  EXPECT_LT(val[1]["val_loss"].get<double>(), val[0]["val_loss"].get<double>());
  const fs::path ck = root_ / "straight" / "checkpoints" / "step-000010";
  EXPECT_TRUE(fs::exists(ck / "adapter_config.json"));
  EXPECT_TRUE(fs::exists(ck / "adapter_model.safetensors"));
  EXPECT_FALSE(fs::exists(ck / "model.safetensors")) << "a LoRA checkpoint holds the adapters, not the base";
  const SafetensorsFile ad = SafetensorsFile::open((ck / "adapter_model.safetensors").string());
  EXPECT_NE(ad.find("base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"), nullptr);
  EXPECT_NE(ad.find("base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"), nullptr);
  // The optimizer state is the adapters' alone: a few percent of a full fine-tune's.
  run_training(config("full"));
  const double lora_state = metrics("straight", "optimizer_state_bytes")[0]["optimizer_state_bytes"].get<double>();
  const double full_state = metrics("full", "optimizer_state_bytes")[0]["optimizer_state_bytes"].get<double>();
  EXPECT_LT(lora_state, 0.2 * full_state) << lora_state << " vs " << full_state;
  EXPECT_GT(lora_state, 0);

  const TrainSummary first =
      run_training(config("resumed", with({"train.exit_interval=3", "checkpoint.keep_last=10"})));
  EXPECT_EQ(first.last_step, 3);
  run_training(config("resumed", with({"checkpoint.keep_last=10"})));
  const auto b = losses("resumed");
  ASSERT_EQ(b.size(), 10u);
  for (size_t i = 0; i < a.size(); i++) EXPECT_EQ(std::memcmp(&a[i], &b[i], sizeof(double)), 0) << "step " << i + 1;
  const auto wa = checkpoint_bytes(ck);
  const auto wb = checkpoint_bytes(root_ / "resumed" / "checkpoints" / "step-000010");
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, bytes] : wa) EXPECT_TRUE(wb.at(name) == bytes) << name;
}

// model.dtype bf16 keeps a LoRA run's frozen base in bf16 on the CPU too; it trains and resumes exactly.
TEST_F(TrainTest, LoraOverABf16BaseResumesExactly) {
  const std::vector<std::string> o = {"lora.rank=4", "model.dtype=bf16", "train.lr=1.0e-2", "train.min_lr=1.0e-3"};
  run_training(config("straight", o));
  std::vector<std::string> a = o, b = o;
  a.insert(a.end(), {"train.exit_interval=3", "checkpoint.keep_last=10"});
  b.push_back("checkpoint.keep_last=10");
  run_training(config("resumed", a));
  run_training(config("resumed", b));
  const auto x = losses("straight"), y = losses("resumed");
  ASSERT_EQ(x.size(), 10u);
  ASSERT_EQ(y, x);
  // Without LoRA, bf16 parameters are refused on the CPU, naming the field.
  EXPECT_THROW(
      {
        try {
          run_training(config("full_bf16", {"model.dtype=bf16"}));
        } catch (const SetupError& e) {
          EXPECT_NE(std::string(e.what()).find("model.dtype: 'bf16' is not supported on device cpu"), std::string::npos)
              << e.what();
          throw;
        }
      },
      SetupError);
}

// A LoRA run from an HF directory whose weights are bf16 values: the bf16 base (read tensor by
// tensor into the bf16 store) and the fp32 base compute bitwise the same run.
TEST_F(TrainTest, LoraFromAnHfDirectoryBf16BaseEqualsFp32Base) {
  run_training(config("init", {"train.max_steps=1", "train.lr=0", "train.min_lr=0", "train.warmup_steps=0"}));
  const fs::path ck = root_ / "init" / "checkpoints" / "step-000001", bf16 = root_ / "init_bf16";
  const std::string cmd = std::string(MOETRON_BINARY) + " convert --input " + ck.string() + " --output " +
                          bf16.string() + " --dtype bf16 --drop-optimizer > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::vector<std::string> o = {"model.init=" + bf16.string(), "model.config=null", "lora.rank=4",
                                      "train.lr=1.0e-2", "train.min_lr=1.0e-3"};
  run_training(config("fp32_base", o));
  std::vector<std::string> b = o;
  b.push_back("model.dtype=bf16");
  run_training(config("bf16_base", b));
  const auto x = losses("fp32_base"), y = losses("bf16_base");
  ASSERT_EQ(x.size(), 10u);
  EXPECT_EQ(x, y);
}

TEST_F(TrainTest, LoraConfigErrorsNameTheField) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"lora.rank=-1"}, "lora.rank: must be in [0, 65536]"},
      {{"lora.rank=4", "lora.alpha=0"}, "lora.alpha: must be > 0"},
      {{"lora.rank=4", "lora.dropout=0.1"}, "lora.dropout: only 0 is implemented"},
      {{"lora.rank=4", "lora.targets=[]"}, "lora.targets: empty"},
  };
  for (const auto& [o, needle] : cases) {
    try {
      config("x", o);
      ADD_FAILURE() << "accepted " << o.back();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  const std::pair<std::string, std::string> setup_cases[] = {
      {"lora.targets=[q_proj, lm_head]", "lora.targets: unknown target 'lm_head' (valid: attention, experts"},
      {"lora.targets=[q_proj, mlp]", "lora.targets: target 'mlp': the model (MixtralForCausalLM) has no dense FFN"},
  };
  for (const auto& [o, needle] : setup_cases) {
    try {
      run_training(config("x", {"lora.rank=4", o}));
      ADD_FAILURE() << "accepted " << o;
    } catch (const SetupError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  EXPECT_FALSE(fs::exists(root_ / "x" / "checkpoints"));
}
