// Element types of tensors on disk and in memory, and conversions between them.
//
// Names follow safetensors ("F32", "F16", "BF16", "I32", "I64", "U8", "BOOL"). Conversions to a
// narrower float type round to nearest, ties to even (as PyTorch and CUDA do); NaN stays NaN (the
// sign and the high payload bits are kept and the quiet bit is set), infinities stay infinite, and
// values beyond the target's range become infinity. fp16 covers IEEE binary16 in full, subnormals
// included. The host is assumed little-endian (as safetensors data is).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace moetron {

enum class DType { F32, F16, BF16, I32, I64, U8, BOOL };

// "BF16" -> DType::BF16; anything else not in the list above throws Error naming the string.
DType dtype_from_string(std::string_view name);
// DType::BF16 -> "BF16" (the safetensors name).
const char* dtype_name(DType dtype);
// Bytes per element.
size_t dtype_size(DType dtype);
// True for F32, F16 and BF16.
bool dtype_is_float(DType dtype);

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// bf16 is the top half of an fp32: widening is exact.
inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; overflow carries into infinity
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Q8_0 (llama.cpp's 8-bit format): blocks of kQ8_0Block values, each w ~ d * q with d = max|w| / 127
// and q = roundf(w * (1 / d)) in [-127, 127] (llama.cpp's rule: the reciprocal, then roundf).  One
// block here; a non-finite value makes d NaN and every q 0.  d is returned in fp32: llama.cpp stores
// it as f16 (refuse d > 65504, which f16 cannot hold).
constexpr int kQ8_0Block = 32;
void quantize_q8_0_block(const float* x, int8_t* q, float& d);

// out[i] = src[i] as fp32 for n elements of `dtype` (any DType; integers convert by value, BOOL to
// 0/1). `src` need not be aligned.
void convert_to_f32(float* out, const void* src, DType dtype, size_t n);
// Writes n elements of `dtype` (F32, F16 or BF16; other dtypes throw Error) from fp32 values.
// `out` need not be aligned.
void convert_from_f32(void* out, DType dtype, const float* src, size_t n);

// The index of the first NaN or infinity among p[0, n), or n when every value is finite. One pass
// (parallel for large n): cheap beside the conversion that produced the values.
size_t first_non_finite(const float* p, size_t n);

// The index of the first FINITE value among p[0, n) that `to` cannot hold -- convert_from_f32 would
// round it to infinity (f16: |v| >= 65520; bf16: beyond 3.3961e38) -- or n when there is none.
// Writers call it before converting: a finite weight must never be written as Inf.
size_t first_unrepresentable(const float* p, size_t n, DType to);
// Throws Error when first_unrepresentable finds a value: "<what>: element <i + offset> is <v>, beyond
// F16's range (largest 65504): it would be written as Inf".  `what` names the tensor (and file).
void check_representable(const float* p, size_t n, DType to, const std::string& what, size_t offset = 0);

}  // namespace moetron
