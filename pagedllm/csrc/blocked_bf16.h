// The blocked bf16 linear's inner path (layers/csrc/cpu_linear.cpp), for other kernels that form bf16
// weights in its layout themselves: the quantized linear's prompt rows (cpu_quant_linear.cpp) dequantize a
// block of output features into it and multiply the rows as a bf16 linear does.
//
// A block is `width` (at most kBlockOutputs) output features of K' = K (even) inputs, packed k-major as
// [K / 2][width][2] bf16: pairs of k, one pair of every output after the other.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDLLM_BLOCKED_BF16 1
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace pagedllm_blocked {

constexpr int64_t kBlockOutputs = 64;  // output features per block
constexpr int64_t kMaxRows = 256;      // rows per bf16_block_rows call

// Before a thread's first bf16_block_rows of a call of m rows: the tile configuration where `amx`.
void prepare_bf16_rows(bool amx, int64_t m);

// y[r][0..width) = x[r] . block + bias (null: none) for `rows` (<= kMaxRows) rows, rounded once to bf16: by
// the AMX tiles where `amx`, else by VDPBF16PS, each row summed as blocked_linear sums it on that path.
void bf16_block_rows(bool amx, int64_t rows, const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* block,
                     int64_t width, int64_t k, const c10::BFloat16* bias, c10::BFloat16* y, int64_t y_stride);

}  // namespace pagedllm_blocked
#endif
