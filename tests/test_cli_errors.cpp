// Bad input through the CLI: each case must exit with status 1 (not a signal, not 0), print an
// error naming the file or field and what was expected, and leave no output file behind.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace fs = std::filesystem;

namespace {

const fs::path kGolden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "mixtral_gqa";

struct CliResult {
  int exit_code = -1;
  bool signalled = false;
  std::string err;
};

class CliErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = fs::temp_directory_path() /
           ("moetron_cli_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(tmp_);
    fs::create_directories(tmp_);
    model_ = tmp_ / "model";
    fs::copy(kGolden, model_);
    input_ = model_ / "input.safetensors";
  }
  void TearDown() override { fs::remove_all(tmp_); }

  CliResult forward() {
    const fs::path err = tmp_ / "stderr.txt";
    const std::string cmd = std::string(MOETRON_BINARY) + " forward --model " + model_.string() + " --input " +
                            input_.string() + " --output " + out().string() + " > /dev/null 2> " + err.string();
    const int status = std::system(cmd.c_str());
    CliResult r;
    r.signalled = WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) > 128);
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream f(err);
    std::stringstream ss;
    ss << f.rdbuf();
    r.err = ss.str();
    return r;
  }
  fs::path out() const { return tmp_ / "out.safetensors"; }

  // `moetron ARGS` with stdout to stdout.txt and stderr captured.
  CliResult run_cli(const std::string& args) {
    const fs::path err = tmp_ / "stderr.txt";
    const std::string cmd = "OMP_NUM_THREADS=2 " + std::string(MOETRON_BINARY) + " " + args + " < /dev/null > " +
                            (tmp_ / "stdout.txt").string() + " 2> " + err.string();
    const int status = std::system(cmd.c_str());
    CliResult r;
    r.signalled = WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) > 128);
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.err = read_bytes(err);
    return r;
  }
  void expect_error(const CliResult& r, int code, const std::vector<std::string>& needles) {
    EXPECT_FALSE(r.signalled) << "crashed: " << r.err;
    EXPECT_EQ(r.exit_code, code) << r.err;
    for (const std::string& n : needles)
      EXPECT_NE(r.err.find(n), std::string::npos) << "message lacks '" << n << "': " << r.err;
  }

  // Overwrites element `index` of tensor `name` (F32) in a safetensors file.
  void poke_f32(const fs::path& file, const std::string& name, size_t index, float value) {
    std::string bytes = read_bytes(file);
    uint64_t header_len = 0;
    std::memcpy(&header_len, bytes.data(), 8);
    const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_len));
    const auto& t = header.at(name);
    ASSERT_EQ(t["dtype"], "F32");
    const size_t at = 8 + header_len + (size_t)t["data_offsets"][0] + 4 * index;
    ASSERT_LT(at + 4, 8 + header_len + (size_t)t["data_offsets"][1] + 1);
    std::memcpy(bytes.data() + at, &value, 4);
    write_bytes(file, bytes);
  }

  void expect_clean_failure(const CliResult& r, const std::string& needle) {
    EXPECT_FALSE(r.signalled) << "crashed: " << r.err;
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << "message lacks '" << needle << "': " << r.err;
    EXPECT_FALSE(fs::exists(out())) << "no output may be written on failure";
    EXPECT_FALSE(fs::exists(out().string() + ".tmp")) << "no temporary file may be left behind";
  }

  void edit_config(const std::function<void(nlohmann::json&)>& edit) {
    std::ifstream in(model_ / "config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    edit(j);
    std::ofstream(model_ / "config.json") << j.dump(2);
  }

  std::string read_bytes(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  void write_bytes(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

  fs::path tmp_, model_, input_;
};

TEST_F(CliErrors, TheUnmodifiedCopyWorks) {
  const CliResult r = forward();
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(out()));
}

TEST_F(CliErrors, TruncatedSafetensors) {
  const fs::path w = model_ / "model.safetensors";
  std::string bytes = read_bytes(w);
  write_bytes(w, bytes.substr(0, bytes.size() / 2));
  expect_clean_failure(forward(), "model.safetensors");
}

TEST_F(CliErrors, HeaderLengthBeyondTheFile) {
  const fs::path w = model_ / "model.safetensors";
  std::string bytes = read_bytes(w);
  const uint64_t huge = (uint64_t)bytes.size() * 4;
  std::memcpy(bytes.data(), &huge, 8);
  write_bytes(w, bytes);
  expect_clean_failure(forward(), "model.safetensors");
}

TEST_F(CliErrors, ConfigMissingARequiredField) {
  edit_config([](nlohmann::json& j) { j.erase("vocab_size"); });
  expect_clean_failure(forward(), "vocab_size");
}

TEST_F(CliErrors, ConfigTopKLargerThanExperts) {
  edit_config([](nlohmann::json& j) { j["num_experts_per_tok"] = 9; });
  expect_clean_failure(forward(), "num_experts_per_tok");
}

TEST_F(CliErrors, ConfigHeadsNotDividingHidden) {
  edit_config([](nlohmann::json& j) {
    j["num_attention_heads"] = 5;
    j["num_key_value_heads"] = 5;
    j.erase("head_dim");
  });
  expect_clean_failure(forward(), "num_attention_heads");
}

TEST_F(CliErrors, ConfigDisagreeingWithTheWeights) {
  edit_config([](nlohmann::json& j) { j["intermediate_size"] = (int)j["intermediate_size"] + 2; });
  expect_clean_failure(forward(), "shape");
}

TEST_F(CliErrors, TokenIdBeyondTheVocabulary) {
  // Rewrite the input with one id = vocab_size.
  std::string bytes = read_bytes(input_);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_len));
  const auto& ids = header["input_ids"];
  ASSERT_EQ(ids["dtype"], "I64");
  const size_t begin = 8 + header_len + (size_t)ids["data_offsets"][0];
  std::ifstream cin(model_ / "config.json");
  const int64_t vocab = nlohmann::json::parse(cin)["vocab_size"];
  std::memcpy(bytes.data() + begin + 3 * 8, &vocab, 8);
  write_bytes(input_, bytes);
  expect_clean_failure(forward(), "input_ids[0][3]");
}

TEST_F(CliErrors, InputWithoutInputIds) {
  input_ = model_ / "model.safetensors";  // a valid safetensors file without input_ids
  expect_clean_failure(forward(), "input_ids");
}

TEST_F(CliErrors, PickleCheckpointIsRefusedWithAHint) {
  fs::remove(model_ / "model.safetensors");
  write_bytes(model_ / "pytorch_model.bin", "not really a pickle");
  expect_clean_failure(forward(), "pytorch_model.bin");
}

// config.json asking for far more parameters than its 300 KB of weights hold (vocab_size 2^22):
// refused from the tensor headers, before the gigabytes the config implies are allocated (the
// review saw 15 s and 6.3 GB before the shape error).
TEST_F(CliErrors, ConfigFarLargerThanTheWeightsIsRefusedBeforeAllocating) {
  edit_config([](nlohmann::json& j) { j["vocab_size"] = 1 << 22; });
  rusage before{}, after{};
  getrusage(RUSAGE_CHILDREN, &before);
  const CliResult r = forward();
  getrusage(RUSAGE_CHILDREN, &after);
  expect_clean_failure(r, "model.embed_tokens.weight' has shape");
  // 2^22 x 64 x 4 bytes x (parameters + gradients) would be 2 GiB; the check needs none of it.
  EXPECT_LT(after.ru_maxrss, 1024L * 1024) << "peak RSS of the children, KiB";
}

// NaN or Inf weights: forward gave all-NaN logits with exit 0 and generate streamed garbage; both
// refuse the model now, naming the tensor and the file.
TEST_F(CliErrors, NonFiniteWeightsAreRefusedNamingTheTensor) {
  const fs::path w = model_ / "model.safetensors";
  poke_f32(w, "model.layers.1.self_attn.o_proj.weight", 5, std::nanf(""));
  CliResult r = forward();
  expect_clean_failure(r, "model.layers.1.self_attn.o_proj.weight");
  EXPECT_NE(r.err.find("non-finite"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(w.string()), std::string::npos) << r.err;
  r = run_cli("generate --model " + model_.string() + " --prompt-ids 1,2,3 --max-new-tokens 4");
  expect_error(r, 1, {"model.layers.1.self_attn.o_proj.weight", "non-finite", w.string()});

  fs::copy_file(kGolden / "model.safetensors", w, fs::copy_options::overwrite_existing);
  poke_f32(w, "model.norm.weight", 0, -INFINITY);
  r = forward();
  expect_clean_failure(r, "model.norm.weight");
  EXPECT_NE(r.err.find("-inf"), std::string::npos) << r.err;
  // With --quantize q8_0 the small tensors are read with pread, not through the mapping: checked too.
  r = run_cli("generate --model " + model_.string() + " --prompt-ids 1,2,3 --max-new-tokens 4 --quantize q8_0");
  expect_error(r, 1, {"model.norm.weight", "non-finite", w.string()});
}

// Every --threads is bounded (4 x the hardware threads): `bench generate --threads 1000` on 2 cores
// never finished.  Refused at once, before any work, naming the option.
TEST_F(CliErrors, ThreadCountsAreBounded) {
  const std::string m = model_.string(), in = (tmp_ / "in.jsonl").string();
  write_bytes(in, "{\"text\": \"a b\"}\n");
  const std::vector<std::string> commands = {
      "bench generate --new-tokens 2 --prompt-tokens 1",
      "bench train",
      "bench data --input " + in + " --tokenizer " + (tmp_ / "no.model").string(),
      "data prepare --input " + in + " --tokenizer " + (tmp_ / "no.model").string() + " --output " +
          (tmp_ / "out_data").string(),
      "tokenizer train --input " + in + " --vocab-size 300 --output " + (tmp_ / "tok").string(),
      "generate --model " + m + " --prompt-ids 1,2",
      "chat --model " + m,
      "serve --model " + m + " --port 0",
  };
  for (const std::string& c : commands) {
    SCOPED_TRACE(c);
    expect_error(run_cli(c + " --threads 1000000"), 1, {"--threads 1000000: at most", "hardware threads"});
    expect_error(run_cli(c + " --threads -2"), 1, {"--threads -2"});
  }
  expect_error(run_cli("serve --model " + m + " --port 0 --http-threads 100000"), 1, {"--http-threads 100000"});
  EXPECT_FALSE(fs::exists(tmp_ / "out_data"));
  EXPECT_FALSE(fs::exists(tmp_ / "tok.model"));
}

// forward --force replaces an earlier output, never an input: the model's weights (through a
// symlink too), --input, or the --output file given again as --grads.  Refused with exit 2 before any
// work, every input left as it was.
TEST_F(CliErrors, ForwardNeverWritesOverAnInputEvenWithForce) {
  const std::string weights = read_bytes(model_ / "model.safetensors"), input = read_bytes(input_);
  fs::create_symlink(model_ / "model.safetensors", tmp_ / "link.safetensors");
  const std::string base = "forward --force --model " + model_.string() + " --input " + input_.string();
  for (const fs::path& target : {model_ / "model.safetensors", input_, tmp_ / "link.safetensors", model_ / "config.json"}) {
    SCOPED_TRACE(target.string());
    expect_error(run_cli(base + " --output " + target.string()), 2, {"one of the input files", "never replaced"});
    expect_error(run_cli(base + " --output " + out().string() + " --grads " + target.string()), 2,
                 {"--grads", "one of the input files"});
  }
  expect_error(run_cli(base + " --output " + out().string() + " --grads " + out().string()), 2,
               {"--grads", "is the --output file too"});
  EXPECT_EQ(read_bytes(model_ / "model.safetensors"), weights);
  EXPECT_EQ(read_bytes(input_), input);
  EXPECT_FALSE(fs::exists(out()));
  // An earlier output is replaced with --force.
  write_bytes(out(), "old");
  ASSERT_EQ(run_cli(base + " --output " + out().string()).exit_code, 0);
  EXPECT_NE(read_bytes(out()), "old");
}

// tokenizer train --force replaced a JSONL input named like its PREFIX.model; data prepare may not
// write into a directory holding its input or tokenizer.  Both refuse with exit 2, the inputs intact.
TEST_F(CliErrors, TokenizerTrainAndDataPrepareNeverWriteOverAnInput) {
  const fs::path data = tmp_ / "corpus.model";  // a JSONL file, whatever its name
  std::string lines;
  for (int i = 0; i < 50; i++) lines += "{\"text\": \"sparse experts route token " + std::to_string(i) + "\"}\n";
  write_bytes(data, lines);
  expect_error(run_cli("tokenizer train --input " + data.string() + " --vocab-size 100 --force --output " +
                       (tmp_ / "corpus").string()),
               2, {"--output", "corpus.model: is one of the input files"});
  EXPECT_EQ(read_bytes(data), lines);
  fs::copy_file(fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "generate" / "mixtral_gqa" / "tokenizer.model",
                tmp_ / "tok.model");
  fs::create_directories(tmp_ / "out");
  fs::copy_file(data, tmp_ / "out" / "train.jsonl");
  expect_error(run_cli("data prepare --input " + (tmp_ / "out" / "train.jsonl").string() + " --tokenizer " +
                       (tmp_ / "tok.model").string() + " --output " + (tmp_ / "out").string()),
               2, {"--output", "is a directory holding one of the input files"});
  EXPECT_EQ(read_bytes(tmp_ / "out" / "train.jsonl"), lines);
}

// report --output onto the run's metrics.jsonl replaced the log it reads: refused (exit 2), the run
// directory as it was.
TEST_F(CliErrors, ReportNeverWritesOverTheRunItReads) {
  const fs::path run = tmp_ / "run";
  fs::create_directories(run / "checkpoints" / "step-000001");
  write_bytes(run / "metrics.jsonl", "{\"step\": 1, \"loss\": 2.0}\n");
  write_bytes(run / "checkpoints" / "step-000001" / "config.json", "{}");
  for (const fs::path& target : {run / "metrics.jsonl", run / "checkpoints" / "step-000001" / "config.json"}) {
    SCOPED_TRACE(target.string());
    expect_error(run_cli("report " + run.string() + " --output " + target.string()), 2,
                 {"--output", "one of the input files"});
  }
  EXPECT_EQ(read_bytes(run / "metrics.jsonl"), "{\"step\": 1, \"loss\": 2.0}\n");
  EXPECT_EQ(read_bytes(run / "checkpoints" / "step-000001" / "config.json"), "{}");
}

}  // namespace
