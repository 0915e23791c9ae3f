// Commands never delete or overwrite what they did not create (the hostile-input review's data
// loss): `bench checkpoint` works in a fresh scratch directory of its own and removes only that,
// whatever --output says (an existing directory with a user's files, the model directory itself,
// the default); `bench checkpoint --make-model` refuses a directory that is not new or empty.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

namespace fs = std::filesystem;

namespace {

int run(const std::string& args, std::string* out = nullptr) {
  std::string text;
  FILE* p = popen((std::string(MOETRON_BINARY) + " " + args + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t n;
  while (p && (n = fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
  const int rc = p ? pclose(p) : -1;
  if (out) *out = text;
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Every regular file below dir: relative path -> contents.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> s;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    s[fs::relative(e.path(), dir).string()] = ss.str();
  }
  return s;
}

class OutputDirs : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("moetron_outdirs_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    model_ = root_ / "model";
    std::string out;
    ASSERT_EQ(run("bench checkpoint --make-model " + model_.string() +
                      " --hidden 64 --layers 1 --experts 2 --intermediate 64 --vocab 128",
                  &out),
              0)
        << out;
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_, model_;
};

TEST_F(OutputDirs, BenchCheckpointLeavesEveryPreexistingFileUntouched) {
  const fs::path out = root_ / "out";
  fs::create_directories(out / "mine");
  std::ofstream(out / "notes.txt") << "a user's file";
  std::ofstream(out / "mine" / "data.bin") << "more";
  const auto model_before = snapshot(model_), out_before = snapshot(out);
  std::string text;
  ASSERT_EQ(run("bench checkpoint --model " + model_.string() + " --output " + out.string() + " --repeats 1", &text), 0)
      << text;
  EXPECT_EQ(snapshot(out), out_before) << "--output DIR: only the run's own scratch directory goes";
  EXPECT_EQ(snapshot(model_), model_before);
  // --output = --model: the model survives.
  ASSERT_EQ(run("bench checkpoint --model " + model_.string() + " --output " + model_.string() + " --repeats 1", &text),
            0)
      << text;
  EXPECT_EQ(snapshot(model_), model_before) << "--output equal to --model must not delete the model";
  // The default no longer uses MODEL.bench-out: a directory of that name is left alone.
  const fs::path old_default = fs::path(model_.string() + ".bench-out");
  fs::create_directories(old_default);
  std::ofstream(old_default / "keep.txt") << "keep";
  ASSERT_EQ(run("bench checkpoint --model " + model_.string() + " --repeats 1", &text), 0) << text;
  EXPECT_TRUE(fs::exists(old_default / "keep.txt"));
  for (const auto& e : fs::directory_iterator(out)) EXPECT_EQ(e.path().filename().string().rfind("moetron-bench-", 0),
                                                             std::string::npos)
      << "scratch left behind: " << e.path();
}

TEST_F(OutputDirs, MakeModelRefusesADirectoryThatIsNotNewOrEmpty) {
  const fs::path dir = root_ / "taken";
  fs::create_directories(dir);
  std::ofstream(dir / "mine.txt") << "mine";
  std::string text;
  EXPECT_NE(run("bench checkpoint --make-model " + dir.string() + " --hidden 64 --layers 1 --experts 2 "
                "--intermediate 64 --vocab 128",
                &text),
            0);
  EXPECT_NE(text.find("already exists and is not an empty directory"), std::string::npos) << text;
  EXPECT_EQ(snapshot(dir).size(), 1u) << "nothing was written";
  fs::create_directories(root_ / "empty");
  EXPECT_EQ(run("bench checkpoint --make-model " + (root_ / "empty").string() +
                " --hidden 64 --layers 1 --experts 2 --intermediate 64 --vocab 128"),
            0)
      << "an empty directory is fine";
}

}  // namespace

// `data synthetic` and `data prepare` write into --output: files that were there and that the command
// did not write are never replaced (exit non-zero, everything as it was); a previous `data prepare`
// output is the command's own and is replaced.
TEST_F(OutputDirs, DataCommandsLeavePreexistingFilesUntouched) {
  const fs::path raw = root_ / "raw";
  std::string out;
  ASSERT_EQ(run("data synthetic --train-examples 40 --test-examples 5 --output " + raw.string(), &out), 0) << out;
  const auto raw_before = snapshot(raw);
  EXPECT_NE(run("data synthetic --train-examples 10 --test-examples 2 --seed 9 --output " + raw.string(), &out), 0);
  EXPECT_NE(out.find("already exists"), std::string::npos) << out;
  EXPECT_EQ(snapshot(raw), raw_before);

  const std::string tok = std::string(MOETRON_SOURCE_DIR) + "/tests/golden/generate/mixtral_gqa/tokenizer.model";
  const std::string prepare = "data prepare --quiet --input " + (raw / "train.jsonl").string() + " --tokenizer " + tok +
                              " --output ";
  const fs::path mine = root_ / "mine";
  fs::create_directories(mine);
  std::ofstream(mine / "notes.txt") << "my notes\n";
  std::ofstream(mine / "train.bin") << "my own train.bin\n";
  const auto mine_before = snapshot(mine);
  EXPECT_NE(run(prepare + mine.string(), &out), 0) << out;
  EXPECT_NE(out.find("notes.txt"), std::string::npos) << out;
  EXPECT_EQ(snapshot(mine), mine_before);

  const fs::path data = root_ / "data";
  ASSERT_EQ(run(prepare + data.string(), &out), 0) << out;
  ASSERT_TRUE(fs::exists(data / "dataset.json"));
  EXPECT_EQ(run(prepare + data.string(), &out), 0) << out;  // its own previous output: replaced
}

// `forward --output/--grads` never replaces an existing file unless --force.
TEST_F(OutputDirs, ForwardKeepsAnExistingOutputUnlessForced) {
  const std::string golden = std::string(MOETRON_SOURCE_DIR) + "/tests/golden/mixtral_gqa";
  const fs::path out = root_ / "logits.safetensors";
  std::ofstream(out) << "my results\n";
  const std::string cmd = "forward --model " + golden + " --input " + golden + "/input.safetensors --output " + out.string();
  std::string text;
  EXPECT_NE(run(cmd, &text), 0);
  EXPECT_NE(text.find("already exists"), std::string::npos) << text;
  EXPECT_EQ(snapshot(root_)["logits.safetensors"], "my results\n");
  EXPECT_EQ(run(cmd + " --force", &text), 0) << text;
  EXPECT_NE(snapshot(root_)["logits.safetensors"], "my results\n");
}
