// XXH64 (Yann Collet's xxHash, 64-bit variant): the checksums of checkpoint files
// (train/checkpoint.h) and of anything else that needs a fast non-cryptographic hash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moetron {

// Streaming XXH64, seed 0 by default.
class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t n);
  uint64_t digest() const;

 private:
  uint64_t v_[4];
  uint8_t buf_[32];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
  uint64_t seed_;
};
uint64_t xxh64(const void* data, size_t n, uint64_t seed = 0);
// 16 lowercase hex digits, most significant first.
std::string xxh64_hex(uint64_t h);
// XXH64 of a file's bytes; Error naming the file. *size (when given) receives the byte count.
uint64_t xxh64_file(const std::string& path, uint64_t* size = nullptr);

}  // namespace moetron
