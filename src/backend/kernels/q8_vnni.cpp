// The AVX-512 VNNI Q8_0 products (q8_impl.h): 64 values at a time (two blocks: E in the low half, O in
// the high) as -128 * sum(x) plus (w + 128) (u8) times x.

// GCC 12 reports the "undefined" pass-through operand inside its own AVX-512 intrinsics
// (_mm512_slli_epi32, _mm512_reduce_add_ps) as uninitialised when they are used under a target
// attribute: a known false positive of the headers, silenced for this file only.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "backend/kernels/q8_impl.h"

namespace moetron::kernels {

namespace {

// Q8_0: bytes ahead, per kernel, each measured on the CPU it is chosen for (0.49B model, one thread;
// q8_avx2.cpp: AVX2's).  AVX-512 VNNI (64 bytes a step), on the AVX-512 AMD EPYC VM: 2 KiB 88
// tokens/s, 4 KiB 109, 8 KiB 115, 16 KiB 110.
constexpr int kQ8PrefetchVnni = 8192;
// On AMD (amd_cpu()) 4 KiB ahead into L2: 2-core Zen 4 EPYC VM, 32000 x 1024 from memory, G
// multiply-adds/s, one thread 14.8 -> 20.2 (8 KiB into L2: 18.7), two 24.6 -> 31.5.
constexpr int kQ8PrefetchVnniL2 = 4096;

// The 16 int32 lane sums of blocks b, b+1 (64 weights) with input j: -128 sum(x) + (w + 128) x, the
// dot product accumulated onto the offset (exact int32: the same sums as subtracting it after, with
// neither a zeroed accumulator nor the subtraction).
MOETRON_VNNI inline __m512i q8_pair_lanes(const int8_t* w, const Q8Inputs& x, size_t at) {
  const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(w), _mm512_set1_epi8((char)0x80));
  return _mm512_dpbusd_epi32(_mm512_loadu_si512(x.neg_off + at / 4), wu, _mm512_loadu_si512(x.q + at));
}

// The same for one block, 8 lanes.
MOETRON_VNNI inline __m256i q8_one_lanes(const int8_t* w, const Q8Inputs& x, size_t at) {
  const __m256i wu = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
                                      _mm256_set1_epi8((char)0x80));
  return _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.neg_off + at / 4)), wu,
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at)));
}

// acc (E low, O high) += d_b, d_b+1 times the lane sums; dv holds 16 blocks' scales from g, p the pair.
MOETRON_VNNI inline __m512 q8_pair_fma(__m512 acc, __m512 dv, int p, __m512i s) {
  const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                       _mm512_set1_epi32(2 * p));
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, dv), _mm512_cvtepi32_ps(s), acc);
}

// An odd last block (an even index: E, the low half).
MOETRON_VNNI inline __m512 q8_tail_fma(__m512 acc, __m512 dv, int p, __m256i s) {
  const __m256 d = _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_set1_epi32(2 * p), dv));
  const __m256 lo = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), _mm512_castps512_ps256(acc));
  return _mm512_insertf32x8(acc, lo, 0);
}

MOETRON_VNNI inline float q8_finish(__m512 acc) {
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)));
}

// 16 block scales from block g of row r (fewer at the row's end: mask m) times the input's.
MOETRON_VNNI inline __m512 q8_scales(const uint16_t* S, size_t at, __mmask16 m, const float* dx) {
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, S + at)), _mm512_maskz_loadu_ps(m, dx));
}

}  // namespace

template <int R, Prefetch PF>
MOETRON_VNNI void q8_block_vnni(float* y, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int r, int stride,
                                int IC, bool acc) {
  const int nb = IC / kQ8Block;
  __m512 a[R];
  for (int k = 0; k < R; k++) a[k] = _mm512_setzero_ps();
  for (int g = 0; g < nb; g += 16) {
    const int gn = std::min(16, nb - g);
    const __mmask16 m = (__mmask16)((1u << gn) - 1);
    __m512 dv[R];
    for (int k = 0; k < R; k++) dv[k] = q8_scales(S, (size_t)(r + k * stride) * nb + g, m, x.d + g);
    int p = 0;
    for (; 2 * p + 1 < gn; p++) {
      const size_t at = (size_t)(g + 2 * p) * kQ8Block;
      for (int k = 0; k < R; k++) {
        const int8_t* w = W + (size_t)(r + k * stride) * IC + at;
        if constexpr (PF == Prefetch::l2)
          _mm_prefetch(reinterpret_cast<const char*>(w + kQ8PrefetchVnniL2), _MM_HINT_T1);
        else if constexpr (PF == Prefetch::l1)
          _mm_prefetch(reinterpret_cast<const char*>(w + kQ8PrefetchVnni), _MM_HINT_T0);
        a[k] = q8_pair_fma(a[k], dv[k], p, q8_pair_lanes(w, x, at));
      }
    }
    if (2 * p < gn) {
      const size_t at = (size_t)(g + 2 * p) * kQ8Block;
      for (int k = 0; k < R; k++)
        a[k] = q8_tail_fma(a[k], dv[k], p, q8_one_lanes(W + (size_t)(r + k * stride) * IC + at, x, at));
    }
  }
  for (int k = 0; k < R; k++) {
    const float s = q8_finish(a[k]);
    y[r + k * stride] = acc ? y[r + k * stride] + s : s;
  }
}

namespace {

// PF: the row's prefetch, kQ8PrefetchVnni ahead into L1 or L2 (see q8_multi_fn_vnni).
template <int N, Prefetch PF>
MOETRON_VNNI void q8_multi_vnni(float* out, int ld_out, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int r,
                                int IC, bool acc) {
  const int nb = IC / kQ8Block;
  __m512 a[N];
  for (int j = 0; j < N; j++) a[j] = _mm512_setzero_ps();
  const int8_t* row = W + (size_t)r * IC;
  for (int g = 0; g < nb; g += 16) {
    const int gn = std::min(16, nb - g);
    const __mmask16 m = (__mmask16)((1u << gn) - 1);
    __m512 dv[N];
    for (int j = 0; j < N; j++) dv[j] = q8_scales(S, (size_t)r * nb + g, m, x.d + (size_t)j * nb + g);
    int p = 0;
    for (; 2 * p + 1 < gn; p++) {
      const size_t at = (size_t)(g + 2 * p) * kQ8Block;
      _mm_prefetch(reinterpret_cast<const char*>(row + at + kQ8PrefetchVnni),
                   PF == Prefetch::l2 ? _MM_HINT_T1 : _MM_HINT_T0);
      for (int j = 0; j < N; j++) a[j] = q8_pair_fma(a[j], dv[j], p, q8_pair_lanes(row + at, x, (size_t)j * IC + at));
    }
    if (2 * p < gn) {
      const size_t at = (size_t)(g + 2 * p) * kQ8Block;
      for (int j = 0; j < N; j++) a[j] = q8_tail_fma(a[j], dv[j], p, q8_one_lanes(row + at, x, (size_t)j * IC + at));
    }
  }
  for (int j = 0; j < N; j++) {
    const float s = q8_finish(a[j]);
    float& o = out[(size_t)j * ld_out + r];
    o = acc ? o + s : s;
  }
}

// On AMD into L2: the inputs stay in L1.  2-core Zen 4 EPYC VM, Q8_0 from memory, alternating in one
// process, L2 / L1 GB/s ratios, one and two threads: 2048 x 1024 with 2 inputs 1.15 / 1.04, 4 inputs
// 1.25 / 1.05; 1024 x 2048 with 2 inputs 1.32 / 1.05, 4 inputs 1.31 / 1.24; 32000 x 1024 with 8 and
// rows of 256 the same (1.00-1.02).  4 KiB ahead into L2 (the neighbours' one-input distance) gained
// less (1.00-1.28).  The AVX2 products (compute-bound on it) were the same either way.
template <Prefetch PF>
Q8MultiFn q8_multi_fn_vnni_pf(int n) {
  static constexpr Q8MultiFn t[kMaxGemvInputs] = {q8_multi_vnni<1, PF>, q8_multi_vnni<2, PF>, q8_multi_vnni<3, PF>,
                                                  q8_multi_vnni<4, PF>, q8_multi_vnni<5, PF>, q8_multi_vnni<6, PF>,
                                                  q8_multi_vnni<7, PF>, q8_multi_vnni<8, PF>};
  return t[n - 1];
}

}  // namespace

Q8MultiFn q8_multi_fn_vnni(int n) {
  return amd_cpu() ? q8_multi_fn_vnni_pf<Prefetch::l2>(n) : q8_multi_fn_vnni_pf<Prefetch::l1>(n);
}

template Q8BlockKernel q8_block_vnni<1, Prefetch::none>;
template Q8BlockKernel q8_block_vnni<1, Prefetch::l1>;
template Q8BlockKernel q8_block_vnni<1, Prefetch::l2>;
template Q8BlockKernel q8_block_vnni<2, Prefetch::none>;
template Q8BlockKernel q8_block_vnni<2, Prefetch::l1>;
template Q8BlockKernel q8_block_vnni<2, Prefetch::l2>;

}  // namespace moetron::kernels
