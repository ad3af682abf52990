"""RMSNorm with the reference implementation's rounding: normalize in float32, cast back, then scale.

Given the residual stream as well, it first adds the block's output to it (vLLM's fused_add_rms_norm):
on CPU one C++ call does the add and the norm in place (pagedllm/layers/csrc/cpu_layers.cpp), where
torch takes five ops for a 16-bit model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.cpu_kernels import cpu_ops_available


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, with the residual stream, (norm(x + residual), x + residual), taking x and
        residual over in place where it can."""
        if residual is None:
            return self._norm(x)
        if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and cpu_ops_available(x):
            torch.ops.pagedllm_cpu_layers.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)  # one fused op, bit-exact in fp32
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
