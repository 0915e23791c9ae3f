// moetron tokenizer: placeholder until the dataset-preparation work lands (issue 3).
#include <cstdio>

#include "cli/commands.h"

namespace moetron::cli {

int run_tokenizer(int, char**) {
  std::fprintf(stderr, "moetron tokenizer: not implemented yet\n");
  return 2;
}

}  // namespace moetron::cli
