"""Which Hugging Face architectures we serve, and the class that serves each."""

from __future__ import annotations

# Llama, Mistral and Qwen2/3 share one decoder; they differ in qkv bias and q/k norm (see ModelConfig).
_ARCHITECTURES = {
    "LlamaForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "pagedllm.models.moe_llama:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "pagedllm.models.moe_llama:Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": "pagedllm.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "pagedllm.models.deepseek:DeepseekV3ForCausalLM",
    "Gemma2ForCausalLM": "pagedllm.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "pagedllm.models.gemma:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "pagedllm.models.phi3:Phi3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(architectures: list[str]) -> str:
    for name in architectures:
        if name in _ARCHITECTURES:
            return name
    raise ValueError(
        f"Model architectures {architectures} are not supported; supported architectures: "
        f"{', '.join(supported_architectures())}."
    )


def get_model_class(architecture: str) -> type:
    import importlib

    module_name, class_name = _ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)
