// moetron data: placeholder until the dataset-preparation work lands (issue 3).
#include <cstdio>

#include "cli/commands.h"

namespace moetron::cli {

int run_data(int, char**) {
  std::fprintf(stderr, "moetron data: not implemented yet\n");
  return 2;
}

}  // namespace moetron::cli
