// The prefill GEMM's AVX2 tiles (gemm_impl.h): x packed 16 rows a tile, up to 6 weight rows each
// broadcast against its 8-wide vectors (12 accumulators of the 16 registers).
#include "backend/kernels/gemm_impl.h"

namespace moetron::kernels {

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

void gemm_run_avx2(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
                   float alpha, bool acc, std::vector<float>& scratch, bool parallel) {
  gemm_run<16>(out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, acc, scratch, parallel);
}

}  // namespace moetron::kernels
