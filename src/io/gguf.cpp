#include "io/gguf.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/interrupt.h"

namespace moetron::gguf {

namespace fs = std::filesystem;

namespace {

// ggml's GGML_MAX_NAME is 64 including the terminator: llama.cpp refuses longer tensor names.
constexpr size_t kMaxTensorName = 63;

constexpr TensorTypeTraits kTypes[] = {
    {TensorType::F32, "f32", 1, 4},
    {TensorType::F16, "f16", 1, 2},
    {TensorType::BF16, "bf16", 1, 2},
    {TensorType::Q8_0, "q8_0", kQ8_0Block, 2 + kQ8_0Block},  // block_q8_0: f16 d, then int8 qs[32]
};

bool is_signed(ValueType t) {
  return t == ValueType::i8 || t == ValueType::i16 || t == ValueType::i32 || t == ValueType::i64;
}
// Bytes of a fixed-size scalar (0 for string / array).
size_t scalar_bytes(ValueType t) {
  switch (t) {
    case ValueType::u8:
    case ValueType::i8:
    case ValueType::boolean:
      return 1;
    case ValueType::u16:
    case ValueType::i16:
      return 2;
    case ValueType::u32:
    case ValueType::i32:
    case ValueType::f32:
      return 4;
    case ValueType::u64:
    case ValueType::i64:
    case ValueType::f64:
      return 8;
    default:
      return 0;
  }
}
bool known_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::f64); }

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// ---- writing ----------------------------------------------------------------------------------

// Buffered writes to a file descriptor.
class Out {
 public:
  Out(int fd, std::string path) : fd_(fd), path_(std::move(path)) { buf_.reserve(kFlushBytes); }
  void bytes(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), c, c + n);
    written_ += n;
    if (buf_.size() >= kFlushBytes) flush();
  }
  // n bytes at the end of the buffer for the caller to fill.
  uint8_t* reserve(size_t n) {
    const size_t at = buf_.size();
    buf_.resize(at + n);
    written_ += n;
    return buf_.data() + at;
  }
  void maybe_flush() {
    if (buf_.size() >= kFlushBytes) flush();
  }
  template <class T>
  void pod(T v) {
    bytes(&v, sizeof v);
  }
  void str(const std::string& s) {
    pod<uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  void zeros(size_t n) {
    static constexpr uint8_t z[64] = {};
    while (n > 0) {
      const size_t k = std::min(n, sizeof z);
      bytes(z, k);
      n -= k;
    }
  }
  uint64_t written() const { return written_; }
  void flush() {
    check_interrupted();  // Ctrl-C: unwind, and the writer removes the temporary
    size_t at = 0;
    while (at < buf_.size()) {
      const ssize_t k = ::write(fd_, buf_.data() + at, buf_.size() - at);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) fail("{}: write failed: {}", path_, std::strerror(errno));
      at += static_cast<size_t>(k);
    }
    buf_.clear();
  }

 private:
  static constexpr size_t kFlushBytes = size_t{4} << 20;
  int fd_;
  std::string path_;
  std::vector<uint8_t> buf_;
  uint64_t written_ = 0;
};

template <class T>
T checked(uint64_t u, int64_t i, bool from_signed, const std::string& key) {
  if (from_signed) {
    if (i < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
        (i > 0 && static_cast<uint64_t>(i) > static_cast<uint64_t>(std::numeric_limits<T>::max())))
      fail("gguf: key '{}': value {} does not fit its type", key, i);
    return static_cast<T>(i);
  }
  if (u > static_cast<uint64_t>(std::numeric_limits<T>::max()))
    fail("gguf: key '{}': value {} does not fit its type", key, u);
  return static_cast<T>(u);
}

void put_number(Out& out, ValueType t, uint64_t u, int64_t i, double f, const std::string& key) {
  const bool s = is_signed(t);
  switch (t) {
    case ValueType::u8:
      out.pod(checked<uint8_t>(u, i, s, key));
      break;
    case ValueType::i8:
      out.pod(checked<int8_t>(u, i, s, key));
      break;
    case ValueType::u16:
      out.pod(checked<uint16_t>(u, i, s, key));
      break;
    case ValueType::i16:
      out.pod(checked<int16_t>(u, i, s, key));
      break;
    case ValueType::u32:
      out.pod(checked<uint32_t>(u, i, s, key));
      break;
    case ValueType::i32:
      out.pod(checked<int32_t>(u, i, s, key));
      break;
    case ValueType::u64:
      out.pod(u);
      break;
    case ValueType::i64:
      out.pod(i);
      break;
    case ValueType::boolean:
      if (u > 1) fail("gguf: key '{}': boolean value {}", key, u);
      out.pod<uint8_t>(static_cast<uint8_t>(u));
      break;
    case ValueType::f32:
      if (std::isfinite(f) && std::fabs(f) > std::numeric_limits<float>::max())
        fail("gguf: key '{}': value {} does not fit float32", key, f);
      out.pod(static_cast<float>(f));
      break;
    case ValueType::f64:
      out.pod(f);
      break;
    default:
      fail("gguf: key '{}': {} is not a number type", key, value_type_name(t));
  }
}

void put_value(Out& out, const std::string& key, const Value& v) {
  out.pod(static_cast<uint32_t>(v.type));
  if (v.type == ValueType::string) {
    out.str(v.s);
    return;
  }
  if (v.type != ValueType::array) {
    put_number(out, v.type, v.u, v.i, v.f, key);
    return;
  }
  const ValueType e = v.elem_type;
  if (e == ValueType::array || !known_type(static_cast<uint32_t>(e)))
    fail("gguf: key '{}': arrays of {} are not supported", key, value_type_name(e));
  out.pod(static_cast<uint32_t>(e));
  out.pod<uint64_t>(v.size());
  if (e == ValueType::string) {
    for (const std::string& s : v.sa) out.str(s);
  } else if (e == ValueType::f32 || e == ValueType::f64) {
    for (double f : v.fa) put_number(out, e, 0, 0, f, key);
  } else if (is_signed(e)) {
    for (int64_t i : v.ia) put_number(out, e, 0, i, 0, key);
  } else {
    for (uint64_t u : v.ua) put_number(out, e, u, 0, 0, key);
  }
}

class FileSink final : public TensorSink {
 public:
  FileSink(Out& out, const TensorToWrite& t, uint64_t numel) : out_(out), t_(t), numel_(numel) {}
  void put(const float* values, size_t n) override {
    const TensorTypeTraits& tr = tensor_type_traits(t_.type);
    if (n % static_cast<size_t>(tr.block_elems) != 0)
      fail("gguf: tensor '{}': {} values is not a whole number of {}-value blocks", t_.name, n, tr.block_elems);
    if (n > numel_ - done_) fail("gguf: tensor '{}' was given more than its {} values", t_.name, numel_);
    if (t_.type == TensorType::F16 || t_.type == TensorType::BF16)
      check_representable(values, n, t_.type == TensorType::F16 ? DType::F16 : DType::BF16,
                          fmt::format("gguf: tensor '{}'", t_.name), done_);
    encode_f32(t_.type, values, n, out_.reserve(n / static_cast<size_t>(tr.block_elems) * tr.block_bytes));
    out_.maybe_flush();
    done_ += n;
  }
  uint64_t done() const { return done_; }

 private:
  Out& out_;
  const TensorToWrite& t_;
  uint64_t numel_, done_ = 0;
};

void fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open for fsync: {}", path, std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail("{}: fsync failed: {}", path, std::strerror(errno));
}

// ---- reading ----------------------------------------------------------------------------------

class Cursor {
 public:
  Cursor(const uint8_t* p, uint64_t n, const std::string& path) : p_(p), n_(n), path_(path) {}
  uint64_t at() const { return at_; }
  void need(uint64_t k, const char* what) const {
    if (k > n_ - at_) fail("{}: {} at byte {} runs past the end of the file ({} bytes)", path_, what, at_, n_);
  }
  template <class T>
  T pod(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  std::string str(const char* what) {
    const uint64_t len = pod<uint64_t>(what);
    need(len, what);
    std::string s(reinterpret_cast<const char*>(p_ + at_), static_cast<size_t>(len));
    at_ += len;
    return s;
  }
  [[noreturn]] void bad(const std::string& msg) const { fail("{}: {} (at byte {})", path_, msg, at_); }

 private:
  const uint8_t* p_;
  uint64_t n_, at_ = 0;
  const std::string& path_;
};

// One number of type t into the Value's widened slots (scalar) or arrays (append).
void read_number(Cursor& c, ValueType t, Value& v, bool append) {
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0;
  switch (t) {
    case ValueType::u8:
      u = c.pod<uint8_t>("a u8");
      break;
    case ValueType::i8:
      i = c.pod<int8_t>("an i8");
      break;
    case ValueType::u16:
      u = c.pod<uint16_t>("a u16");
      break;
    case ValueType::i16:
      i = c.pod<int16_t>("an i16");
      break;
    case ValueType::u32:
      u = c.pod<uint32_t>("a u32");
      break;
    case ValueType::i32:
      i = c.pod<int32_t>("an i32");
      break;
    case ValueType::u64:
      u = c.pod<uint64_t>("a u64");
      break;
    case ValueType::i64:
      i = c.pod<int64_t>("an i64");
      break;
    case ValueType::f32:
      f = c.pod<float>("an f32");
      break;
    case ValueType::f64:
      f = c.pod<double>("an f64");
      break;
    case ValueType::boolean: {
      const uint8_t b = c.pod<uint8_t>("a bool");
      if (b > 1) c.bad(fmt::format("boolean value {}", b));
      u = b;
      break;
    }
    default:
      c.bad(fmt::format("{} is not a number type", value_type_name(t)));
  }
  if (!append) {
    v.u = u, v.i = i, v.f = f;
  } else if (t == ValueType::f32 || t == ValueType::f64) {
    v.fa.push_back(f);
  } else if (is_signed(t)) {
    v.ia.push_back(i);
  } else {
    v.ua.push_back(u);
  }
}

ValueType read_type(Cursor& c, const char* what) {
  const uint32_t t = c.pod<uint32_t>(what);
  if (!known_type(t)) c.bad(fmt::format("unknown value type {}", t));
  return static_cast<ValueType>(t);
}

Value read_value(Cursor& c) {
  Value v;
  v.type = read_type(c, "a value type");
  if (v.type == ValueType::string) {
    v.s = c.str("a string value");
  } else if (v.type != ValueType::array) {
    read_number(c, v.type, v, false);
  } else {
    v.elem_type = read_type(c, "an array's element type");
    if (v.elem_type == ValueType::array) c.bad("nested arrays are not supported");
    const uint64_t n = c.pod<uint64_t>("an array's length");
    // Every element takes at least one byte (8 for a string's length): a count the file cannot hold
    // is refused before anything is allocated.
    const uint64_t min_bytes = v.elem_type == ValueType::string ? 8 : scalar_bytes(v.elem_type);
    if (min_bytes > 0 && n > UINT64_MAX / min_bytes) c.bad("array too long");
    c.need(n * min_bytes, "an array");
    if (v.elem_type == ValueType::string) {
      v.sa.reserve(static_cast<size_t>(n));
      for (uint64_t k = 0; k < n; k++) v.sa.push_back(c.str("an array string"));
    } else {
      for (uint64_t k = 0; k < n; k++) read_number(c, v.elem_type, v, true);
    }
  }
  return v;
}

}  // namespace

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::u8:
      return "u8";
    case ValueType::i8:
      return "i8";
    case ValueType::u16:
      return "u16";
    case ValueType::i16:
      return "i16";
    case ValueType::u32:
      return "u32";
    case ValueType::i32:
      return "i32";
    case ValueType::f32:
      return "f32";
    case ValueType::boolean:
      return "bool";
    case ValueType::string:
      return "string";
    case ValueType::array:
      return "array";
    case ValueType::u64:
      return "u64";
    case ValueType::i64:
      return "i64";
    case ValueType::f64:
      return "f64";
  }
  return "unknown";
}

Value Value::u32(uint32_t v) {
  Value x;
  x.type = ValueType::u32;
  x.u = v;
  return x;
}
Value Value::i32(int32_t v) {
  Value x;
  x.type = ValueType::i32;
  x.i = v;
  return x;
}
Value Value::f32(float v) {
  Value x;
  x.type = ValueType::f32;
  x.f = v;
  return x;
}
Value Value::boolean(bool v) {
  Value x;
  x.type = ValueType::boolean;
  x.u = v ? 1 : 0;
  return x;
}
Value Value::str(std::string v) {
  Value x;
  x.type = ValueType::string;
  x.s = std::move(v);
  return x;
}
Value Value::strings(std::vector<std::string> v) {
  Value x;
  x.type = ValueType::array;
  x.elem_type = ValueType::string;
  x.sa = std::move(v);
  return x;
}
Value Value::f32s(const std::vector<float>& v) {
  Value x;
  x.type = ValueType::array;
  x.elem_type = ValueType::f32;
  x.fa.assign(v.begin(), v.end());
  return x;
}
Value Value::i32s(const std::vector<int32_t>& v) {
  Value x;
  x.type = ValueType::array;
  x.elem_type = ValueType::i32;
  x.ia.assign(v.begin(), v.end());
  return x;
}
size_t Value::size() const {
  if (type != ValueType::array) return 0;
  if (elem_type == ValueType::string) return sa.size();
  if (elem_type == ValueType::f32 || elem_type == ValueType::f64) return fa.size();
  return is_signed(elem_type) ? ia.size() : ua.size();
}

const TensorTypeTraits& tensor_type_traits(uint32_t type) {
  for (const TensorTypeTraits& t : kTypes)
    if (static_cast<uint32_t>(t.type) == type) return t;
  fail("gguf: tensor type {} is not supported (f32 = 0, f16 = 1, q8_0 = 8, bf16 = 30)", type);
}

uint64_t tensor_bytes(TensorType type, const std::vector<int64_t>& ne) {
  const TensorTypeTraits& tr = tensor_type_traits(type);
  if (ne.empty() || ne.size() > static_cast<size_t>(kMaxDims)) fail("gguf: a tensor has {} dims (1..4)", ne.size());
  uint64_t n = 1;
  for (int64_t d : ne) {
    if (d < 1) fail("gguf: a tensor dimension is {} (must be >= 1)", d);
    if (n > (uint64_t{1} << 62) / static_cast<uint64_t>(d)) fail("gguf: tensor size overflows");
    n *= static_cast<uint64_t>(d);
  }
  if (ne[0] % tr.block_elems != 0)
    fail("gguf: a {} row of {} values is not a whole number of {}-value blocks", tr.name, ne[0], tr.block_elems);
  const uint64_t blocks = n / static_cast<uint64_t>(tr.block_elems);
  // The bytes too must stay far from 2^64 (a 2^62-value f32 tensor is 2^64 bytes: 0 when wrapped).
  if (blocks > (uint64_t{1} << 62) / tr.block_bytes) fail("gguf: tensor size overflows");
  return blocks * tr.block_bytes;
}

void encode_f32(TensorType type, const float* src, size_t n, void* dst) {
  switch (type) {
    case TensorType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case TensorType::F16:
      convert_from_f32(dst, DType::F16, src, n);
      return;
    case TensorType::BF16:
      convert_from_f32(dst, DType::BF16, src, n);
      return;
    case TensorType::Q8_0: {
      uint8_t* out = static_cast<uint8_t*>(dst);
      for (size_t b = 0; b < n / kQ8_0Block; b++, out += 2 + kQ8_0Block) {
        float d;
        quantize_q8_0_block(src + b * kQ8_0Block, reinterpret_cast<int8_t*>(out + 2), d);
        if (!(d <= 65504.0f))
          fail("gguf: a Q8_0 block holds {} (its scale is beyond f16, or a value is not finite)",
               std::isfinite(d) ? "values beyond 65504 * 127" : "a non-finite value");
        const uint16_t h = f32_to_f16(d);
        std::memcpy(out, &h, 2);
      }
      return;
    }
  }
  fail("gguf: no encoder for tensor type {}", static_cast<uint32_t>(type));
}

void decode_f32(TensorType type, const void* src, size_t n, float* out) {
  switch (type) {
    case TensorType::F32:
      convert_to_f32(out, src, DType::F32, n);
      return;
    case TensorType::F16:
      convert_to_f32(out, src, DType::F16, n);
      return;
    case TensorType::BF16:
      convert_to_f32(out, src, DType::BF16, n);
      return;
    case TensorType::Q8_0: {
      const uint8_t* in = static_cast<const uint8_t*>(src);
      for (size_t b = 0; b < n / kQ8_0Block; b++, in += 2 + kQ8_0Block) {
        uint16_t h;
        std::memcpy(&h, in, 2);
        const float d = f16_to_f32(h);
        for (int i = 0; i < kQ8_0Block; i++) out[b * kQ8_0Block + i] = (float)static_cast<int8_t>(in[2 + i]) * d;
      }
      return;
    }
  }
  fail("gguf: no decoder for tensor type {}", static_cast<uint32_t>(type));
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

void write_file(const std::string& path, const KeyValues& kv, const std::vector<TensorToWrite>& tensors) {
  uint64_t alignment = kDefaultAlignment;
  {
    std::set<std::string> keys;
    for (const auto& [key, v] : kv) {
      if (key.empty()) fail("gguf: an empty key");
      if (!keys.insert(key).second) fail("gguf: key '{}' given twice", key);
      if (key == "general.alignment") {
        if (v.type != ValueType::u32 || v.u == 0 || (v.u & (v.u - 1)) != 0)
          fail("gguf: general.alignment must be a u32 power of two");
        alignment = v.u;
      }
    }
  }
  std::vector<uint64_t> offsets, sizes;
  uint64_t data_bytes = 0;
  {
    std::set<std::string> names;
    for (const TensorToWrite& t : tensors) {
      if (t.name.empty() || t.name.size() > kMaxTensorName)
        fail("gguf: tensor name '{}' must have 1..{} bytes", t.name, kMaxTensorName);
      if (!names.insert(t.name).second) fail("gguf: tensor '{}' given twice", t.name);
      if (!t.fill) fail("gguf: tensor '{}' has no fill callback", t.name);
      data_bytes = align_up(data_bytes, alignment);
      offsets.push_back(data_bytes);
      sizes.push_back(tensor_bytes(t.type, t.ne));
      data_bytes += sizes.back();
    }
  }

  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp = (dir / fmt::format(".{}.tmp-{}", target.filename().string(), ::getpid())).string();
  ::unlink(tmp.c_str());  // a stale temporary of this process id's name (ours by its name)
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail("{}: cannot create: {}", tmp, std::strerror(errno));
  try {
    Out out(fd, tmp);
    out.pod(kMagic);
    out.pod(kVersion);
    out.pod<uint64_t>(tensors.size());
    out.pod<uint64_t>(kv.size());
    for (const auto& [key, v] : kv) {
      out.str(key);
      put_value(out, key, v);
    }
    for (size_t k = 0; k < tensors.size(); k++) {
      const TensorToWrite& t = tensors[k];
      out.str(t.name);
      out.pod<uint32_t>(static_cast<uint32_t>(t.ne.size()));
      for (int64_t d : t.ne) out.pod<uint64_t>(static_cast<uint64_t>(d));
      out.pod(static_cast<uint32_t>(t.type));
      out.pod<uint64_t>(offsets[k]);
    }
    out.zeros(align_up(out.written(), alignment) - out.written());
    const uint64_t data_start = out.written();
    for (size_t k = 0; k < tensors.size(); k++) {
      const TensorToWrite& t = tensors[k];
      out.zeros(data_start + offsets[k] - out.written());
      const uint64_t numel = sizes[k] / tensor_type_traits(t.type).block_bytes *
                             static_cast<uint64_t>(tensor_type_traits(t.type).block_elems);
      FileSink sink(out, t, numel);
      t.fill(sink);
      if (sink.done() != numel) fail("gguf: tensor '{}' was given {} of its {} values", t.name, sink.done(), numel);
    }
    out.flush();
    if (::fsync(fd) != 0) fail("{}: fsync failed: {}", tmp, std::strerror(errno));
    if (::close(fd) != 0) {
      ::unlink(tmp.c_str());
      fail("{}: close failed: {}", tmp, std::strerror(errno));
    }
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    fail("{}: cannot rename {} into place: {}", path, tmp, std::strerror(e));
  }
  fsync_path(dir.string(), O_RDONLY | O_DIRECTORY);
}

File File::open(const std::string& path) {
  File f;
  f.map_ = MappedFile::open(path);
  Cursor c(f.map_.data(), f.map_.size(), path);
  if (c.pod<uint32_t>("the magic") != kMagic) fail("{}: not a GGUF file (bad magic)", path);
  f.version_ = c.pod<uint32_t>("the version");
  if (f.version_ != kVersion) fail("{}: GGUF version {} (only version {} is read)", path, f.version_, kVersion);
  const uint64_t n_tensors = c.pod<uint64_t>("the tensor count");
  const uint64_t n_kv = c.pod<uint64_t>("the key count");
  // A key takes at least 12 bytes and a tensor info 32: counts the file cannot hold are refused.
  c.need(n_kv > f.map_.size() / 12 ? UINT64_MAX : n_kv * 12, "the key-value section");
  std::set<std::string> keys;
  for (uint64_t k = 0; k < n_kv; k++) {
    std::string key = c.str("a key");
    if (!keys.insert(key).second) c.bad(fmt::format("key '{}' appears twice", key));
    Value v = read_value(c);
    if (key == "general.alignment") {
      if (v.type != ValueType::u32 || v.u == 0 || (v.u & (v.u - 1)) != 0)
        c.bad("general.alignment is not a u32 power of two");
      f.alignment_ = v.u;
    }
    f.kv_.emplace_back(std::move(key), std::move(v));
  }
  c.need(n_tensors > f.map_.size() / 32 ? UINT64_MAX : n_tensors * 32, "the tensor infos");
  std::set<std::string> names;
  for (uint64_t k = 0; k < n_tensors; k++) {
    TensorInfo t;
    t.name = c.str("a tensor name");
    if (!names.insert(t.name).second) c.bad(fmt::format("tensor '{}' appears twice", t.name));
    const uint32_t n_dims = c.pod<uint32_t>("a tensor's dims");
    if (n_dims < 1 || n_dims > static_cast<uint32_t>(kMaxDims))
      c.bad(fmt::format("tensor '{}' has {} dims (1..{})", t.name, n_dims, kMaxDims));
    for (uint32_t d = 0; d < n_dims; d++) {
      const uint64_t ne = c.pod<uint64_t>("a tensor dimension");
      if (ne < 1 || ne > (uint64_t{1} << 62)) c.bad(fmt::format("tensor '{}' has dimension {}", t.name, ne));
      t.ne.push_back(static_cast<int64_t>(ne));
    }
    const uint32_t type = c.pod<uint32_t>("a tensor type");
    try {
      t.type = tensor_type_traits(type).type;
      t.bytes = tensor_bytes(t.type, t.ne);
    } catch (const Error& e) {
      c.bad(fmt::format("tensor '{}': {}", t.name, e.what()));
    }
    t.offset = c.pod<uint64_t>("a tensor offset");
    f.tensors_.push_back(std::move(t));
  }
  f.data_offset_ = align_up(c.at(), f.alignment_);
  if (f.data_offset_ > f.map_.size() && !f.tensors_.empty()) fail("{}: no data section", path);
  std::vector<std::pair<uint64_t, const TensorInfo*>> spans;
  for (const TensorInfo& t : f.tensors_) {
    if (t.offset % f.alignment_ != 0)
      fail("{}: tensor '{}' offset {} is not aligned to {}", path, t.name, t.offset, f.alignment_);
    const uint64_t avail = f.map_.size() - f.data_offset_;
    if (t.offset > avail || t.bytes > avail - t.offset)
      fail("{}: tensor '{}' ({} bytes at data offset {}) runs past the end of the file", path, t.name, t.bytes,
           t.offset);
    spans.emplace_back(t.offset, &t);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t k = 1; k < spans.size(); k++)
    if (spans[k - 1].first + spans[k - 1].second->bytes > spans[k].first)
      fail("{}: tensors '{}' and '{}' overlap", path, spans[k - 1].second->name, spans[k].second->name);
  return f;
}

const Value* File::find(const std::string& key) const {
  for (const auto& [k, v] : kv_)
    if (k == key) return &v;
  return nullptr;
}

const TensorInfo* File::find_tensor(const std::string& name) const {
  for (const TensorInfo& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::vector<float> File::to_f32(const TensorInfo& t) const {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  decode_f32(t.type, data(t), out.size(), out.data());
  return out;
}

}  // namespace moetron::gguf
