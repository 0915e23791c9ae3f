// GEMMs through cuBLASLt: row-major C = alpha op(A) op(B) + beta C with fp32 accumulation, and the
// nn.Linear forward / backward built on it.
//
// cuBLASLt is column-major.  A row-major matrix X [r, c] with row stride ld is the column-major
// matrix X^T [c, r] with the same ld, so the row-major product C = op(A) op(B) is computed as the
// column-major product C^T = op(B)^T op(A)^T: cuBLASLt's first operand is B (transposed when B
// is), its second is A, and m = N, n = M.
//
// Each distinct shape (with its operand types, pointer alignment and whether beta is 0) gets its
// descriptors and heuristic-chosen algorithm once and keeps them in the Context.
#include <algorithm>

#include "cuda/grouped_gemm.h"
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

// Largest power of two (<= 256) dividing the address and the row stride in bytes: what the
// heuristic may assume about every row of the operand.
int alignment_of(const void* p, long ld, size_t elem) {
  const uint64_t a = reinterpret_cast<uint64_t>(p) | (uint64_t)(ld * (long)elem) | 256u;
  return (int)(a & (~a + 1));
}

// (Local rather than core/dtype.cpp's: moetron_cuda must not depend on moetron_lib, which links it.)
cudaDataType_t cuda_type(DType t, const char* op) {
  if (t == DType::BF16) return CUDA_R_16BF;
  if (t == DType::F32) return CUDA_R_32F;
  fail("[{}] operand dtype #{} is not supported (BF16 or F32)", op, (int)t);
}
size_t elem_size(DType t) { return t == DType::BF16 ? 2 : 4; }
const char* type_name(DType t) { return t == DType::BF16 ? "BF16" : "F32"; }

// Caps the number of cached shapes (expert GEMMs change shape every step).
constexpr size_t kMaxPlans = 4096;

}  // namespace

void gemm(Context& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A, long lda,
          const void* B, long ldb, float beta, void* C, long ldc, DType ab, DType c) {
  const char* op = "gemm";
  MOETRON_OP_CHECK(M >= 0 && N >= 0 && K >= 0, op, "negative dimension M={} N={} K={}", M, N, K);
  if (M == 0 || N == 0) return;
  MOETRON_OP_CHECK(K > 0, op, "K must be positive when M={} and N={} are", M, N);
  const cudaDataType_t tab = cuda_type(ab, op), tc = cuda_type(c, op);
  // Column-major view (see the top of the file).
  const int m = N, n = M;
  const cublasOperation_t opa = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // applied to B
  const cublasOperation_t opb = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // applied to A
  const uint64_t a_rows = opa == CUBLAS_OP_N ? m : K, a_cols = opa == CUBLAS_OP_N ? K : m;
  const uint64_t b_rows = opb == CUBLAS_OP_N ? K : n, b_cols = opb == CUBLAS_OP_N ? n : K;
  MOETRON_OP_CHECK(ldb >= (long)a_rows && lda >= (long)b_rows && ldc >= (long)m, op,
                   "row strides too small: M={} N={} K={} trans_a={} trans_b={} lda={} ldb={} ldc={}", M, N, K,
                   trans_a, trans_b, lda, ldb, ldc);

  const int align = std::min({alignment_of(A, lda, elem_size(ab)), alignment_of(B, ldb, elem_size(ab)),
                              alignment_of(C, ldc, elem_size(c))});
  const GemmKey key{(int)trans_a, (int)trans_b, M, N, K, lda, ldb, ldc, (int)ab, (int)c, align, beta != 0.0f};
  Context::Impl& cx = ctx.impl();
  auto it = cx.gemm_plans.find(key);
  if (it == cx.gemm_plans.end()) {
    if (cx.gemm_plans.size() >= kMaxPlans) cx.clear_gemm_plans();
    GemmPlan p;
    CUBLAS_CALL(op, cublaslt().MatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CALL(op, cublaslt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
    CUBLAS_CALL(op, cublaslt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    CUBLAS_CALL(op, cublaslt().MatrixLayoutCreate(&p.a, tab, a_rows, a_cols, ldb));
    CUBLAS_CALL(op, cublaslt().MatrixLayoutCreate(&p.b, tab, b_rows, b_cols, lda));
    CUBLAS_CALL(op, cublaslt().MatrixLayoutCreate(&p.c, tc, (uint64_t)m, (uint64_t)n, ldc));
    cublasLtMatmulPreference_t pref = nullptr;
    CUBLAS_CALL(op, cublaslt().MatmulPreferenceCreate(&pref));
    const uint32_t al = (uint32_t)align;
    cublasStatus_t st = cublaslt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                             &cx.workspace_bytes, sizeof(cx.workspace_bytes));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      if (st == CUBLAS_STATUS_SUCCESS) st = cublaslt().MatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublaslt().MatmulAlgoGetHeuristic(cx.lt, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
    cublaslt().MatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
      cublaslt().MatrixLayoutDestroy(p.a);
      cublaslt().MatrixLayoutDestroy(p.b);
      cublaslt().MatrixLayoutDestroy(p.c);
      cublaslt().MatmulDescDestroy(p.desc);
      if (st != CUBLAS_STATUS_SUCCESS) fail_cublas(op, "cublasLtMatmulAlgoGetHeuristic", st);
      fail("[{}] cuBLASLt has no algorithm for M={} N={} K={} trans_a={} trans_b={} lda={} ldb={} ldc={} {}x{}->{} "
           "(alignment {} bytes)",
           op, M, N, K, trans_a, trans_b, lda, ldb, ldc, type_name(ab), type_name(ab), type_name(c), align);
    }
    p.algo = result.algo;
    it = cx.gemm_plans.emplace(key, p).first;
  }
  const GemmPlan& p = it->second;
  // First cuBLASLt operand is B, second is A (column-major view).
  CUBLAS_CALL(op, cublaslt().Matmul(cx.lt, p.desc, &alpha, B, p.a, A, p.b, &beta, C, p.c, C, p.c, &p.algo,
                                 cx.workspace, cx.workspace_bytes, cx.stream));
}

void matmul_forward(Context& ctx, Bf16* out, const Bf16* inp, const Bf16* weight, int N, int IC, int OC) {
  gemm(ctx, false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, 0.0f, out, OC, DType::BF16, DType::BF16);
}

void matmul_forward_f32(Context& ctx, float* out, const Bf16* inp, const Bf16* weight, int N, int IC, int OC,
                        bool accumulate) {
  gemm(ctx, false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, accumulate ? 1.0f : 0.0f, out, OC, DType::BF16,
       DType::F32);
}

void matmul_backward(Context& ctx, Bf16* dinp, float* dweight, const Bf16* dout, const Bf16* inp,
                     const Bf16* weight, int N, int IC, int OC) {
  // dinp[N,IC] = dout[N,OC] @ weight[OC,IC]
  if (dinp) gemm(ctx, false, false, N, IC, OC, 1.0f, dout, OC, weight, IC, 0.0f, dinp, IC, DType::BF16, DType::BF16);
  // dweight[OC,IC] += dout^T[OC,N] @ inp[N,IC]
  if (dweight && N > 0)
    gemm(ctx, true, false, OC, IC, N, 1.0f, dout, OC, inp, IC, 1.0f, dweight, IC, DType::BF16, DType::F32);
}

// The grouped linear (ops/grouped_matmul.h): one GEMM per expert over its rows, alpha in the GEMM.
void grouped_matmul_forward(Context& ctx, void* out, DType out_dtype, const void* inp, const void* weight, DType ab,
                            const std::vector<int64_t>& offsets, int E, int IC, int OC, float alpha, bool accumulate,
                            int ld_in, int ld_out) {
  MOETRON_OP_CHECK(out_dtype == DType::BF16 || out_dtype == DType::F32, "grouped_matmul_forward",
                   "output dtype must be BF16 or F32 (got {})", (int)out_dtype);
  MOETRON_OP_CHECK(ab == DType::BF16 || ab == DType::F32, "grouped_matmul_forward", "operand dtype must be BF16 or F32");
  MOETRON_OP_CHECK((int)offsets.size() > E && IC > 0 && OC > 0, "grouped_matmul_forward",
                   "bad plan or dimensions (E={}, IC={}, OC={})", E, IC, OC);
  if (ld_in == 0) ld_in = IC;
  if (ld_out == 0) ld_out = OC;
  const size_t os = out_dtype == DType::BF16 ? 2 : 4, as = ab == DType::BF16 ? 2 : 4;
  const long W = (long)OC * IC;
  // Every expert in one launch where the grouped GEMM serves the call (grouped_gemm.h).
  if (out_dtype == DType::BF16 && ab == DType::BF16 &&
      grouped_gemm_bf16(ctx, true, out, inp, weight, offsets, E, OC, IC, ld_in, ld_out, alpha, accumulate ? 1.0f : 0.0f))
    return;
  for (int e = 0; e < E; e++) {
    const long off = offsets[e], rows = offsets[e + 1] - off;
    if (rows == 0) continue;
    gemm(ctx, false, true, (int)rows, OC, IC, alpha, static_cast<const char*>(inp) + off * ld_in * as, ld_in,
         static_cast<const char*>(weight) + e * W * as, IC, accumulate ? 1.0f : 0.0f,
         static_cast<char*>(out) + off * ld_out * os, ld_out, ab, out_dtype);
  }
}

void grouped_matmul_backward(Context& ctx, void* dinp, DType dinp_dtype, float* dweight, const void* dout,
                             const void* inp, const void* weight, DType ab, const std::vector<int64_t>& offsets, int E,
                             int IC, int OC, float alpha, bool accumulate, int ld_in, int ld_out) {
  MOETRON_OP_CHECK((int)offsets.size() > E && IC > 0 && OC > 0, "grouped_matmul_backward",
                   "bad plan or dimensions (E={}, IC={}, OC={})", E, IC, OC);
  MOETRON_OP_CHECK(dinp_dtype == DType::BF16 || dinp_dtype == DType::F32, "grouped_matmul_backward",
                   "input-gradient dtype must be BF16 or F32 (got {})", (int)dinp_dtype);
  MOETRON_OP_CHECK(ab == DType::BF16 || ab == DType::F32, "grouped_matmul_backward", "operand dtype must be BF16 or F32");
  if (ld_in == 0) ld_in = IC;
  if (ld_out == 0) ld_out = OC;
  const size_t is = dinp_dtype == DType::BF16 ? 2 : 4, as = ab == DType::BF16 ? 2 : 4;
  const long W = (long)OC * IC;
  const char* DOUT = static_cast<const char*>(dout);
  // d inp of every expert in one launch where the grouped GEMM serves it (grouped_gemm.h); the
  // weight gradients stay one GEMM per expert (each is a whole [OC, IC] product).
  const bool grouped = dinp != nullptr && dinp_dtype == DType::BF16 && ab == DType::BF16 &&
                       grouped_gemm_bf16(ctx, false, dinp, dout, weight, offsets, E, IC, OC, ld_out, ld_in, alpha,
                                         accumulate ? 1.0f : 0.0f);
  for (int e = 0; e < E; e++) {
    const long off = offsets[e], rows = offsets[e + 1] - off;
    if (rows == 0) continue;
    if (dweight)
      gemm(ctx, true, false, OC, IC, (int)rows, alpha, DOUT + off * ld_out * as, ld_out,
           static_cast<const char*>(inp) + off * ld_in * as, ld_in, 1.0f, dweight + e * W, IC, ab, DType::F32);
    if (dinp && !grouped)
      gemm(ctx, false, false, (int)rows, IC, OC, alpha, DOUT + off * ld_out * as, ld_out,
           static_cast<const char*>(weight) + e * W * as, IC, accumulate ? 1.0f : 0.0f,
           static_cast<char*>(dinp) + off * ld_in * is, ld_in, ab, dinp_dtype);
  }
}

}  // namespace moetron::gpu
