// Read-only memory mapping of a whole file (RAII, move-only). Used for zero-copy loading of
// safetensors and token data. An empty file maps to data() == nullptr, size() == 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

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

  // 2 MiB pages for a mapping read whole and often (inference weights): one TLB entry per 2 MiB
  // instead of per 4 KiB, so one thread streams the weights faster (one core of a 2-core Zen 4 EPYC
  // VM read 26-27 GB/s on 4 KiB pages, 31 on 2 MiB).  Advice only: no byte of the mapping changes.
  //
  // advise_huge_pages: before the mapping is first read -- a page the kernel then reads from the
  // file comes in a 2 MiB page-cache folio, mapped whole, where the kernel and the file system can
  // (transparent huge pages on, a file system with large folios: ext4 from Linux 6.16, XFS).
  void advise_huge_pages() const noexcept;
  struct HugePages {
    size_t huge = 0;      // bytes of the mapping on 2 MiB pages
    size_t windows = 0;   // bytes of the whole, aligned 2 MiB windows in `ranges`
    bool reread = false;  // the windows were dropped and read again from the file
  };
  // back_with_huge_pages: after the byte ranges [offset, offset + n) of the file (the ones the
  // process reads) have been read once.  A file already in the page cache keeps the folios it was
  // read into (4 KiB ones, say, when another program wrote or read it), whatever the advice: then,
  // if dropping and re-reading one 2 MiB window gives it a 2 MiB page, every window of the ranges is
  // dropped from this mapping and from the page cache (pages other processes map stay) and read
  // again -- once per file, as the page cache keeps the new folios.  Needs the mapping opened with
  // keep_fd; otherwise, or where the kernel gives no 2 MiB pages, it only counts.
  HugePages back_with_huge_pages(std::span<const std::pair<size_t, size_t>> ranges) const;

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

// Bytes mapped by 2 MiB pages of files (smaps' FilePmdMapped) in the mappings of [begin, end),
// from the text of /proc/PID/smaps; 0 where it lists none (parsed here so a test can feed it text).
size_t file_huge_mapped_bytes(std::string_view smaps, uintptr_t begin, uintptr_t end);

}  // namespace moetron
