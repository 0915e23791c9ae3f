// The AVX2 Q8_0 products (q8_impl.h): per block the eight int32 lane sums of |x| (u8) times the
// weights carrying x's signs (maddubs, as llama.cpp), scaled into the E / O fp32 accumulators.
#include "backend/kernels/q8_impl.h"

namespace moetron::kernels {

namespace {

// Q8_0: bytes ahead, per kernel, each measured on the CPU it is chosen for (0.49B model, one thread;
// q8_vnni.cpp: AVX-512 VNNI's).  AVX2 (32 bytes a step), on a 2-core AVX2-only AMD EPYC VM, medians
// of 3, two sweeps: 1 KiB 50, 2 KiB 57, 4 KiB 50, 8 KiB 49, 16 KiB 53 (2 threads: 2 KiB 89, 8 KiB 85).
constexpr int kQ8PrefetchAvx2 = 2048;

MOETRON_AVX2 inline float f16_at_avx2(const uint16_t* s, size_t i) {
  uint16_t h;
  std::memcpy(&h, s + i, sizeof h);
  return _cvtsh_ss(h);  // exact, as f16_to_f32
}

// The eight int32 lane sums of one block: |x| (u8) times the weights carrying x's signs.
MOETRON_AVX2 inline __m256i q8_lanes(__m256i xa, __m256i xq, __m256i w) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w, xq)), _mm256_set1_epi16(1));
}

}  // namespace

// R rows r + k * stride against input 0 (the x loads shared).
template <int R>
MOETRON_AVX2 void q8_block_avx2(float* y, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int r, int stride,
                                int IC, bool acc) {
  const int nb = IC / kQ8Block;
  __m256 a[R][2];  // E, O
  for (int k = 0; k < R; k++) a[k][0] = a[k][1] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (size_t)b * kQ8Block));
    const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a + (size_t)b * kQ8Block));
    const float dx = x.d[b];
    for (int k = 0; k < R; k++) {
      const size_t i = (size_t)(r + k * stride) * IC + (size_t)b * kQ8Block;
      _mm_prefetch(reinterpret_cast<const char*>(W + i + kQ8PrefetchAvx2), _MM_HINT_T0);
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + i));
      const float d = f16_at_avx2(S, (size_t)(r + k * stride) * nb + b) * dx;
      a[k][b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q8_lanes(xa, xq, w)), a[k][b & 1]);
    }
  }
  for (int k = 0; k < R; k++) {
    const float s = hsum8(_mm256_add_ps(a[k][0], a[k][1]));
    y[r + k * stride] = acc ? y[r + k * stride] + s : s;
  }
}

namespace {

// One row r against N inputs (the weight loads shared): q8_block_avx2<1>'s operations per input.
template <int N>
MOETRON_AVX2 void q8_multi_avx2(float* out, int ld_out, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int r,
                                int IC, bool acc) {
  const int nb = IC / kQ8Block;
  __m256 a[N][2];
  for (int j = 0; j < N; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const size_t i = (size_t)r * IC + (size_t)b * kQ8Block;
    _mm_prefetch(reinterpret_cast<const char*>(W + i + kQ8PrefetchAvx2), _MM_HINT_T0);
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + i));
    const float dw = f16_at_avx2(S, (size_t)r * nb + b);
    for (int j = 0; j < N; j++) {
      const size_t at = (size_t)j * IC + (size_t)b * kQ8Block;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at));
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a + at));
      const float d = dw * x.d[(size_t)j * nb + b];
      a[j][b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q8_lanes(xa, xq, w)), a[j][b & 1]);
    }
  }
  for (int j = 0; j < N; j++) {
    const float s = hsum8(_mm256_add_ps(a[j][0], a[j][1]));
    float& o = out[(size_t)j * ld_out + r];
    o = acc ? o + s : s;
  }
}

}  // namespace

Q8MultiFn q8_multi_fn_avx2(int n) {
  static constexpr Q8MultiFn t[kMaxGemvInputs] = {q8_multi_avx2<1>, q8_multi_avx2<2>, q8_multi_avx2<3>,
                                                  q8_multi_avx2<4>, q8_multi_avx2<5>, q8_multi_avx2<6>,
                                                  q8_multi_avx2<7>, q8_multi_avx2<8>};
  return t[n - 1];
}

template Q8BlockKernel q8_block_avx2<1>;
template Q8BlockKernel q8_block_avx2<2>;

}  // namespace moetron::kernels
