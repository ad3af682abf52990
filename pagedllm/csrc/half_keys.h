// bf16 and fp16 values as 16-bit integer keys that order as the values do, for argmaxes that compare
// half-precision rows without widening them to fp32 (layers/csrc: argmax_rows, blocked_linear_argmax).
// A key is the value's magnitude bits, negated for a negative value (two's complement of sign-magnitude):
// +0 and -0 get the same key, as they compare equal, and NaNs lie beyond the keys of the infinities, whose
// magnitude bits are 0x7F80 in bf16 and 0x7C00 in fp16.
#pragma once

#include <cstdint>

#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

inline int16_t half_order_key(uint16_t bits) {
  const int16_t magnitude = static_cast<int16_t>(bits & 0x7FFF);
  return (bits & 0x8000) ? static_cast<int16_t>(-magnitude) : magnitude;
}

#if defined(__AVX512BW__)
inline __m512i half_order_keys(__m512i bits) {
  const __m512i sign = _mm512_srai_epi16(bits, 15);  // 0 or all ones
  return _mm512_sub_epi16(_mm512_xor_si512(_mm512_and_si512(bits, _mm512_set1_epi16(0x7FFF)), sign), sign);
}
#endif

#if defined(__AVX2__)
inline __m256i half_order_keys(__m256i bits) {
  const __m256i sign = _mm256_srai_epi16(bits, 15);
  return _mm256_sub_epi16(_mm256_xor_si256(_mm256_and_si256(bits, _mm256_set1_epi16(0x7FFF)), sign), sign);
}
#endif
