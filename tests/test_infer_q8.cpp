// Q8_0 weights (quantized at load, kernels::quantize_q8_0) and the int8 products: the quantization is
// llama.cpp's rule; every SIMD level computes bitwise the same products, each the exact int8 block sums
// scaled in fp32 (within fp32 summation rounding of a double reference) and within the quantization
// bound of the unquantized product; batched inputs equal single ones; a model loaded with Q8_0 holds
// the quantized values and ~half the bytes of bf16; and perplexity -- checked against the training
// model's forward -- changes by a measured, bounded amount under Q8_0 on a trained model.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <omp.h>

#include "backend/kernels/gemv.h"
#include "backend/kernels/q8.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "infer/model_runner.h"
#include "infer/generate.h"
#include "infer/model.h"
#include "infer/perplexity.h"
#include "io/hf_config.h"
#include "model/params.h"
#include "io/model_files.h"
#include "model/model.h"
#include "model/weights.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

const fs::path kGolden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden";

float uniform(uint64_t i, double scale = 1.0) { return (float)(((mix64(i) % 20001) / 10000.0 - 1.0) * scale); }

// llama.cpp's rule, written out independently: d = max|x| / 127, q = roundf(x * (1 / d)).
void reference_quantize(const float* x, int n, std::vector<int8_t>& q, std::vector<float>& d) {
  q.resize(n);
  d.resize(n / 32);
  for (int b = 0; b < n / 32; b++) {
    float amax = 0;
    for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    d[b] = amax / 127.0f;
    const float id = d[b] != 0 ? 1.0f / d[b] : 0.0f;
    for (int i = 0; i < 32; i++) q[b * 32 + i] = (int8_t)std::roundf(x[b * 32 + i] * id);
  }
}

std::vector<kernels::SimdLevel> levels() {
  std::vector<kernels::SimdLevel> l = {kernels::SimdLevel::generic};
  if ((int)kernels::simd_level() >= (int)kernels::SimdLevel::avx2) l.push_back(kernels::SimdLevel::avx2);
  if (kernels::simd_level() == kernels::SimdLevel::avx512) l.push_back(kernels::SimdLevel::avx512);
  return l;
}

struct Q8Matrix {
  std::vector<int8_t> q;
  std::vector<uint16_t> d;
  WeightRef ref() const { return {q.data(), DType::U8, d.data()}; }
};

Q8Matrix quantized(const std::vector<float>& w, int OC, int IC) {
  Q8Matrix m;
  m.q.resize((size_t)OC * IC);
  m.d.resize((size_t)OC * IC / 32);
  EXPECT_TRUE(kernels::quantize_q8_0({w.data(), DType::F32}, OC, IC, m.q.data(), m.d.data()));
  return m;
}

}  // namespace

// Weights quantize by llama.cpp's rule (f16 scales), from bf16 as from its fp32 widening, and each
// value is back within half a step (plus the scale's f16 rounding) of where it was.
TEST(Q8Kernels, QuantizationIsLlamaCppsRule) {
  const int OC = 9, IC = 96;
  std::vector<float> w((size_t)OC * IC);
  std::vector<uint16_t> wb(w.size());
  for (size_t i = 0; i < w.size(); i++) {
    wb[i] = f32_to_bf16(uniform(i * 7 + 1, i % 5 == 0 ? 3.0 : 0.2));
    w[i] = bf16_to_f32(wb[i]);
  }
  for (int c = 0; c < 32; c++) w[c] = 0, wb[c] = 0;  // an all-zero block: scale 0, values 0
  const Q8Matrix m = quantized(w, OC, IC);
  std::vector<int8_t> qb(w.size());
  std::vector<uint16_t> db(w.size() / 32);
  ASSERT_TRUE(kernels::quantize_q8_0({wb.data(), DType::BF16}, OC, IC, qb.data(), db.data()));
  EXPECT_EQ(m.q, qb);
  EXPECT_EQ(m.d, db);
  std::vector<int8_t> rq;
  std::vector<float> rd;
  reference_quantize(w.data(), (int)w.size(), rq, rd);
  EXPECT_EQ(m.q, rq);
  for (size_t b = 0; b < rd.size(); b++) {
    ASSERT_EQ(m.d[b], f32_to_f16(rd[b])) << "block " << b;
    const float d16 = f16_to_f32(m.d[b]);
    for (int i = 0; i < 32; i++) {
      const size_t k = b * 32 + i;
      ASSERT_LE(std::abs((int)m.q[k]), 127);
      ASSERT_LE(std::fabs(w[k] - m.q[k] * d16), rd[b] * 0.5f + 127.0f * std::fabs(d16 - rd[b]) + 1e-7f) << k;
    }
  }
  EXPECT_EQ(m.d[0], 0);
  // Halves round away from zero (roundf): a block with max 127 has d = 1 exactly.
  std::vector<float> ties = {127, 2.5f, -3.5f, 0.5f, -0.5f, 1.4999999f, -126.5f, 0};
  ties.resize(32, 0.25f);
  const Q8Matrix t = quantized(ties, 1, 32);
  EXPECT_EQ(std::vector<int>(t.q.begin(), t.q.begin() + 8), (std::vector<int>{127, 3, -4, 1, -1, 1, -127, 0}));
  // A scale beyond f16 (|w| > 65504 * 127) cannot be stored: refused, not written as infinity.
  std::vector<float> big(32, 1e7f);
  std::vector<int8_t> q(32);
  std::vector<uint16_t> d(1);
  EXPECT_FALSE(kernels::quantize_q8_0({big.data(), DType::F32}, 1, 32, q.data(), d.data()));
}

// Every SIMD level gives bitwise the same Q8_0 product; it equals, within fp32 summation rounding,
// the exact sum of dequantized weights times dequantized inputs (so the int8 block sums are right), and
// it is within the quantization bound of the unquantized product:
//   |sum w x - sum w' x'| <= sum_c |w_c| |x_c - x'_c| + |x'_c| |w_c - w'_c|,
// each difference at most half a step plus the f16 rounding of a weight scale.
TEST(Q8Kernels, EverySimdLevelIsBitwiseTheSameAndWithinTheQuantizationBound) {
  for (const int IC : {32, 64, 96, 672, 1024}) {
    const int OC = 37;
    std::vector<float> w((size_t)OC * IC), x(IC);
    for (size_t i = 0; i < w.size(); i++) w[i] = uniform(i * 3 + 1, i % 17 == 0 ? 4.0 : 0.5);
    for (int c = 0; c < IC; c++) x[c] = uniform(77 + c, c % 11 == 0 ? 8.0 : 1.0);
    const Q8Matrix m = quantized(w, OC, IC);
    std::vector<int8_t> xq;
    std::vector<float> xd;
    reference_quantize(x.data(), IC, xq, xd);
    std::vector<float> first;
    for (const kernels::SimdLevel level : levels()) {
      SCOPED_TRACE(::testing::Message() << kernels::simd_name(level) << " IC " << IC);
      std::vector<float> y(OC);
      kernels::gemv_at(level, y.data(), m.ref(), x.data(), OC, IC);
      if (first.empty()) first = y;
      EXPECT_EQ(0, std::memcmp(first.data(), y.data(), sizeof(float) * OC)) << "differs from the generic level";
      for (int r = 0; r < OC; r++) {
        double exact_q = 0, mag = 0, exact = 0, bound = 0;
        for (int c = 0; c < IC; c++) {
          const size_t k = (size_t)r * IC + c;
          const double wq = (double)m.q[k] * f16_to_f32(m.d[k / 32]), xq_c = (double)xq[c] * xd[c / 32];
          exact_q += wq * xq_c;
          mag += std::fabs(wq * xq_c);
          exact += (double)w[k] * x[c];
          bound += std::fabs(w[k]) * std::fabs(x[c] - xq_c) + std::fabs(xq_c) * std::fabs(w[k] - wq);
        }
        ASSERT_LE(std::fabs(y[r] - exact_q), std::ldexp(mag, -20)) << "row " << r;
        ASSERT_LE(std::fabs(y[r] - exact), bound * (1 + 1e-6) + std::ldexp(mag, -20)) << "row " << r;
      }
    }
  }
  if (levels().size() < 3) std::printf("note: this CPU runs only %zu of the 3 SIMD levels\n", levels().size());
}

// Up to 8 inputs against one Q8_0 matrix (batched decoding, an expert's few rows) give each input
// bitwise what it gets alone, with row strides and +=, split over threads or not.
TEST(Q8Kernels, GemvRowsIsBitwiseGemvPerInput) {
  const int OC = 150, IC = 96;
  std::vector<float> w((size_t)OC * IC);
  for (size_t i = 0; i < w.size(); i++) w[i] = uniform(i * 5 + 3);
  const Q8Matrix m = quantized(w, OC, IC);
  const int ld_x = IC + 3, ld_out = OC + 5;
  std::vector<float> x((size_t)kernels::kMaxGemvInputs * ld_x);
  for (size_t i = 0; i < x.size(); i++) x[i] = uniform(31 + i);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  for (int n = 1; n <= kernels::kMaxGemvInputs; n++)
    for (const bool acc : {false, true})
      for (const long split : {1L, kernels::kGemvParallelMin}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << " acc " << acc << " split at " << split);
        std::vector<float> out((size_t)n * ld_out, 0.25f), want(out);
        kernels::gemv_rows(out.data(), ld_out, x.data(), ld_x, m.ref(), n, IC, OC, acc, split);
        for (int j = 0; j < n; j++)
          kernels::gemv(want.data() + (size_t)j * ld_out, m.ref(), x.data() + (size_t)j * ld_x, OC, IC, acc);
        ASSERT_EQ(0, std::memcmp(out.data(), want.data(), sizeof(float) * out.size()));
      }
  omp_set_num_threads(saved);
}

// However gemv_batch cuts a Q8_0 matrix into pieces (up to 2 MiB, fewer rows with threads), each row is
// what the level's kernel gives over the whole matrix at once (gemv_at): rows of 2048 bytes paired
// half a piece apart, rows of 704 as neighbours.
TEST(Q8Kernels, GemvBatchPiecesAreBitwiseTheWholeMatrix) {
  const int OC = 1100;
  const int saved = omp_get_max_threads();
  for (const int IC : {2048, 704}) {
    SCOPED_TRACE(::testing::Message() << "IC " << IC);
    std::vector<float> w((size_t)OC * IC), x(IC);
    for (size_t i = 0; i < w.size(); i++) w[i] = uniform(i * 3 + 11);
    for (int c = 0; c < IC; c++) x[c] = uniform(555 + c);
    const Q8Matrix m = quantized(w, OC, IC);
    std::vector<float> whole(OC), y(OC);
    kernels::gemv_at(kernels::simd_level(), whole.data(), m.ref(), x.data(), OC, IC);
    for (const int threads : {1, 2, 3})
      for (const long split : {1L, kernels::kGemvParallelMin}) {
        omp_set_num_threads(threads);
        kernels::GemvTask t{y.data(), m.ref(), x.data(), OC};
        kernels::gemv_batch(&t, 1, IC, split);
        EXPECT_EQ(0, std::memcmp(whole.data(), y.data(), sizeof(float) * OC))
            << "threads " << threads << " split at " << split;
      }
  }
  omp_set_num_threads(saved);
}

// A non-finite input gives NaN (as the fp32 product would), never garbage from converting NaN to int8.
TEST(Q8Kernels, NonFiniteInputsGiveNaN) {
  const int OC = 4, IC = 64;
  std::vector<float> w((size_t)OC * IC);
  for (size_t i = 0; i < w.size(); i++) w[i] = uniform(i);
  const Q8Matrix m = quantized(w, OC, IC);
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> x(IC, 0.5f), y(OC);
    x[40] = bad;
    for (const kernels::SimdLevel level : levels()) {
      kernels::gemv_at(level, y.data(), m.ref(), x.data(), OC, IC);
      for (int r = 0; r < OC; r++) EXPECT_TRUE(std::isnan(y[r])) << kernels::simd_name(level) << " row " << r;
    }
  }
}

// --quantize q8_0 at load: every matrix whose rows are whole blocks holds exactly quantize_q8_0 of the
// file's values (the rest stay bf16, in place), the small parameters stay fp32, and the bytes held are
// those of Q8_0 (1 + 2/32 a value) -- about half of bf16.
TEST(Q8Model, LoadQuantizesWholeBlockMatricesAndKeepsTheRest) {
  for (const char* name : {"mixtral_gqa", "llama_dense", "qwen3_moe"}) {
    SCOPED_TRACE(name);
    const std::string dir = (kGolden / "generate" / name).string();
    const auto q8 = load_inference_model(dir, "", false, WeightQuant::q8_0);
    const auto bf = load_inference_model(dir);
    size_t want_bytes = 0, quantized_values = 0;
    for (const HfTensorRef& ref : q8->table.hf_tensors()) {
      const ParamSpec& s = q8->table.spec_of(ref);
      if (InferenceModel::is_small(s.kind)) {
        want_bytes += ref.numel * 4;
        continue;
      }
      const int IC = (int)s.shape.back();
      if (s.kind == ParamKind::embedding) {
        // Untied in these models: read by row from the file as stored, each row quantized on lookup
        // to what a Q8_0 copy would hold.
        const TensorView* e = q8->embedding_in_file();
        ASSERT_NE(e, nullptr);
        EXPECT_EQ(e->dtype, DType::BF16);
        EXPECT_EQ(e->nbytes, ref.numel * 2);
        const WeightRef stored = {bf->embedding_in_file()->data, DType::BF16};
        const size_t rows = ref.numel / IC;
        std::vector<int8_t> q(ref.numel);
        std::vector<uint16_t> d(ref.numel / 32);
        ASSERT_TRUE(kernels::quantize_q8_0(stored, rows, IC, q.data(), d.data()));
        std::vector<float> want(IC), got(IC), plain(IC);
        std::vector<uint8_t> scratch;
        for (size_t r = 0; r < rows; r++) {
          kernels::widen_row(want.data(), {q.data(), DType::U8, d.data()}, r, IC);
          q8->embedding_row(got.data(), r, scratch);
          ASSERT_EQ(0, std::memcmp(want.data(), got.data(), IC * sizeof(float))) << "row " << r;
          bf->embedding_row(plain.data(), r, scratch);
          kernels::widen_row(want.data(), stored, r, IC);
          ASSERT_EQ(0, std::memcmp(want.data(), plain.data(), IC * sizeof(float))) << "bf16 row " << r;
        }
        want_bytes += ref.numel + ref.numel / 16;
        quantized_values += ref.numel;
        continue;
      }
      const WeightRef a = q8->mat(s.kind, s.layer, ref.offset - s.offset, ref.numel);
      const WeightRef b = bf->mat(s.kind, s.layer, ref.offset - s.offset, ref.numel);
      ASSERT_EQ(b.dtype, DType::BF16);
      if (IC % 32 != 0) {
        EXPECT_FALSE(a.q8()) << ref.name;
        EXPECT_EQ(a.dtype, DType::BF16) << ref.name << ": as stored";
        EXPECT_EQ(0, std::memcmp(a.data, b.data, ref.numel * 2)) << ref.name;
        want_bytes += ref.numel * 2;
        continue;
      }
      ASSERT_TRUE(a.q8()) << ref.name;
      std::vector<int8_t> q(ref.numel);
      std::vector<uint16_t> d(ref.numel / 32);
      ASSERT_TRUE(kernels::quantize_q8_0(b, ref.numel / IC, IC, q.data(), d.data()));
      EXPECT_EQ(0, std::memcmp(a.data, q.data(), q.size())) << ref.name;
      EXPECT_EQ(0, std::memcmp(a.scales, d.data(), d.size() * 2)) << ref.name;
      want_bytes += ref.numel + ref.numel / 16;
      quantized_values += ref.numel;
    }
    EXPECT_GT(quantized_values, 0u);
    EXPECT_EQ(q8->weight_bytes(), want_bytes);
    EXPECT_LT(q8->weight_bytes(), bf->weight_bytes());
  }
  EXPECT_EQ(load_inference_model((kGolden / "generate" / "mixtral_gqa").string(), "", false, WeightQuant::q8_0)
                ->storage_name(),
            "Q8_0");
  EXPECT_THROW(parse_weight_quant("int4", "--quantize"), Error);
}

// perplexity() is exp(mean -log p) of the training model's forward over each window (fp32 model,
// windows of 16 with a short last one, scored in prefill pieces of 5 and token by token).
TEST(Perplexity, EqualsTheTrainingForwardsLossPerWindow) {
  const std::string dir = (kGolden / "mixtral_gqa").string();
  const auto model = load_inference_model(dir);
  const ModelConfig& cfg = model->cfg;
  const int V = cfg.vocab_size, T = 37, ctx = 16;
  std::vector<int32_t> tokens(T);
  for (int i = 0; i < T; i++) tokens[i] = (int32_t)(mix64(1234 + i) % (uint64_t)V);
  double nll = 0;
  long scored = 0;
  for (int w0 = 0; w0 < T; w0 += ctx) {
    const int n = std::min(ctx, T - w0);
    Model ref(cfg);
    load_hf_weights(ModelTensors::open(dir), ref.table(), ref.params().data(), dir);
    Batch b;
    b.B = 1;
    b.T = n;
    b.input_ids.assign(tokens.begin() + w0, tokens.begin() + w0 + n);
    ref.forward(b, {});
    for (int t = 0; t + 1 < n; t++) {
      const float* l = ref.logits() + (size_t)t * V;
      double mx = l[0], s = 0;
      for (int v = 1; v < V; v++) mx = std::max(mx, (double)l[v]);
      for (int v = 0; v < V; v++) s += std::exp(l[v] - mx);
      nll += std::log(s) + mx - l[tokens[w0 + t + 1]];
      scored++;
    }
  }
  ModelRunner dec(*model);
  for (const int step : {5, 1}) {
    const PerplexityResult r = perplexity(dec, tokens, {ctx, step});
    EXPECT_EQ(r.scored, scored);
    EXPECT_EQ(r.windows, 3);
    EXPECT_NEAR(r.nll, nll, 1e-5 * nll) << "step " << step;
  }
  EXPECT_THROW(perplexity(dec, std::vector<int32_t>{1}, {}), Error);
  EXPECT_THROW(perplexity(dec, std::vector<int32_t>{1, V}, {}), Error);
  EXPECT_THROW(perplexity(dec, tokens, {1, 1}), Error);
  EXPECT_THROW(perplexity(dec, tokens, {cfg.max_position_embeddings + 1, 1}), Error);
  EXPECT_THROW(perplexity(dec, tokens, {16, 0}), Error);
  // 4095 rows a forward x a vocabulary of 32000 would be 500 MiB of logits: refused before allocating.
  const nlohmann::json j = {{"architectures", {"MistralForCausalLM"}}, {"model_type", "mistral"},
                            {"vocab_size", 32000}, {"hidden_size", 32}, {"intermediate_size", 32},
                            {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
                            {"max_position_embeddings", 4096}, {"tie_word_embeddings", false}};
  InferenceModel wide(model_config_from_json(j, "test"));
  ModelRunner wdec(wide);
  try {
    perplexity(wdec, std::vector<int32_t>(4096, 5), {4096, 4096});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MiB of logits"), std::string::npos) << e.what();
  }
}

// The accuracy cost of Q8_0, measured: a small Mixtral trained by moetron on licence texts
// (tools/make_perplexity_model.sh), scored on the Apache-2.0 licence (tests/data/apache-2.0.txt, held
// out).  Its bf16 perplexity is far below the 384 of a uniform guess (so a change in the logits shows),
// and Q8_0 changes it by less than 1% both in prefill (weights widened from Q8_0, inputs fp32) and
// token by token (int8 inputs as well).  Measured when this test was written: bf16 36.534, Q8_0 prefill
// 36.603 (+0.19%), token by token 36.597 (+0.17%).
TEST(Q8Model, PerplexityChangesByLessThanOnePercentOnATrainedModel) {
  const std::string dir = (kGolden / "perplexity").string();
  const auto bf = load_inference_model(dir);
  const auto q8 = load_inference_model(dir, "", false, WeightQuant::q8_0);
  ASSERT_EQ(q8->storage_name(), "Q8_0");
  const auto tok = load_model_tokenizer(dir, "", bf->cfg, true);
  std::ifstream in(fs::path(MOETRON_SOURCE_DIR) / "tests" / "data" / "apache-2.0.txt");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> ids = completion_prompt_tokens(*tok, text);
  ASSERT_GT(ids.size(), 2000u);
  ModelRunner db(*bf), dq(*q8);
  const double p_bf = perplexity(db, ids, {256, 64}).perplexity();
  const double p_q8_prefill = perplexity(dq, ids, {256, 64}).perplexity();
  const double p_q8_decode = perplexity(dq, ids, {256, 1}).perplexity();
  std::printf("perplexity on apache-2.0.txt (%zu tokens): bf16 %.4f, Q8_0 prefill %.4f (%+.3f%%), Q8_0 token by "
              "token %.4f (%+.3f%%)\n",
              ids.size(), p_bf, p_q8_prefill, 100 * (p_q8_prefill / p_bf - 1), p_q8_decode,
              100 * (p_q8_decode / p_bf - 1));
  EXPECT_LT(p_bf, 384 / 4.0) << "the model is not trained: the comparison would show nothing";
  EXPECT_LT(std::fabs(p_q8_prefill / p_bf - 1), 0.01);
  EXPECT_LT(std::fabs(p_q8_decode / p_bf - 1), 0.01);
  EXPECT_NE(p_q8_decode, p_bf) << "Q8_0 changed nothing: were the weights quantized?";
}

// A prompt's experts run in parallel (one thread each) when the products are large enough (here
// 96 tokens x 2 experts x 3 x 128 x 256 = 19M multiply-adds, over the 8M threshold): on 2 threads the
// logits of every row are within 1e-5 (of the row's max) of the training model's forward, and two
// runs are bitwise equal (no shared scratch between the threads).  Not bitwise one thread's: OpenBLAS
// sums in another order when it splits a GEMM over threads, with or without this.
TEST(Decoder, ExpertParallelPrefillMatchesTheTrainingForwardAndIsDeterministic) {
  const nlohmann::json j = {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"},
                            {"vocab_size", 256},  {"hidden_size", 128},
                            {"intermediate_size", 256}, {"num_hidden_layers", 2},
                            {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                            {"max_position_embeddings", 1024}, {"rms_norm_eps", 1e-5},
                            {"rope_theta", 1e4},  {"num_local_experts", 4},
                            {"num_experts_per_tok", 2}, {"tie_word_embeddings", false}};
  const ModelConfig cfg = model_config_from_json(j, "test");
  InferenceModel model(cfg);
  init_parameters(model.table, cfg, 7, model.owned.data());
  const int T = 96, V = cfg.vocab_size;
  std::vector<int32_t> tokens(T);
  for (int i = 0; i < T; i++) tokens[i] = (int32_t)(mix64(5 + i) % (uint64_t)V);
  Model ref(cfg);
  ASSERT_EQ(ref.params().size(), model.owned.size());
  std::copy(model.owned.begin(), model.owned.end(), ref.params().begin());
  Batch b;
  b.B = 1;
  b.T = T;
  b.input_ids = tokens;
  ref.forward(b, {});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  std::vector<float> first((size_t)T * V), again((size_t)T * V);
  for (std::vector<float>* out : {&first, &again}) {
    ModelRunner dec(model);
    KvCache cache = dec.new_cache();
    dec.forward(cache, tokens, out->data(), /*all_logits=*/true);
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(0, std::memcmp(first.data(), again.data(), sizeof(float) * first.size()));
  for (int t = 0; t < T; t++) {
    double err = 0, mx = 0;
    for (int v = 0; v < V; v++) {
      const double want = ref.logits()[(size_t)t * V + v];
      err = std::max(err, std::fabs(first[(size_t)t * V + v] - want));
      mx = std::max(mx, std::fabs(want));
    }
    ASSERT_LE(err, 1e-5 * mx) << "row " << t;
  }
}
