"""RMSNorm with the reference implementation's rounding: normalize in float32, cast back, then scale.

Given the residual stream as well, it first adds the block's output to it (vLLM's fused_add_rms_norm):
on CPU one C++ call does the add and the norm in place (pagedllm/layers/csrc/cpu_layers.cpp), where
torch takes five ops for a 16-bit model. Without a residual (the first layer's input) a C++ call does
the norm alone: torch's F.rms_norm is six ops even in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    # forward(x, residual=None) -> norm(x); or, with the residual stream, (norm(x + residual), x + residual)
    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return torch_rms_norm(x, self.weight, self.eps)
        residual = x + residual
        return torch_rms_norm(residual, self.weight, self.eps), residual

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As forward_native, taking x and residual over in place where the layout allows."""
        if residual is None:
            return self._norm_cpu(x)
        if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
            torch.ops.pagedllm_cpu_layers.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm_cpu(residual), residual

    def _norm_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1 and x.dtype == self.weight.dtype:
            return torch.ops.pagedllm_cpu_layers.rms_norm(x, self.weight, self.eps)
        return torch_rms_norm(x, self.weight, self.eps)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference rounding in torch ops (what the C++ ops match)."""
    shape = (x.shape[-1],)
    if x.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)  # one fused op, bit-exact in fp32
    return weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)
