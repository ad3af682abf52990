"""Gated activations: the MLP's gate and up projections arrive fused in one tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def get_act_and_mul(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}.")
    act = _ACTIVATIONS[name]

    def act_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return act_and_mul
