// MpiComm: the Comm interface over MPI (OpenMPI), and make_world_comm().  Built only when CMake
// finds MPI (MOETRON_HAVE_MPI); otherwise make_world_comm() reports "built without MPI" when a
// launcher started the process.
//
// Algorithms (what stats() counts, per rank, S = bytes of the full buffer, n ranks):
//   reduce_scatter  MPI_Alltoallv of the blocks (each rank receives its block from every rank),
//                   then a local sum in rank order: sends (n-1)/n S.  In rounds of at most
//                   kChunk elements per block, so the receive scratch stays n x kChunk.
//   all_gather      ring of MPI_Sendrecv (n-1 steps): sends (n-1)/n S.
//   all_reduce      small buffers: MPI_Allgather of whole buffers and a local sum in rank order
//                   ((n-1) S); large ones: reduce_scatter + all_gather in place (2(n-1)/n S, the
//                   ring all-reduce's volume).
//   all_to_all_v    MPI_Alltoallv: the bytes addressed to other ranks.
//   broadcast       MPI_Bcast: the payload, counted at the root.
//
// Failure handling (DESIGN §6: never a hang):
//   - every communicator gets an error handler that prints "rank R: MPI error in group G: ..." and
//     calls MPI_Abort, which ends every rank of the job;
//   - a heartbeat watchdog thread (MPI_THREAD_MULTIPLE, on its own duplicate of the world
//     communicator) sends a beat to rank r+1 every second and expects one from rank r-1; when none
//     arrives for MOETRON_HEARTBEAT_TIMEOUT_S seconds (default 20; 0 turns the check off), it prints which rank went
//     silent and aborts the job.  This catches a peer that vanished without its launcher noticing
//     (mpirun and `srun --kill-on-bad-exit` already end the job when a rank dies);
//   - an abort (Comm::abort -- the CLI's reaction to an error on a rank --, or the watchdog's)
//     first sends a "poison" message to every other rank's watchdog, which then aborts too, so the
//     job ends within seconds even where MPI_Abort does not reach the other ranks (a launcher
//     running with fault tolerance); then it calls MPI_Abort.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "dist/comm.h"
#include "dist/mpi_api.h"


namespace moetron::dist {

#ifndef MOETRON_HAVE_MPI

bool have_mpi() { return false; }

std::string mpi_library() { fail("moetron was built without MPI"); }

std::unique_ptr<Comm> make_world_comm() {
  const LaunchInfo li = detect_launch();
  if (li.launched)
    fail(
        "this process was started by {} ({}), but moetron was built without MPI: install libopenmpi-dev "
        "(scripts/setup.sh) and rebuild, or run a single process without a launcher",
        li.launcher, li.evidence);
  return std::make_unique<SelfComm>("world");
}

#else  // MOETRON_HAVE_MPI

bool have_mpi() { return true; }

std::string mpi_library() { return mpi_api().path; }

namespace {

// Elements per block and round of reduce_scatter, and per message of the chunked point-to-point
// calls (MPI counts are int).
constexpr size_t kChunk = size_t(1) << 20;
constexpr size_t kMaxMessage = size_t(1) << 30;
// all_reduce of at most this many elements (times the group size) gathers whole buffers.
constexpr size_t kSmallAllReduce = 1 << 14;

MPI_Datatype mpi_type(CommDType t) {
  switch (t) {
    case CommDType::f32:
      return mpi_api().float_;
    case CommDType::f64:
      return mpi_api().double_;
    case CommDType::i32:
      return mpi_api().int32;
    case CommDType::i64:
      return mpi_api().int64;
    case CommDType::u8:
      return mpi_api().uint8;
    case CommDType::bf16:
      return mpi_api().uint16;  // moved, never reduced (reduce_blocks refuses it)
  }
  return mpi_api().byte;
}

int world_rank_now() {
  int r = -1;
  mpi_api().Comm_rank(mpi_api().comm_world, &r);
  return r;
}

[[noreturn]] void abort_job(int code, const std::string& message) {
  if (!message.empty()) std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  mpi_api().Abort(mpi_api().comm_world, code);
  std::_Exit(code);  // MPI_Abort does not return; keep the compiler and the contract sure of it
}

extern "C" void on_mpi_error(MPI_Comm* comm, int* code, ...) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  mpi_api().Error_string(*code, text, &len);
  char name[MPI_MAX_OBJECT_NAME] = {0};
  int nlen = 0;
  mpi_api().Comm_get_name(*comm, name, &nlen);
  abort_job(1, fmt::format("moetron: rank {}: MPI error in group '{}': {} (a peer has probably died); aborting "
                           "the job",
                           world_rank_now(), name, text));
}

// Sum / max / min of n sources into out, element by element, in source order.
template <typename T>
void reduce_blocks(T* out, const T* src, int n, size_t count, size_t stride, ReduceOp op) {
  for (size_t i = 0; i < count; i++) {
    T acc = src[i];
    for (int q = 1; q < n; q++) {
      const T x = src[(size_t)q * stride + i];
      if (op == ReduceOp::sum)
        acc = acc + x;
      else if (op == ReduceOp::max)
        acc = x > acc ? x : acc;
      else
        acc = x < acc ? x : acc;
    }
    out[i] = acc;
  }
}

void reduce_blocks(void* out, const void* src, int n, size_t count, size_t stride, CommDType t, ReduceOp op) {
  switch (t) {
    case CommDType::f32:
      return reduce_blocks((float*)out, (const float*)src, n, count, stride, op);
    case CommDType::f64:
      return reduce_blocks((double*)out, (const double*)src, n, count, stride, op);
    case CommDType::i32:
      return reduce_blocks((int32_t*)out, (const int32_t*)src, n, count, stride, op);
    case CommDType::i64:
      return reduce_blocks((int64_t*)out, (const int64_t*)src, n, count, stride, op);
    case CommDType::u8:
      return reduce_blocks((uint8_t*)out, (const uint8_t*)src, n, count, stride, op);
    case CommDType::bf16:
      fail("the MPI transport does not reduce bf16 values (reduce in f32)");
  }
}

// MPI_Init .. MPI_Finalize and the heartbeat watchdog; shared by every MpiComm of the process.
class MpiRuntime {
 public:
  explicit MpiRuntime(const LaunchInfo& li) {
    int initialized = 0;
    mpi_api().Initialized(&initialized);
    if (initialized) fail("MPI is already initialised in this process (one MPI world per process)");
    int provided = 0;
    mpi_api().Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    mpi_api().Comm_create_errhandler(on_mpi_error, &errhandler_);
    mpi_api().Comm_set_errhandler(mpi_api().comm_world, errhandler_);
    mpi_api().Comm_rank(mpi_api().comm_world, &rank_);
    mpi_api().Comm_size(mpi_api().comm_world, &size_);
    if (li.world_size > 0 && li.world_size != size_)
      abort_job(1, fmt::format("moetron: rank {}: {} started {} processes ({}) but MPI joined them into a world of "
                               "{}: under Slurm use `srun --mpi=pmix` (or pmi2), or mpirun",
                               rank_, li.launcher, li.world_size, li.evidence, size_));
    const char* t = std::getenv("MOETRON_HEARTBEAT_TIMEOUT_S");
    if (t != nullptr && *t != '\0') timeout_s_ = std::atof(t);
    if (size_ > 1) {
      if (provided < MPI_THREAD_MULTIPLE) {
        if (rank_ == 0)
          std::fprintf(stderr,
                       "moetron: warning: MPI does not provide MPI_THREAD_MULTIPLE; the heartbeat watchdog is off "
                       "(a vanished rank is caught only by the launcher)\n");
      } else {
        mpi_api().Comm_dup(mpi_api().comm_world, &hb_comm_);
        mpi_api().Comm_set_name(hb_comm_, "heartbeat");
        mpi_api().Comm_set_errhandler(hb_comm_, errhandler_);
        mpi_api().Irecv(&poison_in_, 1, mpi_api().int_, MPI_ANY_SOURCE, kPoisonTag, hb_comm_, &poison_req_);
        watchdog_ = std::thread([this] { heartbeat_loop(); });
      }
    }
  }
  ~MpiRuntime() {
    // Every rank is here (or the job has been aborted): all work is done, the watchdog can stop.
    mpi_api().Barrier(mpi_api().comm_world);
    if (watchdog_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
      }
      cv_.notify_all();
      watchdog_.join();
      mpi_api().Cancel(&poison_req_);
      mpi_api().Wait(&poison_req_, MPI_STATUS_IGNORE);
      mpi_api().Comm_free(&hb_comm_);
    }
    mpi_api().Errhandler_free(&errhandler_);
    mpi_api().Finalize();
  }
  MPI_Errhandler errhandler() const { return errhandler_; }

  // Prints `message`, tells every other rank's watchdog (when there is one), ends the job.
  [[noreturn]] void abort(int code, const std::string& message) {
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
    if (hb_comm_ != mpi_api().comm_null) {
      const int payload = code;
      std::vector<MPI_Request> reqs;
      for (int r = 0; r < size_; r++) {
        if (r == rank_) continue;
        reqs.emplace_back();
        mpi_api().Isend(&payload, 1, mpi_api().int_, r, kPoisonTag, hb_comm_, &reqs.back());
      }
      // Small messages complete at once; never wait long for a peer that may be gone.
      const auto t0 = std::chrono::steady_clock::now();
      int done = 0;
      while (!done && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2)) {
        mpi_api().Testall((int)reqs.size(), reqs.data(), &done, MPI_STATUSES_IGNORE);
        if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    abort_job(code, "");
  }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  void heartbeat_loop() {
    using Clock = std::chrono::steady_clock;
    const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
    constexpr int kTag = 1;
    int in_beat = 0;
    MPI_Request recv_req = mpi_api().request_null;
    std::vector<MPI_Request> sends;
    mpi_api().Irecv(&in_beat, 1, mpi_api().int_, prev, kTag, hb_comm_, &recv_req);
    auto last_heard = Clock::now();
    auto last_sent = Clock::now() - std::chrono::seconds(10);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      const auto now = Clock::now();
      if (now - last_sent >= std::chrono::seconds(1)) {
        MPI_Request r;
        mpi_api().Isend(&out_beat_, 1, mpi_api().int_, next, kTag, hb_comm_, &r);
        sends.push_back(r);
        last_sent = now;
      }
      for (;;) {
        int done = 0;
        mpi_api().Test(&recv_req, &done, MPI_STATUS_IGNORE);
        if (!done) break;
        last_heard = Clock::now();
        mpi_api().Irecv(&in_beat, 1, mpi_api().int_, prev, kTag, hb_comm_, &recv_req);
      }
      std::erase_if(sends, [](MPI_Request& r) {
        int done = 0;
        mpi_api().Test(&r, &done, MPI_STATUS_IGNORE);
        return done != 0;
      });
      int poisoned = 0;
      MPI_Status st;
      mpi_api().Test(&poison_req_, &poisoned, &st);
      if (poisoned) {
        // The failed rank calls MPI_Abort itself; this one just ends, non-zero.
        std::fprintf(stderr, "moetron: rank %d: rank %d failed (see its message); ending this rank\n", rank_,
                     st.MPI_SOURCE);
        std::fflush(stderr);
        std::fflush(stdout);
        std::_Exit(poison_in_ > 0 ? poison_in_ : 1);
      }
      const double silent = std::chrono::duration<double>(Clock::now() - last_heard).count();
      if (timeout_s_ > 0 && silent > timeout_s_)
        abort(1, fmt::format("moetron: rank {}: no heartbeat from rank {} for {:.0f} s: rank {} has died or its "
                                 "host is unreachable; aborting the job",
                                 rank_, prev, silent, prev));
      cv_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stop_; });
    }
    lock.unlock();
    mpi_api().Cancel(&recv_req);
    mpi_api().Wait(&recv_req, MPI_STATUS_IGNORE);
    // Beats to a rank that has stopped listening are small (eager) messages: they complete locally.
    for (MPI_Request& r : sends) mpi_api().Request_free(&r);
  }

  static constexpr int kPoisonTag = 2;
  int rank_ = 0, size_ = 1;
  MPI_Errhandler errhandler_ = mpi_api().errhandler_null;
  MPI_Comm hb_comm_ = mpi_api().comm_null;
  int poison_in_ = 0;
  int out_beat_ = 1;
  MPI_Request poison_req_ = mpi_api().request_null;
  double timeout_s_ = 20.0;
  std::thread watchdog_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

class MpiComm final : public Comm {
 public:
  MpiComm(std::shared_ptr<MpiRuntime> rt, MPI_Comm comm, const std::string& name, int world_rank)
      : Comm(rank_of(comm), size_of(comm), world_rank, name), rt_(std::move(rt)), comm_(comm) {
    mpi_api().Comm_set_name(comm_, name.c_str());
    mpi_api().Comm_set_errhandler(comm_, rt_->errhandler());
  }
  ~MpiComm() override {
    if (comm_ != mpi_api().comm_null && comm_ != mpi_api().comm_world) mpi_api().Comm_free(&comm_);
  }
  const char* transport() const override { return "mpi"; }

  void all_reduce(void* data, size_t count, CommDType dtype, ReduceOp op) override {
    const int n = size();
    if (n == 1 || count == 0) return;
    const size_t es = comm_dtype_size(dtype);
    if (count * (size_t)n <= kSmallAllReduce) {
      std::vector<uint8_t> all(count * n * es);
      mpi_api().Allgather(data, (int)count, mpi_type(dtype), all.data(), (int)count, mpi_type(dtype), comm_);
      count_bytes((uint64_t)(n - 1) * count * es);
      reduce_blocks(data, all.data(), n, count, count, dtype, op);
      return;
    }
    std::vector<size_t> counts(n);
    for (int r = 0; r < n; r++) counts[r] = count / n + ((size_t)r < count % n ? 1 : 0);
    size_t off = 0;
    for (int r = 0; r < rank(); r++) off += counts[r];
    uint8_t* mine = static_cast<uint8_t*>(data) + off * es;
    reduce_scatter(mine, data, counts, dtype, op);
    all_gather(data, mine, counts, dtype);
  }

  void reduce_scatter(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype,
                      ReduceOp op) override {
    check_counts("reduce_scatter", counts);
    const int n = size(), me = rank();
    const size_t es = comm_dtype_size(dtype);
    std::vector<size_t> displ(n + 1, 0);
    for (int r = 0; r < n; r++) displ[r + 1] = displ[r] + counts[r];
    if (n == 1) {
      if (out != in && counts[0] > 0) std::memmove(out, in, counts[0] * es);
      return;
    }
    size_t max_count = 0;
    for (size_t c : counts) max_count = std::max(max_count, c);
    const size_t rounds = (max_count + kChunk - 1) / kChunk;
    const size_t mine = counts[me];
    std::vector<uint8_t> scratch(std::min(mine, kChunk) * n * es);
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    const uint8_t* src = static_cast<const uint8_t*>(in);
    uint64_t sent = 0;
    for (size_t k = 0; k < rounds; k++) {
      const size_t begin = k * kChunk;
      const size_t rcount = mine > begin ? std::min(kChunk, mine - begin) : 0;
      // Displacements are in elements relative to `in`; they must fit an int: send from a
      // per-round base pointer instead.
      for (int p = 0; p < n; p++) {
        sc[p] = counts[p] > begin ? (int)std::min(kChunk, counts[p] - begin) : 0;
        rc[p] = (int)rcount;
        rd[p] = (int)(p * rcount);
        if (p != me) sent += (uint64_t)sc[p] * es;
      }
      // Each block's round-k piece lives at displ[p] + begin; gather them through MPI with a
      // base of `in` when the offsets fit an int, else one round at a time per peer.
      bool fits = displ[n] + begin <= (size_t)INT_MAX;
      if (fits) {
        for (int p = 0; p < n; p++) sd[p] = (int)(displ[p] + begin);
        mpi_api().Alltoallv(src, sc.data(), sd.data(), mpi_type(dtype), scratch.data(), rc.data(), rd.data(),
                      mpi_type(dtype), comm_);
      } else {
        // Pairwise exchange with explicit pointers (huge buffers).
        for (int s = 0; s < n; s++) {
          const int to = (me + s) % n, from = (me - s + n) % n;
          mpi_api().Sendrecv(src + (displ[to] + begin) * es, sc[to], mpi_type(dtype), to, 7, scratch.data() + from * rcount * es,
                       (int)rcount, mpi_type(dtype), from, 7, comm_, MPI_STATUS_IGNORE);
        }
      }
      if (rcount > 0)
        reduce_blocks(static_cast<uint8_t*>(out) + begin * es, scratch.data(), n, rcount, rcount, dtype, op);
    }
    count_bytes(sent);
  }

  void all_gather(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype) override {
    check_counts("all_gather", counts);
    const int n = size(), me = rank();
    const size_t es = comm_dtype_size(dtype);
    std::vector<size_t> displ(n + 1, 0);
    for (int r = 0; r < n; r++) displ[r + 1] = displ[r] + counts[r];
    uint8_t* o = static_cast<uint8_t*>(out);
    if (o + displ[me] * es != in && counts[me] > 0) std::memmove(o + displ[me] * es, in, counts[me] * es);
    if (n == 1) return;
    const int next = (me + 1) % n, prev = (me - 1 + n) % n;
    uint64_t sent = 0;
    for (int s = 0; s < n - 1; s++) {
      const int send_block = (me - s + n) % n, recv_block = (me - s - 1 + 2 * n) % n;
      sendrecv_bytes(o + displ[send_block] * es, counts[send_block] * es, next, o + displ[recv_block] * es,
                     counts[recv_block] * es, prev);
      sent += counts[send_block] * es;
    }
    count_bytes(sent);
  }

  void all_to_all_v(void* out, const std::vector<size_t>& recv_counts, const void* in,
                    const std::vector<size_t>& send_counts, CommDType dtype) override {
    check_counts("all_to_all_v", recv_counts);
    check_counts("all_to_all_v", send_counts);
    const int n = size();
    const size_t es = comm_dtype_size(dtype);
    std::vector<int> sc(n), sd(n), rc(n), rd(n);
    size_t so = 0, ro = 0;
    uint64_t sent = 0;
    for (int p = 0; p < n; p++) {
      if (so + send_counts[p] > (size_t)INT_MAX || ro + recv_counts[p] > (size_t)INT_MAX)
        fail("[all_to_all_v] group '{}': more than {} elements per call", name(), INT_MAX);
      sc[p] = (int)send_counts[p];
      sd[p] = (int)so;
      rc[p] = (int)recv_counts[p];
      rd[p] = (int)ro;
      so += send_counts[p];
      ro += recv_counts[p];
      if (p != rank()) sent += send_counts[p] * es;
    }
    mpi_api().Alltoallv(in, sc.data(), sd.data(), mpi_type(dtype), out, rc.data(), rd.data(), mpi_type(dtype), comm_);
    count_bytes(sent);
  }

  void send(const void* data, size_t count, CommDType dtype, int peer, int tag) override {
    check_peer("send", peer);
    const size_t bytes = count * comm_dtype_size(dtype);
    const uint8_t* p = static_cast<const uint8_t*>(data);
    for (size_t off = 0; off < bytes || off == 0; off += kMaxMessage) {
      const size_t len = std::min(kMaxMessage, bytes - off);
      mpi_api().Send(p + off, (int)len, mpi_api().byte, peer, tag, comm_);
      if (bytes == 0) break;
    }
    count_bytes(bytes);
  }

  void recv(void* data, size_t count, CommDType dtype, int peer, int tag) override {
    check_peer("recv", peer);
    const size_t bytes = count * comm_dtype_size(dtype);
    uint8_t* p = static_cast<uint8_t*>(data);
    for (size_t off = 0; off < bytes || off == 0; off += kMaxMessage) {
      const size_t len = std::min(kMaxMessage, bytes - off);
      MPI_Status st;
      mpi_api().Recv(p + off, (int)len, mpi_api().byte, peer, tag, comm_, &st);
      int got = 0;
      mpi_api().Get_count(&st, mpi_api().byte, &got);
      if ((size_t)got != len)
        fail("[recv] group '{}': rank {} sent {} bytes, expected {} (mismatched send/recv)", name(), peer, got, len);
      if (bytes == 0) break;
    }
    count_bytes(0);
  }

  void sendrecv(const void* send, size_t send_count, int to, void* recv, size_t recv_count, int from, CommDType dtype,
                int tag) override {
    if (to != -1) check_peer("sendrecv", to);
    if (from != -1) check_peer("sendrecv", from);
    const size_t es = comm_dtype_size(dtype);
    sendrecv_bytes(static_cast<const uint8_t*>(send), send_count * es, to, static_cast<uint8_t*>(recv), recv_count * es,
                   from, tag);
    count_bytes(to != -1 ? send_count * es : 0);
  }

  void broadcast(void* data, size_t count, CommDType dtype, int root) override {
    check_peer("broadcast", root);
    const size_t bytes = count * comm_dtype_size(dtype);
    uint8_t* p = static_cast<uint8_t*>(data);
    for (size_t off = 0; off < bytes; off += kMaxMessage)
      mpi_api().Bcast(p + off, (int)std::min(kMaxMessage, bytes - off), mpi_api().byte, root, comm_);
    count_bytes(rank() == root ? bytes : 0);
  }

  void barrier() override {
    mpi_api().Barrier(comm_);
    count_bytes(0);
  }

  std::unique_ptr<Comm> split(int color, int key, const std::string& name) override {
    MPI_Comm sub = mpi_api().comm_null;
    mpi_api().Comm_split(comm_, color, key, &sub);
    return std::make_unique<MpiComm>(rt_, sub, name, world_rank());
  }

  [[noreturn]] void abort(int code, const std::string& message) override { rt_->abort(code, message); }

 private:
  static int rank_of(MPI_Comm c) {
    int r = 0;
    mpi_api().Comm_rank(c, &r);
    return r;
  }
  static int size_of(MPI_Comm c) {
    int s = 0;
    mpi_api().Comm_size(c, &s);
    return s;
  }
  void check_peer(const char* op, int peer) const {
    if (peer < 0 || peer >= size()) fail("[{}] group '{}' has {} ranks; no rank {}", op, name(), size(), peer);
  }
  void count_bytes(uint64_t b) { count(b); }
  // Sends sbytes to `to` while receiving rbytes from `from` (-1: that half is absent), in messages
  // of at most kMaxMessage bytes (each direction chunked independently, so the two sides agree).
  void sendrecv_bytes(const uint8_t* sbuf, size_t sbytes, int to, uint8_t* rbuf, size_t rbytes, int from, int tag = 3) {
    std::vector<MPI_Request> reqs;
    if (from != -1)
      for (size_t off = 0; off < rbytes || (off == 0 && rbytes == 0); off += kMaxMessage) {
        reqs.emplace_back();
        mpi_api().Irecv(rbuf + off, (int)std::min(kMaxMessage, rbytes - off), mpi_api().byte, from, tag, comm_, &reqs.back());
        if (rbytes == 0) break;
      }
    if (to != -1)
      for (size_t off = 0; off < sbytes || (off == 0 && sbytes == 0); off += kMaxMessage) {
        reqs.emplace_back();
        mpi_api().Isend(sbuf + off, (int)std::min(kMaxMessage, sbytes - off), mpi_api().byte, to, tag, comm_, &reqs.back());
        if (sbytes == 0) break;
      }
    mpi_api().Waitall((int)reqs.size(), reqs.data(), MPI_STATUSES_IGNORE);
  }

  std::shared_ptr<MpiRuntime> rt_;
  MPI_Comm comm_;
};

}  // namespace

std::unique_ptr<Comm> make_world_comm() {
  const LaunchInfo li = detect_launch();
  if (!li.launched) return std::make_unique<SelfComm>("world");
  auto rt = std::make_shared<MpiRuntime>(li);
  MPI_Comm world = mpi_api().comm_null;
  mpi_api().Comm_dup(mpi_api().comm_world, &world);
  return std::make_unique<MpiComm>(rt, world, "world", rt->rank());
}

#endif  // MOETRON_HAVE_MPI

}  // namespace moetron::dist
