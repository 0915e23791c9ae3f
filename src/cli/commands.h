// Entry points of the subcommands; each takes the arguments after "moetron" (argv[0] = command).
#pragma once

namespace moetron::cli {

int run_forward(int argc, char** argv);
int run_bench(int argc, char** argv);
int run_train(int argc, char** argv);       // src/cli/train.cpp
int run_eval(int argc, char** argv);        // src/cli/eval.cpp
int run_generate(int argc, char** argv);    // src/cli/generate.cpp
int run_chat(int argc, char** argv);        // src/cli/chat.cpp
int run_serve(int argc, char** argv);       // src/cli/serve.cpp
int run_bench_generate(int argc, char** argv);  // src/cli/bench_generate.cpp (moetron bench generate)
int run_bench_data(int argc, char** argv);  // src/cli/bench_data.cpp (moetron bench data)
int run_bench_checkpoint(int argc, char** argv);  // src/cli/bench_checkpoint.cpp
int run_bench_kernels(int argc, char** argv);     // src/cli/bench_kernels.cpp (moetron bench kernels)
int run_tokenizer(int argc, char** argv);  // src/cli/tokenizer.cpp
int run_data(int argc, char** argv);       // src/cli/data.cpp
int run_data_synthetic(int argc, char** argv);  // src/cli/data_synthetic.cpp (moetron data synthetic)
int run_convert(int argc, char** argv);    // src/cli/convert.cpp
int run_export(int argc, char** argv);     // src/cli/export.cpp (moetron export gguf)
int run_report(int argc, char** argv);     // src/cli/report.cpp
int run_plan(int argc, char** argv);       // src/cli/plan.cpp
int run_template(int argc, char** argv);   // src/cli/template.cpp (moetron template render)

}  // namespace moetron::cli
