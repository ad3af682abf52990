// exp(x) in plain arithmetic, so that `omp simd` loops vectorise it (libm's expf is a call per element):
// 2^(x log2 e) = 2^n * 2^f with n an integer and |f| <= 1/2, 2^f by a degree-6 polynomial (relative error
// about 2e-7, an ulp or two of fp32). x log2 e is clamped to [-127, 127], and results below 2^-126 are 0:
// attention uses it for scores minus their running max (x <= 0), silu for both signs, where beyond that
// range the result is already 0 or x in every dtype.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedllm {

// Always inlined: a plain `inline` function with external linkage may be left as a call through the PLT
// in a shared object, and such a call inside an `omp simd` loop keeps the loop scalar.
inline __attribute__((always_inline)) float fast_exp(float x) {
  const float t = std::min(std::max(x * 1.44269504088896341f, -127.f), 127.f);
  const float n = (t + 12582912.f) - 12582912.f;  // round to nearest without a libm call
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return n < -126.f ? 0.f : result;
}

}  // namespace pagedllm
