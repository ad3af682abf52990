"""The attention backend interface: write new K/V into the paged cache by `slot_mapping`, read the
context back through `block_tables`. Models see only `AttentionMetadata` and the backend.

A step's tokens are laid out flat, decode-like requests first (short queries, batched in one call),
then prefill chunks (each attends to its own cached prefix through its block table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    query_start: int   # first row of this request's tokens in the flat batch
    query_len: int     # tokens computed this step
    seq_len: int       # context length after this step (cached prefix + query_len)
    block_table: torch.Tensor  # [num_blocks] physical blocks holding the whole context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [num_tokens] where each new token's K/V is written
    num_decode_tokens: int = 0            # rows [0, num_decode_tokens) belong to the decode group
    num_decodes: int = 0
    decode_max_query_len: int = 1
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    # [num_decodes, 1, max_query_len, max_blocks * block_size] additive mask (0 visible, -inf hidden);
    # None for a lone decode token, which attends to its first `decode_seq_len` keys.
    decode_attn_mask: torch.Tensor | None = None
    decode_seq_len: int = 0
    # [num_decodes, max_query_len] row of each (padded) query in the flat batch; None if all lens are 1
    decode_query_index: torch.Tensor | None = None
    decode_query_valid: torch.Tensor | None = None   # [num_decodes * max_query_len] padded rows to keep
    prefills: list[PrefillSeq] = field(default_factory=list)


class AttentionBackend:
    """One instance per model; `forward` is called by every attention layer with that layer's cache."""

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError
