// Row softmax; see softmax.h.
#include "ops/softmax.h"

namespace moetron::ops {

void softmax_inplace(float* s, int n) {
  float mx = s[0];
  for (int j = 1; j < n; j++) mx = s[j] > mx ? s[j] : mx;
  for (int j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - mx);
  double sum = 0.0;
  for (int j = 0; j < n; j++) sum += s[j];
  const float inv = (float)(1.0 / sum);
  for (int j = 0; j < n; j++) s[j] *= inv;
}

}  // namespace moetron::ops
