// The maximum of a row of float, bf16 or fp16 values, NaNs skipped, in one vectorised pass: argmax_rows
// (layers/csrc/cpu_layers.cpp) and the sampler's passes (layers/csrc/sampler_ops.cpp). The pass is
// written in intrinsics where the CPU has AVX-512 or AVX2: GCC leaves an `omp simd` loop that takes a max
// and notes NaNs scalar in some functions (a chain of dependent scalar maxes), and widens bf16 one
// element at a time.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace pagedllm {

inline float widen(float x) { return x; }
inline float widen(double x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {  // bf16 is the top half of an fp32
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The maximum of x[0, n) (NaNs skipped); sets has_nan if an element may be a NaN (a NaN or an
// infinity: the caller's scan for the first NaN then finds none).
template <typename T>
inline float chunk_max_scalar(const T* x, int64_t n, bool& has_nan) {
  float m = -std::numeric_limits<float>::infinity();
  float poison = 0.f;  // NaN iff x holds a NaN or an infinity
#pragma omp simd reduction(max : m) reduction(+ : poison)
  for (int64_t i = 0; i < n; ++i) {
    const float v = widen(x[i]);
    m = std::max(m, v);
    poison += v * 0.f;
  }
  if (poison != poison) has_nan = true;
  return m;
}

// The vector ops of the max pass, for the widest ISA the build has. max(a, m): a NaN in a yields m, so
// NaNs are skipped; nan(acc, a) notes whether a holds one.
#if defined(__AVX512F__)
struct MaxVec {
  using V = __m512;
  using NanAcc = __mmask16;
  static constexpr int kLanes = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V fill(float v) { return _mm512_set1_ps(v); }
  static V max(V a, V m) { return _mm512_max_ps(a, m); }
  static NanAcc no_nan() { return 0; }
  static NanAcc nan(NanAcc acc, V a) { return acc | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static bool any(NanAcc acc) { return acc != 0; }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
};
#elif defined(__AVX2__)
struct MaxVec {
  using V = __m256;
  using NanAcc = __m256;
  static constexpr int kLanes = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V fill(float v) { return _mm256_set1_ps(v); }
  static V max(V a, V m) { return _mm256_max_ps(a, m); }
  static NanAcc no_nan() { return _mm256_setzero_ps(); }
  static NanAcc nan(NanAcc acc, V a) { return _mm256_or_ps(acc, _mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
  static bool any(NanAcc acc) { return _mm256_movemask_ps(acc) != 0; }
  static float reduce_max(V v) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    return *std::max_element(lanes, lanes + 8);
  }
};
#endif

template <typename T>
inline float chunk_max(const T* x, int64_t n, bool& has_nan) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    using M = MaxVec;
    constexpr int64_t kStep = 2 * M::kLanes;  // two accumulators
    const int64_t body = n - n % kStep;
    typename M::V m0 = M::fill(-std::numeric_limits<float>::infinity()), m1 = m0;
    typename M::NanAcc nan = M::no_nan();
    for (int64_t i = 0; i < body; i += kStep) {
      const typename M::V a = M::load(x + i), b = M::load(x + i + M::kLanes);
      nan = M::nan(M::nan(nan, a), b);
      m0 = M::max(a, m0);
      m1 = M::max(b, m1);
    }
    if (M::any(nan)) has_nan = true;
    return std::max(M::reduce_max(M::max(m0, m1)), chunk_max_scalar(x + body, n - body, has_nan));
  }
#endif
  return chunk_max_scalar(x, n, has_nan);
}

}  // namespace pagedllm
