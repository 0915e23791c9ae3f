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

constexpr int kRows = 6;  // weight rows per tile
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
const float* weight_rows(WeightRef W, int ld_w, int r0, int R, int IC, float* tmp, int& ld) {
  if (W.dtype == DType::F32 && !W.q8()) {
    ld = ld_w;
    return static_cast<const float*>(W.data) + (size_t)r0 * ld_w;
  }
  for (int r = 0; r < R; r++) widen_row(tmp + (size_t)r * IC, W, (size_t)(r0 + r), IC);
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
#define MOETRON_GEMM_AVX512 __attribute__((target("avx512f,avx2,fma")))

// One tile: R weight rows from W against V vectors of a packed x tile ([IC][T] with T = 2 vectors;
// V = 1 when the tile's real rows fit in the first vector), into buf[R][T].  Meanwhile it asks for
// pf_lines cache lines from pf into L2, one every 4 columns (at most IC / 4: the next weight rows, so
// their read from memory overlaps this arithmetic instead of stalling the widening).
template <int R, int V>
MOETRON_GEMM_AVX2 void tile_avx2(const float* xp, const float* W, int ld_w, int IC, float* buf, const char* pf,
                                int pf_lines) {
  __m256 a[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) a[r][v] = _mm256_setzero_ps();
  for (int k = 0; k < IC; k++) {
    if ((k & 3) == 0 && (k >> 2) < pf_lines) _mm_prefetch(pf + (size_t)(k >> 2) * 64, _MM_HINT_T1);
    __m256 x[V];
    for (int v = 0; v < V; v++) x[v] = _mm256_loadu_ps(xp + (size_t)k * 16 + 8 * v);
    for (int r = 0; r < R; r++) {
      const __m256 w = _mm256_broadcast_ss(W + (size_t)r * ld_w + k);
      for (int v = 0; v < V; v++) a[r][v] = _mm256_fmadd_ps(x[v], w, a[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) _mm256_storeu_ps(buf + r * 16 + 8 * v, a[r][v]);
}

template <int R, int V>
MOETRON_GEMM_AVX512 void tile_avx512(const float* xp, const float* W, int ld_w, int IC, float* buf, const char* pf,
                                    int pf_lines) {
  __m512 a[R][V];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) a[r][v] = _mm512_setzero_ps();
  for (int k = 0; k < IC; k++) {
    if ((k & 3) == 0 && (k >> 2) < pf_lines) _mm_prefetch(pf + (size_t)(k >> 2) * 64, _MM_HINT_T1);
    __m512 x[V];
    for (int v = 0; v < V; v++) x[v] = _mm512_loadu_ps(xp + (size_t)k * 32 + 16 * v);
    for (int r = 0; r < R; r++) {
      const __m512 w = _mm512_set1_ps(W[(size_t)r * ld_w + k]);
      for (int v = 0; v < V; v++) a[r][v] = _mm512_fmadd_ps(x[v], w, a[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) _mm512_storeu_ps(buf + r * 32 + 16 * v, a[r][v]);
}

using TileFn = void (*)(const float*, const float*, int, int, float*, const char*, int);

template <int T>
TileFn tile_fn(int R, int V) {
  if constexpr (T == 32) {
    static constexpr TileFn t[2][kRows] = {
        {tile_avx512<1, 1>, tile_avx512<2, 1>, tile_avx512<3, 1>, tile_avx512<4, 1>, tile_avx512<5, 1>, tile_avx512<6, 1>},
        {tile_avx512<1, 2>, tile_avx512<2, 2>, tile_avx512<3, 2>, tile_avx512<4, 2>, tile_avx512<5, 2>, tile_avx512<6, 2>}};
    return t[V - 1][R - 1];
  } else {
    static constexpr TileFn t[2][kRows] = {
        {tile_avx2<1, 1>, tile_avx2<2, 1>, tile_avx2<3, 1>, tile_avx2<4, 1>, tile_avx2<5, 1>, tile_avx2<6, 1>},
        {tile_avx2<1, 2>, tile_avx2<2, 2>, tile_avx2<3, 2>, tile_avx2<4, 2>, tile_avx2<5, 2>, tile_avx2<6, 2>}};
    return t[V - 1][R - 1];
  }
}

// T = 16 (AVX2) or 32 (AVX-512) packed rows of x a tile; T = 0: the portable path, unpacked.
template <int T>
void gemm_run(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
              float alpha, bool acc, std::vector<float>& scratch, bool parallel) {
  const int tiles = T ? (n + T - 1) / T : 0;
  const size_t packed = (size_t)tiles * T * IC;
  const bool widen = !(W.dtype == DType::F32 && !W.q8());
  const int threads = parallel ? omp_get_max_threads() : 1;
  scratch.resize(packed + (widen ? (size_t)threads * kRows * IC : 0));
  float* p = scratch.data();
  if constexpr (T > 0)
    for (int i = 0; i < tiles; i++) pack_tile<T>(p + (size_t)i * IC * T, x, ld_x, n, i * T, IC);
  const int groups = (OC + kRows - 1) / kRows;
  // Widened weights (2 bytes a value, or Q8_0's 1): the first tile of a group prefetches the next
  // group's rows, kRows * IC values, contiguous (ld_w == IC), at most IC / 4 lines for 2-byte values.
  // 0.49B bf16 model, prompt 128, one thread, 2-core AVX-512 AMD EPYC (Zen 4) VM: widen_row, stalled
  // on memory, was 15% of the prefill's time.
  const size_t vbytes = W.q8() ? 1 : dtype_size(W.dtype);
  const int pf_lines = widen ? (int)std::min<size_t>((size_t)kRows * IC * vbytes / 64, (size_t)IC / 4) : 0;
#pragma omp parallel for schedule(static) if (parallel)
  for (int g = 0; g < groups; g++) {
    const int r0 = g * kRows, R = std::min(kRows, OC - r0);
    int ld = 0;
    const float* Wg = weight_rows(W, ld_w, r0, R, IC, p + packed + (size_t)omp_get_thread_num() * kRows * IC, ld);
    const int next_rows = g + 1 < groups ? std::min(kRows, OC - r0 - kRows) : 0;
    const char* next = next_rows ? static_cast<const char*>(W.data) + (size_t)(r0 + kRows) * IC * vbytes : nullptr;
    const int next_lines = (int)std::min<size_t>(pf_lines, (size_t)next_rows * IC * vbytes / 64);
    if constexpr (T == 0) {
      gemm_generic(out, ld_out, x, ld_x, Wg, ld, n, IC, r0, R, alpha, acc);
    } else {
      alignas(64) float buf[kRows * T];
      for (int i = 0; i < tiles; i++) {
        const int valid = std::min(T, n - i * T);
        tile_fn<T>(R, valid <= T / 2 ? 1 : 2)(p + (size_t)i * IC * T, Wg, ld, IC, buf, next, i == 0 ? next_lines : 0);
        store_tile<T>(out, ld_out, buf, R, valid, i * T, r0, alpha, acc);
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
      return gemm_run<32>(out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, accumulate, scratch, parallel);
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
