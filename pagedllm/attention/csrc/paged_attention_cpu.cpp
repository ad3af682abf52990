// Paged FlashAttention for CPUs: exact attention computed one KV block at a time with the
// FlashAttention-2 online softmax (running max, denominator and unnormalised accumulator per query
// row), reading K/V in place from the paged cache through each sequence's block table.
//
// Layout (one layer): kv_cache [2, num_kv_heads, num_blocks, block_size, head_dim], so one block of
// one head is a contiguous [block_size, head_dim] tile. A step's queries are flat [num_tokens,
// num_heads, head_dim]; sequence i owns rows [query_start_loc[i], query_start_loc[i+1]) and its last
// row sits at position seq_lens[i] - 1 (bottom-right causal: chunked prefill over a cached prefix and
// speculative verification both need that alignment).
//
// One-byte caches (int8, fp8 e4m3 / e5m2; see pagedllm/kv_cache/quant.py) come as a strided codes view
// [2, num_kv_heads, num_blocks, block_size, head_dim] plus a bf16 scale per row [2, num_kv_heads,
// num_blocks, block_size]; a row is widened to fp32 and multiplied by its scale as its tile is loaded,
// so only the tiles attention reads are dequantized, once per KV head group.
//
// Work items are (sequence, kv head, query tile, kv split). All query heads of a KV head group are
// processed together, so each KV block is read (and converted to fp32) once per group. Sequences with
// one query tile (decode, verification) are split along the context every kSplitTokens tokens
// (flash-decoding), so one long sequence keeps every thread busy; partial results are merged exactly
// with their log-sum-exp. The split length is fixed, not derived from the batch or the thread count,
// so a sequence's output is the same whatever else is in the batch and however many threads run.
//
// A row's arithmetic does not depend on the item that holds it either (a decode step, a chunk of
// chunked prefill, a preempted request's recomputation): every path takes a row's keys in the same
// chunks (16 keys; 32 on the AMX tiles), a key the row must not see scores -inf (probability 0) and a
// chunk it sees none of changes nothing, and an item that crosses a split boundary folds each row's
// result there as the merge after split items does (fold_partial). Which path runs depends on the
// call's dtypes and shapes only.
//
// Vectorisation: with AVX-512 a 16-key chunk is one vector step for all of an item's rows (chunk_rows),
// reading fp32/bf16 tiles in place, with AVX512-BF16 bf16 scores from `_mm512_dpbf16_ps` on the stored
// pairs; one-byte caches are widened to fp32 tiles first. Without AVX-512 each row takes
// chunk_row_scalar (compiled with -O3 -march=native: AVX2 where the CPU has it). With AMX, items of a
// bf16 cache in 16-token blocks run on the matrix tiles instead: decode-like items (run_decode_item_amx)
// and prefill tiles (run_prefill_item_amx). Which path a build has: the paged_attention_isa op. Threads
// come from at::parallel_for, i.e. torch's own OpenMP pool and torch.set_num_threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "amx.h"
#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQueryTile = 16;     // query positions per work item (times the group's heads)
constexpr int64_t kSplitTokens = 512;  // context tokens per split of a decode-like sequence
constexpr int64_t kPrefetchBlocks = 4;      // blocks ahead asked into L2
constexpr int64_t kNearPrefetchBlocks = 2;  // blocks ahead asked into L1 by decode's fast path
constexpr int64_t kDecodePrefetchBlocks = 8;  // blocks ahead the AMX decode path asks into L2
constexpr int64_t kKeptPartialFloats = int64_t{4} << 20;  // 16 MiB of flash-decoding partials kept per thread
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Element -> fp32. bf16 is the top half of an fp32, so it widens with a shift the compiler vectorises.
inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}
// int8 codes widen with one vector conversion. fp8 codes widen exactly with integer shifts the compiler
// vectorises: the sign and the exponent+mantissa bits are moved into an fp32's fields, which reads the
// value times 2^(127 - bias) (subnormal codes become fp32 subnormals, equally exact), then one multiply
// restores the bias. (torch's scalar fp8 cast runs at well under 1 Gelem/s on CPUs.)
inline void to_float(const int8_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <int kMantissaBits, int kBias>
inline void fp8_to_float(const uint8_t* bits, float* dst, int64_t n) {
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  constexpr float kRebias = static_cast<float>(1ull << (127 - kBias - 64)) * static_cast<float>(1ull << 63) * 2.f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits[i];
    out[i] = ((b & 0x80u) << 24) | ((b & 0x7Fu) << (23 - kMantissaBits));
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] *= kRebias;
}
inline void to_float(const c10::Float8_e4m3fn* src, float* dst, int64_t n) {
  fp8_to_float<3, 7>(reinterpret_cast<const uint8_t*>(src), dst, n);
}
inline void to_float(const c10::Float8_e5m2* src, float* dst, int64_t n) {
  fp8_to_float<2, 15>(reinterpret_cast<const uint8_t*>(src), dst, n);
}
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline float bf16_to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Rows j0..j1 of a [block_size, D] tile -> fp32, each times its scale when the cache is one-byte
// (row_scales non-null). Rows are D apart in both.
template <typename cache_t>
inline void rows_to_float(const cache_t* src, float* dst, int64_t j0, int64_t j1, int64_t D,
                          const c10::BFloat16* row_scales) {
  to_float(src + j0 * D, dst + j0 * D, (j1 - j0) * D);
  if (row_scales != nullptr) {
    for (int64_t j = j0; j < j1; ++j) {
      const float sc = bf16_to_float(row_scales[j]);
      float* row = dst + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) row[d] *= sc;
    }
  }
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if defined(__AVX512F__)
// The chunk step's helpers pass vectors and small arrays of them: out of line (GCC's inliner leaves
// sum16 and chunk_rows as calls), those go through the stack on every block.
#define PA_ALWAYS_INLINE inline __attribute__((always_inline))

// Lane j of the result is the sum of p[j]'s 16 lanes: a transpose-and-add tree (8 + 4 + 2 + 1 vector adds)
// instead of 16 horizontal reductions. Each level halves the vectors.
PA_ALWAYS_INLINE __m512 sum16(const __m512* p) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // within 128-bit lanes: (p0_0+p0_2, p1_0+p1_2, p0_1+p0_3, p1_1+p1_3)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // within 128-bit lanes: the 4 keys' sums over that lane
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // across 128-bit lanes, pairwise
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// 16 elements of a cache row as fp32, widened in registers.
PA_ALWAYS_INLINE __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
PA_ALWAYS_INLINE __m512 load16(const c10::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The scores of one row against a 16-key chunk, K read straight from the cache (no fp32 copy of the tile)
// where it is fp32 or bf16, so a decode step is one pass over the bytes it must read: q (scaled, fp32)
// against the 16 keys; or, where the CPU has
// AVX512-BF16 and both query and cache are bf16, the unscaled bf16 query q_bf16 (null otherwise,
// D a multiple of 32) with `_mm512_dpbf16_ps` (bf16 pairs multiplied exactly, summed in fp32), then
// scaled: the bf16 K row needs no widening at all.
template <typename cache_t>
PA_ALWAYS_INLINE __m512 chunk_scores(const float* q, const uint16_t* q_bf16, const cache_t* k, int64_t D, float scale) {
  __m512 p[16];
  for (int j = 0; j < 16; ++j) p[j] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
    if (q_bf16 != nullptr) {
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh qd = (__m512bh)_mm512_loadu_si512(q_bf16 + d);
        for (int j = 0; j < 16; ++j) p[j] = _mm512_dpbf16_ps(p[j], qd, (__m512bh)_mm512_loadu_si512(k + j * D + d));
      }
      return _mm512_mul_ps(sum16(p), _mm512_set1_ps(scale));
    }
  }
#endif
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int j = 0; j < 16; ++j) p[j] = _mm512_fmadd_ps(qd, load16(k + j * D + d), p[j]);
  }
  return sum16(p);
}

// acc[r] = acc[r] * alpha[r] + sum_j probs[r][j] v_j for R rows, 16 columns at a time: each V vector is
// loaded (and widened) once for all R rows, whose accumulators stay in registers.
template <typename cache_t, int R>
PA_ALWAYS_INLINE void chunk_values(const cache_t* v, int64_t D, const float* probs, const float* alpha, float* acc) {
  for (int64_t d = 0; d < D; d += 16) {
    __m512 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), _mm512_set1_ps(alpha[r]));
    for (int j = 0; j < 16; ++j) {
      const __m512 vj = load16(v + j * D + d);
      for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(probs[r * 16 + j]), vj, a[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * D + d, a[r]);
  }
}

#if defined(__AVX512BF16__)
// Two rows of 32 bf16 interleaved word by word (_mm512_permutex2var_epi16 of the rows a and b): word 2i of
// the result is a[i] and word 2i + 1 is b[i], for columns 0..15 (kPairLow) and 16..31 (kPairHigh).
alignas(64) static const uint16_t kPairLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) static const uint16_t kPairHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// chunk_values for a bf16 cache where the CPU has AVX512-BF16: the probabilities rounded to bf16 (as torch's
// CPU flash attention rounds them before its P @ V product on bf16 inputs), then for each pair of keys
// j, j+1 one `_mm512_dpbf16_ps` per 16 columns and row, which multiplies both keys' values by their
// probabilities exactly and adds them in fp32. The pair's two V rows are interleaved word by word
// (_mm512_permutex2var_epi16) so that lane i holds column i of both, and the accumulators stay in the
// columns' order. p_bf16 [R][16] holds the rounded probabilities; D a multiple of 32.
template <int R>
PA_ALWAYS_INLINE void chunk_values_bf16(const c10::BFloat16* v, int64_t D, const uint16_t* p_bf16, const float* alpha,
                                        float* acc) {
  const __m512i low = _mm512_load_si512(kPairLow), high = _mm512_load_si512(kPairHigh);
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v);
  for (int64_t d = 0; d < D; d += 32) {
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      lo[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), a);
      hi[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d + 16), a);
    }
    for (int j = 0; j < 16; j += 2) {
      const __m512i vj = _mm512_loadu_si512(vb + j * D + d), vj1 = _mm512_loadu_si512(vb + (j + 1) * D + d);
      const __m512bh pair_lo = (__m512bh)_mm512_permutex2var_epi16(vj, low, vj1);
      const __m512bh pair_hi = (__m512bh)_mm512_permutex2var_epi16(vj, high, vj1);
      for (int r = 0; r < R; ++r) {
        int32_t pj;  // (p_j, p_{j+1}) as one 32-bit lane, broadcast
        std::memcpy(&pj, p_bf16 + r * 16 + j, sizeof(pj));
        const __m512bh p = (__m512bh)_mm512_set1_epi32(pj);
        lo[r] = _mm512_dpbf16_ps(lo[r], pair_lo, p);
        hi[r] = _mm512_dpbf16_ps(hi[r], pair_hi, p);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc + r * D + d, lo[r]);
      _mm512_storeu_ps(acc + r * D + d + 16, hi[r]);
    }
  }
}
#endif

// f(R, m) for rows m..m+R-1 in groups of kMax rows, then the rest in one group, R a compile-time
// std::integral_constant (the row kernels keep R rows' vectors in registers). f must be an always-inline
// lambda (PA_INLINE_LAMBDA): a call in decode's block loop spills every vector register.
template <int kMax, int R = kMax - 1, typename F>
PA_ALWAYS_INLINE void rest_group(int64_t left, int64_t m, F& f) {
  if constexpr (R > 0) {
    if (left == R) return f(std::integral_constant<int, R>{}, m);
    rest_group<kMax, R - 1>(left, m, f);
  }
}
template <int kMax, typename F>
PA_ALWAYS_INLINE void in_row_groups(int64_t rows, F&& f) {
  int64_t m = 0;
  for (; m + kMax <= rows; m += kMax) f(std::integral_constant<int, kMax>{}, m);
  rest_group<kMax>(rows - m, m, f);
}
#define PA_INLINE_LAMBDA __attribute__((always_inline))

// c[0] f^(N-1) + ... + c[N-1] on 16 lanes, by Horner's rule: 2^f for |f| <= 1/2 in the exponentials below.
template <size_t N>
PA_ALWAYS_INLINE __m512 horner16(__m512 f, const float (&c)[N]) {
  __m512 p = _mm512_set1_ps(c[0]);
  for (size_t i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return p;
}

// pagedllm::fast_exp on 16 lanes in registers (the same steps: 2^n by the exponent field, 2^f by the
// degree-6 polynomial, 0 below 2^-126, and a NaN stays a NaN, so a poisoned key still shows).
PA_ALWAYS_INLINE __m512 fast_exp16(__m512 x) {
  // (max and min return their second operand where either is NaN: x's side stays NaN, as std::max/min do)
  const __m512 t = _mm512_min_ps(_mm512_set1_ps(127.f), _mm512_max_ps(_mm512_set1_ps(-127.f),
                                                                      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f))));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  static constexpr float kPoly[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                     5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
  const __m512 p = horner16(f, kPoly);
  const __m512 result =
      _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(n, _mm512_set1_ps(-126.f), _CMP_NLT_UQ), result);
}

// Scores and the online-softmax update of R rows (R <= 8) for one 16-key chunk, with no call and no row
// waiting on another: each row's chain (dot products, max, exp, sum) is short next to the chunk's
// bytes, so the rows' chains are laid side by side for the CPU to overlap. masks [R]: the keys each row
// sees (at least one; a key it does not see scores -inf, so its probability is 0). probs [R][16]
// receives the unnormalised probabilities, alpha [R] each row's rescale of its accumulator.
template <typename cache_t, int R>
PA_ALWAYS_INLINE void softmax_rows(const float* q, const uint16_t* q_bf16, const cache_t* k, int64_t D, float scale,
                                   const uint32_t* masks, float* row_max, float* row_sum, float* probs, float* alpha) {
  __m512 s[R];
  for (int r = 0; r < R; ++r) {
    s[r] = _mm512_mask_blend_ps(static_cast<__mmask16>(masks[r]), _mm512_set1_ps(kNegInf),
                                chunk_scores(q + r * D, q_bf16 != nullptr ? q_bf16 + r * D : nullptr, k, D, scale));
  }
  float new_max[R];
  for (int r = 0; r < R; ++r) {
    new_max[r] = std::max(row_max[r], _mm512_reduce_max_ps(s[r]));
    alpha[r] = pagedllm::fast_exp(row_max[r] - new_max[r]);  // 0 on the row's first chunk (row_max = -inf)
  }
  for (int r = 0; r < R; ++r) {
    const __m512 p = fast_exp16(_mm512_sub_ps(s[r], _mm512_set1_ps(new_max[r])));
    _mm512_storeu_ps(probs + r * 16, p);
    row_sum[r] = std::fma(row_sum[r], alpha[r], _mm512_reduce_add_ps(p));
    row_max[r] = new_max[r];
  }
}

// One 16-key chunk for `rows` rows, each seeing at least one of its keys (masks [rows]): scores and the
// online-softmax update, then V for all. v's keys that no row sees must be finite (their probabilities
// are 0). probs [rows][16] and alpha [rows] are scratch.
template <typename cache_t>
PA_ALWAYS_INLINE void chunk_rows(const float* q, const uint16_t* q_bf16, const cache_t* k, const cache_t* v,
                                 int64_t rows, const uint32_t* masks, int64_t D, float scale, float soft_cap,
                                 float* row_max, float* row_sum, float* acc, float* probs, float* alpha) {
  if (soft_cap == 0.f) {
    in_row_groups<8>(rows, [&](auto r, int64_t m) PA_INLINE_LAMBDA {
      softmax_rows<cache_t, decltype(r)::value>(q + m * D, q_bf16 != nullptr ? q_bf16 + m * D : nullptr, k, D, scale,
                                                masks + m, row_max + m, row_sum + m, probs + m * 16, alpha + m);
    });
  }
  for (int64_t m = 0; m < rows && soft_cap > 0.f; ++m) {  // row by row, capped as in chunk_row_scalar
    __m512 s = chunk_scores(q + m * D, q_bf16 != nullptr ? q_bf16 + m * D : nullptr, k, D, scale);
    float* pm = probs + m * 16;
    _mm512_storeu_ps(pm, s);
    for (int j = 0; j < 16; ++j) pm[j] = std::tanh(pm[j] / soft_cap) * soft_cap;  // s / cap, tanh, * cap
    s = _mm512_mask_blend_ps(static_cast<__mmask16>(masks[m]), _mm512_set1_ps(kNegInf), _mm512_loadu_ps(pm));
    const float new_max = std::max(row_max[m], _mm512_reduce_max_ps(s));
    alpha[m] = std::exp(row_max[m] - new_max);  // exp(-inf) = 0 on the row's first chunk
    const __m512 p = fast_exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max)));
    _mm512_storeu_ps(pm, p);
    row_sum[m] = std::fma(row_sum[m], alpha[m], _mm512_reduce_add_ps(p));
    row_max[m] = new_max;
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
    if (q_bf16 != nullptr) {  // (the bf16 path: D a multiple of 32)
      // probs' rows rounded to bf16, packed at its front (row r's 16 at p_bf16 + r * 16: each row is read
      // before anything is written over it)
      uint16_t* p_bf16 = reinterpret_cast<uint16_t*>(probs);
      for (int64_t r = 0; r < rows; ++r) {
        const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(probs + r * 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_bf16 + r * 16), (__m256i)rounded);
      }
      in_row_groups<8>(rows, [&](auto r, int64_t m) PA_INLINE_LAMBDA {
        chunk_values_bf16<decltype(r)::value>(v, D, p_bf16 + m * 16, alpha + m, acc + m * D);
      });
      return;
    }
  }
#endif
  in_row_groups<4>(rows, [&](auto r, int64_t m) PA_INLINE_LAMBDA {
    chunk_values<cache_t, decltype(r)::value>(v, D, probs + m * 16, alpha + m, acc + m * D);
  });
}
#endif

// The same step without AVX-512, or for chunks that are not 16 keys of 16-float multiples: one row (q
// scaled) against keys lo..hi of a chunk (fp32 rows, D apart), the only ones it sees. Each sum has a
// fixed order (no vectorised reduction whose grouping could follow the data's alignment), so a row
// gets the same bits whatever item holds it. s is scratch for the chunk's scores.
inline void chunk_row_scalar(const float* __restrict q, const float* __restrict k, const float* __restrict v,
                             int64_t lo, int64_t hi, int64_t D, float soft_cap, float* __restrict s, float& row_max,
                             float& row_sum, float* __restrict acc) {
  for (int64_t j = lo; j < hi; ++j) {
    const float* kj = k + j * D;
    float lanes[8] = {};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
      for (int i = 0; i < 8; ++i) lanes[i] = std::fma(q[d + i], kj[d + i], lanes[i]);
    }
    for (; d < D; ++d) lanes[d % 8] = std::fma(q[d], kj[d], lanes[d % 8]);
    s[j] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    if (soft_cap > 0.f) s[j] = std::tanh(s[j] / soft_cap) * soft_cap;  // Gemma 2's order: s / cap, tanh, * cap
  }
  float new_max = row_max;
  for (int64_t j = lo; j < hi; ++j) new_max = std::max(new_max, s[j]);
  const float alpha = pagedllm::fast_exp(row_max - new_max);  // 0 on the row's first chunk (row_max = -inf)
  float sum = 0.f;
  for (int64_t j = lo; j < hi; ++j) {
    s[j] = pagedllm::fast_exp(s[j] - new_max);
    sum += s[j];
  }
  row_sum = std::fma(row_sum, alpha, sum);
  row_max = new_max;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  for (int64_t j = lo; j < hi; ++j) {
    const float p = s[j];
    const float* vj = v + j * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(p, vj[d], acc[d]);
  }
}

// Ask the memory system for `bytes` from p on, without waiting: into L2 (locality 2) or into L1 (3).
// Always inlined, as prefetch_tile: a call in decode's block loop spills the vectors live across it.
template <int locality>
inline __attribute__((always_inline)) void prefetch_lines(const void* p, int64_t bytes) {
  const char* start = static_cast<const char*>(p);
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(start + byte, 0, locality);
}

// One block's K and V tiles (K at k, V `part` elements on), into L2 (locality 2) or L1 (3). The K and V
// lines are asked for in turn.
template <int locality = 2, typename cache_t>
inline __attribute__((always_inline)) void prefetch_tile(const cache_t* k, int64_t part, int64_t tile_elems) {
  const char* k_bytes = reinterpret_cast<const char*>(k);
  const char* v_bytes = reinterpret_cast<const char*>(k + part);
  for (int64_t byte = 0; byte < tile_elems * static_cast<int64_t>(sizeof(cache_t)); byte += 64) {
    __builtin_prefetch(k_bytes + byte, 0, locality);
    __builtin_prefetch(v_bytes + byte, 0, locality);
  }
}

struct WorkItem {
  int64_t seq;
  int64_t kv_head;
  int64_t q_begin;    // first query row of the tile, relative to the sequence
  int64_t q_end;
  int64_t k_begin;    // context range of this split
  int64_t k_end;
  int64_t partial;    // first row of this split's partial result, or -1 when the item writes the output
};

// Element strides of the cache (and of its scales): K/V part, KV head, block. A block's [block_size,
// head_dim] tile is contiguous.
struct CacheStrides {
  int64_t part, head, block;
};

// The first kPrefetchBlocks blocks of a work item. Called one item ahead: a decode item's context is often
// only a few blocks, which the in-loop prefetch (kPrefetchBlocks ahead) never reaches, so without this
// every block of a short sequence is a demand miss (measured: 0.45 us a block at batch 64, context 64).
template <typename cache_t>
inline void prefetch_item(const WorkItem& w, const cache_t* kv_cache, const int64_t* block_table, CacheStrides cs,
                          int64_t block_size, int64_t head_dim) {
  const int64_t last = std::min(w.k_end, w.k_begin + kPrefetchBlocks * block_size);
  for (int64_t kb = w.k_begin / block_size * block_size; kb < last; kb += block_size) {
    prefetch_tile(kv_cache + w.kv_head * cs.head + block_table[kb / block_size] * cs.block, cs.part,
                  block_size * head_dim);
  }
}

// An item's rows when its blocks are done: its split's partial result (accumulator, max, denominator) for
// the log-sum-exp merge, or the normalised output.
template <typename scalar_t>
void finish_rows(const WorkItem& w, int64_t rows, int64_t group, int64_t D, int64_t q_row0, int64_t num_heads,
                 float* acc, const float* row_max, const float* row_sum, scalar_t* out, float* partial_acc,
                 float* partial_max, float* partial_sum) {
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t t = w.q_begin + m / group;
    const int64_t head = w.kv_head * group + m % group;
    if (w.partial >= 0) {
      const int64_t slot = w.partial + m;
      std::memcpy(partial_acc + slot * D, acc + m * D, D * sizeof(float));
      partial_max[slot] = row_max[m];
      partial_sum[slot] = row_sum[m];
    } else {
      // Every row sees at least its own key, so row_sum > 0 here.
      const float inv = 1.f / row_sum[m];
      float* am = acc + m * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) am[d] *= inv;
      from_float(am, out + ((q_row0 + t) * num_heads + head) * D, D);
    }
  }
}

// Context tokens per split of a decode-like sequence: kSplitTokens in whole blocks.
inline int64_t split_tokens(int64_t block_size) { return std::max(block_size, kSplitTokens / block_size * block_size); }

// Whether the keys first..stop (stop > first) of an item cross a split boundary: its rows' results are
// then folded at each one (fold_partial), as the merge after a decode's split items folds them.
inline bool crosses_split(int64_t first, int64_t stop, int64_t split) {
  return first < stop && (stop - 1) / split > first / split;
}

// Folds one split's partial result of a row (max m, denominator l, unnormalised accumulator a) into the
// row's running merge (max M, denominator T, accumulator O; T = 0 before the first). The merge after a
// decode's split items and an item that crosses split boundaries take these steps, split after split in
// order, so that a row's output does not depend on which of the two computed it (one out-of-line body:
// the same contractions into FMAs for both). A split of which the row sees no key (l = 0) is skipped.
__attribute__((noinline)) void fold_partial(float m, float l, const float* a, float& M, float& T, float* O,
                                            int64_t D) {
  if (l == 0.f) return;
  if (T == 0.f) {
    M = m;
    T = l;
    std::memcpy(O, a, D * sizeof(float));
    return;
  }
  const float new_max = std::max(M, m);
  // (one of the two weights is exp(0) = 1: only the other needs an exp)
  const float wa = M == new_max ? 1.f : std::exp(M - new_max), wb = m == new_max ? 1.f : std::exp(m - new_max);
  T = std::fma(T, wa, l * wb);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) O[d] = std::fma(O[d], wa, a[d] * wb);
  M = new_max;
}

#if defined(PAGEDLLM_AMX)

// The tile configuration this thread last loaded for an item, within the current parallel chunk of items
// (none at a chunk's start: between op calls other AMX code, oneDNN's, may load its own). The items of a
// path share one configuration, so a chunk loads it once, not once per item: LDTILECFG was about a fifth
// of a short decode item's time.
constexpr int kNoItemConfig = 0;
thread_local int t_item_config = kNoItemConfig;

inline void load_item_config(const pagedllm_amx::TileConfig& config, int kind) {
  if (t_item_config != kind) {
    config.load();
    t_item_config = kind;
  }
}

// 2^t on 16 lanes for the AMX decode path: 2^round(t) by VSCALEFPS, 2^f by a degree-5 polynomial (relative
// error under 1e-7, far below the bf16 rounding the probabilities take next). Below 2^-126 the result is 0
// (t = -inf too, a masked key), NaN stays NaN. The scaling never makes a subnormal: on Intel cores a
// subnormal or underflowing result takes a microcode assist of some hundred cycles, which every masked
// lane of a decode step's last chunk paid. (The probabilities' bf16 rounding flushes subnormals anyway.)
PA_ALWAYS_INLINE __m512 exp2_16(__m512 t) {
  // (max and min return their second operand where either is NaN: t's side stays NaN)
  const __m512 c = _mm512_min_ps(_mm512_set1_ps(128.f), _mm512_max_ps(_mm512_set1_ps(-126.f), t));
  const __m512 n = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(c, n);
  static constexpr float kPoly[] = {1.326697994954884e-3f, 9.675469249486923e-3f, 5.550742521882057e-2f,
                                     2.402212172746658e-1f, 6.931469440460205e-1f, 1.0f};
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_NLT_UQ),
                             _mm512_scalef_ps(horner16(f, kPoly), n));
}

// The tile row of query row r in the P rows and the accumulators: with 16 lanes the shuffle network
// (probability_rows16) leaves query row 4 L + i in tile row 4 i + L.
template <int kLanes>
inline int64_t p_row(int64_t r) { return kLanes == 8 ? r : 4 * (r % 4) + r / 4; }

// Two rows of 8 dwords (the halves of v) at p and p + stride.
PA_ALWAYS_INLINE void store_rows(uint32_t* p, int64_t stride, __m512i v) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(v));
  _mm256_store_si256(reinterpret_cast<__m256i*>(p + stride), _mm512_extracti64x4_epi64(v, 1));
}

// A block's probabilities, kLanes == 8: e[k] holds keys 2k (lanes 0-7) and 2k + 1 (lanes 8-15) -> P
// rows [8][8 key pairs] (u32: key 2p in the low half), `stride` dwords apart.
PA_ALWAYS_INLINE void probability_rows8(const __m512* e, uint32_t* p_rows, int64_t stride) {
  // dword d < 8: (word d, word 8 + d), i.e. keys 2k and 2k + 1 of row d; d >= 8: the next vector's keys
  alignas(64) static const uint16_t kPairs[32] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                                  16, 24, 17, 25, 18, 26, 19, 27, 20, 28, 21, 29, 22, 30, 23, 31};
  // w[i] = pairs 2i (rows 0-7), 2i + 1 (rows 0-7); b = 4 x 4 blocks of rows x pairs; y = rows 2j, 2j + 1
  alignas(64) static const int32_t kRows0[16] = {0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27};
  alignas(64) static const int32_t kRows4[16] = {4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31};
  alignas(64) static const int32_t kOut0[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t kOut2[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i pairs = _mm512_load_si512(kPairs);
  __m512i w[4];
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(e[2 * i + 1], e[2 * i]));
  const __m512i rows0 = _mm512_load_si512(kRows0), rows4 = _mm512_load_si512(kRows4);
  const __m512i b0 = _mm512_permutex2var_epi32(w[0], rows0, w[1]), b1 = _mm512_permutex2var_epi32(w[0], rows4, w[1]);
  const __m512i b2 = _mm512_permutex2var_epi32(w[2], rows0, w[3]), b3 = _mm512_permutex2var_epi32(w[2], rows4, w[3]);
  const __m512i out0 = _mm512_load_si512(kOut0), out2 = _mm512_load_si512(kOut2);
  store_rows(p_rows, stride, _mm512_permutex2var_epi32(b0, out0, b2));
  store_rows(p_rows + 2 * stride, stride, _mm512_permutex2var_epi32(b0, out2, b2));
  store_rows(p_rows + 4 * stride, stride, _mm512_permutex2var_epi32(b1, out0, b3));
  store_rows(p_rows + 6 * stride, stride, _mm512_permutex2var_epi32(b1, out2, b3));
}

// kLanes == 16: e[j] holds key j, lane r row r -> P rows [16, in p_row order][8 key pairs], `stride` dwords
// apart.
PA_ALWAYS_INLINE void probability_rows16(const __m512* e, uint32_t* p_rows, int64_t stride) {
  // word 2r is key 2p's probability in lane r, word 2r + 1 key 2p + 1's (of cvtne2ps_pbh(e[2p + 1], e[2p]))
  alignas(64) static const uint16_t kLanePairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i lane_pairs = _mm512_load_si512(kLanePairs);
  __m512i pairs[8], t[8], u[8];
  for (int p = 0; p < 8; ++p)
    pairs[p] = _mm512_permutexvar_epi16(lane_pairs, (__m512i)_mm512_cvtne2ps_pbh(e[2 * p + 1], e[2 * p]));
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(pairs[2 * i], pairs[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(pairs[2 * i], pairs[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // pairs 0-3 (h = 0) and 4-7: u[4h + i] holds row 4L + i in its lane L
    u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  const __m512i rows_lo = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i rows_hi = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int i = 0; i < 4; ++i) {
    store_rows(p_rows + (4 * i) * stride, stride, _mm512_permutex2var_epi64(u[i], rows_lo, u[4 + i]));
    store_rows(p_rows + (4 * i + 2) * stride, stride, _mm512_permutex2var_epi64(u[i], rows_hi, u[4 + i]));
  }
}

// Query rows m0..m0 + n of an item as head_dim pairs with a lane a row, q_pairs [D / 2][lanes] u32 (zero
// past n): the B operand of S^T = K Q^T.
inline void query_pairs(const WorkItem& w, const c10::BFloat16* query, int64_t q_row0, int64_t num_heads,
                        int64_t group, int64_t D, int64_t m0, int64_t n, int64_t lanes, uint32_t* q_pairs) {
  std::fill(q_pairs, q_pairs + D / 2 * lanes, 0u);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t m = m0 + i, t = w.q_begin + m / group, g = m % group;
    const uint32_t* src =
        reinterpret_cast<const uint32_t*>(query + ((q_row0 + t) * num_heads + w.kv_head * group + g) * D);
    for (int64_t p = 0; p < D / 2; ++p) q_pairs[p * lanes + i] = src[p];
  }
}

// Each lane's query position for rows m0.. of an item (past `rows`: sees every key), and its key within a
// vector's keys (kLanes 8: two keys a vector).
template <int kLanes>
inline void lane_positions(int64_t first_pos, int64_t group, int64_t m0, int64_t rows, __m512i& positions,
                           __m512i& lane_keys) {
  alignas(64) int32_t lane_pos[16], lane_key[16];
  for (int64_t l = 0; l < 16; ++l) {
    const int64_t m = m0 + l % kLanes;
    lane_pos[l] = m < rows ? static_cast<int32_t>(first_pos + m / group) : std::numeric_limits<int32_t>::max();
    lane_key[l] = static_cast<int32_t>(l / kLanes);
  }
  positions = _mm512_load_si512(lane_pos);
  lane_keys = _mm512_load_si512(lane_key);
}

// S^T of the block at k on tile 0 (or 6, for a chunk's second block), stored as [16 keys][lanes] fp32 at
// dst: K as the cache holds it (tile 1) against the query pairs (tile 2). (The tile intrinsics take
// literal tile numbers, hence the macro.)
PA_ALWAYS_INLINE void block_scores_t(const c10::BFloat16* k, const uint32_t* q_pairs, int64_t D, int64_t lanes,
                                     float* dst, bool second = false) {
#define PAGEDLLM_BLOCK_SCORES(C)                                           \
  _tile_zero(C);                                                           \
  for (int64_t d0 = 0; d0 < D; d0 += 32) {                                 \
    _tile_loadd(1, k + d0, D * sizeof(c10::BFloat16));                    \
    _tile_loadd(2, q_pairs + d0 / 2 * lanes, lanes * sizeof(uint32_t));   \
    _tile_dpbf16ps(C, 1, 2);                                               \
  }                                                                        \
  _tile_stored(C, dst, lanes * sizeof(float));
  if (second) {
    PAGEDLLM_BLOCK_SCORES(6)
  } else {
    PAGEDLLM_BLOCK_SCORES(0)
  }
#undef PAGEDLLM_BLOCK_SCORES
}

// Keys a lane must not see score -inf: those at or past k_stop, or past the lane's position. s[j] holds
// the keys k0 + j * (16 / kLanes) + lane_keys.
template <int kLanes>
PA_ALWAYS_INLINE void mask_keys(__m512* s, int64_t count, int64_t k0, int64_t k_stop, __m512i positions,
                                __m512i lane_keys) {
  for (int64_t j = 0; j < count; ++j) {
    const __m512i key = _mm512_add_epi32(lane_keys, _mm512_set1_epi32(static_cast<int>(k0 + j * (16 / kLanes))));
    const __mmask16 seen = _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(k_stop)), _MM_CMPINT_LT) &
                           _mm512_cmp_epi32_mask(key, positions, _MM_CMPINT_LE);
    s[j] = _mm512_mask_blend_ps(seen, _mm512_set1_ps(kNegInf), s[j]);
  }
}

// The online-softmax step of kN score vectors (dot products, -inf where masked), down the keys: each
// lane's running max and denominator updated and the probabilities exp(scale * (s - max)) written over
// the scores (vscale: the scale in log2 units); returns each lane's rescale of its accumulator. A lane
// that has seen no key yet subtracts 0: its scores are -inf, their exponentials 0. With two keys a
// vector (kLanes 8), both halves get the max and the sum of the two.
template <int kN, int kLanes>
PA_ALWAYS_INLINE __m512 softmax_down_keys(__m512* s, __m512& rmax, __m512& rsum, __m512 vscale) {
  auto fold = [](__m512 v, auto op) PA_INLINE_LAMBDA {
    return kLanes == 8 ? op(v, _mm512_shuffle_f32x4(v, v, 0x4E)) : v;
  };
  __m512 m = s[0];
  for (int j = 1; j < kN; ++j) m = _mm512_max_ps(m, s[j]);
  const __m512 new_max = _mm512_max_ps(rmax, fold(m, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }));
  const __m512 shift = _mm512_mul_ps(
      _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(new_max, _mm512_set1_ps(kNegInf), _CMP_NEQ_UQ), new_max), vscale);
  // 1 exactly where the max stays (a chunk a lane sees none of is then no change at all, as if skipped)
  const __m512 alpha = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(rmax, new_max, _CMP_EQ_OQ),
                                            exp2_16(_mm512_mul_ps(_mm512_sub_ps(rmax, new_max), vscale)),
                                            _mm512_set1_ps(1.f));
  // Each lane's sum in one order for both lane counts: its even keys, its odd keys, then the two (with 8
  // lanes, vector j holds keys 2j and 2j + 1, and the fold adds the halves).
  __m512 sum = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
  for (int j = 0; j < kN; ++j) {
    s[j] = exp2_16(_mm512_fmsub_ps(s[j], vscale, shift));
    if (kLanes == 16 && j % 2 == 1) {
      odd = _mm512_add_ps(odd, s[j]);
    } else {
      sum = _mm512_add_ps(sum, s[j]);
    }
  }
  if constexpr (kLanes == 16) sum = _mm512_add_ps(sum, odd);
  rsum = _mm512_fmadd_ps(rsum, alpha, fold(sum, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }));
  rmax = new_max;
  return alpha;
}

// A 16-key block's values interleaved in key pairs, dst [8][D] u32: word 2i of (p, d) is v_{2p}[d] and
// word 2i + 1 v_{2p+1}[d] (the B operand of P V). Keys from `keys` on read as zeros: past the context they
// may hold anything, and their probabilities are 0.
PA_ALWAYS_INLINE void value_pairs(const c10::BFloat16* v, int64_t D, uint32_t* dst, int64_t keys = 16) {
  const __m512i low = _mm512_load_si512(kPairLow), high = _mm512_load_si512(kPairHigh);
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v);
  for (int64_t p = 0; p < 8; ++p) {
    const __mmask32 first = 2 * p < keys ? ~__mmask32{0} : 0, second = 2 * p + 1 < keys ? ~__mmask32{0} : 0;
    for (int64_t d = 0; d < D; d += 32) {
      const uint16_t* row = vb + 2 * p * D + d;
      const __m512i vj = keys >= 16 ? _mm512_loadu_si512(row) : _mm512_maskz_loadu_epi16(first, row);
      const __m512i vj1 = keys >= 16 ? _mm512_loadu_si512(row + D) : _mm512_maskz_loadu_epi16(second, row + D);
      _mm512_store_si512(dst + p * D + d, _mm512_permutex2var_epi16(vj, low, vj1));
      _mm512_store_si512(dst + p * D + d + 16, _mm512_permutex2var_epi16(vj, high, vj1));
    }
  }
}

// An item's rows on the tile paths when its blocks are done: acc [tiles][16][D] in p_row order within a
// tile, row_max in the raw dot products' units (scaled here into the other paths' units), to finish_rows
// in query order through `ordered` [rows][D].
template <int kLanes>
void finish_tile_rows(const WorkItem& w, int64_t rows, int64_t group, int64_t D, int64_t q_row0, int64_t num_heads,
                      float scale, const float* acc, float* row_max, const float* row_sum, float* ordered,
                      c10::BFloat16* out, float* partial_acc, float* partial_max, float* partial_sum) {
  for (int64_t m = 0; m < rows; ++m) {
    std::memcpy(ordered + m * D, acc + (m / kLanes * kLanes + p_row<kLanes>(m % kLanes)) * D, D * sizeof(float));
    row_max[m] *= scale;
  }
  finish_rows(w, rows, group, D, q_row0, num_heads, ordered, row_max, row_sum, out, partial_acc, partial_max,
              partial_sum);
}

// acc = acc * alpha + pv for query rows 0..rows of a tile (acc and pv in p_row order, alphas by lane).
template <int kLanes>
PA_ALWAYS_INLINE void add_values(float* acc, const float* pv, const float* alphas, int64_t rows, int64_t D) {
  for (int64_t r = 0; r < rows; ++r) {
    float* am = acc + p_row<kLanes>(r) * D;
    const float* pm = pv + p_row<kLanes>(r) * D;
    const __m512 rescale = _mm512_set1_ps(alphas[r]);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_store_ps(am + d, _mm512_fmadd_ps(_mm512_load_ps(am + d), rescale, _mm512_load_ps(pm + d)));
  }
}

// A decode-like item (fewer than 16 query rows per KV head: a decode step, a short verification) of a
// bf16 cache on AMX tiles, in chunks of two 16-key blocks. The scores come transposed, S^T = K Q^T: a
// block's keys are the tile's rows as the cache holds them, against the query rows' head_dim pairs
// arranged once per item, so a column is a query row. The online softmax then runs down the keys with a
// lane per query row, kLanes of them: 8 (up to 8 rows: two keys a vector) or 16; no horizontal
// reductions, the scale folded into the exponent's argument. The probabilities, rounded to bf16, become
// rows of key pairs by a shuffle network, and P V is one TDPBF16PS per 16 columns of head_dim and chunk,
// on the chunk's values interleaved in key pairs. The denominator sums the unrounded probabilities, as
// decode's AVX-512 path does. Lanes past `rows` compute on zero queries and are never stored.
// Tiles: 0 and 6 S^T of a chunk's two blocks [16 keys][kLanes]; 1 K [16 keys][32 of head_dim], or a V
// slice as 4; 2 the query pairs [16 pairs of head_dim][kLanes x 2]; 3 P [kLanes][32 keys]; 4 V pairs [16
// pairs of keys][16 of head_dim x 2]; 5 and 7 P V slices [kLanes][16 of head_dim].
template <int kLanes>
void run_decode_item_amx(const WorkItem& w, const c10::BFloat16* query, const c10::BFloat16* kv_cache,
                         const int64_t* block_table, int64_t q_row0, int64_t seq_len, int64_t query_len,
                         int64_t num_heads, int64_t num_kv_heads, CacheStrides cs, int64_t head_dim, float scale,
                         c10::BFloat16* out, float* partial_acc, float* partial_max, float* partial_sum,
                         std::vector<float>& scratch) {
  // Keys go in chunks of two blocks: one P V product of 32 keys (16 pairs) per chunk.
  constexpr int64_t BS = 16, kChunk = 2 * BS, kVectors = BS * kLanes / 16;  // score vectors a block
  const int64_t group = num_heads / num_kv_heads, D = head_dim;
  const int64_t rows = (w.q_end - w.q_begin) * group;
  // query pairs [D / 2][kLanes] u32, acc [kLanes][D] (p_row order) and the same in query order, V pairs
  // [kChunk / 2][D] u32, S^T [2 chunks in flight][2 blocks][BS][kLanes], P V [kLanes][D], P rows
  // [kLanes][kChunk / 2] u32, row max and sum [16] each; 64-byte aligned
  const int64_t floats = D / 2 * kLanes + 2 * kLanes * D + kChunk / 2 * D + 2 * kChunk * kLanes + kLanes * D +
                         kLanes * kChunk / 2 + 2 * 16;
  scratch.resize(floats + 16);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  uint32_t* q_pairs = reinterpret_cast<uint32_t*>(base);
  float* acc = base + D / 2 * kLanes;
  float* ordered = acc + kLanes * D;
  uint32_t* v_pairs = reinterpret_cast<uint32_t*>(ordered + kLanes * D);
  float* scores = reinterpret_cast<float*>(v_pairs + kChunk / 2 * D);
  float* pv = scores + 2 * kChunk * kLanes;
  uint32_t* p_rows = reinterpret_cast<uint32_t*>(pv + kLanes * D);
  float* row_max = reinterpret_cast<float*>(p_rows + kLanes * kChunk / 2);
  float* row_sum = row_max + 16;

  query_pairs(w, query, q_row0, num_heads, group, D, 0, rows, kLanes, q_pairs);
  std::fill(acc, acc + kLanes * D, 0.f);

  pagedllm_amx::TileConfig config;
  config.tile(0, BS, kLanes * 4).tile(6, BS, kLanes * 4).tile(1, BS, 64).tile(2, 16, kLanes * 4);
  config.tile(3, kLanes, kChunk * 2).tile(4, kChunk / 2, 64).tile(5, kLanes, 64).tile(7, kLanes, 64);
  load_item_config(config, kLanes);  // (kinds 8 and 16)

  // scores times scale, in log2 units
  const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f), neg_inf = _mm512_set1_ps(kNegInf);

  const int64_t first_pos = seq_len - query_len + w.q_begin;
  const int64_t k_stop = std::min(w.k_end, seq_len - query_len + w.q_end);
  __m512i positions, lane_keys;
  lane_positions<kLanes>(first_pos, group, 0, rows, positions, lane_keys);
  __m512 rmax = neg_inf, rsum = _mm512_setzero_ps();
  const int64_t tile_elems = BS * D;
  auto k_tile = [&](int64_t kb) PA_INLINE_LAMBDA {
    return kv_cache + w.kv_head * cs.head + block_table[kb / BS] * cs.block;
  };
  // S^T of the chunk at c0 (its second block only where it has one) into scores slot `slot`
  auto chunk_scores = [&](int64_t c0, int slot) PA_INLINE_LAMBDA {
    float* dst = scores + slot * kChunk * kLanes;
    block_scores_t(k_tile(c0), q_pairs, D, kLanes, dst);
    if (c0 + BS < k_stop) block_scores_t(k_tile(c0 + BS), q_pairs, D, kLanes, dst + BS * kLanes, true);
  };
  alignas(64) float alphas[16];  // the previous chunk's rescales, for its P V

  // Software-pipelined: the next chunk's scores are on the tiles while this chunk's softmax runs, and this
  // chunk's P V while the next one's softmax runs. Chunks start on block boundaries (a split's first key
  // is a multiple of kSplitTokens; this path has no window); only the last block may be partial.
  chunk_scores(w.k_begin, 0);
  int slot = 0;
  bool pending = false;
  for (int64_t c0 = w.k_begin; c0 < k_stop; c0 += kChunk, slot ^= 1) {
    const int64_t blocks = c0 + BS < k_stop ? 2 : 1;
    // The blocks kDecodePrefetchBlocks ahead into L2 and the next chunk's into L1, a quarter at a time
    // between this chunk's steps: asked for all at once, their lines wait for the core's few line-fill
    // buffers and stall the computation behind them.
    auto ahead = [&](int64_t blocks_ahead) PA_INLINE_LAMBDA {
      return c0 + blocks_ahead * BS < k_stop ? k_tile(c0 + blocks_ahead * BS) : nullptr;
    };
    const c10::BFloat16* far[2] = {ahead(kDecodePrefetchBlocks), ahead(kDecodePrefetchBlocks + 1)};
    const c10::BFloat16* near[2] = {ahead(2), ahead(3)};
    auto prefetch_quarter = [&](int64_t quarter) PA_INLINE_LAMBDA {
      for (int b = 0; b < 2; ++b) {
        if (far[b] != nullptr) prefetch_tile<2>(far[b] + quarter * tile_elems / 4, cs.part, tile_elems / 4);
        if (near[b] != nullptr) prefetch_tile<3>(near[b] + quarter * tile_elems / 4, cs.part, tile_elems / 4);
      }
    };
    prefetch_quarter(0);
    if (c0 + kChunk < k_stop) chunk_scores(c0 + kChunk, slot ^ 1);

    __m512 s[2 * kVectors];
    const float* chunk = scores + slot * kChunk * kLanes;
    for (int64_t j = 0; j < 2 * kVectors; ++j) s[j] = j < blocks * kVectors ? _mm512_load_ps(chunk + j * 16) : neg_inf;
    if (c0 + blocks * BS > k_stop || first_pos < c0 + blocks * BS - 1)  // keys some row must not see
      mask_keys<kLanes>(s, blocks * kVectors, c0, k_stop, positions, lane_keys);
    prefetch_quarter(1);
    const __m512 alpha = softmax_down_keys<2 * kVectors, kLanes>(s, rmax, rsum, vscale);

    prefetch_quarter(2);
    if (pending) add_values<kLanes>(acc, pv, alphas, rows, D);  // the previous chunk's, before this one's
    _mm512_store_ps(alphas, alpha);
    for (int64_t b = 0; b < 2; ++b) {  // an absent second block's probabilities are 0
      if constexpr (kLanes == 8) {
        probability_rows8(s + b * kVectors, p_rows + b * BS / 2, kChunk / 2);
      } else {
        probability_rows16(s + b * kVectors, p_rows + b * BS / 2, kChunk / 2);
      }
    }
    value_pairs(k_tile(c0) + cs.part, D, v_pairs, k_stop - c0);
    if (blocks == 2) {
      value_pairs(k_tile(c0 + BS) + cs.part, D, v_pairs + BS / 2 * D, k_stop - c0 - BS);
    } else {  // no second block: zero values (times probabilities 0)
      std::fill(v_pairs + BS / 2 * D, v_pairs + BS * D, 0u);
    }
    prefetch_quarter(3);
    _tile_loadd(3, p_rows, kChunk / 2 * sizeof(uint32_t));
    for (int64_t d0 = 0; d0 < D; d0 += 32) {  // two slices of 16 columns on alternate tiles
      _tile_zero(5);
      _tile_loadd(4, v_pairs + d0, D * sizeof(uint32_t));
      _tile_dpbf16ps(5, 3, 4);
      _tile_stored(5, pv + d0, D * sizeof(float));
      if (d0 + 16 < D) {
        _tile_zero(7);
        _tile_loadd(1, v_pairs + d0 + 16, D * sizeof(uint32_t));
        _tile_dpbf16ps(7, 3, 1);
        _tile_stored(7, pv + d0 + 16, D * sizeof(float));
      }
    }
    pending = true;
  }
  if (pending) add_values<kLanes>(acc, pv, alphas, rows, D);

  _mm512_store_ps(row_max, rmax);
  _mm512_store_ps(row_sum, rsum);
  finish_tile_rows<kLanes>(w, rows, group, D, q_row0, num_heads, scale, acc, row_max, row_sum, ordered, out,
                           partial_acc, partial_max, partial_sum);
}

// A prefill item (16 or more query rows per KV head) of a bf16 cache on AMX tiles, 16 rows at a time with
// the decode path's steps and chunks (so that a row's bits do not depend on which path computed it): per
// chunk of two 16-key blocks, the chunk's values interleaved in key pairs once, then for every 16-row
// tile that sees one of its keys S^T = K Q^T (K as the cache holds it), the online softmax down the keys
// with a lane per row (the causal diagonal masked lane by lane), the probabilities turned into rows and
// P V, all on the tiles. At each split boundary every row's result is folded (fold_partial), as the
// decode path's splits are merged. Tiles as in run_decode_item_amx with 16 lanes: 0 and 6 S^T; 1 K; 2
// the query pairs; 3 P [16][32 keys]; 4 V pairs [16][16 of head_dim x 2]; 5 a P V slice.
void run_prefill_item_amx(const WorkItem& w, const c10::BFloat16* query, const c10::BFloat16* kv_cache,
                          const int64_t* block_table, int64_t q_row0, int64_t seq_len, int64_t query_len,
                          int64_t num_heads, int64_t num_kv_heads, CacheStrides cs, int64_t head_dim, float scale,
                          c10::BFloat16* out, float* partial_acc, float* partial_max, float* partial_sum,
                          std::vector<float>& scratch) {
  constexpr int64_t BS = 16, kLanes = 16, kChunk = 2 * BS;
  const int64_t group = num_heads / num_kv_heads, D = head_dim;
  const int64_t rows = (w.q_end - w.q_begin) * group, tiles = (rows + kLanes - 1) / kLanes;
  const int64_t first_pos = seq_len - query_len + w.q_begin;
  const int64_t k_stop = std::min(w.k_end, seq_len - query_len + w.q_end);
  const int64_t split = split_tokens(BS);
  const bool folds = crosses_split(w.k_begin, k_stop, split);
  // per row tile: query pairs [D / 2][16] u32, acc [16][D] (p_row order), row max and sum [16], lane
  // positions [16]; then V pairs [kChunk / 2][D] u32, S^T [kChunk][16], P V [16][D], P rows [16][kChunk
  // / 2] u32, the rows in query order [rows][D], and when the item folds the merged accumulator [rows][D],
  // max and sum [rows]; 64-byte aligned
  const int64_t per_tile = D / 2 * kLanes + kLanes * D + 3 * kLanes;
  scratch.resize(tiles * per_tile + kChunk / 2 * D + kChunk * kLanes + kLanes * D + kLanes * kChunk / 2 + rows * D +
                 (folds ? rows * D + 2 * rows : 0) + 16);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  uint32_t* q_pairs = reinterpret_cast<uint32_t*>(base);          // [tiles][D / 2][16]
  float* acc = base + tiles * D / 2 * kLanes;                      // [tiles][16][D]
  float* row_max = acc + tiles * kLanes * D;                       // [tiles * 16]
  float* row_sum = row_max + tiles * kLanes;                       // [tiles * 16]
  int32_t* lane_pos = reinterpret_cast<int32_t*>(row_sum + tiles * kLanes);  // [tiles][16]
  uint32_t* v_pairs = reinterpret_cast<uint32_t*>(lane_pos + tiles * kLanes);
  float* scores = reinterpret_cast<float*>(v_pairs + kChunk / 2 * D);
  float* pv = scores + kChunk * kLanes;
  uint32_t* p_rows = reinterpret_cast<uint32_t*>(pv + kLanes * D);
  float* ordered = reinterpret_cast<float*>(p_rows + kLanes * kChunk / 2);
  float* merged = ordered + rows * D;
  float* merged_max = merged + rows * D;
  float* merged_sum = merged_max + rows;

  for (int64_t rt = 0; rt < tiles; ++rt) {
    query_pairs(w, query, q_row0, num_heads, group, D, rt * kLanes, std::min(kLanes, rows - rt * kLanes), kLanes,
                q_pairs + rt * D / 2 * kLanes);
    __m512i positions, lane_keys;
    lane_positions<kLanes>(first_pos, group, rt * kLanes, rows, positions, lane_keys);
    _mm512_store_si512(lane_pos + rt * kLanes, positions);
  }
  auto reset_rows = [&] {
    std::fill(acc, acc + tiles * kLanes * D, 0.f);
    std::fill(row_max, row_max + tiles * kLanes, kNegInf);
    std::fill(row_sum, row_sum + tiles * kLanes, 0.f);
  };
  reset_rows();
  if (folds) std::fill(merged_sum, merged_sum + rows, 0.f);
  auto fold_rows = [&] {
    for (int64_t m = 0; m < rows; ++m) {
      fold_partial(row_max[m] * scale, row_sum[m], acc + (m / kLanes * kLanes + p_row<kLanes>(m % kLanes)) * D,
                   merged_max[m], merged_sum[m], merged + m * D, D);
    }
    reset_rows();
  };

  pagedllm_amx::TileConfig config;
  config.tile(0, BS, kLanes * 4).tile(6, BS, kLanes * 4).tile(1, BS, 64).tile(2, 16, kLanes * 4);
  config.tile(3, kLanes, kChunk * 2).tile(4, kChunk / 2, 64).tile(5, kLanes, 64);
  load_item_config(config, 1);
  const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);  // scores times scale, in log2 units
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  alignas(64) float alphas[kLanes];
  auto k_tile = [&](int64_t kb) PA_INLINE_LAMBDA {
    return kv_cache + w.kv_head * cs.head + block_table[kb / BS] * cs.block;
  };

  // Items start at 0 (this path has no window); chunks of two blocks from there, as the decode path's from
  // a split's first key; only the last block may be partial.
  for (int64_t c0 = w.k_begin; c0 < k_stop; c0 += kChunk) {
    if (folds && c0 > w.k_begin && c0 % split == 0) fold_rows();
    const int64_t blocks = c0 + BS < k_stop ? 2 : 1;
    if (c0 + kPrefetchBlocks * BS < k_stop) prefetch_tile(k_tile(c0 + kPrefetchBlocks * BS), cs.part, BS * D);
    if (c0 + (kPrefetchBlocks + 1) * BS < k_stop) {
      prefetch_tile(k_tile(c0 + (kPrefetchBlocks + 1) * BS), cs.part, BS * D);
    }
    value_pairs(k_tile(c0) + cs.part, D, v_pairs, k_stop - c0);
    if (blocks == 2) {
      value_pairs(k_tile(c0 + BS) + cs.part, D, v_pairs + BS / 2 * D, k_stop - c0 - BS);
    } else {  // no second block: zero values (times probabilities 0)
      std::fill(v_pairs + BS / 2 * D, v_pairs + BS * D, 0u);
    }
    for (int64_t rt = 0; rt < tiles; ++rt) {
      const int64_t m0 = rt * kLanes, n = std::min(kLanes, rows - m0);
      // rows are in position order: a tile whose last row is before the chunk sees none of its keys
      if (first_pos + (m0 + n - 1) / group < c0) continue;
      block_scores_t(k_tile(c0), q_pairs + rt * D / 2 * kLanes, D, kLanes, scores);
      if (blocks == 2) {
        block_scores_t(k_tile(c0 + BS), q_pairs + rt * D / 2 * kLanes, D, kLanes, scores + BS * kLanes, true);
      }
      __m512 s[kChunk];
      for (int64_t j = 0; j < kChunk; ++j) s[j] = j < blocks * BS ? _mm512_load_ps(scores + j * kLanes) : neg_inf;
      // keys some row must not see
      if (c0 + blocks * BS > k_stop || first_pos + m0 / group < c0 + blocks * BS - 1)
        mask_keys<kLanes>(s, blocks * BS, c0, k_stop, _mm512_load_si512(lane_pos + rt * kLanes),
                          _mm512_setzero_si512());
      __m512 rmax = _mm512_load_ps(row_max + m0), rsum = _mm512_load_ps(row_sum + m0);
      _mm512_store_ps(alphas, softmax_down_keys<kChunk, kLanes>(s, rmax, rsum, vscale));
      _mm512_store_ps(row_max + m0, rmax);
      _mm512_store_ps(row_sum + m0, rsum);
      probability_rows16(s, p_rows, kChunk / 2);
      probability_rows16(s + BS, p_rows + BS / 2, kChunk / 2);
      _tile_loadd(3, p_rows, kChunk / 2 * sizeof(uint32_t));
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        _tile_zero(5);
        _tile_loadd(4, v_pairs + d0, D * sizeof(uint32_t));
        _tile_dpbf16ps(5, 3, 4);
        _tile_stored(5, pv + d0, D * sizeof(float));
      }
      add_values<kLanes>(acc + rt * kLanes * D, pv, alphas, n, D);
    }
  }

  if (folds) {
    fold_rows();
    finish_rows(w, rows, group, D, q_row0, num_heads, merged, merged_max, merged_sum, out, partial_acc, partial_max,
                partial_sum);
  } else {
    finish_tile_rows<kLanes>(w, rows, group, D, q_row0, num_heads, scale, acc, row_max, row_sum, ordered, out,
                             partial_acc, partial_max, partial_sum);
  }
}

#endif  // PAGEDLLM_AMX

template <typename scalar_t, typename cache_t>
void run_item(const WorkItem& w, const scalar_t* query, const cache_t* kv_cache, const int64_t* block_table,
              int64_t q_row0, int64_t seq_len, int64_t query_len, int64_t num_heads, int64_t num_kv_heads,
              CacheStrides cs, const c10::BFloat16* kv_scales, CacheStrides ss, int64_t block_size,
              int64_t head_dim, float scale, int64_t window, float soft_cap, scalar_t* out,
              float* partial_acc, float* partial_max, float* partial_sum, std::vector<float>& scratch) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows = (w.q_end - w.q_begin) * group;  // row m = (query position - q_begin) * group + g
#if defined(PAGEDLLM_AMX)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
    if (kv_scales == nullptr && window == 0 && soft_cap == 0.f && block_size == 16 && head_dim % 32 == 0 &&
        pagedllm_amx::tiles_permitted()) {
      // (an item of a few rows whose context crosses a split boundary, the last tile of a prefill chunk, takes
      // the prefill path, which folds the rows' results at the boundary)
      const int64_t k_stop = std::min(w.k_end, seq_len - query_len + w.q_end);
      auto tile_path = rows >= 16 || crosses_split(w.k_begin, k_stop, split_tokens(block_size)) ? run_prefill_item_amx
                       : rows > 8                  ? run_decode_item_amx<16>
                                                   : run_decode_item_amx<8>;
      tile_path(w, query, kv_cache, block_table, q_row0, seq_len, query_len, num_heads, num_kv_heads, cs, head_dim,
                scale, out, partial_acc, partial_max, partial_sum, scratch);
      return;
    }
  }
#endif
  const int64_t D = head_dim;
  const int64_t split = split_tokens(block_size);
  // Keys go in chunks of 16 (a block holds whole chunks where block_size is a multiple of 16; otherwise a
  // chunk is a block). With AVX-512 a 16-key chunk is one vector step (chunk_rows) that reads plain
  // fp32/bf16 tiles in place; other caches are widened to fp32 tiles first, and without AVX-512 (or for
  // other chunks) each row takes chunk_row_scalar. The choice depends on the call's shapes and dtypes
  // only, never on the item, so a row's arithmetic is the same in every item that holds it.
  const int64_t chunk = block_size % 16 == 0 ? 16 : block_size;
  bool vector_chunks = false, read_in_place = false, dot_bf16 = false;
#if defined(__AVX512F__)
  vector_chunks = chunk == 16 && D % 16 == 0;
  read_in_place = vector_chunks && (std::is_same_v<cache_t, float> || std::is_same_v<cache_t, c10::BFloat16>) &&
                  kv_scales == nullptr;
#endif
#if defined(__AVX512BF16__)
  dot_bf16 = read_in_place && std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16> &&
             D % 32 == 0;
#endif

  // Query position p sees keys 0..p (with a sliding window, p - window + 1..p) within the item's context
  // range; the tile's last query bounds the keys any row can see, its first query's window start the
  // first key. Blocks before that are never touched: a sliding layer's freed blocks may sit in the block
  // table.
  const int64_t first_pos = seq_len - query_len + w.q_begin;
  const int64_t last_pos = seq_len - query_len + w.q_end - 1;
  const int64_t k_stop = std::min(w.k_end, last_pos + 1);
  auto first_key = [&](int64_t pos) { return window > 0 ? std::max(w.k_begin, pos - window + 1) : w.k_begin; };
  const int64_t k_first = first_key(first_pos);
  const bool folds = crosses_split(k_first, k_stop, split);  // (a prefill tile over a long context)

  // q [rows][D] (scaled), acc [rows][D], row max and sum [rows], K and V tiles [block_size][D] (widened),
  // a padded V chunk [16][D] (in place), scores [chunk], probs [rows][16], alpha [rows], masks [rows],
  // q_bf16 [rows][D] 16-bit (half as many floats' room, rounded up), and when the item folds the merged
  // accumulator [rows][D], max and sum [rows].
  const int64_t merged_floats = folds ? rows * D + 2 * rows : 0;
  scratch.resize(2 * rows * D + 2 * rows + 2 * block_size * D + 16 * D + chunk + rows * 16 + 2 * rows +
                 (rows * D + 1) / 2 + merged_floats);
  float* q = scratch.data();
  float* acc = q + rows * D;
  float* row_max = acc + rows * D;
  float* row_sum = row_max + rows;
  float* k_tile = row_sum + rows;
  float* v_tile = k_tile + block_size * D;
  cache_t* v_pad = reinterpret_cast<cache_t*>(v_tile + block_size * D);
  float* scores = v_tile + block_size * D + 16 * D;
  float* probs = scores + chunk;
  float* alpha = probs + rows * 16;
  uint32_t* masks = reinterpret_cast<uint32_t*>(alpha + rows);
  uint16_t* q_bf16 = reinterpret_cast<uint16_t*>(masks + rows);
  float* merged = reinterpret_cast<float*>(masks + rows) + (rows * D + 1) / 2;
  float* merged_max = merged + rows * D;
  float* merged_sum = merged_max + rows;

  for (int64_t t = w.q_begin; t < w.q_end; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t m = (t - w.q_begin) * group + g;
      const scalar_t* q_src = query + ((q_row0 + t) * num_heads + w.kv_head * group + g) * D;
      if (dot_bf16) std::memcpy(q_bf16 + m * D, q_src, D * sizeof(uint16_t));
      to_float(q_src, q + m * D, D);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) q[m * D + d] *= scale;
    }
  }
  auto reset_rows = [&] {
    std::fill(acc, acc + rows * D, 0.f);
    std::fill(row_max, row_max + rows, kNegInf);
    std::fill(row_sum, row_sum + rows, 0.f);
  };
  reset_rows();
  if (folds) std::fill(merged_sum, merged_sum + rows, 0.f);
  auto fold_rows = [&] {
    for (int64_t m = 0; m < rows; ++m)
      fold_partial(row_max[m], row_sum[m], acc + m * D, merged_max[m], merged_sum[m], merged + m * D, D);
    reset_rows();
  };
  // The keys [lo, hi) of the chunk at key0 that row m sees (lo >= hi: none).
  auto visible = [&](int64_t m, int64_t key0, int64_t& lo, int64_t& hi) {
    const int64_t pos = first_pos + m / group;
    lo = std::clamp<int64_t>(first_key(pos) - key0, 0, chunk);
    hi = std::clamp<int64_t>(std::min(pos + 1, w.k_end) - key0, 0, chunk);
  };

  // The last row's first key: a chunk from there on to the first row's position every row sees whole.
  const int64_t last_row_lo = first_key(last_pos);
  bool whole_masks = false;  // masks hold every key of a chunk for every row
  const int64_t tile_elems = block_size * D;  // a tile's elements (its scales follow closely)
  for (int64_t kb = k_first; kb < k_stop; kb = (kb / block_size + 1) * block_size) {
    const int64_t logical = kb / block_size;
    const int64_t block_start = logical * block_size;
    if (folds && kb > k_first && block_start % split == 0) fold_rows();
    const int64_t j0 = kb - block_start;
    const int64_t j1 = std::min(block_size, k_stop - block_start);
    const int64_t physical = block_table[logical];
    const cache_t* k_src = kv_cache + w.kv_head * cs.head + physical * cs.block;
    const cache_t* v_src = k_src + cs.part;
    // Blocks sit anywhere in the pool, so hardware prefetchers stop at every block boundary: ask for the
    // block kPrefetchBlocks ahead in the table while this one is computed (the first ones were asked
    // for before the item started; see prefetch_item).
    if (block_start + kPrefetchBlocks * block_size < k_stop) {
      prefetch_tile(kv_cache + w.kv_head * cs.head + block_table[logical + kPrefetchBlocks] * cs.block, cs.part,
                    tile_elems);
    }
    if (read_in_place) {
      // Closer in, into L1: this block's V while its scores are computed, and the block
      // kNearPrefetchBlocks ahead (on its way to L2). Decode's compute per block is short next to a
      // miss, so a tile still in L2 when its loads come stalls them (see docs/performance/amd-zen4.md).
      prefetch_lines<3>(v_src, tile_elems * static_cast<int64_t>(sizeof(cache_t)));
      if (block_start + kNearPrefetchBlocks * block_size < k_stop) {
        prefetch_tile<3>(kv_cache + w.kv_head * cs.head + block_table[logical + kNearPrefetchBlocks] * cs.block,
                         cs.part, tile_elems);
      }
    } else {
      // Keys outside j0..j1 are no row's: zero, so that the products with their zero probabilities are 0.
      const c10::BFloat16* k_scales = kv_scales ? kv_scales + w.kv_head * ss.head + physical * ss.block : nullptr;
      const c10::BFloat16* v_scales = kv_scales ? k_scales + ss.part : nullptr;
      rows_to_float(k_src, k_tile, j0, j1, D, k_scales);
      rows_to_float(v_src, v_tile, j0, j1, D, v_scales);
      for (float* tile : {k_tile, v_tile}) {
        std::fill(tile, tile + j0 * D, 0.f);
        std::fill(tile + j1 * D, tile + block_size * D, 0.f);
      }
    }
    for (int64_t c = j0 / chunk * chunk; c < j1; c += chunk) {
      const int64_t key0 = block_start + c;
      // The rows that see a key of the chunk: positions (and window starts) grow with m, so they are
      // consecutive, m_lo..m_hi. Most chunks every row sees whole.
      int64_t m_lo = rows, m_hi = 0;
      const bool whole = key0 + chunk <= std::min(first_pos + 1, w.k_end) && key0 >= last_row_lo;
      if (whole && !whole_masks && vector_chunks) {  // (masks: the vector path's, 16 keys)
        std::fill(masks, masks + rows, uint32_t{0xFFFF});
        whole_masks = true;
      }
      if (whole) m_lo = 0, m_hi = rows;
      for (int64_t m = 0; m < rows && !whole; ++m) {
        int64_t lo, hi;
        visible(m, key0, lo, hi);
        if (lo >= hi) continue;
        m_lo = std::min(m_lo, m);
        m_hi = m + 1;
        if (vector_chunks) masks[m] = (uint32_t{1} << hi) - (uint32_t{1} << lo);
        whole_masks = false;
      }
      if (m_lo >= m_hi) continue;
#if defined(__AVX512F__)
      if (vector_chunks) {
        if constexpr (std::is_same_v<cache_t, float> || std::is_same_v<cache_t, c10::BFloat16>) {
          if (read_in_place) {
            const cache_t* v_chunk = v_src + c * D;
            if (c < j0 || c + 16 > j1) {  // keys outside j0..j1 are no row's: zero values
              std::fill(v_pad, v_pad + 16 * D, cache_t(0.f));
              const int64_t a = std::max(c, j0), b = std::min(c + 16, j1);
              std::memcpy(v_pad + (a - c) * D, v_src + a * D, (b - a) * D * sizeof(cache_t));
              v_chunk = v_pad;
            }
            chunk_rows(q + m_lo * D, dot_bf16 ? q_bf16 + m_lo * D : nullptr, k_src + c * D, v_chunk, m_hi - m_lo,
                       masks + m_lo, D, scale, soft_cap, row_max + m_lo, row_sum + m_lo, acc + m_lo * D, probs,
                       alpha);
            continue;
          }
        }
        chunk_rows<float>(q + m_lo * D, nullptr, k_tile + c * D, v_tile + c * D, m_hi - m_lo, masks + m_lo, D, scale,
                          soft_cap, row_max + m_lo, row_sum + m_lo, acc + m_lo * D, probs, alpha);
        continue;
      }
#endif
      for (int64_t m = m_lo; m < m_hi; ++m) {
        int64_t lo, hi;
        visible(m, key0, lo, hi);
        chunk_row_scalar(q + m * D, k_tile + c * D, v_tile + c * D, lo, hi, D, soft_cap, scores, row_max[m],
                         row_sum[m], acc + m * D);
      }
    }
  }

  if (folds) {
    fold_rows();
    finish_rows(w, rows, group, D, q_row0, num_heads, merged, merged_max, merged_sum, out, partial_acc, partial_max,
                partial_sum);
  } else {
    finish_rows(w, rows, group, D, q_row0, num_heads, acc, row_max, row_sum, out, partial_acc, partial_max,
                partial_sum);
  }
}

template <typename scalar_t, typename cache_t>
void paged_attention_impl(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                          at::Tensor& out, const c10::optional<at::Tensor>& kv_scales, int64_t window,
                          double soft_cap) {
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(3);
  const CacheStrides cs{kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2)};
  const c10::BFloat16* scales_ptr = nullptr;
  CacheStrides ss{0, 0, 0};
  if (kv_scales.has_value()) {
    scales_ptr = reinterpret_cast<const c10::BFloat16*>(kv_scales->data_ptr());
    ss = CacheStrides{kv_scales->stride(0), kv_scales->stride(1), kv_scales->stride(2)};
  }
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();

  // Decode-like sequences (one query tile) get one item per split; longer chunks one item per tile.
  const int64_t split = split_tokens(block_size);
  std::vector<WorkItem> items;
  struct Merge { int64_t seq, kv_head, first_row, num_splits, query_len; };
  std::vector<Merge> merges;
  int64_t num_partial_rows = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = starts[s + 1] - starts[s];
    const int64_t seq_len = lens[s];
    TORCH_CHECK(query_len >= 0 && seq_len >= query_len && (seq_len + block_size - 1) / block_size <= max_blocks,
                "paged_attention: sequence ", s, " has query_len ", query_len, " and seq_len ", seq_len);
    if (query_len == 0) continue;
    // The first key a query at `pos` sees. Splits stay on fixed boundaries (batch invariance); those
    // wholly before the first query's window are not made at all.
    auto first_key = [&](int64_t pos) {
      return window > 0 ? std::max<int64_t>(0, pos - window + 1) : int64_t{0};
    };
    const int64_t first_split = first_key(seq_len - query_len) / split;
    const int64_t num_splits = query_len <= kQueryTile ? (seq_len + split - 1) / split - first_split : 1;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      if (num_splits > 1) {
        merges.push_back({s, h, num_partial_rows, num_splits, query_len});
        for (int64_t p = first_split; p < first_split + num_splits; ++p) {
          items.push_back({s, h, 0, query_len, std::max(p * split, first_key(seq_len - query_len)),
                           std::min(seq_len, (p + 1) * split), num_partial_rows});
          num_partial_rows += query_len * group;
        }
      } else {
        for (int64_t t = 0; t < query_len; t += kQueryTile) {
          items.push_back({s, h, t, std::min(query_len, t + kQueryTile), first_key(seq_len - query_len + t),
                           seq_len, -1});
        }
      }
    }
  }
  // Partial results, split after split: [query_len * group rows][head_dim] each. Every row is written
  // before the merge reads it, so the buffers are kept from call to call (per calling thread) and never
  // cleared: fresh, zeroed megabytes every layer cost page faults and a memset comparable to the reads.
  // A step needing more than kKeptPartialFloats (hundreds of long sequences) gets buffers for this call
  // only, so that one such step does not pin them for the process's life. (The references are bound
  // here: inside the lambdas below, a thread_local's name would mean the worker thread's own copy.)
  thread_local std::vector<float> kept_buffers[3];
  std::vector<float> call_buffers[3];
  std::vector<float>* partial_buffers =
      num_partial_rows * (head_dim + 2) <= kKeptPartialFloats ? kept_buffers : call_buffers;
  std::vector<float>& partial_acc = partial_buffers[0];
  std::vector<float>& partial_max = partial_buffers[1];
  std::vector<float>& partial_sum = partial_buffers[2];
  if (static_cast<int64_t>(partial_max.size()) < num_partial_rows) {
    partial_max.resize(num_partial_rows);
    partial_sum.resize(num_partial_rows);
  }
  if (static_cast<int64_t>(partial_acc.size()) < num_partial_rows * head_dim) partial_acc.resize(num_partial_rows * head_dim);

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* cache_ptr = reinterpret_cast<const cache_t*>(kv_cache.data_ptr());
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
#if defined(PAGEDLLM_AMX)
    t_item_config = kNoItemConfig;
#endif
    if (begin < end) {
      prefetch_item(items[begin], cache_ptr, tables + items[begin].seq * max_blocks, cs, block_size, head_dim);
    }
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& w = items[i];
      if (i + 1 < end) {
        prefetch_item(items[i + 1], cache_ptr, tables + items[i + 1].seq * max_blocks, cs, block_size, head_dim);
      }
      const int64_t query_len = starts[w.seq + 1] - starts[w.seq];
      run_item<scalar_t, cache_t>(w, q_ptr, cache_ptr, tables + w.seq * max_blocks, starts[w.seq], lens[w.seq],
                                  query_len, num_heads, num_kv_heads, cs, scales_ptr, ss, block_size, head_dim,
                                  fscale, window, static_cast<float>(soft_cap), out_ptr, partial_acc.data(),
                                  partial_max.data(), partial_sum.data(),
                                  scratch);
    }
  });

  // Exact merge of each row's splits, folded in order (fold_partial), then normalised.
  at::parallel_for(0, static_cast<int64_t>(merges.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const Merge& mg = merges[i];
      const int64_t rows = mg.query_len * group;
      for (int64_t m = 0; m < rows; ++m) {
        float merged_max = kNegInf, total = 0.f;
        for (int64_t p = 0; p < mg.num_splits; ++p) {
          const int64_t slot = mg.first_row + p * rows + m;
          fold_partial(partial_max[slot], partial_sum[slot], partial_acc.data() + slot * head_dim, merged_max, total,
                       merged.data(), head_dim);
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] *= inv;
        const int64_t t = m / group;
        const int64_t head = mg.kv_head * group + m % group;
        from_float(merged.data(), out_ptr + ((starts[mg.seq] + t) * num_heads + head) * head_dim, head_dim);
      }
    }
  });
}

template <typename scalar_t>
void dispatch_cache(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale, at::Tensor& out,
                    const c10::optional<at::Tensor>& kv_scales, int64_t window, double soft_cap) {
  switch (kv_cache.scalar_type()) {
    case at::kChar:
      return paged_attention_impl<scalar_t, int8_t>(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                                                    out, kv_scales, window, soft_cap);
    case at::kFloat:
      return paged_attention_impl<scalar_t, float>(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                                   kv_scales, window, soft_cap);
    case at::kBFloat16:
      return paged_attention_impl<scalar_t, c10::BFloat16>(query, kv_cache, block_tables, seq_lens, query_start_loc,
                                                           scale, out, kv_scales, window, soft_cap);
    case at::kHalf:
      return paged_attention_impl<scalar_t, c10::Half>(query, kv_cache, block_tables, seq_lens, query_start_loc,
                                                       scale, out, kv_scales, window, soft_cap);
    case at::kFloat8_e4m3fn:
      return paged_attention_impl<scalar_t, c10::Float8_e4m3fn>(query, kv_cache, block_tables, seq_lens,
                                                                query_start_loc, scale, out, kv_scales, window, soft_cap);
    case at::kFloat8_e5m2:
      return paged_attention_impl<scalar_t, c10::Float8_e5m2>(query, kv_cache, block_tables, seq_lens,
                                                              query_start_loc, scale, out, kv_scales, window, soft_cap);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported kv cache dtype ", kv_cache.scalar_type());
  }
}

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale, at::Tensor out,
                     const c10::optional<at::Tensor>& kv_scales, int64_t sliding_window,
                     double logits_soft_cap) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous() && out.is_contiguous() && out.sizes() == query.sizes() &&
                  out.scalar_type() == query.scalar_type(),
              "paged_attention: query and out must be contiguous [num_tokens, num_heads, head_dim] of one dtype");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.stride(4) == 1 &&
                  kv_cache.stride(3) == kv_cache.size(4) && kv_cache.size(4) == query.size(2) &&
                  query.size(2) <= 1024 && query.size(1) % kv_cache.size(1) == 0,
              "paged_attention: kv_cache must be [2, num_kv_heads, num_blocks, block_size, head_dim] with "
              "contiguous [block_size, head_dim] tiles");
  const bool one_byte = kv_cache.scalar_type() == at::kChar || kv_cache.scalar_type() == at::kFloat8_e4m3fn ||
                        kv_cache.scalar_type() == at::kFloat8_e5m2;
  // A one-byte cache without scales reads its codes as values (scale 1).
  TORCH_CHECK(one_byte || !kv_scales.has_value(), "paged_attention: kv_scales go with one-byte caches only");
  if (kv_scales.has_value()) {
    TORCH_CHECK(kv_scales->scalar_type() == at::kBFloat16 && kv_scales->dim() == 4 && kv_scales->stride(3) == 1 &&
                    kv_scales->size(1) == kv_cache.size(1) && kv_scales->size(3) == kv_cache.size(3),
                "paged_attention: kv_scales must be bf16 [2, num_kv_heads, num_blocks, block_size]");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1,
              "paged_attention: block_tables, seq_lens and query_start_loc must be contiguous int64");
  TORCH_CHECK(sliding_window >= 0 && logits_soft_cap >= 0,
              "paged_attention: sliding_window and logits_soft_cap must be >= 0 (0: none)");
  const int64_t window = sliding_window;
  const double soft_cap = logits_soft_cap;
  switch (query.scalar_type()) {
    case at::kFloat:
      return dispatch_cache<float>(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, out, kv_scales,
                                 window, soft_cap);
    case at::kBFloat16:
      return dispatch_cache<c10::BFloat16>(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, out, kv_scales,
                                 window, soft_cap);
    case at::kHalf:
      return dispatch_cache<c10::Half>(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, out, kv_scales,
                                 window, soft_cap);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported query dtype ", query.scalar_type());
  }
}

// K and V of this step's tokens into their slots, one pass over both (vLLM's reshape_and_cache).
template <typename src_t, typename cache_t>
void write_kv_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = kv_cache.size(1);
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  const int64_t D = kv_cache.size(4);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const src_t* k = key.data_ptr<src_t>();
  const src_t* v = value.data_ptr<src_t>();
  const int64_t k_stride = key.stride(0), v_stride = value.stride(0);
  const int64_t k_head_stride = key.stride(1), v_head_stride = value.stride(1);
  cache_t* cache = reinterpret_cast<cache_t*>(kv_cache.data_ptr());
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        cache_t* k_dst = cache + (h * num_slots + slot) * D;
        cache_t* v_dst = cache + ((num_kv_heads + h) * num_slots + slot) * D;
        const src_t* k_src = k + t * k_stride + h * k_head_stride;
        const src_t* v_src = v + t * v_stride + h * v_head_stride;
        if constexpr (std::is_same_v<src_t, cache_t>) {  // c10's 16-bit casts are scalar calls: copy bytes
          std::memcpy(k_dst, k_src, D * sizeof(cache_t));
          std::memcpy(v_dst, v_src, D * sizeof(cache_t));
        } else {
          for (int64_t d = 0; d < D; ++d) {
            k_dst[d] = static_cast<cache_t>(k_src[d]);
            v_dst[d] = static_cast<cache_t>(v_src[d]);
          }
        }
      }
    }
  });
}

template <typename src_t>
void write_kv_dispatch(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat: return write_kv_impl<src_t, float>(key, value, kv_cache, slot_mapping);
    case at::kBFloat16: return write_kv_impl<src_t, c10::BFloat16>(key, value, kv_cache, slot_mapping);
    case at::kHalf: return write_kv_impl<src_t, c10::Half>(key, value, kv_cache, slot_mapping);
    case at::kFloat8_e4m3fn: return write_kv_impl<src_t, c10::Float8_e4m3fn>(key, value, kv_cache, slot_mapping);
    case at::kFloat8_e5m2: return write_kv_impl<src_t, c10::Float8_e5m2>(key, value, kv_cache, slot_mapping);
    default: TORCH_CHECK(false, "write_kv: unsupported kv cache dtype ", kv_cache.scalar_type());
  }
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1 && key.sizes() == value.sizes() &&
                  key.scalar_type() == value.scalar_type(),
              "write_kv: key and value must be [num_tokens, num_kv_heads, head_dim] with unit stride in head_dim");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(1) == key.size(1) &&
                  kv_cache.size(4) == key.size(2),
              "write_kv: kv_cache must be contiguous [2, num_kv_heads, num_blocks, block_size, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "write_kv: slot_mapping must be contiguous int64 [num_tokens]");
  switch (key.scalar_type()) {
    case at::kFloat: return write_kv_dispatch<float>(key, value, kv_cache, slot_mapping);
    case at::kBFloat16: return write_kv_dispatch<c10::BFloat16>(key, value, kv_cache, slot_mapping);
    case at::kHalf: return write_kv_dispatch<c10::Half>(key, value, kv_cache, slot_mapping);
    default: TORCH_CHECK(false, "write_kv: unsupported key dtype ", key.scalar_type());
  }
}

// One-byte caches: each token's K and V row of each head gets scale = amax / qmax (or the layer's static
// scale), rounded to bf16, and codes round(x / scale) clamped to +-qmax: the same arithmetic as
// quant.write_rows in torch, element for element.
template <typename code_t>
inline code_t encode(float y, float qmax) {
  y = std::min(std::max(y, -qmax), qmax);
  if constexpr (std::is_same_v<code_t, int8_t>) {
    return static_cast<int8_t>(std::nearbyint(y));
  } else {
    return static_cast<code_t>(y);
  }
}

template <typename src_t, typename code_t>
void write_kv_quant_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& codes, at::Tensor& scales,
                         const at::Tensor& slot_mapping, const float* static_scales, float qmax) {
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = codes.size(1);
  const int64_t block_size = codes.size(3);
  const int64_t D = codes.size(4);
  const CacheStrides cs{codes.stride(0), codes.stride(1), codes.stride(2)};
  const CacheStrides ss{scales.stride(0), scales.stride(1), scales.stride(2)};
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  code_t* code_ptr = reinterpret_cast<code_t*>(codes.data_ptr());
  c10::BFloat16* scale_ptr = reinterpret_cast<c10::BFloat16*>(scales.data_ptr());
  const src_t* srcs[2] = {key.data_ptr<src_t>(), value.data_ptr<src_t>()};
  const int64_t tok_strides[2] = {key.stride(0), value.stride(0)};
  const int64_t head_strides[2] = {key.stride(1), value.stride(1)};
  const float tiny = std::numeric_limits<float>::min();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t part = 0; part < 2; ++part) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          to_float(srcs[part] + t * tok_strides[part] + h * head_strides[part], row.data(), D);
          float sc;
          if (static_scales != nullptr) {
            sc = static_scales[part];
          } else {
            float amax = 0.f;
            for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(row[d]));
            sc = std::max(amax / qmax, tiny);
          }
          const c10::BFloat16 stored(sc);
          const float used = bf16_to_float(stored);
          code_t* dst = code_ptr + part * cs.part + h * cs.head + block * cs.block + offset * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = encode<code_t>(row[d] / used, qmax);
          scale_ptr[part * ss.part + h * ss.head + block * ss.block + offset] = stored;
        }
      }
    }
  });
}

template <typename src_t>
void write_kv_quant_dispatch(const at::Tensor& key, const at::Tensor& value, at::Tensor& codes, at::Tensor& scales,
                             const at::Tensor& slot_mapping, const float* static_scales, double qmax) {
  const float q = static_cast<float>(qmax);
  switch (codes.scalar_type()) {
    case at::kChar: return write_kv_quant_impl<src_t, int8_t>(key, value, codes, scales, slot_mapping, static_scales, q);
    case at::kFloat8_e4m3fn:
      return write_kv_quant_impl<src_t, c10::Float8_e4m3fn>(key, value, codes, scales, slot_mapping, static_scales, q);
    case at::kFloat8_e5m2:
      return write_kv_quant_impl<src_t, c10::Float8_e5m2>(key, value, codes, scales, slot_mapping, static_scales, q);
    default: TORCH_CHECK(false, "write_kv_quant: unsupported code dtype ", codes.scalar_type());
  }
}

void write_kv_quant(const at::Tensor& key, const at::Tensor& value, at::Tensor codes, at::Tensor scales,
                    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& static_scales, double qmax) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1 && key.sizes() == value.sizes() &&
                  key.scalar_type() == value.scalar_type(),
              "write_kv_quant: key and value must be [num_tokens, num_kv_heads, head_dim] with unit stride in head_dim");
  TORCH_CHECK(codes.dim() == 5 && codes.size(0) == 2 && codes.stride(4) == 1 && codes.stride(3) == codes.size(4) &&
                  codes.size(1) == key.size(1) && codes.size(4) == key.size(2) && key.size(2) <= 4096,
              "write_kv_quant: codes must be [2, num_kv_heads, num_blocks, block_size, head_dim] with contiguous tiles");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 4 && scales.stride(3) == 1 &&
                  scales.size(3) == codes.size(3),
              "write_kv_quant: scales must be bf16 [2, num_kv_heads, num_blocks, block_size]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "write_kv_quant: slot_mapping must be contiguous int64 [num_tokens]");
  const float* static_ptr = nullptr;
  if (static_scales.has_value()) {
    TORCH_CHECK(static_scales->scalar_type() == at::kFloat && static_scales->is_contiguous() &&
                    static_scales->numel() == 2,
                "write_kv_quant: static_scales must be fp32 [2]");
    static_ptr = static_scales->data_ptr<float>();
  }
  switch (key.scalar_type()) {
    case at::kFloat: return write_kv_quant_dispatch<float>(key, value, codes, scales, slot_mapping, static_ptr, qmax);
    case at::kBFloat16:
      return write_kv_quant_dispatch<c10::BFloat16>(key, value, codes, scales, slot_mapping, static_ptr, qmax);
    case at::kHalf: return write_kv_quant_dispatch<c10::Half>(key, value, codes, scales, slot_mapping, static_ptr, qmax);
    default: TORCH_CHECK(false, "write_kv_quant: unsupported key dtype ", key.scalar_type());
  }
}

// Which decode path this build has, for benchmarks and logs: it is fixed at compile time by
// -march=native, i.e. by the flags of the CPU that built it (and for AMX, by Linux granting the tiles).
std::string paged_attention_isa() {
#if defined(PAGEDLLM_AMX)
  // bf16 query and cache, block size 16, head_dim a multiple of 32: decode and prefill on the tiles
  if (pagedllm_amx::tiles_permitted()) return "amx_bf16";
#endif
#if defined(__AVX512BF16__)
  return "avx512_bf16";  // bf16 query and cache: _mm512_dpbf16_ps; fp32: AVX-512 FMAs
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "generic";  // the compiler's vectorisation of the omp simd loops (AVX2 where the CPU has it)
#endif
}

}  // namespace

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("paged_attention_isa() -> str", &paged_attention_isa);
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, Tensor(a!) out, Tensor? kv_scales=None, int sliding_window=0, "
        "float logits_soft_cap=0.0) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("write_kv_quant(Tensor key, Tensor value, Tensor(a!) codes, Tensor(b!) scales, Tensor slot_mapping, "
        "Tensor? static_scales, float qmax) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
  m.impl("write_kv_quant", &write_kv_quant);
}
