// Grouped GEMM: every expert's (group's) product in ONE launch -- CUTLASS 3's pointer-array
// warp-specialized kernel for Hopper (grouped_gemm_sm90.cu, built for sm_90a when the CUTLASS headers
// are present: scripts/fetch-gpu-headers.sh).  The per-expert cuBLASLt loop (gemm.cu) remains the
// path for everything this does not serve: it returns false, having launched nothing, for another
// GPU architecture, an operand or stride not 16-byte aligned, or a build without CUTLASS.
// Row-major terms, group g of G over rows [offsets[g], offsets[g+1]) (empty groups skipped):
//   D[rows_g, N] = alpha * A[rows_g, K] @ op(B_g) + beta * D        (bf16 A, B, D; fp32 accumulation)
// A: rows of `a` with leading dimension lda; B_g = b + g * N * K: trans_b true -> B_g is [N, K]
// (op = transpose: the forward's x @ W^T), false -> [K, N] (the input gradient's dy @ W); D: rows of
// `d` with leading dimension ldd.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moetron::gpu {

class Context;

#ifdef MOETRON_HAVE_CUTLASS
bool grouped_gemm_bf16(Context& ctx, bool trans_b, void* d, const void* a, const void* b,
                       const std::vector<int64_t>& offsets, int groups, int N, int K, long lda, long ldd, float alpha,
                       float beta);
// Why grouped_gemm_bf16 cannot run on the current device at all ("" when it can).
std::string grouped_gemm_unavailable();
#else
inline bool grouped_gemm_bf16(Context&, bool, void*, const void*, const void*, const std::vector<int64_t>&, int, int,
                              int, long, long, float, float) {
  return false;
}
inline std::string grouped_gemm_unavailable() { return "built without the CUTLASS headers"; }
#endif

}  // namespace moetron::gpu
