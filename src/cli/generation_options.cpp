#include "cli/generation_options.h"

#include <random>

#include <omp.h>

#include "backend/select.h"
#include "cli/threads.h"
#include "core/error.h"
#include "infer/model_runner.h"

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
  app.add_option("--device", m.device,
                 "cpu (the default: the weights used in place, SIMD kernels) | cuda (one GPU: the model's layer "
                 "body in bf16, the KV caches on the device)");
  app.add_option("--lora", m.lora_dir, "a PEFT LoRA adapter directory for the model (e.g. a LoRA run's checkpoint)");
  add_quantize_option(app, m.quantize);
  app.add_option("--tokenizer", m.tokenizer_path,
                 "tokenizer.model or tokenizer.json (default: MODEL/tokenizer.model, else MODEL/tokenizer.json)");
  app.add_option("--template", m.template_name, "chat template: auto (the model's: its Jinja template with a tokenizer.json) | jinja | F.jinja | mistral | llama2 | chatml | raw");
}

LoadedModel load_model(const ModelOptions& m) {
  const WeightQuant quant = parse_weight_quant(m.quantize, "--quantize");
  LoadedModel out;
  if (m.device == "cpu") {
    out.weights = load_inference_model(m.dir, m.lora_dir, false, quant);
    out.cfg = out.weights->cfg;
    out.storage = out.weights->storage_name();
    out.runner = std::make_unique<ModelRunner>(*out.weights);
    return out;
  }
  if (m.device != "cuda") throw InputError(fmt::format("--device: '{}' is not a device (cpu, cuda)", m.device));
  const std::string why = device_unavailable_reason(m.device);
  if (!why.empty()) throw InputError(fmt::format("--device cuda: {}", why));
  if (quant != WeightQuant::none)
    throw InputError("--quantize q8_0 runs on the CPU only (--device cuda keeps the weights in bf16)");
  auto runner = std::make_unique<ModelRunner>(make_backend(m.device), m.dir, m.lora_dir);
  out.cfg = runner->config();
  out.storage = "cuda bf16";
  out.runner = std::move(runner);
  return out;
}

void apply_generation_options(GenerationOptions& g) {
  g.sampling.seed = g.seed >= 0 ? (uint64_t)g.seed : std::random_device{}();
  validate_sampling(g.sampling);
  check_thread_count("--threads", g.threads);
  if (g.threads > 0) omp_set_num_threads(g.threads);  // inference uses no BLAS library (backend/kernels/gemm.h)
}

}  // namespace moetron::cli
