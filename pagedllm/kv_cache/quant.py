"""One-byte KV caches (int8, fp8 e4m3, fp8 e5m2) with a scale per token and KV head, and the names of
every kv_cache_dtype the engine accepts.

Layout. A float cache layer is [2 (K, V), kv_heads, num_blocks, block_size, head_dim] in its dtype. A
one-byte layer is one uint8 tensor [2, kv_heads, num_blocks, block_size * (head_dim + 2)]: each
(K or V, head, block) tile holds block_size rows of head_dim one-byte codes, then block_size bf16
scales, one per row (MLA: 1 "head" of kv_lora_rank + qk_rope_head_dim). So a block id still names
every byte of a block, scales included: block copies (copy-on-write), preemption, prefix sharing and
anything that ships raw blocks (`block_tensors`) carry the scales with the codes, and the codes of one
tile stay contiguous for the kernels. A value is `code * scale`.

Scales. By default each token's K (and V) row of each head gets its own scale, amax / qmax, computed
when the token is written: a row's largest element maps to the format's largest code, so no
magnitude underflows into fp8's subnormals or saturates, and an outlier token costs nobody else
precision. Per-layer static scales, as vLLM's `calculate_kv_scales` and checkpoint `k_scale` /
`v_scale`, are stored the same way (every row of a layer gets the layer's scale), so the kernels
have one path. bf16 scales (not fp32) keep the overhead at 2 bytes per row; the bf16-rounded scale is
the one the codes are computed with, so rounding it costs nothing but the clamp of a row maximum that
lands up to 0.4% above qmax.
"""

from __future__ import annotations

import torch

# kv_cache_dtype name -> storage dtype (None: the model's dtype), as vLLM spells them.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
ONE_BYTE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2
# Largest code of each one-byte format: a row's amax maps here.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_TINY = torch.finfo(torch.bfloat16).tiny  # keeps an all-zero row's scale positive (its codes stay 0)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of `kv_cache_dtype` (one-byte kinds: their code dtype). ValueError names the option."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}.")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_quantized(kv_dtype: torch.dtype) -> bool:
    return kv_dtype in ONE_BYTE_DTYPES


def bytes_per_row(row_elements: int, kv_dtype: torch.dtype) -> int:
    """Bytes one cached row (one token, one K or V head; MLA: the latent) takes, scale included."""
    if is_quantized(kv_dtype):
        return row_elements + SCALE_BYTES
    return row_elements * kv_dtype.itemsize


def quantized_layer_shape(float_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[P, H, num_blocks, block_size, row] (the float layout) -> the one-byte layout [P, H, num_blocks,
    block_size * (row + SCALE_BYTES)] in uint8."""
    parts, heads, num_blocks, block_size, row = float_shape
    return (parts, heads, num_blocks, block_size * (row + SCALE_BYTES))


def split_cache(kv_cache: torch.Tensor, kv_dtype: torch.dtype, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-byte layer [P, H, num_blocks, block_size * (row + 2)] uint8 -> (codes [P, H, num_blocks,
    block_size, row] in kv_dtype, scales [P, H, num_blocks, block_size] bf16), both views."""
    block_size = kv_cache.shape[-1] // (row + SCALE_BYTES)
    codes = kv_cache[..., :block_size * row].view(kv_dtype).unflatten(-1, (block_size, row))
    scales = kv_cache[..., block_size * row:].view(SCALE_DTYPE)
    return codes, scales


def block_tensors(kv_caches: list[torch.Tensor], block_id: int) -> list[torch.Tensor]:
    """Every tensor that makes up one block across layers (views, for shipping or copying raw blocks).
    One per layer for float and one-byte caches alike: the scales sit inside the block."""
    return [cache[:, :, block_id] for cache in kv_caches]


def compute_scales(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """Per-row scales [..., ] for rows x [..., row]: amax / qmax, rounded to bf16."""
    amax = x.abs().amax(dim=-1).float()
    return (amax / QMAX[kv_dtype]).clamp_min_(_TINY).to(SCALE_DTYPE)


def quantize(x: torch.Tensor, scales: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """Codes of rows x [..., row] under bf16 scales [...]: round to nearest (even), clamped to +-qmax."""
    qmax = QMAX[kv_dtype]
    y = x.float() / scales.float().unsqueeze(-1)
    if kv_dtype == torch.int8:
        return y.round_().clamp_(-qmax, qmax).to(torch.int8)
    return y.clamp_(-qmax, qmax).to(kv_dtype)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """codes [..., row] * scales [...] in fp32, then rounded once to out_dtype (what every reader sees)."""
    return (codes.float() * scales.float().unsqueeze(-1)).to(out_dtype)


def write_rows(kv_cache: torch.Tensor, kv_dtype: torch.dtype, rows: torch.Tensor, slot_mapping: torch.Tensor,
               static_scales: torch.Tensor | None = None) -> None:
    """Quantize rows [P, H, T, row] and write them with their scales at slot_mapping [T] of a one-byte
    layer. static_scales [P] (one per K and V, fp32): every row of a part gets that scale."""
    parts, heads, _, row = rows.shape
    codes, scales = split_cache(kv_cache, kv_dtype, row)
    if static_scales is None:
        row_scales = compute_scales(rows, kv_dtype)
    else:
        row_scales = static_scales.to(SCALE_DTYPE).view(parts, 1, 1).expand(parts, heads, rows.shape[2])
    new_codes = quantize(rows, row_scales, kv_dtype)
    # index_put_ has no fp8 kernel on CPU: write the bytes. The codes view is strided (scales sit
    # between tiles), so index [P, H, blocks, block_size, row] by (block, offset).
    block_size = codes.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    codes.view(torch.uint8)[:, :, blocks, offsets] = new_codes.view(torch.uint8)
    scales[:, :, blocks, offsets] = row_scales.to(SCALE_DTYPE)


def read_blocks(kv_cache: torch.Tensor, kv_dtype: torch.dtype, row: int, part: int, block_ids: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Dequantized rows of the given blocks of one part (0: K, 1: V): [H, len(block_ids), block_size, row]."""
    codes, scales = split_cache(kv_cache, kv_dtype, row)
    return dequantize(codes[part].index_select(1, block_ids), scales[part].index_select(1, block_ids), out_dtype)


def static_scales_from_batch(key: torch.Tensor, value: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """vLLM's calculate_kv_scales: one scale per K and V of a layer from the first batch, amax / qmax
    (later tokens above the first batch's amax saturate at qmax)."""
    amax = torch.stack((key.abs().amax(), value.abs().amax())).float()
    return (amax / QMAX[kv_dtype]).clamp_min_(_TINY)
