"""The Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

It sees a flat batch of tokens from many requests and an AttentionMetadata; it knows nothing of
requests. Projections are fused at load time (q|k|v and gate|up), so a layer is four matmuls. Under
tensor parallelism (pagedllm.layers.linear) each rank holds its heads, its slice of the MLP and its
vocabulary range; o_proj, down_proj and the embedding end in one all-reduce each.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.config import ModelConfig
from pagedllm.layers.activation import get_act_and_mul
from pagedllm.layers.linear import (
    GetSlice,
    LoadLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedllm.layers.module import Module
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding


class LlamaAttention(Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding,
                 tp_rank: int = 0, tp_size: int = 1, layer_idx: int = 0):
        super().__init__()
        dtype = config.dtype
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, config.qkv_bias, dtype, tp_rank, tp_size)
        self.num_heads = self.qkv_proj.num_heads        # this rank's heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, config.o_bias,
                                        dtype, tp_rank, tp_size)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.backend = backend
        self.rotary = rotary
        self.sliding_window = config.layer_sliding_window(layer_idx)
        self.logits_soft_cap: float | None = None

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        # the heads' views of the fused projection [T, (Hq + 2 Hkv) * D]: one view and one split
        q, k, v = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim).split_with_sizes(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(cos_sin, q, k)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale, self.sliding_window,
                                   self.logits_soft_cap)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(Module):
    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], config.mlp_bias, config.dtype,
                                                       tp_rank, tp_size)
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, config.dtype, tp_rank, tp_size)
        self.act_and_mul = get_act_and_mul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding,
                 tp_rank: int = 0, tp_size: int = 1, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = LlamaAttention(config, backend, rotary, tp_rank, tp_size, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = LlamaMLP(config, tp_rank, tp_size)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the residual add is left to the next
        norm, which fuses it (vLLM's layout). residual is None at the first layer."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.config = config
        self.rotary = self.make_rotary(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.dtype,
                                                   tp_rank, tp_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, backend, self.rotary, tp_rank, tp_size, i)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, config.dtype, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def make_rotary(config: ModelConfig, rotary_dim: int | None = None) -> RotaryEmbedding:
        """The rotary embedding (over the first `rotary_dim` of each head, where it is partial). LongRoPE's
        factors: a short set for contexts within original_max_position_embeddings and a long set beyond.
        The reference picks the set from the length of the sequence in hand and recomputes its whole cache
        when that crosses the original length; a paged cache shared across requests cannot, so the set is
        chosen once per engine: long when max_model_len exceeds the original length, short otherwise (what
        the reference computes for any sequence within that length). Outputs then never depend on batch
        composition or prefix-cache hits. Dynamic NTK's base is fixed per engine likewise."""
        rope = config.rope
        if rope.scaling is not None and rope.scaling["rope_type"] == "longrope":
            rope = copy.deepcopy(rope)
            rope.scaling["use_long_factor"] = config.max_model_len > rope.scaling["original_max_position_embeddings"]
        elif rope.scaling is not None and rope.scaling["rope_type"] == "dynamic":
            rope = copy.deepcopy(rope)
            rope.scaling["max_model_len"] = config.max_model_len  # (the same rule: see layers/rotary.py)
        max_positions = max(config.max_model_len, config.max_position_embeddings)
        return RotaryEmbedding(config.head_dim, max_positions, rope, config.dtype, rotary_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions)
        residual = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(cos_sin, hidden, residual, kv_cache, metadata.for_layer(index))
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        """float32 logits on rank 0 (upcast=False: the matmul's dtype, for an argmax); None on the other
        ranks of a tensor-parallel group."""
        return self.lm_head.compute_logits(hidden, upcast)

    def argmax_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of compute_logits(hidden, upcast=False) (None off rank 0), without storing the
        logits where the LM head's kernel can (ParallelLMHead.argmax)."""
        return self.lm_head.argmax(hidden)

    # ---- weight loading: Hugging Face names -> our fused, sharded parameters ----
    # The projections weight-only quantization replaces; embeddings and the LM head stay in the model dtype.
    quantizable_weights = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")

    def load_weights(self, get_slice: GetSlice, names: set[str],
                     load_linear: LoadLinear | None = None) -> None:
        """`load_linear(param, checkpoint names)` may install a quantized projection in param's place."""
        load_decoder_weights(self, get_slice, names, load_linear)


def load_decoder_weights(model: nn.Module, get_slice: GetSlice, names: set[str], load_linear: LoadLinear | None,
                         layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm"),
                         norm_offset: float = 0.0) -> None:
    """Hugging Face names -> the fused, sharded parameters of a Llama-shaped decoder (embeddings, q|k|v and
    o, an optional q/k norm, gate|up and down or a mixture of experts, the layer norms named in
    `layer_norms`, the final norm, the LM head). `norm_offset` is added to every RMSNorm weight as it is read
    (Gemma stores w for a (1 + w) scale)."""
    def norm(dst: torch.Tensor, name: str) -> None:  # replicated on every rank
        src = get_slice(name)[:]
        dst.copy_(src.float() + norm_offset if norm_offset else src)

    model.embed_tokens.load(get_slice, "model.embed_tokens.weight")
    norm(model.norm.weight, "model.norm.weight")
    # Tied, the LM head reads the embedding's weight; where the embedding kept the file's quantized rows
    # instead, the LM head multiplies by that table as stored where a kernel can, else fills its own.
    tied_table = (model.config.tie_word_embeddings and model.embed_tokens.quantized_rows is not None
                  and model.lm_head.use_quantized_table(model.embed_tokens, model.config.dtype))
    if not tied_table and (not model.config.tie_word_embeddings or model.embed_tokens.quantized_rows is not None):
        model.lm_head.load(get_slice, "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        attn.qkv_proj.load(get_slice, [f"{p}self_attn.{x}_proj.weight" for x in "qkv"],
                           [f"{p}self_attn.{x}_proj.bias" for x in "qkv"], load_linear)
        attn.o_proj.load(get_slice, f"{p}self_attn.o_proj.weight", f"{p}self_attn.o_proj.bias", load_linear)
        if attn.q_norm is not None:
            norm(attn.q_norm.weight, f"{p}self_attn.q_norm.weight")
            norm(attn.k_norm.weight, f"{p}self_attn.k_norm.weight")
        if hasattr(layer.mlp, "load_weights"):  # a mixture of experts (pagedllm.models.moe) loads itself
            layer.mlp.load_weights(lambda name: get_slice(name)[:], names, p)
        else:
            layer.mlp.gate_up_proj.load(get_slice, [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"],
                                        [f"{p}mlp.gate_proj.bias", f"{p}mlp.up_proj.bias"], load_linear)
            layer.mlp.down_proj.load(get_slice, f"{p}mlp.down_proj.weight", f"{p}mlp.down_proj.bias", load_linear)
        for name in layer_norms:
            norm(getattr(layer, name).weight, f"{p}{name}.weight")
