// NcclComm: the Comm interface over NCCL for GPU runs (device: cuda), one GPU per rank (the
// calling thread's current CUDA device).  Built only with the CUDA backend, MPI and NCCL
// (MOETRON_HAVE_NCCL); otherwise make_nccl_comm reports "built without NCCL".
//
// Contract differences from comm.h (everything else holds):
//   - every buffer is a DEVICE pointer; calls are enqueued on the communicator's stream and
//     synchronised before they return (blocking, like the MPI transport);
//   - reductions use NCCL's own algorithms: deterministic for a fixed layout, NCCL version and
//     NCCL_ALGO / NCCL_PROTO settings, but not summed in rank order (results agree with the MPI
//     transport to fp32 reduction-order tolerance, not bitwise);
//   - send/recv have no tags: messages between a pair are matched in call order;
//   - uneven reduce_scatter / all_gather blocks are padded to the largest block in device scratch.
// stats() counts bytes as the ring algorithms send them (the same formulas as MpiComm).
#pragma once

#include <memory>
#include <string>

#include "dist/comm.h"

namespace moetron::dist {

bool have_nccl();

// The NCCL library, loaded at first use (not linked): its path and version code.  Loads it
// (needs no GPU); throws Error when it cannot be loaded or in a build without NCCL.
std::string nccl_library();

// An NCCL communicator over the ranks of `bootstrap` (an MPI group: its rank 0 creates the NCCL
// unique id and broadcasts it).  Collective over `bootstrap`, which must outlive the result (it also
// serves barrier() and abort()).  stream: a cudaStream_t, or null for the default stream.
std::unique_ptr<Comm> make_nccl_comm(Comm& bootstrap, void* stream = nullptr);

}  // namespace moetron::dist
