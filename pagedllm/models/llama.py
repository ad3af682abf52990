"""The Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

It sees a flat batch of tokens from many requests and an AttentionMetadata; it knows nothing of
requests. Projections are fused at load time (q|k|v and gate|up), so a layer is four matmuls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.config import ModelConfig
from pagedllm.layers.activation import get_act_and_mul
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.quantization import linear
from pagedllm.layers.rotary import RotaryEmbedding


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding):
        super().__init__()
        dtype = config.dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, config.hidden_size, dtype=dtype)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype) if config.qkv_bias else None
        self.o_weight = _param(config.hidden_size, self.q_size, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.backend = backend
        self.rotary = rotary

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        qkv = linear(hidden, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.apply(cos_sin, q, k)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale)
        return linear(out.reshape(-1, self.q_size), self.o_weight)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_weight = _param(2 * config.intermediate_size, config.hidden_size, dtype=config.dtype)
        self.down_weight = _param(config.hidden_size, config.intermediate_size, dtype=config.dtype)
        self.act_and_mul = get_act_and_mul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.act_and_mul(linear(x, self.gate_up_weight)), self.down_weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = LlamaAttention(config, backend, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = LlamaMLP(config)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(cos_sin, self.input_layernorm(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.config = config
        max_positions = max(config.max_model_len, config.max_position_embeddings)
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope, config.dtype)
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, backend, self.rotary) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else _param(config.vocab_size, config.hidden_size, dtype=config.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos_sin = self.rotary.lookup(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(cos_sin, hidden, kv_cache, metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()

    # ---- weight loading: Hugging Face names -> our fused parameters ----
    # The projections weight-only quantization replaces; embeddings and the LM head stay in the model dtype.
    quantizable_weights = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

    def load_weights(self, get_tensor: Callable[[str], torch.Tensor], names: set[str],
                     load_linear: Callable[[torch.Tensor, tuple[str, ...]], bool] | None = None) -> None:
        def copy(dst: torch.Tensor, *srcs: str) -> None:
            if load_linear is not None and load_linear(dst, srcs):
                return  # a quantized projection, installed in dst's place by the loader
            dst.copy_(torch.cat([get_tensor(name) for name in srcs], dim=0) if len(srcs) > 1
                      else get_tensor(srcs[0]))

        copy(self.embed_tokens, "model.embed_tokens.weight")
        copy(self.norm.weight, "model.norm.weight")
        if not self.config.tie_word_embeddings:
            copy(self.lm_head, "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = layer.self_attn
            copy(attn.qkv_weight, *(f"{p}self_attn.{x}_proj.weight" for x in "qkv"))
            if attn.qkv_bias is not None:
                copy(attn.qkv_bias, *(f"{p}self_attn.{x}_proj.bias" for x in "qkv"))
            copy(attn.o_weight, f"{p}self_attn.o_proj.weight")
            if attn.q_norm is not None:
                copy(attn.q_norm.weight, f"{p}self_attn.q_norm.weight")
                copy(attn.k_norm.weight, f"{p}self_attn.k_norm.weight")
            if hasattr(layer.mlp, "load_weights"):  # a mixture of experts (pagedllm.models.moe) loads itself
                layer.mlp.load_weights(get_tensor, names, p)
            else:
                copy(layer.mlp.gate_up_weight, f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight")
                copy(layer.mlp.down_weight, f"{p}mlp.down_proj.weight")
            copy(layer.input_layernorm.weight, f"{p}input_layernorm.weight")
            copy(layer.post_attention_layernorm.weight, f"{p}post_attention_layernorm.weight")
