// moetron bench generate: prefill and decode tokens/s of the KV-cache generator on a model directory
// (or a random model of a given shape), greedy, with pseudo-random prompt ids (the same ids
// bench/hf_generate.py gives transformers' generate).  Prefill = the prompt's forward pass on an empty
// cache; decode = each later token (choosing it from the logits plus its forward pass).  Medians over
// --runs after one untimed warm-up run.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <omp.h>

#include "cli/commands.h"
#include "core/error.h"
#include "core/rng.h"
#include "infer/decoder.h"
#include "infer/model.h"
#include "infer/sampler.h"
#include "ops/blas.h"

namespace moetron::cli {

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int run_bench_generate(int argc, char** argv) {
  CLI::App app{"Prefill and decode tokens/s of moetron's KV-cache generation (greedy) on one sequence.",
               "moetron bench generate"};
  std::string model_dir;
  int hidden = 256, layers = 4, heads = 8, kv_heads = 2, experts = 8, top_k = 2, inter = 512, vocab = 32000;
  int prompt_tokens = 128, new_tokens = 64, runs = 3, threads = 0;
  bool json = false;
  app.add_option("--model", model_dir, "HF model directory (default: a random model of the shape below)");
  app.add_option("--hidden", hidden);
  app.add_option("--layers", layers);
  app.add_option("--heads", heads);
  app.add_option("--kv-heads", kv_heads);
  app.add_option("--experts", experts, "0 for a dense (Mistral) model");
  app.add_option("--top-k", top_k);
  app.add_option("--intermediate", inter);
  app.add_option("--vocab", vocab);
  app.add_option("--prompt-tokens", prompt_tokens, "prompt length");
  app.add_option("--new-tokens", new_tokens, "tokens generated per run");
  app.add_option("--runs", runs, "timed runs (after one warm-up)");
  app.add_option("--threads", threads, "threads for OpenMP and BLAS (default: all)");
  app.add_flag("--json", json, "also print one JSON line with the figures");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (prompt_tokens < 1 || new_tokens < 2 || runs < 1)
    fail("need --prompt-tokens >= 1, --new-tokens >= 2 and --runs >= 1");
  if (threads > 0) {
    omp_set_num_threads(threads);
    ops::blas_set_num_threads(threads);
  }
  std::unique_ptr<InferenceModel> model;
  if (!model_dir.empty()) {
    model = load_inference_model(model_dir);
  } else {
    nlohmann::json j = {{"architectures", {experts > 0 ? "MixtralForCausalLM" : "MistralForCausalLM"}},
                        {"model_type", experts > 0 ? "mixtral" : "mistral"},
                        {"vocab_size", vocab},
                        {"hidden_size", hidden},
                        {"intermediate_size", inter},
                        {"num_hidden_layers", layers},
                        {"num_attention_heads", heads},
                        {"num_key_value_heads", kv_heads},
                        {"max_position_embeddings", 4096},
                        {"rms_norm_eps", 1e-5},
                        {"rope_theta", 1e6},
                        {"tie_word_embeddings", false}};
    if (experts > 0) {
      j["num_local_experts"] = experts;
      j["num_experts_per_tok"] = top_k;
    }
    model = std::make_unique<InferenceModel>(model_config_from_json(j, "bench generate flags"));
    init_parameters(model->table, model->cfg, 1234, model->params.data());
  }
  const ModelConfig& cfg = model->cfg;
  std::printf("bench generate: %s hidden %d, %d layers, %d heads (%d kv), experts %d top-%d, intermediate %d, "
              "vocab %d; prompt %d, new tokens %d, %d threads\n",
              cfg.architecture.c_str(), cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
              cfg.num_key_value_heads, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
              cfg.vocab_size, prompt_tokens, new_tokens, omp_get_max_threads());
  std::printf("weights: fp32%s\n", model->params_bf16.empty() ? ""
                                                               : " (a bf16 checkpoint: decoding reads the bf16 copy)");
  // The prompt bench/hf_generate.py uses: BOS, then ids 3 + mix64(i * 7919 + 17) % (V - 3).
  std::vector<int32_t> prompt(prompt_tokens);
  prompt[0] = 1;
  for (int i = 1; i < prompt_tokens; i++)
    prompt[i] = (int32_t)(3 + mix64((uint64_t)i * 7919 + 17) % (uint64_t)(cfg.vocab_size - 3));

  Decoder dec(*model);
  std::vector<float> logits(cfg.vocab_size);
  std::vector<double> prefill, decode;
  for (int run = 0; run <= runs; run++) {
    KvCache cache = dec.new_cache();
    cache.reserve(prompt_tokens + new_tokens);
    Sampler sampler({}, cfg.vocab_size);
    const auto t0 = Clock::now();
    dec.forward(cache, prompt, logits.data());
    const auto t1 = Clock::now();
    int32_t next = sampler.next(logits.data(), {}, {});
    for (int i = 1; i < new_tokens; i++) {
      dec.forward(cache, std::span<const int32_t>(&next, 1), logits.data());
      next = sampler.next(logits.data(), {}, {});
    }
    const auto t2 = Clock::now();
    const double pf = std::chrono::duration<double>(t1 - t0).count();
    const double dc = std::chrono::duration<double>(t2 - t1).count();
    std::printf("  run %d: prefill %.4f s, decode %.4f s%s\n", run, pf, dc, run == 0 ? "  (warm-up)" : "");
    if (run > 0) {
      prefill.push_back(prompt_tokens / pf);
      decode.push_back((new_tokens - 1) / dc);
    }
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double p = median(prefill), d = median(decode);
  std::printf("prefill tokens/s: %.1f\n", p);
  std::printf("decode tokens/s: %.1f\n", d);
  std::printf("peak RSS: %.0f MiB\n", ru.ru_maxrss / 1024.0);
  if (json)
    std::printf("{\"prefill_tokens_per_s\": %.2f, \"decode_tokens_per_s\": %.2f, \"threads\": %d}\n", p, d,
                omp_get_max_threads());
  return 0;
}

}  // namespace moetron::cli
