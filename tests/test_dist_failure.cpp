// A rank that dies or fails ends the whole distributed job promptly, never a hang (DESIGN §6):
//   - SIGKILL of one of 4 ranks under plain mpirun: every rank is gone and mpirun exits non-zero
//     within 60 s (the launcher ends the job);
//   - the same under mpirun with fault tolerance on (orte_enable_recovery: the launcher lets the
//     others run on): moetron's heartbeat watchdog notices the silent rank, names it, and every
//     other rank exits non-zero;
//   - an error on one rank (--debug-fail) with the launcher's help off and the silence check off:
//     the failing rank's abort tells every other rank, and all exit non-zero within seconds, the
//     message naming the failing rank.
// Each rank runs under `sh -c 'moetron ...; echo $? > exit-RANK'` where its own exit status is
// checked.  And the orderly stop: SIGTERM to one rank (Slurm signals the step's processes at
// preemption or the time limit) stops every rank after the same step with a checkpoint.
#include <chrono>
#include <set>

#include "test_dist_harness.h"

using namespace moetron;
using namespace moetron::testing;
using Clock = std::chrono::steady_clock;

namespace {

class DistFailure : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!mpi_available()) GTEST_SKIP() << "built without MPI or no mpirun";
    root_ = fs::temp_directory_path() / ("moetron_distfail_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "data");
    write_dist_split(root_ / "data", "train", 60, 1);
    std::ofstream(root_ / "cfg.yaml") << dist_yaml(root_ / "run", root_ / "data");
  }
  void TearDown() override {
    if (!root_.empty()) fs::remove_all(root_);
  }

  // mpirun -np 4 [extra] sh -c 'moetron train ... ; echo $? > ROOT/exit-$OMPI_COMM_WORLD_RANK'
  pid_t start(const std::vector<std::string>& mpirun_extra, const std::vector<std::string>& train_extra) {
    std::vector<std::string> a = {"mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "4"};
    a.insert(a.end(), mpirun_extra.begin(), mpirun_extra.end());
    std::string cmd = std::string(MOETRON_BINARY) + " train -c " + (root_ / "cfg.yaml").string() +
                      " train.max_steps=100000 checkpoint.every_steps=0 eval.every_steps=0";
    for (const std::string& t : train_extra) cmd += " " + t;
    cmd += "; echo $? > " + (root_ / "exit-").string() + "$OMPI_COMM_WORLD_RANK";
    // The wrapper outlives the launcher's SIGTERM long enough to record the status.
    a.insert(a.end(), {"sh", "-c", "trap '' TERM HUP; " + cmd});
    return spawn(a, root_ / "out.log");
  }
  // Waits until `lines` steps are logged (or 60 s).
  void wait_for_steps(int lines) {
    for (int i = 0; i < 3000; i++) {
      if ((int)read_metrics(root_ / "run", "loss").size() >= lines) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    FAIL() << "no training progress:\n" << read_file(root_ / "out.log");
  }
  // This test's moetron rank processes (their command line names this test's config): world rank
  // -> pid (from their environment).
  std::map<int, pid_t> rank_pids() const {
    std::map<int, pid_t> out;
    for (const auto& e : fs::directory_iterator("/proc")) {
      const std::string name = e.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      const std::string cmd = read_file(e.path() / "cmdline");
      if (cmd.rfind(MOETRON_BINARY, 0) != 0 || cmd.find((root_ / "cfg.yaml").string()) == std::string::npos) continue;
      const std::string env = read_file(e.path() / "environ");
      const std::string key = "OMPI_COMM_WORLD_RANK=";
      size_t p = env.find(key);
      if (p == std::string::npos) continue;
      out[std::atoi(env.c_str() + p + key.size())] = (pid_t)std::stol(name);
    }
    return out;
  }
  static bool alive(pid_t pid) {
    const std::string stat = read_file(fs::path("/proc") / std::to_string(pid) / "stat");
    if (stat.empty()) return false;
    const size_t close = stat.rfind(')');
    return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
  }
  // Waits for mpirun (at most 60 s); returns its exit status (-1 when it did not end).
  static int wait_mpirun(pid_t pid, double* seconds) {
    const auto t0 = Clock::now();
    while (Clock::now() - t0 < std::chrono::seconds(60)) {
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        *seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        return exit_status(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    *seconds = 60;
    return -1;
  }
  // Each rank's exit status as its wrapper recorded it (-1: none recorded).
  std::vector<int> rank_exits() const {
    std::vector<int> out;
    for (int r = 0; r < 4; r++) {
      const std::string s = read_file(root_ / ("exit-" + std::to_string(r)));
      out.push_back(s.empty() ? -1 : std::atoi(s.c_str()));
    }
    return out;
  }

  fs::path root_;
};

}  // namespace

TEST_F(DistFailure, KilledRankEndsTheJobUnderMpirun) {
  const pid_t mpirun = start({}, {});
  wait_for_steps(2);
  const auto ranks = rank_pids();
  ASSERT_EQ(ranks.size(), 4u) << read_file(root_ / "out.log");
  ASSERT_EQ(kill(ranks.at(2), SIGKILL), 0);
  double seconds = 0;
  const int code = wait_mpirun(mpirun, &seconds);
  EXPECT_NE(code, 0) << read_file(root_ / "out.log");
  EXPECT_NE(code, -1) << "mpirun still running 60 s after the kill";
  EXPECT_LT(seconds, 60.0);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  for (const auto& [r, pid] : ranks) EXPECT_FALSE(alive(pid)) << "rank " << r << " survived";
}

TEST_F(DistFailure, HeartbeatCatchesAVanishedRankTheLauncherIgnores) {
  setenv("MOETRON_HEARTBEAT_TIMEOUT_S", "5", 1);
  const pid_t mpirun = start({"--mca", "orte_enable_recovery", "1"}, {});
  unsetenv("MOETRON_HEARTBEAT_TIMEOUT_S");
  wait_for_steps(2);
  const auto ranks = rank_pids();
  ASSERT_EQ(ranks.size(), 4u) << read_file(root_ / "out.log");
  const auto t0 = Clock::now();
  ASSERT_EQ(kill(ranks.at(2), SIGKILL), 0);
  double seconds = 0;
  wait_mpirun(mpirun, &seconds);
  const double total = std::chrono::duration<double>(Clock::now() - t0).count();
  for (const auto& [r, pid] : ranks) EXPECT_FALSE(alive(pid)) << "rank " << r << " survived";
  EXPECT_LT(total, 60.0);
  const std::vector<int> exits = rank_exits();
  for (int r = 0; r < 4; r++) EXPECT_NE(exits[r], 0) << "rank " << r << " exit status " << exits[r];
  EXPECT_EQ(exits[2], 128 + SIGKILL);
  const std::string log = read_file(root_ / "out.log");
  EXPECT_NE(log.find("rank 3: no heartbeat from rank 2"), std::string::npos) << log;
}

TEST_F(DistFailure, ErrorOnOneRankEndsEveryRank) {
  // The launcher's fault tolerance on and the silence check off: only moetron's abort message can
  // end the other ranks, which wait for the failed one in a collective.
  setenv("MOETRON_HEARTBEAT_TIMEOUT_S", "0", 1);
  const auto t0 = Clock::now();
  const pid_t mpirun = start({"--mca", "orte_enable_recovery", "1"}, {"--debug-fail", "1:3"});
  unsetenv("MOETRON_HEARTBEAT_TIMEOUT_S");
  double seconds = 0;
  wait_mpirun(mpirun, &seconds);
  const double total = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_LT(total, 60.0);
  const std::vector<int> exits = rank_exits();
  for (int r = 0; r < 4; r++) EXPECT_NE(exits[r], 0) << "rank " << r << " exit status " << exits[r];
  for (int r = 0; r < 4; r++) EXPECT_NE(exits[r], -1) << "rank " << r << " did not exit";
  const std::string log = read_file(root_ / "out.log");
  EXPECT_NE(log.find("rank 1 of 4: error: --debug-fail: failure injected on rank 1 at step 3"), std::string::npos)
      << log;
  EXPECT_NE(log.find("rank 1 failed"), std::string::npos) << log;
}

TEST_F(DistFailure, SigtermToAnyRankStopsEveryRankAfterTheSameStepWithACheckpoint) {
  // Slurm's preemption / time-limit SIGTERM goes to the step's processes themselves (mpirun does not
  // forward SIGTERM: it aborts the job, SIGKILL after odls_base_sigkill_timeout).  One rank, not
  // rank 0, gets it here: the others learn of it in the per-step all-reduce and stop after the same
  // step, rank 0 saves the checkpoint, and every rank exits 0.
  const pid_t mpirun = start({}, {});
  wait_for_steps(2);
  const auto ranks = rank_pids();
  ASSERT_EQ(ranks.size(), 4u) << read_file(root_ / "out.log");
  ASSERT_EQ(kill(ranks.at(3), SIGTERM), 0);
  double seconds = 0;
  const int code = wait_mpirun(mpirun, &seconds);
  EXPECT_LT(seconds, 60.0);
  const std::string log = read_file(root_ / "out.log");
  EXPECT_EQ(code, 0) << log;
  const std::vector<int> exits = rank_exits();
  for (int r = 0; r < 4; r++) EXPECT_EQ(exits[r], 0) << "rank " << r << " exit status " << exits[r] << "\n" << log;
  EXPECT_NE(log.find("received signal 15: stopped after step"), std::string::npos) << log;
  const std::string latest = read_file(root_ / "run" / "checkpoints" / "latest");
  ASSERT_FALSE(latest.empty()) << log;
  const long step = std::stol(latest.substr(5));
  EXPECT_TRUE(fs::exists(root_ / "run" / "checkpoints" / latest.substr(0, latest.size() - 1) / "trainer_state.json"));
  EXPECT_EQ((long)read_metrics(root_ / "run", "loss").size(), step) << "every rank stopped after step " << step;
  EXPECT_NE(log.find("received signal 15: stopped after step " + std::to_string(step) + " with a checkpoint"),
            std::string::npos)
      << log;
}
