// Collectives on device memory over a host transport (MPI, or a group of one): every buffer is
// copied to host memory, the host group's call runs, and results are copied back.  The fallback
// when NCCL cannot be used -- several ranks sharing one GPU (tests), or a build without NCCL -- so
// the parallel code written once over Comm runs on any backend.  Semantics, byte counts (stats())
// and failures are the host group's; the buffers are the device's.
#pragma once

#include <cstddef>
#include <memory>

#include "dist/comm.h"

namespace moetron::dist {

// Copies between a device's memory and the host; both return once the host buffer may be reused.
class MemorySpace {
 public:
  virtual ~MemorySpace() = default;
  virtual void to_host(void* host, const void* device, size_t bytes) = 0;
  virtual void to_device(void* device, const void* host, size_t bytes) = 0;
};

// A Comm over the ranks of `host` whose buffers live in `mem`.  Both must outlive it; host() is
// `host` itself.
std::unique_ptr<Comm> make_staged_comm(Comm& host, MemorySpace& mem);

}  // namespace moetron::dist
