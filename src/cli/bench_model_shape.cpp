#include "cli/bench_model_shape.h"

#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/params.h"

namespace moetron::cli {

void add_model_shape_options(CLI::App& app, BenchModelShape& s) {
  app.add_option("--hidden", s.hidden);
  app.add_option("--layers", s.layers);
  app.add_option("--heads", s.heads);
  app.add_option("--kv-heads", s.kv_heads);
  app.add_option("--experts", s.experts, "0 for a dense (Mistral) model");
  app.add_option("--top-k", s.top_k);
  app.add_option("--intermediate", s.intermediate);
  app.add_option("--vocab", s.vocab);
}

ModelConfig bench_model_config(const BenchModelShape& s, const std::string& where) {
  const bool moe = s.experts > 0;
  nlohmann::json j = {{"architectures", {moe ? "MixtralForCausalLM" : "MistralForCausalLM"}},
                      {"model_type", moe ? "mixtral" : "mistral"},
                      {"vocab_size", s.vocab},
                      {"hidden_size", s.hidden},
                      {"intermediate_size", s.intermediate},
                      {"num_hidden_layers", s.layers},
                      {"num_attention_heads", s.heads},
                      {"num_key_value_heads", s.kv_heads},
                      {"max_position_embeddings", 32768},
                      {"rms_norm_eps", 1e-5},
                      {"rope_theta", 1e6},
                      {"router_aux_loss_coef", 0.02},
                      {"tie_word_embeddings", false}};
  if (moe) {
    j["num_local_experts"] = s.experts;
    j["num_experts_per_tok"] = s.top_k;
  }
  return model_config_from_json(j, where);
}

void check_bench_model_size(const ModelConfig& cfg, int64_t device_bytes, double bytes_per_param) {
  const int64_t n = ParamTable(cfg).total();
  if (device_bytes > 0) {
    if ((double)n * bytes_per_param > (double)device_bytes)
      throw InputError(fmt::format("--hidden/--layers/--experts/--intermediate/--vocab: a model of {} parameters needs "
                                   "{:.1f} GiB on the device ({} bytes a parameter); it has {:.1f} GiB",
                                   n, n * bytes_per_param / (1 << 30), bytes_per_param,
                                   (double)device_bytes / (1 << 30)));
    return;
  }
  if (n > kMaxBenchRandomParams)
    throw InputError(fmt::format("--hidden/--layers/--experts/--intermediate/--vocab: a random model of {} parameters "
                                 "({:.1f} GiB in fp32); at most {} (2^30) -- time a larger model from files with --model",
                                 n, n * 4.0 / (1 << 30), kMaxBenchRandomParams));
}

void check_bench_positions(const ModelConfig& cfg, int prompt_tokens, int new_tokens, int sequences) {
  const long positions = (long)prompt_tokens + new_tokens;
  if (cfg.max_position_embeddings > 0 && positions > cfg.max_position_embeddings)
    throw InputError(fmt::format("--prompt-tokens {} + --new-tokens {} = {} positions; the model's "
                                 "max_position_embeddings is {}",
                                 prompt_tokens, new_tokens, positions, cfg.max_position_embeddings));
  // fp32 keys and values of every layer (an upper bound of the cache's bytes).
  const double kv = (double)sequences * positions * 2.0 * cfg.num_hidden_layers * cfg.num_key_value_heads *
                    cfg.head_dim * sizeof(float);
  const double ram = (double)::sysconf(_SC_PHYS_PAGES) * (double)::sysconf(_SC_PAGE_SIZE);
  if (ram > 0 && kv > ram / 2)
    throw InputError(fmt::format("--batch / --prompt-tokens / --new-tokens: {} sequences of {} positions need {:.1f} "
                                 "GiB of KV cache; this machine has {:.1f} GiB of memory",
                                 sequences, positions, kv / (1 << 30), ram / (1 << 30)));
}

std::string describe_model_shape(const ModelConfig& cfg) {
  return fmt::format("{} hidden {}, {} layers, {} heads ({} kv), experts {} top-{}, intermediate {}, vocab {}",
                     cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                     cfg.num_key_value_heads, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                     cfg.vocab_size);
}

}  // namespace moetron::cli
