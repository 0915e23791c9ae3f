// moetron convert: re-encode a Hugging Face / moetron model directory -- change the dtype of its float
// tensors, re-shard it by size, keep or drop the optimizer state. Only safetensors is read.
//
// The output is built in OUTPUT_PARENT/.OUTPUT_NAME.tmp-PID/ and renamed to OUTPUT at the end, so OUTPUT
// appears complete or not at all. What it holds:
//   config.json            the input's, with "torch_dtype" (and "dtype", when present) set to --dtype
//   model*.safetensors     every input tensor under its own name, float tensors in --dtype (round to
//                          nearest even), others unchanged, sharded by --max-shard-size (tensors in
//                          natural name order: layer 2 before layer 10)
//   other top-level files  copied byte for byte (generation_config.json, tokenizer files, README, ...);
//                          not copied: other *.safetensors (e.g. consolidated.safetensors), pickle
//                          weights (*.bin, *.pt, *.pth) and their indexes
//   optimizer/             re-sharded, F32 as before, unless --drop-optimizer
//   trainer_state.json     with new file checksums, unless --drop-optimizer (a release model is a plain
//                          HF directory)
// A moetron checkpoint's checksums are verified before anything is converted.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/json_limits.h"
#include "core/dtype.h"
#include "core/error.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "model/lora.h"
#include "model/weights.h"
#include "train/checkpoint.h"
#include "train/plan.h"  // parse_byte_size

namespace moetron::cli {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Natural order: digit runs compare as numbers ("layers.2" < "layers.10").
bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (std::isdigit(static_cast<unsigned char>(a[i])) && std::isdigit(static_cast<unsigned char>(b[j]))) {
      size_t ie = i, je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ie++;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) je++;
      std::string na = a.substr(i, ie - i), nb = b.substr(j, je - j);
      na.erase(0, std::min(na.find_first_not_of('0'), na.size()));
      nb.erase(0, std::min(nb.find_first_not_of('0'), nb.size()));
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = ie, j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      i++, j++;
    }
  }
  return a.size() - i < b.size() - j;
}

std::optional<DType> parse_dtype(const std::string& s) {
  if (s.empty()) return std::nullopt;
  if (s == "fp32" || s == "float32" || s == "f32") return DType::F32;
  if (s == "bf16" || s == "bfloat16") return DType::BF16;
  if (s == "fp16" || s == "float16" || s == "f16") return DType::F16;
  fail("--dtype: '{}' is not supported (expected fp32, bf16 or fp16)", s);
}

const char* torch_name(DType d) { return d == DType::F32 ? "float32" : d == DType::BF16 ? "bfloat16" : "float16"; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Files of the input that are weights in another form (never copied).
bool is_weight_file(const std::string& name) {
  for (const char* suf : {".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".ckpt"})
    if (ends_with(name, suf)) return true;
  return false;
}

// The tensors of `views` as ShardTensors in dtype `target` (float tensors only; nullopt keeps each dtype).
std::vector<ShardTensor> reencode(const std::vector<const TensorView*>& views, std::optional<DType> target) {
  std::vector<ShardTensor> out;
  for (const TensorView* v : views) {
    const DType to = target && dtype_is_float(v->dtype) ? *target : v->dtype;
    ShardTensor t;
    t.name = v->name;
    t.dtype = to;
    t.shape = v->shape;
    t.bytes = [v, to](std::vector<uint8_t>& scratch) -> const void* {
      if (to == v->dtype) return v->data;  // the mapped bytes, no copy
      const size_t n = static_cast<size_t>(v->numel());
      scratch.resize(n * dtype_size(to));
      constexpr size_t kChunk = size_t{1} << 16;
      std::vector<float> tmp(std::min(n, kChunk));
      for (size_t i = 0; i < n; i += kChunk) {
        const size_t m = std::min(kChunk, n - i);
        convert_to_f32(tmp.data(), v->data + i * dtype_size(v->dtype), v->dtype, m);
        check_representable(tmp.data(), m, to, fmt::format("tensor '{}'", v->name), i);
        convert_from_f32(scratch.data() + i * dtype_size(to), to, tmp.data(), m);
      }
      return scratch.data();
    };
    out.push_back(std::move(t));
  }
  return out;
}

void write_json_synced(const fs::path& path, const json& j) {
  std::ofstream f(path, std::ios::binary);
  f << j.dump(2) << "\n";
  f.close();
  if (!f) fail("{}: write failed", path.string());
}

// fsync of a regular file we wrote with ofstream / copy_file.
void fsync_file(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    if (fd >= 0) ::close(fd);
    fail("{}: fsync failed", p.string());
  }
  ::close(fd);
}

// Writes the output directory `out` atomically: `fill` writes into a fresh temporary directory beside
// it, which is fsynced and renamed to `out`; on any error the temporary is removed and `out` is never
// created.
void write_directory_atomically(const fs::path& out, const std::string& output,
                                const std::function<void(const fs::path& tmp)>& fill) {
  std::error_code ec;
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  fs::create_directories(parent, ec);
  const fs::path tmp = parent / fmt::format(".{}.tmp-{}", out.filename().string(), ::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec)) fail("{}: cannot create directory: {}", tmp.string(), ec.message());
  try {
    fill(tmp);
    fsync_directory(tmp.string());
    if (::rename(tmp.c_str(), out.c_str()) != 0)
      fail("--output {}: cannot rename {} into place: {}", output, tmp.string(), std::strerror(errno));
    fsync_directory(parent.string());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

// --merge-lora: the base in --input with the adapter's W += scale B A, as a plain HF model directory
// (the base's config and tokenizer files; dtype `target`, else the base's embedding's).  The output
// is written into `tmp`.
void write_merged(const fs::path& in, const std::string& adapter_dir, std::optional<DType> target, size_t max_shard,
                  const fs::path& tmp) {
  const ModelConfig cfg = load_model_config((in / "config.json").string());
  const PeftAdapter adapter = read_peft_adapter(adapter_dir, cfg);  // checked against the base first
  const ModelTensors files = ModelTensors::open(in.string());
  const ParamTable table(cfg);
  check_weights_size(files, table, in.string());
  std::vector<float> params(table.total(), 0.0f);
  load_hf_weights(files, table, params.data(), in.string());
  merge_lora(table, params.data(), ParamTable(cfg, adapter.spec), adapter.values.data(), adapter.spec);
  for (const HfTensorRef& ref : table.hf_tensors())  // finite adapters can still overflow the sum
    if (const size_t bad = first_non_finite(params.data() + ref.offset, ref.numel); bad < ref.numel)
      fail("--merge-lora {}: the merged tensor '{}' is not finite at element {} (the base plus scale x B A overflowed "
           "float32)",
           adapter_dir, ref.name, bad);
  DType dtype = DType::F32;
  if (target) {
    dtype = *target;
  } else if (const TensorView* e = files.find("model.embed_tokens.weight"); e && dtype_is_float(e->dtype)) {
    dtype = e->dtype;
  }
  std::vector<ModelTensorToWrite> tensors;
  for (const HfTensorRef& ref : table.hf_tensors()) {
    check_representable(params.data() + ref.offset, ref.numel, dtype, fmt::format("tensor '{}'", ref.name));
    tensors.push_back({ref.name, dtype, ref.shape, params.data() + ref.offset});
  }
  write_model_safetensors(tmp.string(), tensors, max_shard);
  json c;
  {
    std::ifstream f(in / "config.json", std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    c = parse_json(ss.str(), (in / "config.json").string());
  }
  c["torch_dtype"] = torch_name(dtype);
  if (c.contains("dtype")) c["dtype"] = torch_name(dtype);
  write_json_synced(tmp / "config.json", c);
  fsync_file(tmp / "config.json");
  // The base's other files (tokenizer, generation config, chat template); not its training state.
  for (const auto& e : fs::directory_iterator(in)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || name == "config.json" || name == "trainer_state.json" || is_weight_file(name) ||
        name == "adapter_config.json")
      continue;
    fs::copy_file(e.path(), tmp / name);
    fsync_file(tmp / name);
  }
  std::printf("merged LoRA rank %d (scale %.4g, %zu adapted tensors) into %zu tensors (%s)\n", adapter.spec.rank,
              adapter.spec.scale(), ParamTable(cfg, adapter.spec).specs().size() / 2, tensors.size(), torch_name(dtype));
}

}  // namespace

int run_convert(int argc, char** argv) {
  CLI::App app{"Re-encode a Hugging Face / moetron model directory: dtype, shard size, optimizer state.\n"
               "Reads only safetensors; writes OUTPUT atomically (a temporary directory, then a rename).",
               "moetron convert"};
  std::string input, output, dtype_s, shard_s = "5GB";
  bool drop_optimizer = false;
  app.add_option("--input", input, "model directory (config.json + safetensors), e.g. a checkpoint")->required();
  app.add_option("--output", output, "new directory to create (must not exist)")->required();
  app.add_option("--dtype", dtype_s, "fp32 | bf16 | fp16 for the model's float tensors (default: keep)");
  app.add_option("--max-shard-size", shard_s, "largest model / optimizer file, e.g. 5GB, 500MB, 2GiB (default 5GB)");
  app.add_flag("--drop-optimizer", drop_optimizer, "leave out optimizer/ and trainer_state.json (release model)");
  std::string merge_lora_dir;
  app.add_option("--merge-lora", merge_lora_dir,
                 "a PEFT LoRA adapter directory (e.g. a LoRA run's checkpoint): write --input (the base) with the "
                 "adapter merged in, as a plain HF model");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const std::optional<DType> target = parse_dtype(dtype_s);
  const size_t max_shard = static_cast<size_t>(parse_byte_size(shard_s, "--max-shard-size"));

  const fs::path in(input), out(output);
  std::error_code ec;
  if (!fs::is_directory(in, ec)) fail("--input {}: not a directory", input);
  if (fs::exists(out, ec)) {
    if (fs::equivalent(in, out, ec)) fail("--output {} is the input directory; convert writes a new directory", output);
    fail("--output {}: already exists; convert never overwrites (remove it or choose another path)", output);
  }
  if (fs::weakly_canonical(in) == fs::weakly_canonical(out))
    fail("--output {} is the input directory; convert writes a new directory", output);
  if (!fs::is_regular_file(in / "config.json", ec)) fail("--input {}: no config.json (not a model directory)", input);
  if (!fs::is_regular_file(in / "model.safetensors", ec) && !fs::is_regular_file(in / "model.safetensors.index.json", ec)) {
    for (const auto& e : fs::directory_iterator(in, ec)) {
      const std::string name = e.path().filename().string();
      if (ends_with(name, ".bin") || ends_with(name, ".bin.index.json") || ends_with(name, ".pt") || ends_with(name, ".pth"))
        fail("--input {}: holds only pickle weights ({}); moetron reads only safetensors (a pickle file can run code "
             "when loaded). Convert it once with transformers: AutoModelForCausalLM.from_pretrained('{}')"
             ".save_pretrained('OUT', safe_serialization=True)",
             input, name, input);
    }
    fail("--input {}: no model.safetensors or model.safetensors.index.json", input);
  }

  if (!merge_lora_dir.empty()) {
    write_directory_atomically(out, output,
                               [&](const fs::path& tmp) { write_merged(in, merge_lora_dir, target, max_shard, tmp); });
    std::printf("wrote %s\n", output.c_str());
    return 0;
  }

  // A moetron checkpoint: verify before converting, so corruption is never laundered into new checksums.
  const bool is_checkpoint = fs::is_regular_file(in / "trainer_state.json", ec);
  json state;
  if (is_checkpoint) {
    state = read_trainer_state(in.string());
    verify_checkpoint_files(in.string(), state);
  }
  const bool has_optimizer = ShardedSafetensors::exists((in / "optimizer").string(), "optimizer");

  size_t n_tensors = 0, n_model_files = 0, n_opt_files = 0;
  std::vector<std::string> copied;
  write_directory_atomically(out, output, [&](const fs::path& tmp) {
    {
      const ModelTensors model = ModelTensors::open(in.string());
      std::vector<std::string> names = model.names();
      std::sort(names.begin(), names.end(), natural_less);
      std::vector<const TensorView*> views;
      for (const std::string& n : names) views.push_back(&model.get(n));
      n_tensors = views.size();
      for (const std::string& f : write_sharded_safetensors(tmp.string(), "model", reencode(views, target), max_shard))
        n_model_files += ends_with(f, ".safetensors");
    }

    json cfg;
    {
      std::ifstream f(in / "config.json", std::ios::binary);
      std::stringstream ss;
      ss << f.rdbuf();
      cfg = parse_json(ss.str(), (in / "config.json").string());
      if (!cfg.is_object()) fail("{}: expected a JSON object", (in / "config.json").string());
    }
    if (target) {
      cfg["torch_dtype"] = torch_name(*target);
      if (cfg.contains("dtype")) cfg["dtype"] = torch_name(*target);
    }
    write_json_synced(tmp / "config.json", cfg);
    fsync_file(tmp / "config.json");

    for (const auto& e : fs::directory_iterator(in)) {
      const std::string name = e.path().filename().string();
      if (!e.is_regular_file() || name == "config.json" || name == "trainer_state.json" || is_weight_file(name)) continue;
      fs::copy_file(e.path(), tmp / name);
      fsync_file(tmp / name);
      copied.push_back(name);
    }

    if (has_optimizer && !drop_optimizer) {
      const ShardedSafetensors opt = ShardedSafetensors::open((in / "optimizer").string(), "optimizer");
      std::vector<std::string> names = opt.names();
      std::sort(names.begin(), names.end(), natural_less);
      std::vector<const TensorView*> views;
      for (const std::string& n : names) views.push_back(opt.find(n));
      fs::create_directory(tmp / "optimizer");
      for (const std::string& f :
           write_sharded_safetensors((tmp / "optimizer").string(), "optimizer", reencode(views, std::nullopt), max_shard))
        n_opt_files += ends_with(f, ".safetensors");
      fsync_directory((tmp / "optimizer").string());
    }
    if (is_checkpoint && !drop_optimizer) write_trainer_state(tmp.string(), state);
  });

  std::printf("wrote %s: %zu tensors (%s) in %zu model file%s\n", output.c_str(), n_tensors,
              target ? torch_name(*target) : "dtypes kept", n_model_files, n_model_files == 1 ? "" : "s");
  if (has_optimizer)
    std::printf("optimizer state: %s\n",
                drop_optimizer ? "dropped" : fmt::format("kept, {} file(s)", n_opt_files).c_str());
  if (is_checkpoint) std::printf("trainer_state.json: %s\n", drop_optimizer ? "dropped" : "rewritten with new checksums");
  if (!copied.empty()) {
    std::string list;
    for (const std::string& c : copied) list += (list.empty() ? "" : ", ") + c;
    std::printf("copied: %s\n", list.c_str());
  }
  return 0;
}

}  // namespace moetron::cli
