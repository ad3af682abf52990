"""Llama-family decoders whose MLP is a mixture of experts: Mixtral and Qwen3-MoE.

Attention, norms and embeddings are the Llama decoder's (Qwen3-MoE keeps Qwen3's q/k norm); only the
sparse layers' MLP is swapped for FusedMoE with plain softmax top-k routing.
"""

from __future__ import annotations

from pagedllm.attention.backend import AttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.models.deepseek import reject_quantization
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.moe import FusedMoE, MoEConfig


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp_rank: int = 0, tp_size: int = 1):
        reject_quantization(config, "MixtralForCausalLM")
        assert tp_size == 1, "ParallelConfig refuses tensor parallelism for MoE models"
        super().__init__(config, backend)
        moe = MoEConfig.from_hf(config.hf_config, "mixtral")
        for layer in self.layers:
            layer.mlp = FusedMoE(moe, config.hidden_size, config.hidden_act, config.dtype,
                                 hf_prefix="block_sparse_moe.")


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp_rank: int = 0, tp_size: int = 1):
        reject_quantization(config, "Qwen3MoeForCausalLM")
        assert tp_size == 1, "ParallelConfig refuses tensor parallelism for MoE models"
        super().__init__(config, backend)
        hf = config.hf_config
        moe = MoEConfig.from_hf(hf, "qwen3_moe")
        # Layer i is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
        dense = set(hf.get("mlp_only_layers") or [])
        step = int(hf.get("decoder_sparse_step") or 1)
        for i, layer in enumerate(self.layers):
            if i not in dense and (i + 1) % step == 0:
                layer.mlp = FusedMoE(moe, config.hidden_size, config.hidden_act, config.dtype)
