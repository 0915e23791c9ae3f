// The prefill GEMM's internals (gemm*.cpp; internal to backend/kernels): the tiles' shapes, the tiling
// loop every level shares (gemm_run: x packed once, the weight rows in groups, each group against
// every tile), and each level's kernels.  gemm_run<T> is instantiated beside its level's kernels
// (gemm_generic.cpp, gemm_avx2.cpp, gemm_avx512.cpp), so that what it calls per tile is compiled with
// it (and inlined where the compiler finds it pays), as when they shared one file.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/kernels/gemm.h"
#include "backend/kernels/gemv.h"
#include "backend/kernels/targets.h"

namespace moetron::kernels {

// Weight rows per tile: 8 with AVX-512 (16 accumulators of its 32 registers, and a tile's results
// leave as 8 x 8 blocks transposed in registers), 6 with AVX2 (12 of its 16) and the portable code.
constexpr int kRows = 6, kRows512 = 8, kMaxRows = 8;
// x rows a packed AVX-512 tile: 48, 3 vectors (a prompt's expert holds a few dozen rows: one tile).
constexpr int kT512 = 48;
template <int T>
constexpr int rows_of() {
  return T == kT512 ? kRows512 : kRows;
}

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
inline const float* weight_rows(const WeightRef& W, int ld_w, int r0, int R, int IC, float* tmp, int& ld) {
  if (W.dtype == DType::F32 && !W.q8()) {
    ld = ld_w;
    return static_cast<const float*>(W.data) + (size_t)r0 * ld_w;
  }
  widen_rows(tmp, W, (size_t)r0, R, IC);
  ld = IC;
  return tmp;
}


// ---- each level's kernels -------------------------------------------------------------------------

// The portable code (gemm_generic.cpp): rows [r0, r0 + R) of W against x's n rows, unpacked.
void gemm_generic(float* out, int ld_out, const float* x, int ld_x, const float* W, int ld_w, int n, int IC, int r0,
                  int R, float alpha, bool acc);
// AVX2 (gemm_avx2.cpp): one tile of R weight rows against V 8-wide vectors of a packed x tile.
template <int R, int V>
MOETRON_GEMM_AVX2 void tile_avx2(const float* xp, const float* W, int ld_w, int IC, float* buf, const char* pf,
                                int pf_lines);
// AVX-512 (gemm_avx512.cpp): one tile of R weight rows (WT: float, or uint16_t for bf16 as stored)
// against Z 16-wide and Y 8-wide vectors of a packed x tile; a tile's sums into out; x packed.  The
// last two are inline, defined in that file only (the one that calls them, from gemm_run<kT512>), so
// that the compiler may inline the store into the tile loop, as when they were local to one file
// (declared plainly, it stayed a call per tile).
template <int R, int Z, int Y, typename WT>
MOETRON_GEMM_AVX512 void tile_avx512(const float* xp, const void* Wv, int ld_w, int IC, float* buf, const char* pf,
                                     int pf_lines);
MOETRON_GEMM_AVX512 inline void store_tile_avx512(float* out, int ld_out, const float* buf, int R, int valid, int t0,
                                                  int r0, float alpha, bool acc);
MOETRON_GEMM_AVX512 inline void pack_tile_avx512(float* p, const float* x, int ld_x, int n, int t0, int IC);

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

// gemm_run<0>, <16> and <kT512>, each in its level's file.
void gemm_run_generic(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
                      float alpha, bool acc, std::vector<float>& scratch, bool parallel);
void gemm_run_avx2(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
                   float alpha, bool acc, std::vector<float>& scratch, bool parallel);
void gemm_run_avx512(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
                     float alpha, bool acc, std::vector<float>& scratch, bool parallel);

}  // namespace moetron::kernels
