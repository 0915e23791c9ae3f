#include "cli/generation_options.h"

#include <random>

#include <omp.h>

#include "cli/threads.h"

namespace moetron::cli {

void add_generation_options(CLI::App& app, GenerationOptions& g) {
  app.add_option("--temperature", g.sampling.temperature, "0: greedy (default; so is anything below 1e-5); > 0: sample at this temperature");
  app.add_option("--top-k", g.sampling.top_k, "sample from the k most likely tokens (0: off)");
  app.add_option("--top-p", g.sampling.top_p, "nucleus sampling threshold (1: off)");
  app.add_option("--repetition-penalty", g.sampling.repetition_penalty, "HF repetition penalty (1: off)");
  app.add_option("--seed", g.seed, "sampling seed (default: random)");
  app.add_option("--stop", g.stop, "stop strings (a reply ends before the first one)");
  app.add_option("--threads", g.threads, "threads for OpenMP and BLAS (default: all)");
}

void add_quantize_option(CLI::App& app, std::string& value) {
  app.add_option("--quantize", value,
                 "weights: none (as stored: bf16/f16/f32, used in place) | q8_0 (quantized to 8 bits at load, "
                 "llama.cpp's Q8_0: half the memory of bf16, faster decoding, a small accuracy cost)");
}

void add_model_options(CLI::App& app, ModelOptions& m) {
  app.add_option("--model", m.dir, "model directory")->required();
  app.add_option("--lora", m.lora_dir, "a PEFT LoRA adapter directory for the model (e.g. a LoRA run's checkpoint)");
  add_quantize_option(app, m.quantize);
  app.add_option("--tokenizer", m.tokenizer_path,
                 "tokenizer.model or tokenizer.json (default: MODEL/tokenizer.model, else MODEL/tokenizer.json)");
  app.add_option("--template", m.template_name, "chat template: auto (the model's) | mistral | llama2 | chatml | raw");
}

std::unique_ptr<InferenceModel> load_model(const ModelOptions& m) {
  return load_inference_model(m.dir, m.lora_dir, false, parse_weight_quant(m.quantize, "--quantize"));
}

void apply_generation_options(GenerationOptions& g) {
  g.sampling.seed = g.seed >= 0 ? (uint64_t)g.seed : std::random_device{}();
  validate_sampling(g.sampling);
  check_thread_count("--threads", g.threads);
  if (g.threads > 0) omp_set_num_threads(g.threads);  // inference uses no BLAS library (infer/gemm.h)
}

}  // namespace moetron::cli
