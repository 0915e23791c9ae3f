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
  // keep_fd: the descriptor stays open (fd(), closed with the mapping), so the mapped file can also
  // be read with pread -- the same file even after the path is replaced or removed.
  static MappedFile open(const std::string& path, bool keep_fd = false);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }  // -1 unless opened with keep_fd

 private:
  void release() noexcept;

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

// Tells the kernel the process is done with [p, p + n) of a read-only file mapping (rounded out to
// whole pages): the pages leave the process's resident set (they stay in the page cache, and a
// later read faults them back in from the file, so the bytes never change). Loading a model
// calls it after converting each tensor, so peak RSS is the converted copy, not copy + file.
// `p` must point into a MappedFile's mapping; n == 0 does nothing.
void release_mapped_pages(const void* p, size_t n) noexcept;

}  // namespace moetron
