// Shared libraries loaded at run time (dlopen) instead of linked: those only some commands use
// (MPI, NCCL), so the others never map them.
#pragma once

#include <initializer_list>
#include <string>

namespace moetron {

// The first of `candidates` (paths or sonames) that dlopen(flags) loads; its name goes to *loaded.
// Throws Error "[what] cannot load <library>: <hint>" with every candidate's dlerror when none does.
void* dlopen_first(std::initializer_list<const char*> candidates, int flags, const char* what, const char* hint,
                   std::string* loaded);

// dlsym that throws Error "[what] <library> has no symbol <name>" instead of returning null.
void* dlsym_required(void* handle, const char* what, const std::string& library, const char* name);

}  // namespace moetron
