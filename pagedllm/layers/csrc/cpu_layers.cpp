// Small fused CPU ops for the decoder's glue between the matmuls. At batch 1 a layer is four matmuls
// and some twenty small torch ops (norms, residual adds, RoPE's slices and concatenations), and each
// small op costs a few microseconds of dispatch whatever its size: fused here, they are one call each.
//
// Each op rounds exactly as the torch code it replaces (see pagedllm/layers/norm.py and rotary.py):
// a bf16 or fp16 tensor op computes in fp32 and rounds its result to the tensor's dtype, so the ops
// below round after every step the torch code rounds after. The one difference is the order of the
// sum of squares in RMSNorm (fp32, a few ulps), which no test or output can tell apart.
//
// Every op works row by row, so a row's result never depends on the rest of the batch.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "fast_exp.h"
#include "half_keys.h"
#include "row_max.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Element <-> fp32 in plain integer arithmetic the compiler vectorises (c10's conversions are scalar
// calls): bf16 is the top half of an fp32, and fp32 -> bf16 rounds to nearest even, NaN staying NaN.
inline float load(float x) { return x; }
inline float load(double x) { return static_cast<float>(x); }
inline float load(c10::Half x) { return static_cast<float>(x); }
inline float load(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((u >> 16) | 0x40u) : static_cast<uint16_t>(rounded);
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(double* dst, float x) { *dst = x; }
inline void store(c10::Half* dst, float x) { *dst = static_cast<c10::Half>(x); }
inline void store(c10::BFloat16* dst, float x) { dst->x = bf16_bits(x); }

// The fp32 -> dtype -> fp32 round trip of a torch op's result in that dtype.
template <typename T>
inline float round_to(float x) {
  T t;
  store(&t, x);
  return load(t);
}

// First index of the largest value of each row, as torch.argmax (a NaN counts as the largest, the
// first NaN wins). torch's CPU argmax along a row runs one scalar comparison per element; here a
// vectorised max pass, then a scan for its first occurrence that checks 256 elements at a time.
// Chunks of 256, not 64: each chunk ends in two horizontal reductions, which at 64 cost as much as the
// chunk's loads. The max pass: csrc/row_max.h.

template <typename T>
void argmax_rows_impl(const T* x, int64_t rows, int64_t cols, int64_t* out) {
  constexpr int64_t kChunk = 256;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk_max_of((cols + kChunk - 1) / kChunk);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * cols;
      // Pass 1: the maximum of every chunk, NaNs aside.
      bool has_nan = false;
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c * kChunk < cols; ++c) {
        const float m = pagedllm::chunk_max(row + c * kChunk, std::min(kChunk, cols - c * kChunk), has_nan);
        chunk_max_of[c] = m;
        best = std::max(best, m);
      }
      int64_t found = -1;
      if (has_nan) {  // torch.argmax returns the first NaN, if any
        for (int64_t i = 0; i < cols && found < 0; ++i) {
          if (load(row[i]) != load(row[i])) found = i;
        }
      }
      // Pass 2: the first chunk that reached the maximum, then the first element in it that did.
      for (int64_t c = 0; found < 0 && c * kChunk < cols; ++c) {
        if (chunk_max_of[c] != best) continue;
        for (int64_t i = c * kChunk; i < std::min(cols, (c + 1) * kChunk); ++i) {
          if (load(row[i]) == best) {
            found = i;
            break;
          }
        }
      }
      out[r] = found < 0 ? 0 : found;
    }
  });
}

#if defined(__AVX512BW__) || defined(__AVX2__)
// bf16 and fp16 rows, compared as 16-bit integer keys instead of widened to fp32 (half_keys.h: they
// order as the values do, +0 and -0 equal, NaNs beyond the infinities), so the max pass is 32 (AVX-512BW)
// or 16 (AVX2) integer max ops per instruction with no conversion, as fast as the rows are read from
// cache. As torch.argmax: the first NaN wins, and +0 and -0 are equal.
#if defined(__AVX512BW__)
struct KeyVec {
  using V = __m512i;
  static constexpr int kLanes = 32;
  static V keys(const uint16_t* p) { return half_order_keys(_mm512_loadu_si512(p)); }
  static V fill(int16_t k) { return _mm512_set1_epi16(k); }
  static V max(V a, V b) { return _mm512_max_epi16(a, b); }
  static V min(V a, V b) { return _mm512_min_epi16(a, b); }
  static uint64_t eq(V a, V b) { return _mm512_cmpeq_epi16_mask(a, b); }  // one bit per lane
  static constexpr int kBitsPerLane = 1;
};
#else
struct KeyVec {
  using V = __m256i;
  static constexpr int kLanes = 16;
  static V keys(const uint16_t* p) {
    return half_order_keys(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V fill(int16_t k) { return _mm256_set1_epi16(k); }
  static V max(V a, V b) { return _mm256_max_epi16(a, b); }
  static V min(V a, V b) { return _mm256_min_epi16(a, b); }
  static uint64_t eq(V a, V b) {  // two bits per lane
    return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi16(a, b)));
  }
  static constexpr int kBitsPerLane = 2;
};
#endif

template <typename V>
inline int16_t reduce_keys(V v, bool take_max) {
  alignas(64) int16_t lanes[KeyVec::kLanes];
  std::memcpy(lanes, &v, sizeof(lanes));
  return take_max ? *std::max_element(lanes, lanes + KeyVec::kLanes) : *std::min_element(lanes, lanes + KeyVec::kLanes);
}

// The first index of x[begin, end) whose key is `want`; -1 if none.
inline int64_t find_key(const uint16_t* x, int64_t begin, int64_t end, int16_t want) {
  using K = KeyVec;
  const K::V w = K::fill(want);
  int64_t i = begin;
  for (; i + K::kLanes <= end; i += K::kLanes) {
    const K::V k = K::keys(x + i);
    const uint64_t hits = K::eq(k, w);
    if (hits) return i + __builtin_ctzll(hits) / K::kBitsPerLane;
  }
  for (; i < end; ++i) {
    if (half_order_key(x[i]) == want) return i;
  }
  return -1;
}

template <typename T>
void argmax_rows_half(const T* x_, int64_t rows, int64_t cols, int64_t* out) {
  using K = KeyVec;
  const int16_t inf_bits = std::is_same_v<T, c10::BFloat16> ? 0x7F80 : 0x7C00;
  const int16_t pos_inf = inf_bits, neg_inf = -inf_bits;  // keys beyond these are NaNs
  const uint16_t* x = reinterpret_cast<const uint16_t*>(x_);
  constexpr int64_t kChunk = 1024;  // one horizontal reduction per chunk, so pass 2 scans one chunk
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int16_t> chunk_max_of((cols + kChunk - 1) / kChunk);
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = x + r * cols;
      int16_t best = std::numeric_limits<int16_t>::min(), lowest = std::numeric_limits<int16_t>::max();
      for (int64_t c = 0; c * kChunk < cols; ++c) {
        const int64_t first = c * kChunk, last = std::min(cols, first + kChunk);
        K::V m0 = K::fill(std::numeric_limits<int16_t>::min()), m1 = m0;
        K::V n0 = K::fill(std::numeric_limits<int16_t>::max()), n1 = n0;
        int64_t i = first;
        for (; i + 2 * K::kLanes <= last; i += 2 * K::kLanes) {
          const K::V a = K::keys(row + i), b = K::keys(row + i + K::kLanes);
          m0 = K::max(m0, a);
          m1 = K::max(m1, b);
          n0 = K::min(n0, a);
          n1 = K::min(n1, b);
        }
        int16_t m = reduce_keys(K::max(m0, m1), true), n = reduce_keys(K::min(n0, n1), false);
        for (; i < last; ++i) {
          const int16_t k = half_order_key(row[i]);
          m = std::max(m, k);
          n = std::min(n, k);
        }
        chunk_max_of[c] = m;
        best = std::max(best, m);
        lowest = std::min(lowest, n);
      }
      int64_t found = -1;
      if (best > pos_inf || lowest < neg_inf) {  // a NaN: torch.argmax returns the first one
        for (int64_t i = 0; i < cols && found < 0; ++i) {
          if (load(x_[r * cols + i]) != load(x_[r * cols + i])) found = i;
        }
      }
      // the first chunk holding the maximum, then its first element equal to it
      for (int64_t c = 0; found < 0 && c * kChunk < cols; ++c) {
        if (chunk_max_of[c] == best) {
          found = find_key(row, c * kChunk, std::min(cols, (c + 1) * kChunk), best);
        }
      }
      out[r] = found < 0 ? 0 : found;
    }
  });
}
#endif

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "argmax_rows: a 2-D tensor with contiguous rows");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    TORCH_CHECK(x.stride(0) == x.size(1), "argmax_rows: rows must be packed");
#if defined(__AVX512BW__) || defined(__AVX2__)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
      argmax_rows_half<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
      return;
    }
#endif
    argmax_rows_impl<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  });
  return out;
}

// out = h * inv * weight, rounded as norm.py does (see fused_add_rms_norm below).
template <typename T>
inline void scale_row(const T* h, T* out, const T* weight, int64_t cols, float inv) {
#pragma omp simd
  for (int64_t i = 0; i < cols; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      out[i] = h[i] * inv * weight[i];
    } else {
      store(out + i, load(weight[i]) * round_to<T>(load(h[i]) * inv));
    }
  }
}

// residual <- x + residual; x <- RMSNorm(residual) * weight, both in place, one pass per row.
// As norm.py: fp32 rows use F.rms_norm's fused form (x * rsqrt(mean(x^2) + eps) * w, rounded once);
// 16-bit rows are normalised in fp32, rounded to the dtype, then multiplied by the weight in the dtype.
template <typename T>
void add_rms_norm_impl(T* x, T* residual, const T* weight, int64_t rows, int64_t cols, int64_t x_stride,
                       int64_t res_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      T* rr = residual + r * res_stride;
      float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
      for (int64_t i = 0; i < cols; ++i) {
        const float h = round_to<T>(load(xr[i]) + load(rr[i]));
        store(rr + i, h);
        sumsq += h * h;
      }
      scale_row<T>(rr, xr, weight, cols, 1.f / std::sqrt(sumsq / static_cast<float>(cols) + eps));
    }
  });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.dim() == 2 && x.sizes() == residual.sizes(), "fused_add_rms_norm: shapes");
  TORCH_CHECK(x.stride(1) == 1 && residual.stride(1) == 1 && weight.is_contiguous(), "fused_add_rms_norm: layout");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "fused_add_rms_norm: dtypes");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                x.size(0), x.size(1), x.stride(0), residual.stride(0), static_cast<float>(eps));
  });
}

// out <- RMSNorm(x) * weight for rows that have no residual to add (the first layer's input norm),
// rounded as fused_add_rms_norm's norm. torch's F.rms_norm is a composite of six ops in fp32, each a
// call and a pass over memory.
template <typename T>
void rms_norm_impl(const T* x, T* out, const T* weight, int64_t rows, int64_t cols, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * cols;
      float sumsq = 0.f;
#pragma omp simd reduction(+ : sumsq)
      for (int64_t i = 0; i < cols; ++i) {
        const float h = load(xr[i]);
        sumsq += h * h;
      }
      scale_row<T>(xr, o, weight, cols, 1.f / std::sqrt(sumsq / static_cast<float>(cols) + eps));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: [T, H] rows with contiguous columns and an [H] weight");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: dtypes");
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), x.stride(0), static_cast<float>(eps));
  });
  return out;
}

// Rotate-half RoPE of q [T, Hq, D] and k [T, Hk, D] in place (rows may be strided, as the q and k views
// of the fused qkv output are), with cos/sin [T, D] already looked up for the step's positions:
// x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype as the torch code does.
// No FMA contraction here: a fused multiply-add would round once where torch rounds twice.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_rows(T* x, int64_t heads, int64_t head_stride,
                                                            const T* cos, const T* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * head_stride;
    float out[1024];
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = round_to<T>(load(v[i]) * load(cos[i]));
      const float b = round_to<T>(-load(v[i + half]) * load(sin[i]));
      out[i] = a + b;
    }
#pragma omp simd
    for (int64_t i = half; i < D; ++i) {
      const float a = round_to<T>(load(v[i]) * load(cos[i]));
      const float b = round_to<T>(load(v[i - half]) * load(sin[i]));
      out[i] = a + b;
    }
    #pragma omp simd
    for (int64_t i = 0; i < D; ++i) store(v + i, out[i]);
  }
}

void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "rotary_embedding: shapes");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % 2 == 0 && q.size(2) <= 1024, "rotary_embedding: layout");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == q.size(0) * q.size(2),
              "rotary_embedding: cos/sin must be [T, D] contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == cos.scalar_type(), "rotary_embedding: dtypes");
  const int64_t T = q.size(0), D = q.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rope_rows<scalar_t>(qp + t * q.stride(0), q.size(1), q.stride(1), cp + t * D, sp + t * D, D);
        rope_rows<scalar_t>(kp + t * k.stride(0), k.size(1), k.stride(1), cp + t * D, sp + t * D, D);
      }
    });
  });
}

// out = silu(gate) * up for gate_up = [gate | up] (the fused projection's output), [T, 2I] -> [T, I]:
// one pass instead of torch's chunk, silu and multiply, each a pass over memory (a long prefill's MLP
// activations are tens of MB). silu rounds to the dtype before the
// multiply, as the torch code does; its exp is ours (fast_exp.h), not torch's, so an fp32 result may
// differ from F.silu's in the last bit or two (and then, rarely, a 16-bit one by one ulp).
template <typename T>
void silu_and_mul_impl(const T* gate_up, T* out, int64_t rows, int64_t inter, int64_t in_stride) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * in_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float x = load(g[i]);
        const float act = round_to<T>(x / (1.f + pagedllm::fast_exp(-x)));
        store(o + i, act * load(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: [T, 2 * intermediate] with contiguous rows");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), inter,
                                gate_up.stride(0));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedllm_cpu_layers, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu_layers, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
