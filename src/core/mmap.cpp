#include "core/mmap.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <fstream>
#include <sstream>
#include <system_error>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/huge_pages.h"

namespace moetron {

namespace {

std::string errno_text(int err) { return std::generic_category().message(err); }

// Closes the descriptor on every path out of open().
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

MappedFile MappedFile::open(const std::string& path, bool keep_fd) {
  FdGuard fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) fail("{}: cannot open: {}", path, errno_text(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) fail("{}: cannot stat: {}", path, errno_text(errno));
  if (S_ISDIR(st.st_mode)) fail("{}: cannot map: is a directory, expected a file", path);
  if (!S_ISREG(st.st_mode)) fail("{}: cannot map: not a regular file", path);

  MappedFile file;
  file.path_ = path;
  file.size_ = static_cast<size_t>(st.st_size);
  if (file.size_ > 0) {
    void* p = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd.fd, 0);
    if (p == MAP_FAILED) fail("{}: cannot mmap {} bytes: {}", path, file.size_, errno_text(errno));
    file.data_ = static_cast<const uint8_t*>(p);
  }
  if (keep_fd) file.fd_ = std::exchange(fd.fd, -1);
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      fd_(std::exchange(other.fd_, -1)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

MappedFile::~MappedFile() { release(); }

void MappedFile::release() noexcept {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  size_ = 0;
  fd_ = -1;
}

void release_mapped_pages(const void* p, size_t n) noexcept {
  if (p == nullptr || n == 0) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n + page - 1) / page * page;
  // Advice only: a failure leaves the pages resident, which is harmless.
  (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

namespace {

// Reads one byte of every 4 KiB page of [p, p + n): the kernel faults the pages in.
void touch_pages(const uint8_t* p, size_t n) {
  volatile uint8_t sink = 0;
  for (size_t i = 0; i < n; i += 4096) sink = sink + p[i];
  (void)sink;
}

uintptr_t parse_hex(std::string_view s) {
  uintptr_t v = 0;
  std::from_chars(s.data(), s.data() + s.size(), v, 16);
  return v;
}

size_t own_file_huge_mapped_bytes(uintptr_t begin, uintptr_t end) {
  std::ifstream in("/proc/self/smaps");
  if (!in) return 0;
  std::stringstream text;
  text << in.rdbuf();
  return file_huge_mapped_bytes(text.str(), begin, end);
}

}  // namespace

size_t file_huge_mapped_bytes(std::string_view smaps, uintptr_t begin, uintptr_t end) {
  size_t total = 0;
  bool inside = false;  // the current mapping lies in [begin, end)
  while (!smaps.empty()) {
    const size_t eol = smaps.find('\n');
    const std::string_view line = smaps.substr(0, eol);
    smaps.remove_prefix(eol == std::string_view::npos ? smaps.size() : eol + 1);
    const size_t dash = line.find('-'), space = line.find(' ');
    if (dash != std::string_view::npos && space != std::string_view::npos && dash < space &&
        std::all_of(line.begin(), line.begin() + (long)dash, [](char c) { return std::isxdigit((unsigned char)c); })) {
      const uintptr_t lo = parse_hex(line.substr(0, dash)), hi = parse_hex(line.substr(dash + 1, space - dash - 1));
      inside = lo >= begin && hi <= end && lo < hi;  // a mapping header: "lo-hi perms offset dev inode path"
      continue;
    }
    constexpr std::string_view kField = "FilePmdMapped:";
    if (!inside || !line.starts_with(kField)) continue;
    std::string_view v = line.substr(kField.size());
    while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
    size_t kib = 0;
    std::from_chars(v.data(), v.data() + v.size(), kib);
    total += kib * 1024;
  }
  return total;
}

void MappedFile::advise_huge_pages() const noexcept {
  if (data_ != nullptr) (void)::madvise(const_cast<uint8_t*>(data_), size_, MADV_HUGEPAGE);
}

MappedFile::HugePages MappedFile::back_with_huge_pages(std::span<const std::pair<size_t, size_t>> ranges) const {
  HugePages r;
  const uintptr_t base = reinterpret_cast<uintptr_t>(data_);
  // The windows the ranges touch, as sorted, disjoint [first, last) runs of window indices (a
  // tensor's first and last windows are shared with its neighbours'); a partial window at the end
  // of the file cannot be one page.
  std::vector<std::pair<size_t, size_t>> windows;
  for (const auto& [offset, n] : ranges) {
    if (n == 0 || offset > size_ || n > size_ - offset) continue;
    const size_t first = offset / kHugePageBytes,
                 last = std::min((offset + n + kHugePageBytes - 1) / kHugePageBytes, size_ / kHugePageBytes);
    if (first < last) windows.emplace_back(first, last);
  }
  std::sort(windows.begin(), windows.end());
  size_t runs = 0;
  for (const auto& w : windows)
    if (runs > 0 && w.first <= windows[runs - 1].second)
      windows[runs - 1].second = std::max(windows[runs - 1].second, w.second);
    else
      windows[runs++] = w;
  windows.resize(runs);
  for (const auto& [first, last] : windows) r.windows += (last - first) * kHugePageBytes;
  // A 2 MiB page maps a 2 MiB-aligned window of the file at a 2 MiB-aligned address: the kernel
  // places mappings of 2 MiB and more so (Linux 6.7 on; not tmpfs's); elsewhere none can be.
  if (r.windows == 0 || base % kHugePageBytes != 0) return r;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const auto huge_now = [&] { return own_file_huge_mapped_bytes(base, base + (size_ + page - 1) / page * page); };
  r.huge = huge_now();
  if (r.huge >= r.windows * 9 / 10 || fd_ < 0) return r;
  // Windows [first, last): dropped from this mapping and the page cache, then read back.
  const auto drop = [&](size_t first, size_t last) {
    (void)::madvise(const_cast<uint8_t*>(data_) + first * kHugePageBytes, (last - first) * kHugePageBytes,
                    MADV_DONTNEED);
    (void)::posix_fadvise(fd_, (off_t)(first * kHugePageBytes), (off_t)((last - first) * kHugePageBytes),
                          POSIX_FADV_DONTNEED);
  };
  const auto read_back = [&](size_t first, size_t last) {
    touch_pages(data_ + first * kHugePageBytes, (last - first) * kHugePageBytes);
  };
  // One window first: does the kernel give this file 2 MiB pages at all?  (Counted once it is
  // dropped, so a window that was one page already does not pass for a new one.)
  const size_t probe = windows.front().first;
  drop(probe, probe + 1);
  const size_t without = huge_now();
  read_back(probe, probe + 1);
  r.huge = huge_now();
  if (r.huge < without + kHugePageBytes) return r;
  for (const auto& [first, last] : windows) {
    const size_t from = first == probe ? probe + 1 : first;  // the probe is one page already
    if (from == last) continue;
    drop(from, last);
    read_back(from, last);
  }
  r.huge = huge_now();
  r.reread = true;
  return r;
}

}  // namespace moetron
