// The MPI library, loaded at first use (dlopen) rather than linked.
//
// Why: linking libmpi maps Open MPI's whole stack (libmpi, open-rte, open-pal, hwloc, libevent,
// libudev, ...) into every moetron process and relocates it at start -- ~1 MiB of resident pages in
// `generate`, `serve` or `bench generate`, which never talk to another rank.  Only make_world_comm()
// of a launched process (mpirun, srun) loads it.  Compiled against mpi.h (its types and, for MPICH,
// its constant handles); Open MPI's predefined handles are addresses of library globals
// (ompi_mpi_comm_world, ...), so they are looked up too.
#pragma once

#ifdef MOETRON_HAVE_MPI
#include <mpi.h>

#include <string>

namespace moetron::dist {

struct MpiApi {
  std::string path;  // the shared object that was loaded
  // Functions, named as MPI_<name>.
  decltype(&MPI_Abort) Abort;
  decltype(&MPI_Allgather) Allgather;
  decltype(&MPI_Alltoallv) Alltoallv;
  decltype(&MPI_Barrier) Barrier;
  decltype(&MPI_Bcast) Bcast;
  decltype(&MPI_Cancel) Cancel;
  decltype(&MPI_Comm_create_errhandler) Comm_create_errhandler;
  decltype(&MPI_Comm_dup) Comm_dup;
  decltype(&MPI_Comm_free) Comm_free;
  decltype(&MPI_Comm_get_name) Comm_get_name;
  decltype(&MPI_Comm_rank) Comm_rank;
  decltype(&MPI_Comm_set_errhandler) Comm_set_errhandler;
  decltype(&MPI_Comm_set_name) Comm_set_name;
  decltype(&MPI_Comm_size) Comm_size;
  decltype(&MPI_Comm_split) Comm_split;
  decltype(&MPI_Errhandler_free) Errhandler_free;
  decltype(&MPI_Error_string) Error_string;
  decltype(&MPI_Finalize) Finalize;
  decltype(&MPI_Get_count) Get_count;
  decltype(&MPI_Init_thread) Init_thread;
  decltype(&MPI_Initialized) Initialized;
  decltype(&MPI_Irecv) Irecv;
  decltype(&MPI_Isend) Isend;
  decltype(&MPI_Recv) Recv;
  decltype(&MPI_Request_free) Request_free;
  decltype(&MPI_Send) Send;
  decltype(&MPI_Sendrecv) Sendrecv;
  decltype(&MPI_Test) Test;
  decltype(&MPI_Testall) Testall;
  decltype(&MPI_Wait) Wait;
  decltype(&MPI_Waitall) Waitall;
  // Predefined handles (MPI_COMM_WORLD, ...).
  MPI_Comm comm_world, comm_null;
  MPI_Request request_null;
  MPI_Errhandler errhandler_null;
  MPI_Datatype byte, int_, float_, double_, int32, int64, uint8, uint16;
};

// Loads the library on first call (thread-safe; immutable afterwards).  Throws Error naming every
// path tried and what dlopen said when none loads, or the missing symbol.
const MpiApi& mpi_api();

}  // namespace moetron::dist
#endif  // MOETRON_HAVE_MPI
