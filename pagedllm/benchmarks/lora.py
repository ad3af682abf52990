"""Multi-LoRA for `pagedllm bench throughput --lora-modules NAME=PATH ...` (or `--num-random-loras N`):
the same requests through the plain base model and then spread round-robin over the adapters, in one run,
with each adapter's load time and bytes in memory.

`--num-random-loras N` writes N PEFT-format adapters (adapter_config.json + adapter_model.safetensors, every
q/k/v/o and gate/up/down projection, rank --lora-rank, seeded random A and small nonzero B, in the model's
dtype) to a temporary directory, so the benchmark needs nothing but the base model.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedllm.lora.peft import CONFIG_NAME, TARGET_MODULES, WEIGHTS_NAME, projection_shapes
from pagedllm.lora.request import LoRARequest


@dataclass
class AdapterLoad:
    name: str
    rank: int
    load_s: float           # reading and checking it into the engine's CPU cache (off the step's path)
    file_tensor_bytes: int  # its tensors' bytes in adapter_model.safetensors
    memory_bytes: int       # its tensors' bytes as the engine holds them (the LoRA dtype)


def write_random_adapter(model_config: Any, path: str, rank: int, seed: int, dtype: torch.dtype) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module, (out_features, in_features) in projection_shapes(model_config).items():
            owner = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{owner}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_features, generator=generator)
                                               / in_features ** 0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator) * 0.01).to(dtype)
    save_file(tensors, os.path.join(path, WEIGHTS_NAME))
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
                   "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "modules_to_save": None}, f)
    return path


def parse_modules(values: list[str] | None) -> list[tuple[str, str]]:
    modules = []
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {value!r} must be NAME=PATH.")
        modules.append((name, path))
    return modules


def load_adapters(llm: Any, modules: list[tuple[str, str]]) -> tuple[list[LoRARequest], list[AdapterLoad]]:
    """Each adapter read into the engine (timed), and its bytes on disk and in memory."""
    from safetensors import safe_open

    engine = llm.llm_engine
    manager = engine.model_runner.lora_manager
    requests, loads = [], []
    for index, (name, path) in enumerate(modules):
        request = LoRARequest(name, index + 1, path)
        start = time.perf_counter()
        engine.input_processor.validate_lora(request)
        engine.engine_core.add_lora(request)
        load_s = time.perf_counter() - start
        with safe_open(os.path.join(path, WEIGHTS_NAME), framework="pt") as f:
            file_bytes = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
        model = manager.cpu_loras[request.lora_int_id] if manager is not None else None
        loads.append(AdapterLoad(name, model.rank if model else 0, load_s, file_bytes,
                                 model.nbytes if model else 0))
        requests.append(request)
    return requests, loads


def format_loads(loads: list[AdapterLoad], slot_bytes: int) -> str:
    lines = [f"{'adapter':<16} {'r':>4} {'load s':>8} {'file tensor bytes':>18} {'bytes in memory':>16}"]
    for load in loads:
        lines.append(f"{load.name:<16} {load.rank:>4} {load.load_s:>8.3f} {load.file_tensor_bytes:>18,} "
                     f"{load.memory_bytes:>16,}")
    lines.append(f"device slots (max_loras x max_lora_rank, allocated once): {slot_bytes:,} bytes")
    return "\n".join(lines)


def loads_report(loads: list[AdapterLoad], slot_bytes: int) -> dict[str, Any]:
    return {"adapters": [asdict(load) for load in loads], "slot_bytes": slot_bytes}


def read_rank(path: str) -> int:
    """An adapter's r from its adapter_config.json (0 if unreadable: the engine's check names the problem)."""
    try:
        with open(os.path.join(path, CONFIG_NAME)) as f:
            return int(json.load(f).get("r", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0
