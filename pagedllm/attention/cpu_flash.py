"""The CPU FlashAttention backend: the C++ kernel in csrc/paged_attention_cpu.cpp, compiled on first use
with the other CPU ops (pagedllm/cpu_kernels.py). With no compiler (or a failed build) the same algorithm
runs in plain torch (`torch_flash.paged_flash_attention`): correct, slower.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.torch_flash import paged_flash_attention
from pagedllm.cpu_kernels import load_cpu_kernels
from pagedllm.kv_cache import quant


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, kv_cache_dtype: torch.dtype | None = None,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Attention of every query row over its sequence's paged context (bottom-right causal; a sliding
    window skips whole blocks before it, see AttentionBackend.forward).

    query [T, Hq, D]; kv_cache [2, Hkv, num_blocks, block_size, D], or a one-byte cache of kv_cache_dtype
    (kv_cache/quant.py); block_tables [B, max_blocks] and seq_lens [B] and query_start_loc [B + 1], all
    int64. Returns [T, Hq, D] in the query's dtype.
    """
    if out is None:
        out = torch.empty_like(query)
    if load_cpu_kernels():
        # The op's "none" is 0 for both.
        window, soft_cap = sliding_window or 0, logits_soft_cap or 0.0
        if kv_cache_dtype is not None and quant.is_quantized(kv_cache_dtype):
            codes, scales = quant.split_cache(kv_cache, kv_cache_dtype, query.shape[-1])
            torch.ops.pagedllm_cpu.paged_attention(query.contiguous(), codes, block_tables, seq_lens,
                                                   query_start_loc, scale, out, scales, window, soft_cap)
        else:
            torch.ops.pagedllm_cpu.paged_attention(query.contiguous(), kv_cache, block_tables, seq_lens,
                                                   query_start_loc, scale, out, None, window, soft_cap)
    else:
        paged_flash_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, out=out,
                              kv_cache_dtype=kv_cache_dtype, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap)
    return out


def decode_path() -> str:
    """The decode path the compiled kernel has, fixed by the flags of the CPU that built it: "amx_bf16"
    (a bf16 cache of 16-token blocks on the AMX tiles, the rest as avx512_bf16), "avx512_bf16" (bf16 dot
    products with `_mm512_dpbf16_ps`, AVX-512 fp32 for fp32 caches), "avx512",
    "generic" (compiler-vectorised loops, AVX2 where the CPU has it) or "torch" (no compiled kernel)."""
    return torch.ops.pagedllm_cpu.paged_attention_isa() if load_cpu_kernels() else "torch"


class CpuFlashAttention(AttentionBackend):
    """Reads K/V in place from the paged cache: no gather, no padding to the longest sequence, no mask."""

    name = "CPU_FLASH"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype):
        super().__init__(num_heads, num_kv_heads, head_dim, compute_dtype)
        self.use_kernel = load_cpu_kernels()

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if self.use_kernel and self.quantized:
            codes, scales = quant.split_cache(kv_cache, self.kv_cache_dtype, self.head_dim)
            torch.ops.pagedllm_cpu.write_kv_quant(key, value, codes, scales, slot_mapping,
                                                  self.layer_static_scales(kv_cache, key, value),
                                                  quant.QMAX[self.kv_cache_dtype])
        elif self.use_kernel:
            torch.ops.pagedllm_cpu.write_kv(key, value, kv_cache, slot_mapping)
        else:
            super().write_kv(kv_cache, key, value, slot_mapping)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        return paged_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                               metadata.query_start_loc, scale, kv_cache_dtype=self.kv_cache_dtype,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
