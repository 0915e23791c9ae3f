// Activation recompute (model/recompute.h, train.recompute): full and selective give the losses and
// gradients of none bit for bit -- over several steps, with micro-batches of two shapes pending at
// once (a 1F1B schedule's queue), on every family of tests/golden/, on the fp32 and the bf16-rounding
// CPU backends, with LoRA adapters on every target and with a capacity limit -- and keep less.
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/cpu.h"
#include "backend/cpu_bf16.h"
#include "core/error.h"
#include "golden_case.h"
#include "model/model.h"
#include "model/recompute.h"
#include "training_case.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

const fs::path kGoldenDir = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden";

struct Case {
  std::string golden;    // tests/golden/<name>: the family, its options and its batch
  bool bf16 = false;     // the bf16-rounding CPU backend (else fp32)
  bool lora = false;     // adapters on every target the model has (the base frozen)
  double capacity = 0;   // capacity factor (0: dropless)
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return c.golden + (c.bf16 ? "_bf16" : "_fp32") + (c.lora ? "_lora" : "") + (c.capacity > 0 ? "_capacity" : "");
}

// The golden batch, and a second micro-batch of another shape: its first row, cut to 3/4 of its length.
std::vector<Batch> micro_batches(const Batch& b) {
  Batch s;
  s.B = 1;
  s.T = b.T * 3 / 4;
  const auto cut = [&](const std::vector<int32_t>& v) {
    return v.empty() ? v : std::vector<int32_t>(v.begin(), v.begin() + s.T);
  };
  s.input_ids = cut(b.input_ids);
  s.labels = cut(b.labels);
  s.attention_mask = cut(b.attention_mask);
  s.segment_ids = cut(b.segment_ids);
  return {b, s};
}

struct Trace {
  std::vector<double> losses;              // every forward's loss, in order
  std::vector<std::vector<float>> grads;   // the trained gradients after each step
};

// Three steps of plain SGD over the trained parameters; each step forwards both micro-batches before
// either backward (both pending), so the recompute buffers are re-laid between shapes.
Trace train(const Case& c, Recompute mode) {
  const moetron::testing::GoldenCase g = moetron::testing::load_golden_case(kGoldenDir / c.golden);
  const std::vector<Batch> micro = micro_batches(g.batch);
  LossWeights w = moetron::testing::golden_loss_weights(g.cfg, g.batch);
  w.z_coef = g.cfg.is_moe() ? 1e-3 : 0.0;
  LoraSpec lora;
  if (c.lora) {
    lora.rank = 4;
    lora.alpha = 8;
    std::vector<std::string> targets = {"attention"};
    if (g.cfg.is_moe()) targets.insert(targets.end(), {"experts", "router"});
    if (!g.cfg.is_moe() || g.cfg.has_shared_expert() || g.cfg.num_local_experts == 0) targets.push_back("mlp");
    lora.targets = parse_lora_targets(targets, g.cfg, "test");
  }
  CpuBackend fp32;
  Bf16CpuBackend bf16;
  Backend& be = c.bf16 ? static_cast<Backend&>(bf16) : static_cast<Backend&>(fp32);
  Model m(be, g.cfg, nullptr, nullptr, {}, lora);
  m.set_recompute(mode);
  m.init_parameters(5);
  if (c.lora) m.init_lora(6);
  if (c.capacity > 0) m.set_capacity_factor(c.capacity);
  const size_t n = m.train_table().total();
  std::vector<float> params(n), grads(n);
  if (c.lora) {
    // PEFT starts B at zero; B != 0 makes every adapter's gradient reach its A.
    m.get_train_params(params.data());
    for (size_t i = 0; i < n; i++) params[i] += 1e-2f * (float)((i * 7919) % 13) - 0.06f;
    m.set_train_params(params.data());
  }
  Trace t;
  for (int step = 0; step < 3; step++) {
    m.zero_grads();
    for (const Batch& b : micro) t.losses.push_back(m.forward_queued(b, w).loss);
    for (size_t i = 0; i < micro.size(); i++) m.backward();
    be.download(grads.data(), m.train_grad_tensor());
    t.grads.push_back(grads);
    m.get_train_params(params.data());
    for (size_t i = 0; i < n; i++) params[i] -= 0.05f * grads[i];
    m.set_train_params(params.data());
  }
  return t;
}

class RecomputeBitwise : public ::testing::TestWithParam<Case> {};

TEST_P(RecomputeBitwise, LossesAndGradientsEqualNone) {
  const Case& c = GetParam();
  const Trace want = train(c, Recompute::none);
  for (Recompute mode : {Recompute::full, Recompute::selective}) {
    const Trace got = train(c, mode);
    const char* name = recompute_name(mode);
    ASSERT_EQ(got.losses.size(), want.losses.size());
    for (size_t i = 0; i < want.losses.size(); i++)
      EXPECT_EQ(std::memcmp(&got.losses[i], &want.losses[i], sizeof(double)), 0)
          << name << ": forward " << i << ": " << got.losses[i] << " vs " << want.losses[i];
    for (size_t s = 0; s < want.grads.size(); s++) {
      size_t differ = 0;
      for (size_t i = 0; i < want.grads[s].size(); i++)
        differ += std::memcmp(&got.grads[s][i], &want.grads[s][i], sizeof(float)) != 0;
      EXPECT_EQ(differ, 0u) << name << ": step " << s << ": gradients differ in " << differ << " of "
                            << want.grads[s].size();
    }
  }
  // The gradients are not all zero (a model that trains nothing would pass the comparison).
  bool nonzero = false;
  for (float v : want.grads.back()) nonzero |= v != 0.0f;
  EXPECT_TRUE(nonzero);
}

INSTANTIATE_TEST_SUITE_P(
    Families, RecomputeBitwise,
    ::testing::Values(Case{"mixtral_gqa"}, Case{"mixtral_e3_k1"}, Case{"mixtral_swa_padded"}, Case{"mistral_dense"},
                      Case{"llama_dense"}, Case{"qwen3_moe_mixed"}, Case{"qwen3_moe_norm_topk_padded"},
                      Case{"qwen2_moe_shared"}, Case{"olmoe_clip"}, Case{"olmoe_plain"}, Case{"qwen3_dense"},
                      Case{"mixtral_gqa", true}, Case{"qwen3_moe_mixed", true}, Case{"qwen2_moe_shared", true},
                      Case{"olmoe_clip", true}, Case{"llama_dense", true}, Case{"mixtral_gqa", false, true},
                      Case{"qwen2_moe_shared", false, true}, Case{"qwen3_moe_mixed", false, true},
                      Case{"llama_dense", false, true}, Case{"mixtral_gqa", false, false, 1.0},
                      Case{"qwen3_moe_mixed", true, false, 1.0}, Case{"glm4_moe_partial"}, Case{"glm4_moe_air"},
                      Case{"deepseek_v3_mla_yarn"}, Case{"deepseek_v3_plain_q"}, Case{"glm4_moe_partial", true},
                      Case{"deepseek_v3_mla_yarn", true}),
    case_name);

// The memory each mode keeps, at a stated shape: the training-case Mixtral (hidden 128, 4 heads,
// 4 experts top-2, width 256) with 4 layers, micro-batch 2 x 256 tokens, fp32 CPU backend.  A
// micro-batch's activations and the model's whole activation memory (every set, scratch, shared
// buffers) after one step, and the peak with 4 micro-batches pending (a 1F1B stage's queue).
TEST(RecomputeMemory, FullKeepsLessThanSelectiveKeepsLessThanNone) {
  ModelConfig cfg = moetron::testing::training_case_model();
  cfg.num_hidden_layers = 4;
  const std::vector<Batch> batches = moetron::testing::training_case_batches(cfg.vocab_size, 2, 256, 4);
  LossWeights w;
  w.ce_scale = 1.0 / (double)count_loss_tokens(batches[0]);
  w.aux_coef = 0.02;
  struct Figures {
    size_t per_micro_batch, total, peak_pending;
  };
  const auto measure = [&](Recompute mode) {
    Model m(cfg);
    m.set_recompute(mode);
    m.init_parameters(1);
    for (const Batch& b : batches) m.forward_queued(b, w);
    const size_t total = m.activation_bytes();
    for (size_t i = 0; i < batches.size(); i++) m.backward();
    return Figures{m.activation_bytes_per_micro_batch(), total, m.peak_activation_bytes()};
  };
  const Figures none = measure(Recompute::none), sel = measure(Recompute::selective),
                full = measure(Recompute::full);
  for (const auto& [name, f] : {std::pair{"none", none}, {"selective", sel}, {"full", full}})
    std::printf("recompute %-9s: %8.2f MiB per micro-batch, %8.2f MiB with 4 pending (all activation memory "
                "%8.2f MiB)\n",
                name, f.per_micro_batch / 1048576.0, f.peak_pending / 1048576.0, f.total / 1048576.0);
  EXPECT_LT(sel.per_micro_batch, none.per_micro_batch);
  EXPECT_LT(full.per_micro_batch, sel.per_micro_batch);
  EXPECT_LT(sel.total, none.total);
  EXPECT_LT(full.total, sel.total);
  // Full keeps one [N,C] f32 input per layer (N = 512, C = 128) and the per-micro-batch tensors
  // outside the layers; the probabilities alone are B*NH*T*T f32 = 2 MiB a layer, which neither keeps.
  EXPECT_LT(full.per_micro_batch, none.per_micro_batch / 4);
}

TEST(RecomputeMode, ChangingItWithMicroBatchesPendingIsAnError) {
  const ModelConfig cfg = moetron::testing::training_case_model();
  const std::vector<Batch> batches = moetron::testing::training_case_batches(cfg.vocab_size, 1, 16, 1);
  Model m(cfg);
  m.init_parameters(1);
  LossWeights w;
  w.ce_scale = 1.0 / 16;
  m.forward_queued(batches[0], w);
  EXPECT_THROW(m.set_recompute(Recompute::full), Error);
  m.backward();
  m.set_recompute(Recompute::full);
  EXPECT_EQ(m.recompute(), Recompute::full);
}

TEST(RecomputeMode, NamesParseAndOthersAreErrors) {
  EXPECT_EQ(parse_recompute("none", "k"), Recompute::none);
  EXPECT_EQ(parse_recompute("full", "k"), Recompute::full);
  EXPECT_EQ(parse_recompute("selective", "k"), Recompute::selective);
  try {
    parse_recompute("true", "train.recompute");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.recompute"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("selective"), std::string::npos) << e.what();
  }
}

}  // namespace
