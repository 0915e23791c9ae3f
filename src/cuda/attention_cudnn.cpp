// Fused attention through the cuDNN frontend; see attention_cudnn.h.
#include "cuda/attention_cudnn.h"

#include <fmt/format.h>

#include "core/error.h"

#if defined(MOETRON_HAVE_CUDA) && defined(MOETRON_HAVE_CUDNN_FRONTEND)

#include <dlfcn.h>

#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include <cuda_runtime.h>
#include <cudnn_frontend.h>

// The frontend's dynamic loading reads the library through this handle (its documented contract):
// set once, under a call_once, before any frontend call, and never changed.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace moetron::gpu {

namespace fe = cudnn_frontend;

namespace {

// Loads libcudnn once per process; the reason when it cannot.
const std::string& load_cudnn() {
  static std::once_flag once;
  static std::string why;
  std::call_once(once, [] {
    for (const char* name : {"libcudnn.so.9", "libcudnn.so"}) {
      cudnn_frontend::cudnn_dlhandle = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
      if (cudnn_frontend::cudnn_dlhandle != nullptr) return;
      why += std::string(why.empty() ? "" : "; ") + dlerror();
    }
    why = "libcudnn not loadable (" + why + ")";
  });
  return why;
}

// The frontend's graphs name their tensors by these uids.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

std::vector<int64_t> bshd_stride(const CudnnSdpaShape& s, int heads) {
  return {(int64_t)s.T * heads * s.HD, s.HD, (int64_t)heads * s.HD, 1};
}

std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph& g, const char* name, Uid uid,
                                                     const CudnnSdpaShape& s, int heads) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({s.B, heads, s.T, s.HD})
                      .set_stride(bshd_stride(s, heads)));
}

std::shared_ptr<fe::graph::Tensor_attributes> stats_tensor(fe::graph::Graph& g, const CudnnSdpaShape& s) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name("stats")
                      .set_uid(kStats)
                      .set_dim({s.B, s.NH, s.T, 1})
                      .set_stride({(int64_t)s.NH * s.T, s.T, 1, 1})
                      .set_data_type(fe::DataType_t::FLOAT));
}

void check(fe::error_t e, const char* what) {
  if (e.is_bad()) fail("[cuda attention (cuDNN)] {}: {}", what, e.get_message());
}

void check_status(cudnnStatus_t st, const char* what) {
  if (st != CUDNN_STATUS_SUCCESS) fail("[cuda attention (cuDNN)] {}: status {}", what, (int)st);
}

}  // namespace

// Orders shapes for the maps below.
auto shape_tie(const CudnnSdpaShape& s) { return std::tie(s.B, s.T, s.NH, s.NKV, s.HD, s.window); }
struct ShapeLess {
  bool operator()(const CudnnSdpaShape& a, const CudnnSdpaShape& b) const { return shape_tie(a) < shape_tie(b); }
};

struct CudnnAttention::Impl {
  cudaStream_t stream = nullptr;
  cudnnHandle_t handle = nullptr;
  std::string unavailable;
  std::map<CudnnSdpaShape, std::shared_ptr<fe::graph::Graph>, ShapeLess> forward_graphs, backward_graphs;
  std::map<CudnnSdpaShape, std::string, ShapeLess> refused;  // shapes whose graphs cuDNN would not build
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  std::shared_ptr<fe::graph::Graph> graph(const CudnnSdpaShape& s, bool backward);
  void* ensure_workspace(const fe::graph::Graph& g);
};

std::shared_ptr<fe::graph::Graph> CudnnAttention::Impl::graph(const CudnnSdpaShape& s, bool backward) {
  auto& graphs = backward ? backward_graphs : forward_graphs;
  if (auto it = graphs.find(s); it != graphs.end()) return it->second;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const auto q = tensor(*g, "q", kQ, s, s.NH), k = tensor(*g, "k", kK, s, s.NKV), v = tensor(*g, "v", kV, s, s.NKV);
  const float scale = 1.0f / std::sqrt((float)s.HD);
  if (!backward) {
    auto opts = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(scale);
    opts.set_causal_mask(true);
    if (s.window > 0) opts.set_sliding_window_length(s.window);
    auto [o, stats] = g->sdpa(q, k, v, opts);
    o->set_output(true).set_uid(kO).set_dim({s.B, s.NH, s.T, s.HD}).set_stride(bshd_stride(s, s.NH));
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
  } else {
    const auto o = tensor(*g, "o", kO, s, s.NH), dout = tensor(*g, "dO", kDO, s, s.NH);
    const auto stats = stats_tensor(*g, s);
    auto opts = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(scale);
    opts.set_causal_mask(true);
    opts.set_deterministic_algorithm(true);  // the same gradients run to run
    if (s.window > 0) opts.set_sliding_window_length(s.window);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, opts);
    dq->set_output(true).set_uid(kDQ).set_dim({s.B, s.NH, s.T, s.HD}).set_stride(bshd_stride(s, s.NH));
    dk->set_output(true).set_uid(kDK).set_dim({s.B, s.NKV, s.T, s.HD}).set_stride(bshd_stride(s, s.NKV));
    dv->set_output(true).set_uid(kDV).set_dim({s.B, s.NKV, s.T, s.HD}).set_stride(bshd_stride(s, s.NKV));
  }
  check(g->validate(), "validate");
  check(g->build_operation_graph(handle), "build_operation_graph");
  check(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
  check(g->check_support(handle), "check_support");
  check(g->build_plans(), "build_plans");
  graphs.emplace(s, g);
  return g;
}

void* CudnnAttention::Impl::ensure_workspace(const fe::graph::Graph& g) {
  int64_t bytes = 0;
  check(g.get_workspace_size(bytes), "get_workspace_size");
  if ((size_t)bytes > workspace_bytes) {
    if (workspace != nullptr) {
      cudaStreamSynchronize(stream);  // the old workspace may still be in use
      cudaFree(workspace);
      workspace = nullptr;
      workspace_bytes = 0;
    }
    if (cudaMalloc(&workspace, (size_t)bytes) != cudaSuccess)
      fail("[cuda attention (cuDNN)] cannot allocate a workspace of {} bytes", bytes);
    workspace_bytes = (size_t)bytes;
  }
  return workspace;
}

CudnnAttention::CudnnAttention(void* stream) : impl_(std::make_unique<Impl>()) {
  impl_->stream = static_cast<cudaStream_t>(stream);
  impl_->unavailable = load_cudnn();
  if (!impl_->unavailable.empty()) return;
  try {  // the frontend throws when it cannot load libcudart
    const cudnnStatus_t st = fe::detail::create_handle(&impl_->handle);
    if (st != CUDNN_STATUS_SUCCESS) {
      impl_->unavailable = fmt::format("cudnnCreate failed (status {})", (int)st);
      impl_->handle = nullptr;
      return;
    }
    check_status(fe::detail::set_stream(impl_->handle, impl_->stream), "cudnnSetStream");
  } catch (const std::exception& e) {
    impl_->unavailable = e.what();
  }
}

CudnnAttention::~CudnnAttention() {
  impl_->forward_graphs.clear();
  impl_->backward_graphs.clear();
  if (impl_->workspace != nullptr) cudaFree(impl_->workspace);
  if (impl_->handle != nullptr) (void)fe::detail::destroy_handle(impl_->handle);
}

const std::string& CudnnAttention::unavailable() const { return impl_->unavailable; }

std::string CudnnAttention::version() const {
  if (!impl_->unavailable.empty()) return "";
  const size_t v = fe::detail::get_backend_version();
  return fmt::format("cuDNN {}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

std::string CudnnAttention::why_not(const CudnnSdpaShape& s, bool masked) const {
  if (!impl_->unavailable.empty()) return impl_->unavailable;
  if (masked) return "a padding mask or packed segments";
  if (s.HD % 8 != 0 || s.HD > 128) return fmt::format("head dim {} (cuDNN: a multiple of 8, at most 128)", s.HD);
  if (s.NH % s.NKV != 0) return fmt::format("{} heads over {} kv heads", s.NH, s.NKV);
  // Both graphs built now (and kept): a shape this cuDNN does not support falls back here, with
  // cuDNN's reason, rather than failing in the middle of a step.
  if (auto it = impl_->refused.find(s); it != impl_->refused.end()) return it->second;
  try {
    impl_->graph(s, false);
    impl_->graph(s, true);
  } catch (const std::exception& e) {
    return impl_->refused.emplace(s, e.what()).first->second;
  }
  return "";
}

void CudnnAttention::forward(const CudnnSdpaShape& s, void* out, float* stats, const void* q, const void* k,
                             const void* v) {
  const auto g = impl_->graph(s, false);
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(q)},
                                             {kK, const_cast<void*>(k)},
                                             {kV, const_cast<void*>(v)},
                                             {kO, out},
                                             {kStats, stats}};
  check(g->execute(impl_->handle, pack, impl_->ensure_workspace(*g)), "execute (forward)");
}

void CudnnAttention::backward(const CudnnSdpaShape& s, void* dq, void* dk, void* dv, const void* dout,
                              const void* out, const float* stats, const void* q, const void* k, const void* v) {
  const auto g = impl_->graph(s, true);
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<void*>(q)},   {kK, const_cast<void*>(k)},          {kV, const_cast<void*>(v)},
      {kO, const_cast<void*>(out)}, {kDO, const_cast<void*>(dout)},      {kStats, const_cast<float*>(stats)},
      {kDQ, dq},                    {kDK, dk},                           {kDV, dv}};
  check(g->execute(impl_->handle, pack, impl_->ensure_workspace(*g)), "execute (backward)");
}

}  // namespace moetron::gpu

#else  // built without CUDA or without the cuDNN frontend headers: the native kernel only

namespace moetron::gpu {

struct CudnnAttention::Impl {
  std::string unavailable;
};

CudnnAttention::CudnnAttention(void*) : impl_(std::make_unique<Impl>()) {
#ifdef MOETRON_HAVE_CUDA
  impl_->unavailable = "built without the cuDNN frontend headers (scripts/setup.sh fetches them)";
#else
  impl_->unavailable = "built without CUDA";
#endif
}
CudnnAttention::~CudnnAttention() = default;
const std::string& CudnnAttention::unavailable() const { return impl_->unavailable; }
std::string CudnnAttention::version() const { return ""; }
std::string CudnnAttention::why_not(const CudnnSdpaShape&, bool) const { return impl_->unavailable; }
void CudnnAttention::forward(const CudnnSdpaShape&, void*, float*, const void*, const void*, const void*) {
  fail("[cuda attention (cuDNN)] {}", impl_->unavailable);
}
void CudnnAttention::backward(const CudnnSdpaShape&, void*, void*, void*, const void*, const void*, const float*,
                              const void*, const void*, const void*) {
  fail("[cuda attention (cuDNN)] {}", impl_->unavailable);
}

}  // namespace moetron::gpu

#endif
