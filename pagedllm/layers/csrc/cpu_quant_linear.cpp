// y = x W^T for weight-only quantized linears (4-, 5-, 6- and 8-bit unsigned integers with a scale and a
// min per group of input channels: w = q * scale + min), on CPUs with AVX512-VNNI.
//
// The activations are quantized too, each row on its own, in blocks of up to 128 (activation_block; x ~ d
// * xq, xq int8, d the block's absmax / 127, as llama.cpp's Q8_0, plus a second int8 term for the
// remainder: see QuantizedRows), so the inner loop is an integer dot product: VPDPBUSD multiplies the
// unsigned weight bytes by the signed activation bytes and sums four products into each int32 lane. Per
// unit of min(block, group) input channels the int32 sums are scaled by d into fp32; per group,
// by the weight's scale, and the min term is min * sum(d * xq) over the group (the row's group sums are
// computed once per call). 8-bit weights are stored unsigned (q + 128 for signed int8: min = -128 * scale).
//
// Layout (packed by the Python side, layers/quantization/vnni.py): output features in tiles of 16; a
// tile's weights k-major, 4 consecutive k per feature in each 32-bit lane, so one 64-byte vector is 16
// features x 4 k and one broadcast of 4 activation bytes feeds all 16 features (no horizontal sums):
//   8-bit: per tile [K / 4][16][4] bytes
//   4-bit: per tile [K / 8][64] bytes, byte i holding k-quad 2t (low nibble) and 2t + 1 (high) of lane i / 4
//   5- and 6-bit (GGUF's Q5 and Q6 types as stored): the low 4 bits as 4-bit weights, and the rest in bit
//   planes, per tile [K / 8][planes][2] 64-bit masks, bit i of mask (p, h) the bit 4 + p of byte i of
//   the vector of k-quad 2t + h, added to the nibbles by a masked byte add
// scales and mins: [N / 16][K / G][16], fp32 or fp16 (fp16 where every value is exact in it), or int8 for
// GGUF's K-quants with fp16 multipliers per super-block [N / 16][K / 256][d, -dmin][16]. A symmetric
// weight (min = -2^(bits - 1) * scale: Q4_0, Q5_0, Q6_K, Q8_0, signed int8, symmetric int4) stores no
// mins: the kernel forms the same min from the scale (a product by a power of two is exact), so it reads
// the file's bytes and not a copy of its scales.
//
// Batch invariance: every row is quantized alone and each output is summed in one fixed order (integer
// sums are exact; the fp32 steps run per row in the same sequence whether the row is computed alone or in
// a block of four); threads split the output tiles, never k. Rows are computed four at a time per tile so
// a batch loads (and unpacks) each weight vector once for four rows.
//
// With AMX (amx_int8), batches go sixteen rows at a time through the matrix tiles: per unit of input
// channels one TDPBSUD (signed activations x unsigned weights) per activation term gives the sixteen rows'
// int32 sums for the tile's sixteen outputs, the very integers VPDPBUSD sums (integer sums are exact in
// any order), and the same fp32 steps follow per row. So a row's result is bit for bit the same whichever
// of the two computed it, and the split between them may follow the batch size.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "amx.h"
#include "blocked_bf16.h"

#include <algorithm>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PAGEDLLM_QLINEAR 1
#endif

// fp32 models (qlinear_fp32): the same weights, multiplied without quantizing the activations, on any CPU
// with AVX2, FMA and F16C (AVX-512 CPUs included).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDLLM_QLINEAR_FP32 1
#endif

namespace {

bool qlinear_supports() {
#ifdef PAGEDLLM_QLINEAR
  return true;
#else
  return false;
#endif
}

#if defined(PAGEDLLM_QLINEAR) || defined(PAGEDLLM_QLINEAR_FP32)
constexpr int kTile = 16;       // output features per tile (one zmm, or two ymm, of fp32 / int32 lanes)
constexpr int kBlock = 32;      // K is a multiple of it: the smallest activation quantization block

// A weight of `bits` is stored as 8-bit bytes, or as 4-bit nibbles plus one bit plane per bit above 4.
constexpr int64_t low_bits(int64_t bits) { return bits == 8 ? 8 : 4; }
constexpr int64_t bit_planes(int64_t bits) { return bits == 8 ? 0 : bits - 4; }

// One weight tile's pointers: its packed bytes, bit planes (5- and 6-bit weights), scales and mins (null for
// a symmetric weight, whose min is min_factor * scale), and for int8 scales (GGUF's K-quants) the fp16
// multipliers of each super-block of groups_per_super groups: [super][d, -dmin][16].
template <typename S>
struct TileWeights {
  const uint8_t* w;
  const uint64_t* high;
  const S* scales;
  const S* mins;
  float min_factor;
  const uint16_t* super;
  int64_t groups_per_super;
};

// Calls f(std::integral_constant<int, B>{}) with the weight's bits B (4, 5, 6 or 8) as a constant.
template <typename F>
void with_bits_constant(int64_t bits, F&& f) {
  switch (bits) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// Calls f(scales, mins, super, supers) with the weight's scales typed as stored (fp32, fp16, or int8 with the
// K-quants' fp16 super-block multipliers); mins null for a symmetric weight.
template <int BITS, typename F>
void with_typed_scales(const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& super, F&& f) {
  const bool symmetric = mins.numel() == 0;
  auto half = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
  if (scales.scalar_type() == at::kFloat) {
    f(scales.data_ptr<float>(), symmetric ? nullptr : mins.data_ptr<float>(), nullptr, int64_t{0});
  } else if (scales.scalar_type() == at::kHalf) {
    f(half(scales), symmetric ? nullptr : half(mins), nullptr, int64_t{0});
  } else if constexpr (BITS != 8) {  // K-quants: 4 to 6 bits
    f(scales.data_ptr<int8_t>(), symmetric ? nullptr : mins.data_ptr<int8_t>(), half(super), super.size(1));
  } else {
    TORCH_CHECK(false, "qlinear: int8 scales (K-quants) are for 4- to 6-bit weights");
  }
}

inline const uint64_t* bit_plane_words(const at::Tensor& high) {
  return high.numel() ? reinterpret_cast<const uint64_t*>(high.data_ptr<uint8_t>()) : nullptr;
}

// What a symmetric weight's min is in units of its scale: -2^(bits - 1).
constexpr float symmetric_min_factor(int bits) { return -static_cast<float>(1 << (bits - 1)); }
#endif

#ifdef PAGEDLLM_QLINEAR

constexpr int kMaxBlock = 128;  // the largest
constexpr int kRows = 4;        // rows computed together per tile
constexpr int kRowChunk = 64;   // rows whose quantized activations stay in L2 while a thread's tiles pass


// The activation quantization block of a weight with K inputs in groups of `group`: the largest of 128,
// 64 and 32 that divides K and that the group divides or is a multiple of. An int32 partial sum spans a
// unit, min(block, group) input channels, and each unit's sum is scaled into fp32 once: with blocks of
// 32, a group of 128 took four rescales (and, on the tiles, four stores of the int32 sums), which bound
// the integer path near half the bf16 tiles' speed. It depends on the weight's shape alone, so every row
// count quantizes a row alike.
inline int64_t activation_block(int64_t k, int64_t group) {
  for (int64_t b = kMaxBlock; b > kBlock; b /= 2)
    if (k % b == 0 && (group % b == 0 || b % group == 0)) return b;
  return kBlock;
}

// Per call: the quantized activations of every row, in one or two int8 terms per activation block (a setting
// of the process, the same for every row), x ~ d * xq + d2 * xq2 (xq2 quantizes what d * xq leaves over,
// at most d / 2: about 15 bits against the block's absmax, where one int8 term, 8 bits, cost a real 135M
// model 1.5% of its teacher-forced top-1 tokens; the second term doubles the integer products), the
// block scales, and the group sums sum(x^) per weight group (xs [M, K / G]).
struct QuantizedRows {
  std::vector<int8_t> xq, xq2;
  std::vector<float> d, d2;
  std::vector<float> xs;
};

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// fp16 scales are stored as raw uint16.
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A block's n vectors of 16 values -> int8 codes at scale absmax / 127 (round to nearest even;
// |v * inv| <= 127, no saturation), written to out; returns the scale, and each vector's code sum in sums.
inline float quantize_block(const __m512* v, int n, int8_t* out, int32_t* sums) {
  __m512 m = _mm512_abs_ps(v[0]);
  for (int i = 1; i < n; ++i) m = _mm512_max_ps(m, _mm512_abs_ps(v[i]));
  const float absmax = _mm512_reduce_max_ps(m);
  const __m512 vinv = _mm512_set1_ps(absmax > 0.0f ? 127.0f / absmax : 0.0f);
  for (int i = 0; i < n; ++i) {
    const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * i), _mm512_cvtsepi32_epi8(codes));
    sums[i] = _mm512_reduce_add_epi32(codes);
  }
  return absmax / 127.0f;
}

// Rows r0..r1 of x quantized into q (sized for all m rows). (No FMA contraction: the group sums add the two
// terms' products, each rounded, as the min term's reference in tests/test_vnni_kernel.py does; a fused
// multiply-add would round once.)
template <typename T>
__attribute__((optimize("fp-contract=off"))) void quantize_row_range(const T* x, int64_t r0, int64_t r1, int64_t k,
                                                                     int64_t stride, int64_t group, int64_t block,
                                                                     int terms, QuantizedRows& q) {
  const int64_t blocks = k / block, groups = k / group, pieces = block / 16;
  std::vector<float> sum16(k / 16);  // d * sum(xq) + d2 * sum(xq2) per 16 input channels
  __m512 v[kMaxBlock / 16];
  int32_t sums[kMaxBlock / 16];
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + r * stride;
    int8_t* out = q.xq.data() + r * k;
    int8_t* out2 = terms == 2 ? q.xq2.data() + r * k : nullptr;
    float* d = q.d.data() + r * blocks;
    float* d2 = terms == 2 ? q.d2.data() + r * blocks : nullptr;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t i = 0; i < pieces; ++i) v[i] = load16(row + b * block + 16 * i);
      const float scale = quantize_block(v, static_cast<int>(pieces), out + b * block, sums);
      d[b] = scale;
      for (int64_t i = 0; i < pieces; ++i) sum16[b * pieces + i] = scale * static_cast<float>(sums[i]);
      if (terms == 2) {
        // the remainder, rounded once (a fused multiply-subtract)
        const __m512 vscale = _mm512_set1_ps(scale);
        for (int64_t i = 0; i < pieces; ++i) {
          const __m512i codes = _mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(out + b * block + 16 * i)));
          v[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(codes), vscale, v[i]);
        }
        const float scale2 = quantize_block(v, static_cast<int>(pieces), out2 + b * block, sums);
        d2[b] = scale2;
        for (int64_t i = 0; i < pieces; ++i) sum16[b * pieces + i] += scale2 * static_cast<float>(sums[i]);
      }
    }
    // sum(x^) per weight group, its 16-wide pieces added in order
    float* xs = q.xs.data() + r * groups;
    const int64_t group_pieces = group / 16;
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t p = g * group_pieces; p < (g + 1) * group_pieces; ++p) sum += sum16[p];
      xs[g] = sum;
    }
  }
}

// Every row of x quantized alone (so a row's codes do not depend on the others): by the calling thread for
// a few rows (a row takes about a microsecond per thousand channels, less than a parallel region's barrier
// on a busy machine), split over the threads from kParallelQuantRows rows on (a prefill chunk's).
constexpr int64_t kParallelQuantRows = 32;
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t stride, int64_t group, int64_t block, int terms,
                   QuantizedRows& q) {
  q.xq.resize(m * k);
  q.d.resize(m * (k / block));
  if (terms == 2) {
    q.xq2.resize(m * k);
    q.d2.resize(m * (k / block));
  }
  q.xs.resize(m * (k / group));
  if (m < kParallelQuantRows) return quantize_row_range(x, 0, m, k, stride, group, block, terms, q);
  at::parallel_for(0, m, kParallelQuantRows / 2, [&](int64_t begin, int64_t end) {
    quantize_row_range(x, begin, end, k, stride, group, block, terms, q);
  });
}

// 16 fp32 results to the output dtype, rounded to nearest even (as c10's conversions round), in vector
// code: a scalar conversion per element costs as much as the products in a large-N prefill.
inline void store16(__m512 v, float* dst) { _mm512_storeu_ps(dst, v); }
inline void store16(__m512 v, c10::BFloat16* dst) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(rounded));
}
inline void store16(__m512 v, c10::Half* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Software prefetch of the weight stream prefetch_bytes(BITS) ahead, every line, for one row (a decode
// step): its linears are many short streams (a 576 x 576 projection is 0.2 MB) that the hardware
// prefetcher alone starts late; the lines past a thread's last tile are harmless extra reads. Each loop
// step asks for the lines it reads, as it reads them: asked a unit at a time (4 or 8 lines at once), the
// prefetches waited for the core's line-fill buffers and stalled the loop. Blocks of rows are
// compute-bound, and there the prefetches cost more than they hide (docs/performance/amd-zen4.md). The
// distance is about a memory latency of one core's stream: 2 KiB for 8-bit weights (two lines a loop
// step), 4 KiB for the others (one line a step, with the unpacking), as measured
// (docs/performance/intel-amx.md).
constexpr int64_t prefetch_bytes(int bits) { return bits == 8 ? 2048 : 4096; }
template <int BITS>
inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* line) {
  _mm_prefetch(reinterpret_cast<const char*>(line + prefetch_bytes(BITS)), _MM_HINT_T0);
}


// The group's 16 scales and mins in fp32. K-quant scales are small integers times a per-super-block fp16
// multiplier, formed here as llama.cpp forms them (d * sc, dmin * m): exact in fp32 (11- and 8-bit
// mantissas), so the weight is the one the file describes, in 4.5 (Q4_K) or 6.56 (Q6_K) bits a weight.
template <typename S>
inline __m512 group_scales(const TileWeights<S>& tw, int64_t g) { return load_scales(tw.scales + g * kTile); }
template <typename S>
inline __m512 group_mins(const TileWeights<S>& tw, int64_t g) { return load_scales(tw.mins + g * kTile); }
inline __m512 small_ints(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <>
inline __m512 group_scales<int8_t>(const TileWeights<int8_t>& tw, int64_t g) {
  return _mm512_mul_ps(small_ints(tw.scales + g * kTile), load_scales(tw.super + g / tw.groups_per_super * 2 * kTile));
}
template <>
inline __m512 group_mins<int8_t>(const TileWeights<int8_t>& tw, int64_t g) {
  return _mm512_mul_ps(small_ints(tw.mins + g * kTile),
                       load_scales(tw.super + g / tw.groups_per_super * 2 * kTile + kTile));
}

// The fp32 steps of an output, written once for the VNNI and the AMX paths (which must give the same
// bits): per unit of input channels, each activation term's int32 sum times its block scale added to the
// group's sum; per group, that sum times the weight scale, then the min times the row's sum of the
// group's activations.
inline __attribute__((always_inline)) __m512 add_unit(__m512 facc, __m512i isum, float d) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d), facc);
}
inline __attribute__((always_inline)) __m512 add_group(__m512 acc, __m512 facc, __m512 scale, __m512 min, float xs) {
  return _mm512_fmadd_ps(min, _mm512_set1_ps(xs), _mm512_fmadd_ps(facc, scale, acc));
}
// The tile's R rows of 16 outputs, plus the tile's 16 biases (null: none) in fp32, rounded once to the
// output dtype, as a linear with a bias rounds (a separate add after the store would round twice).
template <int R, typename T>
inline void store_rows(const __m512* acc, const T* bias, T* out, int64_t out_stride) {
  const __m512 b = bias ? load16(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) store16(bias ? _mm512_add_ps(acc[r], b) : acc[r], out + r * out_stride);
}

// The group's 16 scales, and its mins (formed from the scales for a symmetric weight).
template <typename S>
inline __attribute__((always_inline)) void group_scale_min(const TileWeights<S>& tw, int64_t g, __m512& scale,
                                                           __m512& min) {
  scale = group_scales(tw, g);
  min = tw.mins ? group_mins(tw, g) : _mm512_mul_ps(scale, _mm512_set1_ps(tw.min_factor));
}

// A 4- to 6-bit tile's weight bytes for input channels k..k+8 (k a multiple of 8): k-quad 2t in `lo`
// (the low nibbles), 2t + 1 in `hi` (the high ones), each plus its bit planes (5- and 6-bit weights).
template <int BITS, typename S>
inline __attribute__((always_inline)) void unpack_quads(const TileWeights<S>& tw, int64_t k, __m512i& lo,
                                                        __m512i& hi) {
  constexpr int kPlanes = bit_planes(BITS);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i packed = _mm512_loadu_si512(tw.w + k * kTile / 2);
  lo = _mm512_and_si512(packed, nibble);
  hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  if constexpr (kPlanes > 0) {
    const uint64_t* planes = tw.high + k / 8 * kPlanes * 2;
    for (int p = 0; p < kPlanes; ++p) {
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << p));
      lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(planes[2 * p]), lo, bit);
      hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(planes[2 * p + 1]), hi, bit);
    }
  }
}

// One tile of 16 output features for R rows: out[r][0..16) = the rows' sums plus the bias, rounded to T.
template <int BITS, int TERMS, typename S, int R, typename T>
inline void tile_kernel(const TileWeights<S>& tw, const QuantizedRows& q, int64_t row0, int64_t k, int64_t group,
                        int64_t block, const T* bias, T* out, int64_t out_stride) {
  const uint8_t* w = tw.w;
  const int64_t blocks = k / block, groups = k / group;
  const int64_t unit = std::min(group, block);  // input channels per int32 partial sum
  const int8_t* xq[R];
  const int8_t* xq2[R];
  const float* d[R];
  const float* d2[R];
  const float* xs[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = q.xq.data() + (row0 + r) * k;
    xq2[r] = TERMS == 2 ? q.xq2.data() + (row0 + r) * k : nullptr;
    d[r] = q.d.data() + (row0 + r) * blocks;
    d2[r] = TERMS == 2 ? q.d2.data() + (row0 + r) * blocks : nullptr;
    xs[r] = q.xs.data() + (row0 + r) * groups;
  }
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 facc[R];
    for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += unit) {
      // two accumulators per term (the low and high nibbles' k-quads, or alternate quads of bytes), added
      // at the unit's end: half the dependency chain of a long unit, and the same integers
      __m512i iacc[R], iacc2[R], jacc[R], jacc2[R];
      for (int r = 0; r < R; ++r) iacc[r] = iacc2[r] = jacc[r] = jacc2[r] = _mm512_setzero_si512();
      if constexpr (BITS == 8) {
        const uint8_t* wp = w + k0 * kTile;
        for (int64_t kk = 0; kk < unit; kk += 8) {
          if constexpr (R == 1) {  // the two lines this step reads
            prefetch_ahead<BITS>(wp + kk * kTile);
            prefetch_ahead<BITS>(wp + (kk + 4) * kTile);
          }
          const __m512i wa = _mm512_loadu_si512(wp + kk * kTile), wb = _mm512_loadu_si512(wp + (kk + 4) * kTile);
          for (int r = 0; r < R; ++r) {
            int32_t xa, xb;
            std::memcpy(&xa, xq[r] + k0 + kk, 4);
            std::memcpy(&xb, xq[r] + k0 + kk + 4, 4);
            iacc[r] = _mm512_dpbusd_epi32(iacc[r], wa, _mm512_set1_epi32(xa));
            jacc[r] = _mm512_dpbusd_epi32(jacc[r], wb, _mm512_set1_epi32(xb));
            if constexpr (TERMS == 2) {
              std::memcpy(&xa, xq2[r] + k0 + kk, 4);
              std::memcpy(&xb, xq2[r] + k0 + kk + 4, 4);
              iacc2[r] = _mm512_dpbusd_epi32(iacc2[r], wa, _mm512_set1_epi32(xa));
              jacc2[r] = _mm512_dpbusd_epi32(jacc2[r], wb, _mm512_set1_epi32(xb));
            }
          }
        }
      } else {
        const uint8_t* wp = w + k0 * kTile / 2;
        for (int64_t kk = 0; kk < unit; kk += 8) {
          if constexpr (R == 1) prefetch_ahead<BITS>(wp + kk * kTile / 2);  // the line this step reads
          __m512i wlo, whi;
          unpack_quads<BITS>(tw, k0 + kk, wlo, whi);
          for (int r = 0; r < R; ++r) {
            int32_t xb0, xb1;
            std::memcpy(&xb0, xq[r] + k0 + kk, 4);
            std::memcpy(&xb1, xq[r] + k0 + kk + 4, 4);
            iacc[r] = _mm512_dpbusd_epi32(iacc[r], wlo, _mm512_set1_epi32(xb0));
            jacc[r] = _mm512_dpbusd_epi32(jacc[r], whi, _mm512_set1_epi32(xb1));
            if constexpr (TERMS == 2) {
              std::memcpy(&xb0, xq2[r] + k0 + kk, 4);
              std::memcpy(&xb1, xq2[r] + k0 + kk + 4, 4);
              iacc2[r] = _mm512_dpbusd_epi32(iacc2[r], wlo, _mm512_set1_epi32(xb0));
              jacc2[r] = _mm512_dpbusd_epi32(jacc2[r], whi, _mm512_set1_epi32(xb1));
            }
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        facc[r] = add_unit(facc[r], _mm512_add_epi32(iacc[r], jacc[r]), d[r][k0 / block]);
        if constexpr (TERMS == 2)
          facc[r] = add_unit(facc[r], _mm512_add_epi32(iacc2[r], jacc2[r]), d2[r][k0 / block]);
      }
    }
    __m512 s, mn;
    group_scale_min(tw, g, s, mn);
    for (int r = 0; r < R; ++r) acc[r] = add_group(acc[r], facc[r], s, mn, xs[r][g]);
  }
  store_rows<R>(acc, bias, out, out_stride);
}

#if defined(PAGEDLLM_AMX)
constexpr int kAmxRows = 16;  // rows per AMX group: the tiles' 16 rows

constexpr int64_t kAmxStep = 64;  // input channels per TDPBSUD: a tile row holds 64 int8

// The channels of one product: a unit, or 64 of a longer one (whose products add up in the same tiles).
inline int64_t amx_step(int64_t unit) { return std::min(unit, kAmxStep); }

// Tiles: 0 and 1 the int32 sums of the two activation terms [16 rows][16 outputs]; 2 and 3 the terms' int8
// activations [16 rows][step]; 4 a step's unsigned weight bytes [step / 4][16 outputs x 4]. (The next
// unit's products are issued before this unit's fp32 steps, on the same tiles: a second set of tiles
// alternating with the first measured no faster.)
void load_qlinear_amx_config(int64_t unit) {
  const int step = static_cast<int>(amx_step(unit));
  pagedllm_amx::TileConfig config;
  config.tile(0, kAmxRows, 64).tile(1, kAmxRows, 64);
  config.tile(2, kAmxRows, step).tile(3, kAmxRows, step);
  config.tile(4, step / 4, 64);
  config.load();
}

// The tile's weights as the bytes tile 4 reads, [k / 4][16 outputs][4]: 8-bit weights as stored, 4- to
// 6-bit ones unpacked (low nibbles of k-quad 2t, high nibbles of 2t + 1, plus their bit planes) into
// `buffer` (k * 16 bytes), once per row chunk and read by each of its 16-row groups.
template <int BITS, typename S>
inline const uint8_t* tile_weight_bytes(const TileWeights<S>& tw, int64_t k, uint8_t* buffer) {
  if constexpr (BITS == 8) {
    return tw.w;
  } else {
    for (int64_t kk = 0; kk < k; kk += 8) {
      __m512i wlo, whi;
      unpack_quads<BITS>(tw, kk, wlo, whi);
      _mm512_store_si512(buffer + kk / 4 * 64, wlo);
      _mm512_store_si512(buffer + (kk / 4 + 1) * 64, whi);
    }
    return buffer;
  }
}

// One unit's integer sums of the 16 rows into sums[term][row][output].
template <int TERMS>
inline void unit_products(const uint8_t* wbytes, const int8_t* xq, const int8_t* xq2, int64_t k, int64_t k0,
                          int64_t unit, int32_t (*sums)[kAmxRows * kTile]) {
  const uint8_t* b = wbytes + k0 * kTile;
  const int64_t step = amx_step(unit);
  _tile_zero(0);
  if constexpr (TERMS == 2) _tile_zero(1);
  for (int64_t s = 0; s < unit; s += step) {
    _tile_loadd(4, b + s / 4 * 64, 64);
    _tile_loadd(2, xq + k0 + s, k);
    _tile_dpbsud(0, 2, 4);
    if constexpr (TERMS == 2) {
      _tile_loadd(3, xq2 + k0 + s, k);
      _tile_dpbsud(1, 3, 4);
    }
  }
  _tile_stored(0, sums[0], kTile * sizeof(int32_t));
  if constexpr (TERMS == 2) _tile_stored(1, sums[1], kTile * sizeof(int32_t));
}

// tile_kernel for 16 rows through the tiles: the same integers per unit, the same fp32 steps per row.
template <int TERMS, typename S, typename T>
void tile_kernel_amx(const TileWeights<S>& tw, const uint8_t* wbytes, const QuantizedRows& q, int64_t row0, int64_t k,
                     int64_t group, int64_t ablock, const T* bias, T* out, int64_t out_stride) {
  const int64_t blocks = k / ablock, groups = k / group;
  const int64_t unit = std::min(group, ablock), units = k / unit, units_per_group = group / unit;
  alignas(64) int32_t sums[2][2][kAmxRows * kTile];  // [unit parity][term][row][output]
  __m512 acc[kAmxRows], facc[kAmxRows];
  const int8_t* xq = q.xq.data() + row0 * k;
  const int8_t* xq2 = TERMS == 2 ? q.xq2.data() + row0 * k : nullptr;
  for (int r = 0; r < kAmxRows; ++r) acc[r] = facc[r] = _mm512_setzero_ps();
  unit_products<TERMS>(wbytes, xq, xq2, k, 0, unit, sums[0]);
  for (int64_t u = 0; u < units; ++u) {
    if (u + 1 < units)  // the next unit's products, while this one's fp32 steps run
      unit_products<TERMS>(wbytes, xq, xq2, k, (u + 1) * unit, unit, sums[(u + 1) & 1]);
    const int32_t(*unit_sums)[kAmxRows * kTile] = sums[u & 1];
    const int64_t block = u * unit / ablock;
    for (int r = 0; r < kAmxRows; ++r) {
      facc[r] = add_unit(facc[r], _mm512_load_si512(unit_sums[0] + r * kTile), q.d[(row0 + r) * blocks + block]);
      if constexpr (TERMS == 2)
        facc[r] = add_unit(facc[r], _mm512_load_si512(unit_sums[1] + r * kTile), q.d2[(row0 + r) * blocks + block]);
    }
    if ((u + 1) % units_per_group == 0) {
      const int64_t g = u / units_per_group;
      __m512 s, mn;
      group_scale_min(tw, g, s, mn);
      for (int r = 0; r < kAmxRows; ++r) {
        acc[r] = add_group(acc[r], facc[r], s, mn, q.xs[(row0 + r) * groups + g]);
        facc[r] = _mm512_setzero_ps();
      }
    }
  }
  store_rows<kAmxRows>(acc, bias, out, out_stride);
}
#endif  // PAGEDLLM_AMX

// Rows up to this many are quantized by each thread for itself, inside the parallel region (the same
// bits on every thread): a decode step's linear would otherwise start with one thread quantizing while the
// other waits and memory idles; with the first lines of its tiles asked for before it starts, the
// quantization hides behind their reads. Above it the rows are quantized once, before the region.
constexpr int64_t kLocalRows = 4;

template <int BITS, int TERMS, typename S, typename T>
void qlinear_impl(const T* x, int64_t x_stride, const uint8_t* w, const uint64_t* high, const S* scales,
                  const S* mins, float min_factor, const uint16_t* super, int64_t supers, int64_t m, int64_t n,
                  int64_t k, int64_t group, const T* bias, T* y) {
  const int64_t tiles = n / kTile, groups = k / group;
  const int64_t groups_per_super = supers ? groups / supers : 1;
  const int64_t tile_low_bytes = k * kTile * low_bits(BITS) / 8;  // the bytes or the nibbles
  const int64_t tile_masks = k / 8 * bit_planes(BITS) * 2;        // 64-bit bit-plane masks
  const bool local = m <= kLocalRows;
  const int64_t ablock = activation_block(k, group);
  thread_local QuantizedRows calling_thread_rows;
  if (!local) quantize_rows<T>(x, m, k, x_stride, group, ablock, TERMS, calling_thread_rows);
  const QuantizedRows* shared = &calling_thread_rows;  // (a thread_local named in the region is the thread's own)
#if defined(PAGEDLLM_AMX)
  const bool amx = m >= kAmxRows && pagedllm_amx::tiles_permitted();
#endif
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const QuantizedRows* rows = shared;
    thread_local QuantizedRows own;
#if defined(PAGEDLLM_AMX)
    thread_local std::vector<uint8_t> unpacked_buffer;  // a tile's unpacked weight bytes, 64-byte aligned
    uint8_t* unpacked = nullptr;
    if (amx) {
      load_qlinear_amx_config(std::min(group, ablock));
      if (BITS != 8) {
        unpacked_buffer.resize(k * kTile + 64);
        unpacked = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(unpacked_buffer.data()) + 63) &
                                              ~uintptr_t{63});
      }
    }
#endif
    if (local) {
      const uint8_t* first = w + begin * tile_low_bytes;
      const int64_t warm = std::min((end - begin) * tile_low_bytes, prefetch_bytes(BITS));
      for (int64_t o = 0; o < warm; o += 64) _mm_prefetch(reinterpret_cast<const char*>(first + o), _MM_HINT_T0);
      quantize_rows<T>(x, m, k, x_stride, group, ablock, TERMS, own);
      rows = &own;
    }
    const QuantizedRows& q = *rows;
    for (int64_t c0 = 0; c0 < m; c0 += kRowChunk) {
      const int64_t c1 = std::min(m, c0 + kRowChunk);
      for (int64_t t = begin; t < end; ++t) {
        const TileWeights<S> tw{w + t * tile_low_bytes, high + t * tile_masks, scales + t * groups * kTile,
                                mins ? mins + t * groups * kTile : nullptr, min_factor,
                                super ? super + t * supers * 2 * kTile : nullptr, groups_per_super};
        const T* tile_bias = bias ? bias + t * kTile : nullptr;
        int64_t r0 = c0;
#if defined(PAGEDLLM_AMX)
        if (amx && r0 + kAmxRows <= c1) {
          const uint8_t* wbytes = tile_weight_bytes<BITS>(tw, k, unpacked);
          for (; r0 + kAmxRows <= c1; r0 += kAmxRows)
            tile_kernel_amx<TERMS, S, T>(tw, wbytes, q, r0, k, group, ablock, tile_bias, y + r0 * n + t * kTile, n);
        }
#endif
        for (; r0 < c1; r0 += kRows) {
          T* out = y + r0 * n + t * kTile;
          switch (std::min<int64_t>(kRows, c1 - r0)) {
            case 4: tile_kernel<BITS, TERMS, S, 4>(tw, q, r0, k, group, ablock, tile_bias, out, n); break;
            case 3: tile_kernel<BITS, TERMS, S, 3>(tw, q, r0, k, group, ablock, tile_bias, out, n); break;
            case 2: tile_kernel<BITS, TERMS, S, 2>(tw, q, r0, k, group, ablock, tile_bias, out, n); break;
            default: tile_kernel<BITS, TERMS, S, 1>(tw, q, r0, k, group, ablock, tile_bias, out, n); break;
          }
        }
      }
    }
  });
}



template <int BITS, int TERMS, typename T>
void dispatch_scales(const T* x, int64_t x_stride, const at::Tensor& packed, const at::Tensor& high,
                     const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& super, int64_t m, int64_t n,
                     int64_t k, int64_t group, const T* bias, T* y) {
  with_typed_scales<BITS>(scales, mins, super, [&](const auto* s, const auto* mn, const uint16_t* sup, int64_t supers) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
    qlinear_impl<BITS, TERMS, S, T>(x, x_stride, packed.data_ptr<uint8_t>(), bit_plane_words(high), s, mn,
                                    symmetric_min_factor(BITS), sup, supers, m, n, k, group, bias, y);
  });
}


#if defined(PAGEDLLM_BLOCKED_BF16)
// Prompt rows (qlinear_dense): the weights w = q * scale + min, rounded to bf16 one block of 64 outputs at a time
// into the blocked bf16 linear's layout (csrc/blocked_bf16.h), then multiplied by that kernel's path, the AMX
// tiles where asked: a prefill chunk's rows multiply the unrounded activations at the bf16 tiles' speed, where
// the integer path's two activation terms cost as many tile products as bf16 plus the unpacking and the fp32
// steps. The rounding is the bf16 model's (a weight rounded once, to 8 bits of mantissa), so a row's result
// differs from the integer path's in the last bits: the engine routes rows by what they are, never by the
// batch they are in (layers/quantization/vnni.py).

// Tile t's 16 outputs of w = q * scale + min in bf16 into columns [col, col + 16) of a block [K / 2][width][2].
template <int BITS, typename S>
void dequantize_tile_bf16(const TileWeights<S>& tw, int64_t k, int64_t group, uint16_t* block, int64_t width,
                          int64_t col) {
  // A k-quad's bytes hold output o's 4 weights in 32-bit lane o; 4 lanes widen to 16 fp32 lanes at a time.
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512i spread[4];  // lane i of quarter c belongs to output 4c + i / 4
  for (int c = 0; c < 4; ++c)
    spread[c] = _mm512_add_epi32(_mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                     14, 15), 2),
                                 _mm512_set1_epi32(4 * c));
  __m512 scale4[4], min4[4];
  auto quad = [&](__m512i bytes, int64_t k0) {
    __m512 f[4];
    for (int c = 0; c < 4; ++c)
      f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(bytes, c))), scale4[c],
                             min4[c]);
    // 32-bit lane 2o + p of each: output o's pair p of k (k0 + 2p, k0 + 2p + 1), outputs 0-7 and 8-15
    const __m512i low = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
    const __m512i high = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
    uint16_t* pair = block + (k0 / 2 * width + col) * 2;
    _mm512_storeu_si512(pair, _mm512_permutex2var_epi32(low, even, high));
    _mm512_storeu_si512(pair + width * 2, _mm512_permutex2var_epi32(low, odd, high));
  };
  for (int64_t kk = 0, g = -1; kk < k; kk += 8) {
    if (kk / group != g) {
      g = kk / group;
      __m512 s, mn;
      group_scale_min(tw, g, s, mn);
      for (int c = 0; c < 4; ++c) {
        scale4[c] = _mm512_permutexvar_ps(spread[c], s);
        min4[c] = _mm512_permutexvar_ps(spread[c], mn);
      }
    }
    if constexpr (BITS == 8) {
      quad(_mm512_loadu_si512(tw.w + kk * kTile), kk);
      quad(_mm512_loadu_si512(tw.w + (kk + 4) * kTile), kk + 4);
    } else {
      __m512i lo, hi;
      unpack_quads<BITS>(tw, kk, lo, hi);
      quad(lo, kk);
      quad(hi, kk + 4);
    }
  }
}

template <int BITS, typename S>
void qlinear_dense_impl(const c10::BFloat16* x, int64_t x_stride, const uint8_t* w, const uint64_t* high,
                        const S* scales, const S* mins, float min_factor, const uint16_t* super, int64_t supers,
                        int64_t m, int64_t n, int64_t k, int64_t group, const c10::BFloat16* bias, c10::BFloat16* y,
                        bool amx) {
  using pagedllm_blocked::kBlockOutputs;
  const int64_t tiles = n / kTile, groups = k / group, groups_per_super = supers ? groups / supers : 1;
  const int64_t tile_low_bytes = k * kTile * low_bits(BITS) / 8, tile_masks = k / 8 * bit_planes(BITS) * 2;
  constexpr int64_t kTilesPerBlock = kBlockOutputs / kTile;
  const int64_t blocks = (tiles + kTilesPerBlock - 1) / kTilesPerBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    // one block's bf16 weights, 64-byte aligned (a tile row split over two cache lines loads at half speed)
    thread_local std::vector<uint16_t> dense_buffer;
    dense_buffer.resize(k * kBlockOutputs + 32);
    uint16_t* dense = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(dense_buffer.data()) + 63) &
                                                  ~uintptr_t{63});
    pagedllm_blocked::prepare_bf16_rows(amx, m);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t t0 = b * kTilesPerBlock, t1 = std::min(tiles, t0 + kTilesPerBlock), width = (t1 - t0) * kTile;
      for (int64_t t = t0; t < t1; ++t) {
        const TileWeights<S> tw{w + t * tile_low_bytes, high + t * tile_masks, scales + t * groups * kTile,
                                mins ? mins + t * groups * kTile : nullptr, min_factor,
                                super ? super + t * supers * 2 * kTile : nullptr, groups_per_super};
        dequantize_tile_bf16<BITS>(tw, k, group, dense, width, (t - t0) * kTile);
      }
      const auto* block = reinterpret_cast<const c10::BFloat16*>(dense);
      for (int64_t r0 = 0; r0 < m; r0 += pagedllm_blocked::kMaxRows)
        pagedllm_blocked::bf16_block_rows(amx, std::min(pagedllm_blocked::kMaxRows, m - r0), x + r0 * x_stride,
                                          x_stride, block, width, k, bias ? bias + t0 * kTile : nullptr,
                                          y + r0 * n + t0 * kTile, n);
    }
  });
}
#endif  // PAGEDLLM_BLOCKED_BF16

#endif  // PAGEDLLM_QLINEAR

#ifdef PAGEDLLM_QLINEAR_FP32
// y = x W^T for fp32 rows x and the weights above (any of their layouts and scale encodings), in fp32
// throughout: each weight byte is widened to fp32 and multiplied by the unquantized activation, so the result
// is the dequantized weight's product up to fp32 rounding, as an fp32 model is expected to be exact. Per
// group of input channels, sum(q * x) times the scale plus min times sum(x) (the row's group sums, computed
// once per call). Each output's sum runs in one fixed order whatever the number of rows computed with it
// (threads split the output tiles, never k), so a row's result does not depend on its batch. A tile's 16
// outputs are two 8-lane halves; per half, a k-quad is eight 32-bit lanes of 4 weight bytes each.
namespace fp32q {

constexpr int kRows = 4;

// 32 mask bits as 32 bytes: byte i is `value` where bit i is set, else 0.
inline __m256i mask_bytes(uint32_t m, __m256i value) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(m)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select), value);
}

// Half h's two k-quads of input channels k0..k0+8 (k0 a multiple of 8): channels k0..k0+3 in a, k0+4..k0+7 in b.
template <int BITS>
inline __attribute__((always_inline)) void octet(const uint8_t* w, const uint64_t* high, int64_t k0, int h,
                                                 __m256i& a, __m256i& b) {
  if constexpr (BITS == 8) {
    a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k0 / 4 * 64 + 32 * h));
    b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k0 / 4 + 1) * 64 + 32 * h));
  } else {
    constexpr int kPlanes = bit_planes(BITS);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k0 / 8 * 64 + 32 * h));
    a = _mm256_and_si256(packed, nibble);
    b = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    if constexpr (kPlanes > 0) {
      const uint64_t* planes = high + k0 / 8 * kPlanes * 2;
      for (int p = 0; p < kPlanes; ++p) {
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(16 << p));
        a = _mm256_add_epi8(a, mask_bytes(static_cast<uint32_t>(planes[2 * p] >> (32 * h)), bit));
        b = _mm256_add_epi8(b, mask_bytes(static_cast<uint32_t>(planes[2 * p + 1] >> (32 * h)), bit));
      }
    }
  }
}

// Weight byte u of each lane (input channel k-quad start + u) of half h's 8 outputs, in fp32.
template <int U>
inline __attribute__((always_inline)) __m256 weights_at(__m256i quad) {
  if constexpr (U == 3) return _mm256_cvtepi32_ps(_mm256_srli_epi32(quad, 24));
  if constexpr (U == 0) return _mm256_cvtepi32_ps(_mm256_and_si256(quad, _mm256_set1_epi32(0xFF)));
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(quad, 8 * U), _mm256_set1_epi32(0xFF)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Group g's scales and mins for half h (K-quants: small integers times the super-block's d and -dmin).
template <typename S>
inline void group_scale_min(const TileWeights<S>& tw, int64_t g, int h, __m256& scale, __m256& min) {
  scale = load8(tw.scales + g * kTile + 8 * h);
  if constexpr (std::is_same_v<S, int8_t>) {
    const uint16_t* sup = tw.super + g / tw.groups_per_super * 2 * kTile;
    scale = _mm256_mul_ps(scale, load8(sup + 8 * h));
    min = tw.mins ? _mm256_mul_ps(load8(tw.mins + g * kTile + 8 * h), load8(sup + kTile + 8 * h))
                  : _mm256_mul_ps(scale, _mm256_set1_ps(tw.min_factor));
  } else {
    min = tw.mins ? load8(tw.mins + g * kTile + 8 * h) : _mm256_mul_ps(scale, _mm256_set1_ps(tw.min_factor));
  }
}

// One tile's 16 outputs for R rows. Per group and half, each output sums in two chains (channels k0..k0+3
// and k0+4..k0+7 of each octet), added at the group's end; a weight vector is widened once and used by the
// R rows at once, so the accumulators of four rows stay in registers (16 ymm).
template <int U, int R>
inline __attribute__((always_inline)) void add_channel(__m256i quad, const float* const* xr, int64_t k, __m256* f) {
  const __m256 w = weights_at<U>(quad);
  for (int r = 0; r < R; ++r) f[r] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(xr[r] + k + U), f[r]);
}

template <int BITS, typename S, int R>
void tile_rows(const TileWeights<S>& tw, const float* x, int64_t x_stride, const float* xs, int64_t k,
               int64_t group, const float* bias, float* y, int64_t y_stride) {
  const int64_t groups = k / group;
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + r * x_stride;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int h = 0; h < 2; ++h) {
      __m256 fa[R], fb[R];
      for (int r = 0; r < R; ++r) fa[r] = fb[r] = _mm256_setzero_ps();
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 8) {
        if constexpr (R == 1) {
          if (h == 0) {
            const uint8_t* line = tw.w + k0 * kTile * low_bits(BITS) / 8;
            _mm_prefetch(reinterpret_cast<const char*>(line + 4096), _MM_HINT_T0);
            if constexpr (BITS == 8) _mm_prefetch(reinterpret_cast<const char*>(line + 4096 + 64), _MM_HINT_T0);
          }
        }
        __m256i qa, qb;
        octet<BITS>(tw.w, tw.high, k0, h, qa, qb);
        add_channel<0, R>(qa, xr, k0, fa);
        add_channel<0, R>(qb, xr, k0 + 4, fb);
        add_channel<1, R>(qa, xr, k0, fa);
        add_channel<1, R>(qb, xr, k0 + 4, fb);
        add_channel<2, R>(qa, xr, k0, fa);
        add_channel<2, R>(qb, xr, k0 + 4, fb);
        add_channel<3, R>(qa, xr, k0, fa);
        add_channel<3, R>(qb, xr, k0 + 4, fb);
      }
      __m256 scale, min;
      group_scale_min(tw, g, h, scale, min);
      for (int r = 0; r < R; ++r)
        acc[r][h] = _mm256_fmadd_ps(min, _mm256_set1_ps(xs[r * groups + g]),
                                    _mm256_fmadd_ps(_mm256_add_ps(fa[r], fb[r]), scale, acc[r][h]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(y + r * y_stride + 8 * h,
                       bias ? _mm256_add_ps(acc[r][h], _mm256_loadu_ps(bias + 8 * h)) : acc[r][h]);
}

template <int BITS, typename S>
void qlinear_fp32_impl(const float* x, int64_t x_stride, const uint8_t* w, const uint64_t* high, const S* scales,
                       const S* mins, float min_factor, const uint16_t* super, int64_t supers, int64_t m, int64_t n,
                       int64_t k, int64_t group, const float* bias, float* y) {
  const int64_t tiles = n / kTile, groups = k / group, groups_per_super = supers ? groups / supers : 1;
  const int64_t tile_low_bytes = k * kTile * low_bits(BITS) / 8, tile_masks = k / 8 * bit_planes(BITS) * 2;
  std::vector<float> xs(m * groups);  // sum(x) per row and group, in k order
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) sum += x[r * x_stride + kk];
      xs[r * groups + g] = sum;
    }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const TileWeights<S> tw{w + t * tile_low_bytes, high + t * tile_masks, scales + t * groups * kTile,
                              mins ? mins + t * groups * kTile : nullptr, min_factor,
                              super ? super + t * supers * 2 * kTile : nullptr, groups_per_super};
      const float* tile_bias = bias ? bias + t * kTile : nullptr;
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const float* xr = x + r0 * x_stride;
        const float* xsr = xs.data() + r0 * groups;
        float* out = y + r0 * n + t * kTile;
        switch (std::min<int64_t>(kRows, m - r0)) {
          case 4: tile_rows<BITS, S, 4>(tw, xr, x_stride, xsr, k, group, tile_bias, out, n); break;
          case 3: tile_rows<BITS, S, 3>(tw, xr, x_stride, xsr, k, group, tile_bias, out, n); break;
          case 2: tile_rows<BITS, S, 2>(tw, xr, x_stride, xsr, k, group, tile_bias, out, n); break;
          default: tile_rows<BITS, S, 1>(tw, xr, x_stride, xsr, k, group, tile_bias, out, n); break;
        }
      }
    }
  });
}

}  // namespace fp32q
#endif  // PAGEDLLM_QLINEAR_FP32

#if defined(PAGEDLLM_QLINEAR) || defined(PAGEDLLM_QLINEAR_FP32)
// The weight's tensors as the kernels read them, for x [M, K] and a bias (or none): returns N.
int64_t check_weight(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& high,
                     const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& super, int64_t bits,
                     int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [M, K] with unit stride along K");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, op, ": bits must be 4, 5, 6 or 8");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), op, ": packed must be contiguous uint8");
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == kTile && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf ||
                   scales.scalar_type() == at::kChar),
              op, ": scales must be contiguous [N / 16, K / G, 16] fp32, fp16 or int8 (with super)");
  TORCH_CHECK(scales.scalar_type() != at::kChar ||
                  (super.scalar_type() == at::kHalf && super.is_contiguous() && super.dim() == 4 &&
                   super.size(0) == scales.size(0) && super.size(1) > 0 && scales.size(1) % super.size(1) == 0 &&
                   super.size(2) == 2 && super.size(3) == kTile),
              op, ": int8 scales need super [N / 16, super-blocks, 2, 16] fp16 (d, -dmin)");
  TORCH_CHECK(mins.numel() == 0 || (mins.is_contiguous() && scales.sizes() == mins.sizes() &&
                                    scales.scalar_type() == mins.scalar_type()),
              op, ": mins must be empty (a symmetric weight) or shaped and typed as the scales");
  const int64_t k = x.size(1), n = scales.size(0) * kTile;
  TORCH_CHECK(k % kBlock == 0 && group_size % 16 == 0 && k % group_size == 0 &&
                  (group_size < kBlock || group_size % kBlock == 0) && scales.size(1) == k / group_size,
              op, ": K must be a multiple of 32 and of the group size (16 or a multiple of 32)");
  TORCH_CHECK(packed.numel() == n * k * low_bits(bits) / 8, op, ": packed weight has the wrong size");
  TORCH_CHECK(high.scalar_type() == at::kByte && high.is_contiguous() && high.numel() == n * k * bit_planes(bits) / 8,
              op, ": high must hold one bit plane per bit above 4 (n * k * (bits - 4) / 8 bytes)");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                        bias->scalar_type() == x.scalar_type()),
              op, ": bias must be a contiguous [N] tensor of x's dtype");
  return n;
}
#endif

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& high, const at::Tensor& scales,
                   const at::Tensor& mins, const at::Tensor& super, int64_t bits, int64_t group_size,
                   int64_t activation_terms, const std::optional<at::Tensor>& bias) {
#ifdef PAGEDLLM_QLINEAR
  TORCH_CHECK(activation_terms == 1 || activation_terms == 2, "qlinear: activation_terms must be 1 or 2");
  const int64_t n = check_weight("qlinear", x, packed, high, scales, mins, super, bits, group_size, bias);
  const int64_t m = x.size(0), k = x.size(1);
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  auto run = [&](auto* xp, auto* yp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    const T* bp = bias ? static_cast<const T*>(bias->data_ptr()) : nullptr;
    const int64_t stride = x.stride(0);
    auto with_terms = [&](auto bits_constant) {
      constexpr int B = decltype(bits_constant)::value;
      if (activation_terms == 2)
        dispatch_scales<B, 2, T>(xp, stride, packed, high, scales, mins, super, m, n, k, group_size, bp, yp);
      else
        dispatch_scales<B, 1, T>(xp, stride, packed, high, scales, mins, super, m, n, k, group_size, bp, yp);
    };
    with_bits_constant(bits, with_terms);
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(x.data_ptr<float>(), y.data_ptr<float>()); break;
    case at::kBFloat16: run(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(x.data_ptr<c10::Half>(), y.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "qlinear: x must be fp32, bf16 or fp16");
  }
  return y;
#else
  TORCH_CHECK(false, "qlinear: this build has no AVX512-VNNI (qlinear_supports() is false)");
#endif
}

bool qlinear_fp32_supports() {
#ifdef PAGEDLLM_QLINEAR_FP32
  return true;
#else
  return false;
#endif
}

// y = x W^T (+ bias) for fp32 rows x, in fp32 (see fp32q).
at::Tensor qlinear_fp32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& high, const at::Tensor& scales,
                        const at::Tensor& mins, const at::Tensor& super, int64_t bits, int64_t group_size,
                        const std::optional<at::Tensor>& bias) {
#ifdef PAGEDLLM_QLINEAR_FP32
  TORCH_CHECK(x.scalar_type() == at::kFloat, "qlinear_fp32: x must be fp32");
  const int64_t n = check_weight("qlinear_fp32", x, packed, high, scales, mins, super, bits, group_size, bias);
  const int64_t m = x.size(0), k = x.size(1);
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  auto with_bits = [&](auto bits_constant) {
    constexpr int B = decltype(bits_constant)::value;
    with_typed_scales<B>(scales, mins, super, [&](const auto* s, const auto* mn, const uint16_t* sup, int64_t supers) {
      fp32q::qlinear_fp32_impl<B>(x.data_ptr<float>(), x.stride(0), packed.data_ptr<uint8_t>(), bit_plane_words(high),
                                  s, mn, symmetric_min_factor(B), sup, supers, m, n, k, group_size, bp,
                                  y.data_ptr<float>());
    });
  };
  with_bits_constant(bits, with_bits);
  return y;
#else
  TORCH_CHECK(false, "qlinear_fp32: this build has no AVX2 + FMA + F16C (qlinear_fp32_supports() is false)");
#endif
}

// Whether qlinear_dense runs here: AVX512-BF16 (and, with `amx`, the tiles granted to this process).
bool qlinear_dense_supports(bool amx) {
#if defined(PAGEDLLM_QLINEAR) && defined(PAGEDLLM_BLOCKED_BF16)
#if defined(PAGEDLLM_AMX)
  return !amx || pagedllm_amx::tiles_permitted();
#else
  return !amx;
#endif
#else
  (void)amx;
  return false;
#endif
}

// y = x W^T (+ bias) for bf16 rows x, W dequantized to bf16 (see qlinear_dense_impl).
at::Tensor qlinear_dense(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& high, const at::Tensor& scales,
                         const at::Tensor& mins, const at::Tensor& super, int64_t bits, int64_t group_size,
                         const std::optional<at::Tensor>& bias, bool amx) {
  TORCH_CHECK(qlinear_dense_supports(amx), "qlinear_dense: this build or CPU has no ", amx ? "AMX tiles" : "AVX512-BF16");
#if defined(PAGEDLLM_QLINEAR) && defined(PAGEDLLM_BLOCKED_BF16)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "qlinear_dense: x must be bf16");
  const int64_t n = check_weight("qlinear_dense", x, packed, high, scales, mins, super, bits, group_size, bias);
  const int64_t m = x.size(0), k = x.size(1);
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  auto with_bits = [&](auto bits_constant) {
    constexpr int B = decltype(bits_constant)::value;
    with_typed_scales<B>(scales, mins, super, [&](const auto* s, const auto* mn, const uint16_t* sup, int64_t supers) {
      qlinear_dense_impl<B>(xp, x.stride(0), packed.data_ptr<uint8_t>(), bit_plane_words(high), s, mn,
                            symmetric_min_factor(B), sup, supers, m, n, k, group_size, bp, yp, amx);
    });
  };
  with_bits_constant(bits, with_bits);
  return y;
#else
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY(pagedllm_cpu_qlinear, m) {
  m.def("qlinear_supports() -> bool", &qlinear_supports);
  m.def("qlinear(Tensor x, Tensor packed, Tensor high, Tensor scales, Tensor mins, Tensor super, int bits, "
        "int group_size, int activation_terms, Tensor? bias=None) -> Tensor");
  m.def("qlinear_fp32_supports() -> bool", &qlinear_fp32_supports);
  m.def("qlinear_fp32(Tensor x, Tensor packed, Tensor high, Tensor scales, Tensor mins, Tensor super, int bits, "
        "int group_size, Tensor? bias=None) -> Tensor");
  m.def("qlinear_dense_supports(bool amx) -> bool", &qlinear_dense_supports);
  m.def("qlinear_dense(Tensor x, Tensor packed, Tensor high, Tensor scales, Tensor mins, Tensor super, int bits, "
        "int group_size, Tensor? bias, bool amx) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu_qlinear, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("qlinear_fp32", &qlinear_fp32);
  m.impl("qlinear_dense", &qlinear_dense);
}
