"""Gated activations: the MLP's gate and up projections arrive fused in one tensor."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.layers.custom_op import CustomOp

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def get_act_and_mul(name: str) -> ActAndMul:
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}.")
    return ActAndMul(name)


class ActAndMul(CustomOp):
    """act(gate) * up of the fused [..., 2 * I] gate_up projection."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.act = _ACTIVATIONS[name]

    def dispatch(self, x: torch.Tensor) -> Callable[..., torch.Tensor]:
        # only silu has a fused kernel
        return super().dispatch(x) if self.name == "silu" else ActAndMul.forward_native

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and gate_up.stride(1) == 1:
            # One pass over memory instead of three (pagedllm/layers/csrc/cpu_layers.cpp: silu_and_mul).
            return torch.ops.pagedllm_cpu_layers.silu_and_mul(gate_up)
        return self.forward_native(gate_up)
