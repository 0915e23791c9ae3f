// The strided block copy; see copy_block.h.
#include "ops/copy_block.h"

#include "core/error.h"

namespace moetron::ops {

void check_block_copy(const char* op, const BlockCopy& g, long dst_numel, long src_numel) {
  MOETRON_OP_CHECK(g.A >= 0 && g.B >= 1 && g.Cn >= 0 && g.dst_a >= 0 && g.dst_b >= 0 && g.dst_off >= 0 &&
                       g.src_a >= 0 && g.src_b >= 0 && g.src_off >= 0,
                   op, "bad block geometry A={} B={} Cn={}", g.A, g.B, g.Cn);
  MOETRON_OP_CHECK(g.dst_extent() <= dst_numel && g.src_extent() <= src_numel, op,
                   "block reaches element {} of dst ({}) / {} of src ({})", g.dst_extent(), dst_numel,
                   g.src_extent(), src_numel);
}

void copy_block(float* dst, const float* src, const BlockCopy& g, float alpha, bool accumulate) {
  // Parallel over a only: with accumulate and dst_b 0, the b terms of one destination add in order.
#pragma omp parallel for schedule(static) if (g.A * g.B * (long)g.Cn >= (1 << 15))
  for (long a = 0; a < g.A; a++)
    for (int b = 0; b < g.B; b++) {
      float* d = dst + a * g.dst_a + b * g.dst_b + g.dst_off;
      const float* s = src + a * g.src_a + b * g.src_b + g.src_off;
      if (accumulate)
        for (int c = 0; c < g.Cn; c++) d[c] += alpha * s[c];
      else
        for (int c = 0; c < g.Cn; c++) d[c] = alpha * s[c];
    }
}

}  // namespace moetron::ops
