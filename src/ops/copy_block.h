// A strided block copy: the one data-movement op of latent attention (model/attention_block.h),
// which cuts, broadcasts and sums head slices of its projections.
//   For a < A, b < B, c < Cn:
//     dst[a*dst_a + b*dst_b + dst_off + c]  (= or +=)  alpha * src[a*src_a + b*src_b + src_off + c]
// A source stride src_b of 0 broadcasts one row over b; with accumulate, a destination stride dst_b
// of 0 sums over b (in b order: deterministic).  Without accumulate the destinations must be distinct.
// Its gradient is the same copy with src and dst (strides, offsets) exchanged, accumulated.
#pragma once

namespace moetron::ops {

struct BlockCopy {
  long A = 0;
  int B = 1, Cn = 0;
  long dst_a = 0, dst_b = 0, dst_off = 0;
  long src_a = 0, src_b = 0, src_off = 0;
  // The copy that carries a gradient back: src <- dst.
  BlockCopy transposed() const { return {A, B, Cn, src_a, src_b, src_off, dst_a, dst_b, dst_off}; }
  // The largest element index + 1 each side touches (0 for an empty copy): for bounds checks.
  long dst_extent() const { return A && B && Cn ? (A - 1) * dst_a + (B - 1) * dst_b + dst_off + Cn : 0; }
  long src_extent() const { return A && B && Cn ? (A - 1) * src_a + (B - 1) * src_b + src_off + Cn : 0; }
};

// Checks the geometry against the tensors' sizes (Error naming `op`).
void check_block_copy(const char* op, const BlockCopy& g, long dst_numel, long src_numel);

void copy_block(float* dst, const float* src, const BlockCopy& g, float alpha, bool accumulate);

}  // namespace moetron::ops
