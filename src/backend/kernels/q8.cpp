// The Q8_0 products (q8_impl.h): a product's inputs quantized once, and the portable kernel.
#include <cmath>
#include <cstdlib>

#include "backend/kernels/q8_impl.h"

namespace moetron::kernels {

// The n inputs x + j * ld_x in Q8_0 into buf (q8_input_bytes(n, IC)).
void q8_quantize_inputs(const float* x, int ld_x, int n, int IC, uint8_t* buf) {
  const int nb = IC / kQ8Block;
  const Q8Inputs v = q8_view(buf, n, IC);
  int8_t* q = const_cast<int8_t*>(v.q);
  uint8_t* a = const_cast<uint8_t*>(v.a);
  float* d = const_cast<float*>(v.d);
  int32_t* neg_off = const_cast<int32_t*>(v.neg_off);
  for (int j = 0; j < n; j++)
    for (int b = 0; b < nb; b++) {
      const size_t at = (size_t)j * IC + (size_t)b * kQ8Block;
      quantize_q8_0_block(x + (size_t)j * ld_x + (size_t)b * kQ8Block, q + at, d[(size_t)j * nb + b]);
      for (int i = 0; i < kQ8Block; i++) a[at + i] = (uint8_t)std::abs((int)q[at + i]);
      for (int k = 0; k < kQ8Block / 4; k++)
        neg_off[at / 4 + k] =
            -128 * ((int32_t)q[at + 4 * k] + q[at + 4 * k + 1] + q[at + 4 * k + 2] + q[at + 4 * k + 3]);
    }
}

namespace {

// Row r of W against input j of x (see the section comment).
float q8_dot_generic(const int8_t* W, const uint16_t* S, const Q8Inputs& x, int j, int r, int IC) {
  const int nb = IC / kQ8Block;
  const int8_t* w = W + (size_t)r * IC;
  const int8_t* q = x.q + (size_t)j * IC;
  float a[2][8] = {};  // E, O
  for (int b = 0; b < nb; b++) {
    const float d = f16_at(S, (size_t)r * nb + b) * x.d[(size_t)j * nb + b];
    for (int k = 0; k < 8; k++) {
      int32_t s = 0;
      for (int t = 0; t < 4; t++) {
        const int i = b * kQ8Block + 4 * k + t;
        s += (int32_t)w[i] * (int32_t)q[i];
      }
      a[b & 1][k] = std::fma(d, (float)s, a[b & 1][k]);
    }
  }
  float t[8];
  for (int k = 0; k < 8; k++) t[k] = a[0][k] + a[1][k];
  return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

}  // namespace

void q8_rows_generic(float* out, int ld_out, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int n, int r0,
                     int r1, int IC, bool acc) {
  for (int r = r0; r < r1; r++)
    for (int j = 0; j < n; j++) {
      const float s = q8_dot_generic(W, S, x, j, r, IC);
      float& o = out[(size_t)j * ld_out + r];
      o = acc ? o + s : s;
    }
}

}  // namespace moetron::kernels
