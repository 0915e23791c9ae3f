// The NCCL transport (CUDA builds with NCCL): every Comm call on device buffers, on one rank
// bootstrapped through MPI (`mpirun -np 1`; multi-GPU runs need a machine with several GPUs).
// Skipped in builds without NCCL and on machines without a GPU.
#include "core/error.h"
#include "dist/nccl_comm.h"
#include "proc_maps.h"
#include "test_dist_harness.h"

#ifdef MOETRON_HAVE_NCCL
#include <cuda_runtime.h>
#endif

using namespace moetron;
using namespace moetron::testing;
using dist::CommDType;
using dist::ReduceOp;

namespace {

[[maybe_unused]] bool is_child() {
  const char* v = std::getenv("MOETRON_NCCL_CHILD");
  return v != nullptr && std::string(v) == "1";
}

[[maybe_unused]] bool have_gpu() {
#ifdef MOETRON_HAVE_NCCL
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

}  // namespace

// libnccl is loaded at the first NCCL communicator, not linked: a process that never makes one
// (every CPU command) does not map it.  Loading it needs no GPU.
TEST(NcclLibrary, IsLoadedOnlyWhenAsked) {
  if (!dist::have_nccl()) GTEST_SKIP() << "built without NCCL";
  EXPECT_FALSE(library_mapped("libnccl")) << "libnccl mapped before any NCCL use";
  const std::string info = dist::nccl_library();
  EXPECT_NE(info.find("version code"), std::string::npos) << info;
  EXPECT_TRUE(library_mapped("libnccl")) << info;
}

TEST(NcclComm, ReportsWhenItIsNotBuilt) {
  if (dist::have_nccl()) GTEST_SKIP() << "built with NCCL";
  dist::SelfComm w;
  EXPECT_THROW(dist::make_nccl_comm(w), Error);
}

#ifdef MOETRON_HAVE_NCCL

namespace {

struct Dev {
  float* p = nullptr;
  explicit Dev(const std::vector<float>& v) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(1, v.size()) * 4), cudaSuccess);
    if (!v.empty()) {
      EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~Dev() { cudaFree(p); }
  std::vector<float> get(size_t n) const {
    std::vector<float> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

}  // namespace

TEST(NcclChild, EveryCallOnDeviceBuffers) {
  if (!is_child()) GTEST_SKIP() << "runs under mpirun from NcclComm.OneRankOverMpi";
  std::unique_ptr<dist::Comm> world = dist::make_world_comm();
  ASSERT_EQ(world->size(), 1);
  std::unique_ptr<dist::Comm> c = dist::make_nccl_comm(*world);
  EXPECT_STREQ(c->transport(), "nccl");
  const std::vector<float> v = {1, -2, 3.5f, 4, 5};
  Dev a(v);
  c->all_reduce(a.p, 5, CommDType::f32, ReduceOp::sum);
  EXPECT_EQ(a.get(5), v);
  c->all_reduce(a.p, 5, CommDType::f32, ReduceOp::max);
  EXPECT_EQ(a.get(5), v);
  Dev out(std::vector<float>(5, 0));
  c->reduce_scatter(out.p, a.p, {5}, CommDType::f32, ReduceOp::sum);
  EXPECT_EQ(out.get(5), v);
  Dev g(std::vector<float>(5, 0));
  c->all_gather(g.p, a.p, {5}, CommDType::f32);
  EXPECT_EQ(g.get(5), v);
  Dev t(std::vector<float>(5, 0));
  c->all_to_all_v(t.p, {5}, a.p, {5}, CommDType::f32);
  EXPECT_EQ(t.get(5), v);
  c->broadcast(a.p, 5, CommDType::f32, 0);
  EXPECT_EQ(a.get(5), v);
  c->barrier();
  std::unique_ptr<dist::Comm> s = c->split(0, 0, "sub");
  EXPECT_EQ(s->size(), 1);
  s->all_reduce(a.p, 5, CommDType::f32, ReduceOp::sum);
  EXPECT_EQ(a.get(5), v);
}

TEST(NcclComm, OneRankOverMpi) {
  if (is_child()) GTEST_SKIP();
  if (!mpi_available()) GTEST_SKIP() << "no mpirun";
  if (!have_gpu()) GTEST_SKIP() << "no GPU on this machine";
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const fs::path log = fs::temp_directory_path() / ("moetron_nccl_" + std::to_string(::getpid()) + ".log");
  setenv("MOETRON_NCCL_CHILD", "1", 1);
  const int code = wait_status(spawn({"mpirun", "--allow-run-as-root", "-np", "1", self,
                                      "--gtest_filter=NcclChild.*", "--gtest_color=no"},
                                     log));
  unsetenv("MOETRON_NCCL_CHILD");
  const std::string out = read_file(log);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("[  PASSED  ] 1 test"), std::string::npos) << out;
  fs::remove(log);
}

#endif  // MOETRON_HAVE_NCCL
