// The Comm interface, the process grid and tensor-parallel parameter shards.
//
// CommChild.* are the MPI tests proper: CommOverMpi.* runs this program under `mpirun -np 3` and
// `-np 4` with MOETRON_COMM_CHILD=1, where CommChild.* check every collective on every rank against
// values computed locally (sums in rank order, bitwise), the bytes each call reports, and the
// grid's groups.  Every rank makes the same calls in the same order, failures included (EXPECT
// only), so a failing check never leaves a peer waiting.
#include <dlfcn.h>

#include <cstring>
#include <numeric>
#include <set>

#include "core/dynlib.h"
#include "core/error.h"
#include "dist/comm.h"
#include "dist/grid.h"
#include "dist/tp_ops.h"
#include "model/params.h"
#include "model/weights.h"
#include "ops/cross_entropy.h"
#include "proc_maps.h"
#include "test_dist_harness.h"

using namespace moetron;
using namespace moetron::testing;
using dist::CommDType;
using dist::ReduceOp;

namespace {

bool is_child() {
  const char* v = std::getenv("MOETRON_COMM_CHILD");
  return v != nullptr && std::string(v) == "1";
}

// A value whose sum over ranks depends on the order (large and small magnitudes mixed).
float contribution(int rank, size_t i) {
  const float big = (i + rank) % 3 == 0 ? 1.0e7f : 1.0f;
  return big * (float)((int)((i * 2654435761u + rank * 40503u) % 2001) - 1000) / 997.0f;
}

float sum_in_rank_order(int n, size_t i) {
  float acc = contribution(0, i);
  for (int r = 1; r < n; r++) acc = acc + contribution(r, i);
  return acc;
}

// One world per child process (MPI_Init once).
dist::Comm& world() {
  static std::unique_ptr<dist::Comm> w = dist::make_world_comm();
  return *w;
}

class CommChild : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!is_child()) GTEST_SKIP() << "runs under mpirun from CommOverMpi";
  }
};

}  // namespace

TEST_F(CommChild, AllReduceSumsInRankOrderOnEveryPath) {
  dist::Comm& w = world();
  const int n = w.size();
  ASSERT_GE(n, 2);
  // Small (gather-and-sum) and large (reduce-scatter + all-gather) paths, odd sizes.
  for (size_t count : {size_t(1), size_t(7), size_t(3001), size_t(100003)}) {
    std::vector<float> x(count);
    for (size_t i = 0; i < count; i++) x[i] = contribution(w.rank(), i);
    w.all_reduce(x.data(), count);
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) {
      const float want = sum_in_rank_order(n, i);
      bad += std::memcmp(&x[i], &want, 4) != 0;
    }
    EXPECT_EQ(bad, 0u) << "count " << count;
  }
  // Max / min, other types.
  double d[2] = {(double)w.rank(), -(double)w.rank()};
  w.all_reduce(d, 2, ReduceOp::max);
  EXPECT_EQ(d[0], n - 1);
  EXPECT_EQ(d[1], 0);
  int64_t k[3] = {w.rank(), 10, int64_t(1) << 40};
  w.all_reduce(k, 3, ReduceOp::sum);
  EXPECT_EQ(k[0], (int64_t)n * (n - 1) / 2);
  EXPECT_EQ(k[1], 10 * n);
  EXPECT_EQ(k[2], n * (int64_t(1) << 40));
  EXPECT_EQ(w.all_reduce_value((int32_t)(w.rank() + 5), ReduceOp::min), 5);
}

TEST_F(CommChild, ReduceScatterAndAllGatherWithUnevenAndEmptyBlocks) {
  dist::Comm& w = world();
  const int n = w.size(), me = w.rank();
  // Block r has counts[r] elements; rank 1's is empty; the largest spans several rounds.
  std::vector<size_t> counts(n);
  for (int r = 0; r < n; r++) counts[r] = r == 1 ? 0 : (size_t(1) << 20) + 1000 * r + 17;
  std::vector<size_t> displ(n + 1, 0);
  for (int r = 0; r < n; r++) displ[r + 1] = displ[r] + counts[r];
  std::vector<float> in(displ[n]);
  for (size_t i = 0; i < in.size(); i++) in[i] = contribution(me, i);
  std::vector<float> out(counts[me] + 1, -1.0f);
  const uint64_t before = w.stats().bytes_sent;
  w.reduce_scatter(out.data(), in.data(), counts, CommDType::f32, ReduceOp::sum);
  EXPECT_EQ(w.stats().bytes_sent - before, (displ[n] - counts[me]) * 4) << "reduce-scatter sends the other blocks";
  size_t bad = 0;
  for (size_t i = 0; i < counts[me]; i++) {
    const float want = sum_in_rank_order(n, displ[me] + i);
    bad += std::memcmp(&out[i], &want, 4) != 0;
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(out[counts[me]], -1.0f) << "wrote past its block";
  // In place: out aliases this rank's block of in.
  std::vector<float> in2 = in;
  w.reduce_scatter(in2.data() + displ[me], in2.data(), counts, CommDType::f32, ReduceOp::sum);
  EXPECT_EQ(std::memcmp(in2.data() + displ[me], out.data(), counts[me] * 4), 0);

  // All-gather each rank's reduced block back: everyone ends with the whole reduced array.
  std::vector<float> all(displ[n], 0.0f);
  const uint64_t b2 = w.stats().bytes_sent;
  w.all_gather(all.data(), out.data(), counts, CommDType::f32);
  uint64_t want_bytes = 0;  // ring: every block but the next rank's
  for (int r = 0; r < n; r++)
    if (r != (me + 1) % n) want_bytes += counts[r] * 4;
  EXPECT_EQ(w.stats().bytes_sent - b2, want_bytes);
  bad = 0;
  for (size_t i = 0; i < all.size(); i++) {
    const float want = sum_in_rank_order(n, i);
    bad += std::memcmp(&all[i], &want, 4) != 0;
  }
  EXPECT_EQ(bad, 0u);
  // In place (in aliases its block of out).
  std::vector<float> all2(displ[n], 0.0f);
  std::copy(out.begin(), out.begin() + counts[me], all2.begin() + displ[me]);
  w.all_gather(all2.data(), all2.data() + displ[me], counts, CommDType::f32);
  EXPECT_EQ(all2, all);
}

TEST_F(CommChild, AllReduceOfALargeBufferSendsTheRingVolume) {
  dist::Comm& w = world();
  const int n = w.size();
  const size_t count = 1 << 18;
  std::vector<float> x(count, 1.0f);
  const uint64_t before = w.stats().bytes_sent;
  w.all_reduce(x.data(), count);
  // 2 (n-1)/n S, up to the uneven split of count over n ranks.
  const double want = 2.0 * (n - 1) / n * count * 4;
  EXPECT_NEAR((double)(w.stats().bytes_sent - before), want, 8.0 * n);
  EXPECT_EQ(x[0], (float)n);
  EXPECT_EQ(x[count - 1], (float)n);
}

TEST_F(CommChild, AllToAllVSendRecvBroadcastAndSplit) {
  dist::Comm& w = world();
  const int n = w.size(), me = w.rank();
  // Rank r sends (r + p) % 3 values r*100 + p to peer p (zero counts included).
  std::vector<size_t> sc(n), rc(n);
  std::vector<int32_t> in, want;
  for (int p = 0; p < n; p++) {
    sc[p] = (me + p) % 3;
    rc[p] = (p + me) % 3;
    for (size_t j = 0; j < sc[p]; j++) in.push_back(me * 100 + p);
    for (size_t j = 0; j < rc[p]; j++) want.push_back(p * 100 + me);
  }
  std::vector<int32_t> out(want.size(), -1);
  w.all_to_all_v(out.data(), rc, in.data(), sc, CommDType::i32);
  EXPECT_EQ(out, want);

  // A ring of send/recv (even ranks send first).
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<double> msg(1000, me + 0.5), got(1000, 0);
  if (me % 2 == 0) {
    w.send(msg.data(), msg.size(), CommDType::f64, next, 5);
    w.recv(got.data(), got.size(), CommDType::f64, prev, 5);
  } else {
    w.recv(got.data(), got.size(), CommDType::f64, prev, 5);
    w.send(msg.data(), msg.size(), CommDType::f64, next, 5);
  }
  EXPECT_EQ(got[999], prev + 0.5);

  // sendrecv: every rank sends to next and receives from prev at once (no ordering by parity), with
  // a message large enough for a rendezvous protocol; then the reverse direction, and the ends of an
  // open chain (rank 0 receives nothing, the last rank sends nothing).
  {
    std::vector<float> big(300000, (float)me), from_prev(big.size(), -1.0f);
    const uint64_t before = w.stats().bytes_sent;
    w.sendrecv(big.data(), big.size(), next, from_prev.data(), from_prev.size(), prev, CommDType::f32, 20);
    EXPECT_EQ(w.stats().bytes_sent - before, big.size() * 4);
    EXPECT_EQ(from_prev.front(), (float)prev);
    EXPECT_EQ(from_prev.back(), (float)prev);
    std::vector<int64_t> down = {me * 10, me * 10 + 1}, from_next(2, -1);
    w.sendrecv(down.data(), 2, prev, from_next.data(), 2, next, CommDType::i64, 21);
    EXPECT_EQ(from_next, (std::vector<int64_t>{next * 10, next * 10 + 1}));
    std::vector<double> chain = {me + 0.25}, in_chain = {-1.0};
    w.sendrecv(chain.data(), 1, me + 1 < n ? me + 1 : -1, in_chain.data(), 1, me > 0 ? me - 1 : -1, CommDType::f64, 22);
    EXPECT_EQ(in_chain[0], me > 0 ? me - 1 + 0.25 : -1.0);
  }

  std::string s = me == 1 ? "from rank one" : "";
  w.broadcast_string(s, 1);
  EXPECT_EQ(s, "from rank one");

  // Groups by parity, ordered by descending world rank.
  std::unique_ptr<dist::Comm> g = w.split(me % 2, -me, "parity");
  EXPECT_EQ(g->size(), (n - me % 2 + 1) / 2);
  const int32_t sum = g->all_reduce_value((int32_t)me);
  int32_t want_sum = 0;
  for (int r = me % 2; r < n; r += 2) want_sum += r;
  EXPECT_EQ(sum, want_sum);
  int above = 0;  // members with a larger world rank come first
  for (int r = me % 2; r < n; r += 2) above += r > me;
  EXPECT_EQ(g->rank(), above);
  w.barrier();
}

TEST_F(CommChild, ProcessGridGroups) {
  dist::Comm& w = world();
  if (w.size() != 4) GTEST_SKIP() << "the grid test needs 4 ranks";
  dist::ProcessGrid g(w, 2, 1, 1);  // tp 2 x dp 2
  EXPECT_EQ(g.shape().dp, 2);
  EXPECT_EQ(g.coord().tp, w.rank() % 2);
  EXPECT_EQ(g.coord().dp, w.rank() / 2);
  // Members of each group, as world ranks.
  auto members = [&](dist::Comm& c) {
    std::vector<int32_t> all(c.size());
    int32_t me = w.rank();
    c.all_gather(all.data(), &me, std::vector<size_t>(c.size(), 1), CommDType::i32);
    return all;
  };
  const int r = w.rank();
  EXPECT_EQ(members(g.tp()), (std::vector<int32_t>{r / 2 * 2, r / 2 * 2 + 1}));
  EXPECT_EQ(members(g.dp()), (std::vector<int32_t>{r % 2, r % 2 + 2}));
  EXPECT_EQ(members(g.pp()), (std::vector<int32_t>{r}));
  dist::ProcessGrid e(w, 1, 1, 2);  // dp 4, ep 2: expert groups {0,1}, {2,3}; expert-dp {0,2}, {1,3}
  EXPECT_EQ(members(e.ep()), (std::vector<int32_t>{r / 2 * 2, r / 2 * 2 + 1}));
  EXPECT_EQ(members(e.edp()), (std::vector<int32_t>{r % 2, r % 2 + 2}));
}

TEST_F(CommChild, VocabParallelCrossEntropyMatchesTheWholeVocabulary) {
  dist::Comm& w = world();
  const int n = w.size(), me = w.rank();
  const long N = 5;
  const int V = 37;  // not divisible by n: the larger parts first
  std::vector<float> logits(N * V);
  for (size_t i = 0; i < logits.size(); i++) logits[i] = 3.0f * contribution(0, i) / 1.0e7f + (float)(i % 7);
  std::vector<int32_t> targets = {0, 36, ops::IGNORE_INDEX, 18, 5};
  std::vector<float> lse(N), dl(N * V);
  const double want = ops::cross_entropy_forward(lse.data(), logits.data(), targets.data(), N, V, 0.5f);
  ops::cross_entropy_backward(dl.data(), logits.data(), lse.data(), targets.data(), N, V, 0.5f);
  const auto [v0, v1] = shard_range(V, n, me);
  const int64_t Vr = v1 - v0;
  std::vector<float> mine(N * Vr), lse_r(N), dmine(N * Vr);
  for (long t = 0; t < N; t++) std::copy(&logits[t * V + v0], &logits[t * V + v1], &mine[t * Vr]);
  const double got = dist::cross_entropy_forward_vocab_parallel(lse_r.data(), mine.data(), targets.data(), N, Vr, v0,
                                                                0.5f, w);
  EXPECT_NEAR(got, want, 1e-12 * std::fabs(want));
  dist::cross_entropy_backward_vocab_parallel(dmine.data(), mine.data(), lse_r.data(), targets.data(), N, Vr, v0, 0.5f);
  for (long t = 0; t < N; t++)
    for (int64_t v = 0; v < Vr; v++) EXPECT_NEAR(dmine[t * Vr + v], dl[t * V + v0 + v], 1e-7) << t << "," << v;
}

// ---- the parent tests: launch the children -----------------------------------------------------

TEST(CommOverMpi, CollectivesOnThreeAndFourRanks) {
  if (is_child()) GTEST_SKIP();
  if (!mpi_available()) GTEST_SKIP() << "built without MPI or no mpirun";
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const fs::path log = fs::temp_directory_path() / ("moetron_comm_" + std::to_string(::getpid()) + ".log");
  for (int np : {3, 4}) {
    setenv("MOETRON_COMM_CHILD", "1", 1);
    const int code =
        wait_status(spawn({"mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np",
                           std::to_string(np), self, "--gtest_filter=CommChild.*", "--gtest_color=no"},
                          log));
    unsetenv("MOETRON_COMM_CHILD");
    const std::string out = read_file(log);
    EXPECT_EQ(code, 0) << np << " ranks:\n" << out;
    EXPECT_EQ(out.find("FAILED"), std::string::npos) << out;
    size_t passed = 0;  // one summary per rank
    for (size_t p = out.find("[  PASSED  ]"); p != std::string::npos; p = out.find("[  PASSED  ]", p + 1)) passed++;
    EXPECT_EQ(passed, (size_t)np) << out;
    EXPECT_EQ(out.find("[  SKIPPED ]"), np == 4 ? std::string::npos : out.find("[  SKIPPED ]")) << out;
  }
  fs::remove(log);
}

// ---- without MPI ----------------------------------------------------------------------------------

// libmpi (and Open MPI's stack under it) is loaded by a launched process only: not linked, not
// loaded for a process of its own (ctest runs each test in a fresh process).
TEST(MpiLibrary, IsLoadedOnlyWhenAProcessIsLaunched) {
  if (!dist::have_mpi()) GTEST_SKIP() << "built without MPI";
  if (dist::detect_launch().launched) GTEST_SKIP() << "run under a launcher";
  EXPECT_FALSE(library_mapped("libmpi.so")) << "libmpi mapped before any MPI use";
  {
    auto world = dist::make_world_comm();
    EXPECT_STREQ(world->transport(), "self");
  }
  EXPECT_FALSE(library_mapped("libmpi.so")) << "a process without a launcher loaded libmpi";
  const std::string path = dist::mpi_library();
  EXPECT_FALSE(path.empty());
  EXPECT_TRUE(library_mapped("libmpi.so")) << "mpi_library() reported " << path << " but nothing is mapped";
}

TEST(DynLib, AFailedLoadNamesEveryCandidateAndAMissingSymbolItsName) {
  std::string loaded;
  try {
    dlopen_first({"/nonexistent/libmoetron-a.so", "libmoetron-b.so.9"}, RTLD_NOW, "probe", "a hint", &loaded);
    FAIL() << "loaded " << loaded;
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("[probe] cannot load the library (a hint)"), std::string::npos) << m;
    EXPECT_NE(m.find("libmoetron-a.so"), std::string::npos) << m;
    EXPECT_NE(m.find("libmoetron-b.so.9"), std::string::npos) << m;
  }
  void* h = dlopen_first({"/nonexistent/libx.so", "libm.so.6"}, RTLD_NOW, "probe", "", &loaded);
  EXPECT_EQ(loaded, "libm.so.6");
  EXPECT_NE(dlsym_required(h, "probe", loaded, "cos"), nullptr);
  EXPECT_THROW(
      {
        try {
          dlsym_required(h, "probe", loaded, "moetron_no_such_symbol");
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("libm.so.6 has no symbol moetron_no_such_symbol"), std::string::npos);
          throw;
        }
      },
      Error);
}

TEST(SelfComm, IsAGroupOfOne) {
  dist::SelfComm c;
  std::vector<float> x = {1, 2, 3}, y(3);
  c.all_reduce(x.data(), 3);
  EXPECT_EQ(x, (std::vector<float>{1, 2, 3}));
  c.reduce_scatter(y.data(), x.data(), {3}, CommDType::f32, ReduceOp::sum);
  EXPECT_EQ(y, x);
  EXPECT_THROW(c.reduce_scatter(y.data(), x.data(), {1, 2}, CommDType::f32, ReduceOp::sum), Error);
  EXPECT_THROW(c.send(x.data(), 3, CommDType::f32, 1, 0), Error);
  EXPECT_THROW(c.sendrecv(x.data(), 3, 0, y.data(), 3, -1, CommDType::f32, 0), Error);
  c.sendrecv(x.data(), 3, -1, y.data(), 3, -1, CommDType::f32, 0);  // neither half: nothing to do
  EXPECT_EQ(c.split(0, 0, "x")->size(), 1);
  EXPECT_EQ(c.stats().bytes_sent, 0u);
}

TEST(ProcessGrid, RankOrderIsTpThenDpThenPp) {
  const dist::GridShape s = dist::grid_shape(16, 2, 2, 2);
  EXPECT_EQ(s.dp, 4);
  std::set<int> seen;
  for (int r = 0; r < 16; r++) {
    const dist::GridCoord c = dist::grid_coord(s, r);
    EXPECT_EQ(dist::grid_rank(s, c), r);
    EXPECT_EQ(c.tp, r % 2);
    EXPECT_EQ(c.dp, (r / 2) % 4);
    EXPECT_EQ(c.pp, r / 8);
    EXPECT_EQ(c.dp, c.edp * 2 + c.ep);
    seen.insert(r);
  }
  EXPECT_EQ(seen.size(), 16u);
  EXPECT_THROW(dist::grid_shape(6, 4, 1, 1), Error);   // world % (tp * pp)
  EXPECT_THROW(dist::grid_shape(8, 2, 1, 3), Error);   // ep does not divide dp
  EXPECT_THROW(dist::grid_shape(8, 0, 1, 1), Error);
  dist::SelfComm w;
  const dist::ProcessGrid g(w, 1, 1, 1);
  EXPECT_EQ(g.tp().size(), 1);
  EXPECT_EQ(g.dp().size(), 1);
}

TEST(LaunchDetection, ReadsTheLaunchersEnvironment) {
  if (is_child()) GTEST_SKIP();
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "PMIX_RANK",
                        "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_ID"})
    unsetenv(v);
  EXPECT_FALSE(dist::detect_launch().launched);
  setenv("SLURM_STEP_NUM_TASKS", "1", 1);  // one srun task: no MPI needed
  setenv("SLURM_PROCID", "0", 1);
  EXPECT_FALSE(dist::detect_launch().launched);
  setenv("SLURM_STEP_NUM_TASKS", "4", 1);
  setenv("SLURM_PROCID", "3", 1);
  dist::LaunchInfo li = dist::detect_launch();
  EXPECT_TRUE(li.launched);
  EXPECT_EQ(li.world_size, 4);
  EXPECT_EQ(li.world_rank, 3);
  EXPECT_EQ(li.launcher, "srun");
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  li = dist::detect_launch();
  EXPECT_EQ(li.launcher, "mpirun");
  EXPECT_EQ(li.world_size, 2);
  EXPECT_EQ(li.evidence, "OMPI_COMM_WORLD_SIZE=2");
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"})
    unsetenv(v);
}

// ---- tensor-parallel parameter shards -------------------------------------------------------------

namespace {

ModelConfig gqa_mixtral() {
  ModelConfig c;
  c.architecture = "MixtralForCausalLM";
  c.model_type = "mixtral";
  c.vocab_size = 50;  // not divisible by 4
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.num_local_experts = 3;
  c.num_experts_per_tok = 2;
  c.initializer_range = 0.02;
  return c;
}

}  // namespace

TEST(ParamShard, SlicesAgreeWithTheWeightShardsAndRoundTrip) {
  const ModelConfig cfg = gqa_mixtral();
  const ParamTable whole(cfg);
  std::vector<float> w(whole.total());
  init_parameters(whole, cfg, 3, w.data());
  for (int tp : {1, 2, 4}) {
    std::vector<float> back(whole.total(), 0.0f);
    size_t numel = 0;
    for (int r = 0; r < tp; r++) {
      ParamShard sh;
      sh.tp_rank = r;
      sh.tp_size = tp;
      const ParamTable t(cfg, sh);
      EXPECT_EQ(t.is_whole(), tp == 1);
      // The same slices as the loader's description of this shard (model/weights.h).
      WeightShard ws;
      ws.tp_rank = r;
      ws.tp_size = tp;
      const std::vector<HfTensorSlice> slices = shard_slices(cfg, whole, ws);
      ASSERT_EQ(slices.size(), t.hf_tensors().size());
      for (size_t i = 0; i < slices.size(); i++) {
        const HfTensorRef& mine = t.hf_tensors()[i];
        EXPECT_EQ(mine.name, slices[i].ref->name);
        EXPECT_EQ(mine.slice_dim, slices[i].dim) << mine.name;
        if (mine.slice_dim >= 0) {
          EXPECT_EQ(mine.slice_begin, slices[i].begin) << mine.name;
          EXPECT_EQ(mine.slice_end, slices[i].end) << mine.name;
        }
        EXPECT_EQ(mine.shape, slices[i].shape()) << mine.name;
        const ParamSpec& spec = t.spec_of(mine);
        if (spec.tp_primary) numel += mine.numel;
      }
      // Initialising the shard alone gives the whole model's values there.
      std::vector<float> s(t.total(), 0.0f), from_whole(t.total(), 0.0f);
      init_parameters(t, cfg, 3, s.data());
      copy_from_whole(whole, w.data(), t, from_whole.data());
      EXPECT_EQ(s, from_whole) << "tp " << tp << " rank " << r;
      copy_to_whole(t, s.data(), whole, back.data());
      // Replicated tensors: only rank 0 (or the first rank sharing a kv head) is primary.
      for (const ParamSpec& spec : t.specs()) {
        if (spec.kind == ParamKind::input_norm || spec.kind == ParamKind::router) {
          EXPECT_EQ(spec.tp_primary, r == 0);
        }
        if (spec.kind == ParamKind::k_proj) {
          EXPECT_EQ(spec.tp_primary, tp <= 2 || r % 2 == 0);
        }
      }
    }
    EXPECT_EQ(back, w) << "tp " << tp;
    size_t whole_numel = 0;
    for (const HfTensorRef& t : whole.hf_tensors()) whole_numel += t.numel;
    EXPECT_EQ(numel, whole_numel) << "primary copies cover the model exactly once, tp " << tp;
  }
}

TEST(ParamShard, RejectsLayoutsThatDoNotFit) {
  const ModelConfig cfg = gqa_mixtral();
  ParamShard sh;
  sh.tp_size = 3;  // 4 heads
  EXPECT_THROW(ParamTable(cfg, sh), Error);
  sh.tp_size = 2;
  sh.tp_rank = 2;
  EXPECT_THROW(ParamTable(cfg, sh), Error);
  sh.tp_rank = 0;
  sh.expert_begin = 2;
  sh.expert_end = 5;
  EXPECT_THROW(ParamTable(cfg, sh), Error);
}
