"""Named models for the planner, written as the relevant part of their published config.json, so that a
preset and a local checkpoint go through the same reader (ModelSpec.from_hf_config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.planner.roofline import ModelSpec

_LLAMA3_VOCAB = 128256

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        model_type="llama",
        num_hidden_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=_LLAMA3_VOCAB,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=_LLAMA3_VOCAB,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    "llama-3.3-70b": dict(
        model_type="llama",
        num_hidden_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=_LLAMA3_VOCAB,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        num_hidden_layers=24,
        hidden_size=896,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        num_hidden_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    # The released checkpoint stores weights in block-quantized fp8: pass --dtype fp8 to plan with that.
    # The multi-token-prediction layer (about 14B more) is not counted.
    "deepseek-v3": dict(
        model_type="deepseek_v3",
        num_hidden_layers=61,
        hidden_size=7168,
        num_attention_heads=128,
        num_key_value_heads=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        vocab_size=129280,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        moe_layer_freq=1,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
}


def load_model_spec(model: str) -> ModelSpec:
    """A preset name, a directory holding config.json, a path to a config.json, or a GGUF file or a
    directory holding one (its metadata's config, and its weights' bytes as stored)."""
    if model.lower() in MODEL_PRESETS:
        return ModelSpec.from_hf_config(MODEL_PRESETS[model.lower()], name=model.lower())
    path = Path(model)
    if path.suffix.lower() == ".gguf" or (path.is_dir() and not (path / "config.json").exists()):
        from pagedllm.models.gguf import gguf_model_name, read_hf_config, resolve_gguf_file, stored_weight_bytes

        gguf_file = resolve_gguf_file(model)  # the file, or the one .gguf of a directory (as the engine takes)
        if gguf_file is not None:
            spec = ModelSpec.from_hf_config(read_hf_config(gguf_file), name=gguf_model_name(gguf_file))
            spec.stored_weight_bytes = stored_weight_bytes(gguf_file)
            return spec
    if path.is_dir() and (path / "config.json").exists():
        return ModelSpec.from_hf_config(path / "config.json", name=path.name)
    if path.is_file():
        try:
            return ModelSpec.from_hf_config(path, name=path.parent.name or path.name)
        except (UnicodeDecodeError, ValueError, KeyError) as exc:  # (json's errors are ValueErrors)
            raise ValueError(f"--model {model!r} is neither a config.json nor a .gguf file ({exc})") from exc
    raise ValueError(
        f"--model {model!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a directory or file with a config.json"
    )
