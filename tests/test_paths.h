// Where a test finds the source tree and the moetron binary: where the build put them, unless the
// environment names others -- MOETRON_TEST_SOURCE_DIR, MOETRON_TEST_BINARY -- as the GPU check does,
// whose bundled test binaries (scripts/gpu-bundle.sh) run on another machine, from another directory.
// Force-included into every test (CMakeLists.txt), so MOETRON_SOURCE_DIR and MOETRON_BINARY read the
// same everywhere.
#pragma once

#include <cstdlib>

namespace moetron::test_paths {

inline const char* path_from_env(const char* name, const char* built) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : built;
}

}  // namespace moetron::test_paths

#define MOETRON_SOURCE_DIR (::moetron::test_paths::path_from_env("MOETRON_TEST_SOURCE_DIR", MOETRON_BUILT_SOURCE_DIR))
#define MOETRON_BINARY (::moetron::test_paths::path_from_env("MOETRON_TEST_BINARY", MOETRON_BUILT_BINARY))
