// Matrix multiply in the Hugging Face nn.Linear convention: weight is [OC, IC] (row = output).
//   N rows of activations, IC input features, OC output features.
// Parameter gradients accumulate (+=); activation gradients assign (=). A null gradient pointer
// skips that gradient.
#pragma once

namespace moetron::ops {

// out[N,OC] = inp[N,IC] @ weight[OC,IC]^T
void matmul_forward(float* out, const float* inp, const float* weight, int N, int IC, int OC);

// out[N,OC] += inp[N,IC] @ weight[OC,IC]^T   (accumulating variant, e.g. for the residual)
void matmul_forward_accumulate(float* out, const float* inp, const float* weight, int N, int IC,
                               int OC);

// dinp[N,IC] = dout[N,OC] @ weight[OC,IC]     (assign; skipped when dinp is null)
// dweight[OC,IC] += dout[N,OC]^T @ inp[N,IC]  (accumulate; skipped when dweight is null)
void matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC);

// Plain row-major sgemm helper: C[M,N] = alpha * op(A) @ op(B) + beta * C.
void sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
           const float* B, int ldb, float beta, float* C, int ldc);

}  // namespace moetron::ops

namespace moetron::ops {

// Best-of-`reps` GFLOP/s of a square n x n x n fp32 sgemm on all threads (after one untimed call):
// the practical peak of this process's BLAS on this machine, which MFU figures are measured against.
double measure_sgemm_gflops(int n, int reps);

}  // namespace moetron::ops
