"""Paged attention in plain torch: SDPA over K/V gathered through block tables.

Decode-like requests (short queries) run as one batched SDPA call over their gathered context with an
explicit bottom-right causal mask; each prefill chunk runs its own SDPA call (a few per step, bounded
by the token budget). A layer with a sliding window or logit soft-capping takes `_windowed`: one
explicit softmax per sequence over only the blocks its window reaches (the dense masks above know
neither). Gathers go into buffers that grow but are never freed: on CPU a fresh large
tensor per layer per step is page-faulted in and zeroed by the kernel every time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata, window_start


class TorchPagedAttention(AttentionBackend):
    name = "TORCH_SDPA"
    needs_dense_masks = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype):
        super().__init__(num_heads, num_kv_heads, head_dim, compute_dtype)
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                ) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= dim
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)

    def _gather(self, kv_cache: torch.Tensor, part: int, block_tables: torch.Tensor, name: str) -> torch.Tensor:
        """[B, max_blocks] block ids -> K (part 0) or V (1) as [B, num_kv_heads, max_blocks * block_size,
        head_dim] in the compute dtype, as the cache holds them (one-byte caches dequantized)."""
        num_seqs, max_blocks = block_tables.shape
        if self.quantized:
            # Only the blocks read are dequantized, straight into the compute dtype.
            gathered = self.read_kv(kv_cache, part, block_tables.reshape(-1), self.head_dim, self.compute_dtype)
            return gathered.view(self.num_kv_heads, num_seqs, -1, self.head_dim).transpose(0, 1)
        cache = kv_cache[part]
        block_size = cache.shape[2]
        out = self._buffer(name, (self.num_kv_heads, num_seqs * max_blocks, block_size, self.head_dim),
                           cache.dtype, cache.device)
        torch.index_select(cache, 1, block_tables.reshape(-1), out=out)
        gathered = out.view(self.num_kv_heads, num_seqs, max_blocks * block_size, self.head_dim)
        if gathered.dtype != self.compute_dtype:
            gathered = gathered.to(self.compute_dtype)
        return gathered.transpose(0, 1)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        """query: [T, Hq, D], key/value: [T, Hkv, D] for this step's tokens. Returns [T, Hq, D]."""
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        if sliding_window is not None or logits_soft_cap is not None:
            return self._windowed(query, kv_cache, metadata, scale, sliding_window, logits_soft_cap)
        output = torch.empty_like(query)
        if metadata.num_decodes:
            self._decode(query, kv_cache, metadata, scale, output)
        for seq in metadata.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            q = query[rows].transpose(0, 1).unsqueeze(0)
            # Every read goes through the cache, also a chunk with no cached prefix: its K/V as stored
            # (rounded to the cache dtype, or quantized) are what any later read or prefix-cache hit
            # sees, so cold and cached runs of one prompt attend to the same values.
            block_table = seq.block_table.unsqueeze(0)
            k = self._gather(kv_cache, 0, block_table, "prefill_k")[:, :, :seq.seq_len]
            v = self._gather(kv_cache, 1, block_table, "prefill_v")[:, :, :seq.seq_len]
            if seq.seq_len == seq.query_len:
                # No cached prefix: top-left causal is bottom-right.
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                # Bottom-right causal mask, built once per step by the runner (is_causal=True would
                # align it top-left, wrong when keys outnumber queries).
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=seq.attn_mask, scale=scale,
                                                     enable_gqa=True)
            output[rows] = out.squeeze(0).transpose(0, 1)
        return output

    def _windowed(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                  sliding_window: int | None, logits_soft_cap: float | None) -> torch.Tensor:
        """Every sequence of the step (varlen description) as scores -> soft cap -> mask -> softmax, the
        order the reference models use, reading only the blocks from the first query's window on."""
        output = torch.empty_like(query)
        block_size = self._block_size(kv_cache) if self.quantized else kv_cache.shape[-2]
        starts = metadata.query_start_loc.tolist()
        for i, seq_len in enumerate(metadata.seq_lens.tolist()):
            q_begin, q_end = starts[i], starts[i + 1]
            query_len = q_end - q_begin
            if query_len == 0:
                continue
            first_block = window_start(seq_len - query_len, sliding_window) // block_size
            num_blocks = -(-seq_len // block_size)
            table = metadata.block_tables[i, first_block:num_blocks].unsqueeze(0)
            k_start = first_block * block_size
            k = self._gather(kv_cache, 0, table, "window_k")[0, :, :seq_len - k_start]  # [Hkv, N, D]
            v = self._gather(kv_cache, 1, table, "window_v")[0, :, :seq_len - k_start]
            group = self.num_heads // self.num_kv_heads
            q = query[q_begin:q_end].transpose(0, 1)  # [Hq, Q, D]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            scores = (q @ k.transpose(-1, -2)) * scale
            if logits_soft_cap is not None:
                scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
            q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(k_start, seq_len, device=query.device)[None, :]
            visible = k_pos <= q_pos
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
            output[q_begin:q_end] = (probs @ v).transpose(0, 1)
        return output

    def _block_size(self, kv_cache: torch.Tensor) -> int:
        # One-byte caches keep codes and scales of a block in one row (kv_cache/quant.py).
        from pagedllm.kv_cache import quant

        return kv_cache.shape[-1] // (self.head_dim + quant.SCALE_BYTES)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, output: torch.Tensor) -> None:
        num_decodes, max_q = metadata.num_decodes, metadata.decode_max_query_len
        k = self._gather(kv_cache, 0, metadata.decode_block_tables, "decode_k")
        v = self._gather(kv_cache, 1, metadata.decode_block_tables, "decode_v")
        if metadata.decode_attn_mask is None:  # one sequence: cut the context instead of masking it
            k, v = k[:, :, :metadata.decode_seq_len], v[:, :, :metadata.decode_seq_len]
        if metadata.decode_query_index is None:
            q = query[:num_decodes].unsqueeze(2)  # [B, Hq, 1, D]
        else:
            q = query.index_select(0, metadata.decode_query_index.reshape(-1))
            q = q.view(num_decodes, max_q, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=metadata.decode_attn_mask, scale=scale,
                                             enable_gqa=True)
        out = out.transpose(1, 2).reshape(num_decodes * max_q, self.num_heads, self.head_dim)
        if metadata.decode_query_index is None:
            output[:num_decodes] = out
        else:
            output[:metadata.num_decode_tokens] = out[metadata.decode_query_valid]
