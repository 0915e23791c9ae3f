// Greedy tokens of a GGUF model in llama.cpp, from given prompt ids -- the llama.cpp side of
// tools/check_gguf_llama.sh (built there against llama.cpp's libllama; never part of moetron's build).
//
//   gguf_llama_greedy MODEL.gguf IDS N      IDS: comma-separated prompt token ids; N: new tokens
// Prints the new ids comma-separated on one line (stopping early at an end-of-generation token, as
// moetron generate stops at EOS). The prompt is decoded as given: llama.cpp adds no BOS here. One
// CPU thread and fp32 logits: the argmax is taken over llama_get_logits_ith(ctx, -1) directly.
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

void quiet(enum ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s MODEL.gguf IDS N\n", argv[0]);
    return 2;
  }
  std::vector<llama_token> prompt;
  {
    std::stringstream ss(argv[2]);
    std::string item;
    while (std::getline(ss, item, ',')) prompt.push_back((llama_token)std::stol(item));
  }
  const int n_new = std::atoi(argv[3]);
  if (prompt.empty() || n_new < 1) {
    std::fprintf(stderr, "need prompt ids and N >= 1\n");
    return 2;
  }
  llama_log_set(quiet, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) {
    std::fprintf(stderr, "llama.cpp could not load %s\n", argv[1]);
    return 1;
  }
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const int n_vocab = llama_vocab_n_tokens(vocab);
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = (uint32_t)(prompt.size() + n_new + 8);
  cp.n_batch = (uint32_t)prompt.size();
  cp.n_ubatch = (uint32_t)prompt.size();
  cp.n_threads = 1;
  cp.n_threads_batch = 1;
  cp.no_perf = true;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) {
    std::fprintf(stderr, "llama.cpp could not create a context\n");
    return 1;
  }
  std::vector<llama_token> out;
  llama_batch batch = llama_batch_get_one(prompt.data(), (int32_t)prompt.size());
  llama_token next = 0;
  for (int step = 0; step < n_new; step++) {
    if (llama_decode(ctx, batch) != 0) {
      std::fprintf(stderr, "llama_decode failed at step %d\n", step);
      return 1;
    }
    const float* logits = llama_get_logits_ith(ctx, -1);
    int best = 0;
    for (int v = 1; v < n_vocab; v++)
      if (logits[v] > logits[best]) best = v;
    next = best;
    if (llama_vocab_is_eog(vocab, next)) break;
    out.push_back(next);
    batch = llama_batch_get_one(&next, 1);
  }
  for (size_t i = 0; i < out.size(); i++) std::printf("%s%d", i ? "," : "", out[i]);
  std::printf("\n");
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
