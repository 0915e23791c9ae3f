// Causal GQA attention through cuDNN's fused SDPA (the cuDNN frontend's graph API, forward and
// backward), the CUDA backend's first choice where the graph expresses the problem: no padding mask
// and no packed segments (the native kernel, cuda/attention.cu, serves those), an optional sliding
// window, head dim a multiple of 8 up to 128.  libcudnn.so.9 is loaded with dlopen at the first use
// (the frontend's dynamic loading), so nothing links cuDNN; without it, or built without the frontend
// headers (scripts/setup.sh fetches them), unavailable() says why and the backend runs the native
// kernel.  Graphs are built once per shape and kept.
// Layouts (bf16): q, out [B,T,NH,HD]; k, v [B,T,NKV,HD]; stats [B,NH,T] f32, cuDNN's softmax
// statistics (natural log-sum-exp of the scaled scores): a forward's stats feed only this path's
// backward (the backend picks the same path for both from the same shape and mask).
#pragma once

#include <memory>
#include <string>

namespace moetron::gpu {

struct CudnnSdpaShape {
  int B = 0, T = 0, NH = 0, NKV = 0, HD = 0;
  int window = 0;  // keys j with i - j < window (0: every earlier key)
  bool operator==(const CudnnSdpaShape&) const = default;
};

class CudnnAttention {
 public:
  // stream: the cudaStream_t the backend's ops run on.
  explicit CudnnAttention(void* stream);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Why the fused path cannot run at all ("" when it can): built without the frontend headers, or
  // libcudnn not loadable.
  const std::string& unavailable() const;
  // Why it cannot run this problem ("" when it can); masked: a padding mask or packed segments.
  // Builds (and keeps) the shape's forward and backward graphs, so a shape cuDNN refuses is refused
  // here, with cuDNN's reason.
  std::string why_not(const CudnnSdpaShape& s, bool masked) const;
  void forward(const CudnnSdpaShape& s, void* out, float* stats, const void* q, const void* k, const void* v);
  // dq, dk, dv (assign).
  void backward(const CudnnSdpaShape& s, void* dq, void* dk, void* dv, const void* dout, const void* out,
                const float* stats, const void* q, const void* k, const void* v);
  // "cuDNN 9.x.y" of the loaded library ("" when none).
  std::string version() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moetron::gpu
