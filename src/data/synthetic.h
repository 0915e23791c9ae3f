// A deterministic synthetic chat dataset for the demo: a task a tiny model can visibly learn on a
// CPU in minutes, with a held-out test set of examples never seen in training.
//   addition: "What is 37 + 48?" -> "85" (a, b in 0..99, several phrasings).  The (a, b) pairs of
//   the test set never occur in the training set.
#pragma once

#include <cstdint>
#include <string>

namespace moetron {

struct SyntheticOptions {
  std::string task = "addition";
  long train_examples = 20000;
  long test_examples = 200;
  uint64_t seed = 1;
};

// Writes chat JSONL ({"messages": [{"role": "user", ...}, {"role": "assistant", ...}]} per line).
void write_synthetic_chat(const std::string& train_path, const std::string& test_path, const SyntheticOptions& o);

}  // namespace moetron
