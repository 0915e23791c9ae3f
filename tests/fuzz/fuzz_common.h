// Shared by the libFuzzer targets (tests/fuzz/fuzz_*.cpp).
//
// Contract of every target: moetron's parsers take untrusted bytes and either succeed or throw
// moetron::Error (a clear message naming the file and field).  Anything else — a crash, a sanitizer
// report, a leak, an exception of another type escaping (the CLI would print "unexpected error"), a
// hang or an allocation beyond libFuzzer's -rss_limit_mb — is a finding.  So targets catch Error
// and nothing else.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>

#include "core/error.h"

namespace moetron::fuzz {

// A scratch directory of this process (files are rewritten on every input), removed at exit.  On
// /dev/shm when it exists: the targets write their input to a file because the code under test
// reads files, and memory-backed files keep that cheap.
class Scratch {
 public:
  Scratch() {
    const char* base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    std::string tmpl = std::string(base) + "/moetron-fuzz-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    dir_ = tmpl;
  }
  ~Scratch() {
    std::string cmd = "rm -rf '" + dir_ + "'";  // our own mkdtemp directory, nothing else
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir_.c_str());
  }
  const std::string& dir() const { return dir_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // Writes bytes to dir()/name (replacing it) and returns the path.
  std::string write(const std::string& name, std::string_view bytes) const {
    const std::string p = path(name);
    FILE* f = std::fopen(p.c_str(), "wb");
    if (f == nullptr || (bytes.size() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size())) {
      std::perror(p.c_str());
      std::abort();
    }
    std::fclose(f);
    return p;
  }
  void remove(const std::string& name) const { ::unlink(path(name).c_str()); }

 private:
  std::string dir_;
};

// One scratch directory per process (libFuzzer runs inputs one after another in one thread).
inline Scratch& scratch() {
  static Scratch s;
  return s;
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Splits the input at the first occurrence of sep: the part before and the part after (the whole
// input and an empty rest when sep is absent).  Lets one input carry several files.
inline std::pair<std::string_view, std::string_view> split_once(std::string_view s, std::string_view sep) {
  const size_t at = s.find(sep);
  if (at == std::string_view::npos) return {s, {}};
  return {s.substr(0, at), s.substr(at + sep.size())};
}

// Runs f; an Error is the expected outcome for bad input (its message must not be empty).
template <class F>
void expect_ok_or_error(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    // An error must say what is wrong, and input must never trip an internal assertion.
    if (e.what()[0] == '\0' || std::strncmp(e.what(), "internal error", 14) == 0) {
      std::fprintf(stderr, "bad error: '%s'\n", e.what());
      std::abort();
    }
  }
}

}  // namespace moetron::fuzz
