// The CUDA backend's runtime: device discovery, the Context every op runs in (stream, cuBLASLt
// handle and workspace, GEMM algorithm cache), device memory arenas and host<->device copies.
//
// This header has no CUDA types, so plain C++ (the model, the CLI, the tests) includes it in every
// build.  Built without CUDA (MOETRON_CUDA=OFF, or no nvcc), src/cuda/stubs.cpp defines the same
// functions: cuda_unavailable_reason() says "built without CUDA" and everything else fails with
// that message.  Device memory comes from plain cudaMalloc (never managed memory), one allocation
// per arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/dtype.h"

namespace moetron::gpu {

// A bf16 element in device memory (the kernels' __nv_bfloat16, same size and layout).  Host code
// only does pointer arithmetic on it and converts through upload_bf16 / download_bf16.
struct Bf16 {
  uint16_t bits;
};

// True when this binary contains the CUDA backend.
bool cuda_compiled();
// Loads the GPU libraries moetron opens at run time (cuBLASLt; a CUDA context does it first) and
// returns the library's name for CUBLAS_STATUS_SUCCESS as a proof of the resolved table.  Error
// naming the library when it cannot be loaded; built without CUDA: "built without CUDA".
std::string load_gpu_libraries();
// "" when a CUDA device can be used; otherwise why not ("built without CUDA", "no CUDA device",
// the driver's error).  Never throws.
std::string cuda_unavailable_reason();

struct DeviceInfo {
  std::string name;
  int major = 0, minor = 0;  // compute capability
  int sm_count = 0;
  size_t total_bytes = 0, free_bytes = 0;
};
// The device this process uses: its launcher's local rank (OMPI_COMM_WORLD_LOCAL_RANK,
// SLURM_LOCALID or LOCAL_RANK) modulo the visible devices, else 0.
int default_device();
DeviceInfo device_info();  // of default_device()

// One per model (or test): the CUDA stream the ops run on, the cuBLASLt handle, the workspace and
// the cache of GEMM algorithms by shape.  Not thread-safe; ops on one Context run in stream order.
class Context {
 public:
  Context();  // default_device(); fails when no device can be used
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // Waits for all queued work; a kernel failure surfaces here, named with `what`.
  void synchronize(const char* what);
  // The same without throwing (for destructors); false when the stream reported an error.
  bool try_synchronize() noexcept;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// One cudaMalloc, handed out front to back.  `what` names the arena in error messages.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(size_t bytes, const std::string& what);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  DeviceArena(DeviceArena&& o) noexcept { swap(o); }
  DeviceArena& operator=(DeviceArena&& o) noexcept {
    DeviceArena tmp(std::move(o));
    swap(tmp);
    return *this;
  }

  // `bytes` from the arena, 256-byte aligned; fails naming the arena when it is exhausted.
  void* take(size_t bytes);
  template <typename T>
  T* take_n(size_t n) {
    return static_cast<T*>(take(n * sizeof(T)));
  }
  size_t used() const { return used_; }
  size_t capacity() const { return capacity_; }
  // Bytes take() uses for `bytes` (for sizing an arena before creating it).
  static size_t rounded(size_t bytes) { return (bytes + 255) / 256 * 256; }

 private:
  void swap(DeviceArena& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(capacity_, o.capacity_);
    std::swap(used_, o.used_);
    std::swap(what_, o.what_);
  }
  char* base_ = nullptr;
  size_t capacity_ = 0, used_ = 0;
  std::string what_;
};

// The Context's cudaStream_t, for NCCL (null when built without CUDA).
void* stream_handle(Context& ctx);

// Copies in stream order; the *_host variants return when the data is on the host.
void copy_to_device(Context& ctx, void* dst, const void* src, size_t bytes);
void copy_to_host(Context& ctx, void* dst, const void* src, size_t bytes);
void copy_device(Context& ctx, void* dst, const void* src, size_t bytes);
void fill_zero(Context& ctx, void* dst, size_t bytes);
// n floats -> bf16 on the device (rounded to nearest even on the host), and back.
void upload_bf16(Context& ctx, Bf16* dst, const float* src, size_t n);
void download_bf16(Context& ctx, float* dst, const Bf16* src, size_t n);

}  // namespace moetron::gpu
