"""Paged FlashAttention in plain torch: the readable specification of the C++ and Triton kernels, and
the CPU path when no compiler is present.

For each sequence, K/V are read a tile of blocks at a time through its block table, and every query
row keeps the FlashAttention-2 state: running max m, denominator l, unnormalised accumulator acc.
A new tile with scores s rescales the old state by exp(m - m_new):

    m_new = max(m, max_j s_j);   l = l * exp(m - m_new) + sum_j exp(s_j - m_new)
    acc   = acc * exp(m - m_new) + sum_j exp(s_j - m_new) v_j;          out = acc / l

so the query_len x seq_len score matrix never exists; peak memory is one query_len x tile block of
scores per head. The query heads of a KV head group share each K/V tile (GQA/MQA).

A sliding window starts the walk at the block that holds the first query's first visible key: blocks
before it are never read (a freed block's table entry may hold anything), not read and masked.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata, window_start
from pagedllm.kv_cache import quant

# Context tokens per tile (rounded to whole blocks): large enough that per-tile torch overhead is small.
TILE_TOKENS = 512


def paged_flash_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                          out: torch.Tensor | None = None, tile_tokens: int = TILE_TOKENS,
                          kv_cache_dtype: torch.dtype | None = None, sliding_window: int | None = None,
                          logits_soft_cap: float | None = None) -> torch.Tensor:
    """query [T, Hq, D]; kv_cache [2, Hkv, num_blocks, block_size, D] (or a one-byte cache of
    kv_cache_dtype, see kv_cache/quant.py, dequantized a tile at a time); returns [T, Hq, D]."""
    num_heads, head_dim = query.shape[1:]
    quantized = kv_cache_dtype is not None and quant.is_quantized(kv_cache_dtype)
    if quantized:
        num_kv_heads = kv_cache.shape[1]
        block_size = kv_cache.shape[3] // (head_dim + quant.SCALE_BYTES)
    else:
        num_kv_heads, _, block_size, _ = kv_cache.shape[1:]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    blocks_per_tile = max(1, tile_tokens // block_size)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_begin, q_end = starts[i], starts[i + 1]
        query_len = q_end - q_begin
        if query_len == 0:
            continue
        # [Hkv, G, Q, D]: query heads grouped under their KV head, pre-scaled, fp32.
        q = (query[q_begin:q_end].float() * scale).transpose(0, 1).reshape(num_kv_heads, group, query_len, head_dim)
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
        row_max = torch.full((num_kv_heads, group, query_len, 1), float("-inf"), device=query.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros((num_kv_heads, group, query_len, head_dim), device=query.device)
        num_blocks = -(-seq_len // block_size)
        first_block = window_start(seq_len - query_len, sliding_window) // block_size
        for first in range(first_block, num_blocks, blocks_per_tile):
            k_start = first * block_size
            blocks = block_tables[i, first:min(first + blocks_per_tile, num_blocks)]
            tile_len = min(len(blocks) * block_size, seq_len - k_start)
            if quantized:
                k = quant.read_blocks(kv_cache, kv_cache_dtype, head_dim, 0, blocks, torch.float32)
                v = quant.read_blocks(kv_cache, kv_cache_dtype, head_dim, 1, blocks, torch.float32)
            else:
                k, v = kv_cache[0].index_select(1, blocks), kv_cache[1].index_select(1, blocks)
            k = k.flatten(1, 2)[:, :tile_len].float()  # [Hkv, N, D]
            v = v.flatten(1, 2)[:, :tile_len].float()
            scores = q @ k.unsqueeze(1).transpose(-1, -2)  # [Hkv, G, Q, N]
            if logits_soft_cap is not None:
                scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
            k_pos = torch.arange(k_start, k_start + tile_len, device=query.device)
            visible = k_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
            scores.masked_fill_(~visible, float("-inf"))
            new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
            # Rows that see nothing yet keep max -inf; shift by 0 there so exp gives 0, not NaN.
            safe_max = torch.where(new_max == float("-inf"), 0.0, new_max)
            alpha = torch.exp(row_max - safe_max)
            p = scores.sub_(safe_max).exp_()  # in place: one score tile alive at a time
            row_sum = row_sum * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + p @ v.unsqueeze(1)
            row_max = new_max
        result = (acc / row_sum).reshape(num_heads, query_len, head_dim).transpose(0, 1)
        out[q_begin:q_end] = result.to(out.dtype)
    return out


class TorchFlashAttention(AttentionBackend):
    """The tiled recurrence in torch ops: no compiler needed, never materialises N x N scores."""

    name = "TORCH_FLASH"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        return paged_flash_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                     metadata.query_start_loc, scale, kv_cache_dtype=self.kv_cache_dtype,
                                     sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
