// Entry points of the subcommands; each takes the arguments after "moetron" (argv[0] = command).
#pragma once

namespace moetron::cli {

int run_forward(int argc, char** argv);
int run_bench(int argc, char** argv);

}  // namespace moetron::cli
