// Row softmax; see softmax.h.
#include "ops/softmax.h"

namespace moetron::ops {

void softmax_inplace(float* s, int n) { softmax_rows(s, 1, n, (size_t)n); }  // one row: the rows' steps

void softmax_rows(float* s, int rows, int n, size_t ld) {
  constexpr int kG = 4;  // rows whose in-order chains (max, double sum) run side by side
  for (int r0 = 0; r0 < rows; r0 += kG) {
    const int g = rows - r0 < kG ? rows - r0 : kG;
    float* row[kG];
    float mx[kG];
    double sum[kG];
    for (int r = 0; r < g; r++) {
      row[r] = s + (size_t)(r0 + r) * ld;
      mx[r] = row[r][0];
      sum[r] = 0.0;
    }
    if (g == kG) {  // the common case, unrolled so the chains interleave
      for (int j = 1; j < n; j++)
        for (int r = 0; r < kG; r++) mx[r] = row[r][j] > mx[r] ? row[r][j] : mx[r];
    } else {
      for (int r = 0; r < g; r++)
        for (int j = 1; j < n; j++) mx[r] = row[r][j] > mx[r] ? row[r][j] : mx[r];
    }
    for (int r = 0; r < g; r++)
      for (int j = 0; j < n; j++) row[r][j] = exp_nonpositive(row[r][j] - mx[r]);
    if (g == kG) {
      for (int j = 0; j < n; j++)
        for (int r = 0; r < kG; r++) sum[r] += row[r][j];
    } else {
      for (int r = 0; r < g; r++)
        for (int j = 0; j < n; j++) sum[r] += row[r][j];
    }
    for (int r = 0; r < g; r++) {
      const float inv = (float)(1.0 / sum[r]);
      for (int j = 0; j < n; j++) row[r][j] *= inv;
    }
  }
}

}  // namespace moetron::ops
