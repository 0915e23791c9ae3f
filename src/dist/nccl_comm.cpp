// NcclComm (see nccl_comm.h).  Compiled to a stub unless MOETRON_HAVE_NCCL.
#include "dist/nccl_comm.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "core/error.h"

#ifdef MOETRON_HAVE_NCCL
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include "core/dynlib.h"
#endif

namespace moetron::dist {

#ifndef MOETRON_HAVE_NCCL

bool have_nccl() { return false; }

std::string nccl_library() { fail("the NCCL transport is not available: moetron was built without NCCL"); }

std::unique_ptr<Comm> make_nccl_comm(Comm&, void*) {
  fail(
      "the NCCL transport is not available: moetron was built without NCCL (it needs the CUDA backend, MPI and "
      "nccl.h / libnccl, e.g. from /usr/local/cuda)");
}

#else

bool have_nccl() { return true; }

namespace {

// libnccl, loaded at the first NCCL communicator (dlopen) rather than linked: linking maps and
// relocates its ~190 MiB image (and its static CUDA runtime's constructors run) in every moetron
// process -- ~1 MiB resident in `generate` or `serve`, which never use it.
struct NcclApi {
  std::string path;
  decltype(&ncclAllGather) AllGather;
  decltype(&ncclAllReduce) AllReduce;
  decltype(&ncclBroadcast) Broadcast;
  decltype(&ncclCommAbort) CommAbort;
  decltype(&ncclCommDestroy) CommDestroy;
  decltype(&ncclCommInitRank) CommInitRank;
  decltype(&ncclCommSplit) CommSplit;
  decltype(&ncclGetErrorString) GetErrorString;
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclGetVersion) GetVersion;
  decltype(&ncclGroupEnd) GroupEnd;
  decltype(&ncclGroupStart) GroupStart;
  decltype(&ncclRecv) Recv;
  decltype(&ncclReduceScatter) ReduceScatter;
  decltype(&ncclSend) Send;
};

NcclApi load_nccl() {
  // The library CMake found (MOETRON_NCCL_LIBRARY), then the dynamic loader's search by soname.
  NcclApi a;
  void* h = dlopen_first(
      {
#ifdef MOETRON_NCCL_LIBRARY
          MOETRON_NCCL_LIBRARY,
#endif
          "libnccl.so.2", "libnccl.so"},
      RTLD_NOW | RTLD_LOCAL, "nccl", "NCCL, e.g. from the CUDA toolkit", &a.path);
  auto sym = [&](const char* name) { return dlsym_required(h, "nccl", a.path, name); };
#define MOETRON_NCCL_FN(name) a.name = reinterpret_cast<decltype(a.name)>(sym("nccl" #name))
  MOETRON_NCCL_FN(AllGather);
  MOETRON_NCCL_FN(AllReduce);
  MOETRON_NCCL_FN(Broadcast);
  MOETRON_NCCL_FN(CommAbort);
  MOETRON_NCCL_FN(CommDestroy);
  MOETRON_NCCL_FN(CommInitRank);
  MOETRON_NCCL_FN(CommSplit);
  MOETRON_NCCL_FN(GetErrorString);
  MOETRON_NCCL_FN(GetUniqueId);
  MOETRON_NCCL_FN(GetVersion);
  MOETRON_NCCL_FN(GroupEnd);
  MOETRON_NCCL_FN(GroupStart);
  MOETRON_NCCL_FN(Recv);
  MOETRON_NCCL_FN(ReduceScatter);
  MOETRON_NCCL_FN(Send);
#undef MOETRON_NCCL_FN
  return a;
}

const NcclApi& nccl_api() {
  static const NcclApi a = load_nccl();  // once, thread-safely; immutable afterwards
  return a;
}

}  // namespace

std::string nccl_library() {
  int v = 0;
  const ncclResult_t r = nccl_api().GetVersion(&v);
  if (r != ncclSuccess) fail("[nccl] ncclGetVersion failed: {}", nccl_api().GetErrorString(r));
  return fmt::format("{} (version code {})", nccl_api().path, v);
}

namespace {

void check_nccl(ncclResult_t r, const char* op, const std::string& group) {
  if (r != ncclSuccess) fail("[{}] NCCL error in group '{}': {}", op, group, nccl_api().GetErrorString(r));
}
void check_cuda(cudaError_t r, const char* op, const std::string& group) {
  if (r != cudaSuccess) fail("[{}] CUDA error in group '{}': {}", op, group, cudaGetErrorString(r));
}

ncclDataType_t nccl_type(CommDType t) {
  switch (t) {
    case CommDType::f32:
      return ncclFloat32;
    case CommDType::f64:
      return ncclFloat64;
    case CommDType::i32:
      return ncclInt32;
    case CommDType::i64:
      return ncclInt64;
    case CommDType::u8:
      return ncclUint8;
    case CommDType::bf16:
      return ncclBfloat16;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  return ncclSum;
}

// Device scratch, freed with its owner.
class DeviceBuffer {
 public:
  DeviceBuffer(size_t bytes, const std::string& group) {
    if (bytes > 0) check_cuda(cudaMalloc(&p_, bytes), "cudaMalloc", group);
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(p_); }

 private:
  void* p_ = nullptr;
};

class NcclComm final : public Comm {
 public:
  NcclComm(Comm& bootstrap, std::unique_ptr<Comm> owned_bootstrap, ncclComm_t comm, cudaStream_t stream,
           const std::string& name)
      : Comm(bootstrap.rank(), bootstrap.size(), bootstrap.world_rank(), name),
        boot_(bootstrap),
        owned_boot_(std::move(owned_bootstrap)),
        comm_(comm),
        stream_(stream) {}
  ~NcclComm() override {
    if (comm_) nccl_api().CommDestroy(comm_);
  }
  const char* transport() const override { return "nccl"; }
  Comm& host() override { return boot_; }

  void all_reduce(void* data, size_t count, CommDType dtype, ReduceOp op) override {
    if (count == 0) return;
    check_nccl(nccl_api().AllReduce(data, data, count, nccl_type(dtype), nccl_op(op), comm_, stream_), "all_reduce", name());
    sync("all_reduce");
    count_bytes((uint64_t)(2.0 * (size() - 1) / size() * count * comm_dtype_size(dtype)));
  }

  void reduce_scatter(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype,
                      ReduceOp op) override {
    check_counts("reduce_scatter", counts);
    const int n = size();
    const size_t es = comm_dtype_size(dtype);
    const size_t mx = *std::max_element(counts.begin(), counts.end());
    const bool even = std::all_of(counts.begin(), counts.end(), [&](size_t c) { return c == mx; });
    uint64_t total = 0;
    for (size_t c : counts) total += c;
    if (mx == 0) return;
    if (even) {
      check_nccl(nccl_api().ReduceScatter(in, out, mx, nccl_type(dtype), nccl_op(op), comm_, stream_), "reduce_scatter",
                 name());
    } else {  // pad every block to the largest
      DeviceBuffer padded(mx * n * es, name()), result(mx * es, name());
      check_cuda(cudaMemsetAsync(padded.get(), 0, mx * n * es, stream_), "cudaMemsetAsync", name());
      size_t off = 0;
      for (int r = 0; r < n; r++) {
        if (counts[r] > 0)
          check_cuda(cudaMemcpyAsync(padded.get() + r * mx * es, static_cast<const uint8_t*>(in) + off * es,
                                     counts[r] * es, cudaMemcpyDeviceToDevice, stream_),
                     "cudaMemcpyAsync", name());
        off += counts[r];
      }
      check_nccl(nccl_api().ReduceScatter(padded.get(), result.get(), mx, nccl_type(dtype), nccl_op(op), comm_, stream_),
                 "reduce_scatter", name());
      if (counts[rank()] > 0)
        check_cuda(cudaMemcpyAsync(out, result.get(), counts[rank()] * es, cudaMemcpyDeviceToDevice, stream_),
                   "cudaMemcpyAsync", name());
      sync("reduce_scatter");
    }
    sync("reduce_scatter");
    count_bytes((total - counts[rank()]) * es);
  }

  void all_gather(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype) override {
    check_counts("all_gather", counts);
    const int n = size(), me = rank();
    const size_t es = comm_dtype_size(dtype);
    const size_t mx = *std::max_element(counts.begin(), counts.end());
    const bool even = std::all_of(counts.begin(), counts.end(), [&](size_t c) { return c == mx; });
    uint64_t total = 0;
    for (size_t c : counts) total += c;
    if (mx == 0) return;
    if (even) {
      check_nccl(nccl_api().AllGather(in, out, mx, nccl_type(dtype), comm_, stream_), "all_gather", name());
    } else {
      DeviceBuffer padded(mx * n * es, name()), mine(mx * es, name());
      if (counts[me] > 0)
        check_cuda(cudaMemcpyAsync(mine.get(), in, counts[me] * es, cudaMemcpyDeviceToDevice, stream_),
                   "cudaMemcpyAsync", name());
      check_nccl(nccl_api().AllGather(mine.get(), padded.get(), mx, nccl_type(dtype), comm_, stream_), "all_gather", name());
      size_t off = 0;
      for (int r = 0; r < n; r++) {
        if (counts[r] > 0)
          check_cuda(cudaMemcpyAsync(static_cast<uint8_t*>(out) + off * es, padded.get() + r * mx * es,
                                     counts[r] * es, cudaMemcpyDeviceToDevice, stream_),
                     "cudaMemcpyAsync", name());
        off += counts[r];
      }
      sync("all_gather");
    }
    sync("all_gather");
    count_bytes((total - counts[(me + 1) % n]) * es);
  }

  void all_to_all_v(void* out, const std::vector<size_t>& recv_counts, const void* in,
                    const std::vector<size_t>& send_counts, CommDType dtype) override {
    check_counts("all_to_all_v", recv_counts);
    check_counts("all_to_all_v", send_counts);
    const size_t es = comm_dtype_size(dtype);
    size_t so = 0, ro = 0;
    uint64_t sent = 0;
    check_nccl(nccl_api().GroupStart(), "all_to_all_v", name());
    for (int p = 0; p < size(); p++) {
      if (send_counts[p] > 0)
        check_nccl(nccl_api().Send(static_cast<const uint8_t*>(in) + so * es, send_counts[p] * es, ncclUint8, p, comm_,
                            stream_),
                   "all_to_all_v", name());
      if (recv_counts[p] > 0)
        check_nccl(nccl_api().Recv(static_cast<uint8_t*>(out) + ro * es, recv_counts[p] * es, ncclUint8, p, comm_, stream_),
                   "all_to_all_v", name());
      if (p != rank()) sent += send_counts[p] * es;
      so += send_counts[p];
      ro += recv_counts[p];
    }
    check_nccl(nccl_api().GroupEnd(), "all_to_all_v", name());
    sync("all_to_all_v");
    count_bytes(sent);
  }

  void send(const void* data, size_t count, CommDType dtype, int peer, int) override {
    check_nccl(nccl_api().Send(data, count, nccl_type(dtype), peer, comm_, stream_), "send", name());
    sync("send");
    count_bytes(count * comm_dtype_size(dtype));
  }
  void recv(void* data, size_t count, CommDType dtype, int peer, int) override {
    check_nccl(nccl_api().Recv(data, count, nccl_type(dtype), peer, comm_, stream_), "recv", name());
    sync("recv");
    count_bytes(0);
  }
  void sendrecv(const void* send, size_t send_count, int to, void* recv, size_t recv_count, int from, CommDType dtype,
                int) override {
    check_nccl(nccl_api().GroupStart(), "sendrecv", name());
    if (to != -1) check_nccl(nccl_api().Send(send, send_count, nccl_type(dtype), to, comm_, stream_), "sendrecv", name());
    if (from != -1) check_nccl(nccl_api().Recv(recv, recv_count, nccl_type(dtype), from, comm_, stream_), "sendrecv", name());
    check_nccl(nccl_api().GroupEnd(), "sendrecv", name());
    sync("sendrecv");
    count_bytes(to != -1 ? send_count * comm_dtype_size(dtype) : 0);
  }
  void broadcast(void* data, size_t count, CommDType dtype, int root) override {
    check_nccl(nccl_api().Broadcast(data, data, count, nccl_type(dtype), root, comm_, stream_), "broadcast", name());
    sync("broadcast");
    count_bytes(rank() == root ? count * comm_dtype_size(dtype) : 0);
  }
  void barrier() override {
    sync("barrier");
    boot_.barrier();
  }
  std::unique_ptr<Comm> split(int color, int key, const std::string& name) override {
    std::unique_ptr<Comm> sub_boot = boot_.split(color, key, name + ".bootstrap");
    ncclComm_t sub = nullptr;
    check_nccl(nccl_api().CommSplit(comm_, color, key, &sub, nullptr), "split", this->name());
    Comm& b = *sub_boot;
    return std::make_unique<NcclComm>(b, std::move(sub_boot), sub, stream_, name);
  }
  [[noreturn]] void abort(int code, const std::string& message) override {
    nccl_api().CommAbort(comm_);
    comm_ = nullptr;
    boot_.abort(code, message);
    std::_Exit(code);  // not reached
  }

 private:
  void sync(const char* op) { check_cuda(cudaStreamSynchronize(stream_), op, name()); }
  void count_bytes(uint64_t b) { count(b); }

  Comm& boot_;
  std::unique_ptr<Comm> owned_boot_;  // the bootstrap group of a split communicator
  ncclComm_t comm_;
  cudaStream_t stream_;
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(Comm& bootstrap, void* stream) {
  ncclUniqueId id{};
  if (bootstrap.rank() == 0) check_nccl(nccl_api().GetUniqueId(&id), "ncclGetUniqueId", bootstrap.name());
  bootstrap.broadcast(reinterpret_cast<void*>(&id), sizeof(id), CommDType::u8, 0);
  ncclComm_t comm = nullptr;
  check_nccl(nccl_api().CommInitRank(&comm, bootstrap.size(), id, bootstrap.rank()), "ncclCommInitRank", bootstrap.name());
  return std::make_unique<NcclComm>(bootstrap, nullptr, comm, static_cast<cudaStream_t>(stream),
                                    bootstrap.name());
}

#endif  // MOETRON_HAVE_NCCL

}  // namespace moetron::dist
