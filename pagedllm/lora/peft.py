"""Reading a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).

PEFT computes each targeted projection as y = W x + scaling * B (A x), with A [r, in], B [out, r] and
scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). An adapter is checked against the
model here, once, at the boundary: every problem is a ValueError naming the field or tensor, so a bad
adapter fails its own request and nothing else.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from pagedllm.config import ModelConfig
from pagedllm.lora.config import LoRAConfig

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

# Hugging Face projection names an adapter may target; qkv_proj and gate_up_proj are the fused ones of
# checkpoints that store them fused (Phi-3): one A over the input, one B over the fused output
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                  "gate_up_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's unsharded (out_features, in_features)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
            "qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * i, h)}


@dataclass
class LoRAModel:
    """One adapter in CPU memory: per (layer, module) its A [r, in] and B [out, r], in the LoRA dtype."""

    lora_int_id: int
    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}


@dataclass
class AdapterConfig:
    rank: int
    scaling: float


def _bad(path: str, message: str) -> ValueError:
    return ValueError(f"lora_path {path!r}: {message}")


def read_adapter_config(path: str, lora_config: LoRAConfig) -> AdapterConfig:
    """adapter_config.json, validated: a LoRA of rank <= max_lora_rank with what we support."""
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isdir(path):
        raise _bad(path, "no such adapter directory.")
    if not os.path.isfile(config_path):
        raise _bad(path, f"{CONFIG_NAME} not found (a PEFT adapter directory holds it).")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise _bad(path, f"{CONFIG_NAME} is not valid JSON ({error}).") from None
    if not isinstance(config, dict):
        raise _bad(path, f"{CONFIG_NAME} must hold a JSON object.")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _bad(path, f"peft_type {peft_type!r} is not supported; only LORA adapters are.")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _bad(path, f"r must be a positive integer, got {rank!r}.")
    if rank > lora_config.max_lora_rank:
        raise _bad(path, f"r ({rank}) is above max_lora_rank ({lora_config.max_lora_rank}); raise max_lora_rank.")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _bad(path, f"lora_alpha must be a number, got {alpha!r}.")
    if config.get("modules_to_save"):
        raise _bad(path, f"modules_to_save ({config['modules_to_save']!r}) is not supported: only LoRA deltas on "
                         "the projections are served, not replaced modules.")
    for name, allowed in (("bias", ("none", None)), ("use_dora", (False, None)), ("fan_in_fan_out", (False, None)),
                          ("rank_pattern", ({}, None)), ("alpha_pattern", ({}, None))):
        if config.get(name) not in allowed:
            raise _bad(path, f"{name}={config[name]!r} is not supported (only {allowed[0]!r}).")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise _bad(path, f"target_modules {unknown} do not exist in this model (supported: "
                             f"{', '.join(TARGET_MODULES)}).")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scaling))


def _weights_path(path: str) -> str:
    weights = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights):
        raise _bad(path, f"{WEIGHTS_NAME} not found (only safetensors adapters are read).")
    return weights


def _check_tensor(path: str, key: str, shape: list[int], rank: int, model_config: ModelConfig) -> tuple[int, str, str]:
    match = _KEY.match(key)
    if match is None:
        raise _bad(path, f"tensor {key!r} is not a LoRA A/B weight of a decoder-layer projection "
                         f"(target_modules supported: {', '.join(TARGET_MODULES)}).")
    layer, module, which = int(match.group(1)), match.group(2), match.group(3)
    if module not in TARGET_MODULES:
        raise _bad(path, f"target_modules: {module!r} (tensor {key!r}) does not exist in this model (supported: "
                         f"{', '.join(TARGET_MODULES)}).")
    if layer >= model_config.num_hidden_layers:
        raise _bad(path, f"tensor {key!r}: layer {layer} does not exist (the model has "
                         f"{model_config.num_hidden_layers}).")
    out_features, in_features = projection_shapes(model_config)[module]
    expected = [rank, in_features] if which == "A" else [out_features, rank]
    if list(shape) != expected:
        raise _bad(path, f"tensor {key!r} has shape {list(shape)}, expected {expected} (r={rank}).")
    return layer, module, which


def validate_adapter(path: str, lora_config: LoRAConfig, model_config: ModelConfig) -> AdapterConfig:
    """Everything load_adapter checks, from the config and the safetensors header only (no weights read):
    what the API process runs before a request reaches the engine."""
    from safetensors import safe_open

    adapter = read_adapter_config(path, lora_config)
    try:
        with safe_open(_weights_path(path), framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                _check_tensor(path, key, f.get_slice(key).get_shape(), adapter.rank, model_config)
    except ValueError:
        raise
    except Exception as error:  # a truncated or foreign file
        raise _bad(path, f"{WEIGHTS_NAME} cannot be read ({error}).") from None
    if not keys:
        raise _bad(path, f"{WEIGHTS_NAME} holds no LoRA weights.")
    return adapter


def load_adapter(lora_int_id: int, name: str, path: str, lora_config: LoRAConfig, model_config: ModelConfig,
                 dtype: torch.dtype) -> LoRAModel:
    """The adapter's A and B per (layer, module), checked as validate_adapter does, in `dtype`."""
    from safetensors.torch import load_file

    adapter = validate_adapter(path, lora_config, model_config)
    tensors = load_file(_weights_path(path))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, which = _check_tensor(path, key, list(tensor.shape), adapter.rank, model_config)
        if not tensor.dtype.is_floating_point:
            raise _bad(path, f"tensor {key!r} has dtype {tensor.dtype}; LoRA weights are floating point.")
        halves.setdefault((layer, module), {})[which] = tensor.to(dtype).contiguous()
    model = LoRAModel(lora_int_id, name, adapter.rank, adapter.scaling)
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _bad(path, f"layer {layer} {module}: lora_A and lora_B must both be present.")
        model.weights[(layer, module)] = (pair["A"], pair["B"])
    return model
