// The prefill GEMM's AVX-512 tiles (gemm_impl.h): x packed kT512 (48) rows a tile by transposes in
// registers, up to 8 weight rows each against 16- and 8-wide vectors (bf16 rows as they lie), and the
// results written back through transposes in registers.

// GCC 12 reports the "undefined" pass-through operand inside its own AVX-512 intrinsics
// (_mm512_slli_epi32, _mm512_reduce_add_ps) as uninitialised when they are used under a target
// attribute: a known false positive of the headers, silenced for this file only.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "backend/kernels/gemm_impl.h"

namespace moetron::kernels {

namespace {

// AVX-512: R weight rows against the first 16 Z + 8 Y columns of a packed x tile ([IC][kT512]): Z 16-wide
// vectors and Y (0 or 1) 8-wide ones after them, so a tile's padding is under 8 columns (on CPUs that
// split a 16-wide FMA in two 8-wide halves, Zen 4's, an 8-wide FMA costs half; elsewhere it costs
// what a 16-wide one does, as the padding it saves would).
// WT: float, or uint16_t for bf16 rows read where they lie (broadcast and shifted into fp32 in the
// register: exactly their widening, without a widening pass over memory).
template <typename WT>
MOETRON_GEMM_AVX512 inline __m512 bcast512(const WT* w) {
  if constexpr (sizeof(WT) == 2)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi16((short)*w), 16));
  else
    return _mm512_set1_ps(*w);
}
template <typename WT>
MOETRON_GEMM_AVX512 inline __m256 bcast256(const WT* w) {
  if constexpr (sizeof(WT) == 2)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi16((short)*w), 16));
  else
    return _mm256_broadcast_ss(w);
}

}  // namespace

template <int R, int Z, int Y, typename WT>
MOETRON_GEMM_AVX512 void tile_avx512(const float* xp, const void* Wv, int ld_w, int IC, float* buf, const char* pf,
                                     int pf_lines) {
  const WT* W = static_cast<const WT*>(Wv);
  __m512 a[R][Z > 0 ? Z : 1];
  __m256 b[R];
  for (int r = 0; r < R; r++) {
    for (int v = 0; v < Z; v++) a[r][v] = _mm512_setzero_ps();
    if (Y) b[r] = _mm256_setzero_ps();
  }
  for (int k = 0; k < IC; k++) {
    if ((k & 3) == 0 && (k >> 2) < pf_lines) _mm_prefetch(pf + (size_t)(k >> 2) * 64, _MM_HINT_T0);
    __m512 x[Z > 0 ? Z : 1];
    __m256 y;
    for (int v = 0; v < Z; v++) x[v] = _mm512_loadu_ps(xp + (size_t)k * kT512 + 16 * v);
    if (Y) y = _mm256_loadu_ps(xp + (size_t)k * kT512 + 16 * Z);
    for (int r = 0; r < R; r++) {
      if constexpr (Z == 0) {  // an 8-wide broadcast (a 16-wide one costs more on Zen 4)
        b[r] = _mm256_fmadd_ps(y, bcast256(W + (size_t)r * ld_w + k), b[r]);
      } else {
        const __m512 w = bcast512(W + (size_t)r * ld_w + k);
        for (int v = 0; v < Z; v++) a[r][v] = _mm512_fmadd_ps(x[v], w, a[r][v]);
        if (Y) b[r] = _mm256_fmadd_ps(y, _mm512_castps512_ps256(w), b[r]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    for (int v = 0; v < Z; v++) _mm512_store_ps(buf + r * kT512 + 16 * v, a[r][v]);
    if (Y) _mm256_store_ps(buf + r * kT512 + 16 * Z, b[r]);
  }
}

// out[t0 + t][r0 + r] (=, or += when acc) alpha * buf[r * kT512 + t] for r < R <= 8, t < valid <= kT512: each
// block of 8 columns is loaded as 8 rows (zero past R), transposed in registers and stored as 8-wide
// rows of out, masked to R values.  alpha * s is s exactly when alpha is 1, so one path serves all.
MOETRON_GEMM_AVX512 inline void store_tile_avx512(float* out, int ld_out, const float* buf, int R, int valid, int t0,
                                                  int r0, float alpha, bool acc) {
  const __mmask8 m = (__mmask8)((1u << R) - 1);
  const __m256 al = _mm256_set1_ps(alpha);
  for (int j = 0; j * 8 < valid; j++) {
    __m256 v[8];
    for (int r = 0; r < 8; r++) v[r] = r < R ? _mm256_load_ps(buf + r * kT512 + 8 * j) : _mm256_setzero_ps();
    const __m256 t0_ = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
    const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0_, t2, 0x44), u1 = _mm256_shuffle_ps(t0_, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    const __m256 c[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                         _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                         _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                         _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
    const int cols = std::min(8, valid - 8 * j);
    for (int t = 0; t < cols; t++) {
      float* o = out + (size_t)(t0 + 8 * j + t) * ld_out + r0;
      __m256 s = _mm256_mul_ps(al, c[t]);
      if (acc) s = _mm256_add_ps(_mm256_maskz_loadu_ps(m, o), s);
      _mm256_mask_storeu_ps(o, m, s);
    }
  }
}

// x rows [t0, t0 + kT512) as [IC][kT512], zero past n: 16 x 16 blocks transposed in registers.
MOETRON_GEMM_AVX512 inline void pack_tile_avx512(float* p, const float* x, int ld_x, int n, int t0, int IC) {
  const int valid = std::min(kT512, n - t0);
  for (int k0 = 0; k0 < IC; k0 += 16) {
    const int kn = std::min(16, IC - k0);
    const __mmask16 km = (__mmask16)((1u << kn) - 1);
    for (int h = 0; h < kT512 / 16; h++) {
      __m512 r[16];
      for (int i = 0; i < 16; i++) {
        const int t = 16 * h + i;
        r[i] = t < valid ? _mm512_maskz_loadu_ps(km, x + (size_t)(t0 + t) * ld_x + k0) : _mm512_setzero_ps();
      }
      __m512 u[16];
      for (int g = 0; g < 4; g++) {  // rows 4g .. 4g + 3: 4 x 4 blocks transposed within each 128-bit lane
        const __m512 a = _mm512_unpacklo_ps(r[4 * g], r[4 * g + 1]), b = _mm512_unpackhi_ps(r[4 * g], r[4 * g + 1]);
        const __m512 c = _mm512_unpacklo_ps(r[4 * g + 2], r[4 * g + 3]),
                     d = _mm512_unpackhi_ps(r[4 * g + 2], r[4 * g + 3]);
        u[4 * g + 0] = _mm512_shuffle_ps(a, c, 0x44);  // lane L: column 4L + 0 of rows 4g .. 4g + 3
        u[4 * g + 1] = _mm512_shuffle_ps(a, c, 0xEE);
        u[4 * g + 2] = _mm512_shuffle_ps(b, d, 0x44);
        u[4 * g + 3] = _mm512_shuffle_ps(b, d, 0xEE);
      }
      for (int c = 0; c < 4; c++) {  // columns c, 4 + c, 8 + c, 12 + c: lanes gathered across the groups
        const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        const __m512 w0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        const __m512 w1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
        const __m512 col[4] = {_mm512_shuffle_f32x4(v0, w0, 0x88), _mm512_shuffle_f32x4(v1, w1, 0x88),
                               _mm512_shuffle_f32x4(v0, w0, 0xDD), _mm512_shuffle_f32x4(v1, w1, 0xDD)};
        for (int q = 0; q < 4; q++) {
          const int k = 4 * q + c;
          if (k < kn) _mm512_store_ps(p + (size_t)(k0 + k) * kT512 + 16 * h, col[q]);
        }
      }
    }
  }
}

void gemm_run_avx512(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
                     float alpha, bool acc, std::vector<float>& scratch, bool parallel) {
  gemm_run<kT512>(out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, acc, scratch, parallel);
}

}  // namespace moetron::kernels
