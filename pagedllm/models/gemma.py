"""Gemma 2 and Gemma 3 (text): the Llama decoder's projections with Gemma's differences.

- Embeddings are scaled by sqrt(hidden_size) (rounded to the model dtype first, as the reference does).
- RMSNorm multiplies by (1 + weight): the checkpoint stores the offset from one, so the loader adds the
  one and the shared RMSNorm (and its fused residual add) runs unchanged.
- Four norms per layer: input, post-attention, pre-feedforward, post-feedforward; the residual add
  happens after the post norms (the pre-feedforward norm fuses it, as the input norm does in Llama).
- GeGLU MLP (gelu_pytorch_tanh), attention scale query_pre_attn_scalar ** -0.5.
- Local sliding-window layers interleaved with global ones (`layer_types`, or every n-th layer global
  by `sliding_window_pattern`; ModelConfig.layer_sliding_window says which).
- Gemma 2: attention logits and final logits soft-capped with tanh. Gemma 3: q/k RMSNorm, and separate
  RoPE for local layers (`rope_local_base_freq`, plain) and global ones (`rope_theta`, maybe scaled).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.config import ModelConfig, RopeConfig
from pagedllm.layers.linear import (
    GetSlice,
    LoadLinear,
    ParallelLMHead,
    VocabParallelEmbedding,
)
from pagedllm.layers.module import Module
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.sampler import argmax_rows
from pagedllm.models.llama import LlamaAttention, LlamaMLP, load_decoder_weights


def gemma3_rope_configs(hf: dict) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE of a Gemma 3 config: transformers 5 writes `rope_parameters` per layer type;
    published checkpoints write `rope_theta` (+ `rope_scaling`) and `rope_local_base_freq`."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", 1_000_000.0)
        local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
        return (RopeConfig.from_hf({**hf, "rope_parameters": full, "rope_scaling": None}),
                RopeConfig.from_hf({**hf, "rope_parameters": local, "rope_scaling": None}))
    top = {**hf, "rope_theta": hf.get("rope_theta", 1_000_000.0)}
    return (RopeConfig.from_hf(top),
            RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0))))


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale (`query_pre_attn_scalar`), optional q/k norm, an o_proj bias
    wherever the q/k/v projection has one, and Gemma 2's attention logit soft-capping."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding, layer_idx: int,
                 qk_norm: bool, logits_soft_cap: float | None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(config, backend, rotary, tp_rank, tp_size, layer_idx)
        self.scale = float(config.hf_config.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.dtype) if qk_norm else None
        self.logits_soft_cap = logits_soft_cap


class GemmaDecoderLayer(Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding, layer_idx: int,
                 qk_norm: bool, logits_soft_cap: float | None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        size, eps, dtype = config.hidden_size, config.rms_norm_eps, config.dtype
        self.input_layernorm = RMSNorm(size, eps, dtype)
        self.self_attn = GemmaAttention(config, backend, rotary, layer_idx, qk_norm, logits_soft_cap,
                                        tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(size, eps, dtype)
        self.mlp = LlamaMLP(config, tp_rank, tp_size)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's post-feedforward-normed MLP output, the residual stream before it); the add is left
        to the next layer's input norm (vLLM's layout), as in Llama."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(cos_sin, hidden, kv_cache, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(Module):
    # Gemma 3 sets these: q/k norm and a second rotary table for its local layers.
    qk_norm = False
    local_rope = False

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        hf = config.hf_config
        if hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported.")
        self.config = config
        max_positions = max(config.max_model_len, config.max_position_embeddings)
        if self.local_rope:
            global_rope, local_rope = gemma3_rope_configs(hf)
        else:
            global_rope = local_rope = config.rope
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, global_rope, config.dtype)
        self.local_rotary = (RotaryEmbedding(config.head_dim, max_positions, local_rope, config.dtype)
                             if self.local_rope else self.rotary)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.dtype,
                                                   tp_rank, tp_size)
        # The reference rounds sqrt(hidden_size) to the model dtype before multiplying.
        self.register_buffer("normalizer", torch.tensor(math.sqrt(config.hidden_size), dtype=config.dtype),
                             persistent=False)
        soft_cap = None if self.qk_norm else hf.get("attn_logit_softcapping")  # Gemma 3 does not cap attention
        self.final_logit_softcapping = hf.get("final_logit_softcapping")
        self.layers = nn.ModuleList([
            GemmaDecoderLayer(config, backend, self._layer_rotary(config, i), i, self.qk_norm, soft_cap,
                              tp_rank, tp_size)
            for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, config.dtype, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _layer_rotary(self, config: ModelConfig, layer: int) -> RotaryEmbedding:
        return self.local_rotary if config.layer_sliding_window(layer) is not None else self.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.normalizer
        cos_sin = self.rotary.lookup(positions)
        local_cos_sin = self.local_rotary.lookup(positions) if self.local_rope else cos_sin
        residual = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            rope = cos_sin if layer.self_attn.rotary is self.rotary else local_cos_sin
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata.for_layer(index))
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden, upcast)
        cap = self.final_logit_softcapping
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def argmax_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.final_logit_softcapping:
            # tanh keeps the order, but where it saturates two logits can round to one value: take the
            # argmax of what is sampled from.
            logits = self.compute_logits(hidden, upcast=False)
            return None if logits is None else argmax_rows(logits)
        return self.lm_head.argmax(hidden)

    quantizable_weights = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")

    def load_weights(self, get_slice: GetSlice, names: set[str], load_linear: LoadLinear | None = None) -> None:
        load_decoder_weights(self, get_slice, names, load_linear, norm_offset=1.0,  # norms scale by (1 + weight)
                             layer_norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                          "post_feedforward_layernorm"))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    local_rope = True
