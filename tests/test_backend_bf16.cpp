// Bf16CpuBackend (src/backend/cpu_bf16.h): the one model body with every tensor the CUDA backend
// stores in bf16 rounded to bf16 -- the mixed-precision policy, tested on every machine, and the
// naive bf16 implementation a GPU is compared with (tests/test_cuda_model.cpp).
//   - without rounding it is the fp32 CPU model (only summation order differs: the eager attention
//     accumulates in fp64, the experts run one GEMM per expert): 1e-5 of each tensor's max;
//   - with rounding, logits, losses and every gradient stay within bf16 accuracy of transformers'
//     float64 references: 5e-2 of each tensor's max (bf16 keeps 8 bits, 4e-3 relative, per stored
//     tensor; a wrong op misses by O(1)), and the logits are measurably rounded (their error is
//     more than 10x the fp32 model's, so a backend that forgot to round fails);
//   - 20 AdamW steps in bf16 follow the fp32 CPU curve within 2% at every step.  At lr 1e-3: at
//     3e-3 this model's fp32 training is itself chaotic (the loss spikes; weights perturbed by 1e-5
//     relative end 4% away), which would measure the chaos, not the precision -- so the test also
//     checks that a perturbed fp32 run stays within 0.5% of the unperturbed one.
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu_bf16.h"
#include "core/rng.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "model/batch_io.h"
#include "model/model.h"
#include "training_case.h"
#include "model/weights.h"
#include "optim/adamw.h"

namespace fs = std::filesystem;

namespace moetron {
namespace {

const fs::path kGoldenDir = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden";

double max_abs(const float* a, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; i++) m = std::max(m, (double)std::fabs(a[i]));
  return m;
}
double max_err(const float* a, const float* b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; i++) {
    const double d = std::fabs((double)a[i] - (double)b[i]);
    if (!(d <= m)) m = d;  // NaN wins
  }
  return m;
}

struct RunResult {
  Losses losses;
  std::vector<float> logits, grads;
};

// One forward and backward of `model` on the golden case's weights.
RunResult run_golden(Model& model, const fs::path& dir, const Batch& batch, const LossWeights& w) {
  load_hf_weights(ModelTensors::open(dir.string()), model.table(), model.params().data(), dir.string());
  RunResult r;
  r.losses = model.forward(batch, w);
  r.logits.assign(model.logits(), model.logits() + (size_t)batch.B * batch.T * model.config().vocab_size);
  model.zero_grads();
  model.backward();
  r.grads = model.grads();
  return r;
}

LossWeights weights_for(const ModelConfig& cfg, const Batch& batch) {
  LossWeights w;
  w.ce_scale = 1.0 / (double)count_loss_tokens(batch);
  w.aux_coef = cfg.router_aux_loss_coef;
  return w;
}

class Bf16Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Bf16Golden, WithoutRoundingItIsTheCpuModel) {
  const fs::path dir = kGoldenDir / GetParam();
  const ModelConfig cfg = load_model_config((dir / "config.json").string());
  const Batch batch = read_batch_safetensors((dir / "input.safetensors").string());
  const LossWeights w = weights_for(cfg, batch);
  Model cpu(cfg);
  Bf16CpuBackend exact_be(false);
  Model exact(exact_be, cfg);
  const RunResult a = run_golden(cpu, dir, batch, w), b = run_golden(exact, dir, batch, w);
  EXPECT_LE(max_err(b.logits.data(), a.logits.data(), a.logits.size()), 1e-5 * max_abs(a.logits.data(), a.logits.size()));
  EXPECT_NEAR(b.losses.loss, a.losses.loss, 1e-6 * a.losses.loss);
  EXPECT_NEAR(b.losses.aux_loss, a.losses.aux_loss, 1e-6 * (a.losses.aux_loss + 1e-30));
  for (const HfTensorRef& t : cpu.table().hf_tensors())
    EXPECT_LE(max_err(b.grads.data() + t.offset, a.grads.data() + t.offset, t.numel),
              1e-5 * max_abs(a.grads.data() + t.offset, t.numel))
        << "gradient of " << t.name;
}

TEST_P(Bf16Golden, WithinBf16AccuracyOfTransformers) {
  const fs::path dir = kGoldenDir / GetParam();
  const ModelConfig cfg = load_model_config((dir / "config.json").string());
  const Batch batch = read_batch_safetensors((dir / "input.safetensors").string());
  const SafetensorsFile expected = SafetensorsFile::open((dir / "expected.safetensors").string());
  const LossWeights w = weights_for(cfg, batch);
  Model cpu(cfg);
  Bf16CpuBackend be;
  Model bf16(be, cfg);
  const RunResult a = run_golden(cpu, dir, batch, w), b = run_golden(bf16, dir, batch, w);

  const std::vector<float> ref = to_f32(expected.get("logits"));
  const double scale = max_abs(ref.data(), ref.size());
  const double e_bf16 = max_err(b.logits.data(), ref.data(), ref.size());
  const double e_fp32 = max_err(a.logits.data(), ref.data(), ref.size());
  EXPECT_LE(e_bf16, 5e-2 * scale) << "bf16 logits vs float64";
  EXPECT_GT(e_bf16, 10 * e_fp32) << "the bf16 backend must actually round (fp32 error " << e_fp32 << ")";
  const double loss = to_f32(expected.get("loss"))[0];
  EXPECT_LE(std::fabs(b.losses.loss - loss), 5e-2 * std::fabs(loss)) << b.losses.loss << " vs " << loss;
  // clip_qkv (olmoe_clip) clamps a third of q and k: the clamp's gradient is a step at +-clip_qkv, so
  // bf16 rounding upstream flips it for the values within rounding of the bound (the first layer,
  // whose q/k/v are decided in f32 before rounding, passes; layer 1's q_proj gradient is off by ~2x
  // the rule).  A step, not an accuracy loss: the gradients of such a model are compared in fp32
  // (Golden.*) and the bf16 logits and loss above.
  if (cfg.clip_qkv > 0) return;
  size_t compared = 0;
  for (const HfTensorRef& t : bf16.table().hf_tensors()) {
    if (bf16.table().spec_of(t).is_buffer()) continue;  // the selection bias has no gradient (Golden.* checks it)
    const std::vector<float> g = to_f32(expected.get("grad." + t.name));
    ASSERT_EQ(g.size(), t.numel) << t.name;
    EXPECT_LE(max_err(b.grads.data() + t.offset, g.data(), t.numel), 5e-2 * max_abs(g.data(), g.size()))
        << "bf16 gradient of " << t.name;
    compared++;
  }
  EXPECT_GT(compared, 0u);
}

INSTANTIATE_TEST_SUITE_P(Transformers, Bf16Golden,
                         ::testing::Values("mixtral_gqa", "mixtral_e3_k1", "mixtral_swa_padded", "mistral_dense",
                                           "llama_dense", "qwen3_moe_mixed", "qwen3_moe_norm_topk_padded",
                                           "qwen2_moe_shared", "olmoe_clip", "olmoe_plain", "qwen3_dense",
                                           "glm4_moe_partial", "glm4_moe_air", "deepseek_v3_mla_yarn",
                                           "deepseek_v3_plain_q"));

// 20 optimizer steps in bf16 and in fp32 from the same weights on the same batches.
TEST(Bf16Training, TwentyStepLossCurveWithinTwoPercentOfFp32) {
  const ModelConfig cfg = testing::training_case_model();
  const int steps = 20;
  const std::vector<Batch> batches = testing::training_case_batches(cfg.vocab_size, 2, 64, 4);
  const int nbatches = (int)batches.size();
  Model fp32(cfg);
  init_parameters(fp32.table(), cfg, 7, fp32.params().data());
  Bf16CpuBackend be;
  Model bf16(be, cfg), perturbed(cfg);
  bf16.params() = fp32.params();
  perturbed.params() = fp32.params();
  for (size_t i = 0; i < perturbed.params().size(); i++)
    perturbed.params()[i] *= (float)(1.0 + 1e-5 * ((double)(mix64(i) % 1000) / 500.0 - 1.0));
  AdamWConfig acfg;
  acfg.lr = 1e-3;
  AdamW opt32(fp32.table(), acfg), opt16(bf16.table(), acfg), optp(perturbed.table(), acfg);
  std::vector<double> l32, l16, lp;
  for (int s = 0; s < steps; s++) {
    const Batch& b = batches[s % nbatches];
    LossWeights w;
    w.ce_scale = 1.0 / (double)count_loss_tokens(b);
    w.aux_coef = cfg.router_aux_loss_coef;
    for (auto [m, opt, out] :
         {std::tuple{&fp32, &opt32, &l32}, std::tuple{&bf16, &opt16, &l16}, std::tuple{&perturbed, &optp, &lp}}) {
      m->zero_grads();
      out->push_back(m->forward(b, w).loss);
      m->backward();
      const double norm = global_grad_norm(m->grads().data(), m->grads().size());
      opt->step(m->params().data(), m->grads().data(), acfg.lr, (float)clip_coefficient(norm, 1.0));
    }
  }
  for (int s = 0; s < steps; s++) {
    EXPECT_LE(std::fabs(l16[s] - l32[s]), 0.02 * std::fabs(l32[s])) << "step " << s + 1 << ": bf16 " << l16[s]
                                                                      << " fp32 " << l32[s];
    EXPECT_LE(std::fabs(lp[s] - l32[s]), 0.005 * std::fabs(l32[s])) << "step " << s + 1 << ": the setup is chaotic";
  }
  EXPECT_LT(l32.back(), 0.9 * l32.front()) << "the run must actually learn";
  EXPECT_NE(l16, l32) << "bf16 rounding changes the curve";
}

}  // namespace
}  // namespace moetron
