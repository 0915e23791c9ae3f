// gemm_nt (see gemm.h).
#include "infer/gemm.h"

#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moetron::infer {

namespace {

// Weight rows per tile: 8 with AVX-512 (16 accumulators of its 32 registers, and a tile's results
// leave as 8 x 8 blocks transposed in registers), 6 with AVX2 (12 of its 16) and the portable code.
constexpr int kRows = 6, kRows512 = 8, kMaxRows = 8;
// x rows a packed AVX-512 tile: 48, 3 vectors (a prompt's expert holds a few dozen rows: one tile).
constexpr int kT512 = 48;
template <int T>
constexpr int rows_of() {
  return T == kT512 ? kRows512 : kRows;
}
// Multiply-adds from which the weight rows are split across threads: 2M, the decoder's own threshold
// (a fork/join may cost a scheduler time slice when the cores are shared; at 256K the prefill router's
// product forked every layer, and test_infer_q8 at two SIMD levels side by side took 45 s instead of 20).
constexpr long kParallelMin = 1L << 21;

// Writes a tile's sums (buf[r * T + t], R rows, T columns of which `valid` are real) into out, as
// alpha * s or out + alpha * s.  The tile's outputs lie transposed to the accumulators (out's rows
// are x's), so they go one by one; specialised so each is a load and a store (+ an add, a multiply).
template <int T, bool kAcc, bool kScale>
inline void store_tile_as(float* out, int ld_out, const float* buf, int R, int valid, int t0, int r0, float alpha) {
  for (int t = 0; t < valid; t++) {
    float* o = out + (size_t)(t0 + t) * ld_out + r0;
    for (int r = 0; r < R; r++) {
      const float v = kScale ? alpha * buf[r * T + t] : buf[r * T + t];
      o[r] = kAcc ? o[r] + v : v;
    }
  }
}

template <int T>
inline void store_tile(float* out, int ld_out, const float* buf, int R, int valid, int t0, int r0, float alpha,
                       bool acc) {
  const bool scale = alpha != 1.0f;  // alpha * s is s exactly when alpha is 1
  if (acc)
    scale ? store_tile_as<T, true, true>(out, ld_out, buf, R, valid, t0, r0, alpha)
          : store_tile_as<T, true, false>(out, ld_out, buf, R, valid, t0, r0, alpha);
  else
    scale ? store_tile_as<T, false, true>(out, ld_out, buf, R, valid, t0, r0, alpha)
          : store_tile_as<T, false, false>(out, ld_out, buf, R, valid, t0, r0, alpha);
}

// x rows [t0, t0 + T) as [IC][T], zero past n.
template <int T>
void pack_tile(float* p, const float* x, int ld_x, int n, int t0, int IC) {
  const int valid = std::min(T, n - t0);
  for (int k = 0; k < IC; k++) {
    float* d = p + (size_t)k * T;
    for (int t = 0; t < valid; t++) d[t] = x[(size_t)(t0 + t) * ld_x + k];
    for (int t = valid; t < T; t++) d[t] = 0.0f;
  }
}

// Rows [r0, r0 + R) of W as fp32: in place (fp32), else widened into tmp[R][IC].  ld: their stride.
const float* weight_rows(const WeightRef& W, int ld_w, int r0, int R, int IC, float* tmp, int& ld) {
  if (W.dtype == DType::F32 && !W.q8()) {
    ld = ld_w;
    return static_cast<const float*>(W.data) + (size_t)r0 * ld_w;
  }
  widen_rows(tmp, W, (size_t)r0, R, IC);
  ld = IC;
  return tmp;
}

void gemm_generic(float* out, int ld_out, const float* x, int ld_x, const float* W, int ld_w, int n, int IC, int r0,
                  int R, float alpha, bool acc) {
  for (int r = 0; r < R; r++)
    for (int t = 0; t < n; t++) {
      const float* xr = x + (size_t)t * ld_x;
      const float* wr = W + (size_t)r * ld_w;
      float s = 0.0f;
      for (int k = 0; k < IC; k++) s = std::fma(xr[k], wr[k], s);
      float& o = out[(size_t)t * ld_out + r0 + r];
      o = acc ? o + alpha * s : alpha * s;
    }
}

#define MOETRON_GEMM_AVX2 __attribute__((target("avx2,fma")))
#define MOETRON_GEMM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

// One tile: R weight rows from W against V vectors of a packed x tile ([IC][T] with T = 2 vectors;
// V = 1 when the tile's real rows fit in the first vector), into buf[R][T].  Meanwhile it asks for
// pf_lines cache lines from pf, one every 4 columns (at most IC / 4: the next weight rows, so their
// read from memory overlaps this arithmetic instead of stalling the widening).  Into L1 (prefetcht0):
// 2-core Zen 4 EPYC VM, one thread, bf16 32 x 256 x 512 over 100 matrices from memory, G
// multiply-adds/s: into L2 38.3, into L1 42.9 (two groups ahead into L1: 41.3); 32 x 1024 x 1024:
// 40.9 and 44.5.
template <int R, int V>
MOETRON_GEMM_AVX2 void tile_avx2(const float* xp, const float* W, int ld_w, int IC, float* buf, const char* pf,
                                int pf_lines) {
  __m256 a[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) a[r][v] = _mm256_setzero_ps();
  // A loop that runs at least once (IC = 0 returns first) and prefetches without a branch (line
  // min(k / 4, pf_lines - 1); x's first line when there is none): with a `for` that may run zero times,
  // or a prefetch under an `if`, GCC 12 kept the accumulators in memory too, storing each after every
  // FMA (this GEMM ran at 21 G multiply-adds/s where the tile alone reaches 57, 2-core Zen 4 EPYC VM).
  if (IC <= 0) {
    for (int r = 0; r < R; r++)
      for (int v = 0; v < V; v++) _mm256_storeu_ps(buf + r * 16 + 8 * v, a[r][v]);
    return;
  }
  const char* pfp = pf_lines > 0 ? pf : reinterpret_cast<const char*>(xp);
  const int last = pf_lines > 0 ? pf_lines - 1 : 0;
  int k = 0;
  do {
    _mm_prefetch(pfp + (size_t)std::min(k >> 2, last) * 64, _MM_HINT_T0);
    __m256 x[V];
    for (int v = 0; v < V; v++) x[v] = _mm256_loadu_ps(xp + (size_t)k * 16 + 8 * v);
    for (int r = 0; r < R; r++) {
      const __m256 w = _mm256_broadcast_ss(W + (size_t)r * ld_w + k);
      for (int v = 0; v < V; v++) a[r][v] = _mm256_fmadd_ps(x[v], w, a[r][v]);
    }
  } while (++k < IC);
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) _mm256_storeu_ps(buf + r * 16 + 8 * v, a[r][v]);
}

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
MOETRON_GEMM_AVX512 void store_tile_avx512(float* out, int ld_out, const float* buf, int R, int valid, int t0, int r0,
                                           float alpha, bool acc) {
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
MOETRON_GEMM_AVX512 void pack_tile_avx512(float* p, const float* x, int ld_x, int n, int t0, int IC) {
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

using TileFn = void (*)(const float*, const float*, int, int, float*, const char*, int);
using TileFn512 = void (*)(const float*, const void*, int, int, float*, const char*, int);

// AVX-512: R rows, [i] the first i + 1 groups of 8 columns (one 8-wide vector, one 16-wide, 16 + 8,
// ..., three 16-wide: 24 accumulators at most).  AVX2: R rows, V 8-wide vectors.
template <int R, typename WT>
constexpr TileFn512 tiles512[6] = {tile_avx512<R, 0, 1, WT>, tile_avx512<R, 1, 0, WT>, tile_avx512<R, 1, 1, WT>,
                                   tile_avx512<R, 2, 0, WT>, tile_avx512<R, 2, 1, WT>, tile_avx512<R, 3, 0, WT>};
template <typename WT>
constexpr const TileFn512* kTiles512[kRows512] = {tiles512<1, WT>, tiles512<2, WT>, tiles512<3, WT>, tiles512<4, WT>,
                                                  tiles512<5, WT>, tiles512<6, WT>, tiles512<7, WT>, tiles512<8, WT>};
constexpr TileFn kTiles2[2][kRows] = {
    {tile_avx2<1, 1>, tile_avx2<2, 1>, tile_avx2<3, 1>, tile_avx2<4, 1>, tile_avx2<5, 1>, tile_avx2<6, 1>},
    {tile_avx2<1, 2>, tile_avx2<2, 2>, tile_avx2<3, 2>, tile_avx2<4, 2>, tile_avx2<5, 2>, tile_avx2<6, 2>}};

// T = 16 (AVX2) or kT512 (AVX-512) packed rows of x a tile; T = 0: the portable path, unpacked.
template <int T>
void gemm_run(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
              float alpha, bool acc, std::vector<float>& scratch, bool parallel) {
  constexpr int kR = rows_of<T>();
  const int tiles = T ? (n + T - 1) / T : 0;
  const size_t packed = (size_t)tiles * T * IC;
  // bf16 rows go to the AVX-512 tiles as they lie; other stored types are widened kR rows at a time.
  const bool direct_bf16 = T == kT512 && W.dtype == DType::BF16 && !W.q8();
  const bool widen = !(W.dtype == DType::F32 && !W.q8()) && !direct_bf16;
  const int threads = parallel ? omp_get_max_threads() : 1;
  // 64-byte aligned: the packed tiles are read and written whole vectors at a time.
  scratch.resize(packed + (widen ? (size_t)threads * kR * IC : 0) + 16);
  float* p = scratch.data() + ((64 - (reinterpret_cast<uintptr_t>(scratch.data()) & 63)) & 63) / sizeof(float);
  if constexpr (T == kT512)
    for (int i = 0; i < tiles; i++) pack_tile_avx512(p + (size_t)i * IC * T, x, ld_x, n, i * T, IC);
  else if constexpr (T > 0)
    for (int i = 0; i < tiles; i++) pack_tile<T>(p + (size_t)i * IC * T, x, ld_x, n, i * T, IC);
  const int groups = (OC + kR - 1) / kR;
  // Widened weights (2 bytes a value, or Q8_0's 1): the first tile of a group prefetches the next
  // group's rows, kR * IC values, contiguous (ld_w == IC), at most IC / 4 lines for 2-byte values.
  // 0.49B bf16 model, prompt 128, one thread, 2-core AVX-512 AMD EPYC (Zen 4) VM: widen_row, stalled
  // on memory, was 15% of the prefill's time.
  const size_t vbytes = W.q8() ? 1 : dtype_size(W.dtype);
  const int pf_lines = widen || direct_bf16 ? (int)std::min<size_t>((size_t)kR * IC * vbytes / 64, (size_t)IC / 4) : 0;
#pragma omp parallel for schedule(static) if (parallel)
  for (int g = 0; g < groups; g++) {
    const int r0 = g * kR, R = std::min(kR, OC - r0);
    int ld = IC;
    const float* Wg = direct_bf16
                          ? nullptr
                          : weight_rows(W, ld_w, r0, R, IC, p + packed + (size_t)omp_get_thread_num() * kR * IC, ld);
    const int next_rows = g + 1 < groups ? std::min(kR, OC - r0 - kR) : 0;
    const char* next = next_rows ? static_cast<const char*>(W.data) + (size_t)(r0 + kR) * IC * vbytes : nullptr;
    const int next_lines = (int)std::min<size_t>(pf_lines, (size_t)next_rows * IC * vbytes / 64);
    if constexpr (T == 0) {
      gemm_generic(out, ld_out, x, ld_x, Wg, ld, n, IC, r0, R, alpha, acc);
    } else {
      alignas(64) float buf[kMaxRows * kT512];
      for (int i = 0; i < tiles; i++) {
        const int valid = std::min(T, n - i * T);
        const float* xp = p + (size_t)i * IC * T;
        const char* pf = next;
        const int lines = i == 0 ? next_lines : 0;
        if constexpr (T == kT512) {
          if (direct_bf16)
            kTiles512<uint16_t>[R - 1][(valid + 7) / 8 - 1](xp, static_cast<const uint16_t*>(W.data) + (size_t)r0 * IC,
                                                            IC, IC, buf, pf, lines);
          else
            kTiles512<float>[R - 1][(valid + 7) / 8 - 1](xp, Wg, ld, IC, buf, pf, lines);
          store_tile_avx512(out, ld_out, buf, R, valid, i * T, r0, alpha, acc);
        } else {
          kTiles2[valid <= T / 2 ? 0 : 1][R - 1](xp, Wg, ld, IC, buf, pf, lines);
          store_tile<T>(out, ld_out, buf, R, valid, i * T, r0, alpha, acc);
        }
      }
    }
  }
}

}  // namespace

void gemm_nt_at(SimdLevel level, float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n,
                int IC, int OC, float alpha, bool accumulate, std::vector<float>& scratch) {
  if (n <= 0 || OC <= 0) return;
  MOETRON_ASSERT((W.dtype == DType::F32 && !W.q8()) || ld_w == IC);
  const bool parallel = !omp_in_parallel() && omp_get_max_threads() > 1 && (long)n * IC * OC >= kParallelMin;
  switch (level) {
    case SimdLevel::avx512:
      return gemm_run<kT512>(out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, accumulate, scratch, parallel);
    case SimdLevel::avx2:
      return gemm_run<16>(out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, accumulate, scratch, parallel);
    case SimdLevel::generic:
      break;
  }
  gemm_run<0>(out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, accumulate, scratch, parallel);
}

void gemm_nt(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
             float alpha, bool accumulate, std::vector<float>& scratch) {
  gemm_nt_at(simd_level(), out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, accumulate, scratch);
}

}  // namespace moetron::infer
