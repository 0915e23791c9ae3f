// dlopen_first, dlsym_required (see dynlib.h).
#include "core/dynlib.h"

#include <dlfcn.h>

#include "core/error.h"

namespace moetron {

void* dlopen_first(std::initializer_list<const char*> candidates, int flags, const char* what, const char* hint,
                   std::string* loaded) {
  std::string errors;
  for (const char* c : candidates) {
    if (void* h = dlopen(c, flags)) {
      *loaded = c;
      return h;
    }
    errors += std::string("\n  ") + dlerror();
  }
  fail("[{}] cannot load the library ({}):{}", what, hint, errors);
}

void* dlsym_required(void* handle, const char* what, const std::string& library, const char* name) {
  void* p = dlsym(handle, name);
  if (!p) fail("[{}] {} has no symbol {}", what, library, name);
  return p;
}

}  // namespace moetron
