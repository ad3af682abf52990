"""Paged FlashAttention as Triton kernels (the CUDA backend): the same online-softmax recurrence as the
CPU kernel and `torch_flash.py`, reading K/V in place from the paged cache through the block tables.

- Decode (every sequence has one query): flash-decoding. Grid (sequence, KV head, split); each program
  walks the pages of one `SPLIT_TOKENS`-long stretch of the context for all query heads of its KV head
  group at once (padded to 16 rows for `tl.dot`), so each page is read once per group, and writes an
  unnormalised partial with its max and denominator. A second kernel merges the splits exactly.
- Varlen prefill (any query lengths: prefill chunks over a cached prefix, speculative verification,
  mixed steps): grid (query tile, query head); each program takes BLOCK_M query rows of one sequence
  and walks its pages up to the tile's last visible key, bottom-right causal.

A sliding window (WINDOW > 0) starts each program's walk at the page holding its first query's first
visible key, so pages wholly before the window are never read (a sliding layer's freed pages may sit in
the block table); soft-capping (SOFT_CAP > 0) applies cap * tanh(s / cap) to the scores before the mask.

The split length is fixed rather than derived from the batch, so a sequence's output does not depend
on what else is in the batch. Under TRITON_INTERPRET=1 (CPU tests) `tl.dot` on bf16 returns garbage,
so the kernels cast the operands to fp32 there; on a GPU they feed the tensor cores the cache's dtype.
One-byte (quantized) KV caches are not read by the kernels: the blocks a step reads are dequantized
once per layer into a compact cache in the compute dtype and the block tables are renumbered to it
(correct, not fast; CUDA picks TORCH_SDPA for one-byte caches by default).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata

SPLIT_TOKENS = 512   # context tokens per decode split
BLOCK_M = 16         # query rows per varlen program


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _load_kv_tile(kv_cache_ptr, block_tables_ptr, seq, start, kv_head, num_kv_heads, num_blocks, max_blocks,
                  key_ok, dims, dim_ok, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr):
    """K and V ([BLOCK_SIZE, BLOCK_D] each) of one KV head in the block that holds context position
    `start`, found through the sequence's block table; rows past key_ok read as 0, fp32 if DOT_FP32."""
    physical = tl.load(block_tables_ptr + seq * max_blocks + start // BLOCK_SIZE).to(tl.int64)
    tile = BLOCK_SIZE * HEAD_DIM
    in_tile = tl.arange(0, BLOCK_SIZE)[:, None] * HEAD_DIM + dims[None, :]
    ok = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(kv_cache_ptr + (kv_head * num_blocks + physical) * tile + in_tile, mask=ok, other=0.0)
    v = tl.load(kv_cache_ptr + ((num_kv_heads + kv_head) * num_blocks + physical) * tile + in_tile, mask=ok,
                other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _soft_cap(scores, SOFT_CAP: tl.constexpr):
    """cap * tanh(s / cap), tanh written with exp (1 - 2 / (e^2x + 1): saturates, never NaN)."""
    x = scores / SOFT_CAP
    return (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * SOFT_CAP


@triton.jit
def _online_softmax_step(scores, v, row_max, row_sum, acc):
    """FlashAttention's update for one tile of (masked) scores and its values: the running row maxima,
    sums of exponentials and value accumulator, rescaled to the new maxima."""
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    alpha = tl.exp(row_max - new_max)
    p = tl.exp(scores - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return new_max, row_sum, acc


@triton.jit
def _decode_split_kernel(
    query_ptr, kv_cache_ptr, block_tables_ptr, seq_lens_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr,
    scale, num_kv_heads, num_blocks, max_blocks, num_splits, window,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    head_ok = tl.arange(0, BLOCK_H) < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(query_ptr + (seq * NUM_HEADS + heads[:, None]) * HEAD_DIM + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    q = (q.to(tl.float32) * scale)
    if not DOT_FP32:
        q = q.to(kv_cache_ptr.dtype.element_ty)
    row_max = tl.full([BLOCK_H], -1e30, tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_begin = split * SPLIT
    k_end = tl.minimum(seq_len, k_begin + SPLIT)
    # The one query sits at seq_len - 1 and, with a window, sees seq_len - window .. seq_len - 1.
    k_first = tl.maximum(k_begin, tl.where(window > 0, seq_len - window, 0))
    offs_n = tl.arange(0, BLOCK_SIZE)
    for start in range(k_first // BLOCK_SIZE * BLOCK_SIZE, k_end, BLOCK_SIZE):
        key_ok = (start + offs_n < k_end) & (start + offs_n >= k_first)
        k, v = _load_kv_tile(kv_cache_ptr, block_tables_ptr, seq, start, kv_head, num_kv_heads, num_blocks,
                             max_blocks, key_ok, dims, dim_ok, HEAD_DIM, BLOCK_SIZE, DOT_FP32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        if SOFT_CAP > 0:
            scores = _soft_cap(scores, SOFT_CAP)
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        row_max, row_sum, acc = _online_softmax_step(scores, v, row_max, row_sum, acc)
    # partials: [num_seqs, NUM_HEADS, num_splits] (+ [HEAD_DIM] for the accumulator)
    slot = (seq * NUM_HEADS + heads) * num_splits + split
    tl.store(partial_acc_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc,
             mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(partial_max_ptr + slot, row_max, mask=head_ok)
    tl.store(partial_sum_ptr + slot, row_sum, mask=head_ok)


@triton.jit
def _decode_merge_kernel(
    out_ptr, seq_lens_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, SPLIT)  # splits past the context wrote nothing meaningful
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    base = (seq * NUM_HEADS + head) * num_splits
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < used
    maxes = tl.load(partial_max_ptr + base + splits, mask=split_ok, other=-1e30)
    sums = tl.load(partial_sum_ptr + base + splits, mask=split_ok, other=0.0)
    global_max = tl.max(maxes, 0)
    weights = tl.where(split_ok, tl.exp(maxes - global_max), 0.0)
    total = tl.sum(sums * weights, 0)
    accs = tl.load(partial_acc_ptr + (base + splits[:, None]) * HEAD_DIM + dims[None, :],
                   mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(accs * weights[:, None], 0) / total
    tl.store(out_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def _varlen_kernel(
    query_ptr, out_ptr, kv_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_seq_ptr,
    tile_start_ptr, scale, num_kv_heads, num_blocks, max_blocks, window,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    q_first = tl.load(tile_start_ptr + tile)  # first query row of the tile, within the sequence
    row0 = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - row0
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = q_first + tl.arange(0, BLOCK_M)
    row_ok = rows < query_len
    q_pos = seq_len - query_len + rows  # bottom-right causal
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(query_ptr + ((row0 + rows[:, None]) * NUM_HEADS + head) * HEAD_DIM + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32) * scale
    if not DOT_FP32:
        q = q.to(kv_cache_ptr.dtype.element_ty)
    row_max = tl.full([BLOCK_M], -1e30, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_stop = tl.minimum(seq_len, seq_len - query_len + q_first + BLOCK_M)  # past the tile's last query
    # With a window, the tile's first query sees keys from its position - window + 1 on.
    k_first = tl.maximum(0, tl.where(window > 0, seq_len - query_len + q_first - window + 1, 0))
    offs_n = tl.arange(0, BLOCK_SIZE)
    for start in range(k_first // BLOCK_SIZE * BLOCK_SIZE, k_stop, BLOCK_SIZE):
        k_pos = start + offs_n
        key_ok = (k_pos < seq_len) & (k_pos >= k_first)
        k, v = _load_kv_tile(kv_cache_ptr, block_tables_ptr, seq, start, kv_head, num_kv_heads, num_blocks,
                             max_blocks, key_ok, dims, dim_ok, HEAD_DIM, BLOCK_SIZE, DOT_FP32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        if SOFT_CAP > 0:
            scores = _soft_cap(scores, SOFT_CAP)
        visible = (k_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        visible = visible & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))
        scores = tl.where(visible, scores, float("-inf"))
        row_max, row_sum, acc = _online_softmax_step(scores, v, row_max, row_sum, acc)
    out = acc / tl.where(row_ok, row_sum, 1.0)[:, None]
    tl.store(out_ptr + ((row0 + rows[:, None]) * NUM_HEADS + head) * HEAD_DIM + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _dot_fp32(kv_cache: torch.Tensor) -> bool:
    # fp32 caches always multiply in fp32 (no TF32: parity with the reference); the interpreter needs
    # fp32 operands whatever the dtype.
    return kv_cache.dtype == torch.float32 or _interpreting()


def _check_block_size(block_size: int) -> None:
    # A page is one tl.arange tile and one tl.dot dimension (at least 16 on GPUs), and decode splits
    # start on page boundaries.
    if block_size < 16 or block_size & (block_size - 1) or SPLIT_TOKENS % block_size:
        raise ValueError(f"block_size must be a power of two from 16 to {SPLIT_TOKENS} for the TRITON attention "
                         f"backend, got {block_size}.")


def query_tiles(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_m: int = BLOCK_M
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first query row) of every BLOCK_M-row query tile of the step, as int32 tensors."""
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    tile_seq, tile_start = [], []
    for seq, query_len in enumerate(query_lens):
        for start in range(0, query_len, block_m):
            tile_seq.append(seq)
            tile_start.append(start)
    device = seq_lens.device
    return (torch.tensor(tile_seq, dtype=torch.int32, device=device),
            torch.tensor(tile_start, dtype=torch.int32, device=device))


def paged_attention_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           out: torch.Tensor | None = None, sliding_window: int | None = None,
                           logits_soft_cap: float | None = None) -> torch.Tensor:
    """One query per sequence: query [B, Hq, D] -> [B, Hq, D]."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, num_blocks, block_size = kv_cache.shape[1:4]
    group = num_heads // num_kv_heads
    _check_block_size(block_size)
    num_splits = triton.cdiv(max_seq_len, SPLIT_TOKENS)
    if out is None:
        out = torch.empty_like(query)
    partial_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    partial_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    partial_sum = torch.empty_like(partial_max)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_cache, block_tables, seq_lens, partial_acc, partial_max, partial_sum,
        scale, num_kv_heads, num_blocks, block_tables.shape[1], num_splits, sliding_window or 0,
        NUM_HEADS=num_heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, SPLIT=SPLIT_TOKENS, DOT_FP32=_dot_fp32(kv_cache),
        SOFT_CAP=float(logits_soft_cap or 0.0))
    _decode_merge_kernel[(num_seqs, num_heads)](
        out, seq_lens, partial_acc, partial_max, partial_sum, num_splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_splits), SPLIT=SPLIT_TOKENS)
    return out


def paged_attention_varlen(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                           tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
                           out: torch.Tensor | None = None, sliding_window: int | None = None,
                           logits_soft_cap: float | None = None) -> torch.Tensor:
    """Any query lengths (bottom-right causal): query [T, Hq, D] -> [T, Hq, D]."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, num_blocks, block_size = kv_cache.shape[1:4]
    _check_block_size(block_size)
    if tiles is None:
        tiles = query_tiles(seq_lens, query_start_loc)
    tile_seq, tile_start = tiles
    if out is None:
        out = torch.empty_like(query)
    if tile_seq.numel() == 0:
        return out
    _varlen_kernel[(tile_seq.numel(), num_heads)](
        query, out, kv_cache, block_tables, seq_lens, query_start_loc, tile_seq, tile_start,
        scale, num_kv_heads, num_blocks, block_tables.shape[1], sliding_window or 0,
        NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M,
        DOT_FP32=_dot_fp32(kv_cache), SOFT_CAP=float(logits_soft_cap or 0.0))
    return out


class TritonPagedAttention(AttentionBackend):
    name = "TRITON"

    def _dequantized_blocks(self, kv_cache: torch.Tensor, block_tables: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the blocks this step reads, dequantized: [2, Hkv, n, block_size, D] and tables into it."""
        used, renumbered = torch.unique(block_tables, return_inverse=True)
        compact = torch.stack([self.read_kv(kv_cache, part, used, self.head_dim, self.compute_dtype)
                               for part in (0, 1)])
        return compact, renumbered.view_as(block_tables)

    def prepare_metadata(self, metadata: AttentionMetadata) -> None:
        if metadata.max_query_len > 1:
            metadata.backend_data["query_tiles"] = query_tiles(metadata.seq_lens, metadata.query_start_loc)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        query = query.contiguous()
        if self.quantized:
            kv_cache, block_tables = self._dequantized_blocks(kv_cache, metadata.block_tables)
            metadata = dataclasses.replace(metadata, block_tables=block_tables)
        if metadata.max_query_len == 1:
            return paged_attention_decode(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                          metadata.max_seq_len, scale, sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap)
        return paged_attention_varlen(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                      metadata.query_start_loc, scale, metadata.backend_data.get("query_tiles"),
                                      sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
