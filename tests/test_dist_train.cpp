// Distributed training under `mpirun --oversubscribe` computes what one process computes (Qwen3-MoE and
// tied dense Qwen3 at the end of the file): for each
// (dp, tp) layout a tiny GQA Mixtral (E = 4, K = 2) trained 10 steps matches the single-process run's
// loss at every step (rel 1e-5) and its final weights (max |diff| / max |w| per tensor <= 1e-4);
// ZeRO-1's optimizer state per rank at dp = 4 is <= 30% of dp = 1's; a checkpoint written at (dp 2,
// tp 2) resumes at (1, 1), (4, 1) and (1, 2) with the losses of continuing at (2, 2); a run started
// from an HF directory at tp 2 matches one process.
//
// Expert parallelism (ep dividing dp; each ep rank holds E/ep experts, tokens travel by all-to-all):
// (ep 2, dp 2), (ep 4, dp 4), (ep 2, dp 4: experts reduced and ZeRO-sharded over edp 2, with and
// without ZeRO-1) and (tp 2, ep 2, dp 2) match one process the same way; so does a run whose router
// is biased so that every token picks experts 0 and 1 (ep rank 1's experts receive no token at all,
// every rank sends it none); a checkpoint written at (ep 2, dp 2) resumes at (1, 1), (ep 2, dp 4)
// and (tp 2, ep 2, dp 2); an HF directory read under ep 2 (each rank reads its experts) matches one
// process; a layout whose ep does not divide dp, or the number of experts, fails before any work
// with exit status 2 and a message naming parallel.ep; a capacity factor drops the same
// assignments under ep (and tp x ep) as in one process.
//
// Pipeline parallelism (stages of contiguous layers, the 1F1B schedule over the micro-batches of
// each data-parallel rank, at least 4 of them): (pp 2), (pp 4 of a 4-layer model) and uneven stages
// of 1 and 3 layers over 8 micro-batches, (pp 2, tp 2) and (pp 2, ep 2, dp 2) over 4 match one process the same way; a
// checkpoint written at (pp 2, ep 2, dp 2) resumes at (1, 1, 1) and at (tp 2, dp 2); the number of
// micro-batches whose activations a stage keeps at once is min(pp - stage, m) whatever m, so its
// activation memory does not grow with m; a pp that does not divide the layers fails with exit 2.
// Activation recompute (full, selective) trains bitwise as without it in one process and matches it
// under (pp 2, ep 2, dp 2) and (tp 2, ep 2, dp 2).
//
// The tolerances are fp32 reduction order: a layout sums the same gradients in another order
// (micro-batches across ranks, partial sums of row-parallel matmuls and of the vocabulary-parallel
// softmax), so values differ by a few ulps per step, amplified a little by Adam over 10 steps (with
// the harness's adam_eps, which keeps Adam from turning a near-cancelled gradient's rounding into a
// full step: test_dist_harness.h).
#include <tuple>

#include "test_dist_harness.h"

using namespace moetron;
using namespace moetron::testing;

namespace {

class DistTrain : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fs::temp_directory_path() / ("moetron_dist_" + std::to_string(::getpid())));
    fs::remove_all(*root_);
    fs::create_directories(*root_ / "data");
    write_dist_split(*root_ / "data", "train", 60, 1);
    write_dist_split(*root_ / "data", "valid", 8, 2);
  }
  static void TearDownTestSuite() {
    // MOETRON_KEEP_TEST_DIRS=1 keeps the runs (their checkpoints for tools/check_checkpoint_hf.py).
    if (std::getenv("MOETRON_KEEP_TEST_DIRS") == nullptr) fs::remove_all(*root_);
    delete root_;
    root_ = nullptr;
  }
  void SetUp() override {
    if (!mpi_available()) GTEST_SKIP() << "built without MPI or no mpirun";
  }

  // Trains run `name` on np ranks (0: one process, no launcher); returns the run directory.
  static fs::path train(const std::string& name, int np, const std::vector<std::string>& overrides,
                        int expect_code = 0, const std::string& model_config = "") {
    const fs::path run = *root_ / name;
    const fs::path cfg = *root_ / (name + ".yaml");
    std::ofstream(cfg) << dist_yaml(run, *root_ / "data", {}, model_config);
    const fs::path log = *root_ / (name + ".log");
    const int code = run_train(np, cfg, overrides, log);
    EXPECT_EQ(code, expect_code) << name << ":\n" << read_file(log);
    return run;
  }
  // The single-process reference, trained once for the whole suite.
  static const fs::path& reference() {
    static const fs::path run = train("ref", 0, {});
    return run;
  }
  // The same with a 4-layer model (the deeper pipelines).
  static const fs::path& reference_4_layers() {
    static const fs::path run = train("ref_l4", 0, {"model.config.num_hidden_layers=4"});
    return run;
  }
  static std::vector<double> losses(const fs::path& run) {
    std::vector<double> v;
    for (const auto& j : read_metrics(run, "loss")) v.push_back(j["loss"].get<double>());
    return v;
  }
  static void expect_same_losses(const std::vector<double>& got, const std::vector<double>& want, size_t first_step,
                                 const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < want.size(); i++)
      EXPECT_NEAR(got[i], want[i], 1e-5 * std::fabs(want[i])) << what << ": step " << first_step + i;
  }
  // Run `a`'s step-5 checkpoint resumed under each layout: the losses of steps 6-10 and the final
  // weights must be those of continuing `a`.
  struct Layout {
    std::string name;
    int np;
    std::vector<std::string> overrides;
  };
  static void expect_resumes_like(const fs::path& a, const std::vector<Layout>& layouts) {
    const fs::path ckpt = a / "checkpoints" / "step-000005";
    ASSERT_TRUE(fs::exists(ckpt / "trainer_state.json"));
    std::vector<double> want = losses(a);
    ASSERT_EQ(want.size(), 10u);
    want.erase(want.begin(), want.begin() + 5);
    const auto want_w = read_tensors(a / "checkpoints" / "step-000010", "model");
    for (const Layout& l : layouts) {
      std::vector<std::string> overrides = l.overrides;
      overrides.push_back("checkpoint.resume=" + ckpt.string());
      const fs::path run = train(l.name, l.np, overrides);
      expect_same_losses(losses(run), want, 6, l.name);
      const auto got_w = read_tensors(run / "checkpoints" / "step-000010", "model");
      ASSERT_EQ(got_w.size(), want_w.size());
      for (const auto& [n, w] : want_w) EXPECT_LE(rel_max_diff(got_w.at(n), w), 1e-4) << l.name << ": " << n;
    }
  }
  static void expect_equivalent(const std::string& name, int dp, int tp, int ep = 1) {
    expect_equivalent_to(reference(), name, dp * tp,
                         {"parallel.tp=" + std::to_string(tp), "parallel.ep=" + std::to_string(ep), "parallel.zero1=true"});
  }
  static void expect_equivalent_to(const fs::path& ref, const std::string& name, int np,
                                   const std::vector<std::string>& overrides) {
    const fs::path run = train(name, np, overrides);
    expect_same_losses(losses(run), losses(ref), 1, name);
    ASSERT_EQ(losses(ref).size(), 10u);
    const auto want = read_tensors(ref / "checkpoints" / "step-000010", "model");
    const auto got = read_tensors(run / "checkpoints" / "step-000010", "model");
    ASSERT_EQ(got.size(), want.size()) << name;
    ASSERT_GT(want.size(), 10u);
    for (const auto& [n, w] : want) {
      ASSERT_TRUE(got.count(n)) << name << ": " << n;
      EXPECT_LE(rel_max_diff(got.at(n), w), 1e-4) << name << ": " << n;
    }
    // The validation losses too (evaluation is sharded over dp).
    const auto vref = read_metrics(ref, "val_loss"), vrun = read_metrics(run, "val_loss");
    ASSERT_EQ(vrun.size(), vref.size());
    for (size_t i = 0; i < vref.size(); i++)
      EXPECT_NEAR(vrun[i]["val_loss"].get<double>(), vref[i]["val_loss"].get<double>(),
                  1e-5 * vref[i]["val_loss"].get<double>());
  }

  static fs::path* root_;
};

fs::path* DistTrain::root_ = nullptr;

}  // namespace

TEST_F(DistTrain, DataParallel2MatchesOneProcess) { expect_equivalent("dp2", 2, 1); }
TEST_F(DistTrain, TensorParallel2MatchesOneProcess) { expect_equivalent("tp2", 1, 2); }
TEST_F(DistTrain, DataAndTensorParallel2x2MatchOneProcess) { expect_equivalent("dp2tp2", 2, 2); }
TEST_F(DistTrain, DataParallel4MatchesOneProcess) { expect_equivalent("dp4", 4, 1); }
// tp 4 > 2 kv heads: each kv head is replicated on two tp ranks and their gradients summed.
TEST_F(DistTrain, TensorParallel4ReplicatesKvHeads) { expect_equivalent("tp4", 1, 4); }
TEST_F(DistTrain, ExpertParallel2MatchesOneProcess) { expect_equivalent("ep2dp2", 2, 1, 2); }
TEST_F(DistTrain, ExpertParallel4MatchesOneProcess) { expect_equivalent("ep4dp4", 4, 1, 4); }
// edp 2: the expert gradients are summed, and their optimizer state sharded, over two ranks.
TEST_F(DistTrain, ExpertParallel2OfDataParallel4MatchesOneProcess) { expect_equivalent("ep2dp4", 4, 1, 2); }
// Without ZeRO-1: bucketed all-reduces (experts over edp 2), every rank updating its whole sets.
TEST_F(DistTrain, ExpertParallelWithoutZero1MatchesOneProcess) {
  expect_equivalent_to(reference(), "ep2dp4_plain", 4, {"parallel.ep=2", "parallel.zero1=false"});
}
TEST_F(DistTrain, TensorExpertAndDataParallel2x2x2MatchOneProcess) { expect_equivalent("tp2ep2dp2", 2, 2, 2); }

// Skewed routing: a router bias makes every token choose experts 0 and 1, so under ep 2 the rank
// holding experts 2 and 3 receives no token, and no rank sends it any; no hang, and the run matches
// one process with the same bias (and so do dp 2 and pp 2 x ep 2 x dp 2).  The bias is the mildest that starves experts
// 2 and 3: with 6,0,-6,-6 the losses still agreed to 1e-5, but the embedding's final weights ended
// 2e-4 (dp 2) and 1e-3 (ep 2) apart relative -- reduction-order differences amplified by Adam's
// normalisation of tiny gradients (not investigated further).
TEST_F(DistTrain, ExpertParallelWithAnIdleExpertRankMatchesOneProcess) {
  const std::string bias = "--debug-router-bias=2,1,-1,-1";
  const fs::path ref = train("ref_skew", 0, {bias});
  expect_equivalent_to(ref, "ep2_skew", 2, {"parallel.ep=2", bias});
  expect_equivalent_to(ref, "dp2_skew", 2, {"parallel.ep=1", bias});
  expect_equivalent_to(ref, "pp2ep2dp2_skew", 4, {"parallel.pp=2", "parallel.ep=2", bias});
  for (const fs::path& run : {ref, *root_ / "ep2_skew", *root_ / "pp2ep2dp2_skew"}) {
    const auto moe = read_metrics(run, "moe");
    ASSERT_EQ(moe.size(), 10u);
    for (const auto& step : moe) {
      ASSERT_EQ(step["moe"].size(), 2u) << run << ": both layers' telemetry, whichever stage holds them";
      for (const auto& layer : step["moe"]) {
        EXPECT_EQ(layer["shares"][2].get<double>(), 0.0) << run;
        EXPECT_EQ(layer["shares"][3].get<double>(), 0.0) << run;
      }
    }
  }
}

// A capacity limit (moe.capacity_factor) drops the overflow of each expert per micro-batch, on the
// token's own rank before the exchange: the dropped fraction is reported, and ep 2 (and tp 2 x ep 2)
// drop what one process drops.
TEST_F(DistTrain, ExpertParallelWithCapacityFactorMatchesOneProcess) {
  const std::string cf = "moe.capacity_factor=0.75";
  const fs::path ref = train("ref_cap", 0, {cf});
  double max_dropped = 0;
  for (const auto& step : read_metrics(ref, "moe"))
    for (const auto& layer : step["moe"]) max_dropped = std::max(max_dropped, layer["dropped_fraction"].get<double>());
  EXPECT_GT(max_dropped, 0.05);
  EXPECT_LT(max_dropped, 0.5);
  expect_equivalent_to(ref, "ep2_cap", 2, {"parallel.ep=2", cf});
  expect_equivalent_to(ref, "tp2ep2_cap", 4, {"parallel.ep=2", "parallel.tp=2", cf});
}

// Capacity factor 1.0 on skewed routing through the trainer: the bias sends every token to experts 0
// and 1, each of which then has room for ceil(N_real / 2) of its N_real real assignments per
// micro-batch, so the reported fraction of every layer and step is sum floor(N_i / 2) / sum N_i over
// the step's micro-batches: 0.5 when every micro-batch has an even number of real tokens, just under
// it otherwise (the exact counts are pinned in test_model's Capacity.FactorOneOnSkewedRouting...).
// The same run without a factor reports 0; ep 2 (whose second rank holds the two idle experts)
// drops what one process drops.
TEST_F(DistTrain, CapacityFactorOneOnSkewedRoutingDropsAndReportsTheFraction) {
  const std::string bias = "--debug-router-bias=2,1,-1,-1";
  const auto fractions = [](const fs::path& run) {
    std::vector<double> f;
    for (const auto& step : read_metrics(run, "moe"))
      for (const auto& layer : step["moe"]) f.push_back(layer["dropped_fraction"].get<double>());
    return f;
  };
  const fs::path dropless = train("skew_dropless", 0, {bias});
  const fs::path capped = train("skew_cap1", 0, {bias, "moe.capacity_factor=1.0"});
  const std::vector<double> none = fractions(dropless), half = fractions(capped);
  ASSERT_EQ(none.size(), 20u);  // 10 steps x 2 layers
  ASSERT_EQ(half.size(), 20u);
  for (double f : none) EXPECT_EQ(f, 0.0);
  for (double f : half) {
    EXPECT_LE(f, 0.5);
    // Each of the 8 micro-batches (at most 64 real tokens) rounds at most half an assignment per
    // expert up: sum N_i >= 8 x 8 tokens (the shortest document) bounds the shortfall by 1/16.
    EXPECT_GE(f, 0.5 - 8 * 0.5 / 64.0);
  }
  EXPECT_NE(losses(capped), losses(dropless));
  expect_equivalent_to(capped, "ep2_skew_cap1", 2, {"parallel.ep=2", bias, "moe.capacity_factor=1.0"});
}

// Layouts that cannot work fail before any work: exit 2, a one-line message naming the field.
TEST_F(DistTrain, ExpertParallelBadLayoutsFailNamingTheField) {
  const fs::path a = train("bad_ep_dp", 2, {"parallel.ep=4"}, 2);
  EXPECT_NE(read_file(*root_ / "bad_ep_dp.log").find("parallel.ep: ep 4 does not divide the data-parallel size 2"),
            std::string::npos)
      << read_file(*root_ / "bad_ep_dp.log");
  EXPECT_FALSE(fs::exists(a / "metrics.jsonl"));
  const fs::path b = train("bad_ep_experts", 3, {"parallel.ep=3", "train.global_batch_size=6"}, 2);
  EXPECT_NE(read_file(*root_ / "bad_ep_experts.log").find("parallel.ep: ep 3 does not divide num_local_experts 4"),
            std::string::npos)
      << read_file(*root_ / "bad_ep_experts.log");
  EXPECT_FALSE(fs::exists(b / "metrics.jsonl"));
}

// A checkpoint written under expert parallelism holds every expert: it resumes at (1, 1), at
// (ep 2, dp 4) and at (tp 2, ep 2, dp 2) with the losses (and final weights) of continuing at
// (ep 2, dp 2).
TEST_F(DistTrain, ExpertParallelCheckpointResumesUnderAnotherLayout) {
  const fs::path a = train("a_ep2", 2, {"parallel.ep=2"});
  ASSERT_TRUE(read_tensors(a / "checkpoints" / "step-000010", "model")
                  .count("model.layers.1.block_sparse_moe.experts.3.w2.weight"));
  expect_resumes_like(a, {{"b_ep_1x1", 0, {"parallel.ep=1", "parallel.tp=1"}},
                          {"c_ep2dp4", 4, {"parallel.ep=2", "parallel.tp=1"}},
                          {"d_tp2ep2dp2", 4, {"parallel.ep=2", "parallel.tp=2"}}});
}

TEST_F(DistTrain, PipelineParallel2MatchesOneProcess) {
  expect_equivalent_to(reference(), "pp2", 2, {"parallel.pp=2"});
}

TEST_F(DistTrain, PipelineParallel4Of4LayersMatchesOneProcess) {
  expect_equivalent_to(reference_4_layers(), "pp4_l4", 4, {"model.config.num_hidden_layers=4", "parallel.pp=4"});
}

// parallel.layers_per_stage: stages of 1 and 3 layers.
TEST_F(DistTrain, PipelineUnevenStagesMatchOneProcess) {
  expect_equivalent_to(reference_4_layers(), "pp2_1_3", 2,
                       {"model.config.num_hidden_layers=4", "parallel.pp=2", "parallel.layers_per_stage=[1, 3]"});
}

TEST_F(DistTrain, PipelineAndTensorParallel2x2MatchOneProcess) {
  expect_equivalent_to(reference(), "pp2tp2", 4, {"parallel.pp=2", "parallel.tp=2"});
}

TEST_F(DistTrain, PipelineExpertAndDataParallel2x2x2MatchOneProcess) {
  expect_equivalent_to(reference(), "pp2ep2dp2", 4, {"parallel.pp=2", "parallel.ep=2", "parallel.zero1=true"});
}

// The pooled load-balancing loss spans the stages (statistics forward, gradient back); the
// per-layer loss stays within each stage.  Both match one process at pp 2.
TEST_F(DistTrain, PipelineParallelPerLayerAuxLossMatchesOneProcess) {
  const fs::path ref = train("ref_per_layer", 0, {"moe.aux_loss=per_layer", "moe.z_loss_coef=0.001"});
  expect_equivalent_to(ref, "pp2_per_layer", 2, {"parallel.pp=2", "moe.aux_loss=per_layer", "moe.z_loss_coef=0.001"});
}

// A checkpoint written under pipeline x expert x data parallelism holds every layer and expert: it
// resumes at (1, 1, 1) and at (tp 2, dp 2) with the losses (and final weights) of continuing.
TEST_F(DistTrain, PipelineCheckpointResumesUnderAnotherLayout) {
  const fs::path a = train("a_pp2ep2dp2", 4, {"parallel.pp=2", "parallel.ep=2"});
  expect_resumes_like(a, {{"b_pp_1x1x1", 0, {"parallel.pp=1", "parallel.ep=1"}},
                          {"c_pp_tp2dp2", 4, {"parallel.pp=1", "parallel.ep=1", "parallel.tp=2"}}});
}

// 1F1B keeps at most min(pp - stage, m) micro-batches' activations on a stage: measured by the
// model's activation sets (metrics.jsonl "pipeline"), the peak is the same with 8 and with 16
// micro-batches per step, and stage 0 holds 4 micro-batches' activations, not m.
TEST_F(DistTrain, PipelineActivationMemoryIsBoundedByStagesNotMicroBatches) {
  std::vector<nlohmann::json> seen;
  for (int m : {8, 16}) {
    const std::string name = "pp4_mem_m" + std::to_string(m);
    const fs::path run = train(name, 4,
                               {"model.config.num_hidden_layers=4", "parallel.pp=4", "train.max_steps=2",
                                "train.global_batch_size=" + std::to_string(m), "eval.every_steps=0"});
    const auto metrics = read_metrics(run, "pipeline");
    ASSERT_EQ(metrics.size(), 2u) << name;
    const nlohmann::json& p = metrics.back()["pipeline"];
    EXPECT_EQ(p["micro_batches"].get<int>(), m);
    EXPECT_EQ(p["peak_micro_batches_in_flight"].get<std::vector<int>>(), (std::vector<int>{4, 3, 2, 1})) << name;
    const auto bytes = p["peak_activation_bytes"].get<std::vector<int64_t>>();
    const auto per_micro = p["activation_bytes_per_micro_batch"].get<std::vector<int64_t>>();
    ASSERT_EQ(bytes.size(), 4u);
    for (int st = 0; st < 4; st++) {
      EXPECT_GT(per_micro[st], 0);
      EXPECT_EQ(bytes[st], (4 - st) * per_micro[st]) << name << ": stage " << st;
    }
    EXPECT_LT(bytes[0], m * per_micro[0]);
    seen.push_back(p);
  }
  EXPECT_EQ(seen[0]["peak_activation_bytes"], seen[1]["peak_activation_bytes"]);
}

// Evaluation runs forwards without backwards between steps; none of that may leak into the next
// step's gradients: one process with evaluation every 5 steps trains bitwise as one without, and
// pp 2 evaluating every step matches them too.
TEST_F(DistTrain, EvaluationBetweenStepsDoesNotChangeTraining) {
  const std::vector<double> with_eval = losses(reference());
  const std::vector<double> without = losses(train("ref_no_eval", 0, {"eval.every_steps=0"}));
  ASSERT_EQ(with_eval.size(), 10u);
  EXPECT_EQ(without, with_eval);
  expect_same_losses(losses(train("pp2_eval_every_step", 2, {"parallel.pp=2", "eval.every_steps=1"})), with_eval, 1,
                     "pp 2, evaluating every step");
}

// train.recompute (model/recompute.h): one process trains bitwise as without it (losses and final
// weights), full and selective alike; full recompute under (pp 2, ep 2, dp 2) -- a 1F1B queue of
// micro-batches sharing one work set, the all-to-all run again in the backward -- and full and
// selective under (tp 2, ep 2, dp 2) match one process as every layout does.
TEST_F(DistTrain, RecomputeTrainsAsWithoutIt) {
  const std::vector<double> want = losses(reference());
  const auto want_w = read_tensors(reference() / "checkpoints" / "step-000010", "model");
  for (const char* mode : {"full", "selective"}) {
    const std::string name = std::string("recompute_") + mode;
    const fs::path run = train(name, 0, {std::string("train.recompute=") + mode});
    EXPECT_NE(read_file(*root_ / (name + ".log")).find(std::string("activation recompute: ") + mode), std::string::npos);
    EXPECT_EQ(losses(run), want) << mode;
    const auto got_w = read_tensors(run / "checkpoints" / "step-000010", "model");
    ASSERT_EQ(got_w.size(), want_w.size()) << mode;
    for (const auto& [n, w] : want_w) EXPECT_EQ(got_w.at(n), w) << mode << ": " << n;
  }
  expect_equivalent_to(reference(), "recompute_full_pp2ep2dp2", 4,
                       {"parallel.pp=2", "parallel.ep=2", "parallel.zero1=true", "train.recompute=full"});
  expect_equivalent_to(reference(), "recompute_selective_tp2ep2dp2", 4,
                       {"parallel.tp=2", "parallel.ep=2", "parallel.zero1=true", "train.recompute=selective"});
  expect_equivalent_to(reference(), "recompute_full_tp2ep2dp2", 4,
                       {"parallel.tp=2", "parallel.ep=2", "parallel.zero1=true", "train.recompute=full"});
}

TEST_F(DistTrain, PipelineBadLayoutFailsNamingTheField) {
  const fs::path a = train("bad_pp_layers", 3, {"parallel.pp=3"}, 2);
  EXPECT_NE(read_file(*root_ / "bad_pp_layers.log").find("pp 3 does not divide num_hidden_layers 2"), std::string::npos)
      << read_file(*root_ / "bad_pp_layers.log");
  EXPECT_FALSE(fs::exists(a / "metrics.jsonl"));
}

// ZeRO-1 shards the Adam moments over the data-parallel ranks: per-rank optimizer state at dp 4 is
// a quarter of dp 1's (plus shard rounding), and without ZeRO-1 every rank holds all of it.  The
// trainer reports the allocation of the largest rank (optimizer_state_bytes in metrics.jsonl).
TEST_F(DistTrain, Zero1ShardsOptimizerStateOverDataParallelRanks) {
  const auto state = [](const fs::path& run) {
    const auto m = read_metrics(run, "optimizer_state_bytes");
    EXPECT_FALSE(m.empty());
    return m.empty() ? 0.0 : m[0]["optimizer_state_bytes"].get<double>();
  };
  const double one = state(reference());
  const double zero1 = state(train("dp4_zero1", 4, {"parallel.zero1=true", "train.max_steps=2"}));
  const double plain = state(train("dp4_plain", 4, {"parallel.zero1=false", "train.max_steps=2"}));
  ASSERT_GT(one, 0);
  EXPECT_LE(zero1, 0.30 * one) << "dp 4 with ZeRO-1: " << zero1 << " bytes, dp 1: " << one;
  EXPECT_GE(zero1, 0.25 * one);
  EXPECT_EQ(plain, one);
}

// Checkpoints hold whole tensors: one written at (dp 2, tp 2) resumes at (1, 1), at (4, 1) and at
// (1, 2) with the losses (and final weights) of continuing at (2, 2).
TEST_F(DistTrain, CheckpointResumesUnderAnotherLayout) {
  const fs::path a = train("a_2x2", 4, {"parallel.tp=2"});
  expect_resumes_like(a, {{"b_1x1", 0, {"parallel.tp=1"}}, {"c_4x1", 4, {"parallel.tp=1"}}, {"d_1x2", 2, {"parallel.tp=2"}}});
}

// Starting from a Hugging Face directory (the golden tiny GQA Mixtral, vocabulary 128): each
// tensor-parallel rank reads only its slices, and the run matches one process reading it whole.
TEST_F(DistTrain, HfInitReadsSlicesUnderTensorParallel) {
  const fs::path golden = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "mixtral_gqa";
  const fs::path data = *root_ / "data128";
  fs::create_directories(data);
  write_dist_split(data, "train", 30, 3, 128);
  std::vector<std::vector<double>> runs;
  // (tp, ep): one process, tp 2, and ep 2 (each rank reads its two experts of every layer).
  for (const auto& [tp, ep] : {std::pair<int, int>{1, 1}, {2, 1}, {1, 2}}) {
    const std::string name = "hf_tp" + std::to_string(tp) + "_ep" + std::to_string(ep);
    const fs::path run = *root_ / name;
    const fs::path cfg = *root_ / (name + ".yaml");
    std::ofstream(cfg) << dist_yaml(run, data, golden);
    const fs::path log = *root_ / (name + ".log");
    const int code = run_train(tp * ep == 1 ? 0 : 2, cfg,
                               {"parallel.tp=" + std::to_string(tp), "parallel.ep=" + std::to_string(ep),
                                "train.max_steps=3", "eval.every_steps=0"},
                               log);
    ASSERT_EQ(code, 0) << read_file(log);
    runs.push_back(losses(run));
  }
  ASSERT_EQ(runs[0].size(), 3u);
  expect_same_losses(runs[1], runs[0], 1, "tp 2 from an HF directory");
  expect_same_losses(runs[2], runs[0], 1, "ep 2 from an HF directory");
}

// ---- the other architectures ----------------------------------------------------------------------
// Each trains 10 steps as in the Mixtral tests: one process, then the layout; equal losses (1e-5) and
// final weights (1e-4 per tensor).  The model is a `model.config` mapping; `common` overrides go to
// both runs; `present` / `absent` name tensors the checkpoint must (not) hold.
namespace {

struct ArchCase {
  std::string model;                // model.config YAML mapping
  std::string ref;                  // name of the one-process run
  std::vector<std::string> common;  // overrides of both runs
  std::vector<std::string> present, absent;
};

}  // namespace

class DistTrainArch : public DistTrain {
 protected:
  static void expect_architecture_equivalent(const ArchCase& a, const std::string& name, int np,
                                             std::vector<std::string> overrides) {
    const fs::path ref = train(a.ref, 0, a.common, 0, a.model);
    overrides.insert(overrides.end(), a.common.begin(), a.common.end());
    const fs::path run = train(name, np, overrides, 0, a.model);
    expect_same_losses(losses(run), losses(ref), 1, name);
    ASSERT_EQ(losses(ref).size(), 10u);
    const auto want = read_tensors(ref / "checkpoints" / "step-000010", "model");
    const auto got = read_tensors(run / "checkpoints" / "step-000010", "model");
    ASSERT_EQ(got.size(), want.size()) << name;
    for (const std::string& n : a.present) ASSERT_TRUE(want.count(n)) << n;
    for (const std::string& n : a.absent) ASSERT_FALSE(want.count(n)) << n;
    for (const auto& [n, w] : want) {
      ASSERT_TRUE(got.count(n)) << name << ": " << n;
      EXPECT_LE(rel_max_diff(got.at(n), w), 1e-4) << name << ": " << n;
    }
  }
};

namespace {

// A tiny Qwen3-MoE with every difference from Mixtral at once: per-head q/k norms (whole on every tp
// rank, each rank's gradient covering its heads: summed over tp), head_dim 12 != 32 / 4, a dense layer
// (mlp_only_layers [1], intermediate_size 48) between MoE layers of moe_intermediate_size 24 (its FFN
// is a dense parameter: reduced over dp, not held by ep rank), top-K weights not renormalised.
const ArchCase kQwen3Moe{
    "{architectures: [Qwen3MoeForCausalLM], model_type: qwen3_moe, vocab_size: 256, hidden_size: 32, "
    "intermediate_size: 48, moe_intermediate_size: 24, num_hidden_layers: 4, num_attention_heads: 4, "
    "num_key_value_heads: 2, head_dim: 12, num_experts: 4, num_experts_per_tok: 2, mlp_only_layers: [1], "
    "norm_topk_prob: false, router_aux_loss_coef: 0.02, rope_theta: 10000.0, rms_norm_eps: 1.0e-5, "
    "tie_word_embeddings: false, max_position_embeddings: 256}",
    "qwen3_ref",
    {},
    {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.mlp.gate_proj.weight",
     "model.layers.3.mlp.experts.3.down_proj.weight"},
    {}};

// Qwen2-MoE: q/k/v biases (split with their heads; replicated kv heads sum theirs over the ranks
// sharing them) and the gated shared expert (a dense FFN split over tp whose gate logit's gradient
// is summed over tp; whole on every ep rank, reduced over dp).
const ArchCase kQwen2Moe{
    "{architectures: [Qwen2MoeForCausalLM], model_type: qwen2_moe, vocab_size: 256, hidden_size: 32, "
    "intermediate_size: 48, moe_intermediate_size: 24, shared_expert_intermediate_size: 40, num_hidden_layers: 4, "
    "num_attention_heads: 4, num_key_value_heads: 2, num_experts: 4, num_experts_per_tok: 2, mlp_only_layers: [2], "
    "norm_topk_prob: false, router_aux_loss_coef: 0.02, rope_theta: 10000.0, rms_norm_eps: 1.0e-5, "
    "tie_word_embeddings: false, max_position_embeddings: 256}",
    "qwen2_ref",
    {},
    {"model.layers.0.self_attn.k_proj.bias", "model.layers.1.mlp.shared_expert_gate.weight"},
    {"model.layers.2.mlp.shared_expert_gate.weight"}};  // the dense layer has none

// Dense Qwen3 with tied embeddings: the head's gradient lands in the vocabulary-parallel embedding
// rows it shares.  At a tenth of the other tests' learning rate: tying feeds the head GEMM's
// summation-order rounding (another order under tp) into the embedding, hence into every layer's
// input, and Adam's nearly sign-like early steps turn such rounding into weight differences
// proportional to lr (measured here: 1.9e-4 at lr 3e-3; with a 32000-token vocabulary: 9e-5 at
// 3e-3, 1.1e-6 at 3e-5, and 1.8e-5 at 3e-3 untied, whose head rounding stays at the output).
const ArchCase kQwen3Tied{
    "{architectures: [Qwen3ForCausalLM], model_type: qwen3, vocab_size: 256, hidden_size: 32, "
    "intermediate_size: 48, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, "
    "rope_theta: 10000.0, rms_norm_eps: 1.0e-5, tie_word_embeddings: true, max_position_embeddings: 256}",
    "qwen3_tied_ref",
    {"train.lr=3.0e-4", "train.min_lr=3.0e-5"},
    {"model.embed_tokens.weight"},
    {"lm_head.weight"}};  // a tied model has no separate head

// OLMoE: q/k norms over the whole projections (under tp their row sums of squares, and the
// backward's dots, are all-reduced; a replicated kv head counts once) and clip_qkv.  The data- and
// tensor-parallel layouts run without clip_qkv: the clamp's gradient is a step at +-clip_qkv, and dp
// (tp) sum gradients in another order, whose rounding (amplified by Adam into ~1e-5 weight
// differences) moves a value across the bound now and then, a 100% difference for that element
// (measured: losses still equal to 1e-5, weights 1e-4 to 7e-4 apart).  The pipeline keeps one
// process's summation order and runs with it.
ArchCase olmoe(const std::string& clip) {
  return {"{architectures: [OlmoeForCausalLM], model_type: olmoe, vocab_size: 256, hidden_size: 32, "
          "intermediate_size: 24, num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 2, "
          "num_experts: 4, num_experts_per_tok: 2, norm_topk_prob: false, clip_qkv: " +
              clip +
              ", router_aux_loss_coef: 0.02, rope_theta: 10000.0, rms_norm_eps: 1.0e-5, tie_word_embeddings: false, "
              "max_position_embeddings: 256}",
          "olmoe_ref_clip_" + clip,
          {},
          {"model.layers.0.self_attn.q_norm.weight", "model.layers.3.mlp.experts.3.up_proj.weight"},
          {}};
}

// GLM-4.5: partial RoPE (half of each head), per-head q/k norms, q/k/v biases, a dense first layer
// (first_k_dense_replace), the sigmoid router with two groups of which one is searched, and
// ungated shared experts (a dense FFN split over tp, whole on every ep rank).  The selection bias is
// state, not a parameter: it rides in the checkpoint (zeros here: no balancing) on every rank.
const ArchCase kGlm4Moe{
    "{architectures: [Glm4MoeForCausalLM], model_type: glm4_moe, vocab_size: 256, hidden_size: 32, "
    "intermediate_size: 48, moe_intermediate_size: 24, num_hidden_layers: 4, num_attention_heads: 4, "
    "num_key_value_heads: 2, head_dim: 16, partial_rotary_factor: 0.5, use_qk_norm: true, attention_bias: true, "
    "n_routed_experts: 4, num_experts_per_tok: 2, n_group: 2, topk_group: 2, n_shared_experts: 1, "
    "first_k_dense_replace: 1, routed_scaling_factor: 2.5, norm_topk_prob: true, rope_theta: 10000.0, "
    "rms_norm_eps: 1.0e-5, tie_word_embeddings: false, max_position_embeddings: 256}",
    "glm_ref",
    {},
    {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
     "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.3.mlp.experts.3.up_proj.weight",
     "model.layers.2.self_attn.q_proj.bias"},
    {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"}};

}  // namespace

TEST_F(DistTrainArch, Qwen3MoeTensorParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kQwen3Moe, "qwen3_tp2", 2, {"parallel.tp=2"});
}
TEST_F(DistTrainArch, Qwen3MoeExpertParallel2OfDataParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kQwen3Moe, "qwen3_ep2dp2", 2, {"parallel.ep=2", "parallel.zero1=true"});
}
TEST_F(DistTrainArch, Qwen3MoePipelineParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kQwen3Moe, "qwen3_pp2", 2, {"parallel.pp=2"});
}
TEST_F(DistTrainArch, Qwen2MoeTensorParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kQwen2Moe, "qwen2_tp2", 2, {"parallel.tp=2"});
}
TEST_F(DistTrainArch, Qwen2MoeTensorParallel4ReplicatesKvHeadsAndTheirBiases) {
  expect_architecture_equivalent(kQwen2Moe, "qwen2_tp4", 4, {"parallel.tp=4"});
}
TEST_F(DistTrainArch, Qwen2MoeExpertParallel2OfDataParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kQwen2Moe, "qwen2_ep2dp2", 2, {"parallel.ep=2", "parallel.zero1=true"});
}
TEST_F(DistTrainArch, Qwen2MoePipelineParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kQwen2Moe, "qwen2_pp2", 2, {"parallel.pp=2"});
}
TEST_F(DistTrainArch, Glm4MoeTensorParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kGlm4Moe, "glm_tp2", 2, {"parallel.tp=2"});
}
TEST_F(DistTrainArch, Glm4MoeExpertParallel2OfDataParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kGlm4Moe, "glm_ep2dp2", 2, {"parallel.ep=2", "parallel.zero1=true"});
}
TEST_F(DistTrainArch, Glm4MoePipelineParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kGlm4Moe, "glm_pp2", 2, {"parallel.pp=2"});
}
// DeepSeek-V3: latent attention (q low-rank path, YaRN, interleaved RoPE; under tp the heads split and
// the replicated down-projections take every head's gradient), grouped sigmoid routing (4 groups of 2,
// 2 searched), two shared experts, a dense first layer; and a plain-q variant under tp.
const ArchCase kDeepseekV3{
    "{architectures: [DeepseekV3ForCausalLM], model_type: deepseek_v3, vocab_size: 256, hidden_size: 32, "
    "intermediate_size: 48, moe_intermediate_size: 16, num_hidden_layers: 4, num_attention_heads: 4, "
    "num_key_value_heads: 4, q_lora_rank: 16, kv_lora_rank: 12, qk_nope_head_dim: 8, qk_rope_head_dim: 4, "
    "v_head_dim: 6, n_routed_experts: 8, num_experts_per_tok: 3, n_group: 4, topk_group: 2, n_shared_experts: 2, "
    "first_k_dense_replace: 1, routed_scaling_factor: 2.5, norm_topk_prob: true, rms_norm_eps: 1.0e-5, "
    "max_position_embeddings: 256, tie_word_embeddings: false, rope_scaling: {type: yarn, factor: 4.0, "
    "original_max_position_embeddings: 64, beta_fast: 32, beta_slow: 1, mscale: 0.8, mscale_all_dim: 0.6}, "
    "rope_theta: 10000.0}",
    "deepseek_ref",
    {},
    {"model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.self_attn.q_a_layernorm.weight",
     "model.layers.2.mlp.shared_experts.up_proj.weight", "model.layers.3.mlp.gate.e_score_correction_bias"},
    {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"}};

// Aux-loss-free balancing (moe.bias_update_rate, DeepSeek-V3's rule) checked against this test's own
// reading of the rule: from each step's expert shares in metrics.jsonl, bias += rate * sign(1/E - share)
// in f32, layer by layer; the checkpoints must hold exactly that after steps 5 and 10.  Under dp 2 x
// ep 2 (4 ranks: each expert group replicated twice) the loads are summed over every rank, so the
// biases equal one process's bitwise; a resume at step 5 under another layout continues them exactly.
namespace {

std::map<std::string, std::vector<float>> biases_from_rule(const fs::path& run, int E, double rate, int steps) {
  std::map<std::string, std::vector<float>> out;
  const auto lines = read_metrics(run, "moe");
  EXPECT_GE((int)lines.size(), steps);
  for (int t = 0; t < steps && t < (int)lines.size(); t++)
    for (const auto& layer : lines[t]["moe"]) {
      const std::string name =
          "model.layers." + std::to_string(layer["layer"].get<int>()) + ".mlp.gate.e_score_correction_bias";
      auto& b = out.try_emplace(name, std::vector<float>(E, 0.0f)).first->second;
      const auto shares = layer["shares"].get<std::vector<double>>();
      for (int e = 0; e < E; e++) {
        const double d = 1.0 / E - shares[e];
        b[e] += (float)rate * (float)((d > 0) - (d < 0));
      }
    }
  return out;
}

}  // namespace

TEST_F(DistTrainArch, Glm4MoeBiasUpdateFollowsTheRuleUnderDp2Ep2) {
  const double rate = 0.01;
  ArchCase a = kGlm4Moe;
  a.ref = "glm_bias_ref";
  a.common = {"moe.bias_update_rate=0.01"};
  const fs::path ref = train(a.ref, 0, a.common, 0, a.model);
  const fs::path run = train("glm_bias_dp2ep2", 4, {"moe.bias_update_rate=0.01", "parallel.ep=2", "parallel.zero1=true"},
                             0, a.model);
  expect_same_losses(losses(run), losses(ref), 1, "glm_bias_dp2ep2");
  for (const fs::path& r : {ref, run})
    for (int step : {5, 10}) {
      SCOPED_TRACE(r.filename().string() + " step " + std::to_string(step));
      const auto want = biases_from_rule(r, 4, rate, step);
      ASSERT_EQ(want.size(), 3u);  // layers 1-3 (layer 0 is dense)
      char dir[32];
      std::snprintf(dir, sizeof dir, "step-%06d", step);
      const auto got = read_tensors(r / "checkpoints" / dir, "model");
      float moved = 0;
      for (const auto& [n, b] : want) {
        ASSERT_TRUE(got.count(n)) << n;
        EXPECT_EQ(got.at(n), b) << n;
        for (float x : b) moved = std::max(moved, std::fabs(x));
      }
      EXPECT_GT(moved, 0.0f) << "the rule moved no bias: the check could not fail";
    }
  const auto want = read_tensors(ref / "checkpoints" / "step-000010", "model");
  const auto got = read_tensors(run / "checkpoints" / "step-000010", "model");
  for (const auto& [n, w] : want)
    if (n.find("e_score_correction_bias") != std::string::npos) EXPECT_EQ(got.at(n), w) << n;
  // The telemetry reports each layer's bias range.
  const auto last = read_metrics(ref, "moe").back()["moe"];
  ASSERT_FALSE(last.empty());
  EXPECT_TRUE(last[0].contains("bias_max") && last[0].contains("bias_min"));
  // Resumed at step 5 under tp 2: the same losses and, bitwise, the same biases at step 10.
  const fs::path resumed =
      train("glm_bias_resume_tp2", 2,
            {"moe.bias_update_rate=0.01", "parallel.tp=2",
             "checkpoint.resume=" + (ref / "checkpoints" / "step-000005").string()},
            0, a.model);
  std::vector<double> tail = losses(ref);
  tail.erase(tail.begin(), tail.begin() + 5);
  expect_same_losses(losses(resumed), tail, 6, "glm_bias_resume_tp2");
  const auto got_r = read_tensors(resumed / "checkpoints" / "step-000010", "model");
  for (const auto& [n, w] : want)
    if (n.find("e_score_correction_bias") != std::string::npos) EXPECT_EQ(got_r.at(n), w) << n;
}

// The demo of aux-loss-free balancing: a router skewed towards expert 0 (the test hook adds 1.5 to its
// logit) sends it ~60% of the tokens; with moe.bias_update_rate the selection bias pulls the loads
// back towards 1/E within 30 steps, and without it they stay skewed.
TEST_F(DistTrainArch, BiasUpdateBalancesASkewedRouter) {
  const std::vector<std::string> common = {"--debug-router-bias=1.5,0,0,0", "train.max_steps=30",
                                           "checkpoint.every_steps=30", "eval.every_steps=30"};
  auto imbalance = [&](const std::string& name, const std::string& rate) {
    std::vector<std::string> o = common;
    o.push_back("moe.bias_update_rate=" + rate);
    const fs::path run = train(name, 0, o, 0, kGlm4Moe.model);
    std::vector<double> per_step;  // the mean over the MoE layers of the largest expert share
    for (const auto& j : read_metrics(run, "moe")) {
      double s = 0;
      for (const auto& layer : j["moe"]) s += layer["max_share"].get<double>();
      per_step.push_back(s / (double)j["moe"].size());
    }
    return per_step;
  };
  const std::vector<double> off = imbalance("glm_skew_off", "0"), on = imbalance("glm_skew_on", "0.02");
  ASSERT_EQ(off.size(), 30u);
  ASSERT_EQ(on.size(), 30u);
  auto last5 = [](const std::vector<double>& v) { return (v[25] + v[26] + v[27] + v[28] + v[29]) / 5; };
  std::printf("max expert share, mean over MoE layers: step 1 %.3f; steps 26-30 without balancing %.3f, with %.3f\n",
              on[0], last5(off), last5(on));
  EXPECT_GT(on[0], 0.45) << "the hook must skew the routing";
  EXPECT_GT(last5(off), 0.45);
  EXPECT_LT(last5(on), last5(off) - 0.1);
}

TEST_F(DistTrainArch, BiasUpdateOnASoftmaxRouterIsRefused) {
  const fs::path run = train("mixtral_bias", 0, {"moe.bias_update_rate=0.01"}, 2);  // 2: a config error
  EXPECT_NE(read_file(run.parent_path() / "mixtral_bias.log").find("moe.bias_update_rate"), std::string::npos);
}

TEST_F(DistTrainArch, DeepseekV3TensorParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kDeepseekV3, "deepseek_tp2", 2, {"parallel.tp=2"});
}
TEST_F(DistTrainArch, DeepseekV3PlainQTensorParallel4MatchesOneProcess) {
  ArchCase plain = kDeepseekV3;
  plain.model.replace(plain.model.find("q_lora_rank: 16"), 15, "q_lora_rank: null");
  plain.ref = "deepseek_plain_ref";
  plain.present = {"model.layers.1.self_attn.q_proj.weight"};
  plain.absent = {"model.layers.1.self_attn.q_a_proj.weight"};
  expect_architecture_equivalent(plain, "deepseek_plain_tp4", 4, {"parallel.tp=4"});
}
TEST_F(DistTrainArch, DeepseekV3ExpertParallel2OfDataParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kDeepseekV3, "deepseek_ep2dp2", 2, {"parallel.ep=2", "parallel.zero1=true"});
}
TEST_F(DistTrainArch, DeepseekV3PipelineParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kDeepseekV3, "deepseek_pp2", 2, {"parallel.pp=2"});
}
TEST_F(DistTrainArch, Qwen3TiedTensorParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kQwen3Tied, "qwen3_tied_tp2", 2, {"parallel.tp=2"});
}
TEST_F(DistTrainArch, Qwen3TiedDataParallel2MatchesOneProcess) {
  expect_architecture_equivalent(kQwen3Tied, "qwen3_tied_dp2", 2, {"parallel.zero1=true"});
}
TEST_F(DistTrainArch, OlmoeTensorParallel2MatchesOneProcess) {
  expect_architecture_equivalent(olmoe("null"), "olmoe_tp2", 2, {"parallel.tp=2"});
}
TEST_F(DistTrainArch, OlmoeTensorParallel4ReplicatesKvHeadsInTheNorm) {
  expect_architecture_equivalent(olmoe("null"), "olmoe_tp4", 4, {"parallel.tp=4"});
}
TEST_F(DistTrainArch, OlmoeExpertParallel2OfDataParallel2MatchesOneProcess) {
  expect_architecture_equivalent(olmoe("null"), "olmoe_ep2dp2", 2, {"parallel.ep=2", "parallel.zero1=true"});
}
TEST_F(DistTrainArch, OlmoePipelineParallel2WithClipQkvMatchesOneProcess) {
  expect_architecture_equivalent(olmoe("1.5"), "olmoe_pp2", 2, {"parallel.pp=2"});
}

// LoRA (model/lora.h) on a frozen base under every parallel layout: the adapters follow their base's
// split (A whole beside a column-parallel base, B whole beside a row-parallel one: their partial
// gradients summed over tp; B of a replicated kv head summed over the ranks sharing it; the router's
// whole, with identical gradients) and live with their experts under ep; ZeRO-1 shards their optimizer state.  Each layout matches one
// process: losses 1e-5 at every step, the final adapter tensors 1e-4.  A checkpoint written at
// (tp 2) resumes at one process with the losses of continuing it.
class DistTrainLora : public DistTrain {
 protected:
  static std::vector<std::string> lora() {
    return {"lora.rank=4", "lora.alpha=8", "lora.targets=[attention, experts, router]", "train.lr=1.0e-2",
            "train.min_lr=1.0e-3"};
  }
  static const fs::path& lora_reference() {
    static const fs::path run = train("lora_ref", 0, lora());
    return run;
  }
  static void expect_lora_equivalent(const std::string& name, int np, std::vector<std::string> overrides) {
    const fs::path& ref = lora_reference();
    std::vector<std::string> o = lora();
    o.insert(o.end(), overrides.begin(), overrides.end());
    const fs::path run = train(name, np, o);
    expect_same_losses(losses(run), losses(ref), 1, name);
    ASSERT_EQ(losses(ref).size(), 10u);
    const auto want = read_tensors(ref / "checkpoints" / "step-000010", "adapter_model");
    const auto got = read_tensors(run / "checkpoints" / "step-000010", "adapter_model");
    ASSERT_FALSE(want.empty());
    ASSERT_EQ(got.size(), want.size()) << name;
    ASSERT_TRUE(want.count("base_model.model.model.layers.1.mlp.experts.lora_B.weight"));
    ASSERT_TRUE(want.count("base_model.model.model.layers.1.mlp.gate.lora_B.weight"));
    for (const auto& [n, w] : want) {
      ASSERT_TRUE(got.count(n)) << name << ": " << n;
      EXPECT_LE(rel_max_diff(got.at(n), w), 1e-4) << name << ": " << n;
    }
  }
};

TEST_F(DistTrainLora, TensorParallel2MatchesOneProcess) { expect_lora_equivalent("lora_tp2", 2, {"parallel.tp=2"}); }
TEST_F(DistTrainLora, TensorParallel4ReplicatesKvHeadsMatchesOneProcess) {
  expect_lora_equivalent("lora_tp4", 4, {"parallel.tp=4"});
}
TEST_F(DistTrainLora, ExpertParallel2OfDataParallel2MatchesOneProcess) {
  expect_lora_equivalent("lora_ep2dp2", 4, {"parallel.ep=2", "parallel.zero1=true"});
}
TEST_F(DistTrainLora, PipelineParallel2MatchesOneProcess) { expect_lora_equivalent("lora_pp2", 2, {"parallel.pp=2"}); }
TEST_F(DistTrainLora, CheckpointOfTensorParallel2ResumesInOneProcess) {
  std::vector<std::string> o = lora();
  o.push_back("parallel.tp=2");
  o.push_back("checkpoint.keep_last=10");
  const fs::path a = train("lora_tp2_ck", 2, o);
  const fs::path ckpt = a / "checkpoints" / "step-000005";
  ASSERT_TRUE(fs::exists(ckpt / "adapter_model.safetensors"));
  std::vector<double> want = losses(a);
  ASSERT_EQ(want.size(), 10u);
  want.erase(want.begin(), want.begin() + 5);
  std::vector<std::string> r = lora();
  r.push_back("checkpoint.resume=" + ckpt.string());
  const fs::path run = train("lora_tp2_resumed_1", 0, r);
  expect_same_losses(losses(run), want, 6, "lora tp2 -> 1");
}
// The frozen base kept in bf16 (model.dtype bf16, one layer widened at a time) under tp 2 x pp 2 and
// under ep 2 of dp 2: as one process with the same bf16 base.
TEST_F(DistTrainLora, Bf16BaseUnderTensorPipelineAndExpertParallelMatchesOneProcess) {
  std::vector<std::string> o = lora();
  o.push_back("model.dtype=bf16");
  const fs::path ref = train("lora_bf16_ref", 0, o);
  const auto want = read_tensors(ref / "checkpoints" / "step-000010", "adapter_model");
  ASSERT_FALSE(want.empty());
  for (const auto& [name, np, extra] : std::vector<std::tuple<std::string, int, std::vector<std::string>>>{
           {"lora_bf16_tp2pp2", 4, {"parallel.tp=2", "parallel.pp=2"}}, {"lora_bf16_ep2dp2", 4, {"parallel.ep=2"}}}) {
    std::vector<std::string> r = o;
    r.insert(r.end(), extra.begin(), extra.end());
    const fs::path run = train(name, np, r);
    expect_same_losses(losses(run), losses(ref), 1, name);
    const auto got = read_tensors(run / "checkpoints" / "step-000010", "adapter_model");
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [n, w] : want) EXPECT_LE(rel_max_diff(got.at(n), w), 1e-4) << name << ": " << n;
  }
  // ... and differs from the fp32 base's run (the base really is rounded).
  EXPECT_NE(losses(ref), losses(lora_reference()));
}
// Qwen2-MoE with LoRA on attention, the routed experts, the shared experts and the dense layer's MLP
// (gate_proj / up_proj / down_proj, split over tp with their base, whole on every ep rank): tp 2,
// tp 4 (replicated kv heads and their biases), ep 2 of dp 2 and pp 2 match one process.
TEST_F(DistTrainLora, Qwen2MoeWithDenseAndSharedExpertTargetsMatchesOneProcess) {
  std::vector<std::string> o = lora();
  o.back() = "train.min_lr=1.0e-3";
  o[2] = "lora.targets=[attention, experts, mlp, router]";
  const fs::path ref = train("lora_q2_ref", 0, o, 0, kQwen2Moe.model);
  const auto want = read_tensors(ref / "checkpoints" / "step-000010", "adapter_model");
  ASSERT_TRUE(want.count("base_model.model.model.layers.2.mlp.gate_proj.lora_B.weight"));
  ASSERT_TRUE(want.count("base_model.model.model.layers.0.mlp.shared_expert.down_proj.lora_A.weight"));
  for (const auto& [name, np, extra] : std::vector<std::tuple<std::string, int, std::vector<std::string>>>{
           {"lora_q2_tp2", 2, {"parallel.tp=2"}},
           {"lora_q2_tp4", 4, {"parallel.tp=4"}},
           {"lora_q2_ep2dp2", 4, {"parallel.ep=2"}},
           {"lora_q2_pp2", 2, {"parallel.pp=2"}}}) {
    std::vector<std::string> r = o;
    r.insert(r.end(), extra.begin(), extra.end());
    const fs::path run = train(name, np, r, 0, kQwen2Moe.model);
    expect_same_losses(losses(run), losses(ref), 1, name);
    const auto got = read_tensors(run / "checkpoints" / "step-000010", "adapter_model");
    ASSERT_EQ(got.size(), want.size()) << name;
    for (const auto& [n, w] : want) EXPECT_LE(rel_max_diff(got.at(n), w), 1e-4) << name << ": " << n;
  }
}
