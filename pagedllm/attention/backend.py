"""The attention backend interface: write new K/V into the paged cache by `slot_mapping`, read the
context back through `block_tables`. Models see only `AttentionMetadata` and the backend.

A step's tokens are laid out flat, decode-like requests first (short queries, batched in one call),
then prefill chunks (each attends to its own cached prefix through its block table). The metadata is
built once per step by the model runner and shared by every layer (once per KV cache group where the
model's full and sliding layers keep separate block tables: `for_layer` picks the layer's).

Every backend gets the varlen description (vLLM's names): sequence i owns query rows
[query_start_loc[i], query_start_loc[i+1]), has seq_lens[i] tokens of context after this step, and
its query rows sit at the last positions of that context (bottom-right causal). The reference
backend additionally reads the padded decode batch and the per-prefill masks below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.kv_cache import quant


@dataclass
class PrefillSeq:
    query_start: int   # first row of this request's tokens in the flat batch
    query_len: int     # tokens computed this step
    seq_len: int       # context length after this step (cached prefix + query_len)
    block_table: torch.Tensor  # [num_blocks] physical blocks holding the whole context
    # [query_len, seq_len] bool, True where visible (bottom-right causal); None without a cached prefix
    attn_mask: torch.Tensor | None = None


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
    # The varlen description of the whole step, in the flat order above (int64).
    query_start_loc: torch.Tensor | None = None   # [num_seqs + 1]
    seq_lens: torch.Tensor | None = None          # [num_seqs]
    # [num_seqs, max_blocks]; entries past a sequence's own blocks are stale ids (zero where needs_dense_masks)
    block_tables: torch.Tensor | None = None
    max_query_len: int = 0
    max_seq_len: int = 0
    # What a backend derives from the above once per step (`AttentionBackend.prepare_metadata`).
    backend_data: dict[str, Any] = field(default_factory=dict)
    # Several KV cache groups (kv_cache/manager.py): per layer, the metadata of its group, whose block
    # tables and slot mapping are the group's own; None: this metadata serves every layer.
    layer_metadata: list[AttentionMetadata] | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata decoder layer `layer` attends with."""
        return self if self.layer_metadata is None else self.layer_metadata[layer]


class AttentionBackend:
    """One instance per model; `forward` is called by every attention layer with that layer's cache."""

    name = "ABSTRACT"
    # Whether the runner must build the padded decode batch and dense masks (only the reference reads them).
    needs_dense_masks = False
    # The cache's storage dtype (one-byte kinds: their code dtype, see kv_cache/quant.py); set by
    # `configure_kv_cache`. None: the same as the compute dtype.
    kv_cache_dtype: torch.dtype | None = None
    quantized = False
    calculate_kv_scales = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compute_dtype = compute_dtype

    def configure_kv_cache(self, kv_cache_dtype: torch.dtype, calculate_kv_scales: bool = False) -> None:
        """Called once by `get_attn_backend`: one-byte caches are quantized with a scale per row; per-layer
        static scales come from the checkpoint (`static_scales`, filled by the runner) or, with
        calculate_kv_scales, from each layer's first batch."""
        self.kv_cache_dtype = kv_cache_dtype
        self.quantized = quant.is_quantized(kv_cache_dtype)
        self.calculate_kv_scales = calculate_kv_scales and self.quantized
        # layer cache (its data_ptr, stable for the engine's life) -> [2] fp32 K and V scales
        self.static_scales: dict[int, torch.Tensor] = {}

    def prepare_metadata(self, metadata: AttentionMetadata) -> None:
        """Called once per step by the runner after it fills `metadata`: derive what every layer reuses."""

    def layer_static_scales(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                            ) -> torch.Tensor | None:
        """This layer's static K/V scales, computed from this batch if it is the first and they are asked
        for; None means a scale per row."""
        scales = self.static_scales.get(kv_cache.data_ptr())
        if scales is None and self.calculate_kv_scales:
            scales = quant.static_scales_from_batch(key, value, self.kv_cache_dtype)
            self.static_scales[kv_cache.data_ptr()] = scales
        return scales

    # kv_cache for one layer: [2, num_kv_heads, num_blocks, block_size, head_dim]. Head-major, so one
    # block of one head is a contiguous [block_size, head_dim] tile. One-byte caches: uint8 [2,
    # num_kv_heads, num_blocks, block_size * (head_dim + 2)], codes then bf16 scales per tile (quant.py).
    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """K and V of this step's tokens into their slots as one indexed copy."""
        new = torch.stack((key, value)).transpose(1, 2)  # [2, Hkv, T, D]
        if self.quantized:
            quant.write_rows(kv_cache, self.kv_cache_dtype, new, slot_mapping,
                             self.layer_static_scales(kv_cache, key, value))
            return
        num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
        flat = kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)
        new = new.to(kv_cache.dtype)
        if kv_cache.dtype.itemsize == 1:  # raw fp8 (no scales): index_copy_ has no fp8 kernel on CPU
            flat.view(torch.uint8).index_copy_(2, slot_mapping, new.view(torch.uint8))
        else:
            flat.index_copy_(2, slot_mapping, new)

    def read_kv(self, kv_cache: torch.Tensor, part: int, block_ids: torch.Tensor, head_dim: int,
                out_dtype: torch.dtype) -> torch.Tensor:
        """K (part 0) or V (1) of the given blocks as [num_kv_heads, len(block_ids), block_size, head_dim]
        in out_dtype: exactly what every reader of the cache sees."""
        if self.quantized:
            return quant.read_blocks(kv_cache, self.kv_cache_dtype, head_dim, part, block_ids, out_dtype)
        return kv_cache[part].index_select(1, block_ids).to(out_dtype)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        """One layer's attention. sliding_window: a query at position p sees keys p - sliding_window + 1
        .. p only (None: all of 0 .. p). logits_soft_cap: scores s (scale included) become
        cap * tanh(s / cap) before the softmax (None: unchanged). Both are per layer (Gemma 2/3 mix
        sliding and full layers), so they are arguments rather than backend state."""
        raise NotImplementedError


def window_start(position: int, sliding_window: int | None) -> int:
    """The first key position that a query at `position` sees."""
    return 0 if sliding_window is None else max(0, position - sliding_window + 1)
