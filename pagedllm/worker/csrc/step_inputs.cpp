// A step's input tensors in one call (torch.ops.pagedllm_cpu_step.step_inputs), for ModelRunner.prepare.
//
// Preparing a decode step takes some twenty numpy and torch calls on small arrays. They run right after
// the forward pass has streamed the weights and the KV cache through the caches, where each call's first
// touch of its code and data costs several times its warm price: the calls, not the arithmetic, cost.
// Here the same arithmetic is one call over the requests' Python lists. The numpy path in
// model_runner.py stays for machines without the C++ ops; a test holds both to the same tensors.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using StepInputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t>;

// For each request b: tokens [query_start_loc[b], query_start_loc[b + 1]) sit at positions
// start_pos[b] + start_offset .. + query_lens[b] - 1 (query_lens null: one token each), and its block
// table is row rows[b] of `table`. Returns (input_ids [T], positions [T], slot_mapping [T],
// query_start_loc [B + 1], seq_lens [B], block_tables [B, max blocks]), all int64, then the longest query
// and sequence (two Python max() passes over the lists otherwise). Table entries past a request's own
// blocks are zeroed when zero_pad (the dense-mask backend reads them), else copied as they are (stale
// ids no kernel reads).
StepInputs build(int64_t num_reqs, const int64_t* token_ids, int64_t num_token_ids, const int64_t* start_pos,
                 int64_t start_offset, const int64_t* query_lens, const int64_t* rows, const at::Tensor& table,
                 int64_t block_size, bool zero_pad) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous(),
              "step_inputs: table must be a contiguous 2-D int64 tensor");
  TORCH_CHECK(block_size > 0, "step_inputs: block_size must be positive");
  const int64_t table_rows = table.size(0), table_cols = table.size(1);
  int64_t num_tokens = 0, max_query_len = 0, max_seq_len = 0;
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t query_len = query_lens ? query_lens[b] : 1, start = start_pos[b] + start_offset;
    TORCH_CHECK(query_len > 0 && start >= 0, "step_inputs: a request computes no token");
    TORCH_CHECK(rows[b] >= 0 && rows[b] < table_rows, "step_inputs: row out of range");
    num_tokens += query_len;
    max_query_len = std::max(max_query_len, query_len);
    max_seq_len = std::max(max_seq_len, start + query_len);
  }
  TORCH_CHECK(num_token_ids == num_tokens, "step_inputs: one token id per token");
  const int64_t max_blocks = (max_seq_len + block_size - 1) / block_size;
  TORCH_CHECK(max_blocks <= table_cols, "step_inputs: a sequence has more blocks than the table holds");
  const auto options = table.options();
  at::Tensor input_ids = at::empty({num_tokens}, options);
  at::Tensor positions = at::empty({num_tokens}, options);
  at::Tensor slots = at::empty({num_tokens}, options);
  at::Tensor query_start_loc = at::empty({num_reqs + 1}, options);
  at::Tensor seq_lens = at::empty({num_reqs}, options);
  at::Tensor tables = at::empty({num_reqs, max_blocks}, options);
  std::memcpy(input_ids.data_ptr<int64_t>(), token_ids, num_tokens * sizeof(int64_t));
  const int64_t* src = table.data_ptr<int64_t>();
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* slot = slots.data_ptr<int64_t>();
  int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t* dst = tables.data_ptr<int64_t>();
  int64_t t = 0;
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t start = start_pos[b] + start_offset;
    const int64_t seq_len = start + (query_lens ? query_lens[b] : 1);
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
    const int64_t* row = src + rows[b] * table_cols;
    int64_t* out = dst + b * max_blocks;
    std::memcpy(out, row, (zero_pad ? num_blocks : max_blocks) * sizeof(int64_t));
    if (zero_pad) std::fill(out + num_blocks, out + max_blocks, int64_t{0});
    qsl[b] = t;
    lens[b] = seq_len;
    for (int64_t p = start; p < seq_len; ++p, ++t) {
      pos[t] = p;
      slot[t] = out[p / block_size] * block_size + p % block_size;
    }
  }
  qsl[num_reqs] = t;
  return {input_ids, positions, slots, query_start_loc, seq_lens, tables, max_query_len, max_seq_len};
}

// From the requests' Python lists (ModelRunner.prepare's general path).
StepInputs step_inputs(at::IntArrayRef token_ids, at::IntArrayRef start_pos, at::IntArrayRef query_lens,
                       at::IntArrayRef rows, const at::Tensor& table, int64_t block_size, bool zero_pad) {
  const int64_t num_reqs = static_cast<int64_t>(start_pos.size());
  TORCH_CHECK(static_cast<int64_t>(query_lens.size()) == num_reqs && static_cast<int64_t>(rows.size()) == num_reqs,
              "step_inputs: start_pos, query_lens and rows must have one entry per request");
  return build(num_reqs, token_ids.data(), static_cast<int64_t>(token_ids.size()), start_pos.data(), 0,
               query_lens.data(), rows.data(), table, block_size, zero_pad);
}

// An InputBatch's token rows as the ops below take them: token_table [rows, max_model_len], num_tokens [rows]
// and the plan's rows [requests], contiguous int64 CPU tensors.
void check_token_rows(const char* op, const at::Tensor& token_table, const at::Tensor& num_tokens,
                      const at::Tensor& rows) {
  TORCH_CHECK(token_table.dim() == 2 && num_tokens.dim() == 1 && rows.dim() == 1, op,
              ": token_table must be 2-D, num_tokens and rows 1-D");
  for (const at::Tensor* t : {&token_table, &num_tokens, &rows}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(), op,
                ": token_table, num_tokens and rows must be contiguous int64 CPU tensors");
  }
  TORCH_CHECK(num_tokens.size(0) == token_table.size(0), op, ": one token count per row");
}

// Row rows[b] of an InputBatch gains one token, token_ids[b]: a decode step's sampled tokens (int64 [requests]),
// written after the row's num_tokens[rows[b]] known ones.
void append_rows(const char* op, const at::Tensor& token_table, const at::Tensor& num_tokens, const at::Tensor& rows,
                 const at::Tensor& token_ids) {
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.scalar_type() == at::kLong && token_ids.is_contiguous() &&
                  token_ids.device().is_cpu() && token_ids.size(0) == rows.size(0),
              op, ": token_ids must be a contiguous int64 CPU tensor with one token per row");
  const int64_t num_reqs = rows.size(0), num_rows = token_table.size(0), row_len = token_table.size(1);
  const int64_t* row_index = rows.data_ptr<int64_t>();
  const int64_t* new_tokens = token_ids.data_ptr<int64_t>();
  int64_t* counts = num_tokens.data_ptr<int64_t>();
  int64_t* tokens = token_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t row = row_index[b];
    TORCH_CHECK(row >= 0 && row < num_rows && counts[row] < row_len, op, ": row out of range or full");
    tokens[row * row_len + counts[row]++] = new_tokens[b];
  }
}

// A decode step (ModelRunner._prepare_plan): request b computes the last known token of row rows[b] of the
// runner's InputBatch, token_table[rows[b], num_tokens[rows[b]] - 1], at that position, with block-table
// row rows[b]. Its arguments are the batch's arrays themselves: reading the same numbers from Python lists
// (torch parses an int[] argument element by element) was most of step_inputs' time. `new_tokens`, where
// given, are the tokens the last step sampled for these rows, appended first: the step then computes them
// (one call instead of two, each of which costs its cold-cache price after the forward pass).
StepInputs decode_step_inputs(const at::Tensor& token_table, const at::Tensor& num_tokens, const at::Tensor& rows,
                              const at::Tensor& table, int64_t block_size, bool zero_pad,
                              const std::optional<at::Tensor>& new_tokens) {
  check_token_rows("decode_step_inputs", token_table, num_tokens, rows);
  if (new_tokens.has_value()) append_rows("decode_step_inputs", token_table, num_tokens, rows, *new_tokens);
  const int64_t num_reqs = rows.size(0), num_rows = token_table.size(0), row_len = token_table.size(1);
  const int64_t* row_index = rows.data_ptr<int64_t>();
  const int64_t* counts = num_tokens.data_ptr<int64_t>();
  const int64_t* tokens = token_table.data_ptr<int64_t>();
  std::vector<int64_t> token_ids(num_reqs), start_pos(num_reqs);
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t row = row_index[b];
    TORCH_CHECK(row >= 0 && row < num_rows, "decode_step_inputs: row out of range");
    const int64_t last = counts[row] - 1;
    TORCH_CHECK(last >= 0 && last < row_len, "decode_step_inputs: a row holds no token");
    token_ids[b] = tokens[row * row_len + last];
    start_pos[b] = last;
  }
  return build(num_reqs, token_ids.data(), num_reqs, start_pos.data(), 0, nullptr, row_index, table, block_size,
               zero_pad);
}

// InputBatch.flush_sampled: the held tokens of a decode step (see append_rows), when something reads the rows
// before the next decode step's gather appends them.
void append_tokens(const at::Tensor& token_table, const at::Tensor& num_tokens, const at::Tensor& rows,
                   const at::Tensor& token_ids) {
  check_token_rows("append_tokens", token_table, num_tokens, rows);
  append_rows("append_tokens", token_table, num_tokens, rows, token_ids);
}
}  // namespace

TORCH_LIBRARY(pagedllm_cpu_step, m) {
  m.def("step_inputs(int[] token_ids, int[] start_pos, int[] query_lens, int[] rows, Tensor table, "
        "int block_size, bool zero_pad) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, int)");
  m.def("decode_step_inputs(Tensor(a!) token_table, Tensor(b!) num_tokens, Tensor rows, Tensor table, int block_size, "
        "bool zero_pad, Tensor? new_tokens) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, int)");
  m.def("append_tokens(Tensor(a!) token_table, Tensor(b!) num_tokens, Tensor rows, Tensor token_ids) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu_step, CPU, m) {
  m.impl("step_inputs", &step_inputs);
  m.impl("decode_step_inputs", &decode_step_inputs);
  m.impl("append_tokens", &append_tokens);
}
