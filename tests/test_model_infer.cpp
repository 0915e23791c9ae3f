// The model's own layer body over KV caches (Model::infer, run by ModelRunner): the training forward's
// blocks, with attention over per-sequence caches in the backend's memory.
//   - on the CPU backend, prefill in chunks after cached positions (and prefill then decode:
//     test_infer's Decoder.KvCacheEqualsRecomputationAtEveryStep) gives the
//     training forward's logits of the whole sequence (max|a-b| <= 1e-5 max|b|: both fp32, the same
//     ops over different shapes -- BLAS blocks and attention over a cache instead of the batch --
//     move logits by ~1e-7; a wrong position, cache row or window moves them by far more), for every
//     golden model (the 7 families, sliding windows, shared experts, clip, q/k norms, tied head);
//   - (greedy generation equal to transformers' and PEFT's logits with an adapter unmerged: test_infer's
//     Generate.GreedyEqualsTransformersGenerate and test_lora's LoraGolden run this runner too);
//   - a decode batch and a row prefill of several sequences give each sequence what it gets alone;
//   - on the bf16-rounding CPU backend (what CUDA stores in bf16: the act-store branches of every
//     block) the logits stay within bf16 accuracy of fp32;
//   - with a GPU, the greedy tokens on CUDA equal the CPU's;
//   - bad input is refused before anything is written.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "backend/cpu.h"
#include "backend/cpu_bf16.h"
#include "backend/select.h"
#include "core/error.h"
#include "core/rng.h"
#include "cuda_test_util.h"
#include "golden_case.h"
#include "infer/generate.h"
#include "infer/model.h"
#include "infer/model_runner.h"
#include "infer_test_util.h"
#include "io/model_files.h"
#include "model/model.h"
#include "model/weights.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

const fs::path kGolden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden";
const fs::path kGenerate = kGolden / "generate";
constexpr double kTol = moetron::testing::kKvTol;
using moetron::testing::random_tokens;
using moetron::testing::recompute_logits;
using moetron::testing::rel_err;
std::vector<std::string> model_dirs() { return moetron::testing::inference_model_dirs(); }

// [T, V] logits of the training forward over the whole sequence.

ModelRunner cpu_runner(const std::string& dir, int chunk = 256, const std::string& lora = "") {
  return ModelRunner(std::make_unique<CpuBackend>(), dir, lora, chunk);
}

}  // namespace

// Prefill in chunks of 3 and 20 over a cache already holding positions: every logit row equals the
// recomputation's (prefill then decode: Decoder.KvCacheEqualsRecomputationAtEveryStep runs this runner
// too).  The sequences are longer than the sliding windows (5 and 16) of the window cases.
TEST(ModelInfer, ChunkedPrefillEqualsTheTrainingForward) {
  for (const std::string& dir : model_dirs()) {
    SCOPED_TRACE(dir);
    const ModelConfig cfg = load_model_config(dir + "/config.json");
    const int V = cfg.vocab_size, T = 40;
    const std::vector<int32_t> tokens = random_tokens(T, V, 7);
    const std::vector<float> ref = recompute_logits(dir, tokens);
    std::vector<float> logits((size_t)T * V);
    for (int chunk : {3, 20}) {
      ModelRunner chunked = cpu_runner(dir, chunk);
      KvCache c = chunked.new_cache();
      chunked.forward(c, std::span(tokens).first(25), logits.data(), true);
      for (int t = 0; t < 25; t++)
        ASSERT_LE(rel_err(logits.data() + (size_t)t * V, ref.data() + (size_t)t * V, V), kTol)
            << "chunk " << chunk << " row " << t;
      chunked.forward(c, std::span(tokens).subspan(25), logits.data());  // the last row's only
      ASSERT_LE(rel_err(logits.data(), ref.data() + (size_t)(T - 1) * V, V), kTol) << "chunk " << chunk;
    }
  }
}

// Latent attention caches per position and layer the normed latent and the rotated RoPE key
// (kv_lora_rank + qk_rope_head_dim values), not every head's key and value: 12 + 4 = 16 values here
// against 4 x (12 + 12) = 96 for a full cache of the padded heads (DeepSeek-V3: 576 against 40960).
TEST(ModelInfer, LatentCacheHoldsTheLatentAndTheRopeKeyPerPosition) {
  const std::string dir = (kGolden / "deepseek_v3_mla_yarn").string();
  ModelRunner run = cpu_runner(dir);
  const ModelConfig& c = run.config();
  KvCache cache = run.new_cache();
  EXPECT_EQ(cache.kv_dim(), c.kv_lora_rank);
  EXPECT_EQ(cache.v_dim(), c.qk_rope_head_dim);
  cache.reserve(100);
  EXPECT_EQ(cache.bytes(), (size_t)100 * (c.kv_lora_rank + c.qk_rope_head_dim) * sizeof(float) * c.num_hidden_layers);
  const ModelConfig ds = load_model_config(std::string(MOETRON_SOURCE_DIR) + "/configs/models/deepseek-v3/config.json");
  const auto [k, v] = cache_widths(ds);
  EXPECT_EQ(k + v, 576);
  EXPECT_EQ((long)ds.num_attention_heads * (ds.head_dim + ds.v_head_dim), 40960);
}

// Three sequences of different lengths decoded together, and prefilled together row by row (in passes
// of 4 rows, so a sequence is split across passes): each gets what it gets alone.
TEST(ModelInfer, BatchAndRowPrefillGiveEachSequenceWhatItGetsAlone) {
  for (const char* name : {"qwen2_moe_shared", "mixtral_swa_padded", "qwen3_moe_mixed", "deepseek_v3_mla_yarn"}) {
    const std::string dir = (kGolden / name).string();
    SCOPED_TRACE(dir);
    ModelRunner run = cpu_runner(dir, 4);
    const int V = run.config().vocab_size;
    std::vector<std::vector<int32_t>> seqs;
    for (int s = 0; s < 3; s++) seqs.push_back(random_tokens(3 + 4 * s, V, 20 + s));
    // Alone: prompt, then one more token each.
    std::vector<std::vector<float>> alone_prompt, alone_step;
    for (const auto& q : seqs) {
      KvCache c = run.new_cache();
      std::vector<float> l(V);
      run.forward(c, q, l.data());
      alone_prompt.push_back(l);
      const int32_t next = (int32_t)(q.back() * 7 % V);
      run.forward(c, std::span<const int32_t>(&next, 1), l.data());
      alone_step.push_back(l);
    }
    std::vector<KvCache> caches;
    for (int s = 0; s < 3; s++) caches.push_back(run.new_cache());
    std::vector<KvCache*> ptrs = {&caches[0], &caches[1], &caches[2]};
    std::vector<std::span<const int32_t>> feeds(seqs.begin(), seqs.end());
    std::vector<float> logits((size_t)3 * V);
    run.prefill_rows(ptrs, feeds, logits.data());
    for (int s = 0; s < 3; s++) {
      EXPECT_EQ(caches[s].tokens(), seqs[s]);
      EXPECT_LE(rel_err(logits.data() + (size_t)s * V, alone_prompt[s].data(), V), kTol) << "prefill " << s;
    }
    std::vector<int32_t> next;
    for (const auto& q : seqs) next.push_back((int32_t)(q.back() * 7 % V));
    run.forward_batch(ptrs, next, logits.data());
    for (int s = 0; s < 3; s++)
      EXPECT_LE(rel_err(logits.data() + (size_t)s * V, alone_step[s].data(), V), kTol) << "decode " << s;
  }
}

// The act-store branches of every block (f32 staging of biased / clipped projections, the router's f32
// copy of its input, the bf16 cache) run on the bf16-rounding CPU backend: its logits stay within
// bf16 accuracy of the fp32 model's (5e-2 of the largest logit: bf16 keeps 8 bits; a wrong branch
// misses by O(1)), prefill and decode.
TEST(ModelInfer, Bf16BackendStaysWithinBf16AccuracyOfFp32) {
  for (const std::string& dir : model_dirs()) {
    SCOPED_TRACE(dir);
    const ModelConfig cfg = load_model_config(dir + "/config.json");
    const int V = cfg.vocab_size, T = 20;
    const std::vector<int32_t> tokens = random_tokens(T, V, 9);
    const std::vector<float> ref = recompute_logits(dir, tokens);
    ModelRunner run(std::make_unique<Bf16CpuBackend>(), dir);
    KvCache cache = run.new_cache();
    std::vector<float> logits((size_t)T * V);
    run.forward(cache, std::span(tokens).first(T - 3), logits.data(), true);
    for (int t = T - 3; t < T; t++) run.forward(cache, std::span(tokens).subspan(t, 1), logits.data() + (size_t)t * V);
    EXPECT_LE(rel_err(logits.data(), ref.data(), T * V), 5e-2);
  }
}

// Bad input: a token outside the vocabulary, a cache of another runner (or backend), one
// cache twice in a batch, an empty feed -- an Error, and the caches keep what they held.
TEST(ModelInfer, RejectsBadInputWithoutChangingTheCache) {
  const std::string dir = (kGolden / "mixtral_gqa").string();
  ModelRunner run = cpu_runner(dir);
  const int V = run.config().vocab_size;
  KvCache cache = run.new_cache();
  std::vector<float> logits((size_t)2 * V);
  const std::vector<int32_t> ok = {1, 2, 3};
  run.forward(cache, ok, logits.data());
  const std::vector<int32_t> bad = {4, V, 5};
  EXPECT_THROW(run.forward(cache, bad, logits.data()), Error);
  const std::vector<int32_t> negative = {-1};
  EXPECT_THROW(run.forward(cache, negative, logits.data()), Error);
  EXPECT_THROW(run.forward(cache, {}, logits.data()), Error);
  EXPECT_EQ(cache.tokens(), ok);
  const auto model = load_inference_model(dir);
  ModelRunner other(*model);  // the CPU inference backend's caches
  KvCache theirs = other.new_cache();
  EXPECT_THROW(run.forward(theirs, ok, logits.data()), Error);
  CpuBackend another;
  KvCache shaped_alike(run.config().num_hidden_layers, theirs.kv_dim(), another);
  EXPECT_THROW(run.forward(shaped_alike, ok, logits.data()), Error);
  KvCache* twice[2] = {&cache, &cache};
  const int32_t two[2] = {1, 2};
  EXPECT_THROW(run.forward_batch(twice, two, logits.data()), Error);
  EXPECT_EQ(cache.tokens(), ok);
  // The cache still continues exactly: its next step equals the recomputation.
  std::vector<int32_t> all = ok;
  all.push_back(7);
  const std::vector<float> ref = recompute_logits(dir, all);
  run.forward(cache, std::span(all).subspan(3, 1), logits.data());
  EXPECT_LE(rel_err(logits.data(), ref.data() + (size_t)3 * V, V), kTol);
}

// With a GPU: greedy generation on CUDA (bf16 weights and cache) gives the CPU's tokens on the
// generation references.
TEST(ModelInfer, CudaGreedyTokensEqualTheCpus) {
  MOETRON_REQUIRE_GPU();
  std::ifstream in(kGenerate / "expected.json");
  const nlohmann::json exp = nlohmann::json::parse(in);
  for (const auto& c : exp["cases"]) {
    const std::string dir = (kGenerate / c["model"].get<std::string>()).string();
    SCOPED_TRACE(dir);
    ModelRunner gpu(make_backend("cuda"), dir);
    KvCache cache = gpu.new_cache();
    const auto prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(generate_greedy(gpu, cache, prompt, 32, std::vector<int32_t>{2}),
              c["expected_ids"].get<std::vector<int32_t>>());
  }
}
