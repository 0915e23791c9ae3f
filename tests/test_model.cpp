// Model-level properties that do not need a reference implementation: packing equivalence,
// determinism, layout-independent initialisation, batch validation.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/model.h"
#include "model/params.h"
#include "optim/adamw.h"

using namespace moetron;

namespace {

ModelConfig tiny_mixtral(int layers = 2, int experts = 4, int top_k = 2) {
  nlohmann::json j = {{"architectures", {"MixtralForCausalLM"}},
                      {"model_type", "mixtral"},
                      {"vocab_size", 64},
                      {"hidden_size", 32},
                      {"intermediate_size", 48},
                      {"num_hidden_layers", layers},
                      {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},
                      {"num_local_experts", experts},
                      {"num_experts_per_tok", top_k},
                      {"rms_norm_eps", 1e-5},
                      {"rope_theta", 1e6},
                      {"router_aux_loss_coef", 0.02},
                      {"tie_word_embeddings", false}};
  return model_config_from_json(j, "test");
}

std::vector<int32_t> tokens(int n, uint32_t salt, int vocab) {
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; i++) v[i] = (int32_t)((i * 37u + salt * 101u + (i * i) % 13u) % (uint32_t)vocab);
  return v;
}

// Router weights scaled up so routing is decisive and every expert sees traffic.
void init_decisive(Model& m, uint64_t seed) {
  init_parameters(m.table(), m.config(), seed, m.params().data());
  for (const ParamSpec& s : m.table().specs())
    if (s.kind == ParamKind::router)
      for (size_t i = 0; i < s.numel; i++) m.params()[s.offset + i] *= 40.0f;
}

double max_abs_diff(const float* a, const float* b, size_t n) {
  double d = 0;
  for (size_t i = 0; i < n; i++) d = std::max(d, std::fabs((double)a[i] - b[i]));
  return d;
}

double max_abs(const float* a, size_t n) {
  double d = 0;
  for (size_t i = 0; i < n; i++) d = std::max(d, std::fabs((double)a[i]));
  return d;
}

}  // namespace

// Two documents packed into one row with segment_ids compute exactly what the two documents
// compute as separate right-padded rows: same logits at every real position, same losses (the
// aux loss pools the same real tokens in both layouts) and the same gradient for every parameter.
// Tolerance 1e-5 relative to the tensor's max: only the summation order of fp32 reductions differs.
TEST(Packing, SegmentIdsMatchSeparateDocuments) {
  const ModelConfig cfg = tiny_mixtral();
  const int L1 = 7, L2 = 5, V = cfg.vocab_size;
  const std::vector<int32_t> d1 = tokens(L1, 1, V), d2 = tokens(L2, 2, V);

  Batch packed;
  packed.B = 1;
  packed.T = L1 + L2;
  packed.input_ids = d1;
  packed.input_ids.insert(packed.input_ids.end(), d2.begin(), d2.end());
  packed.labels = packed.input_ids;
  packed.segment_ids.assign(L1, 0);
  packed.segment_ids.insert(packed.segment_ids.end(), L2, 1);

  Batch separate;
  separate.B = 2;
  separate.T = L1;
  separate.input_ids.assign(2 * L1, 0);
  separate.labels.assign(2 * L1, -100);
  separate.attention_mask.assign(2 * L1, 0);
  for (int t = 0; t < L1; t++) {
    separate.input_ids[t] = d1[t];
    separate.labels[t] = d1[t];
    separate.attention_mask[t] = 1;
  }
  for (int t = 0; t < L2; t++) {
    separate.input_ids[L1 + t] = d2[t];
    separate.labels[L1 + t] = d2[t];
    separate.attention_mask[L1 + t] = 1;
  }
  ASSERT_EQ(count_loss_tokens(packed), count_loss_tokens(separate));
  ASSERT_EQ(count_loss_tokens(packed), (L1 - 1) + (L2 - 1));

  Model a(cfg), b(cfg);
  init_decisive(a, 7);
  b.params() = a.params();
  LossWeights w;
  w.ce_scale = 1.0 / count_loss_tokens(packed);
  w.aux_coef = cfg.router_aux_loss_coef;
  w.z_coef = 1e-3;
  const Losses la = a.forward(packed, w);
  const Losses lb = b.forward(separate, w);
  // Logits of real positions.
  for (int t = 0; t < L1 + L2; t++) {
    const float* pa = a.logits() + (size_t)t * V;
    const float* pb = b.logits() + (size_t)(t < L1 ? t : L1 + (t - L1)) * V;
    EXPECT_LE(max_abs_diff(pa, pb, V), 1e-5 * max_abs(pb, V)) << "position " << t;
  }
  EXPECT_NEAR(la.ce_loss, lb.ce_loss, 1e-6 * lb.ce_loss);
  EXPECT_GT(la.aux_loss, 0.0);
  EXPECT_NEAR(la.aux_loss, lb.aux_loss, 1e-6 * lb.aux_loss);
  EXPECT_NEAR(la.z_loss, lb.z_loss, 1e-6 * lb.z_loss);
  EXPECT_NEAR(la.loss, lb.loss, 1e-6 * lb.loss);

  a.zero_grads();
  b.zero_grads();
  a.backward();
  b.backward();
  for (const ParamSpec& s : a.table().specs()) {
    const double ref = max_abs(b.grads().data() + s.offset, s.numel);
    EXPECT_GT(ref, 0.0) << s.name;
    EXPECT_LE(max_abs_diff(a.grads().data() + s.offset, b.grads().data() + s.offset, s.numel), 1e-5 * ref) << s.name;
  }
}

// Without segment_ids the second document would attend to the first: the test above must be able
// to fail, so check that packing without segment ids changes the second document's logits.
TEST(Packing, WithoutSegmentIdsDocumentsInteract) {
  const ModelConfig cfg = tiny_mixtral();
  const int V = cfg.vocab_size;
  Batch packed;
  packed.B = 1;
  packed.T = 12;
  packed.input_ids = tokens(12, 3, V);
  Batch seg = packed;
  seg.segment_ids.assign(7, 0);
  seg.segment_ids.insert(seg.segment_ids.end(), 5, 1);
  Model m(cfg);
  init_decisive(m, 3);
  m.forward(packed, {});
  const std::vector<float> plain(m.logits(), m.logits() + 12 * V);
  m.forward(seg, {});
  EXPECT_GT(max_abs_diff(plain.data() + 8 * V, m.logits() + 8 * V, V), 1e-3);
  // The first document is unaffected up to fp32 rounding (expert GEMMs see other row counts, so
  // BLAS blocks them differently): 1e-5 of the logits' scale, far below the 1e-3 effect above.
  EXPECT_LE(max_abs_diff(plain.data(), m.logits(), 7 * V), 1e-5 * max_abs(plain.data(), 7 * V))
      << "the first document is unaffected";
}

// Same seed -> bitwise-identical losses over several optimizer steps; another seed differs.
TEST(Determinism, SameSeedSameLossesBitwise) {
  const ModelConfig cfg = tiny_mixtral();
  auto run = [&](uint64_t seed) {
    Model m(cfg);
    init_parameters(m.table(), cfg, seed, m.params().data());
    AdamWConfig acfg;
    acfg.lr = 1e-2;
    AdamW opt(m.table(), acfg);
    Batch b;
    b.B = 2;
    b.T = 16;
    b.input_ids = tokens(32, 5, cfg.vocab_size);
    b.labels = b.input_ids;
    LossWeights w;
    w.ce_scale = 1.0 / count_loss_tokens(b);
    w.aux_coef = 0.02;
    std::vector<double> losses;
    for (int s = 0; s < 4; s++) {
      m.zero_grads();
      losses.push_back(m.forward(b, w).loss);
      m.backward();
      const double norm = global_grad_norm(m.grads().data(), m.grads().size());
      opt.step(m.params().data(), m.grads().data(), acfg.lr, (float)clip_coefficient(norm, 1.0));
    }
    return losses;
  };
  const std::vector<double> a = run(11), b = run(11), c = run(12);
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < a.size(); i++) EXPECT_EQ(std::memcmp(&a[i], &b[i], sizeof(double)), 0) << "step " << i;
  EXPECT_NE(a[0], c[0]);
  EXPECT_LT(a.back(), a.front()) << "training reduces the loss";
}

// Initialisation is keyed by (seed, HF tensor name, element): a tensor's values do not depend on
// which other tensors exist (e.g. the number of layers), norms start at 1, matrices have the
// configured standard deviation.
TEST(Init, LayoutIndependentAndScaled) {
  const ModelConfig c2 = tiny_mixtral(2), c3 = tiny_mixtral(3);
  Model m2(c2), m3(c3);
  init_parameters(m2.table(), c2, 99, m2.params().data());
  init_parameters(m3.table(), c3, 99, m3.params().data());
  for (const HfTensorRef& t : m2.table().hf_tensors()) {
    const HfTensorRef* u = m3.table().find_hf(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    EXPECT_EQ(std::memcmp(m2.params().data() + t.offset, m3.params().data() + u->offset, t.numel * sizeof(float)), 0)
        << t.name;
  }
  const ParamSpec& norm = m2.table().at(ParamKind::input_norm, 0);
  for (size_t i = 0; i < norm.numel; i++) EXPECT_EQ(m2.params()[norm.offset + i], 1.0f);
  const ParamSpec& emb = m2.table().at(ParamKind::embedding);
  double sum = 0, sq = 0;
  for (size_t i = 0; i < emb.numel; i++) {
    sum += m2.params()[emb.offset + i];
    sq += (double)m2.params()[emb.offset + i] * m2.params()[emb.offset + i];
  }
  const double mean = sum / emb.numel, sd = std::sqrt(sq / emb.numel - mean * mean);
  // 2048 samples: the sample sd of N(0, 0.02) is within 5% with overwhelming probability.
  EXPECT_NEAR(sd, c2.initializer_range, 0.05 * c2.initializer_range);
  EXPECT_NEAR(mean, 0.0, 0.1 * c2.initializer_range);
}

TEST(Batch, RejectsTokenIdsOutsideTheVocabulary) {
  const ModelConfig cfg = tiny_mixtral();
  Model m(cfg);
  Batch b;
  b.B = 1;
  b.T = 4;
  b.input_ids = {1, 2, 64, 3};
  try {
    m.forward(b, {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("input_ids[0][2] = 64"), std::string::npos) << e.what();
  }
  b.input_ids = {1, 2, 3, 4};
  b.labels = {1, 2, -5, 4};
  EXPECT_THROW(m.forward(b, {}), Error);
  b.labels = {1, 2, 3};
  EXPECT_THROW(m.forward(b, {}), Error);
}

TEST(Batch, BackwardWithoutForwardIsAnError) {
  Model m(tiny_mixtral());
  EXPECT_THROW(m.backward(), Error);
}

// Capacity (moe.capacity_factor): a factor that leaves room for every assignment changes nothing
// (bitwise), a small one drops assignments (counted per layer) and the backward is the gradient
// of the dropping forward: central finite differences of the loss (double sums over fp32
// activations) agree to 2% with the analytic gradient on the largest entries of the expert weights
// of both layers and of the first o_proj (whose gradient flows back through both MoE layers,
// dropped rows included).  The same check runs on the dropless model for calibration.  (Embedding
// and router entries are left out: a finite step there flips top-k choices and drop order.)
TEST(Capacity, NoRoomLimitIsDroplessAndDroppingBackwardIsTheGradient) {
  const ModelConfig cfg = tiny_mixtral();
  Batch b;
  b.B = 2;
  b.T = 16;
  b.input_ids = tokens(32, 7, cfg.vocab_size);
  b.labels = b.input_ids;
  LossWeights w;
  w.ce_scale = 1.0 / count_loss_tokens(b);
  w.aux_coef = 0.02;
  auto run = [&](Model& m, double cf) {
    init_decisive(m, 3);
    m.set_capacity_factor(cf);
    m.zero_grads();
    const double loss = m.forward(b, w).loss;
    m.backward();
    return loss;
  };
  Model plain(cfg), roomy(cfg), tight(cfg);
  const double l_plain = run(plain, 0.0), l_roomy = run(roomy, 2.0), l_tight = run(tight, 0.5);
  EXPECT_EQ(l_plain, l_roomy);
  EXPECT_EQ(std::memcmp(plain.grads().data(), roomy.grads().data(), sizeof(float) * plain.grads().size()), 0);
  for (long d : roomy.dropped()) EXPECT_EQ(d, 0);
  ASSERT_EQ(tight.dropped().size(), 2u);
  // cap = ceil(0.5 x 32 tokens x K 2 / E 4) = 8: at most 32 of the 64 assignments are kept.
  for (long d : tight.dropped()) EXPECT_GE(d, 32);
  EXPECT_NE(l_tight, l_plain);

  for (Model* model : {&plain, &tight}) {
    Model& m = *model;
    const std::vector<float> grads = m.grads();
    const std::vector<long> dropped = m.dropped();
    for (const auto& [kind, layer] : {std::pair{ParamKind::ffn_w13, 0}, {ParamKind::ffn_w2, 0}, {ParamKind::ffn_w13, 1},
                                      {ParamKind::ffn_w2, 1}, {ParamKind::o_proj, 0}}) {
      const ParamSpec& s = m.table().at(kind, layer);
      std::vector<size_t> order(s.numel);
      for (size_t i = 0; i < s.numel; i++) order[i] = s.offset + i;
      std::partial_sort(order.begin(), order.begin() + 4, order.end(),
                        [&](size_t x, size_t y) { return std::fabs(grads[x]) > std::fabs(grads[y]); });
      for (int j = 0; j < 4; j++) {
        const size_t i = order[j];
        const float keep = m.params()[i], h = 1e-3f;
        m.params()[i] = keep + h;
        const double up = m.forward(b, w).loss;
        EXPECT_EQ(m.dropped(), dropped);
        m.params()[i] = keep - h;
        const double down = m.forward(b, w).loss;
        m.params()[i] = keep;
        const double fd = (up - down) / (2.0 * h);
        EXPECT_NEAR(fd, grads[i], 0.02 * std::fabs(grads[i]) + 1e-5)
            << (model == &plain ? "dropless" : "capacity 0.5") << ": " << s.name << " element " << i - s.offset;
      }
    }
  }
}

// Capacity factor 1.0 on skewed routing: a router bias sends both choices of every token to experts
// 0 and 1.  30 tokens, K = 2: each of the two experts gets 30 assignments and has room for
// ceil(1.0 x 30 x 2 / 4) = 15, so 30 of the 60 assignments are dropped in each layer.  Right padding
// (attention_mask 0) is dropped first and not counted: with 5 padded positions, 25 real tokens,
// room for ceil(12.5) = 13, so each expert drops its 5 padded rows and 12 real ones (24 counted).
// Without a factor nothing is dropped.
TEST(Capacity, FactorOneOnSkewedRoutingDropsHalfOfTheAssignments) {
  const ModelConfig cfg = tiny_mixtral();
  for (const int padded : {0, 5}) {
    SCOPED_TRACE(padded);
    Batch b;
    b.B = 2;
    b.T = 15;
    b.input_ids = tokens(30, 11, cfg.vocab_size);
    b.labels = b.input_ids;
    b.attention_mask.assign(30, 1);
    for (int i = 0; i < padded; i++) {
      b.attention_mask[29 - i] = 0;
      b.labels[29 - i] = -100;
    }
    LossWeights w;
    w.ce_scale = 1.0 / count_loss_tokens(b);
    Model skewed(cfg), dropless(cfg);
    for (Model* m : {&skewed, &dropless}) {
      init_parameters(m->table(), cfg, 5, m->params().data());
      m->set_router_bias({40.0f, 20.0f, -40.0f, -40.0f});
    }
    skewed.set_capacity_factor(1.0);
    skewed.forward(b, w);
    dropless.forward(b, w);
    const long real = 30 - padded, want = 2 * (real - (real + 1) / 2);
    ASSERT_EQ(skewed.dropped().size(), 2u);
    ASSERT_EQ(dropless.dropped().size(), 2u);
    for (long d : skewed.dropped()) EXPECT_EQ(d, want);
    for (long d : dropless.dropped()) EXPECT_EQ(d, 0);
    EXPECT_EQ(want, padded == 0 ? 30 : 24);
  }
}

// Pipeline stages (model/model.h): a 4-layer model split into stages [0, 2) and [2, 4) in one
// process, its three micro-batches all in flight on both stages (three forwards queued, then the
// three backwards, oldest first), the hidden states, pooled router statistics, their gradients and
// the pooled aux-loss gradient handed from stage to stage by hand, computes what the whole model
// computes micro-batch by micro-batch: the same losses (summed over the stages) and BITWISE the same
// gradients for every tensor -- each op runs on the same inputs in the same order, and the pooled
// statistics are summed in layer order on both paths.  For the HF pooled and the per-layer aux loss,
// with a z-loss, right padding and decisive (uneven) routing.
TEST(PipelineStages, TwoStagesComputeTheWholeModelBitwise) {
  const ModelConfig cfg = tiny_mixtral(4);
  std::vector<Batch> micro(3);
  long loss_tokens = 0;
  for (int i = 0; i < 3; i++) {
    Batch& b = micro[i];
    b.B = 2;
    b.T = 12;
    b.input_ids = tokens(24, 11 + i, cfg.vocab_size);
    b.labels = b.input_ids;
    b.attention_mask.assign(24, 1);
    for (int t = 9 + i; t < 12; t++) {
      b.attention_mask[12 + t] = 0;
      b.labels[12 + t] = -100;
    }
    loss_tokens += count_loss_tokens(b);
  }
  for (AuxLossKind kind : {AuxLossKind::hf_pooled, AuxLossKind::per_layer, AuxLossKind::sequence}) {
    const char* what = kind == AuxLossKind::hf_pooled ? "hf_pooled" : kind == AuxLossKind::per_layer ? "per_layer"
                                                                                                      : "sequence";
    LossWeights w;
    w.ce_scale = 1.0 / (double)loss_tokens;
    w.aux_coef = 0.02 / 3;
    w.z_coef = 0.001 / 3;
    w.aux_kind = kind;
    Model whole(cfg), s0(cfg, nullptr, nullptr, {0, 2}), s1(cfg, nullptr, nullptr, {2, 4});
    ASSERT_TRUE(s0.first_stage() && !s0.last_stage() && s1.last_stage() && !s1.first_stage());
    init_decisive(whole, 5);
    copy_from_whole(whole.table(), whole.params().data(), s0.table(), s0.params().data());
    copy_from_whole(whole.table(), whole.params().data(), s1.table(), s1.params().data());
    whole.zero_grads();
    s0.zero_grads();
    s1.zero_grads();
    double want = 0, got = 0;
    for (const Batch& b : micro) {
      want += whole.forward(b, w).loss;
      whole.backward();
    }
    const size_t NC = 24 * (size_t)cfg.hidden_size;
    std::vector<std::vector<float>> hidden;
    std::vector<ops::RouterLayerStats> pooled;
    for (const Batch& b : micro) {
      got += s0.forward_queued(b, w).loss;
      hidden.emplace_back(s0.stage_output(), s0.stage_output() + NC);
      pooled.push_back(s0.pooled_stats());
    }
    for (int i = 0; i < 3; i++) got += s1.forward_queued(micro[i], w, {hidden[i].data(), &pooled[i]}).loss;
    EXPECT_EQ(s0.pending(), 3u);
    EXPECT_EQ(s1.peak_pending(), 3u);
    EXPECT_EQ(s0.peak_activation_bytes(), 3 * s0.activation_bytes_per_micro_batch());
    for (int i = 0; i < 3; i++) {
      s1.backward();
      const std::vector<float> dhidden(s1.input_grad(), s1.input_grad() + NC);
      const std::vector<double> aux = s1.input_aux_grad();
      ASSERT_EQ(aux.size(), 4u);
      if (kind == AuxLossKind::hf_pooled) {
        EXPECT_GT(*std::max_element(aux.begin(), aux.end()), 0.0) << what;
      }
      s0.backward({dhidden.data(), aux.data()});
    }
    EXPECT_EQ(s0.pending(), 0u);
    EXPECT_NEAR(got, want, 1e-12 * std::fabs(want)) << what;
    std::vector<float> staged(whole.table().total(), 0.0f);
    copy_to_whole(s0.table(), s0.grads().data(), whole.table(), staged.data());
    copy_to_whole(s1.table(), s1.grads().data(), whole.table(), staged.data());
    for (const ParamSpec& s : whole.table().specs())
      EXPECT_EQ(std::memcmp(staged.data() + s.offset, whole.grads().data() + s.offset, sizeof(float) * s.numel), 0)
          << what << ": " << s.name << " max |diff| "
          << max_abs_diff(staged.data() + s.offset, whole.grads().data() + s.offset, s.numel);
  }
}

// A stage is told what it lacks: a later stage's forward needs hidden states, an earlier stage's
// backward needs the gradient of its output, the first stage has no input gradient.
TEST(PipelineStages, MissingStageInputsAreErrors) {
  const ModelConfig cfg = tiny_mixtral(4);
  Model s0(cfg, nullptr, nullptr, {0, 2}), s1(cfg, nullptr, nullptr, {2, 4});
  init_parameters(s0.table(), cfg, 1, s0.params().data());
  init_parameters(s1.table(), cfg, 1, s1.params().data());
  Batch b;
  b.B = 1;
  b.T = 8;
  b.input_ids = tokens(8, 3, cfg.vocab_size);
  b.labels = b.input_ids;
  EXPECT_THROW(s1.forward(b, LossWeights{}), Error);
  s0.forward(b, LossWeights{});
  EXPECT_THROW(s0.backward(), Error);
  EXPECT_EQ(s0.pending(), 1u);  // the refused backward leaves the micro-batch pending
  EXPECT_THROW(s0.input_grad(), Error);
  EXPECT_FALSE(s0.table().has(ParamKind::lm_head));
  EXPECT_FALSE(s1.table().has(ParamKind::embedding));
}

// The parameter table's element counts are overflow-checked: a ModelConfig built in code (no
// validate_model_config) with sizes whose products wrap 64 bits -- or exceed 2^44 -- is an Error
// naming the tensor, not a small table that later code indexes past.
TEST(ParamTableSizes, ProductsThatWouldWrapAreErrors) {
  ModelConfig c = tiny_mixtral();
  c.num_attention_heads = c.num_key_value_heads = 1 << 24;
  c.head_dim = 1 << 24;  // q_proj [2^48, C]: > 2^44 elements
  try {
    ParamTable t(c);
    FAIL() << "accepted, total " << t.total();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q_proj"), std::string::npos) << e.what();
  }
  ModelConfig w = tiny_mixtral();
  w.vocab_size = INT32_MAX;
  w.hidden_size = INT32_MAX;  // embedding [2^31, 2^31]: 2^62, fits 64 bits, beyond 2^44
  EXPECT_THROW(ParamTable{w}, Error);
  ModelConfig many = tiny_mixtral();
  many.num_hidden_layers = INT32_MAX;  // each tensor small, the total beyond 2^44
  many.hidden_size = 1 << 12;
  many.intermediate_size = 1 << 12;
  EXPECT_THROW(ParamTable{many}, Error);
}
