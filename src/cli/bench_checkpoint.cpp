// moetron bench checkpoint: how fast and how lean loading and saving model weights is.
//   --make-model DIR   writes a random Mixtral-shaped model in bf16 (default ~1 GB) to benchmark on.
//   --model DIR        loads DIR into fp32 (the training loader: mmap, convert, release the pages of
//                      each tensor), then saves it as bf16 safetensors, and times in the same run a
//                      plain sequential read and a plain sequential copy (read + write + fsync) of the
//                      same files. Prints GB/s of each (medians of --repeats) and the peak RSS of the
//                      load, which happens first, beside the fp32 bytes it must hold.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/flag_range.h"
#include "core/error.h"
#include "core/fd.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "model/params.h"
#include "model/weights.h"

namespace moetron::cli {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double peak_rss_gib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / (1024.0 * 1024.0);
}

std::vector<fs::path> safetensors_files(const std::string& dir) {
  std::vector<fs::path> out;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") out.push_back(entry.path());
  std::sort(out.begin(), out.end());
  if (out.empty()) fail("{}: no .safetensors files", dir);
  return out;
}

// Reads every file sequentially into a buffer; when `out_dir` is given also writes each one there
// and fsyncs it. Returns the bytes read.
size_t sequential_pass(const std::vector<fs::path>& files, const std::string& out_dir, std::vector<char>& buf) {
  size_t total = 0;
  for (const fs::path& src : files) {
    Fd in(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
    if (in.fd < 0) fail("{}: cannot open: {}", src.string(), std::strerror(errno));
    const std::string dst = out_dir.empty() ? "" : (fs::path(out_dir) / src.filename()).string();
    Fd out(dst.empty() ? -1 : ::open(dst.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!dst.empty() && out.fd < 0) fail("{}: cannot create: {}", dst, std::strerror(errno));
    for (;;) {
      const ssize_t n = ::read(in.fd, buf.data(), buf.size());
      if (n < 0) fail("{}: read failed: {}", src.string(), std::strerror(errno));
      if (n == 0) break;
      total += static_cast<size_t>(n);
      for (ssize_t done = 0; out.fd >= 0 && done < n;) {
        const ssize_t w = ::write(out.fd, buf.data() + done, static_cast<size_t>(n - done));
        if (w < 0) fail("{}: write failed: {}", dst, std::strerror(errno));
        done += w;
      }
    }
    if (out.fd >= 0 && ::fsync(out.fd) != 0) fail("{}: fsync failed: {}", dst, std::strerror(errno));
  }
  return total;
}

// A directory this run creates (mkdtemp under `parent`) and removes with everything in it -- and
// nothing else -- when it goes out of scope, errors included.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& parent) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (!fs::is_directory(parent)) fail("--output: '{}' is not a directory and cannot be created", parent);
    std::string tmpl = (fs::path(parent) / "moetron-bench-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr)
      fail("--output: cannot create a scratch directory in '{}': {}", parent, std::strerror(errno));
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

int make_model(const std::string& dir, int hidden, int layers, int experts, int intermediate, int vocab, int heads,
               int kv_heads) {
  const ModelConfig cfg = model_config_from_json(
      {{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"}, {"vocab_size", vocab},
       {"hidden_size", hidden}, {"intermediate_size", intermediate}, {"num_hidden_layers", layers},
       {"num_attention_heads", heads}, {"num_key_value_heads", kv_heads}, {"num_local_experts", experts},
       {"num_experts_per_tok", 2}, {"torch_dtype", "bfloat16"}},
      "bench checkpoint --make-model");
  if (const int64_t n = ParamTable(cfg).total(); n > (int64_t{1} << 32))
    throw InputError(fmt::format("--make-model: {} parameters ({:.1f} GB in bf16); at most 2^32", n, n * 2 / 1e9));
  // The directory is the command's output: it must be new or empty (nothing of the user's is
  // overwritten).
  if (fs::exists(dir) && (!fs::is_directory(dir) || !fs::is_empty(dir)))
    fail("--make-model: '{}' already exists and is not an empty directory; give a new directory", dir);
  const size_t numel = write_random_model(dir, cfg, 1, DType::BF16);
  std::printf("wrote %s: %.3f B parameters, %.3f GB in bf16\n", dir.c_str(), numel / 1e9, numel * 2 / 1e9);
  return 0;
}

}  // namespace

int run_bench_checkpoint(int argc, char** argv) {
  CLI::App app{"Load / save speed and load peak RSS of model weights, beside plain sequential I/O.",
               "moetron bench checkpoint"};
  std::string model_dir, make_dir, out_dir;
  int repeats = 3, hidden = 1024, layers = 8, experts = 8, intermediate = 2048, vocab = 32000, heads = 16, kv_heads = 8;
  app.add_option("--model", model_dir, "HF model directory to load (safetensors, any float dtype)");
  app.add_option("--output", out_dir,
                 "where to make the scratch directory for the saves and copies: a fresh DIR/moetron-bench-XXXXXX, "
                 "removed at the end (nothing else there is touched; default: the system temporary directory)");
  app.add_option("--repeats", repeats, "timed runs of each step; medians are reported");
  app.add_option("--make-model", make_dir, "write a random bf16 Mixtral to this directory and exit");
  app.add_option("--hidden", hidden, "--make-model: hidden_size");
  app.add_option("--layers", layers, "--make-model: num_hidden_layers");
  app.add_option("--experts", experts, "--make-model: num_local_experts");
  app.add_option("--intermediate", intermediate, "--make-model: intermediate_size");
  app.add_option("--vocab", vocab, "--make-model: vocab_size");
  app.add_option("--heads", heads, "--make-model: num_attention_heads (dividing hidden_size)");
  app.add_option("--kv-heads", kv_heads, "--make-model: num_key_value_heads (dividing --heads)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  check_flag_range("--repeats", repeats, 1, 1000);
  for (const auto& [flag, v] : {std::pair<const char*, int>{"--hidden", hidden}, {"--layers", layers},
                                {"--experts", experts}, {"--intermediate", intermediate}, {"--vocab", vocab},
                                {"--heads", heads}, {"--kv-heads", kv_heads}})
    check_flag_range(flag, v, 1, 1 << 20);
  if (!make_dir.empty()) return make_model(make_dir, hidden, layers, experts, intermediate, vocab, heads, kv_heads);
  if (model_dir.empty()) {
    std::fprintf(stderr, "moetron bench checkpoint: give --model DIR (or --make-model DIR to create one)\n");
    return 2;
  }
  if (out_dir.empty()) out_dir = fs::temp_directory_path().string();

  const ModelConfig cfg = load_model_config((fs::path(model_dir) / "config.json").string());
  const ParamTable table(cfg);
  const std::vector<fs::path> files = safetensors_files(model_dir);
  size_t file_bytes = 0;
  for (const fs::path& f : files) file_bytes += fs::file_size(f);
  const double rss_before = peak_rss_gib();

  check_weights_size(ModelTensors::open(model_dir), table, model_dir);  // before allocating from config.json
  // 1. Load into fp32 (first, so the peak RSS is the load's).
  std::vector<float> params(table.total());
  std::vector<double> load_s;
  double rss_after_load = 0;
  for (int r = 0; r < repeats; r++) {
    const auto t0 = Clock::now();
    const ModelTensors tensors = ModelTensors::open(model_dir);
    load_hf_weights(tensors, table, params.data(), model_dir);
    load_s.push_back(seconds_since(t0));
    if (r == 0) rss_after_load = peak_rss_gib();
  }

  // 2. Save as bf16 safetensors (fsynced, atomic), 3. plain sequential read, 4. plain copy + fsync.
  std::vector<ModelTensorToWrite> to_write;
  for (const HfTensorRef& ref : table.hf_tensors())
    to_write.push_back({ref.name, DType::BF16, ref.shape, params.data() + ref.offset});
  const ScratchDir scratch(out_dir);
  const std::string save_dir = (scratch.path() / "save").string(), copy_dir = (scratch.path() / "copy").string();
  fs::create_directories(save_dir);
  fs::create_directories(copy_dir);
  std::vector<char> buf(size_t{16} << 20);
  std::vector<double> save_s, read_s, copy_s;
  size_t saved_bytes = 0;
  for (int r = 0; r < repeats; r++) {
    auto t0 = Clock::now();
    write_model_safetensors(save_dir, to_write);
    save_s.push_back(seconds_since(t0));
    t0 = Clock::now();
    sequential_pass(files, "", buf);
    read_s.push_back(seconds_since(t0));
    t0 = Clock::now();
    sequential_pass(files, copy_dir, buf);
    copy_s.push_back(seconds_since(t0));
  }
  for (const fs::path& f : safetensors_files(save_dir)) saved_bytes += fs::file_size(f);

  const double gb = static_cast<double>(file_bytes) / 1e9, fp32_gib = table.total() * 4.0 / (1 << 30);
  std::printf("bench checkpoint: %s, %zu file(s), %.3f GB on disk; fp32 parameters %.3f GiB; medians of %d runs\n",
              model_dir.c_str(), files.size(), gb, fp32_gib, repeats);
  std::printf("  load into fp32        %7.3f s  %6.2f GB/s of file\n", median_of(load_s), gb / median_of(load_s));
  std::printf("  save bf16 + fsync     %7.3f s  %6.2f GB/s written\n", median_of(save_s),
              saved_bytes / 1e9 / median_of(save_s));
  std::printf("  plain sequential read %7.3f s  %6.2f GB/s\n", median_of(read_s), gb / median_of(read_s));
  std::printf("  plain copy + fsync    %7.3f s  %6.2f GB/s\n", median_of(copy_s), gb / median_of(copy_s));
  std::printf("  load / read %.2fx, save / copy %.2fx\n", median_of(read_s) / median_of(load_s),
              median_of(copy_s) / median_of(save_s));
  std::printf("  peak RSS after load %.3f GiB (before %.3f GiB; the fp32 parameters alone are %.3f GiB)\n",
              rss_after_load, rss_before, fp32_gib);
  std::printf("{\"file_gb\": %.4f, \"load_gbps\": %.3f, \"save_gbps\": %.3f, \"read_gbps\": %.3f, \"copy_gbps\": %.3f, "
              "\"load_peak_rss_gib\": %.4f, \"fp32_gib\": %.4f}\n",
              gb, gb / median_of(load_s), saved_bytes / 1e9 / median_of(save_s), gb / median_of(read_s),
              gb / median_of(copy_s), rss_after_load, fp32_gib);
  return 0;
}

}  // namespace moetron::cli
