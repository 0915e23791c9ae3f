// Reading a text file (the JSONL inputs) line by line, with a bound on the line length, in
// constant memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moetron {

// The default longest line a LineReader holds: 16 MiB, far above any real chat record.  A longer line
// is not read into memory (a JSON DOM, its strings and the tokenizer's work arrays take tens of times
// a line's size: a 200 MB line took 4 GB).
constexpr size_t kDefaultMaxLineBytes = size_t{16} << 20;

// Reads a text file line by line ('\n' separated; the '\n' is dropped, a final line without one is
// still a line).  Memory: the current line (at most max_line_bytes; a longer one is measured by
// reading ahead and never stored) and two 1 MiB buffers.
class LineReader {
 public:
  // Error naming the file if it cannot be opened or is a directory.
  explicit LineReader(const std::string& path, size_t max_line_bytes = kDefaultMaxLineBytes);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // Reads the next line into `line`; false at the end of the file.  Error on a read error.  A line of
  // more than max_line_bytes bytes is consumed without being stored: `line` is then empty and
  // too_long() true (line_bytes() says how long it was).
  bool next(std::string& line);
  bool too_long() const { return too_long_; }          // of the last line read
  uint64_t line_bytes() const { return line_bytes_; }  // length of the last line read, without its '\n'
  size_t max_line_bytes() const { return max_line_; }
  size_t line_number() const { return line_number_; }  // 1-based number of the last line read
  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t file_size() const { return file_size_; }
  const std::string& path() const { return path_; }

 private:
  bool fill();               // refills buf_; false at the end of the file
  bool longer_than_limit();  // whether the line starting at pos_ (past the buffer) exceeds max_line_

  std::string path_;
  int fd_ = -1;
  std::vector<char> buf_;
  std::vector<char> scan_;  // longer_than_limit's read-ahead (allocated on first use)
  size_t pos_ = 0, len_ = 0;
  size_t max_line_;
  bool too_long_ = false;
  uint64_t line_bytes_ = 0;
  size_t line_number_ = 0;
  uint64_t bytes_read_ = 0, file_size_ = 0;
};

}  // namespace moetron
