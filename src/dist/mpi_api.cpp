// MpiApi (see mpi_api.h).
#include "dist/mpi_api.h"

#ifdef MOETRON_HAVE_MPI
#include <dlfcn.h>

#include "core/dynlib.h"

namespace moetron::dist {

namespace {

MpiApi load() {
  // The library CMake found (MOETRON_MPI_LIBRARY), then the dynamic loader's search by soname.
  // RTLD_GLOBAL: Open MPI's own plugins (mca_*.so) resolve libmpi's symbols globally.
  MpiApi a;
  void* h = dlopen_first(
      {
#ifdef MOETRON_MPI_LIBRARY
          MOETRON_MPI_LIBRARY,
#endif
          "libmpi.so.40", "libmpi.so.12", "libmpi.so"},
      RTLD_NOW | RTLD_GLOBAL, "mpi", "scripts/setup.sh installs Open MPI", &a.path);
  auto symbol = [&](const char* name) { return dlsym_required(h, "mpi", a.path, name); };
#define MOETRON_MPI_FN(name) a.name = reinterpret_cast<decltype(a.name)>(symbol("MPI_" #name))
  MOETRON_MPI_FN(Abort);
  MOETRON_MPI_FN(Allgather);
  MOETRON_MPI_FN(Alltoallv);
  MOETRON_MPI_FN(Barrier);
  MOETRON_MPI_FN(Bcast);
  MOETRON_MPI_FN(Cancel);
  MOETRON_MPI_FN(Comm_create_errhandler);
  MOETRON_MPI_FN(Comm_dup);
  MOETRON_MPI_FN(Comm_free);
  MOETRON_MPI_FN(Comm_get_name);
  MOETRON_MPI_FN(Comm_rank);
  MOETRON_MPI_FN(Comm_set_errhandler);
  MOETRON_MPI_FN(Comm_set_name);
  MOETRON_MPI_FN(Comm_size);
  MOETRON_MPI_FN(Comm_split);
  MOETRON_MPI_FN(Errhandler_free);
  MOETRON_MPI_FN(Error_string);
  MOETRON_MPI_FN(Finalize);
  MOETRON_MPI_FN(Get_count);
  MOETRON_MPI_FN(Init_thread);
  MOETRON_MPI_FN(Initialized);
  MOETRON_MPI_FN(Irecv);
  MOETRON_MPI_FN(Isend);
  MOETRON_MPI_FN(Recv);
  MOETRON_MPI_FN(Request_free);
  MOETRON_MPI_FN(Send);
  MOETRON_MPI_FN(Sendrecv);
  MOETRON_MPI_FN(Test);
  MOETRON_MPI_FN(Testall);
  MOETRON_MPI_FN(Wait);
  MOETRON_MPI_FN(Waitall);
#undef MOETRON_MPI_FN
#ifdef OPEN_MPI
  // Open MPI's handles are the addresses of its predefined objects.
#define MOETRON_MPI_HANDLE(field, type, global) a.field = static_cast<type>(symbol(global))
#else
  // MPICH's are integer constants of mpi.h.
#define MOETRON_MPI_HANDLE(field, type, global) a.field = field##_constant
  const MPI_Comm comm_world_constant = MPI_COMM_WORLD, comm_null_constant = MPI_COMM_NULL;
  const MPI_Request request_null_constant = MPI_REQUEST_NULL;
  const MPI_Errhandler errhandler_null_constant = MPI_ERRHANDLER_NULL;
  const MPI_Datatype byte_constant = MPI_BYTE, int__constant = MPI_INT, float__constant = MPI_FLOAT,
                     double__constant = MPI_DOUBLE, int32_constant = MPI_INT32_T, int64_constant = MPI_INT64_T,
                     uint8_constant = MPI_UINT8_T, uint16_constant = MPI_UINT16_T;
#endif
  MOETRON_MPI_HANDLE(comm_world, MPI_Comm, "ompi_mpi_comm_world");
  MOETRON_MPI_HANDLE(comm_null, MPI_Comm, "ompi_mpi_comm_null");
  MOETRON_MPI_HANDLE(request_null, MPI_Request, "ompi_request_null");
  MOETRON_MPI_HANDLE(errhandler_null, MPI_Errhandler, "ompi_mpi_errhandler_null");
  MOETRON_MPI_HANDLE(byte, MPI_Datatype, "ompi_mpi_byte");
  MOETRON_MPI_HANDLE(int_, MPI_Datatype, "ompi_mpi_int");
  MOETRON_MPI_HANDLE(float_, MPI_Datatype, "ompi_mpi_float");
  MOETRON_MPI_HANDLE(double_, MPI_Datatype, "ompi_mpi_double");
  MOETRON_MPI_HANDLE(int32, MPI_Datatype, "ompi_mpi_int32_t");
  MOETRON_MPI_HANDLE(int64, MPI_Datatype, "ompi_mpi_int64_t");
  MOETRON_MPI_HANDLE(uint8, MPI_Datatype, "ompi_mpi_uint8_t");
  MOETRON_MPI_HANDLE(uint16, MPI_Datatype, "ompi_mpi_uint16_t");
#undef MOETRON_MPI_HANDLE
  return a;
}

}  // namespace

const MpiApi& mpi_api() {
  static const MpiApi a = load();
  return a;
}

}  // namespace moetron::dist
#endif  // MOETRON_HAVE_MPI
