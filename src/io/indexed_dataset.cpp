#include "io/indexed_dataset.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <system_error>
#include <utility>

#include "core/error.h"
#include "core/interrupt.h"

namespace moetron {

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kVersion = 1;
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;  // 34
constexpr size_t kBufferBytes = size_t(1) << 20;

std::string errno_text(int err) { return std::generic_category().message(err); }

// Little-endian loads from unaligned bytes (the format is little-endian; so are our targets).
template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void append_le(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

// Range of int32 values each integer dtype holds; floats hold every int32 they can represent exactly.
bool fits(IndexedDType dtype, int32_t v) {
  switch (dtype) {
    case IndexedDType::u8: return v >= 0 && v <= 255;
    case IndexedDType::i8: return v >= -128 && v <= 127;
    case IndexedDType::i16: return v >= -32768 && v <= 32767;
    case IndexedDType::u16: return v >= 0 && v <= 65535;
    case IndexedDType::i32:
    case IndexedDType::i64:
    case IndexedDType::f64: return true;
    case IndexedDType::f32: return (int64_t)(float)v == (int64_t)v;
  }
  return false;
}

void fsync_dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // best effort: some filesystems refuse fsync on directories
    ::close(dfd);
  }
}

}  // namespace

bool indexed_dtype_valid(uint8_t code) { return code >= 1 && code <= 8; }

size_t indexed_dtype_size(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::u8:
    case IndexedDType::i8: return 1;
    case IndexedDType::i16:
    case IndexedDType::u16: return 2;
    case IndexedDType::i32:
    case IndexedDType::f32: return 4;
    case IndexedDType::i64:
    case IndexedDType::f64: return 8;
  }
  fail("indexed dataset: unknown dtype code {}", (int)dtype);
}

const char* indexed_dtype_name(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::u8: return "uint8";
    case IndexedDType::i8: return "int8";
    case IndexedDType::i16: return "int16";
    case IndexedDType::i32: return "int32";
    case IndexedDType::i64: return "int64";
    case IndexedDType::f64: return "float64";
    case IndexedDType::f32: return "float32";
    case IndexedDType::u16: return "uint16";
  }
  return "unknown";
}

// ------------------------------------------------------------------------------------------------
// Writer

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, IndexedDType dtype)
    : prefix_(prefix), dtype_(dtype) {
  if (!indexed_dtype_valid((uint8_t)dtype)) fail("{}.bin: unknown dtype code {}", prefix, (int)dtype);
  const std::string tmp = prefix_ + ".bin.tmp";
  bin_fd_ = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (bin_fd_ < 0) fail("{}: cannot create: {}", tmp, errno_text(errno));
  buffer_.reserve(kBufferBytes);
}

IndexedDatasetWriter::IndexedDatasetWriter(IndexedDatasetWriter&& other) noexcept
    : prefix_(std::move(other.prefix_)),
      dtype_(other.dtype_),
      bin_fd_(std::exchange(other.bin_fd_, -1)),
      finalized_(std::exchange(other.finalized_, true)),
      elements_(other.elements_),
      sizes_(std::move(other.sizes_)),
      doc_idx_(std::move(other.doc_idx_)),
      buffer_(std::move(other.buffer_)) {}

IndexedDatasetWriter& IndexedDatasetWriter::operator=(IndexedDatasetWriter&& other) noexcept {
  if (this != &other) {
    discard();
    prefix_ = std::move(other.prefix_);
    dtype_ = other.dtype_;
    bin_fd_ = std::exchange(other.bin_fd_, -1);
    finalized_ = std::exchange(other.finalized_, true);
    elements_ = other.elements_;
    sizes_ = std::move(other.sizes_);
    doc_idx_ = std::move(other.doc_idx_);
    buffer_ = std::move(other.buffer_);
  }
  return *this;
}

IndexedDatasetWriter::~IndexedDatasetWriter() { discard(); }

void IndexedDatasetWriter::discard() noexcept {
  if (bin_fd_ >= 0) {
    ::close(bin_fd_);
    bin_fd_ = -1;
  }
  if (!finalized_) {
    ::unlink((prefix_ + ".bin.tmp").c_str());
    ::unlink((prefix_ + ".idx.tmp").c_str());
    finalized_ = true;
  }
}

void IndexedDatasetWriter::write_all(int fd, const std::string& path, const void* data, size_t n) {
  check_interrupted();  // Ctrl-C: unwind, and the writer's destructor removes its temporaries
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("{}: write failed: {}", path, errno_text(errno));
    }
    p += w;
    n -= (size_t)w;
  }
}

void IndexedDatasetWriter::flush_buffer() {
  write_all(bin_fd_, prefix_ + ".bin.tmp", buffer_.data(), buffer_.size());
  buffer_.clear();
}

// Checked first (an element that does not fit writes nothing), then converted straight into the
// 1 MiB write buffer: memory does not grow with the sequence's length.
template <typename T>
void IndexedDatasetWriter::append(const T* values, size_t n) {
  if (finalized_) fail("{}.bin: add_sequence after finalize", prefix_);
  if (n > (size_t)std::numeric_limits<int32_t>::max())
    fail("{}.bin: sequence {} has {} elements; the format stores lengths as int32", prefix_, sizes_.size(), n);
  for (size_t j = 0; j < n; j++)
    if (!fits(dtype_, (int32_t)values[j]))
      fail("{}.bin: sequence {} element {} = {} does not fit dtype {}", prefix_, sizes_.size(), j, (int32_t)values[j],
           indexed_dtype_name(dtype_));
  const size_t item = indexed_dtype_size(dtype_);
  for (size_t j = 0; j < n;) {
    if (buffer_.size() + item > kBufferBytes) flush_buffer();
    const size_t m = std::min((kBufferBytes - buffer_.size()) / item, n - j);
    const size_t at = buffer_.size();
    buffer_.resize(at + m * item);
    uint8_t* out = buffer_.data() + at;
    for (size_t k = 0; k < m; k++) {
      const int32_t v = (int32_t)values[j + k];
      switch (dtype_) {
        case IndexedDType::u8: out[k] = (uint8_t)v; break;
        case IndexedDType::i8: { const int8_t x = (int8_t)v; std::memcpy(out + k, &x, 1); break; }
        case IndexedDType::i16: { const int16_t x = (int16_t)v; std::memcpy(out + 2 * k, &x, 2); break; }
        case IndexedDType::u16: { const uint16_t x = (uint16_t)v; std::memcpy(out + 2 * k, &x, 2); break; }
        case IndexedDType::i32: std::memcpy(out + 4 * k, &v, 4); break;
        case IndexedDType::i64: { const int64_t x = v; std::memcpy(out + 8 * k, &x, 8); break; }
        case IndexedDType::f32: { const float x = (float)v; std::memcpy(out + 4 * k, &x, 4); break; }
        case IndexedDType::f64: { const double x = v; std::memcpy(out + 8 * k, &x, 8); break; }
      }
    }
    j += m;
  }
  sizes_.push_back((int32_t)n);
  elements_ += n;
}

void IndexedDatasetWriter::add_sequence(const int32_t* values, size_t n) { append(values, n); }
void IndexedDatasetWriter::add_sequence(const uint8_t* values, size_t n) { append(values, n); }

void IndexedDatasetWriter::end_document() {
  if (finalized_) fail("{}.bin: end_document after finalize", prefix_);
  doc_idx_.push_back((int64_t)sizes_.size());
}

void IndexedDatasetWriter::finalize() {
  if (finalized_) fail("{}.idx: finalize called twice (or on a moved-from writer)", prefix_);
  const std::string bin_tmp = prefix_ + ".bin.tmp", idx_tmp = prefix_ + ".idx.tmp";
  const std::string bin_path = prefix_ + ".bin", idx_path = prefix_ + ".idx";
  try {
    flush_buffer();
    if (::fsync(bin_fd_) != 0) fail("{}: fsync failed: {}", bin_tmp, errno_text(errno));
    const int bfd = std::exchange(bin_fd_, -1);
    if (::close(bfd) != 0) fail("{}: close failed: {}", bin_tmp, errno_text(errno));

    const size_t n = sizes_.size(), item = indexed_dtype_size(dtype_);
    std::vector<uint8_t> idx;
    idx.reserve(kHeaderBytes + n * 12 + doc_idx_.size() * 8);
    idx.insert(idx.end(), kMagic, kMagic + 9);
    append_le<uint64_t>(idx, kVersion);
    append_le<uint8_t>(idx, (uint8_t)dtype_);
    append_le<uint64_t>(idx, (uint64_t)n);
    append_le<uint64_t>(idx, (uint64_t)doc_idx_.size());
    for (int32_t s : sizes_) append_le<int32_t>(idx, s);
    int64_t ptr = 0;
    for (int32_t s : sizes_) {
      append_le<int64_t>(idx, ptr);
      ptr += (int64_t)s * (int64_t)item;
    }
    for (int64_t d : doc_idx_) append_le<int64_t>(idx, d);

    const int ifd = ::open(idx_tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (ifd < 0) fail("{}: cannot create: {}", idx_tmp, errno_text(errno));
    try {
      write_all(ifd, idx_tmp, idx.data(), idx.size());
      if (::fsync(ifd) != 0) fail("{}: fsync failed: {}", idx_tmp, errno_text(errno));
    } catch (...) {
      ::close(ifd);
      throw;
    }
    if (::close(ifd) != 0) fail("{}: close failed: {}", idx_tmp, errno_text(errno));

    // Remove a previous index first, so that no moment shows a new .bin beside an old .idx.
    if (::unlink(idx_path.c_str()) != 0 && errno != ENOENT)
      fail("{}: cannot remove the previous index: {}", idx_path, errno_text(errno));
    if (::rename(bin_tmp.c_str(), bin_path.c_str()) != 0)
      fail("{}: cannot rename {} into place: {}", bin_path, bin_tmp, errno_text(errno));
    if (::rename(idx_tmp.c_str(), idx_path.c_str()) != 0)
      fail("{}: cannot rename {} into place: {}", idx_path, idx_tmp, errno_text(errno));
    fsync_dir_of(idx_path);
    finalized_ = true;
  } catch (...) {
    discard();
    throw;
  }
  std::vector<uint8_t>().swap(buffer_);
}

// ------------------------------------------------------------------------------------------------
// Reader

IndexedDataset IndexedDataset::open(const std::string& prefix) {
  IndexedDataset ds;
  ds.idx_ = MappedFile::open(prefix + ".idx");
  const std::string& ip = ds.idx_.path();
  const uint8_t* p = ds.idx_.data();
  const size_t isize = ds.idx_.size();
  if (isize < kHeaderBytes)
    fail("{}: truncated header: {} bytes, expected at least {}", ip, isize, kHeaderBytes);
  if (std::memcmp(p, kMagic, 9) != 0) fail("{}: bad magic, expected \"MMIDIDX\\x00\\x00\" (Megatron MMIDIDX index)", ip);
  const uint64_t version = load<uint64_t>(p + 9);
  if (version != kVersion) fail("{}: version {}, expected {}", ip, version, kVersion);
  const uint8_t code = p[17];
  if (!indexed_dtype_valid(code)) fail("{}: unknown dtype code {}, expected 1..8", ip, (int)code);
  ds.dtype_ = (IndexedDType)code;
  ds.itemsize_ = indexed_dtype_size(ds.dtype_);
  const uint64_t n = load<uint64_t>(p + 18), d = load<uint64_t>(p + 26);
  // Bound the counts by the file size before multiplying, so the arithmetic cannot overflow.
  if (n > isize / 12) fail("{}: sequence count {} does not fit in a {}-byte index", ip, n, isize);
  if (d > isize / 8) fail("{}: document count {} does not fit in a {}-byte index", ip, d, isize);
  const size_t expected = kHeaderBytes + 12 * n + 8 * d;
  if (isize < expected)
    fail("{}: truncated: {} bytes, expected {} for {} sequences and {} document index entries", ip, isize,
         expected, n, d);
  if (isize > expected)
    fail("{}: {} trailing bytes after the document index (expected {} bytes; multimodal indexes are not "
         "supported)", ip, isize - expected, expected);
  ds.n_ = (size_t)n;
  ds.sizes_ = p + kHeaderBytes;
  ds.pointers_ = ds.sizes_ + 4 * n;
  const uint8_t* docs = ds.pointers_ + 8 * n;

  ds.bin_ = MappedFile::open(prefix + ".bin");
  const std::string& bp = ds.bin_.path();
  const uint64_t bsize = ds.bin_.size();
  uint64_t expect_ptr = 0;
  for (size_t i = 0; i < ds.n_; i++) {
    const int32_t s = load<int32_t>(ds.sizes_ + 4 * i);
    const int64_t ptr = load<int64_t>(ds.pointers_ + 8 * i);
    if (s < 0) fail("{}: sizes[{}] = {} is negative", ip, i, s);
    if (ptr < 0 || (uint64_t)ptr > bsize)
      fail("{}: pointers[{}] = {} is outside {} ({} bytes)", ip, i, ptr, bp, bsize);
    if ((uint64_t)ptr != expect_ptr)
      fail("{}: pointers[{}] = {}, expected {} (pointers[{}] + sizes[{}] * {} bytes): sizes and pointers are "
           "inconsistent", ip, i, ptr, expect_ptr, i == 0 ? 0 : i - 1, i == 0 ? 0 : i - 1, ds.itemsize_);
    const uint64_t end = (uint64_t)ptr + (uint64_t)s * ds.itemsize_;
    if (end > bsize)
      fail("{}: sequence {} ends at byte {}, beyond the end of {} ({} bytes)", ip, i, end, bp, bsize);
    expect_ptr = end;
    ds.elements_ += (size_t)s;
  }
  if (expect_ptr != bsize)
    fail("{}: size {} bytes, expected {} (= {} elements of {} as the index {} describes)", bp, bsize, expect_ptr,
         ds.elements_, indexed_dtype_name(ds.dtype_), ip);

  ds.doc_idx_.resize(d);
  for (size_t k = 0; k < d; k++) {
    const int64_t v = load<int64_t>(docs + 8 * k);
    if (v < 0 || (uint64_t)v > n) fail("{}: doc_idx[{}] = {} is outside [0, {}]", ip, k, v, n);
    if (k == 0 && v != 0) fail("{}: doc_idx[0] = {}, expected 0", ip, v);
    if (k > 0 && v < ds.doc_idx_[k - 1])
      fail("{}: doc_idx[{}] = {} is less than doc_idx[{}] = {}; expected non-decreasing", ip, k, v, k - 1,
           ds.doc_idx_[k - 1]);
    ds.doc_idx_[k] = v;
  }
  return ds;
}

size_t IndexedDataset::length(size_t i) const {
  if (i >= n_) fail("{}: sequence {} out of range ({} sequences)", idx_.path(), i, n_);
  return (size_t)load<int32_t>(sizes_ + 4 * i);
}

int64_t IndexedDataset::pointer(size_t i) const {
  if (i >= n_) fail("{}: sequence {} out of range ({} sequences)", idx_.path(), i, n_);
  return load<int64_t>(pointers_ + 8 * i);
}

void IndexedDataset::read(size_t i, int32_t* out) const { read(i, 0, length(i), out); }

void IndexedDataset::read(size_t i, size_t offset, size_t count, int32_t* out) const {
  const size_t len = length(i);
  if (offset > len || count > len - offset)
    fail("{}: elements [{}, {}) outside sequence {} of length {}", bin_.path(), offset, offset + count, i, len);
  if (count == 0) return;
  const uint8_t* src = bin_.data() + (size_t)load<int64_t>(pointers_ + 8 * i) + offset * itemsize_;
  auto bad = [&](size_t j, auto v) {
    fail("{}: sequence {} element {} = {} ({}) is not an int32 value", bin_.path(), i, offset + j, v,
         indexed_dtype_name(dtype_));
  };
  switch (dtype_) {
    case IndexedDType::u8:
      for (size_t j = 0; j < count; j++) out[j] = src[j];
      break;
    case IndexedDType::i8:
      for (size_t j = 0; j < count; j++) out[j] = load<int8_t>(src + j);
      break;
    case IndexedDType::i16:
      for (size_t j = 0; j < count; j++) out[j] = load<int16_t>(src + 2 * j);
      break;
    case IndexedDType::u16:
      for (size_t j = 0; j < count; j++) out[j] = load<uint16_t>(src + 2 * j);
      break;
    case IndexedDType::i32:
      std::memcpy(out, src, count * 4);
      break;
    case IndexedDType::i64:
      for (size_t j = 0; j < count; j++) {
        const int64_t v = load<int64_t>(src + 8 * j);
        if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) bad(j, v);
        out[j] = (int32_t)v;
      }
      break;
    case IndexedDType::f32:
      for (size_t j = 0; j < count; j++) {
        const float v = load<float>(src + 4 * j);
        if (!(v >= -2147483648.0f && v < 2147483648.0f) || std::trunc(v) != v) bad(j, v);
        out[j] = (int32_t)v;
      }
      break;
    case IndexedDType::f64:
      for (size_t j = 0; j < count; j++) {
        const double v = load<double>(src + 8 * j);
        if (!(v >= -2147483648.0 && v <= 2147483647.0) || std::trunc(v) != v) bad(j, v);
        out[j] = (int32_t)v;
      }
      break;
  }
}

}  // namespace moetron
