#include "train/checkpoint.h"

#include <fmt/ranges.h>
#include "core/json_limits.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <system_error>

#include <fmt/format.h>

#include "core/error.h"
#include "core/fd.h"
#include "core/xxh64.h"
#include "data/loader.h"
#include "model/weights.h"

namespace moetron {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

void write_all_fd(int fd, const void* data, size_t n, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) fail("{}: write failed: {}", path, errno_text(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// Creates/truncates PATH, writes, fsyncs (the directory is fsynced by the caller).
void write_file_synced(const std::string& path, const std::string& text) {
  Fd f{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (f.fd < 0) fail("{}: cannot create: {}", path, errno_text(errno));
  write_all_fd(f.fd, text.data(), text.size(), path);
  if (::fsync(f.fd) != 0) fail("{}: fsync failed: {}", path, errno_text(errno));
  const int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) fail("{}: close failed: {}", path, errno_text(errno));
}

void copy_file_synced(const std::string& src, const std::string& dst) {
  Fd in{::open(src.c_str(), O_RDONLY | O_CLOEXEC)};
  if (in.fd < 0) fail("{}: cannot open: {}", src, errno_text(errno));
  Fd out{::open(dst.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (out.fd < 0) fail("{}: cannot create: {}", dst, errno_text(errno));
  std::vector<char> buf(size_t{1} << 20);
  for (;;) {
    const ssize_t r = ::read(in.fd, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail("{}: read failed: {}", src, errno_text(errno));
    if (r == 0) break;
    write_all_fd(out.fd, buf.data(), static_cast<size_t>(r), dst);
  }
  if (::fsync(out.fd) != 0) fail("{}: fsync failed: {}", dst, errno_text(errno));
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json read_json_file(const std::string& path) {
  const std::string text = read_text_file(path);
  return parse_json(text, path + " (corrupt or truncated?)");
}

// True when the file starts (after whitespace) with '{': a tokenizer.json, not a SentencePiece model.
bool tokenizer_file_is_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char ch = 0;
  while (in.get(ch))
    if (ch != ' ' && ch != '\t' && ch != '\n' && ch != '\r') return ch == '{';
  return false;
}

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// "step-" followed by at least 6 digits.
bool parse_step_dir(const std::string& name, long* step) {
  if (name.size() < 11 || name.compare(0, 5, "step-") != 0 || name.size() > 5 + 18) return false;
  long s = 0;
  for (size_t i = 5; i < name.size(); i++) {
    if (name[i] < '0' || name[i] > '9') return false;
    s = s * 10 + (name[i] - '0');
  }
  if (step) *step = s;
  return true;
}

std::string step_dir_name(long step) { return fmt::format("step-{:06d}", step); }

const char* torch_dtype_name(DType d) {
  switch (d) {
    case DType::F32:
      return "float32";
    case DType::BF16:
      return "bfloat16";
    case DType::F16:
      return "float16";
    default:
      fail("checkpoint: model dtype {} is not a float type (expected F32, BF16 or F16)", dtype_name(d));
  }
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); i++) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// A name the "files" manifest may hold: a plain file name of the checkpoint directory, or one inside
// its optimizer/ subdirectory -- what write_trainer_state writes.  Nothing absolute, no "." or ".."
// component, no empty component, no control character (a NUL would cut the name short when opened).
bool is_safe_relative(const std::string& rel) {
  if (rel.empty() || rel.front() == '/' || rel.back() == '/') return false;
  for (const char ch : rel)
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) return false;
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t slash = rel.find('/', at);
    parts.push_back(rel.substr(at, slash == std::string::npos ? std::string::npos : slash - at));
    if (slash == std::string::npos) break;
    at = slash + 1;
  }
  for (const std::string& part : parts)
    if (part.empty() || part == "." || part == "..") return false;
  return parts.size() == 1 || (parts.size() == 2 && parts[0] == "optimizer");
}

bool is_hex16(const std::string& s) {
  if (s.size() != 16) return false;
  for (const char ch : s)
    if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'))) return false;
  return true;
}

constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kFormat = "moetron-checkpoint";
constexpr int kFormatVersion = 1;
constexpr const char* kReservedKeys[] = {"format", "format_version", "files", "trainer_state_xxh64",
                                         "optimizer_steps"};
constexpr const char* kTokenizerFiles[] = {"tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                           "special_tokens_map.json", "chat_template.jinja"};

}  // namespace

void fsync_directory(const std::string& dir) {
  Fd f{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (f.fd < 0) fail("{}: cannot open directory to fsync: {}", dir, errno_text(errno));
  if (::fsync(f.fd) != 0) fail("{}: fsync of directory failed: {}", dir, errno_text(errno));
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = fmt::format("{}.tmp-{}", path, ::getpid());
  try {
    write_file_synced(tmp, text);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail("{}: cannot rename {} into place: {}", path, tmp, errno_text(err));
  }
  const fs::path parent = fs::path(path).parent_path();
  fsync_directory(parent.empty() ? "." : parent.string());
}

// ---- sharded safetensors -------------------------------------------------------------------------

std::vector<std::string> write_sharded_safetensors(const std::string& dir, const std::string& stem,
                                                   const std::vector<ShardTensor>& tensors, size_t max_shard_bytes,
                                                   const std::function<void(const std::string&)>& after_file) {
  std::vector<std::vector<size_t>> shards;
  std::set<std::string> seen;
  size_t shard_bytes = 0;
  uint64_t total = 0;
  for (size_t i = 0; i < tensors.size(); i++) {
    const ShardTensor& t = tensors[i];
    if (!seen.insert(t.name).second) fail("{}: tensor '{}' given twice", dir, t.name);
    size_t nbytes = dtype_size(t.dtype);
    for (int64_t d : t.shape) nbytes *= static_cast<size_t>(std::max<int64_t>(d, 0));
    if (shards.empty() || (max_shard_bytes > 0 && shard_bytes > 0 && shard_bytes + nbytes > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += nbytes;
    total += nbytes;
  }
  if (shards.empty()) shards.emplace_back();

  std::vector<std::string> written;
  json weight_map = json::object();
  for (size_t k = 0; k < shards.size(); k++) {
    const std::string file = shards.size() == 1 ? stem + ".safetensors"
                                                : fmt::format("{}-{:05d}-of-{:05d}.safetensors", stem, k + 1,
                                                              shards.size());
    const std::string path = (fs::path(dir) / file).string();
    SafetensorsWriter w;
    w.set_metadata("format", "pt");
    std::vector<std::vector<uint8_t>> scratch(shards[k].size());
    for (size_t j = 0; j < shards[k].size(); j++) {
      const ShardTensor& t = tensors[shards[k][j]];
      try {
        if (t.f32 != nullptr || !t.bytes)
          w.add_f32(t.name, t.shape, t.f32, t.dtype);
        else
          w.add(t.name, t.dtype, t.shape, t.bytes(scratch[j]));
      } catch (const Error& e) {
        fail("{}: {}", path, e.what());
      }
      weight_map[t.name] = file;
    }
    w.write(path);
    written.push_back(file);
    if (after_file) after_file(file);
  }
  if (shards.size() > 1) {
    json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = std::move(weight_map);
    const std::string file = stem + ".safetensors.index.json";
    write_file_synced((fs::path(dir) / file).string(), index.dump(2) + "\n");
    written.push_back(file);
    if (after_file) after_file(file);
  }
  return written;
}

bool ShardedSafetensors::exists(const std::string& dir, const std::string& stem) {
  return is_file(fs::path(dir) / (stem + ".safetensors")) || is_file(fs::path(dir) / (stem + ".safetensors.index.json"));
}

ShardedSafetensors ShardedSafetensors::open(const std::string& dir, const std::string& stem) {
  ShardedSafetensors s;
  const fs::path single = fs::path(dir) / (stem + ".safetensors");
  const fs::path index = fs::path(dir) / (stem + ".safetensors.index.json");
  if (is_file(single)) {
    s.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(single.string())));
    for (const std::string& name : s.files_[0]->names()) s.tensors_[name] = s.files_[0]->find(name);
    return s;
  }
  if (!is_file(index)) fail("{}: no {} or {} found", dir, single.filename().string(), index.filename().string());
  const std::string ipath = index.string();
  const json j = read_json_file(ipath);
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    fail("{}: expected an object with a 'weight_map' object of tensor name -> file", ipath);
  std::map<std::string, SafetensorsFile*> by_file;
  for (const auto& [name, fj] : j["weight_map"].items()) {
    if (!fj.is_string() || !is_safe_relative(fj.get<std::string>()))
      fail("{}: weight_map entry for '{}' must name a file inside {}, got {}", ipath, name, dir, json_preview(fj));
    const std::string file = fj.get<std::string>();
    auto it = by_file.find(file);
    if (it == by_file.end()) {
      const fs::path shard = fs::path(dir) / file;
      if (!is_file(shard)) fail("{}: shard '{}' (holding tensor '{}') not found", ipath, file, name);
      s.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(shard.string())));
      it = by_file.emplace(file, s.files_.back().get()).first;
    }
    const TensorView* t = it->second->find(name);
    if (t == nullptr) fail("{}: tensor '{}' is listed under '{}', but that file does not contain it", ipath, name, file);
    s.tensors_[name] = t;
  }
  return s;
}

const TensorView* ShardedSafetensors::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

std::vector<std::string> ShardedSafetensors::names() const {
  std::vector<std::string> out;
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

// ---- trainer_state.json --------------------------------------------------------------------------

namespace {

// A counter of the trainer state: an integer in [0, 2^53] (exact in every JSON reader).
void check_count(const json& state, const char* field, const std::string& source) {
  const auto it = state.find(field);
  if (it == state.end()) fail("{}: field '{}' is missing (expected an integer >= 0)", source, field);
  if (!it->is_number_integer() || (it->is_number_unsigned() ? it->get<uint64_t>() > kMaxStateCount
                                                            : (it->get<int64_t>() < 0 ||
                                                               it->get<int64_t>() > (int64_t)kMaxStateCount)))
    fail("{}: field '{}' must be an integer in [0, 2^53], got {}", source, field, json_preview(*it));
}

}  // namespace

void validate_trainer_state(const json& j, const std::string& source, TrainerStateUse use) {
  if (!j.is_object()) fail("{}: expected a JSON object, got {}", source, j.type_name());
  if (!j.contains("format") || j["format"] != kFormat)
    fail("{}: field 'format' must be \"{}\" (not a moetron checkpoint)", source, kFormat);
  if (!j.contains("format_version") || !j["format_version"].is_number_integer() ||
      j["format_version"].get<int64_t>() != kFormatVersion)
    fail("{}: field 'format_version' must be {}, got {}", source, kFormatVersion,
         j.contains("format_version") ? json_preview(j["format_version"]) : "nothing");
  check_count(j, "optimizer_steps", source);

  // The manifest: every file of the checkpoint with its size and checksum.  Empty or partial, it
  // would switch off the verification of whatever it leaves out.
  const auto files = j.find("files");
  if (files == j.end() || !files->is_object())
    fail("{}: field 'files' must be an object listing the checkpoint's files, got {}", source,
         files == j.end() ? "nothing" : json_preview(*files));
  if (files->empty())
    fail("{}: field 'files' is empty: it must list the checkpoint's files (config.json, the model weights, ...)",
         source);
  for (const auto& [rel, info] : files->items()) {
    if (!is_safe_relative(rel))
      fail("{}: field 'files' lists {}: expected a plain file name inside the checkpoint directory (or "
           "optimizer/NAME), not an absolute path, '..', '.', an empty or a control character",
           source, json_preview(json(rel)));
    if (!info.is_object() || !info.contains("size") || !info["size"].is_number_unsigned() || !info.contains("xxh64") ||
        !info["xxh64"].is_string() || !is_hex16(info["xxh64"].get<std::string>()))
      fail("{}: field 'files' entry '{}' must be {{\"size\": BYTES, \"xxh64\": 16 lowercase hex digits}}, got {}",
           source, rel, json_preview(info));
  }
  if (!files->contains("config.json"))
    fail("{}: field 'files' does not list config.json (every checkpoint has one)", source);
  const bool adapter = files->contains("adapter_config.json") && files->contains("adapter_model.safetensors");
  if (!adapter && !files->contains("model.safetensors") && !files->contains("model.safetensors.index.json"))
    fail("{}: field 'files' lists neither model.safetensors nor model.safetensors.index.json (the model weights)",
         source);
  if (use == TrainerStateUse::any) return;

  // What training resumes from (trainer.cpp's trainer_state()).
  check_count(j, "step", source);
  check_count(j, "consumed_samples", source);
  check_count(j, "consumed_tokens", source);
  const auto ls = j.find("loader_state");
  if (ls == j.end()) fail("{}: field 'loader_state' is missing (the data loader's position to resume from)", source);
  try {
    (void)ls->get<LoaderState>();
  } catch (const Error& e) {
    fail("{}: field 'loader_state': {}", source, e.what());
  }
}

json read_trainer_state(const std::string& dir) {
  const std::string path = (fs::path(dir) / kStateFile).string();
  if (!is_file(path)) fail("{}: not found ({} is not a complete moetron checkpoint)", path, dir);
  json j = read_json_file(path);
  if (!j.is_object()) fail("{}: expected a JSON object, got {}", path, j.type_name());
  auto h = j.find("trainer_state_xxh64");
  if (h == j.end() || !h->is_string()) fail("{}: missing its checksum 'trainer_state_xxh64'", path);
  const std::string want = h->get<std::string>();
  json body = j;
  body.erase("trainer_state_xxh64");
  const std::string text = body.dump();
  const std::string got = xxh64_hex(xxh64(text.data(), text.size()));
  if (got != want)
    fail("{}: checksum mismatch: its content hashes to {}, but it records {} (the file is corrupt)", path, got, want);
  validate_trainer_state(j, path);
  return j;
}

namespace {

struct ListedFile {
  std::string rel;
  uint64_t size = 0;
  std::string hash;
};

std::vector<ListedFile> listed_files(const std::string& dir, const json& state) {
  const std::string spath = (fs::path(dir) / kStateFile).string();
  std::vector<ListedFile> out;
  validate_trainer_state(state, spath);
  for (const auto& [rel, info] : state.at("files").items())
    out.push_back({rel, info["size"].get<uint64_t>(), info["xxh64"].get<std::string>()});
  return out;
}

}  // namespace

bool is_complete_checkpoint(const std::string& dir, std::string* why) {
  try {
    const json state = read_trainer_state(dir);
    for (const ListedFile& f : listed_files(dir, state)) {
      const fs::path p = fs::path(dir) / f.rel;
      std::error_code ec;
      const auto size = fs::file_size(p, ec);
      if (ec) fail("{}: missing (listed in {})", p.string(), kStateFile);
      if (size != f.size) fail("{}: {} bytes, {} lists {}", p.string(), size, kStateFile, f.size);
    }
    return true;
  } catch (const Error& e) {
    if (why) *why = e.what();
    return false;
  }
}

void verify_checkpoint_files(const std::string& dir, const json& state) {
  const std::vector<ListedFile> files = listed_files(dir, state);
  // The manifest lists every file (write_trainer_state does): one it leaves out would be read unverified.
  {
    std::set<std::string> listed;
    for (const ListedFile& f : files) listed.insert(f.rel);
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec)) {
      if (!it->is_regular_file()) continue;
      const std::string rel = fs::relative(it->path(), dir).generic_string();
      if (rel != kStateFile && !listed.count(rel))
        fail("{}: not listed in {}'s 'files' (a checkpoint's manifest lists every file in it; was the file added "
             "after the save, or the manifest edited?)",
             it->path().string(), kStateFile);
    }
    if (ec) fail("{}: cannot list: {}", dir, ec.message());
  }
  std::vector<std::string> errors(files.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < files.size(); i++) {
    const std::string path = (fs::path(dir) / files[i].rel).string();
    try {
      std::error_code ec;
      const auto size = fs::file_size(path, ec);
      if (ec) fail("{}: missing (listed in {})", path, kStateFile);
      if (size != files[i].size)
        fail("{}: {} bytes, but {} records {} (truncated or altered)", path, size, kStateFile, files[i].size);
      const std::string got = xxh64_hex(xxh64_file(path));
      if (got != files[i].hash)
        fail("{}: checksum mismatch: xxh64 {}, but {} records {} (the file is corrupt)", path, got, kStateFile,
             files[i].hash);
    } catch (const std::exception& e) {
      errors[i] = e.what();
    }
  }
  for (const std::string& e : errors)
    if (!e.empty()) throw Error(e);
}

json write_trainer_state(const std::string& dir, json state) {
  if (state.is_null()) state = json::object();
  if (!state.is_object()) fail("{}: trainer state must be a JSON object, got {}", dir, state.type_name());
  const long optimizer_steps = state.value("optimizer_steps", 0L);
  for (const char* k : kReservedKeys) state.erase(k);
  state["format"] = kFormat;
  state["format_version"] = kFormatVersion;
  state["optimizer_steps"] = optimizer_steps;

  std::vector<std::string> rels;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (!it->is_regular_file()) continue;
    const std::string rel = fs::relative(it->path(), dir).generic_string();
    if (rel == kStateFile) continue;
    if (!is_safe_relative(rel))  // never write a manifest that validate_trainer_state would refuse
      fail("{}: '{}' cannot be listed in a checkpoint's manifest (only files of the directory and of optimizer/)",
           dir, rel);
    rels.push_back(rel);
  }
  if (ec) fail("{}: cannot list: {}", dir, ec.message());
  std::sort(rels.begin(), rels.end());
  std::vector<uint64_t> sizes(rels.size()), hashes(rels.size());
  std::vector<std::string> errors(rels.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < rels.size(); i++) {
    try {
      hashes[i] = xxh64_file((fs::path(dir) / rels[i]).string(), &sizes[i]);
    } catch (const std::exception& e) {
      errors[i] = e.what();
    }
  }
  for (const std::string& e : errors)
    if (!e.empty()) throw Error(e);
  json files = json::object();
  for (size_t i = 0; i < rels.size(); i++) files[rels[i]] = {{"size", sizes[i]}, {"xxh64", xxh64_hex(hashes[i])}};
  state["files"] = std::move(files);
  const std::string body = state.dump();
  state["trainer_state_xxh64"] = xxh64_hex(xxh64(body.data(), body.size()));
  write_file_synced((fs::path(dir) / kStateFile).string(), state.dump(2) + "\n");
  return state;
}

// ---- config check --------------------------------------------------------------------------------

void check_same_architecture(const ModelConfig& got, const ModelConfig& want, const std::string& source) {
  std::vector<std::string> diffs;
  auto cmp = [&](const char* field, const auto& a, const auto& b) {
    if (!(a == b)) diffs.push_back(fmt::format("{}: checkpoint {}, expected {}", field, a, b));
  };
  auto window = [](int w) { return w > 0 ? std::to_string(w) : std::string("null"); };
  cmp("architectures", got.architecture, want.architecture);
  cmp("model_type", got.model_type, want.model_type);
  cmp("vocab_size", got.vocab_size, want.vocab_size);
  cmp("hidden_size", got.hidden_size, want.hidden_size);
  cmp("intermediate_size", got.intermediate_size, want.intermediate_size);
  cmp("num_hidden_layers", got.num_hidden_layers, want.num_hidden_layers);
  cmp("num_attention_heads", got.num_attention_heads, want.num_attention_heads);
  cmp("num_key_value_heads", got.num_key_value_heads, want.num_key_value_heads);
  cmp("head_dim", got.head_dim, want.head_dim);
  cmp("num_local_experts", got.num_local_experts, want.num_local_experts);
  cmp("num_experts_per_tok", got.num_experts_per_tok, want.num_experts_per_tok);
  cmp("moe_intermediate_size", got.moe_intermediate_size, want.moe_intermediate_size);
  cmp("decoder_sparse_step", got.decoder_sparse_step, want.decoder_sparse_step);
  cmp("mlp_only_layers", fmt::format("[{}]", fmt::join(got.mlp_only_layers, ", ")),
      fmt::format("[{}]", fmt::join(want.mlp_only_layers, ", ")));
  cmp("norm_topk_prob", got.norm_topk_prob, want.norm_topk_prob);
  cmp("qkv_bias", got.qkv_bias, want.qkv_bias);
  cmp("clip_qkv", got.clip_qkv, want.clip_qkv);
  cmp("shared_expert_intermediate_size", got.shared_expert_intermediate_size, want.shared_expert_intermediate_size);
  cmp("rms_norm_eps", got.rms_norm_eps, want.rms_norm_eps);
  cmp("rope_theta", got.rope_theta, want.rope_theta);
  cmp("sliding_window", window(got.sliding_window), window(want.sliding_window));
  cmp("tie_word_embeddings", got.tie_word_embeddings, want.tie_word_embeddings);
  cmp("hidden_act", got.hidden_act, want.hidden_act);
  if (diffs.empty()) return;
  std::string list;
  for (const std::string& d : diffs) list += (list.empty() ? "" : "; ") + d;
  fail("{}: the checkpoint's model differs from the configured model in {}: {}", source,
       diffs.size() == 1 ? "one field" : fmt::format("{} fields", diffs.size()), list);
}

// ---- save ----------------------------------------------------------------------------------------

namespace {

// Moves tmp to final; an existing final is swapped out atomically where the filesystem allows.
void publish_directory(const fs::path& tmp, const fs::path& final_path) {
  std::error_code ec;
  if (!fs::exists(final_path, ec)) {
    if (::rename(tmp.c_str(), final_path.c_str()) != 0)
      fail("{}: cannot rename {} into place: {}", final_path.string(), tmp.string(), errno_text(errno));
    return;
  }
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp, ec);  // now the old checkpoint
    return;
  }
#endif
  const fs::path trash = final_path.parent_path() /
                         fmt::format(".trash-{}-{}", final_path.filename().string(), ::getpid());
  fs::remove_all(trash, ec);
  if (::rename(final_path.c_str(), trash.c_str()) != 0)
    fail("{}: cannot move the existing checkpoint aside: {}", final_path.string(), errno_text(errno));
  if (::rename(tmp.c_str(), final_path.c_str()) != 0)
    fail("{}: cannot rename {} into place: {}", final_path.string(), tmp.string(), errno_text(errno));
  fs::remove_all(trash, ec);
}

void prune_checkpoints(const fs::path& ckpts, const std::string& keep_name, int keep_last) {
  if (keep_last <= 0) return;
  std::vector<std::pair<long, std::string>> complete;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(ckpts, ec)) {
    long step = 0;
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && parse_step_dir(name, &step) && is_complete_checkpoint(entry.path().string()))
      complete.emplace_back(step, name);
  }
  if (ec) fail("{}: cannot list: {}", ckpts.string(), ec.message());
  std::sort(complete.begin(), complete.end(), std::greater<>());
  for (size_t i = static_cast<size_t>(keep_last); i < complete.size(); i++) {
    const std::string& name = complete[i].second;
    if (name == keep_name) continue;
    // Rename first, so a crash mid-delete never leaves a step-* directory that looks usable.
    const fs::path trash = ckpts / fmt::format(".trash-{}-{}", name, ::getpid());
    fs::remove_all(trash, ec);
    if (::rename((ckpts / name).c_str(), trash.c_str()) != 0)
      fail("{}: cannot remove old checkpoint (keep_last = {}): {}", (ckpts / name).string(), keep_last,
           errno_text(errno));
    fs::remove_all(trash, ec);
    if (ec) fail("{}: cannot delete: {}", trash.string(), ec.message());
  }
}

}  // namespace

std::string save_checkpoint(const std::string& run_dir, long step, const CheckpointContents& c,
                            const SaveOptions& o) {
  if (step < 0) fail("save_checkpoint: step must be >= 0, got {}", step);
  if (!c.model_config || !c.table || !c.params) fail("save_checkpoint: model config, table and params are required");
  if ((c.exp_avg == nullptr) != (c.exp_avg_sq == nullptr))
    fail("save_checkpoint: exp_avg and exp_avg_sq must both be given or both be null");
  if (!c.trainer_state.is_null() && !c.trainer_state.is_object())
    fail("save_checkpoint: trainer_state must be a JSON object, got {}", c.trainer_state.type_name());
  const char* dtype_str = torch_dtype_name(o.model_dtype);
  const ParamTable& table = *c.table;

  const fs::path ckpts = fs::path(run_dir) / "checkpoints";
  std::error_code ec;
  fs::create_directories(ckpts, ec);
  if (ec) fail("{}: cannot create directory: {}", ckpts.string(), ec.message());
  const std::string name = step_dir_name(step);
  const fs::path tmp = ckpts / fmt::format(".tmp-{}-{}", name, ::getpid());
  const fs::path final_path = ckpts / name;
  auto progress = [&](const std::string& what) {
    if (o.on_progress) o.on_progress(what);
  };

  // A step directory that is not a complete checkpoint is not ours to replace (a user's files, or a
  // foreign tool's): refuse before writing anything.
  {
    std::string why;
    if (fs::exists(final_path, ec) && !is_complete_checkpoint(final_path.string(), &why))
      fail("{}: exists and is not a complete moetron checkpoint ({}); it is left as it is -- move it away, or "
           "train into another run_dir",
           final_path.string(), why);
  }
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  if (ec) fail("{}: cannot create directory: {}", tmp.string(), ec.message());
  try {
    ModelConfig cfg = *c.model_config;
    cfg.torch_dtype = dtype_str;
    write_file_synced((tmp / "config.json").string(), model_config_to_json(cfg).dump(2) + "\n");
    progress("config.json");

    json gen = {{"_from_model_config", true}};
    if (cfg.bos_token_id >= 0) gen["bos_token_id"] = cfg.bos_token_id;
    if (cfg.eos_token_ids.size() > 1)
      gen["eos_token_id"] = cfg.eos_token_ids;
    else if (cfg.eos_token_id >= 0)
      gen["eos_token_id"] = cfg.eos_token_id;
    if (cfg.pad_token_id >= 0) gen["pad_token_id"] = cfg.pad_token_id;
    write_file_synced((tmp / "generation_config.json").string(), gen.dump(2) + "\n");
    progress("generation_config.json");

    if (table.is_lora()) {
      if (c.lora == nullptr) fail("save_checkpoint: an adapter table needs its LoRA spec");
      write_peft_adapter(tmp.string(), cfg, *c.lora, table, c.params, c.base_model);
      for (const char* f : {"adapter_config.json", "adapter_model.safetensors"}) {
        const int fd = ::open((tmp / f).c_str(), O_RDONLY);
        if (fd < 0 || ::fsync(fd) != 0) fail("{}: cannot fsync", (tmp / f).string());
        ::close(fd);
      }
    } else {
      std::vector<ModelTensorToWrite> model;
      for (const HfTensorRef& ref : table.hf_tensors())
        model.push_back({ref.name, o.model_dtype, ref.shape, c.params + ref.offset});
      write_model_safetensors(tmp.string(), model, o.max_shard_bytes);
    }
    progress("model");

    if (!o.tokenizer_source_dir.empty()) {
      if (!fs::is_directory(o.tokenizer_source_dir, ec))
        fail("{}: tokenizer source directory not found", o.tokenizer_source_dir);
      for (const char* f : kTokenizerFiles) {
        const fs::path src = fs::path(o.tokenizer_source_dir) / f;
        if (!is_file(src)) continue;
        copy_file_synced(src.string(), (tmp / f).string());
        progress(f);
      }
    }
    if (!o.tokenizer_model_file.empty() && !is_file(tmp / "tokenizer.model") && !is_file(tmp / "tokenizer.json")) {
      // The data's tokenizer under the name the model loaders look for: a tokenizer.json (a JSON
      // object) keeps that name and takes its tokenizer_config.json (BOS/EOS) along.
      const bool json = tokenizer_file_is_json(o.tokenizer_model_file);
      const char* dest = json ? "tokenizer.json" : "tokenizer.model";
      copy_file_synced(o.tokenizer_model_file, (tmp / dest).string());
      progress(dest);
      const fs::path cfg = fs::path(o.tokenizer_model_file).parent_path() / "tokenizer_config.json";
      if (json && is_file(cfg) && !is_file(tmp / "tokenizer_config.json")) {
        copy_file_synced(cfg.string(), (tmp / "tokenizer_config.json").string());
        progress("tokenizer_config.json");
      }
    }

    if (c.exp_avg != nullptr) {
      const fs::path opt = tmp / "optimizer";
      fs::create_directory(opt, ec);
      if (ec) fail("{}: cannot create directory: {}", opt.string(), ec.message());
      std::vector<ShardTensor> tensors;
      for (const HfTensorRef& ref : table.hf_tensors()) {
        tensors.push_back({ref.name + ".master", DType::F32, ref.shape, c.params + ref.offset, {}});
        tensors.push_back({ref.name + ".exp_avg", DType::F32, ref.shape, c.exp_avg + ref.offset, {}});
        tensors.push_back({ref.name + ".exp_avg_sq", DType::F32, ref.shape, c.exp_avg_sq + ref.offset, {}});
      }
      write_sharded_safetensors(opt.string(), "optimizer", tensors, o.max_shard_bytes,
                                [&](const std::string& f) { progress("optimizer/" + f); });
      fsync_directory(opt.string());
    }

    json state = c.trainer_state.is_null() ? json::object() : c.trainer_state;
    state["optimizer_steps"] = c.optimizer_steps;
    write_trainer_state(tmp.string(), std::move(state));
    fsync_directory(tmp.string());
    progress("trainer_state.json");
    publish_directory(tmp, final_path);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }

  fsync_directory(ckpts.string());
  progress("renamed");
  write_file_atomic((ckpts / "latest").string(), name + "\n");
  progress("latest");
  prune_checkpoints(ckpts, name, o.keep_last);
  progress("pruned");
  return final_path.string();
}

// ---- find / load ---------------------------------------------------------------------------------

std::string find_latest_checkpoint(const std::string& run_dir) {
  const fs::path ckpts = fs::path(run_dir) / "checkpoints";
  const fs::path latest = ckpts / "latest";
  std::error_code ec;
  if (!fs::exists(latest, ec)) {
    long best = -1;
    std::string best_path;
    for (const auto& entry : fs::directory_iterator(ckpts, ec)) {
      long step = 0;
      if (entry.is_directory() && parse_step_dir(entry.path().filename().string(), &step) && step > best &&
          is_complete_checkpoint(entry.path().string())) {
        best = step;
        best_path = entry.path().string();
      }
    }
    return best_path;
  }
  std::string name = read_text_file(latest.string());
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  if (!parse_step_dir(name, nullptr))
    fail("{}: names '{}', which is not a checkpoint directory name (step-NNNNNN)", latest.string(), name);
  const fs::path dir = ckpts / name;
  if (!fs::is_directory(dir, ec)) fail("{}: names '{}', but {} does not exist", latest.string(), name, dir.string());
  std::string why;
  if (!is_complete_checkpoint(dir.string(), &why))
    fail("{}: names '{}', which is not a complete checkpoint: {}", latest.string(), name, why);
  return dir.string();
}

namespace {

void read_optimizer_tensor(const ShardedSafetensors& f, const std::string& opt_dir, const HfTensorRef& ref,
                           const char* suffix, float* dst) {
  const std::string name = ref.name + suffix;
  const TensorView* t = f.find(name);
  if (t == nullptr) fail("{}: tensor '{}' is missing", opt_dir, name);
  if (t->dtype != DType::F32)
    fail("{}: tensor '{}' must be F32, got {}", t->file, name, dtype_name(t->dtype));
  if (t->shape != ref.shape)
    fail("{}: tensor '{}' has shape {}, but the model config implies {}", t->file, name, shape_str(t->shape),
         shape_str(ref.shape));
  read_f32(*t, dst + ref.offset, ref.numel);
  const size_t bad = first_non_finite(dst + ref.offset, ref.numel);
  if (bad != ref.numel)
    fail("{}: tensor '{}' holds a non-finite value ({}) at element {}: the optimizer state is corrupt (NaN or Inf), "
         "and training resumed from it would diverge",
         t->file, name, dst[ref.offset + bad], bad);
}

}  // namespace

LoadedCheckpoint load_checkpoint(const std::string& dir, const ModelConfig& expected, const ParamTable& table,
                                 float* params, float* exp_avg, float* exp_avg_sq) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("{}: checkpoint directory not found", dir);
  json state = read_trainer_state(dir);
  verify_checkpoint_files(dir, state);
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  check_same_architecture(load_model_config(cfg_path), expected, cfg_path);

  const std::string opt_dir = (fs::path(dir) / "optimizer").string();
  const bool has_opt = ShardedSafetensors::exists(opt_dir, "optimizer");
  if ((exp_avg != nullptr || exp_avg_sq != nullptr) && !has_opt)
    fail("{}: has no optimizer state (no optimizer/optimizer.safetensors[.index.json]; was it converted with "
         "--drop-optimizer?), so training cannot resume from it exactly",
         dir);
  if (has_opt) {
    const ShardedSafetensors opt = ShardedSafetensors::open(opt_dir, "optimizer");
    std::set<std::string> known;
    for (const HfTensorRef& ref : table.hf_tensors())
      for (const char* s : {".master", ".exp_avg", ".exp_avg_sq"}) known.insert(ref.name + s);
    for (const std::string& name : opt.names())
      if (known.count(name) == 0)
        fail("{}: tensor '{}' does not belong to the model config.json describes", opt_dir, name);
    for (const HfTensorRef& ref : table.hf_tensors()) {
      read_optimizer_tensor(opt, opt_dir, ref, ".master", params);
      if (exp_avg) read_optimizer_tensor(opt, opt_dir, ref, ".exp_avg", exp_avg);
      if (exp_avg_sq) read_optimizer_tensor(opt, opt_dir, ref, ".exp_avg_sq", exp_avg_sq);
    }
  } else if (table.is_lora()) {
    const PeftAdapter a = read_peft_adapter(dir, expected);
    const ParamTable got(expected, a.spec);
    bool same = got.total() == table.total() && got.hf_tensors().size() == table.hf_tensors().size();
    for (size_t i = 0; same && i < got.hf_tensors().size(); i++)
      same = got.hf_tensors()[i].name == table.hf_tensors()[i].name &&
             got.hf_tensors()[i].shape == table.hf_tensors()[i].shape;
    if (!same)
      fail("{}: the adapter (rank {}) has other rank or targets than the run's (lora.rank, lora.targets)", dir,
           a.spec.rank);
    std::copy(a.values.begin(), a.values.end(), params);
  } else {
    load_hf_weights(ModelTensors::open(dir), table, params, dir);
  }

  LoadedCheckpoint out;
  out.optimizer_steps = state["optimizer_steps"].get<long>();  // validated by read_trainer_state
  for (const char* k : kReservedKeys) state.erase(k);
  out.trainer_state = std::move(state);
  return out;
}

}  // namespace moetron
