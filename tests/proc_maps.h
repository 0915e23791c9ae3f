// Whether a shared object is mapped into this process (/proc/self/maps): for the tests that check a
// library is loaded only by the commands that use it.
#pragma once

#include <fstream>
#include <string>

namespace moetron::testing {

// True when a mapped file's path contains `name` (e.g. "libmpi.so").
inline bool library_mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const size_t slash = line.find('/');
    if (slash != std::string::npos && line.find(name, slash) != std::string::npos) return true;
  }
  return false;
}

}  // namespace moetron::testing
