"""Gated activations: the MLP's gate and up projections arrive fused in one tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.cpu_kernels import cpu_ops_available

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def get_act_and_mul(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}.")
    act = _ACTIVATIONS[name]

    def act_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if name == "silu" and gate_up.dim() == 2 and gate_up.stride(1) == 1 and cpu_ops_available(gate_up):
            # One pass over memory instead of three (pagedllm/layers/csrc/cpu_layers.cpp: silu_and_mul).
            return torch.ops.pagedllm_cpu_layers.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return act_and_mul
