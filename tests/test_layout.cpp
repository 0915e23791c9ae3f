// One place resolves and checks a run's layout (src/train/layout.h): `moetron plan` accepts exactly
// the layouts `moetron train` accepts, and refuses the others with the same one-line reason.  Each
// case runs both commands on the tiny distributed-test model (tests/test_dist_harness.h): plan with
// --world-size W, train under `mpirun -np W` (alone when W = 1) for one step.
#include <unistd.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_dist_harness.h"

namespace moetron {
namespace {

namespace fs = std::filesystem;
using testing::read_file;

struct LayoutCase {
  const char* name;
  int world;
  std::vector<std::string> overrides;
  bool valid;
};

// The reason after "error: " on the command's error line ("" when there is none).
std::string reason(const std::string& log) {
  const size_t p = log.find("error: ");
  if (p == std::string::npos) return "";
  const size_t e = log.find('\n', p);
  return log.substr(p + 7, e == std::string::npos ? std::string::npos : e - p - 7);
}

TEST(LayoutAgreement, PlanAndTrainAcceptAndRefuseTheSameLayouts) {
  if (!testing::mpi_available()) GTEST_SKIP() << "mpirun is not available";
  const fs::path root = fs::temp_directory_path() / ("moetron_layout_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "data");
  testing::write_dist_split(root / "data", "train", 200, 1);
  const fs::path cfg = root / "c.yaml";
  std::ofstream(cfg) << testing::dist_yaml(root / "unused", root / "data");
  const std::vector<LayoutCase> cases = {
      {"one", 1, {}, true},
      {"tp2", 2, {"parallel.tp=2"}, true},
      {"ep2", 2, {"parallel.ep=2"}, true},
      {"pp2", 2, {"parallel.pp=2"}, true},
      {"pp2ep2", 4, {"parallel.pp=2", "parallel.ep=2"}, true},
      {"ep_not_dividing_dp", 2, {"parallel.ep=4"}, false},
      {"tp_not_dividing_heads", 3, {"parallel.tp=3"}, false},
      {"pp_not_dividing_layers", 3, {"parallel.pp=3"}, false},
      {"uneven_stages_wrong_sum", 2, {"parallel.pp=2", "parallel.layers_per_stage=[1,2]"}, false},
      {"batch_not_dividing", 2, {"train.global_batch_size=7"}, false},
      {"sequence_beyond_positions", 1, {"data.seq_length=512"}, false},
      {"bf16_on_cpu", 1, {"model.dtype=bf16"}, false},
      {"fp32_on_cuda", 1, {"device=cuda", "model.dtype=fp32"}, false},
      {"tied_embeddings", 2, {"model.config.tie_word_embeddings=true", "parallel.tp=2"}, true},
      {"tied_embeddings_pp2", 2, {"model.config.tie_word_embeddings=true", "parallel.pp=2"}, false},
      // Qwen3-MoE's FFN widths: tp must divide moe_intermediate_size (24) and the dense layers' width.
      {"tp_not_dividing_moe_width", 4,
       {"model.config.architectures=[Qwen3MoeForCausalLM]", "model.config.model_type=qwen3_moe",
        "model.config.moe_intermediate_size=6", "parallel.tp=4"},
       false},
  };
  for (const LayoutCase& c : cases) {
    SCOPED_TRACE(c.name);
    std::string cmd = std::string(MOETRON_BINARY) + " plan -c " + cfg.string() + " --world-size " +
                      std::to_string(c.world);
    for (const std::string& o : c.overrides) cmd += " " + o;
    const fs::path plan_log = root / (std::string(c.name) + ".plan.log");
    const int plan_rc = std::system((cmd + " > " + plan_log.string() + " 2>&1").c_str());
    std::vector<std::string> o = c.overrides;
    o.insert(o.end(), {"run_dir=" + (root / c.name).string(), "train.max_steps=1", "eval.every_steps=0"});
    const fs::path train_log = root / (std::string(c.name) + ".train.log");
    const int train_rc = testing::run_train(c.world > 1 ? c.world : 0, cfg, o, train_log);
    EXPECT_EQ(plan_rc == 0, c.valid) << read_file(plan_log);
    EXPECT_EQ(train_rc == 0, c.valid) << read_file(train_log);
    if (!c.valid) {
      EXPECT_EQ(train_rc, 2) << "a layout error is a setup error: " << read_file(train_log);
      const std::string a = reason(read_file(plan_log)), b = reason(read_file(train_log));
      EXPECT_FALSE(a.empty()) << read_file(plan_log);
      EXPECT_EQ(a, b) << "plan and train give the same reason";
    }
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace moetron
