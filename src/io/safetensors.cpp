#include "io/safetensors.h"
#include "core/json_limits.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <string_view>
#include <system_error>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/interrupt.h"

namespace moetron {

namespace {

using nlohmann::json;

// The reference library refuses headers above 100 MB; so do we (a bogus length would otherwise
// make us parse garbage for a long time).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

std::string errno_text(int err) { return std::generic_category().message(err); }

// numel of `shape` with overflow detection; false when the product does not fit in int64.
bool checked_numel(const std::vector<int64_t>& shape, int64_t* numel) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return false;
  }
  *numel = n;
  return true;
}

// Parses the header text, rejecting duplicate keys in any object (nlohmann keeps the last one
// silently; the reference library rejects them).
json parse_header(const std::string& path, std::string_view text) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth)
      fail("{}: header: JSON nested deeper than {} levels", path, kMaxJsonDepth);
    switch (event) {
      case json::parse_event_t::object_start: keys.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!keys.back().insert(key).second) {
          if (keys.size() == 1) fail("{}: header: duplicate tensor name '{}'", path, key);
          fail("{}: header: duplicate key '{}' in a nested object", path, key);
        }
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), callback);
  } catch (const json::exception& e) {
    fail("{}: header is not valid JSON: {}", path, e.what());
  }
}

void parse_metadata(const std::string& path, const json& value,
                    std::map<std::string, std::string>* out) {
  if (value.is_null()) return;
  if (!value.is_object())
    fail("{}: header: '__metadata__' must be an object of strings, got {}", path,
         value.type_name());
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string())
      fail("{}: header: '__metadata__' value for key '{}' must be a string, got {}", path, key,
           v.type_name());
    (*out)[key] = v.get<std::string>();
  }
}

TensorView parse_entry(const std::string& path, const std::string& name, const json& v,
                       size_t data_size) {
  if (!v.is_object())
    fail("{}: tensor '{}': header entry must be an object, got {}", path, name, v.type_name());
  TensorView t;
  t.name = name;
  t.file = path;

  auto dt = v.find("dtype");
  if (dt == v.end()) fail("{}: tensor '{}': missing 'dtype'", path, name);
  if (!dt->is_string())
    fail("{}: tensor '{}': 'dtype' must be a string, got {}", path, name, dt->type_name());
  try {
    t.dtype = dtype_from_string(dt->get<std::string>());
  } catch (const Error& e) {
    fail("{}: tensor '{}': {}", path, name, e.what());
  }

  auto sh = v.find("shape");
  if (sh == v.end()) fail("{}: tensor '{}': missing 'shape'", path, name);
  if (!sh->is_array())
    fail("{}: tensor '{}': 'shape' must be an array of integers, got {}", path, name,
         sh->type_name());
  for (const json& d : *sh) {
    if (!d.is_number_integer())
      fail("{}: tensor '{}': 'shape' must be an array of integers, found {}", path, name,
           json_preview(d));
    if (d.is_number_unsigned()) {
      const uint64_t u = d.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail("{}: tensor '{}': dimension {} is too large", path, name, u);
      t.shape.push_back(static_cast<int64_t>(u));
    } else {
      const int64_t s = d.get<int64_t>();
      if (s < 0)
        fail("{}: tensor '{}': negative dimension {} in shape {}", path, name, s, sh->dump());
      t.shape.push_back(s);
    }
  }
  int64_t numel = 0;
  uint64_t expected_bytes = 0;
  if (!checked_numel(t.shape, &numel) ||
      __builtin_mul_overflow(static_cast<uint64_t>(numel), dtype_size(t.dtype), &expected_bytes))
    fail("{}: tensor '{}': element count of shape {} overflows", path, name, sh->dump());

  auto off = v.find("data_offsets");
  if (off == v.end()) fail("{}: tensor '{}': missing 'data_offsets'", path, name);
  if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned())
    fail("{}: tensor '{}': 'data_offsets' must be [begin, end] with non-negative integers, got {}",
         path, name, off->dump());
  const uint64_t begin = (*off)[0].get<uint64_t>();
  const uint64_t end = (*off)[1].get<uint64_t>();
  if (begin > end)
    fail("{}: tensor '{}': data_offsets begin {} > end {}", path, name, begin, end);
  if (end > data_size)
    fail("{}: tensor '{}': data_offsets end {} is beyond the data section ({} bytes)", path, name,
         end, data_size);
  if (end - begin != expected_bytes)
    fail("{}: tensor '{}': data_offsets span {} bytes but shape {} of {} needs {} bytes", path,
         name, end - begin, sh->dump(), dtype_name(t.dtype), expected_bytes);
  t.nbytes = static_cast<size_t>(end - begin);
  t.data = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(begin));  // rebased by caller
  return t;
}

void check_float_dtype(const TensorView& t, const char* op) {
  if (!dtype_is_float(t.dtype))
    fail("{}: tensor '{}': {} needs F32, F16 or BF16, but the tensor is {}", t.file, t.name, op,
         dtype_name(t.dtype));
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.file_ = MappedFile::open(path, /*keep_fd=*/true);
  const uint8_t* base = f.file_.data();
  const size_t size = f.file_.size();
  if (size < 8)
    fail("{}: not a safetensors file: {} bytes, too short for the 8-byte header length", path,
         size);
  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);
  if (header_len > size - 8)
    fail("{}: header length {} exceeds the {} bytes that follow it in the file", path, header_len,
         size - 8);
  if (header_len > kMaxHeaderBytes)
    fail("{}: header length {} exceeds the {}-byte limit", path, header_len, kMaxHeaderBytes);

  const json header = parse_header(
      path, std::string_view(reinterpret_cast<const char*>(base + 8), header_len));
  if (!header.is_object())
    fail("{}: header must be a JSON object, got {}", path, header.type_name());

  const size_t data_start = 8 + static_cast<size_t>(header_len);
  const size_t data_size = size - data_start;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      parse_metadata(path, value, &f.metadata_);
      continue;
    }
    TensorView t = parse_entry(path, name, value, data_size);
    t.data = base + data_start + reinterpret_cast<uintptr_t>(t.data);
    t.mapped = true;
    t.map_base = base;
    t.map_fd = f.file_.fd();
    f.tensors_.emplace(name, std::move(t));
  }

  // The tensors must tile the data section exactly.
  std::vector<std::tuple<size_t, size_t, const std::string*>> spans;
  spans.reserve(f.tensors_.size());
  for (const auto& [name, t] : f.tensors_) {
    const size_t begin = static_cast<size_t>(t.data - (base + data_start));
    spans.emplace_back(begin, begin + t.nbytes, &name);
  }
  std::sort(spans.begin(), spans.end());
  size_t pos = 0;
  const std::string* prev = nullptr;
  for (const auto& [begin, end, name] : spans) {
    if (begin < pos)
      fail("{}: tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (ending at {})", path, *name,
           begin, end, *prev, pos);
    if (begin > pos)
      fail("{}: data bytes [{}, {}) before tensor '{}' are not covered by any tensor", path, pos,
           begin, *name);
    pos = end;
    prev = name;
  }
  if (pos != data_size)
    fail("{}: data section has {} trailing bytes (from offset {}) not covered by any tensor", path,
         data_size - pos, pos);
  return f;
}

const TensorView* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorView& SafetensorsFile::get(const std::string& name) const {
  const TensorView* t = find(name);
  if (t == nullptr) fail("{}: tensor '{}' not found", path(), name);
  return *t;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

void read_f32(const TensorView& t, float* out, size_t expected_numel) {
  check_float_dtype(t, "read_f32");
  const int64_t n = t.numel();
  if (static_cast<size_t>(n) != expected_numel)
    fail("{}: tensor '{}': has {} elements (shape [{}]), expected {}", t.file, t.name, n,
         fmt::join(t.shape, ", "), expected_numel);
  convert_to_f32(out, t.data, t.dtype, static_cast<size_t>(n));
  release_pages(t);
}

std::vector<float> to_f32(const TensorView& t) {
  check_float_dtype(t, "to_f32");
  std::vector<float> out(static_cast<size_t>(t.numel()));
  convert_to_f32(out.data(), t.data, t.dtype, out.size());
  return out;
}

std::vector<int64_t> to_i64(const TensorView& t) {
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<int64_t> out(n);
  switch (t.dtype) {
    case DType::I64:
      if (n > 0) std::memcpy(out.data(), t.data, n * 8);
      break;
    case DType::I32:
      for (size_t i = 0; i < n; ++i) {
        int32_t v;
        std::memcpy(&v, t.data + 4 * i, 4);
        out[i] = v;
      }
      break;
    case DType::U8:
      for (size_t i = 0; i < n; ++i) out[i] = t.data[i];
      break;
    case DType::BOOL:
      for (size_t i = 0; i < n; ++i) out[i] = t.data[i] != 0 ? 1 : 0;
      break;
    default:
      fail("{}: tensor '{}': to_i64 needs I32, I64, U8 or BOOL, but the tensor is {}", t.file,
           t.name, dtype_name(t.dtype));
  }
  return out;
}

void read_f32_rows(const TensorView& t, int64_t row_begin, int64_t row_end, float* out) {
  check_float_dtype(t, "read_f32_rows");
  if (t.shape.empty())
    fail("{}: tensor '{}': read_f32_rows needs at least one dimension, the tensor is 0-d", t.file,
         t.name);
  if (row_begin < 0 || row_begin > row_end || row_end > t.shape[0])
    fail("{}: tensor '{}': row range [{}, {}) is outside [0, {})", t.file, t.name, row_begin,
         row_end, t.shape[0]);
  read_f32_slice(t, 0, row_begin, row_end, out);
}

void read_f32_slice(const TensorView& t, int dim, int64_t begin, int64_t end, float* out) {
  check_float_dtype(t, "read_f32_slice");
  const int ndim = static_cast<int>(t.shape.size());
  if (dim < 0 || dim >= ndim)
    fail("{}: tensor '{}': read_f32_slice dim {} is outside [0, {}) for shape [{}]", t.file, t.name, dim,
         ndim, fmt::join(t.shape, ", "));
  const int64_t n = t.shape[static_cast<size_t>(dim)];
  if (begin < 0 || begin > end || end > n)
    fail("{}: tensor '{}': slice [{}, {}) of dim {} is outside [0, {})", t.file, t.name, begin, end, dim, n);
  size_t outer = 1, inner = 1;
  for (int d = 0; d < dim; d++) outer *= static_cast<size_t>(t.shape[static_cast<size_t>(d)]);
  for (int d = dim + 1; d < ndim; d++) inner *= static_cast<size_t>(t.shape[static_cast<size_t>(d)]);
  const size_t esize = dtype_size(t.dtype);
  const size_t width = static_cast<size_t>(end - begin) * inner;  // contiguous elements per outer index
  if (width == 0) return;
  for (size_t o = 0; o < outer; o++) {
    const uint8_t* src = t.data + (o * static_cast<size_t>(n) + static_cast<size_t>(begin)) * inner * esize;
    convert_to_f32(out + o * width, src, t.dtype, width);
  }
  if (t.mapped) {
    const uint8_t* first = t.data + static_cast<size_t>(begin) * inner * esize;
    const uint8_t* last = t.data + ((outer - 1) * static_cast<size_t>(n) + static_cast<size_t>(end)) * inner * esize;
    release_mapped_pages(first, static_cast<size_t>(last - first));
  }
}

TensorView select_index(const TensorView& t, int64_t index) {
  if (t.shape.empty())
    fail("{}: tensor '{}': cannot select an index of a 0-d tensor", t.file, t.name);
  if (index < 0 || index >= t.shape[0])
    fail("{}: tensor '{}': index {} is outside [0, {})", t.file, t.name, index, t.shape[0]);
  TensorView sub = t;
  sub.name = fmt::format("{}[{}]", t.name, index);
  sub.shape.erase(sub.shape.begin());
  sub.nbytes = t.nbytes / static_cast<size_t>(t.shape[0]);
  sub.data = t.data + static_cast<size_t>(index) * sub.nbytes;
  return sub;
}

void release_pages(const TensorView& t) {
  if (t.mapped) release_mapped_pages(t.data, t.nbytes);
}

void read_stored_bytes(const TensorView& t, size_t at, size_t n, void* dst) {
  if (at > t.nbytes || n > t.nbytes - at)
    fail("{}: tensor '{}': {} bytes at offset {} are outside its {} bytes", t.file, t.name, n, at, t.nbytes);
  if (n == 0) return;
  if (!t.mapped) {
    std::memcpy(dst, t.data + at, n);
    return;
  }
  MOETRON_ASSERT(t.map_fd >= 0 && t.map_base != nullptr);
  const off_t offset = static_cast<off_t>(t.data - t.map_base + at);
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(t.map_fd, static_cast<uint8_t*>(dst) + done, n - done, offset + static_cast<off_t>(done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = got < 0 ? errno : 0;
      fail("{}: reading tensor '{}' (bytes {}..{} of the file): {}", t.file, t.name, offset + done, offset + n,
           got < 0 ? std::strerror(err) : "the file ended early (changed since it was opened?)");
    }
    done += static_cast<size_t>(got);
  }
}

// ---------------------------------------------------------------------------------------------
// Writer

SafetensorsWriter::Entry& SafetensorsWriter::insert(const std::string& name, DType dtype,
                                                    const std::vector<int64_t>& shape,
                                                    const void* data, bool from_f32) {
  if (name.empty()) fail("safetensors writer: tensor name must not be empty");
  if (name == "__metadata__") fail("safetensors writer: '__metadata__' is not a valid tensor name");
  if (entries_.count(name) != 0) fail("safetensors writer: tensor '{}' added twice", name);
  for (int64_t d : shape)
    if (d < 0) fail("safetensors writer: tensor '{}': negative dimension {}", name, d);
  int64_t numel = 0;
  size_t nbytes = 0;
  if (!checked_numel(shape, &numel) ||
      __builtin_mul_overflow(static_cast<size_t>(numel), dtype_size(dtype), &nbytes))
    fail("safetensors writer: tensor '{}': element count overflows", name);
  if (nbytes > 0 && data == nullptr) fail("safetensors writer: tensor '{}': data is null", name);
  Entry& e = entries_[name];
  e.dtype = dtype;
  e.shape = shape;
  e.nbytes = nbytes;
  e.data = data;
  e.from_f32 = from_f32;
  return e;
}

void SafetensorsWriter::add(const std::string& name, DType dtype,
                            const std::vector<int64_t>& shape, const void* data) {
  insert(name, dtype, shape, data, false);
}

void SafetensorsWriter::add_copy(const std::string& name, DType dtype,
                                 const std::vector<int64_t>& shape, const void* data) {
  Entry& e = insert(name, dtype, shape, data, false);
  const auto* bytes = static_cast<const uint8_t*>(data);
  e.owned.assign(bytes, bytes + e.nbytes);
  e.data = e.owned.data();
}

void SafetensorsWriter::add_f32(const std::string& name, const std::vector<int64_t>& shape,
                                const float* data, DType storage) {
  if (!dtype_is_float(storage))
    fail("safetensors writer: tensor '{}': fp32 data cannot be stored as {}", name,
         dtype_name(storage));
  insert(name, storage, shape, data, true);
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

size_t SafetensorsWriter::data_bytes() const {
  size_t total = 0;
  for (const auto& kv : entries_) total += kv.second.nbytes;
  return total;
}

namespace {

// Owns the temporary file until it is renamed into place; removes it if anything fails.
class TmpFile {
 public:
  TmpFile(std::string tmp, std::string final_path)
      : tmp_(std::move(tmp)), final_(std::move(final_path)) {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("{}: cannot create: {}", tmp_, errno_text(errno));
  }
  ~TmpFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  void write_all(const void* data, size_t n) {
    check_interrupted();  // Ctrl-C: unwind, and the destructor removes the temporary
    const auto* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        fail("{}: write failed: {}", tmp_, errno_text(errno));
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  void commit() {
    if (::fsync(fd_) != 0) fail("{}: fsync failed: {}", tmp_, errno_text(errno));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("{}: close failed: {}", tmp_, errno_text(errno));
    if (::rename(tmp_.c_str(), final_.c_str()) != 0)
      fail("{}: cannot rename {} into place: {}", final_, tmp_, errno_text(errno));
    committed_ = true;
    // Make the rename durable.
    const std::filesystem::path parent = std::filesystem::path(final_).parent_path();
    const int dfd =
        ::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  std::string tmp_, final_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

void SafetensorsWriter::write(const std::string& path) const {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json md = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) md[k] = v;
    header["__metadata__"] = std::move(md);
  }
  size_t offset = 0;
  for (const auto& [name, e] : entries_) {
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = dtype_name(e.dtype);
    entry["shape"] = e.shape;
    entry["data_offsets"] = nlohmann::ordered_json::array({offset, offset + e.nbytes});
    header[name] = std::move(entry);
    offset += e.nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_len = text.size();

  TmpFile out(path + ".tmp", path);
  out.write_all(&header_len, 8);
  out.write_all(text.data(), text.size());
  constexpr size_t kChunk = size_t{1} << 20;  // elements converted per write
  std::vector<uint8_t> buf;
  for (const auto& [name, e] : entries_) {
    if (!e.from_f32 || e.dtype == DType::F32) {
      if (e.nbytes > 0) out.write_all(e.data, e.nbytes);
      continue;
    }
    const auto* src = static_cast<const float*>(e.data);
    const size_t esize = dtype_size(e.dtype);
    const size_t n = e.nbytes / esize;
    buf.resize(std::min(n, kChunk) * esize);
    for (size_t i = 0; i < n; i += kChunk) {
      const size_t m = std::min(kChunk, n - i);
      convert_from_f32(buf.data(), e.dtype, src + i, m);
      out.write_all(buf.data(), m * esize);
    }
  }
  out.commit();
}

}  // namespace moetron
