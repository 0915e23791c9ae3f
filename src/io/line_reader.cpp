#include "io/line_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace moetron {

LineReader::LineReader(const std::string& path, size_t max_line_bytes) : path_(path), max_line_(max_line_bytes) {
  if (max_line_ == 0) fail("{}: the maximum line length must be at least 1 byte", path);
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) == 0) {
    if (S_ISDIR(st.st_mode)) {
      ::close(fd_);
      fd_ = -1;
      fail("{}: is a directory, expected a JSONL file", path);
    }
    file_size_ = (uint64_t)st.st_size;
  }
  buf_.resize(size_t{1} << 20);
}

LineReader::~LineReader() {
  if (fd_ >= 0) ::close(fd_);
}

bool LineReader::fill() {
  pos_ = len_ = 0;
  for (;;) {
    const ssize_t n = ::read(fd_, buf_.data(), buf_.size());
    if (n > 0) {
      len_ = (size_t)n;
      return true;
    }
    if (n == 0) return false;
    if (errno != EINTR) fail("{}: read error after line {}: {}", path_, line_number_, std::strerror(errno));
  }
}

bool LineReader::longer_than_limit() {
  // The line runs past the buffer: its length is found by reading ahead with pread (into scan_, not
  // stored), up to its '\n' or one byte past the limit, so a line over the limit is never held --
  // not even its first max_line bytes.  Lines that fit the buffer (nearly all) skip this.
  uint64_t n = len_ - pos_;
  off_t at = (off_t)(bytes_read_ + (len_ - pos_));  // the file offset of the buffer's end
  scan_.resize(buf_.size());
  while (n <= max_line_) {
    const ssize_t got = ::pread(fd_, scan_.data(), scan_.size(), at);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("{}: read error after line {}: {}", path_, line_number_, std::strerror(errno));
    }
    if (got == 0) break;  // the file ends the line
    const char* nl = static_cast<const char*>(std::memchr(scan_.data(), '\n', (size_t)got));
    n += nl ? (uint64_t)(nl - scan_.data()) : (uint64_t)got;
    if (nl) break;
    at += got;
  }
  return n > max_line_;
}

bool LineReader::next(std::string& line) {
  line.clear();
  too_long_ = false;
  if (pos_ == len_ && !fill()) return false;
  if (!std::memchr(buf_.data() + pos_, '\n', len_ - pos_) && longer_than_limit()) {
    too_long_ = true;
    std::string().swap(line);
  }
  uint64_t n = 0;
  bool any = false;
  for (;;) {
    if (pos_ == len_ && !fill()) break;
    any = true;
    const char* p = buf_.data() + pos_;
    const size_t avail = len_ - pos_;
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', avail));
    const size_t take = nl ? (size_t)(nl - p) : avail;
    n += take;
    if (!too_long_) {
      if (n > max_line_) {
        too_long_ = true;
        std::string().swap(line);  // give back what the line held so far
      } else {
        line.append(p, take);
      }
    }
    const size_t used = take + (nl ? 1 : 0);
    pos_ += used;
    bytes_read_ += used;
    if (nl) break;
  }
  if (!any) return false;
  line_number_++;
  line_bytes_ = n;
  return true;
}

}  // namespace moetron
