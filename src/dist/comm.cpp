// The transport-independent parts of comm.h: SelfComm, launcher detection, helpers.
#include "dist/comm.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace moetron::dist {

size_t comm_dtype_size(CommDType t) {
  switch (t) {
    case CommDType::f32:
    case CommDType::i32:
      return 4;
    case CommDType::f64:
    case CommDType::i64:
      return 8;
    case CommDType::u8:
      return 1;
    case CommDType::bf16:
      return 2;
  }
  return 1;
}

const char* comm_dtype_name(CommDType t) {
  switch (t) {
    case CommDType::f32:
      return "f32";
    case CommDType::f64:
      return "f64";
    case CommDType::i32:
      return "i32";
    case CommDType::i64:
      return "i64";
    case CommDType::u8:
      return "u8";
    case CommDType::bf16:
      return "bf16";
  }
  return "?";
}

void Comm::check_counts(const char* op, const std::vector<size_t>& counts) const {
  if ((int)counts.size() != size_)
    fail("[{}] group '{}' has {} ranks but {} counts were given", op, name_, size_, counts.size());
}

void Comm::broadcast_string(std::string& s, int root) {
  int64_t n = (int64_t)s.size();
  broadcast(&n, 1, root);
  s.resize((size_t)n);
  if (n > 0) broadcast(reinterpret_cast<void*>(s.data()), (size_t)n, CommDType::u8, root);
}

// ---- SelfComm ------------------------------------------------------------------------------------

void SelfComm::all_reduce(void*, size_t, CommDType, ReduceOp) {}

void SelfComm::reduce_scatter(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype,
                              ReduceOp) {
  check_counts("reduce_scatter", counts);
  if (out != in && counts[0] > 0) std::memmove(out, in, counts[0] * comm_dtype_size(dtype));
}

void SelfComm::all_gather(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype) {
  check_counts("all_gather", counts);
  if (out != in && counts[0] > 0) std::memmove(out, in, counts[0] * comm_dtype_size(dtype));
}

void SelfComm::all_to_all_v(void* out, const std::vector<size_t>& recv_counts, const void* in,
                            const std::vector<size_t>& send_counts, CommDType dtype) {
  check_counts("all_to_all_v", recv_counts);
  check_counts("all_to_all_v", send_counts);
  if (recv_counts[0] != send_counts[0])
    fail("[all_to_all_v] group '{}': rank 0 sends {} elements to itself but expects {}", name(), send_counts[0],
         recv_counts[0]);
  if (out != in && send_counts[0] > 0) std::memmove(out, in, send_counts[0] * comm_dtype_size(dtype));
}

void SelfComm::send(const void*, size_t, CommDType, int peer, int) {
  fail("[send] group '{}' has one rank; there is no peer {}", name(), peer);
}

void SelfComm::recv(void*, size_t, CommDType, int peer, int) {
  fail("[recv] group '{}' has one rank; there is no peer {}", name(), peer);
}

void SelfComm::sendrecv(const void*, size_t, int to, void*, size_t, int from, CommDType, int) {
  if (to != -1 || from != -1)
    fail("[sendrecv] group '{}' has one rank; there is no peer {}", name(), to != -1 ? to : from);
}

void SelfComm::broadcast(void*, size_t, CommDType, int root) {
  if (root != 0) fail("[broadcast] group '{}' has one rank; root {} does not exist", name(), root);
}

std::unique_ptr<Comm> SelfComm::split(int, int, const std::string& name) { return std::make_unique<SelfComm>(name); }

void SelfComm::abort(int code, const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  std::_Exit(code);
}

// ---- launch detection ----------------------------------------------------------------------------

namespace {

bool env_int(const char* name, int* value, std::string* evidence) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return false;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0) return false;
  *value = (int)x;
  if (evidence) *evidence = std::string(name) + "=" + v;
  return true;
}

}  // namespace

LaunchInfo detect_launch() {
  LaunchInfo info;
  int size = 0, rank = 0;
  std::string ev;
  if (env_int("OMPI_COMM_WORLD_SIZE", &size, &ev)) {
    info.launcher = "mpirun";
    env_int("OMPI_COMM_WORLD_RANK", &rank, nullptr);
  } else if (env_int("PMI_SIZE", &size, &ev)) {
    info.launcher = std::getenv("SLURM_STEP_ID") ? "srun" : "pmi";
    env_int("PMI_RANK", &rank, nullptr);
  } else if (env_int("PMIX_RANK", &rank, &ev)) {
    info.launcher = std::getenv("SLURM_STEP_ID") ? "srun" : "pmix";
    size = 0;  // PMIx gives no size variable; MPI_Init tells
    if (!env_int("SLURM_STEP_NUM_TASKS", &size, nullptr)) size = 0;
  } else if (env_int("SLURM_STEP_NUM_TASKS", &size, &ev) && size > 1 && env_int("SLURM_PROCID", &rank, nullptr)) {
    // Inside an srun step of several tasks whose MPI gets no PMI variables: MPI_Init will tell
    // whether it can connect them (make_world_comm checks the world size it sees).
    info.launcher = "srun";
  } else {
    return info;
  }
  info.launched = true;
  info.world_size = size;
  info.world_rank = rank;
  info.evidence = ev;
  return info;
}

}  // namespace moetron::dist
