// StagedComm; see staged_comm.h.
#include "dist/staged_comm.h"

#include <cstdlib>
#include <numeric>
#include <vector>

namespace moetron::dist {

namespace {

class StagedComm final : public Comm {
 public:
  StagedComm(Comm& host, MemorySpace& mem, std::unique_ptr<Comm> owned = nullptr)
      : Comm(host.rank(), host.size(), host.world_rank(), host.name()), host_(host), mem_(mem),
        owned_(std::move(owned)) {}

  const char* transport() const override { return "staged"; }
  Comm& host() override { return host_; }
  const CommStats& stats() const override { return host_.stats(); }

  void all_reduce(void* data, size_t count, CommDType dtype, ReduceOp op) override {
    char* h = stage(count * comm_dtype_size(dtype), 0);
    mem_.to_host(h, data, count * comm_dtype_size(dtype));
    host_.all_reduce(h, count, dtype, op);
    mem_.to_device(data, h, count * comm_dtype_size(dtype));
  }
  void reduce_scatter(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype,
                      ReduceOp op) override {
    const size_t es = comm_dtype_size(dtype), total = sum(counts), mine = counts.at(rank());
    char* h = stage(total * es, mine * es);
    mem_.to_host(h, in, total * es);
    char* o = h + total * es;
    host_.reduce_scatter(o, h, counts, dtype, op);
    mem_.to_device(out, o, mine * es);
  }
  void all_gather(void* out, const void* in, const std::vector<size_t>& counts, CommDType dtype) override {
    const size_t es = comm_dtype_size(dtype), total = sum(counts), mine = counts.at(rank());
    char* h = stage(total * es, mine * es);
    char* mine_h = h + total * es;
    mem_.to_host(mine_h, in, mine * es);
    host_.all_gather(h, mine_h, counts, dtype);
    mem_.to_device(out, h, total * es);
  }
  void all_to_all_v(void* out, const std::vector<size_t>& recv_counts, const void* in,
                    const std::vector<size_t>& send_counts, CommDType dtype) override {
    const size_t es = comm_dtype_size(dtype), ns = sum(send_counts), nr = sum(recv_counts);
    char* h = stage(ns * es, nr * es);
    mem_.to_host(h, in, ns * es);
    host_.all_to_all_v(h + ns * es, recv_counts, h, send_counts, dtype);
    mem_.to_device(out, h + ns * es, nr * es);
  }
  void send(const void* data, size_t count, CommDType dtype, int peer, int tag) override {
    char* h = stage(count * comm_dtype_size(dtype), 0);
    mem_.to_host(h, data, count * comm_dtype_size(dtype));
    host_.send(h, count, dtype, peer, tag);
  }
  void recv(void* data, size_t count, CommDType dtype, int peer, int tag) override {
    char* h = stage(count * comm_dtype_size(dtype), 0);
    host_.recv(h, count, dtype, peer, tag);
    mem_.to_device(data, h, count * comm_dtype_size(dtype));
  }
  void sendrecv(const void* send, size_t send_count, int to, void* recv, size_t recv_count, int from, CommDType dtype,
                int tag) override {
    const size_t es = comm_dtype_size(dtype);
    const size_t sb = to != -1 ? send_count * es : 0, rb = from != -1 ? recv_count * es : 0;
    char* h = stage(sb, rb);
    if (sb) mem_.to_host(h, send, sb);
    host_.sendrecv(h, send_count, to, h + sb, recv_count, from, dtype, tag);
    if (rb) mem_.to_device(recv, h + sb, rb);
  }
  void broadcast(void* data, size_t count, CommDType dtype, int root) override {
    char* h = stage(count * comm_dtype_size(dtype), 0);
    mem_.to_host(h, data, count * comm_dtype_size(dtype));
    host_.broadcast(h, count, dtype, root);
    mem_.to_device(data, h, count * comm_dtype_size(dtype));
  }
  void barrier() override { host_.barrier(); }
  std::unique_ptr<Comm> split(int color, int key, const std::string& name) override {
    std::unique_ptr<Comm> inner = host_.split(color, key, name);
    Comm& ref = *inner;
    return std::make_unique<StagedComm>(ref, mem_, std::move(inner));
  }
  [[noreturn]] void abort(int code, const std::string& message) override {
    host_.abort(code, message);
    std::_Exit(code);  // not reached: Comm::abort does not return
  }

 private:
  static size_t sum(const std::vector<size_t>& v) { return std::accumulate(v.begin(), v.end(), size_t(0)); }
  // Host memory for a call: a bytes, then b bytes.
  char* stage(size_t a, size_t b) {
    if (buf_.size() < a + b) buf_.resize(a + b);
    return buf_.data();
  }

  Comm& host_;
  MemorySpace& mem_;
  std::unique_ptr<Comm> owned_;  // the host group of a split
  std::vector<char> buf_;
};

}  // namespace

std::unique_ptr<Comm> make_staged_comm(Comm& host, MemorySpace& mem) { return std::make_unique<StagedComm>(host, mem); }

}  // namespace moetron::dist
