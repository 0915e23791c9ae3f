// A fresh directory under the system temp dir for one test, removed with everything in it at the end.
#pragma once

#include <stdlib.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>

#include <gtest/gtest.h>

namespace moetron::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& tag = "test") {
    std::string templ = (std::filesystem::temp_directory_path() / ("moetron_" + tag + "_XXXXXX")).string();
    if (mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + templ);
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A directory named after the running test (and the process), emptied on creation and removed at
// the end; `path` is public for tests that build paths from it.
struct TestDir {
  std::filesystem::path path;
  explicit TestDir(const std::string& tag) {
    path = std::filesystem::temp_directory_path() /
           ("moetron_" + tag + "_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TestDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// The whole file as bytes ("" when it cannot be read).
inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace moetron::testing
