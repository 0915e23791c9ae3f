// Read-only memory mapping of a whole file (RAII, move-only). Used for zero-copy loading of
// safetensors and token data. An empty file maps to data() == nullptr, size() == 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moetron {

class MappedFile {
 public:
  // Maps `path` read-only. Throws Error naming the path and the system's reason on failure.
  static MappedFile open(const std::string& path);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void release() noexcept;

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace moetron
