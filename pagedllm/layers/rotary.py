"""Rotary position embeddings (RoPE), with the scaling variants published checkpoints use."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pagedllm.config import RopeConfig
from pagedllm.layers.custom_op import CustomOp

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    # Same arithmetic as transformers, so fp32 logits agree to the last bit we can hope for.
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = rope.scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    if rope_type == "dynamic":
        # Dynamic NTK: the base grows with the context past the original length. The reference recomputes
        # it for the sequence in hand; here it is fixed per engine, for max_model_len (`max_model_len`, set
        # by LlamaForCausalLM.make_rotary): plain RoPE, exactly the reference's, while max_model_len is
        # within the original length.
        original = float(scaling["original_max_position_embeddings"])
        seq_len = max(float(scaling.get("max_model_len", original)), original)
        factor = float(scaling["factor"])
        base = rope.theta * ((factor * seq_len / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope, scaling)
    if rope_type == "longrope":
        # Phi-3's LongRoPE: one rescale factor per frequency, the long set for contexts past the original
        # length. Which set is fixed per engine (`use_long_factor`, see models/phi3.py), never per batch.
        factors = scaling["long_factor"] if scaling.get("use_long_factor") else scaling["short_factor"]
        ext = torch.tensor(factors, dtype=torch.float32)
        if ext.numel() != head_dim // 2:
            raise ValueError(f"rope_scaling long_factor/short_factor must have {head_dim // 2} entries "
                             f"(rotary dimension / 2), got {ext.numel()}.")
        return 1.0 / (ext * rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}.")


def _yarn_original_max(scaling: dict) -> float:
    if "original_max_position_embeddings" not in scaling:
        raise ValueError("rope_scaling of type 'yarn' needs original_max_position_embeddings.")
    return float(scaling["original_max_position_embeddings"])


def _yarn_inv_freq(head_dim: int, rope: RopeConfig, scaling: dict) -> torch.Tensor:
    """YaRN: extrapolate the high frequencies, interpolate the low ones by `factor`, ramp between
    the dimensions that turn beta_fast and beta_slow times over the original context."""
    base, factor = rope.theta, float(scaling["factor"])
    original_max = _yarn_original_max(scaling)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation_factor = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN applies to cos and sin (so to q.k through both): `attention_factor` if given,
    else DeepSeek's mscale(factor, mscale) / mscale(factor, mscale_all_dim), else mscale(factor)."""
    scaling = rope.scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = float(scaling["factor"])
        original = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


class RotaryEmbedding(CustomOp):
    """Precomputes cos/sin for every position once; applying it is two gathers and four multiplies.
    rotary_dim < head_dim (partial rotary, Phi-4-mini): only the first rotary_dim features rotate."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype,
                 rotary_dim: int | None = None):
        super().__init__()
        inv_freq = _inv_freq(rotary_dim or head_dim, rope)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = rope_attention_factor(rope)
        self.register_buffer("cos_cache", (emb.cos() * factor).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * factor).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a step's positions, [T, 1, D]; looked up once per step, used by every layer."""
        return (self.cos_cache.index_select(0, positions).unsqueeze(1),
                self.sin_cache.index_select(0, positions).unsqueeze(1))

    # forward(cos_sin, q, k) -> (q, k) rotated; q: [T, Hq, D], k: [T, Hkv, D]; rotate-half
    # (non-interleaved) layout, as in Llama.
    def dispatch(self, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        return super().dispatch(cos_sin[0])

    def forward_native(self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        rotary_dim = cos.shape[-1]
        if rotary_dim != q.shape[-1]:  # partial rotary: the rest passes through
            return (torch.cat((_apply(q[..., :rotary_dim], cos, sin), q[..., rotary_dim:]), dim=-1),
                    torch.cat((_apply(k[..., :rotary_dim], cos, sin), k[..., rotary_dim:]), dim=-1))
        return _apply(q, cos, sin), _apply(k, cos, sin)

    def forward_cpu(self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        if (cos.shape[-1] == q.shape[-1] and q.dtype == cos.dtype == k.dtype and q.stride(-1) == 1
                and k.stride(-1) == 1):
            # One C++ call rotates q and k in place with the same rounding (the callers own both: they
            # are views of this step's qkv projection), instead of eight torch ops each.
            torch.ops.pagedllm_cpu_layers.rotary_embedding(q, k, cos, sin)
            return q, k
        return self.forward_native(cos_sin, q, k)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
