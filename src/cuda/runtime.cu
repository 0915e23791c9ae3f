// Device discovery, the Context, arenas, copies and dtype conversions.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

// The cuBLASLt workspace NVIDIA recommends for Hopper.
constexpr size_t kWorkspaceBytes = 32u << 20;

__global__ void to_bf16_kernel(bf16* out, const float* in, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void to_f32_kernel(float* out, const bf16* in, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

unsigned grid_stride_blocks(size_t n) {
  const unsigned b = blocks_for(n, 256);
  return b < 65536u ? b : 65536u;
}

}  // namespace

void fail_cuda(const char* op, const char* call, cudaError_t err) {
  fail("[{}] {} failed: {}: {}", op, call, cudaGetErrorName(err), cudaGetErrorString(err));
}

void fail_cublas(const char* op, const char* call, cublasStatus_t status) {
  fail("[{}] {} failed: {}: {}", op, call, cublaslt().GetStatusName(status), cublaslt().GetStatusString(status));
}

bool cuda_compiled() { return true; }

std::string load_gpu_libraries() { return cublaslt().GetStatusName(CUBLAS_STATUS_SUCCESS); }

std::string cuda_unavailable_reason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls start clean
    return std::string("no usable CUDA device: cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + ": " +
           cudaGetErrorString(err);
  }
  if (n == 0) return "no CUDA device: cudaGetDeviceCount returned 0";
  return "";
}

int default_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    return 0;
  }
  // One GPU per local rank: the launcher's local rank (Open MPI, Slurm, torchrun-style) modulo the
  // devices this process sees; ranks beyond the count share GPUs (as the tests do).
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && *v != '\0') {
      char* end = nullptr;
      const long r = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && r >= 0) return (int)(r % n);
    }
  }
  return 0;
}

DeviceInfo device_info() {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) fail("[device_info] {}", why);
  cudaDeviceProp prop{};
  const int dev = default_device();
  CUDA_CALL("device_info", cudaGetDeviceProperties(&prop, dev));
  DeviceInfo info;
  info.name = prop.name;
  info.major = prop.major;
  info.minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  CUDA_CALL("device_info", cudaSetDevice(dev));
  CUDA_CALL("device_info", cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

void Context::Impl::clear_gemm_plans() {
  for (auto& [key, p] : gemm_plans) {
    if (p.a) cublaslt().MatrixLayoutDestroy(p.a);
    if (p.b) cublaslt().MatrixLayoutDestroy(p.b);
    if (p.c) cublaslt().MatrixLayoutDestroy(p.c);
    if (p.desc) cublaslt().MatmulDescDestroy(p.desc);
  }
  gemm_plans.clear();
}

Context::Context() : impl_(std::make_unique<Impl>()) {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) fail("[cuda] {}", why);
  Impl& m = *impl_;
  m.device = default_device();
  cudaDeviceProp prop{};
  CUDA_CALL("cuda context", cudaGetDeviceProperties(&prop, m.device));
  // The attention kernels need bf16 tensor cores (sm_80+).  The default build carries sm_90 code and
  // compute_90 PTX; an sm_80 GPU needs a rebuild with -DCMAKE_CUDA_ARCHITECTURES=80 (a kernel
  // launch without a matching image fails with "no kernel image is available").
  if (prop.major < 8)
    fail("[cuda] {} has compute capability {}.{}; the CUDA backend needs 8.0 or newer (bf16 tensor cores)",
         prop.name, prop.major, prop.minor);
  CUDA_CALL("cuda context", cudaSetDevice(m.device));
  CUDA_CALL("cuda context", cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  CUBLAS_CALL("cuda context", cublaslt().Create(&m.lt));
  m.workspace_bytes = kWorkspaceBytes;
  CUDA_CALL("cuda context", cudaMalloc(&m.workspace, m.workspace_bytes));
}

Context::~Context() {
  if (!impl_) return;
  Impl& m = *impl_;
  if (m.stream) cudaStreamSynchronize(m.stream);
  m.clear_gemm_plans();
  if (m.workspace) cudaFree(m.workspace);
  if (m.lt) cublaslt().Destroy(m.lt);
  if (m.stream) cudaStreamDestroy(m.stream);
}

void Context::synchronize(const char* what) {
  const cudaError_t err = cudaStreamSynchronize(impl_->stream);
  if (err != cudaSuccess) fail_cuda(what, "cudaStreamSynchronize", err);
}

bool Context::try_synchronize() noexcept { return cudaStreamSynchronize(impl_->stream) == cudaSuccess; }

DeviceArena::DeviceArena(size_t bytes, const std::string& what) : what_(what) {
  if (bytes == 0) return;
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    fail("[arena {}] cudaMalloc of {:.2f} GiB failed: {} ({:.2f} GiB free of {:.2f} GiB)", what, bytes / 1073741824.0,
         cudaGetErrorString(err), free_b / 1073741824.0, total_b / 1073741824.0);
  }
  base_ = static_cast<char*>(p);
  capacity_ = bytes;
}

DeviceArena::~DeviceArena() {
  if (base_) cudaFree(base_);
}

void* DeviceArena::take(size_t bytes) {
  const size_t r = rounded(bytes);
  if (used_ + r > capacity_)
    fail("[arena {}] out of space: {} bytes requested, {} of {} used", what_, bytes, used_, capacity_);
  void* p = base_ + used_;
  used_ += r;
  return p;
}

void* stream_handle(Context& ctx) { return stream_of(ctx); }

void copy_to_device(Context& ctx, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  CUDA_CALL("copy_to_device", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_of(ctx)));
  // The host buffer may be temporary: wait until the copy has read it.
  CUDA_CALL("copy_to_device", cudaStreamSynchronize(stream_of(ctx)));
}

void copy_to_host(Context& ctx, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  CUDA_CALL("copy_to_host", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(ctx)));
  CUDA_CALL("copy_to_host", cudaStreamSynchronize(stream_of(ctx)));
}

void copy_device(Context& ctx, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  CUDA_CALL("copy_device", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(ctx)));
}

void fill_zero(Context& ctx, void* dst, size_t bytes) {
  if (bytes == 0) return;
  CUDA_CALL("fill_zero", cudaMemsetAsync(dst, 0, bytes, stream_of(ctx)));
}

void upload_bf16(Context& ctx, Bf16* dst, const float* src, size_t n) {
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; i++) h[i] = f32_to_bf16(src[i]);
  copy_to_device(ctx, dst, h.data(), n * sizeof(uint16_t));
}

void download_bf16(Context& ctx, float* dst, const Bf16* src, size_t n) {
  std::vector<uint16_t> h(n);
  copy_to_host(ctx, h.data(), src, n * sizeof(uint16_t));
  for (size_t i = 0; i < n; i++) dst[i] = bf16_to_f32(h[i]);
}

void convert_to_bf16(Context& ctx, Bf16* out, const float* in, size_t n) {
  if (n == 0) return;
  to_bf16_kernel<<<grid_stride_blocks(n), 256, 0, stream_of(ctx)>>>(as_bf(out), in, n);
  CUDA_LAUNCHED("convert_to_bf16");
}

void convert_to_f32(Context& ctx, float* out, const Bf16* in, size_t n) {
  if (n == 0) return;
  to_f32_kernel<<<grid_stride_blocks(n), 256, 0, stream_of(ctx)>>>(out, as_bf(in), n);
  CUDA_LAUNCHED("convert_to_f32");
}

}  // namespace moetron::gpu
