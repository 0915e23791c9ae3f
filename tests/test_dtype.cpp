// Tests for core/dtype: names and sizes, exhaustive bf16/fp16 round trips, round-to-nearest-even
// against independent references, NaN/inf handling, and the bulk converters.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

using namespace moetron;

namespace {

// Independent decoder for binary16: the value written as a formula, in double.
double f16_value_reference(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0x1f) v = mant == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  else if (exp == 0) v = std::ldexp(mant, -24);
  else v = std::ldexp(1024 + mant, exp - 25);
  return sign ? -v : v;
}

// Magnitude of a non-negative pattern, treating the infinity pattern as the next step beyond the
// largest finite value (IEEE rounds as if the exponent range were unbounded).
double f16_magnitude_for_rounding(uint16_t p) {
  return p == 0x7c00 ? 65536.0 : f16_value_reference(p);
}
double bf16_magnitude_for_rounding(uint16_t p) {
  return p == 0x7f80 ? std::ldexp(1.0, 128) : static_cast<double>(bf16_to_f32(p));
}

// Nearest representable pattern for a finite float, ties to the even pattern, found by comparing
// exact distances in double with the two neighbours from a binary search over the positive
// patterns [0, max_pattern] (monotonic in value).
template <typename Magnitude>
uint16_t round_reference(float f, uint16_t max_pattern, Magnitude mag) {
  const double a = std::fabs(static_cast<double>(f));
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (a >= mag(max_pattern)) return sign | max_pattern;
  uint32_t lo = 0, hi = max_pattern;  // invariant: mag(lo) <= a < mag(hi)
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (mag(static_cast<uint16_t>(mid)) <= a) lo = mid; else hi = mid;
  }
  const double dlo = a - mag(static_cast<uint16_t>(lo));
  const double dhi = mag(static_cast<uint16_t>(hi)) - a;
  uint32_t pick;
  if (dlo < dhi) pick = lo;
  else if (dhi < dlo) pick = hi;
  else pick = (lo % 2 == 0) ? lo : hi;
  return static_cast<uint16_t>(sign | pick);
}

std::vector<float> interesting_floats() {
  std::vector<float> v;
  std::mt19937 rng(1234);
  for (int i = 0; i < 400000; ++i) {  // random bit patterns: every exponent, sign and mantissa
    uint32_t u = rng();
    v.push_back(f32_from_bits(u));
  }
  std::uniform_real_distribution<float> u01(-70000.0f, 70000.0f);
  for (int i = 0; i < 200000; ++i) v.push_back(u01(rng));  // the fp16 range, densely
  for (int e = -30; e <= 17; ++e) {                         // near-tie patterns at many exponents
    for (uint32_t low : {0x0fffu, 0x1000u, 0x1001u, 0x7fffu, 0x8000u, 0x8001u, 0x17fffu,
                         0x18000u, 0x18001u}) {
      const uint32_t base = f32_bits(std::ldexp(1.0f, e)) & 0xff800000u;
      v.push_back(f32_from_bits(base | low));
      v.push_back(f32_from_bits(base | 0x00400000u | low));
      v.push_back(-f32_from_bits(base | low));
    }
  }
  for (float x : {0.0f, -0.0f, 65504.0f, 65519.0f, 65520.0f, 65536.0f, 5.9604645e-8f,
                  2.9802322e-8f, 1e-45f, std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min()})
    v.push_back(x);
  return v;
}

}  // namespace

TEST(DType, NamesAndSizes) {
  const std::vector<std::pair<DType, size_t>> all = {
      {DType::F32, 4}, {DType::F16, 2}, {DType::BF16, 2}, {DType::I32, 4},
      {DType::I64, 8}, {DType::U8, 1},  {DType::BOOL, 1}};
  for (const auto& [dt, size] : all) {
    EXPECT_EQ(dtype_from_string(dtype_name(dt)), dt);
    EXPECT_EQ(dtype_size(dt), size);
  }
  EXPECT_STREQ(dtype_name(DType::BF16), "BF16");
  EXPECT_TRUE(dtype_is_float(DType::F16));
  EXPECT_FALSE(dtype_is_float(DType::I32));
}

TEST(DType, UnknownNameIsAnErrorNamingIt) {
  for (const char* bad : {"F64", "bf16", "", "FLOAT"}) {
    try {
      dtype_from_string(bad);
      FAIL() << "no error for '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos)
          << e.what();
    }
  }
}

TEST(DType, Bf16RoundTripAllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = bf16_to_f32(h);
    EXPECT_EQ(f32_bits(f), b << 16);  // widening is exact: the bits move up
    const uint16_t back = f32_to_bf16(f);
    if (std::isnan(f)) {
      // NaN stays NaN with its sign and payload; only the quiet bit may be added.
      EXPECT_EQ(back, h | 0x0040u) << "pattern " << b;
    } else {
      EXPECT_EQ(back, h) << "pattern " << b;
    }
  }
}

TEST(DType, Fp16RoundTripAllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = f16_to_f32(h);
    const double ref = f16_value_reference(h);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << "pattern " << b;
      EXPECT_EQ(std::signbit(f), (b & 0x8000u) != 0);
      EXPECT_EQ(f32_to_f16(f), h | 0x0200u) << "pattern " << b;  // quiet bit added, payload kept
    } else {
      EXPECT_EQ(static_cast<double>(f), ref) << "pattern " << b;
      EXPECT_EQ(std::signbit(f), (b & 0x8000u) != 0);
      EXPECT_EQ(f32_to_f16(f), h) << "pattern " << b;
    }
  }
}

TEST(DType, Bf16RoundingMatchesNearestEvenReference) {
  for (float f : interesting_floats()) {
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      continue;
    }
    if (std::isinf(f)) continue;
    ASSERT_EQ(f32_to_bf16(f), round_reference(f, 0x7f80, bf16_magnitude_for_rounding))
        << "float bits 0x" << std::hex << f32_bits(f);
  }
}

TEST(DType, Fp16RoundingMatchesNearestEvenReference) {
  for (float f : interesting_floats()) {
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    if (std::isinf(f)) continue;
    ASSERT_EQ(f32_to_f16(f), round_reference(f, 0x7c00, f16_magnitude_for_rounding))
        << "float bits 0x" << std::hex << f32_bits(f);
#if defined(__FLT16_MAX__)
    // The compiler's own conversion (IEEE, round to nearest even) as a second reference.
    const _Float16 c = static_cast<_Float16>(f);
    uint16_t cbits;
    std::memcpy(&cbits, &c, 2);
    ASSERT_EQ(f32_to_f16(f), cbits) << "float bits 0x" << std::hex << f32_bits(f);
#endif
  }
}

TEST(DType, RoundToNearestEvenTies) {
  // bf16 keeps 7 mantissa bits: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3F808000u)), 0x3F80u);  // tie -> even (down)
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3F818000u)), 0x3F82u);  // tie -> even (up)
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3F808001u)), 0x3F81u);  // above the tie -> up
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3F807FFFu)), 0x3F80u);  // below the tie -> down
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0xBF818000u)), 0xBF82u);  // negative tie
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x7F7FFFFFu)), 0x7F80u);  // FLT_MAX rounds to inf
  // fp16 keeps 10 mantissa bits: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3C00u);
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02u);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7BFFu);  // below the overflow tie: largest finite
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00u);  // the tie rounds to even = infinity
  EXPECT_EQ(f32_to_f16(-65520.0f), 0xFC00u);
  // Subnormal ties: 2^-25 is halfway between 0 and the smallest subnormal 2^-24.
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000u);
  EXPECT_EQ(f32_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001u);
  EXPECT_EQ(f32_to_f16(3 * std::ldexp(1.0f, -25)), 0x0002u);  // 1.5 * 2^-24 -> even 2
  EXPECT_EQ(f32_to_f16(5 * std::ldexp(1.0f, -25)), 0x0002u);  // 2.5 * 2^-24 -> even 2
  // Largest subnormal + half a step rounds up into the smallest normal.
  EXPECT_EQ(f32_to_f16(std::ldexp(1023.5f, -24)), 0x0400u);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000u);
}

TEST(DType, NanAndInfinity) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(f32_to_bf16(inf), 0x7F80u);
  EXPECT_EQ(f32_to_bf16(-inf), 0xFF80u);
  EXPECT_EQ(f32_to_f16(inf), 0x7C00u);
  EXPECT_EQ(f32_to_f16(-inf), 0xFC00u);
  EXPECT_TRUE(std::isinf(bf16_to_f32(0x7F80u)));
  EXPECT_TRUE(std::isinf(f16_to_f32(0xFC00u)));
  // A NaN whose payload lives only in the low bits must not truncate to infinity.
  const float low_nan = f32_from_bits(0x7F800001u);
  ASSERT_TRUE(std::isnan(low_nan));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(low_nan))));
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(low_nan))));
  const float neg_nan = f32_from_bits(0xFFC00000u);
  EXPECT_EQ(f32_to_bf16(neg_nan), 0xFFC0u);
  EXPECT_EQ(f32_to_f16(neg_nan), 0xFE00u);
}

TEST(DType, BulkConvertersMatchScalarsUnaligned) {
  // n above the OpenMP threshold so the parallel path runs; offset 1 byte so nothing is aligned.
  const size_t n = (1u << 16) + 37;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 100.0f);
  std::vector<float> src(n);
  for (float& x : src) x = dist(rng);
  for (DType dt : {DType::F32, DType::F16, DType::BF16}) {
    std::vector<uint8_t> buf(n * dtype_size(dt) + 1);
    convert_from_f32(buf.data() + 1, dt, src.data(), n);
    std::vector<float> back(n);
    convert_to_f32(back.data(), buf.data() + 1, dt, n);
    for (size_t i = 0; i < n; ++i) {
      float expect = src[i];
      if (dt == DType::F16) expect = f16_to_f32(f32_to_f16(src[i]));
      if (dt == DType::BF16) expect = bf16_to_f32(f32_to_bf16(src[i]));
      ASSERT_EQ(f32_bits(back[i]), f32_bits(expect)) << dtype_name(dt) << " element " << i;
    }
  }
}

TEST(DType, IntegersConvertToF32ByValue) {
  const int32_t i32[3] = {-5, 0, 1 << 20};
  const int64_t i64[3] = {-7, 3, int64_t{1} << 40};
  const uint8_t u8[3] = {0, 7, 255};
  const uint8_t b[3] = {0, 1, 2};
  float out[3];
  convert_to_f32(out, i32, DType::I32, 3);
  EXPECT_EQ(out[0], -5.0f); EXPECT_EQ(out[2], 1048576.0f);
  convert_to_f32(out, i64, DType::I64, 3);
  EXPECT_EQ(out[0], -7.0f); EXPECT_EQ(out[2], std::ldexp(1.0f, 40));
  convert_to_f32(out, u8, DType::U8, 3);
  EXPECT_EQ(out[2], 255.0f);
  convert_to_f32(out, b, DType::BOOL, 3);
  EXPECT_EQ(out[0], 0.0f); EXPECT_EQ(out[1], 1.0f); EXPECT_EQ(out[2], 1.0f);
}

TEST(DType, ConvertFromF32ToIntegerIsAnError) {
  float src[1] = {1.0f};
  int32_t out[1];
  EXPECT_THROW(convert_from_f32(out, DType::I32, src, 1), Error);
}

// first_unrepresentable finds exactly the finite values the conversion turns into infinity: checked
// against f32_to_f16 / f32_to_bf16 themselves around each boundary (65504 | 65520 for f16; bf16's
// largest 0x7f7f and the halfway point above it), with NaN and infinities passed over (not finite).
TEST(DType, FirstUnrepresentableIsWhereConversionOverflows) {
  const float below_f16 = std::nextafter(65520.0f, 0.0f), bf16_max = bf16_to_f32(0x7f7f);
  const float bf16_half = f32_from_bits(0x7f7f8000u), below_half = f32_from_bits(0x7f7f7fffu);
  const std::vector<float> values = {0.0f,       65504.0f,  -65504.0f, below_f16, 65520.0f,  -65520.0f, 1e10f,
                                     bf16_max,   below_half, bf16_half, -bf16_half, FLT_MAX,  NAN,       INFINITY};
  for (DType to : {DType::F16, DType::BF16}) {
    for (size_t i = 0; i < values.size(); i++) {
      const float v = values[i];
      const uint16_t h = to == DType::F16 ? f32_to_f16(v) : f32_to_bf16(v);
      const bool inf = to == DType::F16 ? (h & 0x7fffu) == 0x7c00u : (h & 0x7fffu) == 0x7f80u;
      EXPECT_EQ(first_unrepresentable(&values[i], 1, to), std::isfinite(v) && inf ? 0u : 1u)
          << dtype_name(to) << " " << v;
    }
  }
  EXPECT_EQ(first_unrepresentable(values.data(), values.size(), DType::F16), 4u);
  EXPECT_EQ(first_unrepresentable(values.data(), values.size(), DType::BF16), 9u);
  EXPECT_EQ(first_unrepresentable(values.data(), values.size(), DType::F32), values.size());
  try {
    check_representable(values.data(), values.size(), DType::F16, "tensor 'w'", 100);
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'w': element 104 is 65520, beyond F16's range (largest 65504)"),
              std::string::npos)
        << e.what();
  }
}
