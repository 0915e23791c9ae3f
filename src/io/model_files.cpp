#include "io/model_files.h"
#include "core/json_limits.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetron {

namespace fs = std::filesystem;

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_json(ss.str(), path);
}

// "model-DDDDD-of-DDDDD.safetensors"
bool is_shard_name(const std::string& name) {
  const std::string pattern = "model-#####-of-#####.safetensors";
  if (name.size() != pattern.size()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const bool ok = pattern[i] == '#' ? (name[i] >= '0' && name[i] <= '9') : name[i] == pattern[i];
    if (!ok) return false;
  }
  return true;
}

std::string shard_name(size_t k, size_t n) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", k, n);
}

// PATH.tmp, fsync, rename: the index appears whole or not at all.
void write_text_atomic(const fs::path& path, const std::string& text) {
  const std::string tmp = path.string() + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("{}: cannot create: {}", tmp, std::generic_category().message(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail("{}: write failed: {}", tmp, std::generic_category().message(err));
    }
    done += static_cast<size_t>(w);
  }
  const bool synced = ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!synced) {
    ::unlink(tmp.c_str());
    fail("{}: fsync failed: {}", tmp, std::generic_category().message(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_err = errno;
    ::unlink(tmp.c_str());
    fail("{}: cannot rename {} into place: {}", path.string(), tmp,
         std::generic_category().message(rename_err));
  }
}

}  // namespace

ModelTensors ModelTensors::open(const std::string& dir) {
  ModelTensors m;
  m.dir_ = dir;
  const fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) fail("{}: model directory not found", dir);

  const fs::path single = root / kSingleFile;
  const fs::path index = root / kIndexFile;
  if (is_file(single)) {
    m.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(single.string())));
    for (const std::string& name : m.files_[0]->names()) m.tensors_[name] = m.files_[0]->find(name);
    return m;
  }
  if (!is_file(index)) {
    if (is_file(root / "pytorch_model.bin") || is_file(root / "pytorch_model.bin.index.json"))
      fail("{}: found only a pytorch_model.bin pickle checkpoint; convert it to safetensors first, "
           "e.g. with transformers: AutoModelForCausalLM.from_pretrained(dir)"
           ".save_pretrained(out, safe_serialization=True)",
           dir);
    fail("{}: no {} or {} found", dir, kSingleFile, kIndexFile);
  }

  const std::string index_path = index.string();
  const nlohmann::json j = read_json_file(index_path);
  if (!j.is_object()) fail("{}: expected a JSON object, got {}", index_path, j.type_name());
  auto wm = j.find("weight_map");
  if (wm == j.end()) fail("{}: missing 'weight_map'", index_path);
  if (!wm->is_object())
    fail("{}: 'weight_map' must be an object of tensor name -> file, got {}", index_path,
         wm->type_name());

  std::map<std::string, SafetensorsFile*> by_file;
  for (const auto& [name, file_json] : wm->items()) {
    if (!file_json.is_string())
      fail("{}: weight_map entry for '{}' must be a file name string, got {}", index_path, name,
           file_json.type_name());
    const std::string file = file_json.get<std::string>();
    const fs::path rel(file);
    bool escapes = rel.is_absolute() || rel.empty();
    for (const auto& part : rel) escapes = escapes || part == "..";
    if (escapes)
      fail("{}: weight_map entry for '{}' names '{}', which is not a file inside the model "
           "directory",
           index_path, name, file);
    auto it = by_file.find(file);
    if (it == by_file.end()) {
      const fs::path shard = root / rel;
      if (!is_file(shard))
        fail("{}: shard '{}' (holding tensor '{}') not found in {}", index_path, file, name, dir);
      m.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(shard.string())));
      it = by_file.emplace(file, m.files_.back().get()).first;
    }
    const TensorView* t = it->second->find(name);
    if (t == nullptr)
      fail("{}: tensor '{}' is listed in weight_map under '{}', but that file does not contain it",
           index_path, name, file);
    m.tensors_[name] = t;
  }
  return m;
}

const TensorView* ModelTensors::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

const TensorView& ModelTensors::get(const std::string& name) const {
  const TensorView* t = find(name);
  if (t == nullptr) fail("{}: tensor '{}' not found", dir_, name);
  return *t;
}

std::vector<std::string> ModelTensors::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

void write_model_safetensors(const std::string& dir, const std::vector<ModelTensorToWrite>& tensors,
                             size_t max_shard_bytes) {
  const fs::path root(dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) fail("{}: cannot create directory: {}", dir, ec.message());

  // Assign tensors to shards in the given order (transformers' greedy rule).
  std::vector<std::vector<size_t>> shards;
  std::set<std::string> seen;
  size_t shard_bytes = 0;
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ModelTensorToWrite& t = tensors[i];
    if (!seen.insert(t.name).second) fail("{}: tensor '{}' given twice", dir, t.name);
    size_t nbytes = dtype_size(t.storage);
    for (int64_t d : t.shape) nbytes *= static_cast<size_t>(std::max<int64_t>(d, 0));
    if (shards.empty() || (max_shard_bytes > 0 && shard_bytes > 0 &&
                           shard_bytes + nbytes > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += nbytes;
    total_bytes += nbytes;
  }
  if (shards.empty()) shards.emplace_back();

  std::set<std::string> written;
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string file = shards.size() == 1 ? kSingleFile : shard_name(k + 1, shards.size());
    SafetensorsWriter w;
    w.set_metadata("format", "pt");
    for (size_t i : shards[k]) {
      const ModelTensorToWrite& t = tensors[i];
      try {
        w.add_f32(t.name, t.shape, t.data, t.storage);
      } catch (const Error& e) {
        fail("{}: {}", (root / file).string(), e.what());
      }
      weight_map[t.name] = file;
    }
    w.write((root / file).string());
    written.insert(file);
  }
  if (shards.size() > 1) {
    nlohmann::json index;
    index["metadata"] = {{"total_size", total_bytes}};
    index["weight_map"] = std::move(weight_map);
    write_text_atomic(root / kIndexFile, index.dump(2) + "\n");
    written.insert(kIndexFile);
  }

  // Remove what an earlier save left behind and this one did not rewrite.
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name == kSingleFile || name == kIndexFile || is_shard_name(name);
    if (ours && written.count(name) == 0) fs::remove(entry.path(), ec);
  }
}

}  // namespace moetron
