"""Load a local Hugging Face checkpoint (safetensors, single file or sharded) into our own layers."""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import torch
from safetensors import safe_open

from pagedllm.attention.backend import AttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.models.registry import get_model_class


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, shard) for shard in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise ValueError(f"model directory {model_dir!r} has no .safetensors weights.")
    return [os.path.join(model_dir, f) for f in found]


def load_model(config: ModelConfig, backend: AttentionBackend, device: torch.device,
               tp_rank: int = 0, tp_size: int = 1) -> torch.nn.Module:
    """The model with this rank's shard of every weight; only that shard is read from the files."""
    model_class = get_model_class(config.architecture)
    model = model_class(config, backend, tp_rank, tp_size)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(path, framework="pt")) for path in
                   _safetensors_files(config.model)]
        where = {name: handle for handle in handles for name in handle.keys()}

        def get_slice(name: str):
            if name not in where:
                raise ValueError(f"checkpoint {config.model!r} lacks weight {name!r}.")
            return where[name].get_slice(name)

        with torch.no_grad():
            model.load_weights(get_slice, set(where))
    return model.to(device).eval()
