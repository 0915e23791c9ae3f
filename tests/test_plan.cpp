// moetron plan: layout validation (one test per rule), the Mixtral-8x7B recipe's parameter totals and
// per-rank sums, ZeRO-1 and EP sharding of optimizer state, --device-memory, and the CLI's exit codes.
// Counts are exact integers; the only floating-point comparisons are on printed/rounded figures.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hf_config.h"
#include "model/flops.h"
#include "model/params.h"
#include "train/config.h"
#include "train/plan.h"
#include "train/plan_search.h"

namespace fs = std::filesystem;
using namespace moetron;

namespace {

const fs::path kSrc = MOETRON_SOURCE_DIR;
const fs::path kRecipe = kSrc / "configs" / "mixtral-8x7b-sft.yaml";
const fs::path kMixtralDir = kSrc / "configs" / "models" / "mixtral-8x7b";

TrainConfig recipe(std::vector<std::string> overrides = {}) {
  overrides.insert(overrides.begin(), "model.init=" + kMixtralDir.string());
  return load_train_config(kRecipe.string(), overrides);
}

// The blog post's own layout: TP 8 x PP 8 (64 ranks at dp 1), no recompute.
TrainConfig recipe64(std::vector<std::string> overrides = {}) {
  overrides.insert(overrides.begin(), {"parallel.tp=8", "parallel.pp=8", "parallel.ep=1", "train.recompute=none"});
  return recipe(overrides);
}

ModelConfig mixtral() { return load_model_config((kMixtralDir / "config.json").string()); }

// A small MoE config whose numbers each rule test changes one at a time.
nlohmann::json small_json() {
  return {{"architectures", {"MixtralForCausalLM"}},
          {"vocab_size", 1024},
          {"hidden_size", 256},
          {"head_dim", 32},
          {"intermediate_size", 512},
          {"num_hidden_layers", 8},
          {"num_attention_heads", 8},
          {"num_key_value_heads", 4},
          {"num_local_experts", 8},
          {"num_experts_per_tok", 2},
          {"max_position_embeddings", 4096}};
}

TrainConfig small_cfg(int tp, int pp, int ep, int gbs = 32, int mbs = 1, int seq = 128) {
  TrainConfig c;
  c.device = "cuda";
  c.model.dtype = "bf16";
  c.data.seq_length = seq;
  c.train.global_batch_size = gbs;
  c.train.micro_batch_size = mbs;
  c.parallel.tp = tp;
  c.parallel.pp = pp;
  c.parallel.ep = ep;
  return c;
}

Plan small_plan(int world, int tp, int pp, int ep, nlohmann::json patch = nlohmann::json::object(), int gbs = 32,
                int mbs = 1, int seq = 128) {
  nlohmann::json j = small_json();
  if (!patch.is_null()) j.update(patch);  // `{}` at a call site is a null json
  return make_plan(small_cfg(tp, pp, ep, gbs, mbs, seq), model_config_from_json(j, "test"), world);
}

// The Error message of `f`, or "" when it does not throw.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_rule(const std::string& msg, const std::string& needle) {
  ASSERT_FALSE(msg.empty()) << "expected an error containing '" << needle << "'";
  EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
}

}  // namespace

TEST(PlanTotals, Mixtral8x7bParameterCounts) {
  const Plan p = make_plan(recipe(), mixtral(), 64);
  // Independent of the plan: the exact counts from the HF shapes.
  const int64_t C = 4096, V = 32000, I = 14336, L = 32, E = 8, K = 2, KV = 8 * 128;
  const int64_t experts = L * E * 3 * I * C;
  const int64_t per_layer = 2 * C * C + 2 * KV * C + 2 * C + E * C;
  const int64_t total = 2 * V * C + C + L * per_layer + experts;
  EXPECT_EQ(p.params_total, total);
  EXPECT_EQ(p.params_experts, experts);
  EXPECT_EQ(p.params_active, total - experts / E * (E - K));
  EXPECT_EQ(format_count((double)p.params_total, 1), "46.7B");
  EXPECT_EQ(format_count((double)p.params_active, 1), "12.9B");
  EXPECT_NEAR(p.params_total / 1e9, 46.70, 0.005);  // the published 46.7B, to the printed 2 decimals
  EXPECT_NEAR(p.params_active / 1e9, 12.88, 0.005);
  // The same from the parameter table (no padding).
  const ParamTable t(mixtral());
  int64_t sum = 0;
  for (const ParamSpec& s : t.specs()) sum += (int64_t)s.numel;
  EXPECT_EQ(p.params_total, sum);
}

// DeepSeek-V3, Kimi-K2, GLM-4.5 and GLM-4.5-Air from their Hub configs: the totals transformers'
// own modules count (tools/count_params_hf.py, transformers 5.24, meta device: buffers and the
// multi-token-prediction layers excluded), and the published figures they round to.
TEST(PlanTotals, DeepSeekKimiGlmMatchTransformers) {
  struct Want {
    const char* dir;
    int64_t total, experts, active, active_without_embedding;
    const char *total_printed, *active_printed;
  };
  const Want wants[] = {
      {"deepseek-v3", 671026404352, 653908770816, 37552282624, 36625603584, "671.0B", "36.6B"},
      {"kimi-k2-instruct", 1026408209408, 1014686023680, 32861477888, 31687072768, "1.0T", "31.7B"},
      {"glm-4.5", 352797814784, 335963750400, 33632251904, 32856305664, "352.8B", "32.9B"},
      {"glm-4.5-air", 106852245504, 99656663040, 13424123904, 12803366912, "106.9B", "12.8B"},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(w.dir);
    const ModelConfig m = load_model_config((kSrc / "configs" / "models" / w.dir / "config.json").string());
    const Plan p =
        make_plan(recipe({"parallel.pp=1", "parallel.tp=8", "parallel.ep=8", "device=cpu", "model.dtype=fp32"}), m, 64);
    EXPECT_EQ(p.params_total, w.total);
    EXPECT_EQ(p.params_experts, w.experts);
    EXPECT_EQ(p.params_active, w.active);
    EXPECT_EQ(p.params_active_compute, w.active_without_embedding);
    EXPECT_EQ(format_count((double)p.params_total, 1), w.total_printed);
    EXPECT_EQ(format_count((double)p.params_active_compute, 1), w.active_printed);
    // The table holds the selection biases too (one [E] per MoE layer), which are not parameters.
    const ParamTable t(m);
    int64_t sum = 0, bias = 0;
    for (const ParamSpec& s : t.specs()) (s.is_buffer() ? bias : sum) += (int64_t)s.numel;
    EXPECT_EQ(sum, w.total);
    EXPECT_EQ(bias, (int64_t)(m.num_hidden_layers - m.first_k_dense_replace) * m.num_local_experts);
  }
}

// FLOPs per token of latent attention and grouped-routing models: twice the multiply-adds of every
// matrix a token passes through, counted here from the parameter table (active experts only).
TEST(PlanTotals, FlopsPerTokenCountTheMatricesATokenUses) {
  for (const char* dir : {"deepseek-v3", "glm-4.5-air"}) {
    SCOPED_TRACE(dir);
    const ModelConfig m = load_model_config((kSrc / "configs" / "models" / dir / "config.json").string());
    const ParamTable t(m);
    double macs = 0;
    for (const ParamSpec& s : t.specs()) {
      if (s.is_norm() || s.is_bias() || s.is_buffer() || s.kind == ParamKind::embedding) continue;
      macs += s.expert ? (double)s.numel / m.num_local_experts * m.num_experts_per_tok : (double)s.numel;
    }
    const FlopCount f = count_flops(m, 4096);
    EXPECT_NEAR(f.forward_matmul_per_token, 2 * macs, 1e-9 * macs);
    // Attention over 4096 positions: q.k over head_dim and the sum over the value width, causal half.
    const double heads = m.num_attention_heads, qk = m.head_dim, v = m.is_mla() ? m.v_head_dim : m.head_dim;
    EXPECT_DOUBLE_EQ(f.forward_attention_per_token, m.num_hidden_layers * 4096.0 * heads * (qk + v));
  }
}

// The blog post's own layout (TP 8 x PP 8 on 64 ranks, no recompute) still plans.
TEST(PlanLayout, RecipesOwnLayoutOn64Ranks) {
  const Plan p = make_plan(recipe64(), mixtral(), 64);
  EXPECT_EQ(p.tp, 8);
  EXPECT_EQ(p.pp, 8);
  EXPECT_EQ(p.dp, 1);
  EXPECT_EQ(p.micro_batches, 32);
  EXPECT_EQ(p.tokens_per_step, 32 * 2048);
  ASSERT_EQ(p.stages.size(), 8u);
  EXPECT_DOUBLE_EQ(p.bubble, 7.0 / 39.0);
  EXPECT_TRUE(p.warnings.empty());
  // First, middle and last stages differ: embedding first, head and final norm last, in-flight counts.
  EXPECT_GT(p.stages[0].params.embedding, 0);
  EXPECT_EQ(p.stages[3].params.embedding, 0);
  EXPECT_GT(p.stages[7].params.lm_head, 0);
  EXPECT_EQ(p.stages[0].in_flight, 8);
  EXPECT_EQ(p.stages[3].in_flight, 5);
  EXPECT_EQ(p.stages[7].in_flight, 1);
  for (const StagePlan& s : p.stages) {
    EXPECT_EQ(s.num_layers, 4);
    EXPECT_EQ(s.param_bytes, 2 * s.params.total());      // bf16 weights
    EXPECT_EQ(s.grad_bytes, 4 * s.params.total());       // fp32 gradients
    EXPECT_EQ(s.optimizer_bytes, 12 * s.params.total());  // dp 1: nothing to shard
    EXPECT_EQ(s.comm.dp, 0);
    EXPECT_EQ(s.comm.ep, 0);
    EXPECT_GT(s.comm.tp, 0);
    EXPECT_GT(s.comm.pp, 0);
    EXPECT_LT(s.total_bytes(), 80LL * 1000 * 1000 * 1000) << "the recipe fits 80 GB GPUs";
  }
  // Every stage's FLOPs over the tp ranks of all stages add up to the model's (dp = 1).
  double flops = 0;
  for (const StagePlan& s : p.stages) flops += s.flops * p.tp;
  EXPECT_NEAR(flops / p.flops_per_step, 1.0, 1e-12);  // reassociated double sums
}

TEST(PlanLayout, PerRankParametersSumToTheModel) {
  // Sum over the tp x pp ranks; tensors every tp rank holds in full (norms, router) counted once.
  for (int tp : {1, 2, 8}) {
    const TrainConfig cfg = recipe64({"parallel.tp=" + std::to_string(tp)});
    const Plan p = make_plan(cfg, mixtral(), tp * 8);
    const ParamTable t(mixtral());
    int64_t sum = 0;
    for (const StagePlan& s : p.stages) {
      int64_t replicated = 0;  // from the table, independently of the plan
      for (const ParamSpec& spec : t.specs()) {
        const bool in_stage = spec.layer >= s.first_layer && spec.layer < s.first_layer + s.num_layers;
        const bool tail = spec.layer < 0 && s.stage == p.pp - 1 && spec.kind == ParamKind::final_norm;
        if ((in_stage || tail) && (spec.is_norm() || spec.kind == ParamKind::router)) replicated += (int64_t)spec.numel;
      }
      EXPECT_EQ(s.params.norms + s.params.router, replicated) << "tp " << tp << " stage " << s.stage;
      sum += tp * s.params.total() - (tp - 1) * replicated;
    }
    EXPECT_EQ(sum, p.params_total) << "tp " << tp;
  }
}

TEST(PlanLayout, KvHeadsReplicatedWhenFewerThanTp) {
  // NKV 4 < tp 8: each rank holds one kv head, so summed over tp the k, v weights count tp/NKV = 2 times.
  const Plan p = small_plan(8, 8, 1, 1);
  const int64_t C = 256, HD = 32, L = 8;
  const int64_t q_o = 2 * (8 * HD * C) / 8, kv = 2 * HD * C;  // per rank per layer
  EXPECT_EQ(p.stages[0].params.attention, L * (q_o + kv));
}

TEST(PlanLayout, Zero1ShardsOptimizerStateOverDp) {
  // tp 8 x pp 8 x dp 8 = 512 ranks.
  const Plan on = make_plan(recipe64(), mixtral(), 512);
  const Plan off = make_plan(recipe64({"parallel.zero1=false"}), mixtral(), 512);
  ASSERT_EQ(on.dp, 8);
  for (size_t i = 0; i < on.stages.size(); i++) {
    const StagePlan &a = on.stages[i], &b = off.stages[i];
    EXPECT_EQ(a.params.total(), b.params.total());
    EXPECT_EQ(b.optimizer_bytes, 12 * b.params.total());
    EXPECT_EQ(a.optimizer_bytes, 12 * ((a.params.dense() + 7) / 8 + (a.params.experts + 7) / 8));
    EXPECT_NEAR((double)b.optimizer_bytes / (double)a.optimizer_bytes, 8.0, 1e-5);  // ceil of shards only
    EXPECT_EQ(a.grad_bytes, b.grad_bytes) << "ZeRO-1 keeps full gradients";
    EXPECT_GT(a.comm.dp, 0);
  }
  // Expert parallelism over the same 8 dp ranks: experts split 8 ways, their optimizer state not sharded
  // further (each expert lives on dp/ep = 1 rank); the dense part still shards over dp.
  const Plan ep = make_plan(recipe64({"parallel.ep=8"}), mixtral(), 512);
  for (size_t i = 0; i < ep.stages.size(); i++) {
    const StagePlan &e = ep.stages[i], &a = on.stages[i];
    EXPECT_EQ(e.params.experts * 8, a.params.experts);
    EXPECT_EQ(e.params.dense(), a.params.dense());
    EXPECT_EQ(e.optimizer_bytes, 12 * ((e.params.dense() + 7) / 8 + e.params.experts));
    EXPECT_GT(e.comm.ep, 0);
  }
}

TEST(PlanLayout, PipelineThatCannotFillIsAWarning) {
  const Plan p = small_plan(4, 1, 4, 1, {}, 2, 1);  // m = 2 < pp = 4
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_NE(p.warnings[0].find("2 micro-batches"), std::string::npos) << p.warnings[0];
  EXPECT_DOUBLE_EQ(p.bubble, 3.0 / 5.0);
  EXPECT_EQ(p.stages[0].in_flight, 2);
}

TEST(PlanRules, WorldNotDivisibleByTpTimesPp) {
  expect_rule(error_of([] { make_plan(recipe64(), mixtral(), 60); }),
              "world size 60 is not divisible by tp 8 x pp 8 = 64");
}

TEST(PlanRules, EpMustDivideDp) {
  expect_rule(error_of([] { make_plan(recipe64({"parallel.ep=4"}), mixtral(), 128); }),
              "ep 4 does not divide the data-parallel size 2");
}

TEST(PlanRules, HeadsDivisibleByTp) {
  expect_rule(error_of([] { small_plan(8, 8, 1, 1, {{"num_attention_heads", 12}}); }),
              "tp 8 does not divide num_attention_heads 12");
}

TEST(PlanRules, KvHeadsAndTp) {
  // tp 6 divides NH 12, I 600 and V 1200, but neither 4 % 6 nor 6 % 4 is 0.
  expect_rule(error_of([] {
                small_plan(6, 6, 1, 1, {{"num_attention_heads", 12}, {"intermediate_size", 600}, {"vocab_size", 1200}});
              }),
              "num_key_value_heads 4 and tp 6");
  EXPECT_EQ(error_of([] { small_plan(2, 2, 1, 1); }), "") << "NKV 4 split over tp 2";
}

TEST(PlanRules, LayersDivisibleByPp) {
  expect_rule(error_of([] { small_plan(3, 1, 3, 1, {}, 33); }), "pp 3 does not divide num_hidden_layers 8");
}

// parallel.layers_per_stage: uneven contiguous stages; one entry per stage, summing to the layers.
TEST(PlanRules, LayersPerStageListsEveryStageAndSumsToTheLayers) {
  const ModelConfig m = model_config_from_json(small_json(), "test");  // 8 layers
  TrainConfig c = small_cfg(1, 3, 1, 33);
  c.parallel.layers_per_stage = {2, 3, 3};
  const Plan p = make_plan(c, m, 3);
  ASSERT_EQ(p.stages.size(), 3u);
  EXPECT_EQ(p.stages[0].first_layer, 0);
  EXPECT_EQ(p.stages[0].num_layers, 2);
  EXPECT_EQ(p.stages[1].first_layer, 2);
  EXPECT_EQ(p.stages[2].first_layer, 5);
  EXPECT_EQ(p.stages[2].num_layers, 3);
  EXPECT_LT(p.stages[0].params.attention, p.stages[1].params.attention);
  EXPECT_EQ(stage_layer_starts(c, m), (std::vector<int>{0, 2, 5, 8}));
  c.parallel.layers_per_stage = {2, 3};
  expect_rule(error_of([&] { make_plan(c, m, 3); }), "parallel.layers_per_stage has 2 entries, pp is 3");
  c.parallel.layers_per_stage = {2, 3, 4};
  expect_rule(error_of([&] { make_plan(c, m, 3); }), "parallel.layers_per_stage sums to 9 layers, the model has 8");
  c.parallel.layers_per_stage = {4, 4, 0};
  expect_rule(error_of([&] { make_plan(c, m, 3); }), "parallel.layers_per_stage[2] is 0");
}

TEST(PlanRules, ExpertsDivisibleByEp) {
  expect_rule(error_of([] { small_plan(3, 1, 1, 3, {}, 33, 1); }), "ep 3 does not divide num_local_experts 8");
}

TEST(PlanRules, DenseModelNeedsEp1) {
  nlohmann::json dense = small_json();
  dense.erase("num_local_experts");
  dense.erase("num_experts_per_tok");
  dense["architectures"] = {"MistralForCausalLM"};
  const ModelConfig m = model_config_from_json(dense, "test");
  expect_rule(error_of([&] { make_plan(small_cfg(1, 1, 2), m, 2); }), "ep 2 needs an MoE model");
  EXPECT_EQ(make_plan(small_cfg(1, 1, 1), m, 2).params_active, make_plan(small_cfg(1, 1, 1), m, 2).params_total);
}

TEST(PlanRules, IntermediateDivisibleByTp) {
  expect_rule(error_of([] { small_plan(8, 8, 1, 1, {{"intermediate_size", 500}}); }),
              "tp 8 does not divide intermediate_size 500");
}

TEST(PlanRules, VocabDivisibleByTp) {
  expect_rule(error_of([] { small_plan(8, 8, 1, 1, {{"vocab_size", 1004}}); }), "tp 8 does not divide vocab_size 1004");
}

TEST(PlanRules, GlobalBatchDivisibleByMicroBatchTimesDp) {
  expect_rule(error_of([] { small_plan(4, 1, 1, 1, {}, 30, 2); }),
              "global_batch_size 30 is not divisible by micro_batch_size 2 x data-parallel size 4 = 8");
}

TEST(PlanRules, SeqLengthWithinMaxPositions) {
  expect_rule(error_of([] { small_plan(1, 1, 1, 1, {}, 32, 1, 8192); }),
              "data.seq_length 8192 exceeds the model's max_position_embeddings 4096");
}

TEST(PlanBytes, ParseByteSize) {
  EXPECT_EQ(parse_byte_size("80GB"), 80'000'000'000LL);
  EXPECT_EQ(parse_byte_size("80GiB"), 80LL << 30);
  EXPECT_EQ(parse_byte_size("80gib"), 80LL << 30);
  EXPECT_EQ(parse_byte_size("1.5TB"), 1'500'000'000'000LL);
  EXPECT_EQ(parse_byte_size("512MiB"), 512LL << 20);
  EXPECT_EQ(parse_byte_size("85899345920"), 85899345920LL);
  for (const char* bad : {"", "GB", "80XB", "-5GB", "1.2.3GB", "0"})
    EXPECT_THROW(parse_byte_size(bad), Error) << bad;
  EXPECT_EQ(format_bytes(1536.0), "1.50 KiB");
}

TEST(PlanActivations, GrowWithSequenceAndMicroBatch) {
  const Plan a = small_plan(1, 1, 1, 1, {}, 32, 1, 128);
  const Plan b = small_plan(1, 1, 1, 1, {}, 32, 2, 128);
  const Plan c = small_plan(1, 1, 1, 1, {}, 32, 1, 256);
  // Linear in B with flash-style attention (device cuda); T doubles, so does everything here.
  EXPECT_EQ(b.stages[0].activation_bytes_per_micro_batch, 2 * a.stages[0].activation_bytes_per_micro_batch);
  EXPECT_EQ(c.stages[0].activation_bytes_per_micro_batch, 2 * a.stages[0].activation_bytes_per_micro_batch);
  // On CPU the stored attention probabilities are quadratic in T.
  TrainConfig cpu = small_cfg(1, 1, 1);
  cpu.device = "cpu";
  cpu.model.dtype = "fp32";
  const ModelConfig m = model_config_from_json(small_json(), "test");
  const Plan d = make_plan(cpu, m, 1);
  cpu.data.seq_length = 256;
  const Plan e = make_plan(cpu, m, 1);
  EXPECT_GT(e.stages[0].activation_bytes_per_micro_batch, 2 * d.stages[0].activation_bytes_per_micro_batch);
  EXPECT_EQ(d.stages[0].optimizer_bytes, 8 * d.stages[0].params.total()) << "fp32: the weights are the master";
}

// train.recompute: full keeps each layer's fp32 input only and runs the layers' forward again;
// selective leaves out the attention probabilities (the CPU's) and the experts' SwiGLU outputs.
// Small model: L 8, C 256, NH 8, E 8, K 2, I 512; B 1, T 128 (N 128, M 256).
TEST(PlanActivations, RecomputeCountsWhatEachModeKeeps) {
  const ModelConfig m = model_config_from_json(small_json(), "test");
  for (const char* device : {"cpu", "cuda"}) {
    TrainConfig c = small_cfg(1, 1, 1);
    c.device = device;
    c.model.dtype = std::string(device) == "cpu" ? "fp32" : "bf16";
    const int64_t a = std::string(device) == "cpu" ? 4 : 2;
    const Plan none = make_plan(c, m, 1);
    c.train.recompute = "selective";
    const Plan sel = make_plan(c, m, 1);
    c.train.recompute = "full";
    const Plan full = make_plan(c, m, 1);
    const StagePlan &n = none.stages[0], &s = sel.stages[0], &f = full.stages[0];
    const int64_t L = 8, N = 128, C = 256, M = 256, I = 512;
    const int64_t probs = std::string(device) == "cpu" ? 4 * 8 * 128 * 128 : 0;  // fp32 B NH T^2 a layer
    const int64_t last = a * 2 * N * C + 4 * (N * 1024 + 2 * N);                  // final norm, logits
    EXPECT_EQ(s.activation_bytes_per_micro_batch, n.activation_bytes_per_micro_batch - L * (probs + a * M * I)) << device;
    EXPECT_EQ(s.workspace_bytes, n.workspace_bytes + probs + a * M * I) << device;
    EXPECT_EQ(f.activation_bytes_per_micro_batch, L * 4 * N * C + last) << device;
    const int64_t layer = (n.activation_bytes_per_micro_batch - last) / L;
    EXPECT_EQ(f.workspace_bytes, n.workspace_bytes + layer + 4 * N * C) << device;
    EXPECT_LT(f.activation_bytes(), s.activation_bytes()) << device;
    EXPECT_LT(s.activation_bytes(), n.activation_bytes()) << device;
    // Full runs every layer's forward again: 4/3 of the layers' training FLOPs (the head's stay 3x).
    EXPECT_GT(f.flops, n.flops * 1.25) << device;
    EXPECT_LT(f.flops, n.flops * 4.0 / 3.0) << device;
    EXPECT_EQ(full.recompute, "full");
    EXPECT_NE(format_plan(full).find("recompute full"), std::string::npos);
    EXPECT_EQ(plan_to_json(sel)["layout"]["recompute"], "selective");
  }
}

// ---- the CLI -------------------------------------------------------------------------------------

namespace {

struct CliRun {
  int code = -1;
  std::string out, err;
};

CliRun run_cli(const std::string& args) {
  const fs::path dir = fs::temp_directory_path() / ("moetron_plan_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string cmd = "cd " + kSrc.string() + " && " + MOETRON_BINARY + " plan " + args + " > " +
                          (dir / "out").string() + " 2> " + (dir / "err").string();
  const int status = std::system(cmd.c_str());
  CliRun r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  auto slurp = [](const fs::path& p) {
    std::ifstream f(p);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  r.out = slurp(dir / "out");
  r.err = slurp(dir / "err");
  fs::remove_all(dir);
  return r;
}

}  // namespace

TEST(PlanCli, RecipeFromTheRepositoryRoot) {
  const CliRun r = run_cli("configs/mixtral-8x7b-sft.yaml --world-size 16 --device-memory 80GB");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("46.7B total"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("12.9B active per token"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("world 16 = pp 2 x dp 2 x tp 4; ep 2; ZeRO-1 on; recompute selective"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("fits: the largest rank"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("memory per rank"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bubble"), std::string::npos) << r.out;
}

TEST(PlanCli, JsonMatchesTheLibrary) {
  const CliRun r = run_cli("--config configs/mixtral-8x7b-sft.yaml -n 16 --json --device-memory 80GB");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const Plan p = make_plan(recipe(), mixtral(), 16);
  EXPECT_EQ(j["params"]["total"].get<int64_t>(), p.params_total);
  EXPECT_EQ(j["params"]["active"].get<int64_t>(), p.params_active);
  EXPECT_EQ(j["max_rank_bytes"].get<int64_t>(), p.largest_stage().total_bytes());
  EXPECT_EQ(j["stages"].size(), 2u);
  EXPECT_TRUE(j["fits"].get<bool>());
}

TEST(PlanCli, DeviceMemoryTooSmallExits1) {
  const CliRun r = run_cli("configs/mixtral-8x7b-sft.yaml --world-size 16 --device-memory 4GiB");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("more than --device-memory 4GiB"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("memory per rank"), std::string::npos) << "the plan is still printed";
}

TEST(PlanCli, InvalidLayoutExits1WithOneLine) {
  const CliRun r = run_cli("configs/mixtral-8x7b-sft.yaml --world-size 60");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("world size 60 is not divisible by tp 4 x pp 2 = 8"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << "nothing printed before validation: " << r.out;
  const CliRun o = run_cli("configs/mixtral-8x7b-sft.yaml -n 64 parallel.tp=3");
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.err.find("tp 3"), std::string::npos) << o.err;
}

TEST(PlanCli, UsageErrors) {
  EXPECT_NE(run_cli("--world-size 64").code, 0);                             // no config
  EXPECT_NE(run_cli("configs/mixtral-8x7b-sft.yaml").code, 0);               // no world size
  EXPECT_EQ(run_cli("configs/mixtral-8x7b-sft.yaml -n 64 --device-memory 80XB").code, 1);
  const CliRun bad = run_cli("configs/mixtral-8x7b-sft.yaml -n 64 train.lrr=1");  // config error: the loader's message
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("train.lr"), std::string::npos) << bad.err;
}

// plan --search on the recipe's 16 H100s: the layouts that fit (with the 10% reserve) come first,
// ranked by estimated step time, and the best is the one configs/mixtral-8x7b-sft.yaml takes.
TEST(PlanCli, SearchPutsTheRecipesLayoutFirstOnSixteenH100s) {
  const CliRun r = run_cli("configs/mixtral-8x7b-sft.yaml --world-size 16 --device-memory 80GB --search --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const nlohmann::json& l = j["layouts"];
  ASSERT_GT(l.size(), 10u);
  const TrainConfig c = recipe();
  EXPECT_EQ(l[0]["tp"], c.parallel.tp);
  EXPECT_EQ(l[0]["pp"], c.parallel.pp);
  EXPECT_EQ(l[0]["ep"], c.parallel.ep);
  EXPECT_EQ(l[0]["micro_batch_size"], c.train.micro_batch_size);
  EXPECT_EQ(l[0]["recompute"], c.train.recompute);
  bool fitting = true;
  for (size_t i = 0; i < l.size(); i++) {
    const bool fits = l[i]["fits"].get<bool>();
    EXPECT_FALSE(fits && !fitting) << "a fitting layout after one that does not fit, at " << i;
    fitting = fits;
    EXPECT_EQ(fits, l[i]["bytes"].get<int64_t>() <= (int64_t)(0.9 * 80e9)) << i;
    EXPECT_LE(l[i]["tp"].get<int>(), 8) << "tp stays within a node";
    if (i > 0 && fits) {
      EXPECT_GE(l[i]["step_s"].get<double>(), l[i - 1]["step_s"].get<double>()) << i;
    }
  }
  // The text form names the best layout's overrides.
  const CliRun t = run_cli("configs/mixtral-8x7b-sft.yaml --world-size 16 --device-memory 80GB --search --top 3");
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_NE(t.out.find("best: parallel.tp=4 parallel.pp=2 parallel.ep=2 train.micro_batch_size=1 "
                       "train.recompute=selective"),
            std::string::npos)
      << t.out;
  // Nothing fits 4 GiB: exit 1, the smallest layouts listed.
  const CliRun none = run_cli("configs/mixtral-8x7b-sft.yaml --world-size 16 --device-memory 4GiB --search");
  EXPECT_EQ(none.code, 1);
  EXPECT_NE(none.err.find("no layout fits"), std::string::npos) << none.err;
}

// The step estimate: the same layout is slower when its groups cross nodes (smaller nodes), and the
// inter-node link speed then matters; full recompute costs compute.
TEST(PlanSearch, EstimateFollowsTheLinksAndTheRecompute) {
  const TrainConfig c = recipe();
  SearchHardware hw;
  const auto find = [](const SearchResult& r, int tp, int pp, int ep, const char* rc) {
    for (const SearchCandidate& k : r.ranked)
      if (k.tp == tp && k.pp == pp && k.ep == ep && k.micro_batch_size == 1 && k.recompute == rc) return k;
    ADD_FAILURE() << "no layout tp " << tp << " pp " << pp << " ep " << ep << " " << rc;
    return SearchCandidate{};
  };
  const SearchResult a = search_layouts(c, mixtral(), 16, 0, hw);
  hw.devices_per_node = 4;
  const SearchResult b = search_layouts(c, mixtral(), 16, 0, hw);
  hw.inter_node_gbps = 5;
  const SearchResult slow = search_layouts(c, mixtral(), 16, 0, hw);
  const SearchCandidate x = find(a, 4, 2, 2, "selective"), y = find(b, 4, 2, 2, "selective"),
                        z = find(slow, 4, 2, 2, "selective");
  EXPECT_LT(x.step_s, y.step_s);
  EXPECT_LT(y.step_s, z.step_s);
  EXPECT_DOUBLE_EQ(x.compute_s, z.compute_s);
  EXPECT_GT(find(a, 4, 2, 2, "full").compute_s, 1.2 * x.compute_s);
  for (const SearchCandidate& k : b.ranked) EXPECT_LE(k.tp, 4);
  EXPECT_GT(a.refused, 0);
}

// Qwen3-30B-A3B from its Hub config.json: 30.5B parameters, 3.35B active (8 of 128 experts; Qwen
// publishes 30.5B and 3.3B); exact integers from the HF shapes.
TEST(PlanTotals, Qwen3Moe30bA3bParameterCounts) {
  const ModelConfig m = load_model_config((kSrc / "configs" / "models" / "qwen3-30b-a3b" / "config.json").string());
  const Plan p = make_plan(small_cfg(1, 1, 1, 8, 1, 128), m, 1);
  const int64_t C = 2048, V = 151936, I = 768, L = 48, E = 128, K = 8, Q = 32 * 128, KV = 4 * 128, HD = 128;
  const int64_t experts = L * E * 3 * I * C;
  const int64_t per_layer = 2 * Q * C + 2 * KV * C + 2 * C + 2 * HD + E * C;  // + q/k norms, router
  const int64_t total = 2 * V * C + C + L * per_layer + experts;
  EXPECT_EQ(p.params_total, total);
  EXPECT_EQ(p.params_experts, experts);
  EXPECT_EQ(p.params_active, total - experts / E * (E - K));
  EXPECT_EQ(p.params_total, 30532122624);
  EXPECT_EQ(p.params_active, 3353032704);
  EXPECT_EQ(format_count((double)p.params_total, 1), "30.5B");
  // Qwen publishes "3.3B activated": 3.353e9 truncated (rounded it is 3.4B).
  EXPECT_EQ(format_count((double)p.params_active, 2), "3.35B");
}

// A dense layer among MoE layers (mlp_only_layers) is not an expert tensor: it is not split over ep
// and counts as active.
TEST(PlanTotals, DenseLayersOfAnMoeModelAreNotExperts) {
  nlohmann::json j = {{"architectures", {"Qwen3MoeForCausalLM"}}, {"vocab_size", 1024}, {"hidden_size", 256},
                      {"head_dim", 32}, {"intermediate_size", 512}, {"moe_intermediate_size", 128},
                      {"num_hidden_layers", 4}, {"num_attention_heads", 8}, {"num_key_value_heads", 4},
                      {"num_experts", 8}, {"num_experts_per_tok", 2}, {"mlp_only_layers", {1}}};
  const ModelConfig m = model_config_from_json(j, "test");
  const Plan p = make_plan(small_cfg(1, 1, 2, 32), m, 2);
  EXPECT_EQ(p.params_experts, 3 * 8 * 3 * 128 * 256);
  const ParamTable t(m);
  EXPECT_FALSE(t.at(ParamKind::ffn_w13, 1).expert);
  EXPECT_FALSE(t.has(ParamKind::router, 1));
  EXPECT_TRUE(t.at(ParamKind::ffn_w13, 2).expert);
  // Per rank with ep 2: the dense FFN whole (a dense parameter for ZeRO-1), each MoE layer's experts halved.
  EXPECT_EQ(p.stages[0].params.experts, 3 * 8 * 3 * 128 * 256 / 2);
  EXPECT_EQ(p.stages[0].params.dense_ffn, 3 * 512 * 256);
}

// device cuda: Qwen3-MoE's 128 experts fit the CUDA router (up to 256); more are refused naming the limit.
TEST(PlanRules, CudaExpertLimit) {
  EXPECT_NO_THROW(small_plan(2, 1, 1, 2, {{"num_local_experts", 512}}));  // Kimi-K2 has 384
  expect_rule(error_of([] { small_plan(2, 1, 1, 2, {{"num_local_experts", 1024}}); }), "at most 512 experts");
}

// Qwen1.5-MoE-A2.7B (Qwen2MoeForCausalLM) from its Hub config.json: 14.3B parameters, 2.7B active
// (4 of 60 routed experts, plus the shared expert and the q/k/v biases every token uses).
TEST(PlanTotals, Qwen2MoeA27bParameterCounts) {
  const ModelConfig m =
      load_model_config((kSrc / "configs" / "models" / "qwen1.5-moe-a2.7b" / "config.json").string());
  const Plan p = make_plan(small_cfg(1, 1, 1, 8, 1, 128), m, 1);
  const int64_t C = 2048, V = 151936, I = 1408, Is = 5632, L = 24, E = 60, K = 4, Q = 2048;
  const int64_t experts = L * E * 3 * I * C;
  const int64_t per_layer = 4 * Q * C + 3 * Q + 2 * C + E * C + 3 * Is * C + C;  // + biases, router, shared
  const int64_t total = 2 * V * C + C + L * per_layer + experts;
  EXPECT_EQ(p.params_total, total);
  EXPECT_EQ(p.params_experts, experts);
  EXPECT_EQ(p.params_active, total - experts / E * (E - K));
  EXPECT_EQ(format_count((double)p.params_total, 1), "14.3B");
  EXPECT_EQ(format_count((double)p.params_active, 1), "2.7B");
}

// OLMoE-1B-7B from its Hub config.json: 6.9B parameters, 1.3B active (8 of 64 experts); its q/k
// norms span the whole projections ([2048] each).
TEST(PlanTotals, Olmoe1b7bParameterCounts) {
  const ModelConfig m = load_model_config((kSrc / "configs" / "models" / "olmoe-1b-7b" / "config.json").string());
  const Plan p = make_plan(small_cfg(1, 1, 1, 8, 1, 128), m, 1);
  const int64_t C = 2048, V = 50304, I = 1024, L = 16, E = 64, K = 8;
  const int64_t experts = L * E * 3 * I * C;
  const int64_t per_layer = 4 * C * C + 2 * C + 2 * C + E * C;  // attention, norms, q/k norms, router
  const int64_t total = 2 * V * C + C + L * per_layer + experts;
  EXPECT_EQ(p.params_total, total);
  EXPECT_EQ(p.params_active, total - experts / E * (E - K));
  EXPECT_EQ(format_count((double)p.params_total, 1), "6.9B");
  EXPECT_EQ(format_count((double)p.params_active, 1), "1.3B");
}
