// Golden tests: the whole model against Hugging Face transformers.
//
// tests/golden/<case>/ holds a tiny random HF model, an input batch and the outputs transformers
// computed in float64 (tools/make_golden.py; tests/golden/README.md describes the files).  We run
// the same model in fp32 and compare:
//   logits, ce_loss, aux_loss, loss and every parameter gradient: max|a-b| / max|b| <= 1e-4 per
//   tensor (the bound; fp32 rounding through a 2-layer model gives ~1e-6 here, so a real
//   discrepancy such as a wrong mask, a missing aux term or a transposed weight shows up orders of
//   magnitude above it);
//   the 5-step AdamW loss trajectory: relative error <= 1e-5 per step.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "io/hf_config.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "model/batch_io.h"
#include "model/model.h"
#include "model/weights.h"
#include "optim/adamw.h"
#include "golden_case.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

const fs::path kGoldenDir = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden";

using moetron::testing::GoldenCase;
using moetron::testing::meta_double;
using moetron::testing::normalized_max_error;

double scalar(const SafetensorsFile& f, const std::string& name) { return to_f32(f.get(name))[0]; }

GoldenCase load_case(const std::string& name) { return moetron::testing::load_golden_case(kGoldenDir / name); }

LossWeights weights_for(const ModelConfig& cfg, const Batch& batch) {
  return moetron::testing::golden_loss_weights(cfg, batch);
}

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, LogitsLossesAndGradientsMatchTransformers) {
  GoldenCase c = load_case(GetParam());
  Model model(c.cfg);
  load_hf_weights(ModelTensors::open(c.dir.string()), model.table(), model.params().data(), c.dir.string());
  const Losses losses = model.forward(c.batch, weights_for(c.cfg, c.batch));

  const std::vector<float> logits = to_f32(c.expected.get("logits"));
  ASSERT_EQ(logits.size(), (size_t)c.batch.B * c.batch.T * c.cfg.vocab_size);
  EXPECT_LE(normalized_max_error(model.logits(), logits), 1e-4) << "logits";

  const double ce = scalar(c.expected, "ce_loss"), aux = scalar(c.expected, "aux_loss"),
               loss = scalar(c.expected, "loss");
  EXPECT_LE(std::fabs(losses.ce_loss - ce), 1e-4 * std::fabs(ce)) << "ce_loss " << losses.ce_loss << " vs " << ce;
  if (c.cfg.router_sigmoid) {
    EXPECT_EQ(aux, 0.0);  // transformers' DeepSeek-V3 / GLM-4.5 train on cross-entropy alone
    EXPECT_EQ(c.cfg.router_aux_loss_coef, 0.0);
  } else if (c.cfg.is_moe()) {
    EXPECT_GT(aux, 0.0);
    EXPECT_LE(std::fabs(losses.aux_loss - aux), 1e-4 * std::fabs(aux)) << "aux_loss " << losses.aux_loss << " vs " << aux;
  } else {
    EXPECT_EQ(losses.aux_loss, 0.0);
  }
  EXPECT_LE(std::fabs(losses.loss - loss), 1e-4 * std::fabs(loss)) << "loss " << losses.loss << " vs " << loss;

  model.zero_grads();
  model.backward();
  size_t compared = 0;
  for (const HfTensorRef& t : model.table().hf_tensors()) {
    if (model.table().spec_of(t).is_buffer()) {  // the selection bias: no gradient (transformers' buffer)
      EXPECT_EQ(c.expected.find("grad." + t.name), nullptr) << t.name;
      for (size_t i = 0; i < t.numel; i++) ASSERT_EQ(model.grads()[t.offset + i], 0.0f) << t.name;
      continue;
    }
    const TensorView* g = c.expected.find("grad." + t.name);
    ASSERT_NE(g, nullptr) << "expected.safetensors has no grad." << t.name;
    ASSERT_EQ(g->shape, t.shape) << t.name;
    const std::vector<float> ref = to_f32(*g);
    EXPECT_LE(normalized_max_error(model.grads().data() + t.offset, ref), 1e-4) << "gradient of " << t.name;
    compared++;
  }
  size_t expected_grads = 0;
  for (const std::string& n : c.expected.names()) expected_grads += n.rfind("grad.", 0) == 0;
  EXPECT_EQ(compared, expected_grads) << "every reference gradient is compared";
}

TEST_P(Golden, AdamWTrajectoryMatchesTorch) {
  GoldenCase c = load_case(GetParam());
  Model model(c.cfg);
  load_hf_weights(ModelTensors::open(c.dir.string()), model.table(), model.params().data(), c.dir.string());
  AdamWConfig acfg;
  acfg.lr = meta_double(c.expected, "lr");
  acfg.beta1 = meta_double(c.expected, "beta1");
  acfg.beta2 = meta_double(c.expected, "beta2");
  acfg.eps = meta_double(c.expected, "eps");
  acfg.weight_decay = meta_double(c.expected, "weight_decay");
  const double clip = meta_double(c.expected, "grad_clip");
  AdamW opt(model.table(), acfg);
  const std::vector<float> ref = to_f32(c.expected.get("adamw_loss"));
  ASSERT_EQ(ref.size(), 5u);
  const LossWeights w = weights_for(c.cfg, c.batch);
  for (size_t step = 0; step < ref.size(); step++) {
    model.zero_grads();
    const Losses l = model.forward(c.batch, w);
    EXPECT_LE(std::fabs(l.loss - ref[step]), 1e-5 * std::fabs(ref[step]))
        << "step " << step << ": " << l.loss << " vs torch " << ref[step];
    model.backward();
    const double norm = global_grad_norm(model.grads().data(), model.grads().size());
    opt.step(model.params().data(), model.grads().data(), acfg.lr, (float)clip_coefficient(norm, clip));
  }
  // The trajectory must actually move (a frozen optimizer would fail the later steps anyway).
  EXPECT_NE(ref.front(), ref.back());
}

// DeepSeek-V3's sequence-wise balance loss through the whole model (moe.aux_loss sequence): the
// gradient it adds to the router weights of every MoE layer (the difference of two backwards, with
// and without it, over its coefficient) against central differences of the loss itself, for the
// sigmoid router (GLM-4.5 golden) and the softmax one (Mixtral golden).
TEST(SequenceAuxLoss, RouterGradientMatchesFiniteDifferences) {
  for (const char* name : {"glm4_moe_partial", "mixtral_gqa"}) {
    SCOPED_TRACE(name);
    GoldenCase c = load_case(name);
    Model model(c.cfg);
    load_hf_weights(ModelTensors::open(c.dir.string()), model.table(), model.params().data(), c.dir.string());
    LossWeights w = weights_for(c.cfg, c.batch);
    w.aux_kind = AuxLossKind::sequence;
    const double coef = 0.5;
    std::vector<float> with, without;
    for (double a : {coef, 0.0}) {
      w.aux_coef = a;
      model.zero_grads();
      model.forward(c.batch, w);
      model.backward();
      (a > 0 ? with : without) = model.grads();
    }
    w.aux_coef = 0.0;
    const double aux0 = model.forward(c.batch, w).aux_loss;
    EXPECT_GT(aux0, 0.5);  // sum over the MoE layers of values near 1 (balanced)
    size_t checked = 0;
    double worst = 0, scale = 0;
    for (int l = 0; l < c.cfg.num_hidden_layers; l++) {
      if (!c.cfg.is_moe_layer(l)) continue;
      const ParamSpec& r = model.table().at(ParamKind::router, l);
      for (size_t i = 0; i < r.numel; i += r.numel / 7 + 1) {
        const size_t at = r.offset + i;
        const float keep = model.params()[at], h = 2e-4f;
        model.params()[at] = keep + h;
        const double up = model.forward(c.batch, w).aux_loss;
        model.params()[at] = keep - h;
        const double down = model.forward(c.batch, w).aux_loss;
        model.params()[at] = keep;
        const double fd = (up - down) / (2.0 * h), got = (with[at] - without[at]) / coef;
        worst = std::max(worst, std::fabs(fd - got));
        scale = std::max(scale, std::fabs(fd));
        checked++;
      }
    }
    EXPECT_GT(checked, 10u);
    EXPECT_GT(scale, 1e-3) << "the loss must depend on the router weights";
    EXPECT_LE(worst, 2e-2 * scale) << "max |fd - analytic| " << worst << " of " << scale;
  }
}

INSTANTIATE_TEST_SUITE_P(Transformers, Golden,
                         ::testing::Values("mixtral_gqa", "mixtral_e3_k1", "mixtral_swa_padded", "mistral_dense",
                                           "llama_dense", "qwen3_moe_mixed", "qwen3_moe_norm_topk_padded",
                                           "qwen2_moe_shared", "olmoe_clip", "olmoe_plain", "qwen3_dense",
                                           "glm4_moe_partial", "glm4_moe_air", "deepseek_v3_mla_yarn",
                                           "deepseek_v3_plain_q"));

// The CLI writes exactly what the library computes, in the DESIGN §2 file contract.
TEST(ForwardCommand, WritesLogitsLossesAndGradients) {
  const fs::path dir = kGoldenDir / "mixtral_gqa";
  const fs::path tmp = fs::temp_directory_path() / ("moetron_forward_" + std::to_string(::getpid()));
  fs::create_directories(tmp);
  const std::string cmd = std::string(MOETRON_BINARY) + " forward --model " + dir.string() + " --input " +
                          (dir / "input.safetensors").string() + " --output " + (tmp / "out.safetensors").string() +
                          " --grads " + (tmp / "grads.safetensors").string() + " > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const SafetensorsFile out = SafetensorsFile::open((tmp / "out.safetensors").string());
  const SafetensorsFile grads = SafetensorsFile::open((tmp / "grads.safetensors").string());
  const SafetensorsFile expected = SafetensorsFile::open((dir / "expected.safetensors").string());
  for (const char* name : {"ce_loss", "aux_loss", "z_loss", "loss"}) {
    ASSERT_NE(out.find(name), nullptr) << name;
    EXPECT_TRUE(out.get(name).shape.empty()) << name << " must be a scalar (shape [])";
    EXPECT_EQ(out.get(name).dtype, DType::F32);
  }
  EXPECT_EQ(out.get("logits").dtype, DType::F32);
  EXPECT_LE(normalized_max_error(to_f32(out.get("logits")).data(), to_f32(expected.get("logits"))), 1e-4);
  EXPECT_NEAR(scalar(out, "loss"), scalar(expected, "loss"), 1e-4 * std::fabs(scalar(expected, "loss")));
  size_t n = 0;
  for (const std::string& name : grads.names()) {
    const std::vector<float> g = to_f32(grads.get(name));
    EXPECT_LE(normalized_max_error(g.data(), to_f32(expected.get("grad." + name))), 1e-4) << name;
    n++;
  }
  size_t expected_grads = 0;
  for (const std::string& name : expected.names()) expected_grads += name.rfind("grad.", 0) == 0;
  EXPECT_EQ(n, expected_grads) << "--grads writes every parameter under its HF name";
  fs::remove_all(tmp);
}

}  // namespace

// Each malformed field of a batch is an error naming it (and the position), before any work.
TEST(BatchValidation, EachMalformedFieldIsAnErrorNamingIt) {
  auto good = [] {
    Batch b;
    b.B = 2;
    b.T = 3;
    b.input_ids = {1, 2, 3, 4, 5, 6};
    b.labels = {2, 3, -100, 5, 6, 7};
    b.attention_mask = {1, 1, 1, 1, 1, 0};
    b.position_ids = {0, 1, 2, 0, 1, 2};
    return b;
  };
  EXPECT_NO_THROW(validate_batch(good(), 8));
  auto expect_error = [&](Batch b, const std::string& want) {
    try {
      validate_batch(b, 8);
      ADD_FAILURE() << "no error; expected one containing: " << want;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  Batch b = good();
  b.T = 0;
  expect_error(b, "B and T must be positive");
  b = good();
  b.labels.pop_back();
  expect_error(b, "'labels' has 5 values, expected B*T = 2x3 = 6");
  b = good();
  b.input_ids = {};
  expect_error(b, "'input_ids' has 0 values");
  b = good();
  b.input_ids[4] = 8;
  expect_error(b, "input_ids[1][1] = 8 is outside the vocabulary [0, 8)");
  b = good();
  b.labels[2] = -1;
  expect_error(b, "labels[0][2] = -1 is neither -100 nor inside the vocabulary");
  b = good();
  b.position_ids[3] = -2;
  expect_error(b, "position_ids[1][0] = -2 is negative");
  b = good();
  b.attention_mask[0] = 2;
  expect_error(b, "attention_mask[0][0] = 2, expected 0 or 1");
}
