// Inference: the KV-cache decoder against recomputation without a cache (the training model's full
// forward), greedy generation against transformers' generate(do_sample=False), sampling, and the
// incremental detokenizer with stop strings.
//
// The KV-vs-recompute tolerance: tests/infer_test_util.h.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <omp.h>
#include <nlohmann/json.hpp>

#include "backend/cpu.h"
#include "backend/kernels/argmax.h"
#include "backend/kernels/attention_rows.h"
#include "backend/kernels/gemv.h"
#include "backend/kernels/q8.h"
#include "core/error.h"
#include "core/rng.h"
#include "infer/model_runner.h"
#include "infer/generate.h"
#include "infer/model.h"
#include "infer/sampler.h"
#include "infer/text_stream.h"
#include "io/model_files.h"
#include "mixtral_tokenizer.h"
#include "proc_maps.h"
#include "model/model.h"
#include "model/weights.h"
#include "infer_test_util.h"
#include "temp_dir.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

const fs::path kGolden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden";
const fs::path kGenerate = kGolden / "generate";

nlohmann::json expected_json() {
  std::ifstream in(kGenerate / "expected.json");
  return nlohmann::json::parse(in);
}




constexpr double kTol = moetron::testing::kKvTol;
using moetron::testing::random_tokens;
using moetron::testing::recompute_logits;
using moetron::testing::rel_err;
std::vector<std::string> model_dirs() { return moetron::testing::inference_model_dirs(); }


}  // namespace

// Prefill of a prompt, then one token at a time: the logits of every position equal the full
// recomputation's -- over the weights used in place (the CPU inference backend) and on the CPU backend
// (the model's fp32 copy, BLAS: the path a GPU runs).  The sequences are longer than the sliding
// windows (5 and 16) of the window cases.
TEST(Decoder, KvCacheEqualsRecomputationAtEveryStep) {
  for (const std::string& dir : model_dirs())
    for (const bool in_place : {true, false}) {
    SCOPED_TRACE(dir + (in_place ? " in place" : " on the CPU backend"));
    const auto model = load_inference_model(dir);
    const int V = model->cfg.vocab_size, T = 40, P = 7;
    const std::vector<int32_t> tokens = random_tokens(T, V, 7);
    const std::vector<float> ref = recompute_logits(dir, tokens);
    std::unique_ptr<ModelRunner> runner = in_place ? std::make_unique<ModelRunner>(*model)
                                                   : std::make_unique<ModelRunner>(std::make_unique<CpuBackend>(), dir);
    ModelRunner& dec = *runner;
    KvCache cache = dec.new_cache();
    std::vector<float> logits((size_t)P * V);
    dec.forward(cache, std::span(tokens).first(P), logits.data(), /*all_logits=*/true);
    for (int t = 0; t < P; t++)
      ASSERT_LE(rel_err(logits.data() + (size_t)t * V, ref.data() + (size_t)t * V, V), kTol) << "prefill row " << t;
    for (int t = P; t < T; t++) {
      dec.forward(cache, std::span(tokens).subspan(t, 1), logits.data());
      ASSERT_LE(rel_err(logits.data(), ref.data() + (size_t)t * V, V), kTol) << "decode step at position " << t;
    }
    EXPECT_EQ(cache.len(), T);
    EXPECT_EQ(cache.tokens(), tokens);
  }
}

// Prefill in chunks (3 and 20 tokens, over a cache that already holds positions), with attention per
// row (the default for short prompts) and as GEMMs (forced), gives the same logits as the
// recomputation, including the last-row-only mode.
TEST(Decoder, ChunkedPrefillAndCacheContinuation) {
  for (const std::string& dir : model_dirs()) {
    SCOPED_TRACE(dir);
    const auto model = load_inference_model(dir);
    const int V = model->cfg.vocab_size, T = 45;
    const std::vector<int32_t> tokens = random_tokens(T, V, 11);
    const std::vector<float> ref = recompute_logits(dir, tokens);
    for (auto [chunk, row_pairs] : std::vector<std::pair<int, long>>{{3, -1}, {20, -1}, {3, 0}, {20, 0}, {256, 0}}) {
      SCOPED_TRACE(::testing::Message() << "chunk " << chunk << ", row attention up to " << row_pairs << " pairs");
      ModelRunner dec(*model, chunk, row_pairs);
      KvCache cache = dec.new_cache();
      std::vector<float> all((size_t)25 * V), last(V);
      dec.forward(cache, std::span(tokens).first(25), all.data(), true);
      for (int t = 0; t < 25; t++)
        ASSERT_LE(rel_err(all.data() + (size_t)t * V, ref.data() + (size_t)t * V, V), kTol) << chunk << " row " << t;
      dec.forward(cache, std::span(tokens).subspan(25), last.data());  // 20 more after 25 cached
      ASSERT_LE(rel_err(last.data(), ref.data() + (size_t)(T - 1) * V, V), kTol) << "chunk " << chunk;
    }
  }
}

// A bf16 checkpoint is used in place from the mapped file (no fp32 copy): prefill and decode give
// bitwise the logits of the same model widened to fp32 (bf16 widens exactly; the kernels do the same
// fp32 arithmetic on the same values).  An fp32 checkpoint is used in place too.
TEST(Decoder, Bf16InPlaceComputesBitwiseWhatItsFp32WideningDoes) {
  const auto fp32_file = load_inference_model((kGolden / "mixtral_gqa").string());
  EXPECT_TRUE(fp32_file->owned.empty());
  EXPECT_EQ(fp32_file->storage_name(), "F32");
  for (const char* name : {"mixtral_gqa", "llama_dense", "qwen3_moe", "olmoe", "qwen2_moe", "mistral_dense", "qwen3_dense"}) {
    SCOPED_TRACE(name);
    const auto model = load_inference_model((kGenerate / name).string());
    const auto wide = load_inference_model((kGenerate / name).string(), "", /*widen_to_fp32=*/true);
    ASSERT_TRUE(model->owned.empty());
    ASSERT_EQ(model->storage_name(), "BF16");
    ASSERT_EQ(wide->owned.size(), wide->table.total());
    // (every one of these models has an untied embedding: here read by row from the file)
    ASSERT_NE(model->embedding_in_file(), nullptr);
    ASSERT_EQ(wide->embedding_in_file(), nullptr);
    size_t small = 0;  // values of the norms, biases and router, copied to fp32 either way
    for (const ParamSpec& p : model->table.specs()) small += InferenceModel::is_small(p.kind) ? p.numel : 0;
    EXPECT_EQ(model->weight_bytes(), (wide->weight_bytes() - 4 * small) / 2 + 4 * small);
    const int V = model->cfg.vocab_size;
    const std::vector<int32_t> tokens = random_tokens(30, V, 3);
    ModelRunner a(*model), b(*wide);
    KvCache ca = a.new_cache(), cb = b.new_cache();
    std::vector<float> la((size_t)9 * V), lb((size_t)9 * V);
    a.forward(ca, std::span(tokens).first(9), la.data(), /*all_logits=*/true);  // prefill: 9 rows
    b.forward(cb, std::span(tokens).first(9), lb.data(), true);
    ASSERT_EQ(0, std::memcmp(la.data(), lb.data(), sizeof(float) * la.size())) << "prefill";
    for (int t = 9; t < 30; t++) {
      a.forward(ca, std::span(tokens).subspan(t, 1), la.data());
      b.forward(cb, std::span(tokens).subspan(t, 1), lb.data());
      ASSERT_EQ(0, std::memcmp(la.data(), lb.data(), sizeof(float) * V)) << "position " << t;
    }
  }
}

namespace {

// Pages of [p, p + n) mapped in this process's page tables (/proc/self/pagemap bit 63: present).
size_t present_pages(const void* p, size_t n) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const uintptr_t first = (uintptr_t)p / page, last = ((uintptr_t)p + n + page - 1) / page;
  std::vector<uint64_t> entries(last - first);
  const int fd = open("/proc/self/pagemap", O_RDONLY);
  EXPECT_GE(fd, 0) << "opening /proc/self/pagemap";
  if (fd < 0) return 0;
  const ssize_t got = pread(fd, entries.data(), entries.size() * 8, (off_t)(first * 8));
  close(fd);
  EXPECT_EQ(got, (ssize_t)(entries.size() * 8)) << "reading /proc/self/pagemap";
  size_t present = 0;
  for (const uint64_t e : entries) present += (e >> 63) & 1;
  return present;
}

}  // namespace

// An untied embedding is looked up by row from the file, never through the mapping: a prompt needs a
// few of its rows, and a fault maps the page-cache folios around a page, so mapped lookups left most of
// the table resident (15.6 of a small model's 57 MiB, for nothing).  Here the embedding is 8 MiB:
// after a load (which checks every value) and a forward over tokens spread through the vocabulary,
// none of its pages away from its ends (2 MiB margins: folios shared with the tensors beside it) is
// mapped; the head, read whole, is.  A tied embedding is the head: used in place as before.
TEST(Decoder, UntiedEmbeddingIsReadByRowNeverMapped) {
  moetron::testing::TempDir tmp("embedding_rows");
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const std::string dir = tmp.file(tied ? "tied" : "untied");
    const ModelConfig cfg = model_config_from_json(
        {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"}, {"vocab_size", 32768},
         {"hidden_size", 128}, {"intermediate_size", 64}, {"num_hidden_layers", 1}, {"num_attention_heads", 4},
         {"num_key_value_heads", 2}, {"num_local_experts", 2}, {"num_experts_per_tok", 1},
         {"tie_word_embeddings", tied}, {"torch_dtype", "bfloat16"}},
        "test");
    write_random_model(dir, cfg, 7, DType::BF16);

    const auto model = load_inference_model(dir);
    const auto wide = load_inference_model(dir, "", /*widen_to_fp32=*/true);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 40; i++) tokens.push_back((int32_t)((i * 7919L) % cfg.vocab_size));
    ModelRunner a(*model), b(*wide);
    KvCache ca = a.new_cache(), cb = b.new_cache();
    std::vector<float> la((size_t)cfg.vocab_size), lb(la.size());
    a.forward(ca, std::span(tokens).first(30), la.data());  // prefill
    b.forward(cb, std::span(tokens).first(30), lb.data());
    for (int t = 30; t < 40; t++) {
      a.forward(ca, std::span(tokens).subspan(t, 1), la.data());
      b.forward(cb, std::span(tokens).subspan(t, 1), lb.data());
    }
    EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), sizeof(float) * la.size())) << "the widened model's logits";

    const size_t page = (size_t)sysconf(_SC_PAGESIZE), margin = 2u << 20, bytes = la.size() * cfg.hidden_size * 2;
    const size_t middle_pages = (bytes - 2 * margin) / page;
    const WeightRef head = model->mat(tied ? ParamKind::embedding : ParamKind::lm_head, -1, 0, 0);
    EXPECT_GE(present_pages(static_cast<const uint8_t*>(head.data) + margin, bytes - 2 * margin), middle_pages)
        << "the head, read whole by every forward, is mapped (a check that this test sees mappings)";
    if (tied) {
      EXPECT_EQ(model->embedding_in_file(), nullptr);
      continue;
    }
    const TensorView* e = model->embedding_in_file();
    ASSERT_NE(e, nullptr);
    ASSERT_TRUE(e->mapped);
    ASSERT_EQ(e->nbytes, bytes);
    EXPECT_EQ(present_pages(e->data + margin, bytes - 2 * margin), 0u);
    // So with Q8_0 weights: the embedding stays in the file (bf16, quantized per row on lookup).
    const auto q8 = load_inference_model(dir, "", false, WeightQuant::q8_0);
    EXPECT_EQ(q8->storage_name(), "Q8_0");
    ModelRunner c(*q8);
    KvCache cc = c.new_cache();
    c.forward(cc, tokens, la.data());
    ASSERT_NE(q8->embedding_in_file(), nullptr);
    EXPECT_EQ(q8->embedding_in_file()->dtype, DType::BF16);
    EXPECT_EQ(present_pages(q8->embedding_in_file()->data + margin, bytes - 2 * margin), 0u);
    // Nor any other page of the file: the header and the small tensors, read at load, are let go.
    const size_t file_bytes = fs::file_size(fs::path(dir) / "model.safetensors");
    EXPECT_EQ(present_pages(q8->embedding_in_file()->map_base, file_bytes), 0u);
  }
}

// The tuner tries 4 serial then 4 split steps every 64 and keeps the faster way (by the fastest step of
// each four) for the other 56.
// Inference loads no BLAS or transport library: its GEMM is its own (backend/kernels/gemm.h), and MPI and NCCL
// (with what they pull in: Open MPI's stack, hwloc, libevent) are loaded only by a launched or
// GPU-distributed process, so they take no memory in generate, chat, serve or bench generate.
// OpenBLAS is checked when this process had not loaded it before (ctest runs each test alone; the
// SimdLevel runs of the whole binary come after tests that train).
TEST(Decoder, LoadsNoBlasMpiOrNcclLibrary) {
  const bool blas_before = moetron::testing::library_mapped("libopenblas");
  moetron::testing::TempDir tmp("no_transports");
  const std::string dir = tmp.file("model");
  const ModelConfig cfg = model_config_from_json(
      {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"}, {"vocab_size", 512},
       {"hidden_size", 64}, {"intermediate_size", 32}, {"num_hidden_layers", 1}, {"num_attention_heads", 4},
       {"num_key_value_heads", 2}, {"num_local_experts", 4}, {"num_experts_per_tok", 2}, {"torch_dtype", "bfloat16"}},
      "test");
  write_random_model(dir, cfg, 3, DType::BF16);
  for (const WeightQuant q : {WeightQuant::none, WeightQuant::q8_0}) {
    const auto model = load_inference_model(dir, "", false, q);
    ModelRunner d(*model);
    KvCache c = d.new_cache();
    std::vector<int32_t> tokens(40);
    for (int i = 0; i < 40; i++) tokens[i] = (int32_t)((i * 37) % cfg.vocab_size);
    std::vector<float> logits((size_t)cfg.vocab_size);
    d.forward(c, std::span(tokens).first(32), logits.data());  // prefill
    for (int t = 32; t < 40; t++) d.forward(c, std::span(tokens).subspan(t, 1), logits.data());
  }
  EXPECT_FALSE(moetron::testing::library_mapped("libmpi.so"));
  EXPECT_FALSE(moetron::testing::library_mapped("libnccl"));
  EXPECT_FALSE(moetron::testing::library_mapped("libopen-pal"));
  if (!blas_before) {
    EXPECT_FALSE(moetron::testing::library_mapped("libopenblas"));
  }
}

TEST(DecodeSplitTuner, TriesBothWaysEachPeriodKeepsTheFasterAndBacksOffWhileItHolds) {
  DecodeSplitTuner t;
  // One period: the ways its steps took and its length (known once the trial has decided).
  auto run_period = [&](double serial_s, double split_s) {
    std::vector<bool> ways;
    for (int i = 0; i < 2 * DecodeSplitTuner::kTrial || i < t.period(); i++) {
      const bool split = t.split_next();
      ways.push_back(split);
      // One slow outlier per trial: the fastest step of each four decides.
      const double noise = i % DecodeSplitTuner::kTrial == 1 ? 1.0 : 0.0;
      t.record((split ? split_s : serial_s) + noise);
    }
    return ways;
  };
  auto expect_period = [](const std::vector<bool>& w, size_t length, bool choice) {
    ASSERT_EQ(w.size(), length);
    for (int i = 0; i < 4; i++) EXPECT_FALSE(w[i]) << i;  // the trial: 4 steps on one thread, 4 split
    for (int i = 4; i < 8; i++) EXPECT_TRUE(w[i]) << i;
    for (size_t i = 8; i < w.size(); i++) EXPECT_EQ(w[i], choice) << i;
  };
  static_assert(DecodeSplitTuner::kPeriod == 64 && DecodeSplitTuner::kMaxPeriod == 512);
  // Splitting pays: the first period is 64 steps, then each trial that agrees doubles it, up to 512.
  for (size_t length : {64, 128, 256, 512, 512}) {
    expect_period(run_period(2.0, 1.0), length, true);
    EXPECT_TRUE(t.choice());
  }
  // The cores got busy: the next trial goes back to one thread and to 64-step periods.
  expect_period(run_period(1.0, 3.0), 64, false);
  EXPECT_FALSE(t.choice());
  expect_period(run_period(1.0, 3.0), 128, false);
  // And idle again: splitting at the next trial.
  expect_period(run_period(2.0, 1.0), 64, true);
  EXPECT_TRUE(t.choice());
}

// A product gives bitwise the same result split or not, on any number of threads (rows are independent),
// so the tuner's choice never changes what is generated; and whatever pieces gemv_batch cuts the rows
// into (piece_rows_for: up to 2 MiB, fewer with threads), each row is what the level's kernel gives
// over the whole matrix at once (gemv_at).  Rows of 4200 bytes are read in pairs half a piece apart,
// rows of 1400 as neighbours.
TEST(DecodeKernels, GemvBatchIsBitwiseTheSameSplitOrNot) {
  const int OC = 1000;
  const int saved = omp_get_max_threads();
  for (const int IC : {2100, 700}) {  // 2.1M and 0.7M multiply-adds: split at kGemvSplitMin, not at the default
    ASSERT_GE((long)OC * IC, kernels::kGemvSplitMin);
    ASSERT_LT((long)OC * IC, kernels::kGemvParallelMin);
    std::vector<float> W((size_t)OC * IC), x(IC);
    std::vector<uint16_t> Wh(W.size());
    for (size_t i = 0; i < W.size(); i++) {
      W[i] = (float)((mix64(i) % 2001) / 1000.0 - 1.0);
      Wh[i] = (uint16_t)(mix64(i + 7) >> 48) & 0xBF7F;  // finite bf16 values
    }
    for (int i = 0; i < IC; i++) x[i] = (float)((mix64(99 + i) % 2001) / 1000.0 - 1.0);
    for (const bool bf16 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "IC " << IC << " bf16 " << bf16);
      std::vector<float> ref(OC), whole(OC), y(OC);
      omp_set_num_threads(1);
      const WeightRef w =
          bf16 ? WeightRef{Wh.data(), DType::BF16} : WeightRef{W.data(), DType::F32};
      kernels::GemvTask t{ref.data(), w, x.data(), OC};
      kernels::gemv_batch(&t, 1, IC);
      kernels::gemv_at(kernels::simd_level(), whole.data(), w, x.data(), OC, IC);
      EXPECT_EQ(0, std::memcmp(ref.data(), whole.data(), sizeof(float) * OC)) << "pieces vs the whole matrix";
      for (const int threads : {2, 3}) {
        omp_set_num_threads(threads);
        for (const long min_macs : {kernels::kGemvParallelMin, kernels::kGemvSplitMin, 1L}) {
          t.y = y.data();
          kernels::gemv_batch(&t, 1, IC, min_macs);
          EXPECT_EQ(0, std::memcmp(ref.data(), y.data(), sizeof(float) * OC))
              << "threads " << threads << " threshold " << min_macs;
        }
      }
    }
  }
  omp_set_num_threads(saved);
}

// Every SIMD level this CPU has (generic, AVX2, AVX-512): bf16 and f16 weights give bitwise the
// product of their fp32 widening, for widths with and without tails; each level is within
// 2^-20 * sum_c |w x| of the exact (double) product (so the levels agree within twice that).
TEST(DecodeKernels, EverySimdLevelMeetsTheFp32WideningAndTheExactProduct) {
  std::vector<kernels::SimdLevel> levels = {kernels::SimdLevel::generic};
  if ((int)kernels::simd_level() >= (int)kernels::SimdLevel::avx2) levels.push_back(kernels::SimdLevel::avx2);
  if (kernels::simd_level() == kernels::SimdLevel::avx512) levels.push_back(kernels::SimdLevel::avx512);
  if (levels.size() < 3) std::printf("note: this CPU runs only %zu of the 3 SIMD levels\n", levels.size());
  for (const int IC : {7, 16, 24, 40, 64, 100, 1031}) {
    const int OC = 37;
    std::vector<uint16_t> wb((size_t)OC * IC), wh((size_t)OC * IC);
    std::vector<float> fb(wb.size()), fh(wh.size()), x(IC);
    for (size_t i = 0; i < wb.size(); i++) {
      const float v = (float)((mix64(i * 3 + 1) % 20001) / 10000.0 - 1.0);
      wb[i] = f32_to_bf16(v);
      fb[i] = bf16_to_f32(wb[i]);
      wh[i] = f32_to_f16(v);
      fh[i] = f16_to_f32(wh[i]);
    }
    for (int c = 0; c < IC; c++) x[c] = (float)((mix64(77 + c) % 2001) / 1000.0 - 1.0);
    for (const kernels::SimdLevel level : levels) {
      SCOPED_TRACE(::testing::Message() << kernels::simd_name(level) << " IC " << IC);
      std::vector<float> yb(OC), yfb(OC), yh(OC), yfh(OC);
      kernels::gemv_at(level, yb.data(), {wb.data(), DType::BF16}, x.data(), OC, IC);
      kernels::gemv_at(level, yfb.data(), {fb.data(), DType::F32}, x.data(), OC, IC);
      kernels::gemv_at(level, yh.data(), {wh.data(), DType::F16}, x.data(), OC, IC);
      kernels::gemv_at(level, yfh.data(), {fh.data(), DType::F32}, x.data(), OC, IC);
      EXPECT_EQ(0, std::memcmp(yb.data(), yfb.data(), sizeof(float) * OC)) << "bf16 vs its fp32 widening";
      EXPECT_EQ(0, std::memcmp(yh.data(), yfh.data(), sizeof(float) * OC)) << "f16 vs its fp32 widening";
      for (int r = 0; r < OC; r++) {
        double exact = 0, mag = 0;
        for (int c = 0; c < IC; c++) {
          exact += (double)fb[(size_t)r * IC + c] * x[c];
          mag += std::fabs((double)fb[(size_t)r * IC + c] * x[c]);
        }
        ASSERT_LE(std::fabs(yb[r] - exact), std::ldexp(mag, -20)) << "row " << r;
      }
    }
  }
}

// gemv_rows (W read once for up to 8 inputs: batched decoding, an expert's few prefill rows) gives
// each input bitwise what gemv gives it alone, for every weight dtype, with row strides and +=.
TEST(DecodeKernels, GemvRowsIsBitwiseGemvPerInput) {
  for (const int OC : {70, 75})  // blocks of 64 rows and 6 or 11: row pairs and an odd row left
    // 1031 and 2053: on AMD, passes of 4 (AVX-512) or 2 (AVX2) inputs of 4096 floats or more prefetch the rows
    // into L2 (multi_prefetch), and 7-8 inputs run over blocks of row pairs (multi_block_pairs, AVX-512).
    for (const int IC : {7, 24, 40, 100, 1031, 2053}) {
      std::vector<uint16_t> wb((size_t)OC * IC), wh((size_t)OC * IC);
      std::vector<float> wf((size_t)OC * IC);
      for (size_t i = 0; i < wf.size(); i++) {
        wf[i] = (float)((mix64(i * 5 + 3) % 20001) / 10000.0 - 1.0);
        wb[i] = f32_to_bf16(wf[i]);
        wh[i] = f32_to_f16(wf[i]);
      }
      const int ld_x = IC + 3, ld_out = OC + 5;
      std::vector<float> x((size_t)kernels::kMaxGemvInputs * ld_x);
      for (size_t i = 0; i < x.size(); i++) x[i] = (float)((mix64(31 + i) % 2001) / 1000.0 - 1.0);
      for (const WeightRef w :
           {WeightRef{wf.data(), DType::F32}, WeightRef{wb.data(), DType::BF16},
            WeightRef{wh.data(), DType::F16}})
        for (int n = 1; n <= kernels::kMaxGemvInputs; n++)
          for (const bool acc : {false, true}) {
            SCOPED_TRACE(::testing::Message()
                         << dtype_name(w.dtype) << " OC " << OC << " IC " << IC << " n " << n << " acc " << acc);
            std::vector<float> out((size_t)n * ld_out, 0.25f), want(out);
            kernels::gemv_rows(out.data(), ld_out, x.data(), ld_x, w, n, IC, OC, acc, 1);  // split at any size
            for (int j = 0; j < n; j++)
              kernels::gemv(want.data() + (size_t)j * ld_out, w, x.data() + (size_t)j * ld_x, OC, IC, acc);
            ASSERT_EQ(0, std::memcmp(out.data(), want.data(), sizeof(float) * out.size()));
          }
    }
}

// gemv_batch runs consecutive tasks of one matrix (a product of more than 8 rows, split by the caller)
// block by block together; each task's result is bitwise what it gets alone, for bf16 and Q8_0 weights,
// with another matrix's tasks between, several threads and any split threshold.
TEST(DecodeKernels, GemvBatchTasksOfOneMatrixGetWhatEachGetsAlone) {
  const int OC = 200, IC = 256;  // 4 blocks of 64 rows, the last one short
  std::vector<float> W((size_t)OC * IC), W2((size_t)OC * IC);
  for (size_t i = 0; i < W.size(); i++) {
    W[i] = (float)((mix64(i * 7 + 1) % 2001) / 1000.0 - 1.0);
    W2[i] = (float)((mix64(i * 11 + 5) % 2001) / 1000.0 - 1.0);
  }
  std::vector<uint16_t> wb(W.size()), wb2(W.size());
  for (size_t i = 0; i < W.size(); i++) wb[i] = f32_to_bf16(W[i]), wb2[i] = f32_to_bf16(W2[i]);
  std::vector<int8_t> q(W.size()), q2(W.size());
  std::vector<uint16_t> d(W.size() / kernels::kQ8Block), d2(d.size());
  ASSERT_TRUE(kernels::quantize_q8_0({W.data()}, OC, IC, q.data(), d.data()));
  ASSERT_TRUE(kernels::quantize_q8_0({W2.data()}, OC, IC, q2.data(), d2.data()));
  const int rows = 21;  // tasks of 8, 8 and 5 inputs on the first matrix, then one of 3 on the second
  std::vector<float> x((size_t)rows * IC);
  for (size_t i = 0; i < x.size(); i++) x[i] = (float)((mix64(123 + i) % 2001) / 1000.0 - 1.0);
  const int saved = omp_get_max_threads();
  const std::pair<WeightRef, WeightRef> mats[] = {
      {{wb.data(), DType::BF16}, {wb2.data(), DType::BF16}},
      {{q.data(), DType::U8, d.data()}, {q2.data(), DType::U8, d2.data()}}};
  for (const auto& [A, B] : mats) {
    std::vector<kernels::GemvTask> tasks;
    std::vector<float> got((size_t)(rows + 3) * OC, 0.5f), want(got);  // the second matrix's 3 rows last
    const int split[][2] = {{0, 8}, {8, 8}, {16, 5}};
    for (const auto& [j, n] : split) tasks.push_back({got.data() + (size_t)j * OC, A, x.data() + (size_t)j * IC, OC, true, n, IC, OC});
    tasks.push_back({got.data() + (size_t)rows * OC, B, x.data() + (size_t)18 * IC, OC, true, 3, IC, OC});
    for (const auto& [j, n] : split)
      kernels::gemv_rows(want.data() + (size_t)j * OC, OC, x.data() + (size_t)j * IC, IC, A, n, IC, OC, true);
    kernels::gemv_rows(want.data() + (size_t)rows * OC, OC, x.data() + (size_t)18 * IC, IC, B, 3, IC, OC, true);
    for (const int threads : {1, 2, 3})
      for (const long min_macs : {kernels::kGemvParallelMin, 1L}) {
        SCOPED_TRACE(::testing::Message() << (A.q8() ? "Q8_0" : "bf16") << " threads " << threads << " threshold " << min_macs);
        omp_set_num_threads(threads);
        std::fill(got.begin(), got.end(), 0.5f);
        kernels::gemv_batch(tasks.data(), (int)tasks.size(), IC, min_macs);
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), sizeof(float) * got.size()));
      }
  }
  omp_set_num_threads(saved);
}

// Attention's kernels: dot follows its stated order exactly (eight fma lanes, the lanes' fixed sum,
// the tail), written out here in scalar code; dot_rows and axpy_rows give, key for key,
// bitwise what dot and axpy give (several keys run at once, and o is held in registers).
// Greedy sampling's argmax: at every SIMD level, the index std::max_element gives -- the first of
// tied largest values, -0 and +0 as one value, infinities, and NaNs wherever they lie.
TEST(DecodeKernels, ArgmaxIsTheIndexMaxElementGives) {
  std::vector<kernels::SimdLevel> levels = {kernels::SimdLevel::generic};
  if ((int)kernels::simd_level() >= (int)kernels::SimdLevel::avx2) levels.push_back(kernels::SimdLevel::avx2);
  if (kernels::simd_level() == kernels::SimdLevel::avx512) levels.push_back(kernels::SimdLevel::avx512);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  int cases = 0;
  for (const int n : {1, 2, 7, 8, 9, 15, 16, 17, 33, 1000, 32000, 32003})
    for (int kind = 0; kind < 8; kind++) {
      std::vector<float> x(n);
      for (int i = 0; i < n; i++) {
        const uint64_t h = mix64((uint64_t)n * 131 + i * 7 + kind);
        switch (kind) {
          case 0: x[i] = (float)((h % 200001) / 1000.0 - 100.0); break;  // distinct-ish values
          case 1: x[i] = (float)(h % 5);  break;                           // many ties of the largest
          case 2: x[i] = h % 2 ? 0.0f : -0.0f; break;                      // signed zeros only
          case 3: x[i] = -inf; break;                                      // all -inf
          default: x[i] = (float)((h % 2001) / 100.0 - 10.0); break;
        }
      }
      const int at = (int)(mix64((uint64_t)n + kind) % n);
      if (kind == 4) x[at] = inf;
      if (kind == 5) x[at] = nan;
      if (kind == 6) x[0] = nan;
      if (kind == 7) x[n - 1] = nan;
      const int want = (int)(std::max_element(x.begin(), x.end()) - x.begin());
      for (const kernels::SimdLevel level : levels) {
        SCOPED_TRACE(::testing::Message() << kernels::simd_name(level) << " n " << n << " kind " << kind);
        ASSERT_EQ(kernels::argmax_at(level, x.data(), n), want);
      }
      ASSERT_EQ(kernels::argmax(x.data(), n), want);
      cases++;
    }
  EXPECT_EQ(cases, 96);
}

TEST(DecodeKernels, AttentionDotAndWeightedSumFollowTheirStatedOrder) {
  for (const int n : {1, 7, 8, 16, 32, 56, 64, 100, 128, 131})
    for (const int count : {1, 3, 4, 5, 9, 17}) {
      SCOPED_TRACE(::testing::Message() << "n " << n << " keys " << count);
      const size_t ld = (size_t)n + 5;
      std::vector<float> q(n), k(count * ld), w(count), o(n), want(n);
      for (int i = 0; i < n; i++) q[i] = (float)((mix64(7 * i + 1) % 2001) / 1000.0 - 1.0);
      for (size_t i = 0; i < k.size(); i++) k[i] = (float)((mix64(11 * i + 5) % 2001) / 1000.0 - 1.0);
      for (int j = 0; j < count; j++) w[j] = (float)((mix64(13 * j + 9) % 1001) / 1000.0);
      for (int i = 0; i < n; i++) o[i] = want[i] = (float)((mix64(17 * i + 3) % 2001) / 1000.0 - 1.0);
      std::vector<float> s(count);
      kernels::dot_rows(s.data(), q.data(), k.data(), ld, count, n, 0.125f);
      for (int j = 0; j < count; j++) {
        const float* kj = k.data() + j * ld;
        float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int i = 0;
        for (; i + 8 <= n; i += 8)
          for (int t = 0; t < 8; t++) l[t] = std::fma(q[i + t], kj[i + t], l[t]);
        float ref = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
        for (; i < n; i++) ref = std::fma(q[i], kj[i], ref);
        ASSERT_EQ(kernels::dot(q.data(), kj, n), ref) << "key " << j;
        ASSERT_EQ(s[j], ref * 0.125f) << "key " << j;
        kernels::axpy(want.data(), w[j], kj, n);
      }
      std::vector<float> o2(o), w2(count), want2(o2);  // axpy_rows2: a second output, its own weights
      for (int j = 0; j < count; j++) w2[j] = (float)((mix64(19 * j + 4) % 1001) / 1000.0);
      kernels::axpy_rows(want2.data(), w2.data(), k.data(), ld, count, n);
      kernels::axpy_rows(o.data(), w.data(), k.data(), ld, count, n);
      ASSERT_EQ(0, std::memcmp(o.data(), want.data(), sizeof(float) * n));
      std::vector<float> p1(o2);
      kernels::axpy_rows2(p1.data(), o2.data(), w.data(), w2.data(), k.data(), ld, count, n);
      ASSERT_EQ(0, std::memcmp(o2.data(), want2.data(), sizeof(float) * n));
      ASSERT_EQ(0, std::memcmp(p1.data(), o.data(), sizeof(float) * n));
      // axpy itself: one fma per value.
      std::vector<float> y(q);
      kernels::axpy(y.data(), w[0], k.data(), n);
      for (int i = 0; i < n; i++) ASSERT_EQ(y[i], std::fma(w[0], k[i], q[i])) << i;
    }
}

// Continuous batching: sequences of different lengths decoded together, joining and leaving the batch
// between steps, get bitwise the logits and caches each gets alone -- for every architecture (routed
// experts read once for all the rows routed to them), with batches up to 11 rows (more than one
// gemv_rows group of 8).
TEST(Decoder, BatchedDecodingIsBitwiseEachSequenceAlone) {
  for (const std::string& dir : model_dirs()) {
    SCOPED_TRACE(dir);
    const auto model = load_inference_model(dir);
    const int V = model->cfg.vocab_size, S = 11;
    ModelRunner batched(*model), alone(*model);
    std::vector<KvCache> bc, ac;
    std::vector<int32_t> next(S);
    for (int s = 0; s < S; s++) {
      bc.push_back(batched.new_cache());
      ac.push_back(alone.new_cache());
      const std::vector<int32_t> prompt = random_tokens(2 + 3 * s % 13, V, 100 + s);
      std::vector<float> l(V);
      batched.forward(bc[s], prompt, l.data());
      alone.forward(ac[s], prompt, l.data());
      next[s] = (int32_t)(mix64(s) % V);
    }
    std::vector<float> lb((size_t)S * V), la(V);
    for (int step = 0; step < 12; step++) {
      std::vector<KvCache*> caches;
      std::vector<int32_t> toks;
      std::vector<int> who;
      for (int s = 0; s < S; s++)
        if ((s + step) % 4 != 0 || step == 5) {  // a changing subset; at step 5 all of them
          caches.push_back(&bc[s]);
          toks.push_back(next[s]);
          who.push_back(s);
        }
      batched.forward_batch(caches, toks, lb.data());
      for (size_t j = 0; j < who.size(); j++) {
        const int s = who[j];
        alone.forward(ac[s], std::span<const int32_t>(&next[s], 1), la.data());
        ASSERT_EQ(0, std::memcmp(lb.data() + j * V, la.data(), sizeof(float) * V)) << "step " << step << " seq " << s;
        next[s] = (int32_t)(std::max_element(la.begin(), la.end()) - la.begin());
      }
    }
    for (int s = 0; s < S; s++) {
      ASSERT_EQ(bc[s].tokens(), ac[s].tokens());
      for (int l = 0; l < bc[s].layers(); l++)
        ASSERT_EQ(0, std::memcmp(bc[s].keys(l), ac[s].keys(l), sizeof(float) * bc[s].len() * bc[s].kv_dim()));
    }
    // Bad input: nothing fed, nothing changed.
    std::vector<KvCache*> twice = {&bc[0], &bc[0]};
    const std::vector<int32_t> two = {1, 2}, bad = {V};
    std::vector<KvCache*> one = {&bc[1]};
    const int len0 = bc[0].len(), len1 = bc[1].len();
    EXPECT_THROW(batched.forward_batch(twice, two, lb.data()), Error);
    EXPECT_THROW(batched.forward_batch(one, bad, lb.data()), Error);
    EXPECT_THROW(batched.forward_batch(one, two, lb.data()), Error);
    EXPECT_EQ(bc[0].len(), len0);
    EXPECT_EQ(bc[1].len(), len1);
  }
}

// weights_read (what bench generate divides by the steps): a one-token step reads every dense matrix
// and the head once, the router, and the K routed experts of each layer; a batch of two sequences that
// route alike (the same cache, the same token) reads exactly as much -- an expert once for all its rows
// -- and a batch of S sequences at most min(E, S K) experts a layer.
TEST(Decoder, WeightsReadCountEachMatrixOnceAStepAndOnlyTheRoutedExperts) {
  const auto model = load_inference_model((kGolden / "mixtral_gqa").string());
  const ModelConfig& c = model->cfg;
  const int C = c.hidden_size, HD = c.head_dim, Q = c.num_attention_heads * HD, KV = c.num_key_value_heads * HD;
  const int E = c.num_local_experts, K = c.num_experts_per_tok, L = c.num_hidden_layers, V = c.vocab_size;
  ASSERT_EQ(model->mat(ParamKind::q_proj, 0, 0, (size_t)Q * C).dtype, DType::F32);
  const size_t dense = ((size_t)Q * C * 2 + (size_t)KV * C * 2) * 4 + (size_t)E * C * 4;  // + the fp32 router
  const size_t expert = (size_t)3 * c.ffn_size(0) * C * 4;
  const size_t head = (size_t)V * C * 4;
  const size_t one_step = L * (dense + K * expert) + head;

  ModelRunner dec(*model);
  const std::vector<int32_t> prompt = random_tokens(5, V, 7);
  KvCache a = dec.new_cache(), b = dec.new_cache();
  std::vector<float> l((size_t)3 * V);
  dec.forward(a, prompt, l.data());
  dec.forward(b, prompt, l.data());
  const int32_t t = 11;
  size_t before = dec.weights_read();
  dec.forward(a, std::span<const int32_t>(&t, 1), l.data());
  EXPECT_EQ(dec.weights_read() - before, one_step);

  KvCache a2 = dec.new_cache(), b2 = dec.new_cache(), c2 = dec.new_cache();
  for (KvCache* k : {&a2, &b2, &c2}) dec.forward(*k, prompt, l.data());
  std::vector<KvCache*> alike = {&a2, &b2};
  const std::vector<int32_t> same = {t, t};
  before = dec.weights_read();
  dec.forward_batch(alike, same, l.data());
  EXPECT_EQ(dec.weights_read() - before, one_step);

  std::vector<KvCache*> three = {&a, &b, &c2};
  const std::vector<int32_t> differ = {3, 40, 97};
  before = dec.weights_read();
  dec.forward_batch(three, differ, l.data());
  const size_t read = dec.weights_read() - before;
  EXPECT_GE(read, one_step);
  EXPECT_LE(read, L * (dense + std::min(E, 3 * K) * expert) + head);
  EXPECT_EQ((read - head - L * dense) % expert, 0u);
}

// prefill_rows (serve's prefill of short prompts, several at once): each sequence's last logits and
// its cache are bitwise those of feeding its tokens one at a time, whatever the other sequences and
// however the passes split them (chunk 7: sequences straddle passes); a sequence with cached tokens
// continues after them.
TEST(Decoder, RowPrefillOfSeveralSequencesIsBitwiseTokenByToken) {
  for (const std::string& dir : model_dirs()) {
    SCOPED_TRACE(dir);
    const auto model = load_inference_model(dir);
    const int V = model->cfg.vocab_size;
    for (const int chunk : {256, 7}) {
      ModelRunner rows(*model, chunk), alone(*model);
      std::vector<KvCache> rc, ac;
      std::vector<std::vector<int32_t>> prompts;
      for (int s = 0; s < 4; s++) {
        rc.push_back(rows.new_cache());
        ac.push_back(alone.new_cache());
        prompts.push_back(random_tokens(1 + 5 * s, V, 300 + s));
      }
      std::vector<float> la(V), lb((size_t)4 * V);
      rows.forward(rc[2], std::span<const int32_t>(prompts[2]).first(1), la.data());  // one token cached already
      alone.forward(ac[2], std::span<const int32_t>(prompts[2]).first(1), la.data());
      std::vector<KvCache*> caches;
      std::vector<std::span<const int32_t>> feed;
      for (int s = 0; s < 4; s++) {
        caches.push_back(&rc[s]);
        feed.push_back(std::span<const int32_t>(prompts[s]).subspan(s == 2 ? 1 : 0));
      }
      rows.prefill_rows(caches, feed, lb.data());
      for (int s = 0; s < 4; s++) {
        for (size_t t = s == 2 ? 1 : 0; t < prompts[s].size(); t++)
          alone.forward(ac[s], std::span<const int32_t>(prompts[s]).subspan(t, 1), la.data());
        ASSERT_EQ(0, std::memcmp(lb.data() + (size_t)s * V, la.data(), sizeof(float) * V)) << "chunk " << chunk << " seq " << s;
        ASSERT_EQ(rc[s].tokens(), ac[s].tokens());
        for (int l = 0; l < rc[s].layers(); l++)
          ASSERT_EQ(0, std::memcmp(rc[s].values(l), ac[s].values(l), sizeof(float) * rc[s].len() * rc[s].v_dim()));
      }
    }
  }
}

TEST(Decoder, RejectsBadTokensWithoutChangingTheCache) {
  const auto model = load_inference_model((kGenerate / "llama_dense").string());
  ModelRunner dec(*model);
  KvCache cache = dec.new_cache();
  std::vector<float> logits(model->cfg.vocab_size);
  const std::vector<int32_t> good = {1, 5, 9};
  dec.forward(cache, good, logits.data());
  const std::vector<int32_t> bad = {3, model->cfg.vocab_size};
  EXPECT_THROW(dec.forward(cache, bad, logits.data()), Error);
  const std::vector<int32_t> negative = {-1};
  EXPECT_THROW(dec.forward(cache, negative, logits.data()), Error);
  EXPECT_THROW(dec.forward(cache, std::span<const int32_t>(), logits.data()), Error);
  EXPECT_EQ(cache.tokens(), good);
}

// transformers' generate(do_sample=False), 32 new tokens (tools/make_generate_reference.py).
TEST(Generate, GreedyEqualsTransformersGenerate) {
  const nlohmann::json exp = expected_json();
  // Mixtral, Llama, Qwen3-MoE, OLMoE, Qwen2-MoE, Mistral, Qwen3, GLM-4.5, DeepSeek-V3 (latent cache)
  ASSERT_EQ(exp["cases"].size(), 9u);
  for (const auto& c : exp["cases"]) {
    const std::string dir = (kGenerate / c["model"].get<std::string>()).string();
    SCOPED_TRACE(dir);
    const auto model = load_inference_model(dir);
    const std::vector<int32_t> eos = model_eos_ids(dir, model->cfg, nullptr);
    EXPECT_EQ(eos, std::vector<int32_t>{2});
    for (const bool in_place : {true, false}) {  // the CPU inference backend, and the CPU backend
    SCOPED_TRACE(in_place ? "in place" : "on the CPU backend");
    std::unique_ptr<ModelRunner> runner = in_place ? std::make_unique<ModelRunner>(*model)
                                                   : std::make_unique<ModelRunner>(std::make_unique<CpuBackend>(), dir);
    ModelRunner& dec = *runner;
    KvCache cache = dec.new_cache();
    const auto prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    const auto want = c["expected_ids"].get<std::vector<int32_t>>();
    ASSERT_EQ(want.size(), 32u);
    EXPECT_EQ(generate_greedy(dec, cache, prompt, 32, eos), want);
    // Again on the same cache: the whole prompt is a cached prefix now (all but its last token reused).
    GenerateOptions o;
    o.max_new_tokens = 32;
    o.eos_ids = eos;
    const GenerateResult r = generate(dec, cache, prompt, o, nullptr);
    EXPECT_EQ(r.tokens, want);
    EXPECT_EQ(r.reused_tokens, (int)prompt.size() - 1);
    EXPECT_EQ(r.finish, FinishReason::length);
    // A fresh cache with a prompt sharing only a prefix (the cache holds prompt + reply[:31]).
    std::vector<int32_t> longer = prompt;
    longer.insert(longer.end(), want.begin(), want.begin() + 10);
    const GenerateResult r2 = generate(dec, cache, longer, o, nullptr);
    EXPECT_EQ(r2.reused_tokens, (int)longer.size() - 1);
    EXPECT_EQ(std::vector<int32_t>(r2.tokens.begin(), r2.tokens.begin() + 22),
              std::vector<int32_t>(want.begin() + 10, want.end()));
    }
  }
}

// The text exchanges of the server tests, through the library: chat (mistral template) and completion.
TEST(Generate, TextRepliesEqualTransformers) {
  const nlohmann::json exp = expected_json();
  const auto& t = exp["cases"][0]["text"];
  const std::string dir = (kGenerate / "mixtral_gqa").string();
  const auto model = load_inference_model(dir);
  const auto tok = load_model_tokenizer(dir, "", model->cfg, true);
  ModelRunner dec(*model);
  KvCache cache = dec.new_cache();
  GenerateOptions o;
  o.max_new_tokens = t["max_tokens"].get<int>();
  o.eos_ids = model_eos_ids(dir, model->cfg, tok.get());

  const auto chat_prompt = chat_prompt_tokens(ChatTemplate::mistral, *tok, {{Role::user, t["chat"]["user"]}});
  EXPECT_EQ(chat_prompt, t["chat"]["prompt_ids"].get<std::vector<int32_t>>());
  std::string streamed;
  GenerateCallbacks cb;
  cb.on_text = [&](const std::string& s) {
    EXPECT_FALSE(s.empty());
    streamed += s;
    return true;
  };
  o.chat_reply = true;
  GenerateResult r = generate(dec, cache, chat_prompt, o, tok.get(), cb);
  EXPECT_EQ(r.tokens, t["chat"]["completion_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(r.text, t["chat"]["content"].get<std::string>());
  EXPECT_EQ(streamed, r.text);
  EXPECT_EQ(finish_reason_name(r.finish), t["chat"]["finish_reason"].get<std::string>());

  const auto comp_prompt = completion_prompt_tokens(*tok, t["completion"]["prompt"]);
  EXPECT_EQ(comp_prompt, t["completion"]["prompt_ids"].get<std::vector<int32_t>>());
  o.chat_reply = false;
  streamed.clear();
  r = generate(dec, cache, comp_prompt, o, tok.get(), cb);
  EXPECT_EQ(r.text, t["completion"]["text"].get<std::string>());
  EXPECT_EQ(streamed, r.text);

  // A stop string from the middle of the expected text: the reply ends right before it.
  const std::string full = t["completion"]["text"];
  const std::string stop = full.substr(full.size() / 2, 3);
  o.stop = {stop, "never-appears"};
  streamed.clear();
  r = generate(dec, cache, comp_prompt, o, tok.get(), cb);
  EXPECT_EQ(r.text, full.substr(0, full.find(stop)));
  EXPECT_EQ(streamed, r.text);
  EXPECT_EQ(r.finish, FinishReason::stop);

  // Cancelling from the callback ends the reply.
  o.stop.clear();
  int calls = 0;
  cb.on_token = [&](int32_t) { return ++calls < 3; };
  r = generate(dec, cache, comp_prompt, o, tok.get(), cb);
  EXPECT_EQ(r.finish, FinishReason::cancelled);
  EXPECT_EQ(r.tokens.size(), 3u);
}

TEST(Generate, PositionLimitAndZeroTokens) {
  const auto model = load_inference_model((kGenerate / "llama_dense").string());
  ModelRunner dec(*model);
  KvCache cache = dec.new_cache();
  GenerateOptions o;
  o.max_new_tokens = 100;
  o.max_positions = 12;
  const std::vector<int32_t> prompt = {1, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  GenerateResult r = generate(dec, cache, prompt, o, nullptr);
  EXPECT_EQ(r.tokens.size(), 2u);  // 10 + 2 = 12 positions
  EXPECT_EQ(r.finish, FinishReason::length);
  o.max_positions = 5;
  EXPECT_THROW(generate(dec, cache, prompt, o, nullptr), Error);
  o.max_positions = 0;
  o.max_new_tokens = 0;
  r = generate(dec, cache, prompt, o, nullptr);
  EXPECT_TRUE(r.tokens.empty());
}

// Logits that come out NaN or infinite (weights that passed the load-time check but overflow, or were
// changed in memory) stop generation with an Error instead of streaming token after garbage token.
TEST(Generate, NonFiniteLogitsStopWithAnError) {
  auto model = load_inference_model((kGenerate / "llama_dense").string());
  const ParamSpec& norm = model->table.at(ParamKind::final_norm);
  ModelRunner dec(*model);
  const std::vector<int32_t> prompt = {1, 4, 5, 6};
  GenerateOptions o;
  o.max_new_tokens = 8;
  for (float poison : {std::nanf(""), 3.0e38f /* finite: the logits overflow to infinity */}) {
    SCOPED_TRACE(poison);
    std::fill(model->vec_mut(ParamKind::final_norm), model->vec_mut(ParamKind::final_norm) + norm.numel, poison);
    KvCache cache = dec.new_cache();
    int tokens = 0;
    GenerateCallbacks cb;
    cb.on_token = [&](int32_t) { return ++tokens, true; };
    try {
      generate(dec, cache, prompt, o, nullptr, cb);
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not finite"), std::string::npos) << e.what();
    }
    EXPECT_EQ(tokens, 0) << "no token may be sampled from non-finite logits";
  }
}

// ---- sampling ------------------------------------------------------------------------------------

TEST(Sampler, GreedyIsFirstArgmaxAndTopK1IsGreedy) {
  std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f};
  Sampler g({}, 4);
  EXPECT_EQ(g.next(std::vector<float>(l).data(), {}, {}), 1);
  SamplingParams p;
  p.temperature = 1.5f;
  p.top_k = 1;
  Sampler s(p, 4);
  for (int i = 0; i < 20; i++) EXPECT_EQ(s.next(std::vector<float>(l).data(), {}, {}), 1);
}

// Below kGreedyTemperature the sampler is greedy: dividing by a denormal temperature (1e-45) made
// every logit infinite and the draw garbage.
TEST(Sampler, TinyTemperaturesAreGreedy) {
  const std::vector<float> l = {0.5f, -3.0f, 2.0f, 1.9f, 2.0f};
  for (float t : {1e-45f, 1e-38f, 1e-20f, 9.9e-6f}) {
    SCOPED_TRACE(t);
    SamplingParams p;
    p.temperature = t;
    p.top_p = 0.9f;
    p.seed = 7;
    EXPECT_TRUE(p.greedy());
    Sampler s(p, 5);
    for (int i = 0; i < 50; i++) EXPECT_EQ(s.next(std::vector<float>(l).data(), {}, {}), 2);
  }
  SamplingParams p;
  p.temperature = kGreedyTemperature;
  EXPECT_FALSE(p.greedy());
}

TEST(Sampler, SeededDrawsAreReproducibleAndFollowTheSoftmax) {
  const std::vector<float> l = {1.0f, 0.0f, -1.0f, 2.0f, 0.5f};
  SamplingParams p;
  p.temperature = 2.0f;
  p.seed = 42;
  Sampler a(p, 5), b(p, 5);
  std::vector<int> count(5, 0);
  const int n = 40000;
  for (int i = 0; i < n; i++) {
    const int x = a.next(std::vector<float>(l).data(), {}, {});
    EXPECT_EQ(x, b.next(std::vector<float>(l).data(), {}, {}));
    count[x]++;
  }
  double z = 0;
  for (float v : l) z += std::exp(v / 2.0);
  for (int v = 0; v < 5; v++) {
    const double pv = std::exp(l[v] / 2.0) / z;
    const double sd = std::sqrt(pv * (1 - pv) / n);
    EXPECT_NEAR((double)count[v] / n, pv, 5 * sd) << "token " << v;
  }
}

TEST(Sampler, TopPKeepsTheNucleusOnly) {
  // probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625: top_p 0.7 keeps {0, 1}; 0.75 keeps {0, 1} too
  // (cumulative reaches 0.75 exactly), 0.8 adds token 2.
  const std::vector<float> l = {std::log(0.5f), std::log(0.25f), std::log(0.125f), std::log(0.0625f),
                                std::log(0.0625f)};
  for (auto [top_p, allowed] : std::vector<std::pair<float, int>>{{0.7f, 2}, {0.8f, 3}, {0.01f, 1}}) {
    SamplingParams p;
    p.temperature = 1.0f;
    p.top_p = top_p;
    p.seed = 3;
    Sampler s(p, 5);
    std::vector<int> seen(5, 0);
    for (int i = 0; i < 4000; i++) seen[s.next(std::vector<float>(l).data(), {}, {})]++;
    for (int v = 0; v < 5; v++) EXPECT_EQ(seen[v] > 0, v < allowed) << "top_p " << top_p << " token " << v;
  }
  // A large vocabulary exercises the growing sorted prefix.
  std::vector<float> big(5000, 0.0f);
  big[4321] = 12.0f;  // ~0.9 of the mass
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.5f;
  Sampler s(p, 5000);
  for (int i = 0; i < 50; i++) EXPECT_EQ(s.next(std::vector<float>(big).data(), {}, {}), 4321);
}

TEST(Sampler, RepetitionPresenceAndFrequencyPenalties) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  Sampler s(p, 4);
  std::vector<float> l = {3.0f, 2.0f, -1.0f, 1.9f};
  const std::vector<int32_t> ctx = {0, 2, 0};
  EXPECT_EQ(s.next(l.data(), ctx, {}), 1);  // 3 -> 1.5; 2 stays; -1 -> -2
  EXPECT_FLOAT_EQ(l[0], 1.5f);
  EXPECT_FLOAT_EQ(l[2], -2.0f);
  EXPECT_FLOAT_EQ(l[1], 2.0f);
  SamplingParams q;
  q.presence_penalty = 0.5f;
  q.frequency_penalty = 0.25f;
  Sampler f(q, 3);
  std::vector<float> m = {1.0f, 1.0f, 1.0f};
  const std::vector<int32_t> reply = {0, 0, 1};
  EXPECT_EQ(f.next(m.data(), {}, reply), 2);
  EXPECT_FLOAT_EQ(m[0], 1.0f - 0.5f - 0.5f);
  EXPECT_FLOAT_EQ(m[1], 1.0f - 0.5f - 0.25f);
}

TEST(Sampler, RejectsBadParameters) {
  auto bad = [](auto edit) {
    SamplingParams p;
    edit(p);
    return p;
  };
  EXPECT_THROW(validate_sampling(bad([](SamplingParams& p) { p.temperature = -1; })), Error);
  EXPECT_THROW(validate_sampling(bad([](SamplingParams& p) { p.top_p = 0; })), Error);
  EXPECT_THROW(validate_sampling(bad([](SamplingParams& p) { p.top_p = 1.5f; })), Error);
  EXPECT_THROW(validate_sampling(bad([](SamplingParams& p) { p.top_k = -2; })), Error);
  EXPECT_THROW(validate_sampling(bad([](SamplingParams& p) { p.repetition_penalty = 0; })), Error);
  EXPECT_THROW(validate_sampling(bad([](SamplingParams& p) { p.temperature = NAN; })), Error);
}

// ---- incremental text ----------------------------------------------------------------------------

namespace {

std::string stream_all(const Tokenizer& tok, std::span<const int32_t> context, std::span<const int32_t> ids,
                       std::vector<std::string> stop, bool* stopped = nullptr) {
  TextStream ts(tok, context, std::move(stop));
  std::string out;
  for (int32_t id : ids) {
    const std::string piece = ts.push(id);
    EXPECT_EQ(incomplete_utf8_tail(out + piece), 0u) << "a piece ended inside a UTF-8 character";
    out += piece;
    if (ts.stopped()) break;
  }
  out += ts.finish();
  EXPECT_EQ(out, ts.text());
  if (stopped) *stopped = ts.stopped();
  return out;
}

}  // namespace

TEST(TextStream, PiecesConcatenateToTheDecode) {
  const auto tok = Tokenizer::load((kGenerate / "mixtral_gqa" / "tokenizer.model").string());
  const std::vector<int32_t> ids = tok.encode("The cat sees the river, and a dog finds 42 apples.");
  EXPECT_EQ(stream_all(tok, {}, ids, {}), tok.decode(ids));
  // Completion mode: the context token keeps the first piece's space.
  const std::vector<int32_t> ctx = tok.encode("Once");
  EXPECT_EQ(stream_all(tok, ctx, ids, {}), " " + tok.decode(ids));
}

// A model whose vocab_size exceeds its tokenizer's (Qwen: 151936 rows, 151665 tokens) can emit a
// padding id: it has no text, as in HF's decode, instead of failing the reply.
TEST(TextStream, IdsPastTheTokenizerHaveNoText) {
  const auto tok = Tokenizer::load((kGenerate / "qwen3_moe" / "tokenizer.json").string());
  ASSERT_EQ(tok.vocab_size(), 802);
  std::vector<int32_t> ids = tok.encode("The cat sees the river.");
  const std::string want = tok.decode(ids);
  ids.insert(ids.begin() + 2, 805);
  ids.push_back(831);
  EXPECT_EQ(stream_all(tok, {}, ids, {}), want);
}

TEST(TextStream, StopStringsEndTheTextBeforeThem) {
  const auto tok = Tokenizer::load((kGenerate / "mixtral_gqa" / "tokenizer.model").string());
  const std::string text = "The cat sees the river, and a dog finds the market.";
  const std::vector<int32_t> ids = tok.encode(text);
  bool stopped = false;
  EXPECT_EQ(stream_all(tok, {}, ids, {"river", "dog"}, &stopped), "The cat sees the ");
  EXPECT_TRUE(stopped);
  EXPECT_EQ(stream_all(tok, {}, ids, {"og fi"}, &stopped), "The cat sees the river, and a d");
  EXPECT_TRUE(stopped);
  // A held-back prefix of a stop string that never completes is released at the end.
  EXPECT_EQ(stream_all(tok, {}, ids, {"market!"}, &stopped), text);
  EXPECT_FALSE(stopped);
  EXPECT_EQ(stream_all(tok, {}, ids, {".", ""}, &stopped), "The cat sees the river, and a dog finds the market");
  EXPECT_TRUE(stopped);
}

TEST(TextStream, MultiByteCharactersNeverSplit) {
  REQUIRE_MIXTRAL();
  const Tokenizer& tok = moetron::testing::mixtral();
  const std::string text = "héllo wörld — 你好, 🙂🙃 ok ∑x²";
  const std::vector<int32_t> ids = tok.encode(text);
  EXPECT_EQ(stream_all(tok, {}, ids, {}), tok.decode(ids));
  EXPECT_EQ(stream_all(tok, {}, ids, {"🙃"}), "héllo wörld — 你好, 🙂");
}

TEST(TextStream, IncompleteUtf8Tail) {
  EXPECT_EQ(incomplete_utf8_tail("abc"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("ab\xC3"), 1u);
  EXPECT_EQ(incomplete_utf8_tail("ab\xC3\xA9"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("\xF0\x9F\x99"), 3u);
  EXPECT_EQ(incomplete_utf8_tail("\xF0\x9F\x99\x82"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("\xE4\xBD"), 2u);
}

// --eval-chat holds conversations to the model's positions as --prompt does (the hostile-input
// review: a 13 MB conversation ran past the context with exit 0): an Error naming the line.
TEST(EvalChat, AConversationBeyondTheModelsPositionsIsAnErrorNamingTheLine) {
  const std::string dir = (kGenerate / "mixtral_gqa").string();
  const auto model = load_inference_model(dir);
  const auto tok = load_model_tokenizer(dir, "", model->cfg, true);
  ModelRunner decoder(*model);
  const fs::path path = fs::temp_directory_path() / ("moetron_evalchat_" + std::to_string(::getpid()) + ".jsonl");
  std::string long_text;
  for (int i = 0; i < 600; i++) long_text += "word" + std::to_string(i) + " ";
  {
    std::ofstream out(path);
    out << R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]})" << "\n";
    out << nlohmann::json{{"messages", {{{"role", "user"}, {"content", long_text}}, {{"role", "assistant"}, {"content", "x"}}}}}.dump()
        << "\n";
  }
  const std::vector<int32_t> eos = {tok->eos_id()};
  try {
    chat_answer_accuracy(decoder, *tok, ChatTemplate::mistral, eos, path.string(), 8, 0);
    ADD_FAILURE() << "accepted a conversation longer than " << model->cfg.max_position_embeddings << " positions";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path.string() + ":2: the conversation is"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("more than the model's 512 positions"), std::string::npos) << e.what();
  }
  // A line beyond 16 MiB is refused without being held (it was read whole with std::getline).
  {
    std::ofstream out(path);
    out << R"({"messages": [{"role": "user", "content": ")" << std::string((16u << 20) + 8, 'a') << R"("}]})" << "\n";
  }
  try {
    chat_answer_accuracy(decoder, *tok, ChatTemplate::mistral, eos, path.string(), 8, 0);
    ADD_FAILURE() << "accepted a 16 MiB line";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path.string() + ":1: the line is"), std::string::npos) << e.what();
  }
  fs::remove(path);
}
