// XXH64 after the xxHash specification (four 64-bit lanes over 32-byte stripes, then the tail).
#include "core/xxh64.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>
#include <vector>

#include "core/error.h"
#include "core/fd.h"

namespace moetron {

namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;

inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian host (core/dtype.h)
  return v;
}
inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t xxh_round(uint64_t acc, uint64_t input) { return rotl64(acc + input * kP2, 31) * kP1; }
inline uint64_t xxh_merge(uint64_t acc, uint64_t v) { return (acc ^ xxh_round(0, v)) * kP1 + kP4; }

}  // namespace

Xxh64::Xxh64(uint64_t seed) : v_{seed + kP1 + kP2, seed + kP2, seed, seed - kP1}, buf_{}, seed_(seed) {}

void Xxh64::update(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  total_ += n;
  if (buf_len_ + n < 32) {
    if (n > 0) std::memcpy(buf_ + buf_len_, p, n);
    buf_len_ += n;
    return;
  }
  if (buf_len_ > 0) {
    const size_t take = 32 - buf_len_;
    std::memcpy(buf_ + buf_len_, p, take);
    for (int i = 0; i < 4; i++) v_[i] = xxh_round(v_[i], load64(buf_ + 8 * i));
    p += take;
    n -= take;
    buf_len_ = 0;
  }
  uint64_t v0 = v_[0], v1 = v_[1], v2 = v_[2], v3 = v_[3];
  for (; n >= 32; p += 32, n -= 32) {
    v0 = xxh_round(v0, load64(p));
    v1 = xxh_round(v1, load64(p + 8));
    v2 = xxh_round(v2, load64(p + 16));
    v3 = xxh_round(v3, load64(p + 24));
  }
  v_[0] = v0, v_[1] = v1, v_[2] = v2, v_[3] = v3;
  if (n > 0) std::memcpy(buf_, p, n);
  buf_len_ = n;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl64(v_[0], 1) + rotl64(v_[1], 7) + rotl64(v_[2], 12) + rotl64(v_[3], 18);
    for (int i = 0; i < 4; i++) h = xxh_merge(h, v_[i]);
  } else {
    h = seed_ + kP5;
  }
  h += total_;
  const uint8_t* p = buf_;
  size_t n = buf_len_;
  for (; n >= 8; p += 8, n -= 8) h = rotl64(h ^ xxh_round(0, load64(p)), 27) * kP1 + kP4;
  if (n >= 4) {
    h = rotl64(h ^ (static_cast<uint64_t>(load32(p)) * kP1), 23) * kP2 + kP3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; p++, n--) h = rotl64(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, size_t n, uint64_t seed) {
  Xxh64 x(seed);
  x.update(data, n);
  return x.digest();
}

std::string xxh64_hex(uint64_t h) { return fmt::format("{:016x}", h); }

uint64_t xxh64_file(const std::string& path, uint64_t* size) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) fail("{}: cannot open for checksum: {}", path, errno_text(errno));
  ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<uint8_t> buf(size_t{4} << 20);
  Xxh64 x;
  uint64_t total = 0;
  for (;;) {
    const ssize_t r = ::read(f.fd, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail("{}: read failed while computing its checksum: {}", path, errno_text(errno));
    if (r == 0) break;
    x.update(buf.data(), static_cast<size_t>(r));
    total += static_cast<uint64_t>(r);
  }
  if (size) *size = total;
  return x.digest();
}

}  // namespace moetron
