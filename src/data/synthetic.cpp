#include "data/synthetic.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"

namespace moetron {

namespace {

std::string chat_line(const std::string& user, const std::string& assistant) {
  const nlohmann::json j = {{"messages",
                             {{{"role", "user"}, {"content", user}}, {{"role", "assistant"}, {"content", assistant}}}}};
  return j.dump();
}

std::string addition_question(int a, int b, int phrasing) {
  switch (phrasing % 4) {
    case 0: return fmt::format("What is {} + {}?", a, b);
    case 1: return fmt::format("{} + {} = ?", a, b);
    case 2: return fmt::format("Add {} and {}.", a, b);
    default: return fmt::format("What is the sum of {} and {}?", a, b);
  }
}

// Writes to PATH.tmp and renames, so a failed run leaves no partial file.
class AtomicText {
 public:
  explicit AtomicText(std::string path) : path_(std::move(path)), out_(path_ + ".tmp") {
    if (!out_) fail("{}: cannot open for writing", path_ + ".tmp");
  }
  void line(const std::string& s) { out_ << s << '\n'; }
  void commit() {
    out_.close();
    if (!out_) fail("{}: write failed", path_ + ".tmp");
    std::filesystem::rename(path_ + ".tmp", path_);
  }

 private:
  std::string path_;
  std::ofstream out_;
};

}  // namespace

void write_synthetic_chat(const std::string& train_path, const std::string& test_path, const SyntheticOptions& o) {
  if (o.task != "addition") fail("synthetic task '{}' is unknown; available: addition", o.task);
  const long pairs = 100 * 100;
  if (o.test_examples < 0 || o.test_examples >= pairs)
    fail("synthetic: test examples must be in [0, {}), got {}", pairs, o.test_examples);
  if (o.train_examples <= 0) fail("synthetic: train examples must be positive, got {}", o.train_examples);
  // A seeded permutation of all (a, b) pairs: the first test_examples are held out.
  std::vector<int> order(pairs);
  for (int i = 0; i < pairs; i++) order[i] = i;
  for (long i = pairs - 1; i > 0; i--) {
    const long j = (long)(mix64(o.seed * 0x9e3779b97f4a7c15ULL + (uint64_t)i) % (uint64_t)(i + 1));
    std::swap(order[i], order[j]);
  }
  AtomicText test(test_path);
  for (long i = 0; i < o.test_examples; i++) {
    const int a = order[i] / 100, b = order[i] % 100;
    test.line(chat_line(addition_question(a, b, (int)i), std::to_string(a + b)));
  }
  AtomicText train(train_path);
  const long usable = pairs - o.test_examples;
  for (long i = 0; i < o.train_examples; i++) {
    const int p = order[o.test_examples + (long)(mix64(o.seed + 7 + (uint64_t)i) % (uint64_t)usable)];
    const int a = p / 100, b = p % 100;
    train.line(chat_line(addition_question(a, b, (int)(mix64(o.seed + 11 + (uint64_t)i) % 4)), std::to_string(a + b)));
  }
  test.commit();
  train.commit();
}

}  // namespace moetron
