"""Tiny GGUF files for tests, written with gguf.GGUFWriter from the random Hugging Face models of
tiny_models.py, laid out as llama.cpp's converter lays them out (its tensor names, its q/k row
permutation for llama, the tokenizer and chat template in the metadata).

Block types the gguf package can quantize (Q8_0, Q4_0, Q4_1, ...) quantize the model's weights; the
K-quants it cannot (Q4_K, Q6_K) are filled with random valid blocks, so the file's weights are whatever
those blocks dequantize to: tests compare pagedllm with transformers on the same file, never with the
original model.
Mixture-of-experts layers (Qwen3-MoE) are stacked as the converter stacks them: one
[n_expert, rows, cols] tensor per projection and layer (blk.N.ffn_{gate,up,down}_exps), the router
(ffn_gate_inp) kept in F32 as llama.cpp keeps it.
"""

from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from safetensors.torch import load_file

# bytes of one K-quant block of 256 weights: (offset of the fp16 scale fields, block size)
_K_BLOCKS = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
         "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3,
         "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}
# a per-expert Hugging Face weight: (the layer's experts, expert index, projection)
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def _permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for the rows of a llama q or k projection."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    size = _K_BLOCKS[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    # small super-block scales keep activations in range (fp16 d, and dmin where the type has it)
    scale = rng.uniform(0.0005, 0.002, size=(rows, cols // 256)).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":  # Q6_K keeps its one fp16 scale last
        blocks[:, :, size - 2:] = scale.reshape(rows, cols // 256, 2)
    else:
        blocks[:, :, 0:2] = scale.reshape(rows, cols // 256, 2)
        blocks[:, :, 2:4] = scale.reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def _stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's weights with each layer's per-expert projections stacked in expert order, as
    llama.cpp's converter does: `<layer>.mlp.experts.<proj>.weight`, [n_expert, rows, cols], which gguf's
    name map knows as blk.N.ffn_<proj>_exps.weight."""
    out: dict[str, torch.Tensor | dict[int, torch.Tensor]] = {}
    for hf_name, tensor in state.items():
        match = _EXPERT.fullmatch(hf_name)
        if match is None:
            out[hf_name] = tensor
        else:
            out.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = tensor
    return {name: torch.stack([t[i] for i in range(len(t))]) if isinstance(t, dict) else t for name, t in out.items()}


def _encode(name: str, w: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, GGMLQuantizationType]:
    if w.ndim == 1 or kind == "F32" or name.endswith("ffn_gate_inp.weight") or \
            name == "token_embd.weight" and kind in _K_BLOCKS:
        return w.astype(np.float32), GGMLQuantizationType.F32
    qtype = GGMLQuantizationType[kind]
    if kind == "F16":
        return w.astype(np.float16), qtype
    if kind in _K_BLOCKS:  # random blocks for every row, of a matrix or of a stack of experts
        rows = _random_k_blocks(int(np.prod(w.shape[:-1])), w.shape[-1], kind, rng)
        return rows.reshape(*w.shape[:-1], -1), qtype
    return quantize(w.astype(np.float32), qtype), qtype  # row-wise over the last axis, any rank


def write_gguf(model_dir: str, path: str, weight_type: str = "F32", seed: int = 0,
               arch_name: str | None = None, metadata: dict | None = None,
               tensor_types: dict[str, str] | None = None) -> str:
    """Write the tiny model in `model_dir` as a GGUF file at `path`, its 2-D weights in `weight_type`
    (arch_name: declare another architecture, for refusal tests; metadata: more keys, as the writer's
    add_<name>(value) calls; tensor_types: {a llama.cpp tensor name's suffix, e.g. "attn_v.weight": its
    block type}, to mix types as llama.cpp's Q4_K_M does)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    model_type = config["model_type"]
    arch_name = arch_name or gguf.MODEL_ARCH_NAMES[_ARCH[model_type]]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(path, arch_name)
    writer.add_name(os.path.basename(model_dir))
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    partial = rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(head_dim * partial))
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if config.get("sliding_window"):  # llama.cpp's converter writes Gemma's and Phi-3's window
        writer.add_sliding_window(config["sliding_window"])
    for key, value in (metadata or {}).items():
        getattr(writer, f"add_{key}")(value)
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if rope.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter: the factors as tensors
        writer.add_rope_scaling_orig_ctx_len(config.get("original_max_position_embeddings")
                                             or rope["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))

    vocab = tokenizer["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    tokens = [""] * config["vocab_size"]
    for token, index in {**vocab, **specials}.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(specials[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(specials[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(specials[tokenizer_config["pad_token"]])
    writer.add_add_bos_token(False)
    template_file = os.path.join(model_dir, "chat_template.jinja")  # transformers 5 saves it beside
    template = tokenizer_config.get("chat_template")
    if template is None and os.path.isfile(template_file):
        with open(template_file) as f:
            template = f.read()
    if template:
        writer.add_chat_template(template)

    rng = np.random.default_rng(seed)
    name_map = gguf.get_tensor_name_map(_ARCH[model_type], layers)
    state = _stack_experts(load_file(os.path.join(model_dir, "model.safetensors")))
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        w = tensor.to(torch.float32).numpy()
        if model_type == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _permute_qk(w, heads if "attn_q" in name else kv_heads)
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp stores Gemma's norms as the (1 + weight) they multiply by
        kind = next((t for suffix, t in (tensor_types or {}).items() if name.endswith(suffix)), weight_type)
        data, qtype = _encode(name, w, kind, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
