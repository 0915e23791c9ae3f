// The 20-step training comparison shared by tests/test_backend_bf16.cpp and tests/test_cuda_model.cpp:
// a small Mixtral (E = 4, K = 2, GQA) and batches of token streams with structure (a repeating
// pattern per row plus noise) so the loss falls.
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "core/rng.h"
#include "io/hf_config.h"
#include "model/batch.h"

namespace moetron::testing {

inline ModelConfig training_case_model() {
  const nlohmann::json j = {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"},
                            {"vocab_size", 512},   {"hidden_size", 128},
                            {"intermediate_size", 256}, {"num_hidden_layers", 2},
                            {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                            {"num_local_experts", 4}, {"num_experts_per_tok", 2},
                            {"rms_norm_eps", 1e-5}, {"rope_theta", 1e6},
                            {"router_aux_loss_coef", 0.02}, {"tie_word_embeddings", false}};
  return model_config_from_json(j, "training test");
}

inline std::vector<Batch> training_case_batches(int vocab, int B, int T, int n) {
  std::vector<Batch> batches(n);
  for (int i = 0; i < n; i++) {
    Batch& b = batches[i];
    b.B = B;
    b.T = T;
    b.input_ids.resize((size_t)B * T);
    for (size_t t = 0; t < b.input_ids.size(); t++)
      b.input_ids[t] = (int32_t)((t % 17) * 29 + (mix64(t + 1000 * i) % 3)) % vocab;
    b.labels = b.input_ids;
  }
  return batches;
}

}  // namespace moetron::testing
