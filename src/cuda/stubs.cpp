// Built without CUDA: the CUDA backend's entry points exist so everything links, and fail with
// "built without CUDA" when called.  cuda_unavailable_reason() says so without throwing, which is
// how tests decide to skip.  Compiled only when MOETRON_HAVE_CUDA is off (see CMakeLists.txt).
#include "core/error.h"
#include "cuda/ops.h"
#include "cuda/runtime.h"

namespace moetron::gpu {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  fail("[{}] moetron was built without CUDA (reconfigure with -DMOETRON_CUDA=ON on a machine with nvcc)", what);
}
}  // namespace

struct Context::Impl {};

bool cuda_compiled() { return false; }
std::string load_gpu_libraries() { no_cuda("load_gpu_libraries"); }
std::string cuda_unavailable_reason() { return "built without CUDA"; }
int default_device() { return 0; }
DeviceInfo device_info() { no_cuda("device_info"); }
Context::Context() { no_cuda("cuda context"); }
Context::~Context() = default;
void Context::synchronize(const char*) { no_cuda("synchronize"); }
bool Context::try_synchronize() noexcept { return false; }
DeviceArena::DeviceArena(size_t, const std::string& what) : what_(what) { no_cuda("device arena"); }
DeviceArena::~DeviceArena() = default;
void* DeviceArena::take(size_t) { no_cuda("device arena"); }
void* stream_handle(Context&) { return nullptr; }
void copy_to_device(Context&, void*, const void*, size_t) { no_cuda("copy_to_device"); }
void copy_to_host(Context&, void*, const void*, size_t) { no_cuda("copy_to_host"); }
void copy_device(Context&, void*, const void*, size_t) { no_cuda("copy_device"); }
void fill_zero(Context&, void*, size_t) { no_cuda("fill_zero"); }
void upload_bf16(Context&, Bf16*, const float*, size_t) { no_cuda("upload_bf16"); }
void download_bf16(Context&, float*, const Bf16*, size_t) { no_cuda("download_bf16"); }

void convert_to_bf16(Context&, Bf16*, const float*, size_t) { no_cuda("convert_to_bf16"); }
void convert_to_f32(Context&, float*, const Bf16*, size_t) { no_cuda("convert_to_f32"); }
void gemm(Context&, bool, bool, int, int, int, float, const void*, long, const void*, long, float, void*, long, DType,
          DType) {
  no_cuda("gemm");
}
void matmul_forward(Context&, Bf16*, const Bf16*, const Bf16*, int, int, int) { no_cuda("matmul_forward"); }
void matmul_forward_f32(Context&, float*, const Bf16*, const Bf16*, int, int, int, bool) {
  no_cuda("matmul_forward_f32");
}
void matmul_backward(Context&, Bf16*, float*, const Bf16*, const Bf16*, const Bf16*, int, int, int) {
  no_cuda("matmul_backward");
}
void embedding_forward(Context&, float*, const int32_t*, const float*, long, int, int64_t, int64_t) {
  no_cuda("embedding_forward");
}
void embedding_backward(Context&, float*, const float*, const int32_t*, long, int, int64_t, int64_t) {
  no_cuda("embedding_backward");
}
void rmsnorm_forward(Context&, void*, DType, float*, const float*, const float*, long, int, float) {
  no_cuda("rmsnorm_forward");
}
void rmsnorm_backward(Context&, float*, float*, const float*, const float*, const float*, const float*, long, int,
                      bool) {
  no_cuda("rmsnorm_backward");
}
void rope_forward(Context&, Bf16*, const Bf16*, long, const int32_t*, long, int, int, const ops::RopeSpec&) {
  no_cuda("rope_forward");
}
void rope_backward(Context&, Bf16*, const Bf16*, long, const int32_t*, long, int, int, const ops::RopeSpec&) {
  no_cuda("rope_backward");
}
void attention_forward(Context&, Bf16*, float*, const Bf16*, const Bf16*, const Bf16*, const AttentionMask&, int, int,
                       int, int, int, long, long) {
  no_cuda("attention_forward");
}
void attention_kv_forward(Context&, Bf16*, const Bf16*, const Bf16*, const Bf16*, int, int, int, int, int, int) {
  no_cuda("attention_kv_forward");
}
size_t attention_backward_scratch_floats(int B, int T, int NH, int HD) {
  return (size_t)B * T * NH * HD + (size_t)B * NH * T;
}
void attention_backward(Context&, Bf16*, Bf16*, Bf16*, float*, const Bf16*, const Bf16*, const float*, const Bf16*,
                        const Bf16*, const Bf16*, const AttentionMask&, int, int, int, int, int, long, long) {
  no_cuda("attention_backward");
}
void swiglu_forward(Context&, Bf16*, const Bf16*, long, int) { no_cuda("swiglu_forward"); }
void swiglu_backward(Context&, Bf16*, const Bf16*, const Bf16*, long, int) { no_cuda("swiglu_backward"); }
void router_forward(Context&, float*, int32_t*, float*, const float*, const float*, long, int, int,
                    const ops::RouterSpec&) {
  no_cuda("router_forward");
}
void copy_block(Context&, void*, bool, const void*, bool, const ops::BlockCopy&, float, bool) {
  no_cuda("copy_block");
}
void router_layer_stats(Context&, double*, const float*, const float*, const int32_t*, const uint8_t*, long, int, int) {
  no_cuda("router_layer_stats");
}
void router_backward(Context&, float*, const float*, const double*, const uint8_t*, const float*, const int32_t*,
                     const float*, long, int, int, const ops::RouterSpec&) {
  no_cuda("router_backward");
}
void router_sequence_backward(Context&, float*, const float*, const uint8_t*, const float*, long, int, int, bool,
                              float) {
  no_cuda("router_sequence_backward");
}
void router_z_loss_backward(Context&, float*, const float*, const float*, const uint8_t*, long, int, float, long) {
  no_cuda("router_z_loss_backward");
}
void moe_plan_build(Context&, MoePlanDevice&, int32_t*, int32_t*, int64_t*, const int32_t*, long, int, int) {
  no_cuda("moe_plan_build");
}
void moe_permute_forward(Context&, Bf16*, const Bf16*, const MoePlanDevice&, int) { no_cuda("moe_permute_forward"); }
void moe_permute_backward(Context&, float*, const Bf16*, const MoePlanDevice&, int, bool) {
  no_cuda("moe_permute_backward");
}
void moe_combine_forward(Context&, float*, const Bf16*, const float*, const MoePlanDevice&, int) {
  no_cuda("moe_combine_forward");
}
void moe_combine_backward(Context&, Bf16*, float*, const float*, const Bf16*, const float*, const MoePlanDevice&, int) {
  no_cuda("moe_combine_backward");
}
void moe_experts_forward(Context&, void*, DType, Bf16*, Bf16*, const Bf16*, const Bf16*, const Bf16*,
                         const MoePlanDevice&, int, int) {
  no_cuda("moe_experts_forward");
}
void moe_experts_backward(Context&, void*, DType, float*, float*, Bf16*, const Bf16*, const Bf16*, const Bf16*,
                          const Bf16*, const Bf16*, const Bf16*, const MoePlanDevice&, int, int) {
  no_cuda("moe_experts_backward");
}
double cross_entropy_forward(Context&, float*, float*, const float*, const int32_t*, long, int, float) {
  no_cuda("cross_entropy_forward");
}
void cross_entropy_backward(Context&, Bf16*, long, const float*, const float*, const int32_t*, long, int, int64_t,
                            float) {
  no_cuda("cross_entropy_backward");
}
void cross_entropy_row_max(Context&, float*, const float*, long, int) { no_cuda("cross_entropy_row_max"); }
void cross_entropy_row_sums(Context&, double*, const float*, const float*, const int32_t*, long, int, int64_t) {
  no_cuda("cross_entropy_row_sums");
}
double cross_entropy_finish(Context&, float*, float*, const float*, const double*, const int32_t*, long, float) {
  no_cuda("cross_entropy_finish");
}
void add_f32(Context&, float*, const float*, size_t) { no_cuda("add_f32"); }
void add_bias_rows(Context&, float*, const float*, long, int) { no_cuda("add_bias_rows"); }
void bias_backward(Context&, float*, const float*, long, int) { no_cuda("bias_backward"); }
void sigmoid_forward(Context&, float*, const float*, long) { no_cuda("sigmoid_forward"); }
void sigmoid_backward(Context&, float*, const float*, const float*, long) { no_cuda("sigmoid_backward"); }
void clamp_forward(Context&, void*, DType, uint8_t*, float, long) { no_cuda("clamp_forward"); }
void row_dot(Context&, float*, const float*, const float*, const float*, long, int) { no_cuda("row_dot"); }
void rmsnorm_forward_stats(Context&, void*, DType, float*, const float*, const float*, const float*, long, int, int,
                           float, float) {
  no_cuda("rmsnorm_forward_stats");
}
void rmsnorm_backward_stats(Context&, float*, float*, const float*, const float*, const float*, const float*,
                            const float*, long, int, int, float) {
  no_cuda("rmsnorm_backward_stats");
}
void clamp_backward(Context&, void*, DType, const uint8_t*, long) { no_cuda("clamp_backward"); }
void gather_rows(Context&, void*, const void*, const int32_t*, long, size_t) { no_cuda("gather_rows"); }
void sum_squares_segments(Context&, double*, const float*, const int64_t*, const int64_t*, size_t) {
  no_cuda("sum_squares_segments");
}
void adamw_update(Context&, float*, Bf16*, float*, float*, const float*, size_t, float, double, double, double, double,
                  double, long) {
  no_cuda("adamw_update");
}
size_t grad_norm_scratch_doubles(size_t n) { return (n + (1 << 16) - 1) / (1 << 16) + 1; }
double global_grad_norm(Context&, double*, const float*, size_t) { no_cuda("global_grad_norm"); }
void init_normal(Context&, float*, size_t, uint64_t, uint64_t, double, float) { no_cuda("init_normal"); }

void grouped_matmul_forward(Context&, void*, DType, const void*, const void*, DType, const std::vector<int64_t>&, int, int,
                            int, float, bool, int, int) {
  no_cuda("grouped_matmul_forward");
}
void grouped_matmul_backward(Context&, void*, DType, float*, const void*, const void*, const void*, DType,
                             const std::vector<int64_t>&, int, int, int, float, bool, int, int) {
  no_cuda("grouped_matmul_backward");
}

}  // namespace moetron::gpu
