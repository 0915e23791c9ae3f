// The demo's synthetic dataset: deterministic, correct answers, and a test set disjoint from training.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/synthetic.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

struct Example {
  int a, b;
  std::string answer;
};

std::vector<Example> read(const fs::path& p) {
  std::vector<Example> out;
  std::ifstream f(p);
  const std::regex two_numbers(R"((\d+)\D+(\d+))");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    const std::string q = j["messages"][0]["content"];
    std::smatch m;
    EXPECT_TRUE(std::regex_search(q, m, two_numbers)) << q;
    EXPECT_EQ(j["messages"][0]["role"], "user");
    EXPECT_EQ(j["messages"][1]["role"], "assistant");
    out.push_back({std::stoi(m[1]), std::stoi(m[2]), j["messages"][1]["content"]});
  }
  return out;
}

}  // namespace

TEST(Synthetic, AdditionIsDeterministicCorrectAndHeldOut) {
  const fs::path dir = fs::temp_directory_path() / ("moetron_synth_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  SyntheticOptions o;
  o.train_examples = 3000;
  o.test_examples = 100;
  write_synthetic_chat((dir / "train.jsonl").string(), (dir / "test.jsonl").string(), o);
  write_synthetic_chat((dir / "train2.jsonl").string(), (dir / "test2.jsonl").string(), o);
  auto bytes = [](const fs::path& p) {
    std::ifstream f(p);
    return std::string((std::istreambuf_iterator<char>(f)), {});
  };
  EXPECT_EQ(bytes(dir / "train.jsonl"), bytes(dir / "train2.jsonl"));
  EXPECT_EQ(bytes(dir / "test.jsonl"), bytes(dir / "test2.jsonl"));
  const auto train = read(dir / "train.jsonl"), test = read(dir / "test.jsonl");
  ASSERT_EQ(train.size(), 3000u);
  ASSERT_EQ(test.size(), 100u);
  std::set<std::pair<int, int>> train_pairs, test_pairs;
  for (const auto& e : train) {
    EXPECT_EQ(e.answer, std::to_string(e.a + e.b));
    train_pairs.insert({e.a, e.b});
  }
  for (const auto& e : test) {
    EXPECT_EQ(e.answer, std::to_string(e.a + e.b));
    EXPECT_FALSE(train_pairs.count({e.a, e.b})) << e.a << " + " << e.b << " is also a training example";
    test_pairs.insert({e.a, e.b});
  }
  EXPECT_EQ(test_pairs.size(), 100u) << "test pairs are distinct";
  o.seed = 2;
  write_synthetic_chat((dir / "train3.jsonl").string(), (dir / "test3.jsonl").string(), o);
  EXPECT_NE(bytes(dir / "test.jsonl"), bytes(dir / "test3.jsonl"));
  o.task = "division";
  EXPECT_THROW(write_synthetic_chat((dir / "x.jsonl").string(), (dir / "y.jsonl").string(), o), Error);
  fs::remove_all(dir);
}
