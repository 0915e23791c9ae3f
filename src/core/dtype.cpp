#include "core/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace moetron {

DType dtype_from_string(std::string_view name) {
  if (name == "F32") return DType::F32;
  if (name == "F16") return DType::F16;
  if (name == "BF16") return DType::BF16;
  if (name == "I32") return DType::I32;
  if (name == "I64") return DType::I64;
  if (name == "U8") return DType::U8;
  if (name == "BOOL") return DType::BOOL;
  fail("unsupported dtype '{}' (expected one of F32, F16, BF16, I32, I64, U8, BOOL)", name);
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  fail("dtype_name: invalid DType value {}", static_cast<int>(dtype));
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
    case DType::BOOL: return 1;
  }
  fail("dtype_size: invalid DType value {}", static_cast<int>(dtype));
}

bool dtype_is_float(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return f32_from_bits(sign | ((exp - 15 + 127) << 23) | (mant << 13));
  if (mant == 0) return f32_from_bits(sign);  // +-0
  // Subnormal: mant * 2^-24. Normalise so the leading one becomes the implicit bit.
  int e = -14;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  mant &= 0x3ffu;
  return f32_from_bits(sign | (static_cast<uint32_t>(e + 127) << 23) | (mant << 13));
}

uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf / NaN
    if (a == 0x7f800000u) return sign | 0x7c00u;
    return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  const int e = static_cast<int>(a >> 23) - 127;  // unbiased exponent
  if (e > 15) return sign | 0x7c00u;               // beyond the half range
  if (e >= -14) {                                  // normal half (rounding may carry up to inf)
    const uint32_t m = a & 0x7fffffu;
    uint32_t h = (static_cast<uint32_t>(e + 15) << 10) | (m >> 13);
    const uint32_t rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  // Subnormal half: value = M * 2^(e-23) with M the 24-bit significand; result r = value / 2^-24.
  const int shift = -e - 1;  // >= 14
  if (shift > 24) return sign;  // below half the smallest subnormal (float subnormals land here)
  const uint32_t M = (a & 0x7fffffu) | 0x800000u;
  uint32_t r = M >> shift;
  const uint32_t rem = M & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;  // may become 0x400, the smallest normal
  return static_cast<uint16_t>(sign | r);
}

namespace {

template <typename T>
void ints_to_f32(float* out, const uint8_t* src, size_t n) {
#pragma omp parallel for schedule(static) if (n > (1u << 16))
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    out[i] = static_cast<float>(v);
  }
}

}  // namespace

void convert_to_f32(float* out, const void* src_void, DType dtype, size_t n) {
  const auto* src = static_cast<const uint8_t*>(src_void);
  switch (dtype) {
    case DType::F32:
      if (n > 0) std::memcpy(out, src, n * sizeof(float));
      return;
    case DType::BF16:
#pragma omp parallel for schedule(static) if (n > (1u << 16))
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      return;
    case DType::F16:
#pragma omp parallel for schedule(static) if (n > (1u << 16))
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = f16_to_f32(h);
      }
      return;
    case DType::I32: ints_to_f32<int32_t>(out, src, n); return;
    case DType::I64: ints_to_f32<int64_t>(out, src, n); return;
    case DType::U8: ints_to_f32<uint8_t>(out, src, n); return;
    case DType::BOOL:
      for (size_t i = 0; i < n; ++i) out[i] = src[i] != 0 ? 1.0f : 0.0f;
      return;
  }
  fail("convert_to_f32: invalid DType value {}", static_cast<int>(dtype));
}

void convert_from_f32(void* out_void, DType dtype, const float* src, size_t n) {
  auto* out = static_cast<uint8_t*>(out_void);
  switch (dtype) {
    case DType::F32:
      if (n > 0) std::memcpy(out, src, n * sizeof(float));
      return;
    case DType::BF16:
#pragma omp parallel for schedule(static) if (n > (1u << 16))
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(src[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case DType::F16:
#pragma omp parallel for schedule(static) if (n > (1u << 16))
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_f16(src[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    default:
      fail("convert_from_f32: cannot store fp32 values as {} (expected F32, F16 or BF16)",
           dtype_name(dtype));
  }
}

size_t first_non_finite(const float* p, size_t n) {
  // Exponent bits all ones: NaN or infinity.  A bit test, so it vectorises and -ffast-math cannot
  // fold it away.
  auto bad = [](float v) { return (f32_bits(v) & 0x7f800000u) == 0x7f800000u; };
  if (n <= (1u << 16)) {
    for (size_t i = 0; i < n; ++i)
      if (bad(p[i])) return i;
    return n;
  }
  size_t first = n;
#pragma omp parallel for schedule(static) reduction(min : first)
  for (size_t i = 0; i < n; ++i)
    if (bad(p[i]) && i < first) first = i;
  return first;
}

size_t first_unrepresentable(const float* p, size_t n, DType to) {
  // Magnitude bits from which round-to-nearest-even gives infinity, below the infinity itself.
  uint32_t from = 0;
  switch (to) {
    case DType::F16: from = f32_bits(65520.0f); break;  // halfway between 65504 and 2^16
    case DType::BF16: from = 0x7f7f8000u; break;        // halfway above bf16's largest, 0x7f7f
    default: return n;                                  // F32 and the integer types: nothing to lose
  }
  for (size_t i = 0; i < n; ++i) {
    const uint32_t m = f32_bits(p[i]) & 0x7fffffffu;
    if (m >= from && m < 0x7f800000u) return i;
  }
  return n;
}

void check_representable(const float* p, size_t n, DType to, const std::string& what, size_t offset) {
  const size_t i = first_unrepresentable(p, n, to);
  if (i == n) return;
  const double largest = to == DType::F16 ? 65504.0 : (double)bf16_to_f32(0x7f7f);
  fail("{}: element {} is {}, beyond {}'s range (largest {:g}): it would be written as Inf (keep a wider dtype)",
       what, i + offset, p[i], dtype_name(to), largest);
}

void quantize_q8_0_block(const float* x, int8_t* q, float& d) {
  float amax = 0;
  bool finite = true;
  for (int i = 0; i < kQ8_0Block; i++) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  if (!finite) {
    d = std::numeric_limits<float>::quiet_NaN();
    std::memset(q, 0, kQ8_0Block);
    return;
  }
  d = amax / 127.0f;
  const float id = d != 0 ? 1.0f / d : 0.0f;
  for (int i = 0; i < kQ8_0Block; i++) {
    // roundf (half away from zero) without the library call: |v| <= 127 (+ rounding), so the integer
    // part converts exactly and v - part is exact.
    const float v = x[i] * id;
    int r = (int)v;
    const float frac = v - (float)r;
    r += frac >= 0.5f ? 1 : frac <= -0.5f ? -1 : 0;
    q[i] = (int8_t)r;
  }
}

}  // namespace moetron
