// The GPU check without a GPU (scripts/gpu-bundle.sh, scripts/gpu-check.sh): the bundle is made from
// this build, its binaries need no shared library outside it but the C/C++ runtime, and run isolated
// -- in a root holding nothing but that runtime and the bundle -- up to "no usable CUDA device" (exit
// 2); the check's plan keeps every stage's cap and their sum under its deadline for both cards; a run
// without a GPU reports every stage in the two files it promises.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace fs = std::filesystem;

namespace {

const fs::path kSrc = MOETRON_BUILT_SOURCE_DIR;
const fs::path kBuild = fs::path(MOETRON_BUILT_BINARY).parent_path();

struct ShellRun {
  int code = -1;
  std::string out;
};

ShellRun sh(const std::string& cmd) {
  ShellRun r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// The path in single quotes, for a shell command (appended piecewise: GCC 12 warns, wrongly, on
// "'" + string + "'").
std::string q(const fs::path& p) {
  std::string s(1, '\'');
  s.append(p.string());
  s.push_back('\'');
  return s;
}

class GpuBundle : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() / ("moetron_bundle_" + std::to_string(::getpid())));
    fs::remove_all(*dir_);
    fs::create_directories(*dir_);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override {
    if (!fs::exists(kBuild / "libmoetron_cuda.a"))
      GTEST_SKIP() << "this build has no CUDA backend (no nvcc): there is no GPU bundle to make";
  }
  // The bundle of this build (made once per suite).
  static const fs::path& bundle() {
    static const fs::path b = [] {
      const fs::path b = *dir_ / "bundle";
      const ShellRun r = sh("MOETRON_BUNDLE_NO_BUILD=1 BUILD_DIR=" + q(kBuild) + " BUNDLE_DIR=" + q(b) + " bash " +
                       q(kSrc / "scripts" / "gpu-bundle.sh"));
      EXPECT_EQ(r.code, 0) << r.out;
      std::printf("%s", r.out.c_str());
      return b;
    }();
    return b;
  }
  static fs::path* dir_;
};
fs::path* GpuBundle::dir_ = nullptr;

std::vector<std::string> needed(const fs::path& elf) {
  std::vector<std::string> v;
  const ShellRun r = sh("readelf -d " + q(elf));
  const std::regex re(R"(\(NEEDED\).*\[(.*)\])");
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_search(line, m, re)) v.push_back(m[1]);
  }
  return v;
}

const std::regex kRuntime(R"(^(ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s)\.so.*)");

TEST_F(GpuBundle, BinariesNeedNothingOutsideTheBundleButTheRuntime) {
  const fs::path b = bundle();
  ASSERT_TRUE(fs::exists(b / "bin" / "moetron"));
  std::set<std::string> libs;
  uintmax_t bytes = 0;
  for (const auto& e : fs::directory_iterator(b / "lib")) libs.insert(e.path().filename().string());
  for (const char* sub : {"bin", "lib"})
    for (const auto& e : fs::directory_iterator(b / sub)) {
      bytes += fs::file_size(e.path());
      for (const std::string& n : needed(e.path()))
        EXPECT_TRUE(std::regex_match(n, kRuntime) || libs.count(n)) << e.path() << " needs " << n;
      const ShellRun rp = sh("readelf -d " + q(e.path()) + " | grep RUNPATH");
      EXPECT_NE(rp.out.find("$ORIGIN"), std::string::npos) << e.path() << ": " << rp.out;
    }
  EXPECT_TRUE(libs.count("libblas.so.3")) << "the CBLAS the CPU backend loads with dlopen";
  EXPECT_LE(bytes, 50u << 20);
  std::printf("bundle: %zu libraries, %.1f MiB\n", libs.size(), bytes / 1048576.0);
}

// A root with the C/C++ runtime of this machine and the bundle, nothing else: chroot into it.
TEST_F(GpuBundle, RunsIsolatedUpToNoUsableGpu) {
  if (::geteuid() != 0) GTEST_SKIP() << "chroot needs root";
  const fs::path b = bundle();
  const fs::path root = *dir_ / "root";
  fs::create_directories(root / "lib" / "x86_64-linux-gnu");
  fs::create_directories(root / "lib64");
  fs::create_directories(root / "tmp");
  for (const char* lib : {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1"}) {
    const ShellRun where =
        sh(std::string("ldconfig -p | awk '$1 == \"") + lib + "\" && /x86-64/ && !p {p = $NF} END {print p}'");
    ASSERT_EQ(where.code, 0);
    const std::string path = where.out.substr(0, where.out.find('\n'));
    ASSERT_FALSE(path.empty()) << lib;
    fs::copy_file(fs::canonical(path), root / "lib" / "x86_64-linux-gnu" / lib);
  }
  fs::copy_file(fs::canonical("/lib64/ld-linux-x86-64.so.2"), root / "lib64" / "ld-linux-x86-64.so.2");
  fs::create_directories(root / "proc");
  fs::copy(b, root / "bundle", fs::copy_options::recursive);
  // The loader resolves $ORIGIN through /proc/self/exe: a private mount namespace with /proc mounted.
  const ShellRun probe = sh("unshare --mount --fork sh -c 'mount -t proc proc " + root.string() + "/proc && true'");
  if (probe.code != 0) GTEST_SKIP() << "cannot mount /proc in a private namespace here: " << probe.out;
  const auto in_root = [&](const std::string& cmd) {
    return "unshare --mount --fork sh -c 'mount -t proc proc " + root.string() + "/proc && chroot " + root.string() +
           " " + cmd + "'";
  };
  const ShellRun gen = sh(in_root("/bundle/bin/moetron generate --device cuda --model /nowhere --prompt-ids 1,2"));
  EXPECT_EQ(gen.code, 2) << gen.out;
  EXPECT_NE(gen.out.find("no usable CUDA device"), std::string::npos) << gen.out;
  for (const auto& e : fs::directory_iterator(b / "bin")) {
    const std::string name = e.path().filename().string();
    if (name == "moetron") continue;
    const ShellRun list = sh(in_root("/bundle/bin/" + name + " --gtest_list_tests"));
    EXPECT_EQ(list.code, 0) << name << ": " << list.out;
    EXPECT_NE(list.out.find('.'), std::string::npos) << name << " lists no test";
  }
}

// --plan: every stage with its cap; the caps sum to under the 540 s deadline; both cards sized.
TEST(GpuCheck, PlanKeepsEveryCapAndTheirSumUnderTheDeadline) {
  const ShellRun r = sh("bash " + q(kSrc / "scripts" / "gpu-check.sh") + " --plan");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::regex stage(R"(^([a-z0-9-]+) +([0-9]+)s  )");
  int sum = 0, stages = 0;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_search(line, m, stage)) {
      EXPECT_GT(std::stoi(m[2]), 0) << line;
      sum += std::stoi(m[2]);
      stages++;
    }
  }
  EXPECT_GE(stages, 12);
  EXPECT_LT(sum, 540);
  for (const char* card : {"H100 80GB: bench model ", "H200 141GB: bench model "}) {
    const size_t at = r.out.find(card);
    ASSERT_NE(at, std::string::npos) << r.out;
    EXPECT_NE(r.out.find("caps sum to " + std::to_string(sum) + " s", at), std::string::npos) << r.out;
  }
}

// The check run here, where no GPU is: every stage is reported, gated ones fail, and what comes back
// is two files (the device runner brings back at most 8).
TEST_F(GpuBundle, CheckWithoutAGpuReportsEveryStageInTwoFiles) {
  const fs::path b = bundle();
  const fs::path out = *dir_ / "out";
  const ShellRun r = sh("BUNDLE=" + q(b) + " OUT=" + q(out) + " MEMORY_GIB=79.6 DEADLINE_S=300 PATH=/usr/bin:/bin bash " +
                   q(kSrc / "scripts" / "gpu-check.sh"));
  EXPECT_NE(r.code, 0) << r.out;
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(out)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"logs.tar.gz", "summary.txt"}));
  std::ifstream f(out / "summary.txt");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string summary = ss.str();
  for (const char* name : {"env ", "probe ", "optable ", "golden ", "train20 ", "resume ", "bench ", "profile "})
    EXPECT_NE(summary.find(std::string("\n") + name), std::string::npos) << name << "\n" << summary;
  EXPECT_NE(summary.find("RESULT: FAIL"), std::string::npos) << summary;
  const ShellRun tar = sh("tar tzf " + q(out / "logs.tar.gz"));
  EXPECT_NE(tar.out.find("probe.log"), std::string::npos) << tar.out;
}

}  // namespace
