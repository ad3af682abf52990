// y = x W^T + b for CPU decoding: weights packed once at load in a layout a matrix-vector product reads
// as one sequential stream, and a register-blocked kernel that computes every row the same way.
//
// Why not only oneDNN's prepacked linear: on some CPUs its matrix-vector product (batch-1 decode) reads
// weights at half the memory bandwidth, and its results depend on the CPU's code path; this kernel
// streams each weight once, and every row's sums run in one order whatever the batch and thread count.
//
// Layout: output features in blocks of 64 with AVX-512, 16 with AVX2 (the last block holds what is left
// over), each block's weights stored k-major, so a block is one contiguous run of memory that the loop
// over k walks front to back, and the blocks follow each other: the whole weight is one stream. One flat
// tensor of N x K' elements:
//   fp32: per block [K, width]                  one k at a time, 4 zmm (AVX2: 2 ymm) FMAs per k and row
//   bf16: per block [K' / 2, width, 2]          pairs of k, 4 zmm VDPBF16PS per pair (AVX512-BF16 only)
// where K' is K rounded up to the k step (an odd K in bf16 gets a zero column). The layout is this
// build's: weights are packed by the same library that reads them.
//
// Batch invariance: each output element is one accumulator summed over k in order, whether its row is
// computed alone or in a tile of six; threads split the output blocks, never k. So a row's result does
// not depend on what else is in the batch or on the thread count, as the engine's outputs must not.
//
// AMX (`amx=True`, bf16 only, where the build and the process have the tiles): the same packed weights
// read by TDPBF16PS, 16 rows x 64 outputs at a time. It sums a row in another order than VDPBF16PS (the
// two differ in the last bits), so it is a path of its own for every row count, chosen by measurement
// (layers/linear_tuning.py), never a fast case of the AVX-512 path for some batches.
//
// Built with -march=native: without AVX2 + FMA (fp32) or AVX512-BF16 (bf16) `blocked_linear_supports`
// says no and the caller keeps oneDNN.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "amx.h"
#include "blocked_bf16.h"
#include "half_keys.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PAGEDLLM_BLOCKED_FP32 1
#endif

namespace {

// The fp32 vector of the widest ISA the build has: AVX-512 (16 lanes, 4 per block of 64 outputs) or
// AVX2 + FMA (8 lanes, 2 per block of 16: 6 rows x 2 accumulators + 2 weights + 1 broadcast fit in its
// 16 registers).
#if defined(__AVX512F__)
struct Fp32Vec {
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  static Mask first(int64_t n) {  // the first n lanes (n clamped to 0..16)
    return n >= 16 ? Mask(0xFFFF) : n <= 0 ? Mask(0) : Mask((1u << n) - 1);
  }
  static bool any(Mask m) { return m != 0; }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static V broadcast(float v) { return _mm512_set1_ps(v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static void store(float* p, V v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
};
#elif defined(PAGEDLLM_BLOCKED_FP32)
struct Fp32Vec {
  using V = __m256;
  using Mask = __m256i;
  static constexpr int kLanes = 8;
  static Mask first(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static bool any(Mask m) { return !_mm256_testz_si256(m, m); }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static V broadcast(float v) { return _mm256_set1_ps(v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static void store(float* p, V v, Mask m) { _mm256_maskstore_ps(p, m, v); }
};
#endif

#if defined(PAGEDLLM_BLOCKED_FP32)
constexpr int kVecs = Fp32Vec::kLanes == 16 ? 4 : 2;  // vectors per block
constexpr int64_t kBlockN = kVecs * Fp32Vec::kLanes;  // output features per block: 64 or 16
#else
constexpr int kVecs = 1;
constexpr int64_t kBlockN = 16;
#endif
constexpr int64_t kTileRows = 6;  // rows per register tile

bool supports(c10::ScalarType dtype) {
#if defined(PAGEDLLM_BLOCKED_FP32)
  if (dtype == c10::kFloat) return true;
#endif
#if defined(__AVX512BF16__)
  if (dtype == c10::kBFloat16) return true;
#endif
  return false;
}

int64_t k_step(c10::ScalarType dtype) { return dtype == c10::kBFloat16 ? 2 : 1; }

// K' for a weight of `k` input features: K rounded up to the k step.
int64_t padded_in_features(int64_t k, c10::ScalarType dtype) {
  const int64_t step = k_step(dtype);
  return (k + step - 1) / step * step;
}

int64_t packed_numel(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "blocked_linear_pack: weight must be [out_features, in_features]");
  return weight.size(0) * padded_in_features(weight.size(1), weight.scalar_type());
}

// Packs `weight` into `out` (a flat tensor of packed_numel elements, e.g. a slice of a model's buffer), or
// into a new tensor.
at::Tensor pack(const at::Tensor& weight, const std::optional<at::Tensor>& out) {
  TORCH_CHECK(supports(weight.scalar_type()), "blocked_linear_pack: ", weight.scalar_type(),
              " is not supported on this CPU");
  const int64_t n = weight.size(0), k = weight.size(1), step = k_step(weight.scalar_type());
  const int64_t numel = packed_numel(weight), k_padded = numel / n, full = n / kBlockN, tail = n % kBlockN;
  at::Tensor padded = weight;
  if (k_padded != k) {
    padded = at::zeros({n, k_padded}, weight.options());
    padded.narrow(1, 0, k).copy_(weight);
  }
  at::Tensor packed = out.has_value() ? *out : at::empty({numel}, weight.options());
  TORCH_CHECK(packed.dim() == 1 && packed.numel() == numel && packed.is_contiguous() &&
                  packed.scalar_type() == weight.scalar_type(),
              "blocked_linear_pack: out must be a contiguous ", weight.scalar_type(), " tensor of ", numel,
              " elements");
  if (full > 0) {  // [blocks, width, K'/step, step] -> [blocks, K'/step, width, step]
    packed.narrow(0, 0, full * kBlockN * k_padded)
        .view({full, k_padded / step, kBlockN, step})
        .copy_(padded.narrow(0, 0, full * kBlockN).view({full, kBlockN, k_padded / step, step}).permute({0, 2, 1, 3}));
  }
  if (tail > 0) {  // [tail, K'/step, step] -> [K'/step, tail, step]
    packed.narrow(0, full * kBlockN * k_padded, tail * k_padded)
        .view({k_padded / step, tail, step})
        .copy_(padded.narrow(0, full * kBlockN, tail).view({tail, k_padded / step, step}).permute({1, 0, 2}));
  }
  return packed;
}

#if defined(PAGEDLLM_BLOCKED_FP32)
using Vec = Fp32Vec::V;
using Acc = Vec[kTileRows][kVecs];

// Which lanes of each of a block's vectors hold columns (all of them in a full block).
inline void column_masks(int64_t width, Fp32Vec::Mask (&masks)[kVecs]) {
  for (int j = 0; j < kVecs; ++j) masks[j] = Fp32Vec::first(width - Fp32Vec::kLanes * j);
}

// The block's outputs for R rows, over the whole of K, into `out`. The accumulators are locals until the
// loop ends: vector types may alias anything, so accumulating through a reference would make the
// compiler store them to memory at every k.
template <int R, bool kFull>
inline void tile_fp32(const float* x, int64_t x_stride, const float* w, int64_t width, int64_t k, Acc& out) {
  Fp32Vec::Mask masks[kVecs];
  column_masks(width, masks);
  Vec acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) acc[r][j] = Fp32Vec::zero();
  for (int64_t i = 0; i < k; ++i) {
    // the block's weight vectors for this k, then one broadcast per row: no spills
    Vec wv[kVecs];
    for (int j = 0; j < kVecs; ++j) {
      const float* p = w + i * width + Fp32Vec::kLanes * j;
      if constexpr (kFull) {
        wv[j] = Fp32Vec::load(p);
      } else {
        wv[j] = Fp32Vec::load(p, masks[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = Fp32Vec::broadcast(x[r * x_stride + i]);
      for (int j = 0; j < kVecs; ++j) acc[r][j] = Fp32Vec::fma(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) out[r][j] = acc[r][j];
}

#if defined(__AVX512BF16__)
inline __m512 bf16x16_to_fp32(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// bf16: pairs of k through VDPBF16PS (K is even here: the caller pads x and the weight).
template <int R, bool kFull>
inline void tile_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t width, int64_t k, Acc& out) {
  __mmask32 masks[kVecs];  // two bf16 (a pair of k) per output column
  for (int j = 0; j < kVecs; ++j) {
    const uint32_t m16 = Fp32Vec::first(width - 16 * j);
    uint32_t m32 = 0;
    for (int c = 0; c < 16; ++c) m32 |= ((m16 >> c) & 1u) * (3u << (2 * c));
    masks[j] = m32;
  }
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k / 2; ++i) {
    __m512bh wv[kVecs];
    for (int j = 0; j < kVecs; ++j) {
      const uint16_t* p = w + i * 2 * width + 32 * j;
      if constexpr (kFull) {
        wv[j] = (__m512bh)_mm512_loadu_si512(p);
      } else {
        wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(masks[j], p);
      }
    }
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * i, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < kVecs; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) out[r][j] = acc[r][j];
}

// fp32 -> bf16, round to nearest even as torch rounds (NaN stays NaN); stores the masked lanes.
inline void store_bf16(c10::BFloat16* y, __m512 v, __mmask16 mask) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(rounded));
}
#endif

// Adds the bias and stores the block's `width` outputs of each of R rows.
template <typename T, int R>
inline void store_tile(Acc& acc, const T* bias, T* y, int64_t y_stride, int64_t width) {
  Fp32Vec::Mask masks[kVecs];
  column_masks(width, masks);
  for (int j = 0; j < kVecs; ++j) {
    if (!Fp32Vec::any(masks[j])) break;
    const int64_t lo = Fp32Vec::kLanes * j;
    Vec b = Fp32Vec::zero();
    if constexpr (std::is_same_v<T, float>) {
      if (bias != nullptr) b = Fp32Vec::load(bias + lo, masks[j]);
      for (int r = 0; r < R; ++r) Fp32Vec::store(y + r * y_stride + lo, Fp32Vec::add(acc[r][j], b), masks[j]);
    } else {
#if defined(__AVX512BF16__)
      if (bias != nullptr) b = bf16x16_to_fp32(_mm256_maskz_loadu_epi16(masks[j], bias + lo));
      for (int r = 0; r < R; ++r) store_bf16(y + r * y_stride + lo, _mm512_add_ps(acc[r][j], b), masks[j]);
#endif
    }
  }
}

template <typename T, int R>
inline void run_tile(const T* x, int64_t x_stride, const T* w, int64_t width, int64_t k, const T* bias, T* y,
                     int64_t y_stride) {
  Acc acc;
  if constexpr (std::is_same_v<T, float>) {
    if (width == kBlockN) {
      tile_fp32<R, true>(x, x_stride, w, width, k, acc);
    } else {
      tile_fp32<R, false>(x, x_stride, w, width, k, acc);
    }
  } else {
#if defined(__AVX512BF16__)
    const auto* xb = reinterpret_cast<const uint16_t*>(x);
    const auto* wb = reinterpret_cast<const uint16_t*>(w);
    if (width == kBlockN) {
      tile_bf16<R, true>(xb, x_stride, wb, width, k, acc);
    } else {
      tile_bf16<R, false>(xb, x_stride, wb, width, k, acc);
    }
#endif
  }
  store_tile<T, R>(acc, bias, y, y_stride, width);
}

template <typename T>
void run_rows(int64_t rows, const T* x, int64_t x_stride, const T* w, int64_t width, int64_t k, const T* bias,
              T* y, int64_t y_stride) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    run_tile<T, kTileRows>(x + r * x_stride, x_stride, w, width, k, bias, y + r * y_stride, y_stride);
  const T* xr = x + r * x_stride;
  T* yr = y + r * y_stride;
  switch (rows - r) {
    case 5: run_tile<T, 5>(xr, x_stride, w, width, k, bias, yr, y_stride); break;
    case 4: run_tile<T, 4>(xr, x_stride, w, width, k, bias, yr, y_stride); break;
    case 3: run_tile<T, 3>(xr, x_stride, w, width, k, bias, yr, y_stride); break;
    case 2: run_tile<T, 2>(xr, x_stride, w, width, k, bias, yr, y_stride); break;
    case 1: run_tile<T, 1>(xr, x_stride, w, width, k, bias, yr, y_stride); break;
    default: break;
  }
}

// Rows per pass over a thread's blocks: each block's weights (K x width) are read from memory once per
// pass and reused from L2 by every tile of the pass; the pass's rows of x are re-read per block from L2/L3.
constexpr int64_t kRowsPerPass = 256;

// Output blocks per thread: at least ~256 KiB of weights each, so the small matmuls of a draft model stay
// on one thread.
template <typename T>
int64_t block_grain(int64_t k) {
  const int64_t block_bytes = k * kBlockN * static_cast<int64_t>(sizeof(T));
  return std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(block_bytes, 1));
}

template <typename T>
void blocked_linear_impl(const T* x, int64_t m, int64_t k, const T* w, int64_t n, const T* bias, T* y) {
  const int64_t num_blocks = (n + kBlockN - 1) / kBlockN;
  at::parallel_for(0, num_blocks, block_grain<T>(k), [&](int64_t begin, int64_t end) {
    for (int64_t row = 0; row < m; row += kRowsPerPass) {
      const int64_t rows = std::min(kRowsPerPass, m - row);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t col = b * kBlockN, width = std::min(kBlockN, n - col);
        run_rows<T>(rows, x + row * k, k, w + col * k, width, k, bias == nullptr ? nullptr : bias + col,
                    y + row * n + col, n);
      }
    }
  });
}

#if defined(PAGEDLLM_AMX)
// A full block (64 outputs) of up to 16 rows is four 16 x 16 fp32 accumulator tiles (tmm0-3). Each step of
// 32 k loads the rows' 16 x 32 bf16 (tmm4) and, per 16 outputs, the block's 16 pairs x 16 outputs x 2 (tmm5
// and tmm6 in turn: rows of the k-major block, 256 bytes apart) for one TDPBF16PS. A call of fewer than 16
// rows configures its row tiles to exactly that many rows (a product costs in proportion to its rows, and
// x is read in place); larger calls take 16, and their last partial tile is padded.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxPairs = 16;  // pairs of k per tile step: 64 bytes of a row

thread_local int64_t amx_tile_rows = 0;  // the rows of the row tiles this thread configured last

// The tile configuration for a call of m rows, on this thread.
void load_amx_config(int64_t m) {
  amx_tile_rows = std::min(m, kAmxRows);
  pagedllm_amx::TileConfig config;
  for (int t = 0; t < 5; ++t) config.tile(t, static_cast<int>(amx_tile_rows), 64);
  config.tile(5, kAmxRows, 64).tile(6, kAmxRows, 64);
  config.load();
}

// A thread's buffers: a partial row tile's rows padded to 16 (the rows past them are never stored), and
// the fp32 sums of a block's rows.
struct AmxScratch {
  std::vector<uint16_t> rows;
  std::vector<float> sums;

  static AmxScratch& get(int64_t k) {
    thread_local AmxScratch scratch;
    if (static_cast<int64_t>(scratch.rows.size()) < kAmxRows * k) scratch.rows.assign(kAmxRows * k, 0);
    if (scratch.sums.empty()) scratch.sums.assign(kRowsPerPass * kBlockN, 0.f);
    return scratch;
  }
};

// Steps of 32 k per chunk when a block has several row tiles: the block's 256 k x 64 outputs (32 KiB)
// stay in L1 while every row tile of the pass goes through them, their sums saved and reloaded between
// chunks as they are (fp32, exact), so each output is still one sum in k order.
constexpr int64_t kAmxChunkSteps = 8;

// The weights one step ahead (4 KiB: the block's 16 pairs of k x 64 outputs; past a block's last step,
// the next block's first, which follows it in memory), asked for a quarter before each of the step's four
// weight tiles: the hardware prefetcher alone left a decode step's stream short of the bandwidth, and
// all 64 lines asked at once would wait for the line-fill buffers (figures in
// docs/performance/intel-amx.md).
inline __attribute__((always_inline)) void prefetch_quarter(const uint16_t* step_weights, int quarter) {
  const char* p = reinterpret_cast<const char*>(step_weights + kAmxPairs * 2 * kBlockN) + quarter * 1024;
  for (int i = 0; i < 16; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T0);
}

// The k steps [s0, s1) of one row tile: rows `a` (stride a_stride), the block's weights `w`, the sums in
// c [16][64] (zero at s0 == 0). `prefetch`: ask for the weights a step ahead (the pass that first reads
// them; later row tiles of a block find them in L1).
inline void amx_tile_steps(const uint16_t* a, int64_t a_stride, const uint16_t* w, int64_t s0, int64_t s1,
                           float* c, bool prefetch) {
  constexpr int64_t w_stride = kBlockN * 2 * sizeof(uint16_t);  // one pair of k of the block
  constexpr int64_t c_stride = kBlockN * sizeof(float);
  if (s0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, c_stride);
    _tile_loadd(1, c + 16, c_stride);
    _tile_loadd(2, c + 32, c_stride);
    _tile_loadd(3, c + 48, c_stride);
  }
  for (int64_t s = s0; s < s1; ++s) {
    const uint16_t* ws = w + s * kAmxPairs * 2 * kBlockN;
    _tile_loadd(4, a + s * 2 * kAmxPairs, a_stride * sizeof(uint16_t));
    if (prefetch) prefetch_quarter(ws, 0);
    _tile_loadd(5, ws, w_stride);
    _tile_dpbf16ps(0, 4, 5);
    if (prefetch) prefetch_quarter(ws, 1);
    _tile_loadd(6, ws + 32, w_stride);
    _tile_dpbf16ps(1, 4, 6);
    if (prefetch) prefetch_quarter(ws, 2);
    _tile_loadd(5, ws + 64, w_stride);
    _tile_dpbf16ps(2, 4, 5);
    if (prefetch) prefetch_quarter(ws, 3);
    _tile_loadd(6, ws + 96, w_stride);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + 16, c_stride);
  _tile_stored(2, c + 32, c_stride);
  _tile_stored(3, c + 48, c_stride);
}

// sums[r][0..64) = the sums over k of each of `rows` rows of x with a full block's weights `w`.
inline void amx_block_sums(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* w, int64_t k,
                           AmxScratch& scratch) {
  const int64_t pairs = k / 2, steps = pairs / kAmxPairs;
  const int64_t full = rows / amx_tile_rows * amx_tile_rows;  // rows read in place; the rest padded
  for (int64_t r = full; r < rows; ++r)
    std::memcpy(scratch.rows.data() + (r - full) * k, x + r * x_stride, k * sizeof(uint16_t));
  float* acc = scratch.sums.data();
  const int64_t chunk = rows > amx_tile_rows ? kAmxChunkSteps : std::max<int64_t>(steps, 1);
  for (int64_t s0 = 0; s0 < steps; s0 += chunk) {
    const int64_t s1 = std::min(steps, s0 + chunk);
    for (int64_t r0 = 0; r0 < rows; r0 += amx_tile_rows) {
      const bool in_place = r0 < full;
      amx_tile_steps(in_place ? x + r0 * x_stride : scratch.rows.data(), in_place ? x_stride : k, w, s0, s1,
                     acc + r0 * kBlockN, r0 == 0);
    }
  }
  if (steps == 0) std::fill(acc, acc + rows * kBlockN, 0.f);
  // the pairs after the last whole step (K' not a multiple of 32): VDPBF16PS on the tiles' sums, in k order
  for (int64_t i = steps * kAmxPairs; i < pairs; ++i) {
    for (int64_t r = 0; r < rows; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * i, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int j = 0; j < 4; ++j) {
        float* out = acc + r * kBlockN + 16 * j;
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i * 2 * kBlockN + 32 * j);
        _mm512_storeu_ps(out, _mm512_dpbf16_ps(_mm512_loadu_ps(out), xv, wv));
      }
    }
  }
}

// run_rows by the tiles (up to kRowsPerPass rows): a full block in 16-row tiles; a narrower last block by
// the AVX-512 kernel (for every batch alike, so its columns too are computed one way).
void amx_rows(int64_t rows, const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* w, int64_t width,
              int64_t k, const c10::BFloat16* bias, c10::BFloat16* y, int64_t y_stride, AmxScratch& scratch) {
  if (width != kBlockN) {
    run_rows<c10::BFloat16>(rows, x, x_stride, w, width, k, bias, y, y_stride);
    return;
  }
  __m512 b[4];
  for (int j = 0; j < 4; ++j)
    b[j] = bias == nullptr ? _mm512_setzero_ps()
                           : bf16x16_to_fp32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + 16 * j)));
  amx_block_sums(reinterpret_cast<const uint16_t*>(x), x_stride, rows, reinterpret_cast<const uint16_t*>(w), k,
                 scratch);
  const float* acc = scratch.sums.data();
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < 4; ++j)
      store_bf16(y + r * y_stride + 16 * j, _mm512_add_ps(_mm512_loadu_ps(acc + r * kBlockN + 16 * j), b[j]),
                 __mmask16(0xFFFF));
}

void amx_linear_impl(const c10::BFloat16* x, int64_t m, int64_t k, const c10::BFloat16* w, int64_t n,
                     const c10::BFloat16* bias, c10::BFloat16* y) {
  const int64_t num_blocks = (n + kBlockN - 1) / kBlockN;
  at::parallel_for(0, num_blocks, block_grain<c10::BFloat16>(k), [&](int64_t begin, int64_t end) {
    AmxScratch& scratch = AmxScratch::get(k);
    load_amx_config(m);
    for (int64_t row = 0; row < m; row += kRowsPerPass) {
      const int64_t rows = std::min(kRowsPerPass, m - row);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t col = b * kBlockN, width = std::min(kBlockN, n - col);
        amx_rows(rows, x + row * k, k, w + col * k, width, k, bias == nullptr ? nullptr : bias + col,
                 y + row * n + col, n, scratch);
      }
    }
  });
}
#endif  // PAGEDLLM_AMX

#endif  // PAGEDLLM_BLOCKED_FP32

// x as the kernel reads it: [rows, K'] contiguous (an odd K in bf16 padded with a zero column, as the weight).
at::Tensor kernel_input(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const char* op) {
  TORCH_CHECK(supports(x.scalar_type()), op, ": ", x.scalar_type(), " is not supported on this CPU");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type(), op, ": x and the packed weight differ in dtype");
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous() && out_features > 0 && packed.numel() % out_features == 0,
              op, ": the weight is not packed by blocked_linear_pack for ", out_features, " outputs");
  const int64_t k_padded = packed.numel() / out_features, k = x.size(-1);
  TORCH_CHECK(k_padded == padded_in_features(k, x.scalar_type()), op, ": x has ", k, " features, the weight ",
              k_padded);
  at::Tensor x2 = x.reshape({-1, k});
  if (k != k_padded) {  // an odd K in bf16: the kernel reads x in pairs
    at::Tensor wide = at::zeros({x2.size(0), k_padded}, x.options());
    wide.narrow(1, 0, k).copy_(x2);
    x2 = wide;
  }
  return x2.contiguous();
}

bool amx_supports(c10::ScalarType dtype) {
#if defined(PAGEDLLM_AMX)
  return dtype == c10::kBFloat16 && pagedllm_amx::tiles_permitted();
#else
  (void)dtype;
  return false;
#endif
}

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                          const std::optional<at::Tensor>& bias, bool amx) {
  at::Tensor x2 = kernel_input(x, packed, out_features, "blocked_linear");
  TORCH_CHECK(!amx || amx_supports(x.scalar_type()), "blocked_linear: no AMX tiles for ", x.scalar_type(),
              " on this CPU");
  const int64_t k_padded = x2.size(1);
  auto out_shape = x.sizes().vec();
  out_shape.back() = out_features;
  at::Tensor y = at::empty({x2.size(0), out_features}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(x.scalar_type()).contiguous();
    TORCH_CHECK(b.numel() == out_features, "blocked_linear: bias has ", b.numel(), " elements");
  }
#if defined(PAGEDLLM_BLOCKED_FP32)
  if (x.scalar_type() == c10::kFloat) {
    blocked_linear_impl<float>(x2.data_ptr<float>(), x2.size(0), k_padded, packed.data_ptr<float>(), out_features,
                               b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
  } else {
    using bf16 = c10::BFloat16;
#if defined(PAGEDLLM_AMX)
    if (amx) {
      amx_linear_impl(x2.data_ptr<bf16>(), x2.size(0), k_padded, packed.data_ptr<bf16>(), out_features,
                      b.defined() ? b.data_ptr<bf16>() : nullptr, y.data_ptr<bf16>());
      return y.view(out_shape);
    }
#endif
    blocked_linear_impl<bf16>(x2.data_ptr<bf16>(), x2.size(0), k_padded, packed.data_ptr<bf16>(), out_features,
                              b.defined() ? b.data_ptr<bf16>() : nullptr, y.data_ptr<bf16>());
  }
#endif
  return y.view(out_shape);
}

bool blocked_linear_supports(c10::ScalarType dtype, bool amx) {
  return supports(dtype) && (!amx || amx_supports(dtype));
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The argmax of each row of blocked_linear(x) in bf16 (a plain-greedy decode step's LM head), without
// storing the logits: each block's bf16 outputs, rounded exactly as blocked_linear stores them, land in a
// small buffer that stays in L1 and are folded into per-row running maxima. The [rows, vocab] logits are
// never written and read back (at batch 64 and a vocabulary of 8,192, 1 MiB each way every step).
// Values compare as 16-bit keys (half_keys.h: they order as the values do, +0 and -0 equal, NaNs beyond
// the infinities' keys). Each of a row's 64 lanes keeps its largest key and the first block that reached it, so the first
// column holding the maximum is the smallest block * 64 + lane among the lanes that hold it: torch.argmax's
// index. A row with a NaN (rare) is recomputed alone and its first NaN returned, as torch.argmax does.
constexpr int16_t kInfKey = 0x7F80;  // bf16 infinity's magnitude bits

// A block's bf16 rows by the op's path: the tiles when `amx` (their configuration loaded on this thread).
inline void bf16_rows(bool amx, int64_t rows, const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* w,
                      int64_t width, int64_t k, const c10::BFloat16* bias, c10::BFloat16* y, int64_t y_stride) {
#if defined(PAGEDLLM_AMX)
  if (amx) {
    amx_rows(rows, x, x_stride, w, width, k, bias, y, y_stride, AmxScratch::get(k));
    return;
  }
#endif
  run_rows<c10::BFloat16>(rows, x, x_stride, w, width, k, bias, y, y_stride);
}

inline void prepare_thread(bool amx, int64_t m) {
#if defined(PAGEDLLM_AMX)
  if (amx) load_amx_config(m);
#else
  (void)amx;
  (void)m;
#endif
}

struct RowLanes {  // one row's running state over a thread's blocks: 64 lanes, two vectors of 32
  __m512i max[2], min[2], block[2];
};

struct ChunkArgmax {  // a thread's result for its blocks, per row
  int64_t begin;
  std::vector<int16_t> key;
  std::vector<int64_t> index;
  std::vector<uint8_t> nan;
};

at::Tensor blocked_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, bool amx) {
  using bf16 = c10::BFloat16;
  TORCH_CHECK(x.scalar_type() == c10::kBFloat16, "blocked_linear_argmax: bf16 only, got ", x.scalar_type());
  TORCH_CHECK(!amx || amx_supports(x.scalar_type()), "blocked_linear_argmax: no AMX tiles on this CPU");
  at::Tensor x2 = kernel_input(x, packed, out_features, "blocked_linear_argmax");
  const int64_t m = x2.size(0), k = x2.size(1), n = out_features;
  const int64_t num_blocks = (n + kBlockN - 1) / kBlockN;
  TORCH_CHECK(num_blocks <= std::numeric_limits<int16_t>::max(), "blocked_linear_argmax: too many outputs (", n, ")");
  const bf16* xp = x2.data_ptr<bf16>();
  const bf16* wp = packed.data_ptr<bf16>();
  std::mutex mutex;
  std::vector<ChunkArgmax> chunks;
  at::parallel_for(0, num_blocks, block_grain<bf16>(k), [&](int64_t begin, int64_t end) {
    ChunkArgmax chunk{begin, std::vector<int16_t>(m), std::vector<int64_t>(m), std::vector<uint8_t>(m)};
    prepare_thread(amx, m);
    std::vector<bf16> buffer(kRowsPerPass * kBlockN);
    std::vector<RowLanes> lanes(kRowsPerPass);
    alignas(64) int16_t max_keys[kBlockN], min_keys[kBlockN], blocks[kBlockN];
    for (int64_t row = 0; row < m; row += kRowsPerPass) {
      const int64_t rows = std::min(kRowsPerPass, m - row);
      for (int64_t r = 0; r < rows; ++r) {
        for (int j = 0; j < 2; ++j) {
          lanes[r].max[j] = _mm512_set1_epi16(std::numeric_limits<int16_t>::min());
          lanes[r].min[j] = _mm512_set1_epi16(std::numeric_limits<int16_t>::max());
          lanes[r].block[j] = _mm512_setzero_si512();
        }
      }
      for (int64_t b = begin; b < end; ++b) {
        const int64_t col = b * kBlockN, width = std::min(kBlockN, n - col);
        bf16_rows(amx, rows, xp + row * k, k, wp + col * k, width, k, nullptr, buffer.data(), kBlockN);
        const __mmask32 valid[2] = {width >= 32 ? ~__mmask32(0) : __mmask32((1ull << width) - 1),
                                    width >= 64 ? ~__mmask32(0)
                                                : width > 32 ? __mmask32((1ull << (width - 32)) - 1) : __mmask32(0)};
        const __m512i block = _mm512_set1_epi16(static_cast<int16_t>(b));
        for (int64_t r = 0; r < rows; ++r) {
          RowLanes& lane = lanes[r];
          for (int j = 0; j < 2; ++j) {
            const __m512i keys = half_order_keys(_mm512_loadu_si512(buffer.data() + r * kBlockN + 32 * j));
            const __mmask32 above = _mm512_mask_cmpgt_epi16_mask(valid[j], keys, lane.max[j]);
            lane.max[j] = _mm512_mask_mov_epi16(lane.max[j], above, keys);
            lane.block[j] = _mm512_mask_mov_epi16(lane.block[j], above, block);
            lane.min[j] = _mm512_mask_min_epi16(lane.min[j], valid[j], lane.min[j], keys);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        for (int j = 0; j < 2; ++j) {
          _mm512_store_si512(max_keys + 32 * j, lanes[r].max[j]);
          _mm512_store_si512(min_keys + 32 * j, lanes[r].min[j]);
          _mm512_store_si512(blocks + 32 * j, lanes[r].block[j]);
        }
        const int16_t best = *std::max_element(max_keys, max_keys + kBlockN);
        const int16_t lowest = *std::min_element(min_keys, min_keys + kBlockN);
        int64_t index = std::numeric_limits<int64_t>::max();
        for (int64_t l = 0; l < kBlockN; ++l) {
          if (max_keys[l] == best) index = std::min(index, static_cast<int64_t>(blocks[l]) * kBlockN + l);
        }
        chunk.key[row + r] = best;
        chunk.index[row + r] = index;
        chunk.nan[row + r] = best > kInfKey || lowest < -kInfKey;
      }
    }
    std::lock_guard<std::mutex> lock(mutex);
    chunks.push_back(std::move(chunk));
  });
  std::sort(chunks.begin(), chunks.end(), [](const ChunkArgmax& a, const ChunkArgmax& b) { return a.begin < b.begin; });
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
  int64_t* result = out.data_ptr<int64_t>();
  std::vector<bf16> row_logits;
  for (int64_t r = 0; r < m; ++r) {
    int16_t best = std::numeric_limits<int16_t>::min();
    int64_t index = 0;
    bool nan = false;
    for (const ChunkArgmax& chunk : chunks) {  // in column order: a later chunk wins only if strictly above
      nan = nan || chunk.nan[r];
      if (chunk.key[r] > best) {
        best = chunk.key[r];
        index = chunk.index[r];
      }
    }
    if (nan) {  // the row's logits, computed alone (the same values: rows never mix), and their first NaN
      row_logits.resize(n);
      prepare_thread(amx, 1);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t col = b * kBlockN, width = std::min(kBlockN, n - col);
        bf16_rows(amx, 1, xp + r * k, k, wp + col * k, width, k, nullptr, row_logits.data() + col, n);
      }
      for (int64_t i = 0; i < n; ++i) {
        if ((row_logits[i].x & 0x7FFF) > kInfKey) {
          index = i;
          break;
        }
      }
    }
    result[r] = index;
  }
  return out;
}
#else
at::Tensor blocked_linear_argmax(const at::Tensor& x, const at::Tensor&, int64_t, bool) {
  TORCH_CHECK(false, "blocked_linear_argmax: this build has no AVX512-BF16 (", x.scalar_type(), ")");
  return at::Tensor();
}
#endif

}  // namespace

#if defined(PAGEDLLM_BLOCKED_BF16)
static_assert(kBlockN == pagedllm_blocked::kBlockOutputs && kRowsPerPass == pagedllm_blocked::kMaxRows,
              "blocked_bf16.h states this file's block width and rows per pass");

namespace pagedllm_blocked {
void prepare_bf16_rows(bool amx, int64_t m) { prepare_thread(amx, m); }

void bf16_block_rows(bool amx, int64_t rows, const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* block,
                     int64_t width, int64_t k, const c10::BFloat16* bias, c10::BFloat16* y, int64_t y_stride) {
  bf16_rows(amx, rows, x, x_stride, block, width, k, bias, y, y_stride);
}
}  // namespace pagedllm_blocked
#endif

TORCH_LIBRARY(pagedllm_cpu_linear, m) {
  m.def("blocked_linear_supports(ScalarType dtype, bool amx=False) -> bool", &blocked_linear_supports);
  m.def("blocked_linear_packed_numel(Tensor weight) -> int");
  m.def("blocked_linear_pack(Tensor weight, Tensor(a!)? out=None) -> Tensor");
  m.def("blocked_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, bool amx=False) -> Tensor");
  m.def("blocked_linear_argmax(Tensor x, Tensor packed, int out_features, bool amx=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu_linear, CPU, m) {
  m.impl("blocked_linear_packed_numel", &packed_numel);
  m.impl("blocked_linear_pack", &pack);
  m.impl("blocked_linear", &blocked_linear);
  m.impl("blocked_linear_argmax", &blocked_linear_argmax);
}
