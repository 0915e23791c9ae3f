// The grouped GEMM on Hopper through CUTLASS 3 (see grouped_gemm.h): one kernel per B layout --
// KernelPtrArrayTmaWarpSpecializedCooperative, 128x128x64 tiles, bf16 operands and output, fp32
// accumulation and epilogue (D = alpha * acc + beta * D).  Built for sm_90a only (its own target):
// the wgmma / TMA instructions exist there alone.  The per-group arguments (problem shapes, pointers,
// strides) and the kernel's workspace come from the stream-ordered allocator and are freed in stream
// order: nothing is kept between calls and the host never waits.
#include "cuda/grouped_gemm.h"

#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda/common.cuh"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/default_epilogue.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace moetron::gpu {

namespace {

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using Element = cutlass::bfloat16_t;
constexpr int kAlign = 8;  // elements of 16 bytes: TMA's alignment

// One kernel per layout of B in CUTLASS's (N, K) view: ColumnMajor = B given as [N, K] rows (trans_b),
// RowMajor = B given as [K, N] rows.  Spelled at namespace scope: GCC 12 rejects the epilogue
// builder inside a class template ("type/value mismatch ... CollectiveEpilogue").
using LayoutA = cutlass::layout::RowMajor;
using LayoutD = cutlass::layout::RowMajor;
using TileShape = Shape<_128, _128, _64>;
using ClusterShape = Shape<_1, _1, _1>;
using EpilogueOp = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutD*, kAlign, Element, LayoutD*, kAlign,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
using Stages = cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(EpilogueOp::SharedStorage))>;
using MainloopNK = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element,
    cutlass::layout::ColumnMajor*, kAlign, float, TileShape, ClusterShape, Stages,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
using MainloopKN = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, cutlass::layout::RowMajor*,
    kAlign, float, TileShape, ClusterShape, Stages, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
using GemmNK = cutlass::gemm::device::GemmUniversalAdapter<
    cutlass::gemm::kernel::GemmUniversal<ProblemShape, MainloopNK, EpilogueOp>>;
using GemmKN = cutlass::gemm::device::GemmUniversalAdapter<
    cutlass::gemm::kernel::GemmUniversal<ProblemShape, MainloopKN, EpilogueOp>>;

// A packed stride with its one dynamic (leading-dimension) mode set to ld.
template <class Stride>
Stride with_leading(Stride s, long ld) {
  if constexpr (!cute::is_static<decltype(get<0>(s))>::value)
    get<0>(s) = ld;
  else
    get<1>(s) = ld;
  return s;
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Appends n objects of T to a byte buffer at 16-byte alignment; returns their offset.
template <class T>
size_t append(std::vector<char>& buf, const T* v, size_t n) {
  const size_t at = (buf.size() + 15) / 16 * 16;
  buf.resize(at + n * sizeof(T));
  std::memcpy(buf.data() + at, v, n * sizeof(T));
  return at;
}

template <class Gemm>
bool run(Context& ctx, void* d, const void* a, const void* b, const std::vector<int64_t>& offsets, int groups, int N,
         int K, long lda, long ldd, float alpha, float beta) {
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideC = typename Gemm::GemmKernel::InternalStrideC;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;
  const cudaStream_t stream = stream_of(ctx);
  std::vector<typename ProblemShape::UnderlyingProblemShape> shapes;
  std::vector<const Element*> pa, pb;
  std::vector<Element*> pd;  // C is D (beta scales what D holds): one array serves both
  std::vector<StrideA> sa;
  std::vector<StrideB> sb;
  std::vector<StrideC> sc;
  std::vector<StrideD> sd;
  const Element* A = static_cast<const Element*>(a);
  const Element* B = static_cast<const Element*>(b);
  Element* D = static_cast<Element*>(d);
  for (int g = 0; g < groups; g++) {
    const long off = offsets[g], rows = offsets[g + 1] - off;
    if (rows == 0) continue;
    shapes.push_back({(int)rows, N, K});
    pa.push_back(A + off * lda);
    pb.push_back(B + (long)g * N * K);
    pd.push_back(D + off * ldd);
    sa.push_back(with_leading(cutlass::make_cute_packed_stride(StrideA{}, {(int)rows, K, 1}), lda));
    sb.push_back(cutlass::make_cute_packed_stride(StrideB{}, {N, K, 1}));  // packed: ld = K or N
    sc.push_back(with_leading(cutlass::make_cute_packed_stride(StrideC{}, {(int)rows, N, 1}), ldd));
    sd.push_back(with_leading(cutlass::make_cute_packed_stride(StrideD{}, {(int)rows, N, 1}), ldd));
  }
  const int n = (int)shapes.size();
  if (n == 0) return true;  // nothing to compute
  std::vector<char> host;
  const size_t o_shapes = append(host, shapes.data(), n), o_pa = append(host, pa.data(), n),
               o_pb = append(host, pb.data(), n), o_pd = append(host, pd.data(), n),
               o_sa = append(host, sa.data(), n), o_sb = append(host, sb.data(), n), o_sc = append(host, sc.data(), n),
               o_sd = append(host, sd.data(), n);
  char* dev = nullptr;
  if (cudaMallocAsync(reinterpret_cast<void**>(&dev), host.size(), stream) != cudaSuccess) return false;
  // From pageable memory: returns once the bytes are staged, so `host` may go.
  cudaMemcpyAsync(dev, host.data(), host.size(), cudaMemcpyHostToDevice, stream);
  auto at = [&](size_t o) { return dev + o; };

  int device = 0;
  cudaGetDevice(&device);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = alpha;
  fusion.beta = beta;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  args = typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {n, reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(at(o_shapes)), shapes.data()},
      {reinterpret_cast<const Element**>(at(o_pa)), reinterpret_cast<StrideA*>(at(o_sa)),
       reinterpret_cast<const Element**>(at(o_pb)), reinterpret_cast<StrideB*>(at(o_sb))},
      {fusion, reinterpret_cast<const Element**>(at(o_pd)), reinterpret_cast<StrideC*>(at(o_sc)),
       reinterpret_cast<Element**>(at(o_pd)), reinterpret_cast<StrideD*>(at(o_sd))},
      hw};
  Gemm gemm;
  bool ok = gemm.can_implement(args) == cutlass::Status::kSuccess;
  void* workspace = nullptr;
  const size_t ws = Gemm::get_workspace_size(args);
  if (ok && ws > 0) ok = cudaMallocAsync(&workspace, ws, stream) == cudaSuccess;
  if (ok) ok = gemm.initialize(args, workspace, stream) == cutlass::Status::kSuccess;
  if (ok) {
    const cutlass::Status st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess)
      fail("[cuda grouped GEMM] CUTLASS run failed: {}", cutlassGetStatusString(st));
  }
  if (workspace != nullptr) cudaFreeAsync(workspace, stream);
  cudaFreeAsync(dev, stream);
  return ok;
}

}  // namespace

std::string grouped_gemm_unavailable() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return "no CUDA device";
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major != 9 || minor != 0)
    return "compute capability " + std::to_string(major) + "." + std::to_string(minor) +
           " (the CUTLASS grouped GEMM is built for sm_90a)";
  return "";
}

bool grouped_gemm_bf16(Context& ctx, bool trans_b, void* d, const void* a, const void* b,
                       const std::vector<int64_t>& offsets, int groups, int N, int K, long lda, long ldd, float alpha,
                       float beta) {
  if (!grouped_gemm_unavailable().empty()) return false;
  if (N % kAlign != 0 || K % kAlign != 0 || lda % kAlign != 0 || ldd % kAlign != 0 || !aligned(a) || !aligned(b) ||
      !aligned(d) || (int)offsets.size() <= groups)
    return false;
  return trans_b ? run<GemmNK>(ctx, d, a, b, offsets, groups, N, K, lda, ldd, alpha, beta)
                 : run<GemmKN>(ctx, d, a, b, offsets, groups, N, K, lda, ldd, alpha, beta);
}

}  // namespace moetron::gpu
