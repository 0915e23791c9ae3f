// The index of the largest of a vocabulary's logits (greedy sampling).
#pragma once

#include "backend/kernels/simd.h"

namespace moetron::kernels {

// The index std::max_element gives for x[0, n), n >= 1: the first of the largest values (greedy
// sampling over a vocabulary; two vectorised passes unless x holds a NaN, where std::max_element's
// own comparisons decide).  argmax_at: with the kernels of `level` (at most simd_level()), for tests.
int argmax(const float* x, int n);
int argmax_at(SimdLevel level, const float* x, int n);

}  // namespace moetron::kernels
