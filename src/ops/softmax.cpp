// Row softmax; see softmax.h.
#include "ops/softmax.h"

#include <cmath>

namespace moetron::ops {

void softmax_inplace(float* s, int n) {
  float mx = s[0];
  for (int j = 1; j < n; j++) mx = std::fmax(mx, s[j]);
  double sum = 0.0;
  for (int j = 0; j < n; j++) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  const float inv = (float)(1.0 / sum);
  for (int j = 0; j < n; j++) s[j] *= inv;
}

}  // namespace moetron::ops
