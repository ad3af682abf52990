"""A step's flat input tensors from the scheduled requests' Python lists (ModelRunner.prepare's core).

For request b, tokens [query_start_loc[b], query_start_loc[b + 1]) of the flat batch sit at positions
start_pos[b] .. start_pos[b] + query_lens[b] - 1; its block table is row rows[b] of the runner's
BlockTables. From these: every token's id, position and KV slot, the varlen description (query_start_loc,
seq_lens) and the step's block tables ([num_reqs, max blocks]; entries past a request's own blocks are
zeroed with zero_pad, which the dense-mask reference backend needs, and otherwise left as the stale but
valid ids no kernel reads).

Built in one C++ call where the CPU ops are available (worker/csrc/step_inputs.cpp): this runs right
after the forward pass has swept the caches, where each of the twenty-odd small numpy and torch calls of
the array path below cost several times its warm price. The array path is the same arithmetic for
machines without the C++ ops; tests hold the two to the same tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pagedllm.cpu_kernels import load_cpu_kernels


class StepInputs(NamedTuple):
    """int64 CPU tensors."""

    input_ids: torch.Tensor        # [num_tokens]
    positions: torch.Tensor        # [num_tokens]
    slot_mapping: torch.Tensor     # [num_tokens]
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor         # [num_reqs]
    block_tables: torch.Tensor     # [num_reqs, max blocks]
    max_query_len: int
    max_seq_len: int


def step_inputs(token_ids: list[int], start_pos: list[int], query_lens: list[int], rows: list[int],
                table: torch.Tensor, block_size: int, zero_pad: bool) -> StepInputs:
    """`table`: the runner's block tables, an int64 CPU tensor (BlockTables.tensor, which shares the
    numpy array's memory, so no step wraps the array anew)."""
    if load_cpu_kernels():
        return StepInputs(*torch.ops.pagedllm_cpu_step.step_inputs(
            token_ids, start_pos, query_lens, rows, table, block_size, zero_pad))
    return step_inputs_numpy(token_ids, start_pos, query_lens, rows, table.numpy(), block_size, zero_pad)


def decode_step_inputs(token_table: torch.Tensor, num_tokens: torch.Tensor, rows: torch.Tensor,
                       table: torch.Tensor, block_size: int, zero_pad: bool,
                       new_tokens: torch.Tensor | None = None) -> StepInputs:
    """A decode step: request b computes the last known token of row rows[b] of the runner's InputBatch
    (token_table [rows, max_model_len] and num_tokens [rows], int64 CPU tensors sharing its arrays' memory)
    at its position, with block-table row rows[b]. The same as step_inputs with one token per request,
    without reading Python lists: torch parses an int[] argument element by element, which was most of
    step_inputs' time on a 64-request decode. `new_tokens` (int64 [requests]), where given, are appended to
    the rows first (append_tokens), in the same call."""
    if load_cpu_kernels():
        return StepInputs(*torch.ops.pagedllm_cpu_step.decode_step_inputs(
            token_table, num_tokens, rows, table, block_size, zero_pad, new_tokens))
    if new_tokens is not None:
        append_tokens(token_table, num_tokens, rows, new_tokens)
    row_index = rows.numpy()
    start_pos = num_tokens.numpy()[row_index] - 1
    token_ids = token_table.numpy()[row_index, start_pos]
    return step_inputs_numpy(token_ids.tolist(), start_pos.tolist(), [1] * len(row_index), row_index.tolist(),
                             table.numpy(), block_size, zero_pad)


def append_tokens(token_table: torch.Tensor, num_tokens: torch.Tensor, rows: torch.Tensor,
                  token_ids: torch.Tensor) -> None:
    """Row rows[b] of an InputBatch (token_table, num_tokens: tensors sharing its arrays' memory) gains one
    token, token_ids[b] (int64 [requests]): a decode step's sampled tokens, in one call."""
    if load_cpu_kernels():
        torch.ops.pagedllm_cpu_step.append_tokens(token_table, num_tokens, rows, token_ids)
        return
    row_index, counts = rows.numpy(), num_tokens.numpy()
    ends = counts[row_index]
    if (ends >= token_table.shape[1]).any():
        raise RuntimeError("append_tokens: row out of range or full")
    token_table.numpy()[row_index, ends] = token_ids.numpy()
    counts[row_index] = ends + 1


def step_inputs_numpy(token_ids: list[int], start_pos: list[int], query_lens: list[int], rows: list[int],
                      table: np.ndarray, block_size: int, zero_pad: bool) -> StepInputs:
    """The same as the C++ op, in whole-array numpy calls."""
    bs = block_size
    num_reqs, num_tokens = len(start_pos), len(token_ids)
    start_pos_np, query_lens_np = np.array((start_pos, query_lens), dtype=np.int64)
    seq_lens = start_pos_np + query_lens_np
    num_blocks = (seq_lens + (bs - 1)) // bs
    max_seq_len = int(seq_lens.max(initial=0))
    tables = table[np.array(rows, dtype=np.int64), :(max_seq_len + bs - 1) // bs]
    if zero_pad:
        tables[np.arange(tables.shape[1]) >= num_blocks[:, None]] = 0
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens_np, out=query_start_loc[1:])
    if num_tokens == num_reqs:  # one token per request (plain decode): no per-token expansion
        positions = start_pos_np
        seq_index = np.arange(num_tokens)
    else:
        seq_index = np.repeat(np.arange(num_reqs), query_lens_np)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(start_pos_np - query_start_loc[:-1],
                                                                      query_lens_np)
    block_index, offset = np.divmod(positions, bs)
    slots = tables[seq_index, block_index] * bs + offset
    return StepInputs(torch.from_numpy(np.array(token_ids, dtype=np.int64)), torch.from_numpy(positions),
                      torch.from_numpy(slots), torch.from_numpy(query_start_loc), torch.from_numpy(seq_lens),
                      torch.from_numpy(tables), int(query_lens_np.max(initial=0)), max_seq_len)
