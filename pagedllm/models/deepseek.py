"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and mixture-of-experts layers.

MLA (pagedllm.attention.mla) caches per token one latent c_kv = RMSNorm(W_DKV h) of kv_lora_rank and
one rope key k_pe shared by all heads; queries are split into a no-position part (q_nope, matched
against W_UK c_kv) and a rope part (q_pe, matched against k_pe). With q_lora_rank the query is also
low-rank: q = W_UQ RMSNorm(W_DQ h). The first `first_k_dense_replace` layers use a dense MLP, the rest
routed experts plus shared experts (pagedllm.models.moe).

RoPE on the rope part is interleaved (pairs (x0, x1), as DeepSeek trained it; V3 unless
rope_interleave is false). We de-interleave q_pe and k_pe once, then rotate halves: the same dot
products, since both sides carry the same permutation and the cache holds the rotated k_pe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.mla import TorchMLAAttention
from pagedllm.config import ModelConfig
from pagedllm.layers.activation import get_act_and_mul
from pagedllm.layers.module import Module
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, yarn_mscale
from pagedllm.layers.sampler import argmax_rows
from pagedllm.models.moe import FusedMoE, MoEConfig


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def validate_deepseek_config(hf: dict, model_type: str) -> None:
    """Fields we cannot serve fail at load time, naming the field, rather than produce wrong outputs."""
    if hf.get("attention_bias"):
        raise ValueError(f"{model_type}: attention_bias=True is not supported (published checkpoints use False).")
    if hf.get("mlp_bias"):
        raise ValueError(f"{model_type}: mlp_bias=True is not supported (published checkpoints use False).")
    if int(hf.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"{model_type}: moe_layer_freq={hf['moe_layer_freq']} is not supported; only 1 "
                         "(every layer from first_k_dense_replace on is MoE).")
    for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if not isinstance(hf.get(name), int) or hf[name] <= 0:
            raise ValueError(f"{model_type}: {name} must be a positive integer, got {hf.get(name)!r}.")
    if hf["qk_rope_head_dim"] % 2:
        raise ValueError(f"{model_type}: qk_rope_head_dim must be even, got {hf['qk_rope_head_dim']}.")
    if int(hf.get("n_routed_experts") or 0) > 0:
        MoEConfig.from_hf(hf, model_type)


def reject_quantization(config: ModelConfig, architecture: str) -> None:
    # Weight-only quantization covers the Llama decoder's projections; the experts' 3-D weights and
    # MLA's kv_b_proj (sliced into W_UK / W_UV for absorbed decode) have no quantized path yet.
    if getattr(config, "quantization", None) is not None:
        raise ValueError(f"quantization is not supported for {architecture} yet; pass quantization=None.")


class DeepseekMLP(Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, dtype: torch.dtype):
        super().__init__()
        self.gate_up_weight = _param(2 * intermediate_size, hidden_size, dtype=dtype)
        self.down_weight = _param(hidden_size, intermediate_size, dtype=dtype)
        self.act_and_mul = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act_and_mul(F.linear(x, self.gate_up_weight)), self.down_weight)

    def load_weights(self, get_tensor: Callable[[str], torch.Tensor], names: set[str], layer_prefix: str) -> None:
        p = layer_prefix + "mlp."
        self.gate_up_weight.copy_(torch.cat([get_tensor(f"{p}gate_proj.weight"), get_tensor(f"{p}up_proj.weight")]))
        self.down_weight.copy_(get_tensor(f"{p}down_proj.weight"))


class DeepseekMLAAttention(Module):
    def __init__(self, config: ModelConfig, mla: TorchMLAAttention, rotary: RotaryEmbedding, interleaved: bool):
        super().__init__()
        hf, dtype, hidden = config.hf_config, config.dtype, config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = hf.get("q_lora_rank") or None
        self.kv_lora_rank = hf["kv_lora_rank"]
        self.nope_dim = hf["qk_nope_head_dim"]
        self.rope_dim = hf["qk_rope_head_dim"]
        self.v_head_dim = hf["v_head_dim"]
        q_out = self.num_heads * (self.nope_dim + self.rope_dim)
        if self.q_lora_rank is None:
            self.q_weight = _param(q_out, hidden, dtype=dtype)
        else:
            self.q_a_weight = _param(self.q_lora_rank, hidden, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, dtype)
            self.q_b_weight = _param(q_out, self.q_lora_rank, dtype=dtype)
        self.kv_a_weight = _param(self.kv_lora_rank + self.rope_dim, hidden, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6, dtype)
        self.kv_b_weight = _param(self.num_heads * (self.nope_dim + self.v_head_dim), self.kv_lora_rank, dtype=dtype)
        self.o_weight = _param(hidden, self.num_heads * self.v_head_dim, dtype=dtype)
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        scaling = config.rope.scaling
        if scaling is not None and scaling.get("mscale_all_dim"):
            # DeepSeek's YaRN: softmax scale grows with mscale(factor, mscale_all_dim)^2.
            self.scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
        self.mla = mla
        self.rotary = rotary
        self.interleaved = interleaved

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = F.linear(hidden, self.q_weight)
        else:
            q = F.linear(self.q_a_layernorm(F.linear(hidden, self.q_a_weight)), self.q_b_weight)
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = F.linear(hidden, self.kv_a_weight).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe.unsqueeze(1)
        if self.interleaved:
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
        q_pe, k_pe = self.rotary(cos_sin, q_pe, k_pe)
        out = self.mla.forward_mla(q_nope, q_pe, torch.cat([latent, k_pe.squeeze(1)], dim=-1), kv_cache, metadata,
                                   self.scale, self.kv_b_weight, self.v_head_dim)
        return F.linear(out.reshape(-1, self.num_heads * self.v_head_dim), self.o_weight)

    def load_weights(self, get_tensor: Callable[[str], torch.Tensor], layer_prefix: str) -> None:
        p = layer_prefix + "self_attn."
        if self.q_lora_rank is None:
            self.q_weight.copy_(get_tensor(f"{p}q_proj.weight"))
        else:
            self.q_a_weight.copy_(get_tensor(f"{p}q_a_proj.weight"))
            self.q_a_layernorm.weight.copy_(get_tensor(f"{p}q_a_layernorm.weight"))
            self.q_b_weight.copy_(get_tensor(f"{p}q_b_proj.weight"))
        self.kv_a_weight.copy_(get_tensor(f"{p}kv_a_proj_with_mqa.weight"))
        self.kv_a_layernorm.weight.copy_(get_tensor(f"{p}kv_a_layernorm.weight"))
        self.kv_b_weight.copy_(get_tensor(f"{p}kv_b_proj.weight"))
        self.o_weight.copy_(get_tensor(f"{p}o_proj.weight"))


class DeepseekDecoderLayer(Module):
    def __init__(self, config: ModelConfig, layer_idx: int, mla: TorchMLAAttention, rotary: RotaryEmbedding,
                 interleaved: bool, moe: MoEConfig | None, v3: bool):
        super().__init__()
        hf = config.hf_config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = DeepseekMLAAttention(config, mla, rotary, interleaved)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        if moe is not None and layer_idx >= int(hf.get("first_k_dense_replace") or 0):
            self.mlp: nn.Module = FusedMoE(moe, config.hidden_size, config.hidden_act, config.dtype,
                                           use_correction_bias=v3)
        else:
            self.mlp = DeepseekMLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.dtype)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(cos_sin, self.input_layernorm(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekV2ForCausalLM(Module):
    model_type = "deepseek_v2"

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        assert tp_size == 1, "ParallelConfig refuses tensor parallelism for DeepSeek models"
        # MLA brings its own attention (latent cache, absorbed decode); of the runner's MHA backend only
        # the cache dtype (one-byte kinds: quantized latent rows) is taken.
        hf = config.hf_config
        validate_deepseek_config(hf, self.model_type)
        reject_quantization(config, type(self).__name__)
        v3 = self.model_type == "deepseek_v3"
        self.config = config
        self.mla = TorchMLAAttention(config.num_attention_heads, hf["kv_lora_rank"], hf["qk_rope_head_dim"],
                                     config.dtype)
        if backend is not None and backend.kv_cache_dtype is not None:
            self.mla.configure_kv_cache(backend.kv_cache_dtype, backend.calculate_kv_scales)
        del backend
        max_positions = max(config.max_model_len, config.max_position_embeddings)
        self.rotary = RotaryEmbedding(hf["qk_rope_head_dim"], max_positions, config.rope, config.dtype)
        interleaved = bool(hf.get("rope_interleave", True)) if v3 else True
        moe = MoEConfig.from_hf(hf, self.model_type) if int(hf.get("n_routed_experts") or 0) > 0 else None
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.layers = nn.ModuleList([
            DeepseekDecoderLayer(config, i, self.mla, self.rotary, interleaved, moe, v3)
            for i in range(config.num_hidden_layers)])
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

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """float32 logits (upcast=False: the matmul's dtype, for an argmax)."""
        logits = F.linear(hidden, self.lm_head)
        return logits.float() if upcast else logits

    def argmax_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of compute_logits(hidden, upcast=False)."""
        return argmax_rows(self.compute_logits(hidden, upcast=False))

    def load_weights(self, get_slice: Callable, names: set[str], load_linear: Callable | None = None) -> None:
        # Weights past num_hidden_layers (V3's multi-token-prediction layer) are not read. Unsharded: every
        # tensor is read whole; quantization is refused at construction, so load_linear is never given.
        def get_tensor(name: str) -> torch.Tensor:
            return get_slice(name)[:]

        self.embed_tokens.copy_(get_tensor("model.embed_tokens.weight"))
        self.norm.weight.copy_(get_tensor("model.norm.weight"))
        if not self.config.tie_word_embeddings:
            self.lm_head.copy_(get_tensor("lm_head.weight" if "lm_head.weight" in names
                                          else "model.embed_tokens.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(get_tensor(f"{p}input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(get_tensor(f"{p}post_attention_layernorm.weight"))
            layer.self_attn.load_weights(get_tensor, p)
            layer.mlp.load_weights(get_tensor, names, p)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    model_type = "deepseek_v3"
