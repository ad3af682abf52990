"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, in plain torch.

Each token's cache entry in a layer is one vector [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]: the
compressed latent after kv_a_layernorm and the shared rope key after RoPE, stored as a single-"head"
cache [1, 1, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]. Every read goes through the
cache (written first), so a prefix-cache hit, a chunk boundary or a preemption sees the same bytes.

- Prefill chunks expand K/V for their whole context through kv_b_proj (W_UK, W_UV) and run MHA.
- Decode uses the absorbed form: q_nope is folded through W_UK into the latent space, attention runs
  over the latent plus the rope key as one shared KV head (MQA with head size kv_lora_rank +
  qk_rope_head_dim, values = the latent), and W_UV maps the attended latent to each head's value.
  It reads only the latent: kv_lora_rank + qk_rope_head_dim elements per token, not 2 x heads x dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.torch_paged import TorchPagedAttention
from pagedllm.kv_cache import quant


class TorchMLAAttention(TorchPagedAttention):
    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, compute_dtype: torch.dtype):
        # The latent cache is one KV "head" of kv_lora_rank + qk_rope_head_dim: reuse the paged gather.
        super().__init__(num_heads, 1, kv_lora_rank + qk_rope_head_dim, compute_dtype)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        # Decode in the absorbed form; False expands K/V like prefill (kept for tests and the benchmark).
        self.absorbed_decode = True

    def write_latent(self, kv_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.quantized:
            # One scale per token over its whole latent row (the "head" of this cache), per row as
            # for K/V (static per-layer scales: one for the latent, stored in K's slot).
            static = self.layer_static_scales(kv_cache, latent, latent)
            quant.write_rows(kv_cache, self.kv_cache_dtype, latent.unsqueeze(0).unsqueeze(0), slot_mapping,
                             None if static is None else static[:1])
            return
        cache = kv_cache[0]
        flat = cache.view(1, cache.shape[1] * cache.shape[2], self.head_dim)
        flat.index_copy_(1, slot_mapping, latent.unsqueeze(0).to(kv_cache.dtype))

    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, kv_b_weight: torch.Tensor, v_head_dim: int
                    ) -> torch.Tensor:
        """q_nope [T, H, Dn], q_pe [T, H, Dr] (rotated), latent [T, R + Dr] (normed c_kv | rotated k_pe),
        kv_b_weight [H * (Dn + Dv), R]. Returns [T, H, Dv]."""
        self.write_latent(kv_cache, latent, metadata.slot_mapping)
        num_tokens, num_heads, nope_dim = q_nope.shape
        output = q_nope.new_empty(num_tokens, num_heads, v_head_dim)
        if metadata.num_decodes:
            n = metadata.num_decode_tokens
            if self.absorbed_decode:
                output[:n] = self._decode_absorbed(q_nope[:n], q_pe[:n], kv_cache, metadata, scale, kv_b_weight,
                                                   v_head_dim)
            else:
                output[:n] = self._decode_expanded(q_nope[:n], q_pe[:n], kv_cache, metadata, scale, kv_b_weight,
                                                   v_head_dim)
        for seq in metadata.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            context = self._gather(kv_cache, 0, seq.block_table.unsqueeze(0), "prefill_latent")[0, 0, :seq.seq_len]
            k, v = self._expand(context, kv_b_weight, nope_dim, v_head_dim)       # [H, S, Dn + Dr], [H, S, Dv]
            q = torch.cat([q_nope[rows], q_pe[rows]], dim=-1).transpose(0, 1)    # [H, Q, Dn + Dr]
            if seq.seq_len == seq.query_len:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            else:
                # Bottom-right causal: query i sits at position seq_len - query_len + i.
                q_pos = torch.arange(seq.query_len, device=q.device) + (seq.seq_len - seq.query_len)
                mask = torch.arange(seq.seq_len, device=q.device)[None, :] <= q_pos[:, None]
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            output[rows] = out.transpose(0, 1)
        return output

    def _expand(self, context: torch.Tensor, kv_b_weight: torch.Tensor, nope_dim: int, v_head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., S, R + Dr] cached entries -> K [..., H, S, Dn + Dr] and V [..., H, S, Dv] through kv_b_proj."""
        latent, k_pe = context.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = F.linear(latent, kv_b_weight).unflatten(-1, (self.num_heads, nope_dim + v_head_dim)).transpose(-3, -2)
        k_nope, v = kv.split([nope_dim, v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(-3).expand(*k_nope.shape[:-1], self.qk_rope_head_dim)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def _decode_queries(self, q: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """[N, H, D] decode rows -> [B, H, max_q, D], padded as the decode mask expects."""
        if metadata.decode_query_index is None:
            return q.unsqueeze(2)
        q = q.index_select(0, metadata.decode_query_index.reshape(-1))
        return q.view(metadata.num_decodes, metadata.decode_max_query_len, *q.shape[1:]).transpose(1, 2)

    def _decode_rows(self, out: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """[B, H, max_q, D] -> [N, H, D] for the real (unpadded) decode rows."""
        num_seqs, num_heads, max_q, dim = out.shape
        out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, dim)
        return out if metadata.decode_query_index is None else out[metadata.decode_query_valid]

    def _decode_context(self, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        context = self._gather(kv_cache, 0, metadata.decode_block_tables, "decode_latent")  # [B, 1, ctx, R + Dr]
        if metadata.decode_attn_mask is None:  # one sequence: cut the context instead of masking it
            context = context[:, :, :metadata.decode_seq_len]
        return context

    def _decode_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         metadata: AttentionMetadata, scale: float, kv_b_weight: torch.Tensor, v_head_dim: int
                         ) -> torch.Tensor:
        num_heads, nope_dim = q_nope.shape[1], q_nope.shape[2]
        w_kv = kv_b_weight.view(num_heads, nope_dim + v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv[:, :nope_dim], w_kv[:, nope_dim:]                         # [H, Dn, R], [H, Dv, R]
        # q_nope . (W_UK c) = (W_UK^T q_nope) . c: fold W_UK into the query, once per query, not per key.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)           # [N, H, R]
        q = self._decode_queries(torch.cat([q_latent, q_pe], dim=-1), metadata)     # [B, H, Q, R + Dr]
        num_seqs, _, max_q, dim = q.shape
        # One KV head shared by all query heads: lay the heads out as extra query rows of a single head,
        # so attention is two plain matmuls over the latent (GQA broadcasting would copy it per head).
        q = q.transpose(1, 2).reshape(num_seqs, 1, max_q * num_heads, dim)           # rows (query, head)
        mask = metadata.decode_attn_mask
        if mask is not None and max_q > 1:
            mask = mask.repeat_interleave(num_heads, dim=2)
        context = self._decode_context(kv_cache, metadata)                           # [B, 1, ctx, R + Dr]
        out = F.scaled_dot_product_attention(q, context, context[..., :self.kv_lora_rank], attn_mask=mask,
                                             scale=scale)
        out = out.view(num_seqs, max_q, num_heads, self.kv_lora_rank).transpose(1, 2)
        out_latent = self._decode_rows(out, metadata)                                # [N, H, R]
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [N, H, Dv]

    def _decode_expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                         metadata: AttentionMetadata, scale: float, kv_b_weight: torch.Tensor, v_head_dim: int
                         ) -> torch.Tensor:
        q = self._decode_queries(torch.cat([q_nope, q_pe], dim=-1), metadata)        # [B, H, Q, Dn + Dr]
        context = self._decode_context(kv_cache, metadata)[:, 0]                     # [B, ctx, R + Dr]
        k, v = self._expand(context, kv_b_weight, q_nope.shape[2], v_head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=metadata.decode_attn_mask, scale=scale)
        return self._decode_rows(out, metadata)
