// The moetron binary's generation commands: `generate` (token ids and text, greedy equal to
// transformers), `chat` (multi-turn history, /reset, /system), `bench generate`, and their bad-input
// errors (exit 1 with the field named).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cuda/runtime.h"
#include "temp_dir.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const fs::path kGen = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "generate";

struct CliRun {
  int code = -1;
  std::string out, err;
};

CliRun run(const std::string& args, const std::string& stdin_text = "") {
  moetron::testing::TempDir tmp("infer_cli");
  const std::string in = tmp.file("in.txt"), out = tmp.file("out.txt"), err = tmp.file("err.txt");
  std::ofstream(in) << stdin_text;
  const std::string cmd = "OMP_NUM_THREADS=2 " + std::string(MOETRON_BINARY) + " " + args + " < " + in + " > " + out +
                          " 2> " + err;
  const int status = std::system(cmd.c_str());
  CliRun r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = moetron::testing::read_text(out);
  r.err = moetron::testing::read_text(err);
  return r;
}

json expected() {
  std::ifstream in(kGen / "expected.json");
  return json::parse(in);
}

std::string join_ids(const json& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); i++) {
    if (i) s += ',';
    s += std::to_string(ids[i].get<int>());
  }
  return s;
}

}  // namespace

TEST(GenerateCli, TokenIdsEqualTransformers) {
  const json exp = expected();
  for (const json& c : exp["cases"]) {
    const CliRun r = run("generate --model " + (kGen / c["model"].get<std::string>()).string() + " --prompt-ids " +
                      join_ids(c["prompt_ids"]) + " --max-new-tokens 32 --stats");
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.out, join_ids(c["expected_ids"]) + "\n");
    EXPECT_NE(r.err.find("decode"), std::string::npos) << r.err;
  }
}

// --temperature below 1e-5 is greedy: the sampler divided by 1e-45, overflowing every logit.
TEST(GenerateCli, DenormalTemperatureIsGreedy) {
  const json c = expected()["cases"][0];
  const std::string base = "generate --model " + (kGen / c["model"].get<std::string>()).string() + " --prompt-ids " +
                           join_ids(c["prompt_ids"]) + " --max-new-tokens 32 --seed 3";
  for (const char* t : {"1e-45", "1e-30", "0.000001"}) {
    const CliRun r = run(base + " --temperature " + t);
    ASSERT_EQ(r.code, 0) << t << "\n" << r.err;
    EXPECT_EQ(r.out, join_ids(c["expected_ids"]) + "\n") << t;
  }
}

TEST(GenerateCli, TextPlainAndChat) {
  const json t = expected()["cases"][0]["text"];
  const std::string model = (kGen / "mixtral_gqa").string();
  CliRun r = run("generate --model " + model + " --max-new-tokens 16 --prompt '" + t["completion"]["prompt"].get<std::string>() + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, t["completion"]["text"].get<std::string>() + "\n");
  r = run("generate --model " + model + " --max-new-tokens 16 --chat --prompt '" + t["chat"]["user"].get<std::string>() + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, t["chat"]["content"].get<std::string>() + "\n");
  // Sampling with a seed is reproducible; a different seed (almost surely) differs somewhere.
  const std::string samp = "generate --model " + model + " --max-new-tokens 24 --temperature 1.5 --top-k 50 --top-p 0.95 "
                           "--repetition-penalty 1.1 --prompt 'Once upon'";
  const CliRun a = run(samp + " --seed 1"), b = run(samp + " --seed 1"), c = run(samp + " --seed 2");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.out, c.out);
  // A stop string.
  const std::string full = t["completion"]["text"];
  const std::string stop = full.substr(full.size() / 2, 3);
  r = run("generate --model " + model + " --max-new-tokens 16 --stop '" + stop + "' --prompt '" +
          t["completion"]["prompt"].get<std::string>() + "'");
  EXPECT_EQ(r.out, full.substr(0, full.find(stop)) + "\n");
}

TEST(ChatCli, HistoryResetAndSystem) {
  const json t = expected()["cases"][0]["text"];
  const std::string model = (kGen / "mixtral_gqa").string();
  const std::string user = t["chat"]["user"];
  // Turn 1 equals the one-shot chat reply; after /reset the same question gets the same reply again,
  // while a second turn without reset sees the history (a different prompt, so generally a different
  // reply than the first turn).
  const CliRun r = run("chat --model " + model + " --max-new-tokens 16", user + "\n" + user + "\n/reset\n" + user +
                                                                          "\n/system Be brief.\n" + user + "\n/exit\n");
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> lines;
  std::stringstream ss(r.out);
  for (std::string l; std::getline(ss, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 6u) << r.out;
  EXPECT_EQ(lines[0], t["chat"]["content"].get<std::string>());
  EXPECT_NE(lines[1], lines[0]);
  EXPECT_EQ(lines[2], "[conversation reset]");
  EXPECT_EQ(lines[3], t["chat"]["content"].get<std::string>());
  EXPECT_EQ(lines[4], "[system message set; conversation reset]");
  EXPECT_NE(lines[5], lines[0]);
}

TEST(GenerateCli, BadInputFailsCleanly) {
  const std::string model = (kGen / "mixtral_gqa").string();
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {"generate --model " + model, "exactly one of"},
      {"generate --model " + model + " --prompt x --temperature -1", "temperature"},
      {"generate --model " + model + " --prompt x --top-p 0", "top_p"},
      {"generate --model " + model + " --prompt x --max-new-tokens -3", "--max-new-tokens"},
      {"generate --model " + model + " --prompt-ids 1,x,3", "--prompt-ids"},
      {"generate --model " + model + " --prompt-ids 1,99999", "outside the vocabulary"},
      {"generate --model " + model + " --prompt x --chat --template nope", "nope"},
      {"generate --model " + (kGen / "llama_dense").string() + " --prompt hello", "tokenizer"},
      {"generate --model /nonexistent --prompt x", "/nonexistent"},
      {"chat --model " + model + " --top-k -2", "top_k"},
      {"serve --model " + model + " --port 70000", "70000"},
      {"serve --model " + model + " --queue-size 0", "queue"},
      {"generate --model " + model + " --prompt x --quantize int4", "--quantize: 'int4'"},
      {"serve --model " + model + " --quantize q4", "--quantize: 'q4'"},
      {"bench generate --quantize q8_0", "--quantize needs --model"},
      {"generate --model " + model + " --perplexity /nonexistent.txt", "/nonexistent.txt"},
      {"generate --model " + model + " --perplexity " + std::string(MOETRON_SOURCE_DIR) + "/tests/data/apache-2.0.txt --ppl-ctx 1",
       "at least 2 tokens"},
      {"generate --model " + model + " --perplexity " + std::string(MOETRON_SOURCE_DIR) + "/tests/data/apache-2.0.txt --ppl-ctx 100000",
       "beyond the model's"},
      {"generate --model " + model + " --perplexity " + std::string(MOETRON_SOURCE_DIR) + "/tests/data/apache-2.0.txt --ppl-step 0",
       "at least 1"},
  };
  for (const Case& c : cases) {
    const CliRun r = run(c.args);
    EXPECT_EQ(r.code, 1) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << c.args << "\n" << r.err;
  }
}

// --perplexity prints the library's perplexity; --quantize q8_0 loads Q8_0 (named in the line).
TEST(GenerateCli, PerplexityOfATextWithAndWithoutQ8) {
  const std::string base = "generate --model " + std::string(MOETRON_SOURCE_DIR) + "/tests/golden/perplexity --perplexity " +
                           std::string(MOETRON_SOURCE_DIR) + "/tests/data/apache-2.0.txt --ppl-ctx 256";
  const CliRun bf = run(base), q8 = run(base + " --quantize q8_0");
  ASSERT_EQ(bf.code, 0) << bf.err;
  ASSERT_EQ(q8.code, 0) << q8.err;
  EXPECT_EQ(bf.out.rfind("perplexity: 36.5338 (7717 tokens scored in 31 windows of up to 256; weights BF16)", 0), 0u) << bf.out;
  EXPECT_EQ(q8.out.rfind("perplexity: 36.60", 0), 0u) << q8.out;
  EXPECT_NE(q8.out.find("weights Q8_0"), std::string::npos) << q8.out;
}

// A model whose activations overflow (every final-norm weight 1e38, finite in bf16): --perplexity
// printed "-nan" with exit 0 as if it were a measurement; it stops naming the non-finite logits now.
TEST(GenerateCli, PerplexityOfOverflowingActivationsIsAnError) {
  moetron::testing::TempDir tmp("ppl_overflow");
  const fs::path model = tmp.path() / "model";
  fs::copy(fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "perplexity", model);
  {
    std::fstream f(model / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    uint64_t n = 0;
    f.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, '\0');
    f.read(header.data(), (std::streamsize)n);
    const json t = json::parse(header)["model.norm.weight"];
    ASSERT_EQ(t["dtype"], "BF16");
    const uint16_t big = 0x7e96;  // bf16 1.0e38
    const uint64_t begin = t["data_offsets"][0], end = t["data_offsets"][1];
    f.seekp((std::streamoff)(8 + n + begin));
    for (uint64_t i = begin; i < end; i += 2) f.write(reinterpret_cast<const char*>(&big), 2);
  }
  const CliRun r = run("generate --model " + model.string() + " --perplexity " + std::string(MOETRON_SOURCE_DIR) +
                       "/tests/data/apache-2.0.txt --ppl-ctx 256");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("perplexity: the logits at position 0 are not finite"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("perplexity: "), std::string::npos) << r.out;
}

// The bench commands' sizes are bounded before anything is allocated, naming the flag and its range
// (--batch 1000000 ran past a minute at ~2 GB; --new-tokens 1e9 ended in std::bad_alloc; --batch -1 was
// taken; CLI11's check printed "not in range 0.000000 to 1.797...e308").
TEST(BenchGenerateCli, SizesAreBoundedNamingTheFlag) {
  const std::string model = " --model " + (kGen / "mixtral_gqa").string();
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {"bench generate" + model + " --batch 1000000", "--batch 1000000: expected an integer in [0, 1024]"},
      {"bench generate" + model + " --batch -1", "--batch -1: expected an integer in [0, 1024]"},
      {"bench generate" + model + " --prompt-tokens 1000000000", "--prompt-tokens 1000000000: expected an integer"},
      {"bench generate" + model + " --new-tokens 1", "--new-tokens 1: expected an integer in [2, "},
      {"bench generate" + model + " --prompt-tokens 500 --new-tokens 13", "513 positions; the model's max_position_embeddings is 512"},
      {"bench generate --hidden 16384 --intermediate 65536", "at most 1073741824 (2^30)"},
      {"bench train --hidden 16384 --intermediate 65536", "at most 1073741824 (2^30)"},
      {"bench train --seq 1", "--seq 1: expected an integer in [2, "},
      {"bench train --recompute yes", "--recompute: must be one of none, full, selective, got \"yes\""},
      {"bench checkpoint --make-model /nonexistent/m --experts 0", "--experts 0: expected an integer in [1, 1048576]"},
  };
  for (const Case& c : cases) {
    const CliRun r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << c.args << "\n" << r.err;
  }
}

// bench kernels: attention and the grouped expert GEMM through the CPU backend at small dimensions
// (the presets are real layers, for a GPU); every figure positive; sizes bounded before allocation.
TEST(BenchKernelsCli, TimesAttentionAndTheGroupedGemm) {
  const CliRun r = run("bench kernels --device cpu --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --experts 4 "
                       "--top-k 2 --intermediate 32 --seq 64 --runs 2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = json::parse(r.out.substr(r.out.rfind('{')));
  for (const char* k : {"attention_forward_tflops", "attention_backward_tflops", "grouped_gemm_forward_tflops",
                        "grouped_gemm_backward_tflops"})
    EXPECT_GT(j[k].get<double>(), 0) << k;
  const CliRun big = run("bench kernels --device cpu --shape mixtral-8x7b --seq 65536");
  EXPECT_EQ(big.code, 2) << big.err;
  EXPECT_NE(big.err.find("GiB, more than"), std::string::npos) << big.err;
  const CliRun bad = run("bench kernels --device cpu --shape llama --seq 64");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("--shape llama"), std::string::npos) << bad.err;
}

TEST(BenchGenerateCli, PrintsPrefillAndDecodeRates) {
  const CliRun r = run("bench generate --model " + (kGen / "mixtral_gqa").string() +
                    " --prompt-tokens 20 --new-tokens 8 --runs 1 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("prefill tokens/s: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("decode tokens/s: "), std::string::npos) << r.out;
  const std::string last = r.out.substr(r.out.rfind('{'));
  const json j = json::parse(last);
  EXPECT_GT(j["prefill_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(j["decode_tokens_per_s"].get<double>(), 0);
}

// --profile: the time of a decode step by section, one sequence's and a batch's; every section of a
// MoE model appears, none is negative, and together they stay within the step ("rest" >= 0).
TEST(BenchGenerateCli, ProfilePrintsEachSectionOfADecodeStep) {
  const CliRun r = run("bench generate --model " + (kGen / "mixtral_gqa").string() +
                       " --prompt-tokens 8 --new-tokens 6 --runs 1 --batch 3 --profile");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* what : {"profile of steps of the batch", "profile of one sequence's decode steps"}) {
    const size_t at = r.out.find(what);
    ASSERT_NE(at, std::string::npos) << what << "\n" << r.out;
    std::istringstream lines(r.out.substr(at));
    std::string line;
    std::getline(lines, line);  // the heading
    std::map<std::string, double> ms;
    while (std::getline(lines, line) && line.rfind("  ", 0) == 0) {
      const size_t end = line.find_last_not_of(" 0123456789.%-");
      const std::string name = line.substr(2, end - 1);
      ms[name] = std::stod(line.substr(end + 1));
    }
    for (const char* s : {"q/k/v", "attention", "o", "router and gathering", "experts", "experts combine", "head",
                          "rest"}) {
      ASSERT_TRUE(ms.count(s)) << what << ": no section " << s << "\n" << r.out;
      EXPECT_GE(ms[s], 0.0) << what << ": " << s << "\n" << r.out;
    }
    EXPECT_GT(ms["experts"], 0.0) << r.out;
    EXPECT_GT(ms["head"], 0.0) << r.out;
  }
}

// --device: cuda without a usable GPU (this build or machine) is refused with exit 2, naming the
// reason, before anything is read (the model directory does not even exist); an unknown device names
// the valid ones.  With a GPU, generate --device cuda gives transformers' greedy tokens.
TEST(GenerateCli, DeviceCudaRunsOnAGpuOrExits2BeforeAnyWork) {
  const std::string why = moetron::gpu::cuda_unavailable_reason();
  if (why.empty()) {
    const json exp = expected();
    for (const json& c : exp["cases"]) {
      const CliRun r = run("generate --device cuda --model " + (kGen / c["model"].get<std::string>()).string() +
                           " --prompt-ids " + join_ids(c["prompt_ids"]) + " --max-new-tokens 32");
      ASSERT_EQ(r.code, 0) << r.err;
      EXPECT_EQ(r.out, join_ids(c["expected_ids"]) + "\n");
    }
    return;
  }
  for (const std::string cmd : {"generate --prompt-ids 1,2", "chat", "serve --port 0"}) {
    SCOPED_TRACE(cmd);
    const CliRun r = run(cmd + " --device cuda --model /nonexistent-moetron-model");
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find("--device cuda"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("nonexistent"), std::string::npos) << r.err;
  }
  const CliRun r = run("generate --prompt-ids 1,2 --device tpu --model " + (kGen / "mixtral_gqa").string());
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("cpu, cuda"), std::string::npos) << r.err;
}
