// Flash-attention style causal GQA attention on the device (forward and backward); see ops.h.
//   B batch, T sequence, NH query heads, NKV kv heads, G = NH/NKV, HD head dim (<= 128), HDP = HD
//   rounded up to 16 (the tiles are zero-padded to it).
//
// Forward (one block per (query tile of BR rows, head, batch row); 4 warps, warp w owns tile rows
// [16w, 16w+16)): for every key tile of BC keys that can be visible, S = Q K^T on tensor cores
// (WMMA bf16 -> fp32), then an online softmax in fp32 in the log2 domain (running max m and sum l
// per row; the output accumulator O in shared memory is rescaled by 2^(m_old - m_new)), then
// O += P V with P rounded to bf16.  At the end out = O / l and lse = m + log2(l) are written.
// The T x T scores never leave shared memory.
//
// Backward (FlashAttention-2): one block per (key tile, kv head, batch row) accumulates dK and dV
// for its keys in shared memory over the G query heads of its group and every query tile that can
// see it, recomputing P = 2^(S*scale*log2e - lse) from Q, K and the saved lse; dS = P * (dP - D)
// with dP = dO V^T and D = rowsum(dO * O); dV += P^T dO, dK += dS^T Q (times the softmax scale),
// and dQ += dS K goes to an fp32 buffer through atomics (then rounded to bf16).
//
// Visibility (as ops::attention): key j is visible from query i when j <= i, i - j < window (when
// window > 0), attention_mask[b,j] != 0 (when given) and segment_ids[b,j] == segment_ids[b,i]
// (when given).  A query with no visible key outputs zeros and has lse 0.
// Activation gradients assign (=).
#include <mma.h>

#include <cmath>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

using namespace nvcuda;

constexpr int BR = 64;  // query rows per tile
constexpr int BC = 64;  // keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxHD = 128;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

struct Params {
  const bf16 *q, *k, *v, *out, *dout;
  bf16* o;  // forward output
  float* lse;
  float* dq_acc;  // backward: fp32 [B,T,NH,HD]
  const float* dvec;  // backward: D [B,NH,T]
  bf16 *dk, *dv;
  const int32_t *amask, *seg;
  int window;
  int B, T, NH, NKV, HD, HDP;
  long q_stride, kv_stride;
  float scale, scale_log2;
  bool vec;  // 16-byte global loads are aligned
};

// rows x HDP bf16 tile in shared memory <- `rows` rows of HD values starting at row0 of `base`
// (row stride `stride`), zero beyond HD and beyond row T.
__device__ void load_tile(bf16* dst, const bf16* base, long stride, int row0, int rows, int T, int HD, int HDP,
                          bool vec) {
  if (vec) {
    const int cpr = HDP / 8;
    for (int idx = threadIdx.x; idx < rows * cpr; idx += blockDim.x) {
      const int r = idx / cpr, c8 = (idx - r * cpr) * 8;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (row0 + r < T && c8 < HD) val = *reinterpret_cast<const uint4*>(base + (long)(row0 + r) * stride + c8);
      *reinterpret_cast<uint4*>(dst + r * HDP + c8) = val;
    }
  } else {
    for (int idx = threadIdx.x; idx < rows * HDP; idx += blockDim.x) {
      const int r = idx / HDP, c = idx - r * HDP;
      dst[idx] = (row0 + r < T && c < HD) ? base[(long)(row0 + r) * stride + c] : __float2bfloat16_rn(0.0f);
    }
  }
}

// Key metadata of a tile: ok = inside T and not padding, and the segment id.
__device__ __forceinline__ void load_key_info(int* ok, int* kseg, const Params& p, int b, int k0) {
  for (int j = threadIdx.x; j < BC; j += blockDim.x) {
    const int jj = k0 + j;
    const bool in = jj < p.T;
    ok[j] = in && (p.amask == nullptr || p.amask[(long)b * p.T + jj] != 0);
    kseg[j] = (p.seg != nullptr && in) ? p.seg[(long)b * p.T + jj] : 0;
  }
}

__device__ __forceinline__ bool visible(const Params& p, int i, int j, bool row_valid, int key_ok, int qseg,
                                        int kseg) {
  return row_valid && key_ok && j <= i && (p.window <= 0 || i - j < p.window) && (p.seg == nullptr || kseg == qseg);
}

// S[16 x BC] (fp32, row stride BC) = A[16 x HDP] @ Bm[BC x HDP]^T, for one warp.
__device__ void warp_qkT(float* S, const bf16* A, const bf16* Bm, int HDP) {
  for (int nf = 0; nf < BC / 16; nf++) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < HDP / 16; kk++) {
      FragA a;
      FragBT bt;
      wmma::load_matrix_sync(a, A + kk * 16, HDP);
      wmma::load_matrix_sync(bt, Bm + nf * 16 * HDP + kk * 16, HDP);
      wmma::mma_sync(acc, a, bt, acc);
    }
    wmma::store_matrix_sync(S + nf * 16, acc, BC, wmma::mem_row_major);
  }
}

size_t fwd_smem_bytes(int HDP) {
  return (size_t)(BR + 2 * BC) * HDP * 2 + (size_t)BR * BC * 4 + (size_t)BR * BC * 2 + (size_t)BR * HDP * 4 +
         2 * BC * 4;
}

__global__ void __launch_bounds__(kThreads) flash_forward_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int HDP = p.HDP, HD = p.HD, T = p.T;
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // [BR][HDP]
  bf16* sK = sQ + BR * HDP;                  // [BC][HDP]
  bf16* sV = sK + BC * HDP;                  // [BC][HDP]
  float* sS = reinterpret_cast<float*>(sV + BC * HDP);  // [BR][BC]
  bf16* sP = reinterpret_cast<bf16*>(sS + BR * BC);      // [BR][BC]
  float* sO = reinterpret_cast<float*>(sP + BR * BC);    // [BR][HDP]
  int* sOk = reinterpret_cast<int*>(sO + BR * HDP);      // [BC]
  int* sSeg = sOk + BC;                                  // [BC]

  const int num_q_tiles = (T + BR - 1) / BR;
  const int qt = num_q_tiles - 1 - (int)blockIdx.x;  // the longest rows first
  const int h = blockIdx.y, b = blockIdx.z, g = h / (p.NH / p.NKV);
  const int q0 = qt * BR;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  const bf16* qb = p.q + (long)b * T * p.q_stride + (long)h * HD;
  const bf16* kb = p.k + (long)b * T * p.kv_stride + (long)g * HD;
  const bf16* vb = p.v + (long)b * T * p.kv_stride + (long)g * HD;
  load_tile(sQ, qb, p.q_stride, q0, BR, T, HD, HDP, p.vec);
  for (int idx = threadIdx.x; idx < BR * HDP; idx += blockDim.x) sO[idx] = 0.0f;

  // Each lane pair owns one row: lane/2 picks the row within the warp's strip, lane&1 the half.
  const int r = warp * 16 + (lane >> 1), half = lane & 1;
  const int i = q0 + r;
  const bool row_valid = i < T;
  const int qseg = (p.seg != nullptr && row_valid) ? p.seg[(long)b * T + i] : 0;
  float m_run = -INFINITY, l_run = 0.0f;

  const int q_last = min(q0 + BR, T) - 1;
  const int k_first = p.window > 0 ? max(0, q0 - p.window + 1) : 0;
  for (int kt = k_first / BC; kt <= q_last / BC; kt++) {
    const int k0 = kt * BC;
    __syncthreads();  // sQ/sO are ready; the previous tile's sK/sV/sOk are no longer read
    load_tile(sK, kb, p.kv_stride, k0, BC, T, HD, HDP, p.vec);
    load_tile(sV, vb, p.kv_stride, k0, BC, T, HD, HDP, p.vec);
    load_key_info(sOk, sSeg, p, b, k0);
    __syncthreads();

    warp_qkT(sS + warp * 16 * BC, sQ + warp * 16 * HDP, sK, HDP);
    __syncwarp();

    // Online softmax over this lane's 32 columns of its row.
    const float* srow = sS + r * BC + half * 32;
    bf16* prow = sP + r * BC + half * 32;
    float sv[32];
    float tmax = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; c++) {
      const int jl = half * 32 + c;
      const bool vis = visible(p, i, k0 + jl, row_valid, sOk[jl], qseg, sSeg[jl]);
      sv[c] = vis ? srow[c] * p.scale_log2 : -INFINITY;
      tmax = fmaxf(tmax, sv[c]);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    const float m_new = fmaxf(m_run, tmax);
    float alpha = 1.0f, psum = 0.0f;
    if (m_new == -INFINITY) {
#pragma unroll
      for (int c = 0; c < 32; c++) prow[c] = __float2bfloat16_rn(0.0f);
    } else {
      alpha = exp2f(m_run - m_new);  // 0 when m_run is -inf
#pragma unroll
      for (int c = 0; c < 32; c++) {
        const float pe = exp2f(sv[c] - m_new);  // 0 for masked entries
        psum += pe;
        prow[c] = __float2bfloat16_rn(pe);
      }
    }
    psum += __shfl_xor_sync(0xffffffffu, psum, 1);
    l_run = l_run * alpha + psum;
    m_run = m_new;
    if (alpha != 1.0f) {
      float* orow = sO + r * HDP;
      for (int d = half * (HDP / 2); d < (half + 1) * (HDP / 2); d++) orow[d] *= alpha;
    }
    __syncwarp();

    // O[16 x HDP] += P[16 x BC] @ V[BC x HDP] for this warp's rows.
    for (int nf = 0; nf < HDP / 16; nf++) {
      FragC acc;
      float* o_tile = sO + warp * 16 * HDP + nf * 16;
      wmma::load_matrix_sync(acc, o_tile, HDP, wmma::mem_row_major);
      for (int kk = 0; kk < BC / 16; kk++) {
        FragA a;
        FragB bm;
        wmma::load_matrix_sync(a, sP + warp * 16 * BC + kk * 16, BC);
        wmma::load_matrix_sync(bm, sV + kk * 16 * HDP + nf * 16, HDP);
        wmma::mma_sync(acc, a, bm, acc);
      }
      wmma::store_matrix_sync(o_tile, acc, HDP, wmma::mem_row_major);
    }
    __syncwarp();
  }
  __syncwarp();
  if (row_valid) {
    const float inv = l_run > 0.0f ? 1.0f / l_run : 0.0f;
    bf16* og = p.o + (((long)b * T + i) * p.NH + h) * HD;
    const float* orow = sO + r * HDP;
    for (int d = half; d < HD; d += 2) og[d] = __float2bfloat16_rn(orow[d] * inv);
    if (half == 0) p.lse[((long)b * p.NH + h) * T + i] = l_run > 0.0f ? m_run + log2f(l_run) : 0.0f;
  }
}

// D[b,h,i] = sum_d dout * out (fp32), one warp per (token, head).
__global__ void attention_dvec_kernel(float* dvec, const bf16* dout, const bf16* out, int B, int T, int NH, int HD) {
  const long wid = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (wid >= (long)B * T * NH) return;
  const long n = wid / NH;
  const int h = (int)(wid - n * NH);
  const bf16* a = dout + wid * HD;
  const bf16* c = out + wid * HD;
  float s = 0.0f;
  for (int d = lane; d < HD; d += 32) s += __bfloat162float(a[d]) * __bfloat162float(c[d]);
  s = warp_sum(s);
  if (lane == 0) {
    const long b = n / T, t = n - b * T;
    dvec[(b * NH + h) * T + t] = s;
  }
}

__host__ __device__ size_t bwd_region_bytes(int HDP) {
  const size_t a = (size_t)2 * BR * BC * 4, c = (size_t)BR * HDP * 4;
  return a > c ? a : c;
}

size_t bwd_smem_bytes(int HDP) {
  return (size_t)2 * BC * HDP * 4 + bwd_region_bytes(HDP) + (size_t)(2 * BC + 2 * BR) * HDP * 2 +
         (size_t)2 * BR * BC * 2 + (size_t)(3 * BR + 2 * BC) * 4;
}

__global__ void __launch_bounds__(kThreads) flash_backward_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int HDP = p.HDP, HD = p.HD, T = p.T, NH = p.NH;
  float* sdK = reinterpret_cast<float*>(smem);  // [BC][HDP]
  float* sdV = sdK + BC * HDP;                  // [BC][HDP]
  float* region = sdV + BC * HDP;
  float* sS = region;                           // [BR][BC]  (P in fp32 after the exp)
  float* sdP = region + BR * BC;                // [BR][BC]
  float* sdQ = region;                          // [BR][HDP] (aliases sS/sdP once they are dead)
  bf16* sK = reinterpret_cast<bf16*>(reinterpret_cast<unsigned char*>(region) + bwd_region_bytes(HDP));
  bf16* sV = sK + BC * HDP;
  bf16* sQ = sV + BC * HDP;
  bf16* sdO = sQ + BR * HDP;
  bf16* sP = sdO + BR * HDP;   // [BR][BC]
  bf16* sdS = sP + BR * BC;    // [BR][BC]
  float* sLse = reinterpret_cast<float*>(sdS + BR * BC);
  float* sD = sLse + BR;
  int* sQseg = reinterpret_cast<int*>(sD + BR);
  int* sOk = sQseg + BR;
  int* sSeg = sOk + BC;

  const int kt = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int G = NH / p.NKV;
  const int k0 = kt * BC;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  const bf16* kb = p.k + (long)b * T * p.kv_stride + (long)g * HD;
  const bf16* vb = p.v + (long)b * T * p.kv_stride + (long)g * HD;
  load_tile(sK, kb, p.kv_stride, k0, BC, T, HD, HDP, p.vec);
  load_tile(sV, vb, p.kv_stride, k0, BC, T, HD, HDP, p.vec);
  load_key_info(sOk, sSeg, p, b, k0);
  for (int idx = threadIdx.x; idx < BC * HDP; idx += blockDim.x) {
    sdK[idx] = 0.0f;
    sdV[idx] = 0.0f;
  }

  // Queries that can see a key of this tile: i >= k0, and i <= k_last + window - 1 with a window.
  const int k_last = min(k0 + BC, T) - 1;
  const int q_last = p.window > 0 ? min(T - 1, k_last + p.window - 1) : T - 1;
  const int r = warp * 16 + (lane >> 1), half = lane & 1;

  for (int hh = 0; hh < G; hh++) {
    const int h = g * G + hh;
    const bf16* qb = p.q + (long)b * T * p.q_stride + (long)h * HD;
    const bf16* ob = p.dout + (long)b * T * NH * HD + (long)h * HD;
    for (int qt = k0 / BR; qt <= q_last / BR; qt++) {
      const int q0 = qt * BR;
      __syncthreads();  // the previous iteration is done with sQ, sdO, sP, sdS and sdQ
      load_tile(sQ, qb, p.q_stride, q0, BR, T, HD, HDP, p.vec);
      load_tile(sdO, ob, (long)NH * HD, q0, BR, T, HD, HDP, p.vec);
      for (int rr = threadIdx.x; rr < BR; rr += blockDim.x) {
        const int ii = q0 + rr;
        const bool in = ii < T;
        sLse[rr] = in ? p.lse[((long)b * NH + h) * T + ii] : 0.0f;
        sD[rr] = in ? p.dvec[((long)b * NH + h) * T + ii] : 0.0f;
        sQseg[rr] = (p.seg != nullptr && in) ? p.seg[(long)b * T + ii] : 0;
      }
      __syncthreads();

      warp_qkT(sS + warp * 16 * BC, sQ + warp * 16 * HDP, sK, HDP);    // S = Q K^T
      warp_qkT(sdP + warp * 16 * BC, sdO + warp * 16 * HDP, sV, HDP);  // dP = dO V^T
      __syncwarp();

      {
        const int i = q0 + r;
        const bool row_valid = i < T;
        const float lse = sLse[r], D = sD[r];
        const int qseg = sQseg[r];
#pragma unroll 4
        for (int c = 0; c < 32; c++) {
          const int jl = half * 32 + c;
          const bool vis = visible(p, i, k0 + jl, row_valid, sOk[jl], qseg, sSeg[jl]);
          const float pe = vis ? exp2f(sS[r * BC + jl] * p.scale_log2 - lse) : 0.0f;
          const float ds = pe * (sdP[r * BC + jl] - D);
          sP[r * BC + jl] = __float2bfloat16_rn(pe);
          sdS[r * BC + jl] = __float2bfloat16_rn(ds);
        }
      }
      __syncthreads();  // sP/sdS complete; sS/sdP are dead (the region becomes sdQ)

      // dV[16 x HDP] += P^T dO and dK += dS^T Q for this warp's 16 keys.
      for (int nf = 0; nf < HDP / 16; nf++) {
        FragC acc_v, acc_k;
        float* dv_tile = sdV + warp * 16 * HDP + nf * 16;
        float* dk_tile = sdK + warp * 16 * HDP + nf * 16;
        wmma::load_matrix_sync(acc_v, dv_tile, HDP, wmma::mem_row_major);
        wmma::load_matrix_sync(acc_k, dk_tile, HDP, wmma::mem_row_major);
        for (int kk = 0; kk < BR / 16; kk++) {
          FragAT at;
          FragB bm;
          // (P^T)[key m][query k] = P[kk*16 + k][warp*16 + m]: column-major with ld BC.
          wmma::load_matrix_sync(at, sP + kk * 16 * BC + warp * 16, BC);
          wmma::load_matrix_sync(bm, sdO + kk * 16 * HDP + nf * 16, HDP);
          wmma::mma_sync(acc_v, at, bm, acc_v);
          wmma::load_matrix_sync(at, sdS + kk * 16 * BC + warp * 16, BC);
          wmma::load_matrix_sync(bm, sQ + kk * 16 * HDP + nf * 16, HDP);
          wmma::mma_sync(acc_k, at, bm, acc_k);
        }
        wmma::store_matrix_sync(dv_tile, acc_v, HDP, wmma::mem_row_major);
        wmma::store_matrix_sync(dk_tile, acc_k, HDP, wmma::mem_row_major);
      }

      // dQ[16 x HDP] (this warp's query rows) = dS K, added to the fp32 buffer with atomics.
      for (int nf = 0; nf < HDP / 16; nf++) {
        FragC acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int kk = 0; kk < BC / 16; kk++) {
          FragA a;
          FragB bm;
          wmma::load_matrix_sync(a, sdS + warp * 16 * BC + kk * 16, BC);
          wmma::load_matrix_sync(bm, sK + kk * 16 * HDP + nf * 16, HDP);
          wmma::mma_sync(acc, a, bm, acc);
        }
        wmma::store_matrix_sync(sdQ + warp * 16 * HDP + nf * 16, acc, HDP, wmma::mem_row_major);
      }
      __syncwarp();
      for (int idx = lane; idx < 16 * HD; idx += 32) {
        const int rr = idx / HD, d = idx - rr * HD;
        const int ii = q0 + warp * 16 + rr;
        if (ii < T)
          atomicAdd(p.dq_acc + (((long)b * T + ii) * NH + h) * HD + d, sdQ[(warp * 16 + rr) * HDP + d] * p.scale);
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < BC * HD; idx += blockDim.x) {
    const int rr = idx / HD, d = idx - rr * HD;
    const int j = k0 + rr;
    if (j >= T) continue;
    const long o = (long)b * T * p.kv_stride + (long)j * p.kv_stride + (long)g * HD + d;
    p.dk[o] = __float2bfloat16_rn(sdK[rr * HDP + d] * p.scale);
    p.dv[o] = __float2bfloat16_rn(sdV[rr * HDP + d]);
  }
}

// dq (bf16, row stride q_stride) <- dq_acc (fp32 [B,T,NH,HD]).
__global__ void attention_dq_kernel(bf16* dq, const float* dq_acc, long N, int NH, int HD, long q_stride) {
  const long total = N * NH * HD;
  for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < total; idx += (long)gridDim.x * blockDim.x) {
    const long n = idx / ((long)NH * HD);
    const long rest = idx - n * NH * HD;
    dq[n * q_stride + rest] = __float2bfloat16_rn(dq_acc[idx]);
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

Params make_params(const char* op, const Bf16* q, const Bf16* k, const Bf16* v, const AttentionMask& mask, int B,
                   int T, int NH, int NKV, int HD, long& q_stride, long& kv_stride) {
  MOETRON_OP_CHECK(B > 0 && T > 0 && NH > 0 && NKV > 0 && HD > 0, op, "bad dimensions B={} T={} NH={} NKV={} HD={}",
                   B, T, NH, NKV, HD);
  MOETRON_OP_CHECK(NH % NKV == 0, op, "NH={} is not a multiple of NKV={}", NH, NKV);
  MOETRON_OP_CHECK(HD <= kMaxHD, op, "head dim {} exceeds the kernel's maximum {}", HD, kMaxHD);
  MOETRON_OP_CHECK(mask.sliding_window >= 0, op, "sliding_window must be >= 0, got {}", mask.sliding_window);
  if (q_stride == 0) q_stride = (long)NH * HD;
  if (kv_stride == 0) kv_stride = (long)NKV * HD;
  MOETRON_OP_CHECK(q_stride >= (long)NH * HD && kv_stride >= (long)NKV * HD, op,
                   "row strides q={} kv={} are smaller than NH*HD={} / NKV*HD={}", q_stride, kv_stride,
                   (long)NH * HD, (long)NKV * HD);
  Params p{};
  p.q = as_bf(q);
  p.k = as_bf(k);
  p.v = as_bf(v);
  p.amask = mask.attention_mask;
  p.seg = mask.segment_ids;
  p.window = mask.sliding_window;
  p.B = B;
  p.T = T;
  p.NH = NH;
  p.NKV = NKV;
  p.HD = HD;
  p.HDP = (HD + 15) / 16 * 16;
  p.q_stride = q_stride;
  p.kv_stride = kv_stride;
  p.scale = 1.0f / std::sqrt((float)HD);
  p.scale_log2 = p.scale * 1.4426950408889634f;
  p.vec = HD % 8 == 0 && q_stride % 8 == 0 && kv_stride % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
  return p;
}

}  // namespace

void attention_forward(Context& ctx, Bf16* out, float* lse, const Bf16* q, const Bf16* k, const Bf16* v,
                       const AttentionMask& mask, int B, int T, int NH, int NKV, int HD, long q_stride,
                       long kv_stride) {
  const char* op = "attention_forward";
  Params p = make_params(op, q, k, v, mask, B, T, NH, NKV, HD, q_stride, kv_stride);
  p.o = as_bf(out);
  p.lse = lse;
  const size_t smem = fwd_smem_bytes(p.HDP);
  CUDA_CALL(op, cudaFuncSetAttribute(flash_forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const dim3 grid((T + BR - 1) / BR, NH, B);
  flash_forward_kernel<<<grid, kThreads, smem, stream_of(ctx)>>>(p);
  CUDA_LAUNCHED(op);
}

size_t attention_backward_scratch_floats(int B, int T, int NH, int HD) {
  return (size_t)B * T * NH * HD + (size_t)B * NH * T;
}

void attention_backward(Context& ctx, Bf16* dq, Bf16* dk, Bf16* dv, float* scratch, const Bf16* dout,
                        const Bf16* out, const float* lse, const Bf16* q, const Bf16* k, const Bf16* v,
                        const AttentionMask& mask, int B, int T, int NH, int NKV, int HD, long q_stride,
                        long kv_stride) {
  const char* op = "attention_backward";
  Params p = make_params(op, q, k, v, mask, B, T, NH, NKV, HD, q_stride, kv_stride);
  p.vec = p.vec && aligned16(dout);
  const long N = (long)B * T;
  float* dq_acc = scratch;
  float* dvec = scratch + (size_t)N * NH * HD;
  p.out = as_bf(out);
  p.dout = as_bf(dout);
  p.lse = const_cast<float*>(lse);
  p.dq_acc = dq_acc;
  p.dvec = dvec;
  p.dk = as_bf(dk);
  p.dv = as_bf(dv);
  cudaStream_t s = stream_of(ctx);
  fill_zero(ctx, dq_acc, sizeof(float) * (size_t)N * NH * HD);
  attention_dvec_kernel<<<blocks_for((size_t)N * NH * 32, 256), 256, 0, s>>>(dvec, as_bf(dout), as_bf(out), B, T, NH,
                                                                            HD);
  CUDA_LAUNCHED(op);
  const size_t smem = bwd_smem_bytes(p.HDP);
  CUDA_CALL(op, cudaFuncSetAttribute(flash_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const dim3 grid((T + BC - 1) / BC, NKV, B);
  flash_backward_kernel<<<grid, kThreads, smem, s>>>(p);
  CUDA_LAUNCHED(op);
  const size_t total = (size_t)N * NH * HD;
  const unsigned blocks = blocks_for(total, 256) < (1u << 20) ? blocks_for(total, 256) : (1u << 20);
  attention_dq_kernel<<<blocks, 256, 0, s>>>(as_bf(dq), dq_acc, N, NH, HD, q_stride);
  CUDA_LAUNCHED(op);
}

}  // namespace moetron::gpu
