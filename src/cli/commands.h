// Entry points of the subcommands; each takes the arguments after "moetron" (argv[0] = command).
#pragma once

namespace moetron::cli {

int run_forward(int argc, char** argv);
int run_bench(int argc, char** argv);
int run_tokenizer(int argc, char** argv);  // src/cli/tokenizer.cpp
int run_data(int argc, char** argv);       // src/cli/data.cpp

}  // namespace moetron::cli
