// The real Mixtral tokenizer from ../shared/data, for tests that need it; they skip when it is absent.
#pragma once

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "tokenizer/tokenizer.h"

namespace moetron::testing {

inline const std::string kMixtral = std::string(MOETRON_SOURCE_DIR) + "/../shared/data/mixtral-tokenizer.model";

inline const Tokenizer& mixtral() {
  static Tokenizer t = Tokenizer::load(kMixtral);
  return t;
}

}  // namespace moetron::testing

#define REQUIRE_MIXTRAL()                                                                 \
  if (!std::filesystem::exists(moetron::testing::kMixtral))                              \
  GTEST_SKIP() << "the Mixtral tokenizer is not at " << moetron::testing::kMixtral       \
               << " (../shared/data is absent); this test needs the real tokenizer"
