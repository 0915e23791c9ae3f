// SHA-256 (FIPS 180-4) of byte strings and files, as lowercase hex: the checksums that tie a
// token dataset to the tokenizer that produced it (dataset.json).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moetron {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  // Finishes and returns the 64-character hex digest; the object must not be updated afterwards.
  std::string hex_digest();

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

std::string sha256_hex(std::string_view bytes);
// Error naming the file when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace moetron
