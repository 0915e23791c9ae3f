// Collective communication (DESIGN §6): one `Comm` interface, one implementation per transport.
//
//   SelfComm   a group of one process: every collective is a copy or a no-op (single-process runs,
//              which need no launcher).
//   MpiComm    OpenMPI (src/dist/mpi_comm.cpp), for `mpirun -np N` and Slurm's `srun`; in builds
//              without MPI the factory reports "built without MPI" when a launcher is detected.
//   NcclComm   GPUs (src/dist/nccl_comm.cpp, CUDA builds with NCCL only): the same interface over
//              device pointers, its communicator bootstrapped through an MpiComm.
//
// Semantics every implementation keeps (so any layout computes what one process computes):
//   - Reductions are deterministic and identical on every rank: all_reduce and reduce_scatter sum
//     the contributions in rank order 0, 1, ..., n-1 (never in arrival order), so a run is bitwise
//     reproducible for a fixed layout and every rank of a group holds bitwise-equal results.
//   - Counts are ELEMENTS of `dtype`, never bytes; stats() counts BYTES this rank sent, as the
//     algorithm in the implementation sends them (ring all-gather: (n-1)/n of the gathered size;
//     reduce-scatter by all-to-all: (n-1)/n of the input; all-reduce = reduce-scatter + all-gather).
//   - Every call is collective over the group unless it is send/recv; all ranks of the group must
//     make the same calls in the same order with the same counts.
//   - Failures (a transport error, a vanished peer) end the whole job with a non-zero exit and a
//     message naming the rank (see MpiComm); they are never returned as a value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moetron::dist {

// bf16: 2-byte floats moved as they are (all_to_all_v, send/recv, gathers); only NCCL reduces them.
enum class CommDType { f32, f64, i32, i64, u8, bf16 };
enum class ReduceOp { sum, max, min };

size_t comm_dtype_size(CommDType t);
const char* comm_dtype_name(CommDType t);

template <typename T>
constexpr CommDType comm_dtype_of();
template <>
constexpr CommDType comm_dtype_of<float>() { return CommDType::f32; }
template <>
constexpr CommDType comm_dtype_of<double>() { return CommDType::f64; }
template <>
constexpr CommDType comm_dtype_of<int32_t>() { return CommDType::i32; }
template <>
constexpr CommDType comm_dtype_of<int64_t>() { return CommDType::i64; }
template <>
constexpr CommDType comm_dtype_of<uint8_t>() { return CommDType::u8; }

// Bytes sent and calls made by one Comm (not by the groups split from it).
struct CommStats {
  uint64_t bytes_sent = 0;
  uint64_t calls = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // "world", "tp", "dp", ...: used in error messages.
  const std::string& name() const { return name_; }
  // The rank of this process in the world group (for messages).
  int world_rank() const { return world_rank_; }
  // "self", "mpi", "nccl", "staged".
  virtual const char* transport() const = 0;
  // The same ranks over host memory: this group itself for the host transports (self, MPI); the MPI
  // group a device transport (NCCL, staged through the host) was made from.  Control data --
  // counts, statistics, scalars -- travels through it.
  virtual Comm& host() { return *this; }

  // data[count] in place: the element-wise reduction over the group, in rank order.
  virtual void all_reduce(void* data, size_t count, CommDType dtype, ReduceOp op) = 0;
  // in[sum(counts)] is split into size() consecutive blocks, block r of counts[r] elements; rank r
  // receives in out[counts[r]] the reduction of block r over the group.  out may alias the start of
  // block rank() in `in` (in + offset of that block).
  virtual void reduce_scatter(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype,
                              ReduceOp op) = 0;
  // out[sum(counts)] = the blocks of every rank, in rank order; rank r contributes in[counts[r]].
  // `in` may alias its own block inside `out`.
  virtual void all_gather(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype) = 0;
  // Rank r sends send_counts[p] elements (consecutive blocks of `in`, in peer order) to every peer p
  // and receives recv_counts[p] elements from p into consecutive blocks of `out`; zero counts are fine.
  virtual void all_to_all_v(void* out, const std::vector<size_t>& recv_counts, const void* in,
                            const std::vector<size_t>& send_counts, CommDType dtype) = 0;
  // Point to point within the group; `tag` >= 0 tells apart messages between the same pair.
  virtual void send(const void* data, size_t count, CommDType dtype, int peer, int tag) = 0;
  virtual void recv(void* data, size_t count, CommDType dtype, int peer, int tag) = 0;
  // Sends send[send_count] to peer `to` and receives recv[recv_count] from peer `from` in one call
  // (either half absent when its peer is -1), so two ranks exchanging in opposite directions --
  // pipeline stages passing activations forward and gradients back -- cannot deadlock on each other.
  virtual void sendrecv(const void* send, size_t send_count, int to, void* recv, size_t recv_count, int from,
                        CommDType dtype, int tag) = 0;
  virtual void broadcast(void* data, size_t count, CommDType dtype, int root) = 0;
  virtual void barrier() = 0;
  // A sub-group: the ranks passing the same color, ordered by key (collective over this group).
  virtual std::unique_ptr<Comm> split(int color, int key, const std::string& name) = 0;
  // Ends the whole job (every rank of every group) with exit status `code`, after printing `message`
  // prefixed with this rank.  The one sanctioned exit from inside the library: a rank that fails
  // alone would otherwise leave its peers waiting forever in the next collective.
  [[noreturn]] virtual void abort(int code, const std::string& message) = 0;

  // Bytes this group sent (a device transport staged through a host group reports the host group's).
  virtual const CommStats& stats() const { return stats_; }

  // Typed conveniences.
  template <typename T>
  void all_reduce(T* data, size_t count, ReduceOp op = ReduceOp::sum) {
    all_reduce(static_cast<void*>(data), count, comm_dtype_of<T>(), op);
  }
  template <typename T>
  T all_reduce_value(T value, ReduceOp op = ReduceOp::sum) {
    all_reduce(&value, 1, op);
    return value;
  }
  template <typename T>
  void broadcast(T* data, size_t count, int root) {
    broadcast(static_cast<void*>(data), count, comm_dtype_of<T>(), root);
  }
  void broadcast_string(std::string& s, int root);

 protected:
  Comm(int rank, int size, int world_rank, std::string name)
      : rank_(rank), size_(size), world_rank_(world_rank), name_(std::move(name)) {}
  void count(uint64_t bytes) {
    stats_.bytes_sent += bytes;
    stats_.calls++;
  }
  void check_counts(const char* op, const std::vector<size_t>& counts) const;

 private:
  int rank_, size_, world_rank_;
  std::string name_;
  CommStats stats_;
};

// A group of one: collectives copy or do nothing, send/recv are errors.
class SelfComm final : public Comm {
 public:
  explicit SelfComm(std::string name = "world") : Comm(0, 1, 0, std::move(name)) {}
  const char* transport() const override { return "self"; }
  void all_reduce(void* data, size_t count, CommDType dtype, ReduceOp op) override;
  void reduce_scatter(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype,
                      ReduceOp op) override;
  void all_gather(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype) override;
  void all_to_all_v(void* out, const std::vector<size_t>& recv_counts, const void* in,
                    const std::vector<size_t>& send_counts, CommDType dtype) override;
  void send(const void* data, size_t count, CommDType dtype, int peer, int tag) override;
  void recv(void* data, size_t count, CommDType dtype, int peer, int tag) override;
  void sendrecv(const void* send, size_t send_count, int to, void* recv, size_t recv_count, int from, CommDType dtype,
                int tag) override;
  void broadcast(void* data, size_t count, CommDType dtype, int root) override;
  void barrier() override {}
  std::unique_ptr<Comm> split(int color, int key, const std::string& name) override;
  [[noreturn]] void abort(int code, const std::string& message) override;
  using Comm::all_reduce;
  using Comm::broadcast;
};

// How this process was started.
struct LaunchInfo {
  bool launched = false;    // by mpirun / srun (a world of one started by a launcher counts)
  int world_size = 1;       // from the launcher's environment (1 when not launched)
  int world_rank = 0;
  std::string launcher;     // "mpirun", "srun", "" (none)
  std::string evidence;     // the variable that told, e.g. "OMPI_COMM_WORLD_SIZE=4"
};
// Reads OMPI_COMM_WORLD_SIZE/RANK (OpenMPI's mpirun), PMIX_RANK (PMIx launchers), PMI_SIZE/PMI_RANK
// (PMI-2, e.g. srun --mpi=pmi2) and SLURM_STEP_NUM_TASKS/SLURM_PROCID (inside an srun step; a batch
// script outside srun is not a launch).
LaunchInfo detect_launch();

// True when this build has an MPI implementation.
bool have_mpi();

// The MPI library, loaded at first use (src/dist/mpi_api.h: only a launched process's
// make_world_comm() needs it): the path it was loaded from.  Loads it without initialising MPI;
// throws Error when it cannot be loaded or in a build without MPI.
std::string mpi_library();

// The world group of this process, and the transport's lifetime (MPI_Init .. MPI_Finalize): an
// MpiComm when a launcher started the process, else a SelfComm.  Error "built without MPI" when a
// launcher is detected in a build without MPI.  At most one MPI world per process.
std::unique_ptr<Comm> make_world_comm();

}  // namespace moetron::dist
