// Weights used where they lie (inference over a checkpoint): a matrix in its stored dtype anywhere in
// host memory -- a mapped safetensors file, a Q8_0 copy made at load, an fp32 buffer -- and the
// source a backend resolves a weight tensor's elements through, since a checkpoint keeps a stacked
// parameter in pieces (each expert's gate, up and down rows are tensors of their own).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "core/error.h"

namespace moetron {

// A row-major matrix (or vector) in F32, BF16 or F16 (unaligned is fine) -- or Q8_0: int8 values at
// `data` (dtype U8, one byte a value) and one f16 scale per kQ8_0Block values at `scales`.
struct WeightRef {
  const void* data = nullptr;
  DType dtype = DType::F32;
  const uint16_t* scales = nullptr;  // Q8_0 only
  bool q8() const { return scales != nullptr; }
  // The same storage advanced by `elements` values (for Q8_0 a multiple of kQ8_0Block).
  WeightRef at(size_t elements) const {
    return {static_cast<const uint8_t*>(data) + elements * dtype_size(dtype), dtype,
            scales ? scales + elements / kQ8_0Block : nullptr};
  }
};

// Where one parameter tensor's values lie, in the parameter table's element order.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // The stored piece holding element `offset` (a stacked tensor's pieces are the checkpoint's tensors:
  // an expert's gate rows, its up rows, ...): its storage from that element, and the values from
  // there to the piece's end -- a product over rows crossing a piece's end runs as one per piece.
  struct Piece {
    WeightRef ref;
    size_t count = 0;
  };
  virtual Piece piece(size_t offset) const = 0;
  // `count` values from element `offset`, which must lie in one piece.
  WeightRef at(size_t offset, size_t count) const {
    const Piece p = piece(offset);
    MOETRON_ASSERT(count <= p.count);
    return p.ref;
  }
  // out[n, C] (fp32) = rows idx[n] of the tensor read as a [rows, C] table (an embedding lookup).
  virtual void rows(float* out, const int32_t* idx, long n, int C) const = 0;
};

}  // namespace moetron
