// The model's own layer body over KV caches (Model::infer, run by ModelRunner): the training forward's
// blocks, with attention over per-sequence caches in the backend's memory.
//   - on the CPU backend, prefill (at once, in chunks, after cached positions) and decode give the
//     training forward's logits of the whole sequence (max|a-b| <= 1e-5 max|b|: both fp32, the same
//     ops over different shapes -- BLAS blocks and attention over a cache instead of the batch --
//     move logits by ~1e-7; a wrong position, cache row or window moves them by far more), for every
//     golden model (the 7 families, sliding windows, shared experts, clip, q/k norms, tied head);
//   - greedy generation equals transformers' on the generation references, and with a PEFT adapter
//     unmerged the logits equal PEFT's;
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
#include "infer/model_runner.h"
#include "infer/generate.h"
#include "infer/model.h"
#include "infer/model_runner.h"
#include "io/model_files.h"
#include "model/model.h"
#include "model/weights.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

const fs::path kGolden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden";
const fs::path kGenerate = kGolden / "generate";
constexpr double kTol = 1e-5;

std::vector<std::string> model_dirs() {
  std::vector<std::string> dirs;
  for (const char* c :
       {"mixtral_gqa", "mixtral_e3_k1", "mixtral_swa_padded", "mistral_dense", "llama_dense", "qwen3_moe_mixed",
        "qwen3_moe_norm_topk_padded", "qwen2_moe_shared", "olmoe_clip", "olmoe_plain", "qwen3_dense"})
    dirs.push_back((kGolden / c).string());
  for (const char* c : {"mixtral_gqa", "llama_dense", "qwen3_moe", "olmoe"}) dirs.push_back((kGenerate / c).string());
  return dirs;
}

std::vector<int32_t> random_tokens(int n, int V, uint64_t seed) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; i++) t[i] = (int32_t)(mix64(seed * 1000003 + i) % (uint64_t)V);
  return t;
}

// [T, V] logits of the training forward over the whole sequence.
std::vector<float> recompute_logits(const std::string& dir, const std::vector<int32_t>& tokens) {
  const ModelConfig cfg = load_model_config(dir + "/config.json");
  Model model(cfg);
  load_hf_weights(ModelTensors::open(dir), model.table(), model.params().data(), dir);
  Batch b;
  b.B = 1;
  b.T = (int)tokens.size();
  b.input_ids = tokens;
  model.forward(b, {});
  return std::vector<float>(model.logits(), model.logits() + tokens.size() * (size_t)cfg.vocab_size);
}

double rel_err(const float* a, const float* b, int n) {
  double err = 0, ref = 0;
  for (int i = 0; i < n; i++) {
    err = std::max(err, std::fabs((double)a[i] - b[i]));
    ref = std::max(ref, std::fabs((double)b[i]));
  }
  return err / ref;
}

ModelRunner cpu_runner(const std::string& dir, int chunk = 256, const std::string& lora = "") {
  return ModelRunner(std::make_unique<CpuBackend>(), dir, lora, chunk);
}

}  // namespace

// Prefill P tokens, then one token at a time; and prefill in chunks of 3 and 20 over a cache already
// holding positions: every logit row equals the recomputation's.  The sequences are longer than the
// sliding windows (5 and 16) of the window cases.
TEST(ModelInfer, PrefillAndDecodeEqualTheTrainingForward) {
  for (const std::string& dir : model_dirs()) {
    SCOPED_TRACE(dir);
    const ModelConfig cfg = load_model_config(dir + "/config.json");
    const int V = cfg.vocab_size, T = 40, P = 7;
    const std::vector<int32_t> tokens = random_tokens(T, V, 7);
    const std::vector<float> ref = recompute_logits(dir, tokens);
    ModelRunner run = cpu_runner(dir);
    KvCache cache = run.new_cache();
    std::vector<float> logits((size_t)T * V);
    run.forward(cache, std::span(tokens).first(P), logits.data(), /*all_logits=*/true);
    for (int t = 0; t < P; t++)
      ASSERT_LE(rel_err(logits.data() + (size_t)t * V, ref.data() + (size_t)t * V, V), kTol) << "prefill row " << t;
    for (int t = P; t < T; t++) {
      run.forward(cache, std::span(tokens).subspan(t, 1), logits.data());
      ASSERT_LE(rel_err(logits.data(), ref.data() + (size_t)t * V, V), kTol) << "decode step at position " << t;
    }
    EXPECT_EQ(cache.len(), T);
    EXPECT_EQ(cache.tokens(), tokens);
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

// The same on the CPU inference backend over the checkpoint used where it lies (bf16 / f32 in place,
// the inference kernels), with prompts in chunks of 3 and 256 rows.
TEST(ModelInfer, OverWeightsInPlacePrefillAndDecodeEqualTheTrainingForward) {
  for (const std::string& dir : model_dirs()) {
    SCOPED_TRACE(dir);
    const auto weights = load_inference_model(dir);
    const int V = weights->cfg.vocab_size, T = 40, P = 7;
    const std::vector<int32_t> tokens = random_tokens(T, V, 7);
    const std::vector<float> ref = recompute_logits(dir, tokens);
    for (int chunk : {3, 256}) {
      ModelRunner run(*weights, chunk);
      KvCache cache = run.new_cache();
      std::vector<float> logits((size_t)T * V);
      run.forward(cache, std::span(tokens).first(P), logits.data(), /*all_logits=*/true);
      for (int t = 0; t < P; t++)
        ASSERT_LE(rel_err(logits.data() + (size_t)t * V, ref.data() + (size_t)t * V, V), kTol)
            << "chunk " << chunk << " prefill row " << t;
      for (int t = P; t < T; t++) {
        run.forward(cache, std::span(tokens).subspan(t, 1), logits.data());
        ASSERT_LE(rel_err(logits.data(), ref.data() + (size_t)t * V, V), kTol) << "decode step at position " << t;
      }
    }
  }
}

// Greedy generation through the model's body equals transformers' generate(do_sample=False), also
// with the prompt cached (reused) from the previous generation.
TEST(ModelInfer, GreedyEqualsTransformersGenerate) {
  std::ifstream in(kGenerate / "expected.json");
  const nlohmann::json exp = nlohmann::json::parse(in);
  ASSERT_EQ(exp["cases"].size(), 4u);  // Mixtral, Llama, Qwen3-MoE, OLMoE
  for (const auto& c : exp["cases"]) {
    const std::string dir = (kGenerate / c["model"].get<std::string>()).string();
    SCOPED_TRACE(dir);
    ModelRunner run = cpu_runner(dir);
    KvCache cache = run.new_cache();
    const auto prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    const auto want = c["expected_ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> eos = {2};
    EXPECT_EQ(generate_greedy(run, cache, prompt, 32, eos), want);
    GenerateOptions o;
    o.max_new_tokens = 32;
    o.eos_ids = eos;
    const GenerateResult r = generate(run, cache, prompt, o, nullptr);
    EXPECT_EQ(r.tokens, want);
    EXPECT_EQ(r.reused_tokens, (int)prompt.size() - 1);
  }
}

// A PEFT adapter applied unmerged: the first sequence's logits equal PEFT's, prefilled at once and fed
// token by token.
TEST(ModelInfer, LoraAdapterUnmergedGivesPeftsLogits) {
  for (const char* name : {"mixtral", "qwen3_moe", "qwen2_moe", "mixtral_router"}) {
    SCOPED_TRACE(name);
    const moetron::testing::GoldenCase c = moetron::testing::load_golden_case(kGolden / "lora" / name);
    const int T = c.batch.T, V = c.cfg.vocab_size;
    const std::vector<int32_t> tokens(c.batch.input_ids.begin(), c.batch.input_ids.begin() + T);  // row 0: unpadded
    const std::vector<float> all = to_f32(c.expected.get("logits_final"));
    const std::vector<float> want(all.begin(), all.begin() + (size_t)T * V);
    ModelRunner run = cpu_runner(c.dir.string(), 256, (c.dir / "adapter_final").string());
    KvCache prefill = run.new_cache();
    std::vector<float> got((size_t)T * V);
    run.forward(prefill, tokens, got.data(), true);
    EXPECT_LE(moetron::testing::normalized_max_error(got, want), 1e-5) << "prefill";
    KvCache step = run.new_cache();
    for (int t = 0; t < T; t++) run.forward(step, std::span<const int32_t>(&tokens[t], 1), got.data() + (size_t)t * V);
    EXPECT_LE(moetron::testing::normalized_max_error(got, want), 1e-5) << "token by token";
  }
}

// Three sequences of different lengths decoded together, and prefilled together row by row (in passes
// of 4 rows, so a sequence is split across passes): each gets what it gets alone.
TEST(ModelInfer, BatchAndRowPrefillGiveEachSequenceWhatItGetsAlone) {
  for (const char* name : {"qwen2_moe_shared", "mixtral_swa_padded", "qwen3_moe_mixed"}) {
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

// Bad input: a token outside the vocabulary, a cache of another runner (or of host floats), one
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
  KvCache host(run.config().num_hidden_layers, theirs.kv_dim());
  EXPECT_THROW(run.forward(host, ok, logits.data()), Error);
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
