// Untrusted JSON nested without bound (src/core/json_limits.h): ~200 KB of brackets nested 10^5
// deep once crashed forward / serve / report / train (resume) / eval / convert with a stack
// overflow in nlohmann's recursive dump().  Every reader now refuses more than 64 levels with a
// message naming the file, and error messages print bounded previews.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/json_limits.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "server/openai_api.h"

namespace fs = std::filesystem;

namespace moetron {
namespace {

std::string nested(int depth, const std::string& leaf = "1") {
  return std::string(depth, '[') + leaf + std::string(depth, ']');
}

int run(const std::string& args, std::string* out) {
  FILE* p = popen((std::string(MOETRON_BINARY) + " " + args + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t n;
  out->clear();
  while (p && (n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
  const int rc = p ? pclose(p) : -1;
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + WTERMSIG(rc);
}

TEST(JsonLimits, DepthIsBoundedAndTheMessageNamesTheSource) {
  EXPECT_NO_THROW(parse_json(nested(kMaxJsonDepth), "ok.json"));
  for (int depth : {kMaxJsonDepth + 1, 100000}) {
    try {
      parse_json(nested(depth), "deep.json");
      ADD_FAILURE() << "depth " << depth << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("deep.json: JSON nested deeper than 64 levels"), std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(parse_json_or_discarded(nested(depth)).is_discarded());
  }
  EXPECT_THROW(parse_json("{\"a\": ", "bad.json"), Error);
  EXPECT_FALSE(parse_json_or_discarded("{\"a\": [1, {\"b\": 2}]}").is_discarded());
}

TEST(JsonLimits, PreviewsAreBoundedAndMatchDumpForSmallValues) {
  const nlohmann::json small = nlohmann::json::parse("{\"a\":[1,2,{\"b\":\"x\"}],\"c\":null}");
  EXPECT_EQ(json_preview(small), small.dump());
  EXPECT_EQ(json_preview(nlohmann::json("text")), "\"text\"");
  // A value built deeper than any parsed one, in memory (moved, never copied: copying recurses):
  // the preview stays short.
  nlohmann::json deep = 1;
  for (int i = 0; i < 1000; i++) {
    nlohmann::json next = nlohmann::json::array();
    next.push_back(std::move(deep));
    deep = std::move(next);
  }
  EXPECT_LE(json_preview(deep).size(), 83u);
  EXPECT_LE(json_preview(nlohmann::json(std::string(1 << 20, 'x'))).size(), 83u);
}

class DeepFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("moetron_deep_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_;
};

TEST_F(DeepFiles, ConfigJsonWithADeepExtraFieldIsAnErrorNotACrash) {
  const fs::path golden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "mixtral_gqa";
  const fs::path dir = root_ / "model";
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(golden)) fs::copy(e.path(), dir / e.path().filename());
  std::string cfg;
  {
    std::ifstream in(golden / "config.json");
    cfg.assign(std::istreambuf_iterator<char>(in), {});
  }
  cfg.insert(cfg.find('{') + 1, "\"deep\": " + nested(100000) + ", ");
  std::ofstream(dir / "config.json") << cfg;
  EXPECT_THROW(load_model_config((dir / "config.json").string()), Error);
  std::string out;
  const int rc = run("forward --model " + dir.string() + " --input " + (golden / "input.safetensors").string() +
                         " --output " + (root_ / "o.safetensors").string(),
                     &out);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("config.json: JSON nested deeper than 64 levels"), std::string::npos) << out;
  const int rc2 = run("convert --input " + dir.string() + " --output " + (root_ / "converted").string(), &out);
  EXPECT_NE(rc2, 0) << out;
  EXPECT_LT(rc2, 128) << "no crash: " << out;
}

TEST_F(DeepFiles, SafetensorsHeaderNestedDeepIsRefused) {
  const std::string header = "{\"t\": {\"dtype\": \"F32\", \"shape\": " + nested(100000) + ", \"data_offsets\": [0, 4]}}";
  const fs::path f = root_ / "deep.safetensors";
  {
    std::ofstream out(f, std::ios::binary);
    const uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header;
    out.write("\0\0\0\0", 4);
  }
  try {
    SafetensorsFile::open(f.string());
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nested deeper than 64 levels"), std::string::npos) << e.what();
  }
}

TEST_F(DeepFiles, ReportOfDeepMetricsIsAnError) {
  const fs::path run_dir = root_ / "run";
  fs::create_directories(run_dir);
  std::ofstream(run_dir / "metrics.jsonl") << "{\"step\": 1, \"loss\": 2.0, \"moe\": " + nested(100000) + "}\n";
  std::string out;
  const int rc = run("report " + run_dir.string(), &out);
  EXPECT_NE(rc, 0) << out;
  EXPECT_LT(rc, 128) << "no crash: " << out;
  EXPECT_NE(out.find("metrics.jsonl:1: JSON nested deeper than 64 levels"), std::string::npos) << out;
}

TEST(JsonLimitsServe, DeepRequestBodyIsA400) {
  const std::string body = "{\"messages\": [{\"role\": \"user\", \"content\": " + nested(100000, "\"x\"") + "}]}";
  EXPECT_THROW(server::parse_request(server::Endpoint::chat, body), server::ApiError);
}

}  // namespace
}  // namespace moetron
