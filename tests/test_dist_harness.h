// Shared by the tests/test_dist*.cpp programs: a tiny token dataset, a tiny GQA Mixtral config, and
// `moetron train` launched as a child process -- alone, or under `mpirun --oversubscribe -np N` --
// with its metrics.jsonl and checkpoints read back.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/rng.h"
#include "dist/comm.h"
#include "io/indexed_dataset.h"
#include "io/safetensors.h"

namespace moetron::testing {

namespace fs = std::filesystem;

// Documents of 8..70 tokens over a `vocab`-token vocabulary, every third token repeating the
// previous one (learnable); the first quarter of each is prompt (loss mask 0).
inline void write_dist_split(const fs::path& dir, const std::string& name, int docs, uint64_t seed, int vocab = 256) {
  IndexedDatasetWriter tokens((dir / name).string(), IndexedDType::u16);
  IndexedDatasetWriter mask((dir / (name + "_mask")).string(), IndexedDType::u8);
  for (int d = 0; d < docs; d++) {
    const int len = 8 + (int)(mix64(seed * 1000 + d) % 63);
    std::vector<int32_t> t(len), m(len);
    t[0] = 1;
    for (int i = 1; i < len; i++) t[i] = 3 + (int)(mix64(seed * 7919 + d * 131 + i) % (vocab - 3));
    for (int i = 3; i < len; i += 3) t[i] = t[i - 1];
    for (int i = 0; i < len; i++) m[i] = i >= len / 4;
    tokens.add_sequence(t.data(), t.size());
    tokens.end_document();
    mask.add_sequence(m.data(), m.size());
    mask.end_document();
  }
  tokens.finalize();
  mask.finalize();
}

// The tiny Mixtral of the distributed tests: E = 4, K = 2, GQA (4 heads, 2 kv heads), vocabulary 256,
// hidden 32, FFN 48 -- every size divisible by tp 2 and 4; seq 64, global batch 8 of micro-batches 1
// (8 micro-batches per step at dp 1, 2 at dp 4); 10 steps.  adam_eps 1e-4 (not 1e-8): Adam's update
// m / (sqrt(v) + eps) is scale-free where sqrt(v) >> eps, so an element whose gradient nearly cancels
// (|g| ~ 1e-6 against ~1e-3 typical) moves by ~lr whatever the fp32 rounding of that cancellation --
// a layout's reduction order then changed such an element by up to 1.7e-4 of the tensor's largest
// weight after 10 steps (dp 2, one OpenMP thread per rank, Zen 5 EPYC), and the comparison measured
// rounding luck.  With eps 1e-4 those updates are proportional to g and every tensor agrees to
// 2e-7..5e-7 (same runs), so the layouts' 1e-4 bound below has its margin back.
// init_dir: start from that HF model directory instead (model.config empty).
// model_config: the `model.config` mapping of a random init (empty: the tiny Mixtral).
inline std::string dist_yaml(const fs::path& run_dir, const fs::path& data_dir, const fs::path& init_dir = {},
                             const std::string& model_config = "") {
  const std::string model =
      !model_config.empty() ? "model:\n  init: random\n  config: " + model_config + "\n"
      : init_dir.empty()
          ? "model:\n"
            "  init: random\n"
            "  config: {architectures: [MixtralForCausalLM], model_type: mixtral, vocab_size: 256, hidden_size: 32,\n"
            "           intermediate_size: 48, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,\n"
            "           num_local_experts: 4, num_experts_per_tok: 2, router_aux_loss_coef: 0.02, rope_theta: 10000.0,\n"
            "           rms_norm_eps: 1.0e-5, tie_word_embeddings: false, max_position_embeddings: 256}\n"
          : "model: {init: " + init_dir.string() + "}\n";
  return "run_dir: " + run_dir.string() + "\n" + "seed: 11\n" + model +
         "data: {path: " +
         data_dir.string() +
         ", seq_length: 64}\n"
         "train: {global_batch_size: 8, micro_batch_size: 1, max_steps: 10, lr: 3.0e-3, min_lr: 3.0e-4,\n"
         "        warmup_steps: 2, schedule: cosine, grad_clip: 1.0, adam_eps: 1.0e-4}\n"
         "checkpoint: {every_steps: 5, keep_last: 3}\n"
         "log: {every_steps: 1, tensorboard: false}\n"
         "eval: {every_steps: 5, batches: 3}\n";
}

// The child's exit status: the code, or 128 + signal.
inline int exit_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// argv for `moetron train -c cfg overrides...`, under mpirun when np > 0 (np = 0: no launcher).
inline std::vector<std::string> train_argv(int np, const fs::path& cfg, const std::vector<std::string>& overrides,
                                           const std::vector<std::string>& mpirun_extra = {}) {
  std::vector<std::string> a;
  if (np > 0) {
    a = {"mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", std::to_string(np)};
    a.insert(a.end(), mpirun_extra.begin(), mpirun_extra.end());
  }
  a.insert(a.end(), {MOETRON_BINARY, "train", "-c", cfg.string()});
  a.insert(a.end(), overrides.begin(), overrides.end());
  return a;
}

// Starts argv with stdout and stderr into `log`; one OpenMP thread per process (the tests run
// several ranks on two cores).
inline pid_t spawn(const std::vector<std::string>& argv, const fs::path& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    setenv("OMP_NUM_THREADS", "1", 1);
    // Quiet, container-friendly shared-memory transport (no ptrace-based single copy).
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
    setenv("ASAN_OPTIONS", "detect_leaks=0", 1);  // MPI's own allocations are not ours to check
    std::vector<char*> args;
    for (const std::string& s : argv) args.push_back(const_cast<char*>(s.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  return pid;
}

inline int wait_status(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return exit_status(status);
}

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs to completion; returns the exit status (the output is in `log`).
inline int run_train(int np, const fs::path& cfg, const std::vector<std::string>& overrides, const fs::path& log) {
  return wait_status(spawn(train_argv(np, cfg, overrides), log));
}

// The lines of RUN/metrics.jsonl holding `key`.  Only lines ended by '\n' count: the writer ends every
// line so, and a test polling a running job can read a line its write has only partly copied in.
inline std::vector<nlohmann::json> read_metrics(const fs::path& run, const char* key) {
  std::vector<nlohmann::json> out;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line) && !f.eof();) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains(key)) out.push_back(j);
  }
  return out;
}

// The F32 tensors of DIR/STEM*.safetensors by name.
inline std::map<std::string, std::vector<float>> read_tensors(const fs::path& dir, const std::string& stem) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    if (f.rfind(stem, 0) != 0 || e.path().extension() != ".safetensors") continue;
    const SafetensorsFile file = SafetensorsFile::open(e.path().string());
    for (const std::string& n : file.names()) out[n] = to_f32(file.get(n));
  }
  return out;
}

// max |a - b| / max |b| over a tensor (0 for an all-zero reference and equal tensors).
inline double rel_max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); i++) {
    diff = std::max(diff, (double)std::fabs(a[i] - b[i]));
    scale = std::max(scale, (double)std::fabs(b[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

inline bool mpi_available() { return dist::have_mpi() && std::system("mpirun --version > /dev/null 2>&1") == 0; }

}  // namespace moetron::testing
