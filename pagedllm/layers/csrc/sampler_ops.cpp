// The sampler's full-vocabulary passes (pagedllm/layers/sampler.py): the seeded Gumbel race without its
// noise tensor, an unseeded row's draw from its softmax, and the top-C candidates that top-k/top-p filter.
//
// seeded_race:
// A seeded row draws argmax_j (x_j + g_j) over its kept logits x (the removed ones -inf), where
// g_j = -log(-log(u_j)) and u_j is splitmix64 of (the row's position key, token id j). The torch code
// hashes every token of the row into [C] int64 and float64 tensors and takes two logs of each: about 15
// full-row passes, 3 ms a row over a 49,152-token vocabulary, for one winner. Here:
//
//   1. the row's best logit x_t (the first, as argmax) and its race value r_t = x_t + g_t give a lower
//      bound B <= max_j r_j;
//   2. one pass hashes each kept token and keeps it as a contender only if it may still reach B:
//      r_j >= B needs -log(u_j) <= exp(x_j - B), and -log(u) >= 1 - u, so 1 - u_j > exp(x_j - B) (with a
//      margin far above the rounding of both sides) rules j out without a logarithm;
//   3. the contenders (a handful: token j passes with probability about exp(x_j - B)) get their exact
//      noise from at::log, the very function torch's reference calls (its result does not depend on a
//      value's place in a tensor), and the largest x_j + g_j wins, the first on ties.
//
// So the chosen column is the reference's bit for bit: the same hash, the same float64 ops on the
// same values for every token that can win, and the same tie rule. A row with a NaN takes its first NaN
// and a row with +inf its first +inf (torch.argmax's answer); a row with nothing kept takes column 0.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/log.h>
#include <torch/library.h>

#include "fast_exp.h"
#include "row_max.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// Every op's float input (sampler.float_rows_on_cpu on the Python side); `what` names the op and argument.
inline void check_float_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be a contiguous 2-D float32 tensor");
}

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// u_j of sampler.py's _seeded_uniform: splitmix64 of key + (token + 1) * golden, its top 53 bits + 1/2
// scaled into (0, 1).
inline double seeded_uniform(uint64_t key, int64_t token) {
  uint64_t z = key + static_cast<uint64_t>(token + 1) * kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z = z ^ (z >> 31);
  return (static_cast<double>(z >> 11) + 0.5) * 0x1p-53;
}

struct RowPlan {
  int64_t answer = -1;             // decided without the race (NaN, +inf, nothing kept)
  std::vector<int64_t> columns;    // the contenders
  std::vector<double> uniforms;    // their u
};

// Rules a token out when 1 - u > exp(v - B) * kMargin. fast_exp's relative error is about 2e-7, the float
// roundings of 1 - u and of v - B (|B| < 1024 there: 6e-5 of an absolute error at most) stay far below it.
constexpr float kMargin = 1.001f;

// Step 2 in float, a block at a time: a branch-free pass the compiler vectorises (64-bit multiplies and
// conversions included, with AVX-512), then the few flagged tokens get their exact u.
template <bool kIds>
inline void scan_block(const float* x, const int64_t* ids, int64_t n, uint64_t key, double bound, RowPlan& plan) {
  constexpr int64_t kBlock = 256;
  const float bound_f = static_cast<float>(bound);
  uint8_t flag[kBlock];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    int any = 0;  // (a count: with a bool reduction GCC leaves the loop scalar)
#pragma omp simd reduction(+ : any)
    for (int64_t i = 0; i < len; ++i) {
      const int64_t j = start + i;
      const float d = x[j] - bound_f;  // -inf for a removed token
      uint64_t z = key + static_cast<uint64_t>((kIds ? ids[j] : j) + 1) * kGolden;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z = z ^ (z >> 31);
      // (2^53 - m - 1) 2^-53 <= 1 - u = (2^53 - m - 1/2) 2^-53: rounding down keeps the test conservative
      const float gap = static_cast<float>(static_cast<int64_t>((1ull << 53) - (z >> 11) - 1)) * 0x1p-53f;
      const bool keep = (d >= -37.5f) & (gap <= pagedllm::fast_exp(d) * kMargin);
      flag[i] = keep;
      any += keep;
    }
    if (!any) continue;
    for (int64_t i = 0; i < len; ++i) {
      if (flag[i]) {
        const int64_t j = start + i;
        plan.columns.push_back(j);
        plan.uniforms.push_back(seeded_uniform(key, kIds ? ids[j] : j));
      }
    }
  }
}

// A row's max into m (NaNs skipped), and the column the row takes without a softmax or a race where its
// values leave no choice, as torch.argmax would: the first NaN, else the first +inf (+inf plus any noise
// stays +inf), column 0 where every value is -inf; -1 for a row of finite max and no NaN.
inline int64_t argmax_without_softmax(const float* x, int64_t n, float& m) {
  bool maybe_nan = false;  // (also set by an infinity: the scan then finds no NaN)
  m = pagedllm::chunk_max(x, n, maybe_nan);
  for (int64_t j = 0; maybe_nan && j < n; ++j) {
    if (x[j] != x[j]) return j;
  }
  if (m == std::numeric_limits<float>::infinity()) return std::find(x, x + n, m) - x;
  if (m == -std::numeric_limits<float>::infinity()) return 0;
  return -1;
}

// Steps 1 and 2 for one row of n values; token id of column j: ids[j], or j.
inline void plan_row(const float* x, const int64_t* ids, int64_t n, uint64_t key, RowPlan& plan) {
  float best;
  plan.answer = argmax_without_softmax(x, n, best);
  if (plan.answer >= 0) return;
  const int64_t top = std::find(x, x + n, best) - x;
  const double u_top = seeded_uniform(key, ids ? ids[top] : top);
  // std::log, not at::log, may differ from the reference in the last bit: the margin covers that (the
  // race values are below 1e3, their ulp below 1e-12).
  const double bound = static_cast<double>(best) - std::log(-std::log(u_top)) - 1e-6;
  if (std::abs(bound) < 1024.0) {
    if (ids) {
      scan_block<true>(x, ids, n, key, bound, plan);
    } else {
      scan_block<false>(x, ids, n, key, bound, plan);
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {  // huge logits: v - B in double, then small enough for a float
    const double d = static_cast<double>(x[j]) - bound;
    if (!(d >= -37.5)) continue;
    const double u = seeded_uniform(key, ids ? ids[j] : j);
    if (static_cast<float>(1.0 - u) > pagedllm::fast_exp(static_cast<float>(d)) * kMargin) continue;
    plan.columns.push_back(j);
    plan.uniforms.push_back(u);
  }
}

}  // namespace

// values [N, C] float32 (removed tokens -inf), token_ids [N, C] int64 or None (column j is token j),
// keys [N] int64 (sampler.position_seed per row) -> [N] int64, the winning column of each row.
at::Tensor seeded_race(const at::Tensor& values, const std::optional<at::Tensor>& token_ids, const at::Tensor& keys) {
  check_float_rows(values, "seeded_race: values");
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == values.size(0) && keys.scalar_type() == at::kLong,
              "seeded_race: one int64 key per row");
  const int64_t rows = values.size(0), cols = values.size(1);
  const int64_t* ids = nullptr;
  at::Tensor ids_contig;
  if (token_ids.has_value()) {
    ids_contig = token_ids->contiguous();
    TORCH_CHECK(ids_contig.sizes() == values.sizes() && ids_contig.scalar_type() == at::kLong,
                "seeded_race: token_ids must be int64 and shaped as values");
    ids = ids_contig.data_ptr<int64_t>();
  }
  const auto keys_contig = keys.contiguous();
  const float* x = values.data_ptr<float>();
  const int64_t* key = keys_contig.data_ptr<int64_t>();
  std::vector<RowPlan> plans(rows);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      plan_row(x + r * cols, ids ? ids + r * cols : nullptr, cols, static_cast<uint64_t>(key[r]), plans[r]);
    }
  });
  // Step 3: every row's contenders in one tensor, through torch's own log (twice, as seeded_gumbel).
  std::vector<double> uniforms;
  for (const auto& plan : plans) uniforms.insert(uniforms.end(), plan.uniforms.begin(), plan.uniforms.end());
  at::Tensor gumbel;
  if (!uniforms.empty()) {
    const auto u = at::from_blob(uniforms.data(), {static_cast<int64_t>(uniforms.size())},
                                 at::TensorOptions().dtype(at::kDouble));
    gumbel = -at::log(-at::log(u));
  }
  const double* g = uniforms.empty() ? nullptr : gumbel.data_ptr<double>();
  auto out = at::empty({rows}, values.options().dtype(at::kLong));
  int64_t* winner = out.data_ptr<int64_t>();
  int64_t offset = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const RowPlan& plan = plans[r];
    if (plan.answer >= 0) {
      winner[r] = plan.answer;
      continue;
    }
    double best = -std::numeric_limits<double>::infinity();
    int64_t best_col = plan.columns.front();  // the top token always contends (its gap is below its bound)
    for (size_t i = 0; i < plan.columns.size(); ++i) {
      const double race = static_cast<double>(x[r * cols + plan.columns[i]]) + g[offset + i];
      if (race > best) {  // strictly: the first of equal values wins, as argmax
        best = race;
        best_col = plan.columns[i];
      }
    }
    winner[r] = best_col;
    offset += static_cast<int64_t>(plan.columns.size());
  }
  return out;
}

// top_candidates: each row's c largest values in descending order and their columns: torch.topk's values
// (a tie may list its columns in another order, and -0 and +0 may swap places: the sampler's filters
// read values only, and its exact-candidates test refuses a kept set that a tie at the last candidate
// cuts, so the kept tokens are the same). torch.topk keeps a c-element
// heap per row. Here a row of 8 c values or more first tries a threshold estimated on a strided sample
// (top_row_sampled: one vector pass keeps the values at or above it); a shorter row, or one where fewer
// than c values reached the threshold, is counted in 2,048 bins of its values' order-preserving 32-bit
// keys (sign, exponent and two mantissa bits), the bins from the top down that hold the c largest are
// collected (a few hundred values for a trained model's logits), and only those are sorted (top_row). Both
// give the same columns in the same order. A row with a NaN is left to torch (has_nan: the caller runs
// torch.topk instead).

namespace {

inline uint32_t order_key(float v) {  // ascending keys for ascending floats, -0 just below +0
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The c largest of the picked (order key, column) pairs, largest first and equal keys by column, written
// out as values and columns of x.
inline void write_largest(const float* x, std::vector<std::pair<uint32_t, int64_t>>& picked, int64_t c,
                          float* values, int64_t* columns) {
  auto larger = [](const std::pair<uint32_t, int64_t>& a, const std::pair<uint32_t, int64_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  std::nth_element(picked.begin(), picked.begin() + (c - 1), picked.end(), larger);
  std::sort(picked.begin(), picked.begin() + c, larger);
  for (int64_t i = 0; i < c; ++i) {
    values[i] = x[picked[i].second];
    columns[i] = picked[i].second;
  }
}

// The c largest of a row without a NaN by the histogram of its keys.
inline void top_row(const float* x, int64_t n, int64_t c, float* values, int64_t* columns,
                    std::vector<uint32_t>& hist, std::vector<std::pair<uint32_t, int64_t>>& picked) {
  constexpr int kShift = 21;
  std::fill(hist.begin(), hist.end(), 0u);
  for (int64_t j = 0; j < n; ++j) ++hist[order_key(x[j]) >> kShift];
  int64_t bin = static_cast<int64_t>(hist.size()) - 1, count = 0;
  for (; bin > 0; --bin) {
    count += hist[bin];
    if (count >= c) break;
  }
  const uint32_t floor = static_cast<uint32_t>(bin) << kShift;
  picked.clear();
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t key = order_key(x[j]);
    if (key >= floor) picked.emplace_back(key, j);
  }
  write_largest(x, picked, c, values, columns);
}

// Scratch of one thread's rows for top_row_sampled.
struct TopScratch {
  std::vector<float> sample;
  std::vector<float> kept_values;
  std::vector<int32_t> kept_columns;
};

// The c largest of a long row from a threshold estimated on a strided sample: the sample's order
// statistic a little above where the row's c-th value should fall, then one pass keeps every value at or
// above it (AVX-512: a compare and two compresses per 16 values), and only those (about 1.5 c)
// are ordered. Returns false, having written nothing, where fewer than c values reached the threshold
// (the caller then counts the whole row in the histogram). The kept set holds every value of the c
// largest and all values tied with the c-th, so the result is top_row's.
inline bool top_row_sampled(const float* x, int64_t n, int64_t c, float* values, int64_t* columns,
                            TopScratch& scratch, std::vector<std::pair<uint32_t, int64_t>>& picked) {
  const int64_t stride = std::max<int64_t>(1, n / std::clamp<int64_t>(16 * n / c, 512, 2048));
  auto& sample = scratch.sample;
  sample.clear();
  for (int64_t j = 0; j < n; j += stride) sample.push_back(x[j]);
  const int64_t size = static_cast<int64_t>(sample.size());
  // the sample's expected count at or above the row's c-th value, plus three standard deviations
  const int64_t expected = (c * size + n - 1) / n;
  const int64_t rank = std::min<int64_t>(size, expected + 3 * static_cast<int64_t>(std::ceil(std::sqrt(expected))) + 2);
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(), std::greater<float>());
  const float threshold = sample[rank - 1];
  auto& kept_values = scratch.kept_values;
  auto& kept_columns = scratch.kept_columns;
  kept_values.resize(n + 16);  // (a whole vector stored at the last kept position)
  kept_columns.resize(n + 16);
  int64_t count = 0, j = 0;
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(threshold);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i column = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= n; j += 16, column = _mm512_add_epi32(column, step)) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 keep = _mm512_cmp_ps_mask(v, t, _CMP_GE_OQ);
    if (keep == 0) continue;
    // Compressed in a register and stored whole (on Zen 4 a compressing store to memory is microcoded),
    // merged into the source (Zen 4's zero-masked compress waits on its destination's old value); the
    // lanes past the kept ones are overwritten or never read.
    _mm512_storeu_ps(kept_values.data() + count, _mm512_mask_compress_ps(v, keep, v));
    _mm512_storeu_si512(kept_columns.data() + count, _mm512_mask_compress_epi32(column, keep, column));
    count += _mm_popcnt_u32(keep);
  }
#endif
  for (; j < n; ++j) {  // branch-free: written always, counted only when kept
    kept_values[count] = x[j];
    kept_columns[count] = static_cast<int32_t>(j);
    count += x[j] >= threshold;
  }
  if (count < c) return false;
  picked.clear();
  for (int64_t i = 0; i < count; ++i) picked.emplace_back(order_key(kept_values[i]), kept_columns[i]);
  write_largest(x, picked, c, values, columns);
  return true;
}

// The c largest values of rows without a NaN and their columns, one thread's scratch kept across its rows:
// a sampled threshold for a long row, the histogram for a short one or where the threshold fell short.
struct TopSelector {
  std::vector<uint32_t> hist = std::vector<uint32_t>(2048);
  std::vector<std::pair<uint32_t, int64_t>> picked;
  TopScratch scratch;

  void select(const float* row, int64_t n, int64_t c, float* values, int64_t* columns) {
    if (n >= 8 * c && n <= std::numeric_limits<int32_t>::max() &&
        top_row_sampled(row, n, c, values, columns, scratch, picked)) {
      return;
    }
    top_row(row, n, c, values, columns, hist, picked);
  }
};

// Whether a row whose max pass set maybe_nan (a NaN or an infinity: chunk_max) holds a NaN.
inline bool has_nan(const float* row, int64_t n, bool maybe_nan) {
  return maybe_nan && std::any_of(row, row + n, [](float value) { return value != value; });
}

// The row's max into m; false where it is infinite or the row holds a NaN (no softmax to speak of).
inline bool finite_max(const float* row, int64_t n, float& m) {
  bool maybe_nan = false;
  m = pagedllm::chunk_max(row, n, maybe_nan);
  return !std::isinf(m) && !has_nan(row, n, maybe_nan);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, bool> top_candidates(const at::Tensor& x, int64_t c) {
  check_float_rows(x, "top_candidates: x");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(c >= 1 && c <= cols, "top_candidates: c must be in [1, columns]");
  auto values = at::empty({rows, c}, x.options());
  auto columns = at::empty({rows, c}, x.options().dtype(at::kLong));
  const float* in = x.data_ptr<float>();
  float* v = values.data_ptr<float>();
  int64_t* col = columns.data_ptr<int64_t>();
  std::atomic<bool> nan{false};
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    TopSelector selector;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * cols;
      bool maybe_nan = false;
      pagedllm::chunk_max(row, cols, maybe_nan);
      if (has_nan(row, cols, maybe_nan)) {
        nan = true;  // the caller runs torch.topk
        continue;
      }
      selector.select(row, cols, c, v + r * c, col + r * c);
    }
  });
  return {values, columns, nan.load()};
}

// categorical: one draw per row from softmax(values) by inverting its CDF at the row's uniform u in [0, 1)
// (sampler._torch_categorical's method without its tensors: a softmax, a float64 cumsum of the whole
// row, which torch runs one scalar add at a time, and a search). Per row: the max, then
// p_j = exp(x_j - max) (fast_exp: no subnormal arithmetic, whose assists cost hundreds of cycles on Intel
// cores) with float64 sums of 256-token blocks, then the first token whose cumulative sum passes
// u * total: the block by its sums, the token within it in float64. A token of probability 0 (its logit
// -inf, or 2^-126 below the max) is never drawn. A row with a NaN takes its first NaN and a row with +inf
// its first +inf (as argmax); a row with nothing kept (all -inf) takes column 0.

namespace {

constexpr int64_t kDrawBlock = 256;

inline int64_t draw_row(const float* x, int64_t n, double u, float* p, std::vector<double>& block_sums) {
  float m;
  const int64_t answer = argmax_without_softmax(x, n, m);
  if (answer >= 0) return answer;
  const int64_t blocks = (n + kDrawBlock - 1) / kDrawBlock;
  block_sums.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kDrawBlock, end = std::min(n, begin + kDrawBlock);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = begin; j < end; ++j) {
      p[j] = pagedllm::fast_exp(x[j] - m);
      sum += p[j];
    }
    block_sums[b] = sum;
    total += sum;
  }
  const double target = u * total;
  double cumulative = 0.0;
  int64_t b = 0;
  for (; b + 1 < blocks && cumulative + block_sums[b] <= target; ++b) cumulative += block_sums[b];
  const int64_t begin = b * kDrawBlock, end = std::min(n, begin + kDrawBlock);
  int64_t last = -1;  // the block's last token of nonzero probability, where rounding leaves target past it
  for (int64_t j = begin; j < end; ++j) {
    if (p[j] == 0.f) continue;
    cumulative += p[j];
    last = j;
    if (cumulative > target) return j;
  }
  if (last >= 0) return last;
  for (int64_t j = begin - 1; j >= 0; --j) {  // (a block of zeros reached by rounding: the one before)
    if (p[j] != 0.f) return j;
  }
  return 0;
}

}  // namespace

// values [N, V] float32 (logits after temperature and filters, removed tokens -inf), uniforms [N] float64
// in [0, 1) -> [N] int64 token columns.
at::Tensor categorical(const at::Tensor& values, const at::Tensor& uniforms) {
  check_float_rows(values, "categorical: values");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == values.size(0) && uniforms.scalar_type() == at::kDouble,
              "categorical: one float64 uniform per row");
  const int64_t rows = values.size(0), cols = values.size(1);
  TORCH_CHECK(cols >= 1, "categorical: rows must not be empty");
  const auto u = uniforms.contiguous();
  const float* x = values.data_ptr<float>();
  const double* uniform = u.data_ptr<double>();
  auto out = at::empty({rows}, values.options().dtype(at::kLong));
  int64_t* drawn = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(cols);
    std::vector<double> block_sums;
    for (int64_t r = begin; r < end; ++r) drawn[r] = draw_row(x + r * cols, cols, uniform[r], p.data(), block_sums);
  });
  return out;
}

namespace {

// sum(exp(x - m)) over a row (m its max), in float64 over float blocks of kDrawBlock
inline double exp_sum(const float* x, int64_t n, float m) {
  double total = 0.0;
  for (int64_t begin = 0; begin < n; begin += kDrawBlock) {
    const int64_t end = std::min(n, begin + kDrawBlock);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = begin; j < end; ++j) sum += pagedllm::fast_exp(x[j] - m);
    total += sum;
  }
  return total;
}

// How many of the row's log-probabilities (x - m) - log_sum exceed `chosen`, in that float arithmetic.
// (A function of its own: inlined into a parallel lambda, GCC may leave such a loop scalar.)
__attribute__((noinline)) int64_t count_above(const float* x, int64_t n, float m, float log_sum, float chosen) {
  int above = 0;
#pragma omp simd reduction(+ : above)
  for (int64_t j = 0; j < n; ++j) above += ((x[j] - m) - log_sum) > chosen;
  return above;
}

}  // namespace

// row_logsumexp: each row's log(sum(exp(x))), top-p's normalizer over a whole row, in two passes (the
// max, then fast_exp(x - max) summed in float64) where torch's logsumexp makes four (max, subtract, exp,
// sum) and writes two row-sized tensors. A row with a NaN gives NaN, with +inf +inf, all -inf -inf.
at::Tensor row_logsumexp(const at::Tensor& x) {
  check_float_rows(x, "row_logsumexp: x");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto out = at::empty({rows}, x.options());
  const float* in = x.data_ptr<float>();
  float* lse = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * cols;
      bool maybe_nan = false;
      const float m = pagedllm::chunk_max(row, cols, maybe_nan);
      if (has_nan(row, cols, maybe_nan)) {
        lse[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (std::isinf(m)) {  // +inf, or every value -inf
        lse[r] = m;
        continue;
      }
      lse[r] = static_cast<float>(static_cast<double>(m) + std::log(exp_sum(row, cols, m)));
    }
  });
  return out;
}

// top_p_threshold: for rows filtered by top-p alone (no top-k), the smallest logit top-p keeps, without
// sorting the row: a token is kept iff the mass of the tokens strictly above it is below top_p (so ties
// with the last kept token stay, as sampler.py's rule says). One pass sums each row's probabilities
// (fast_exp(x - max), float64) into 2,048 bins of the values' order keys; the bins are walked from the
// top to the one where the mass above reaches top_p, and only that bin's values are sorted. A row with a
// NaN or an infinite max sets `special` (the caller sorts).
std::tuple<at::Tensor, bool> top_p_threshold(const at::Tensor& x, const at::Tensor& top_p) {
  check_float_rows(x, "top_p_threshold: x");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == rows, "top_p_threshold: one top_p per row");
  const auto p = top_p.to(at::kDouble).contiguous();
  auto out = at::empty({rows}, x.options());
  const float* in = x.data_ptr<float>();
  const double* top = p.data_ptr<double>();
  float* threshold = out.data_ptr<float>();
  std::atomic<bool> special{false};
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    constexpr int kShift = 21, kBins = 2048;
    std::vector<double> mass(kBins);
    std::vector<float> bin_values;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * cols;
      float m;
      if (!finite_max(row, cols, m)) {
        special = true;
        continue;
      }
      std::fill(mass.begin(), mass.end(), 0.0);
      double total = 0.0;
      for (int64_t j = 0; j < cols; ++j) {
        const double pj = pagedllm::fast_exp(row[j] - m);
        mass[order_key(row[j]) >> kShift] += pj;
        total += pj;
      }
      const double target = top[r] * total;
      double above = 0.0;  // the mass of the bins above the current one
      int bin = kBins - 1;
      for (; bin > 0 && above + mass[bin] < target; --bin) above += mass[bin];
      // the bin where the mass above a token reaches top_p: its values, largest first, by distinct value
      bin_values.clear();
      for (int64_t j = 0; j < cols; ++j) {
        if (static_cast<int>(order_key(row[j]) >> kShift) == bin) bin_values.push_back(row[j]);
      }
      std::sort(bin_values.begin(), bin_values.end(), std::greater<float>());
      // (the first value always stays: the mass above it is below top_p; an empty bin, which rounding
      // alone could reach, keeps the max alone)
      float kept = bin_values.empty() ? m : bin_values.front();
      for (size_t i = 0; i < bin_values.size();) {
        if (above >= target) break;
        kept = bin_values[i];
        size_t same = i;
        while (same < bin_values.size() && bin_values[same] == bin_values[i]) ++same;
        above += static_cast<double>(same - i) * pagedllm::fast_exp(bin_values[i] - m);
        i = same;
      }
      threshold[r] = kept;
    }
  });
  return {out, special.load()};
}

// logprobs: what the sampler reports of each row's raw distribution, the log-probabilities
// (x - max) - log(sum(exp(x - max))) as log_softmax computes them: the chosen token's, its rank (1 + the
// tokens whose log-probability is higher) and the k best tokens' (top_candidates' order). Torch's way
// (log_softmax, gather, topk, a comparison summed as int64) writes three row-sized tensors; here the max,
// the sum, the count and the k best are passes over the row alone. A row with a NaN or an infinite max
// sets `special` and nothing of the call is used (the caller runs torch's way).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, bool> logprobs(const at::Tensor& x,
                                                                       const at::Tensor& token_ids, int64_t k) {
  check_float_rows(x, "logprobs: x");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.size(0) == rows && token_ids.scalar_type() == at::kLong,
              "logprobs: one int64 token id per row");
  TORCH_CHECK(k >= 0 && k <= cols, "logprobs: k must be in [0, columns]");
  const auto ids = token_ids.contiguous();
  auto chosen = at::empty({rows}, x.options());
  auto top_values = at::empty({rows, k}, x.options());
  auto top_columns = at::empty({rows, k}, x.options().dtype(at::kLong));
  auto ranks = at::empty({rows}, x.options().dtype(at::kLong));
  const float* in = x.data_ptr<float>();
  const int64_t* token = ids.data_ptr<int64_t>();
  float* chosen_lp = chosen.data_ptr<float>();
  float* top_lp = top_values.data_ptr<float>();
  int64_t* top_col = top_columns.data_ptr<int64_t>();
  int64_t* rank = ranks.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(token[r] >= 0 && token[r] < cols, "logprobs: token id out of range");
  std::atomic<bool> special{false};
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    TopSelector selector;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * cols;
      float m;
      if (!finite_max(row, cols, m)) {
        special = true;
        continue;
      }
      const float log_sum = static_cast<float>(std::log(exp_sum(row, cols, m)));
      chosen_lp[r] = (row[token[r]] - m) - log_sum;
      rank[r] = 1 + count_above(row, cols, m, log_sum, chosen_lp[r]);
      if (k == 0) continue;
      float* values = top_lp + r * k;
      selector.select(row, cols, k, values, top_col + r * k);
      for (int64_t i = 0; i < k; ++i) values[i] = (values[i] - m) - log_sum;
    }
  });
  return {chosen, top_values, top_columns, ranks, special.load()};
}

TORCH_LIBRARY(pagedllm_cpu_sampler, m) {
  m.def("categorical(Tensor values, Tensor uniforms) -> Tensor");
  m.def("row_logsumexp(Tensor x) -> Tensor");
  m.def("logprobs(Tensor x, Tensor token_ids, int k) -> (Tensor, Tensor, Tensor, Tensor, bool)");
  m.def("top_p_threshold(Tensor x, Tensor top_p) -> (Tensor, bool)");
  m.def("seeded_race(Tensor values, Tensor? token_ids, Tensor keys) -> Tensor");
  m.def("top_candidates(Tensor x, int c) -> (Tensor, Tensor, bool)");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu_sampler, CPU, m) {
  m.impl("categorical", &categorical);
  m.impl("row_logsumexp", &row_logsumexp);
  m.impl("logprobs", &logprobs);
  m.impl("top_p_threshold", &top_p_threshold);
  m.impl("seeded_race", &seeded_race);
  m.impl("top_candidates", &top_candidates);
}
