"""int8 weight-only quantization (W8A16): symmetric, per output channel or per group of input channels.

On CPUs with AVX512-VNNI, bf16 and fp16 models run these weights on pagedllm's VNNI kernel unless the
measured kernel table picks torch's (layers/quantization/vnni.py: repacked after loading as q + 128 with
min = -128 * scale, losslessly, so the loader, the checkpoint writer and narrow() see the int8 form
below); fp32 models run them on its fp32 op wherever AVX2 and FMA are (vnni.py). torch's kernels, which
serve the rest, measured on this project's CPUs (one thread, bf16 activations, the 386M Qwen2's shapes):
- `torch._weight_int8pack_mm` (int8 weights, per-channel scales, bf16/fp16/fp32 activations) reads half
  the bytes of a bf16 GEMV and ran 2-4.6x faster than bf16 `F.linear` at one token, 0.9-1.3x at 8,
  0.6-0.9x at 16, 0.5-0.6x at 32 and 0.45x at 128: a matrix-vector kernel, which computes each row the
  same whatever the number of rows. It serves every call it can take, prefill chunks included, although
  dequantizing would be faster past 16 rows: a switch at a row count would compute a row two ways, and a
  request's tokens would then depend on its batch (outputs must not). With bf16/fp16 activations it needs
  K % 16 == 0 (K = 24 gave inf, K = 5 crashed), so other shapes take the dequantizing path, always.
- Dequantize-then-matmul: an int8 -> bf16 copy (about 9.4 Gelem/s) into a preallocated buffer, the
  model-dtype matmul, and the scales applied to the output: for per-group scales, bf16/fp16 activations
  whose K is not a multiple of 16, and CUDA.
- Dequantizing in row chunks that stay in cache was slower still (0.2-0.8x bf16): many small matmuls.
On CUDA the dequantizing path is used (untested here: no GPU in this project's sessions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.quantization.base import QuantizationMethod, QuantizedWeight
from pagedllm.layers.quantization.vnni import VnniWeight

INT8_MAX = 127
_INT8PACK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Int8WeightOnlyMethod(QuantizationMethod):
    name = "int8"
    storage_dtype = torch.int8

    def __init__(self, group_size: int | None = None):
        super().__init__()
        self.group_size = group_size

    def quantize(self, weight: torch.Tensor, scale_dtype: torch.dtype) -> QuantizedWeight:
        w = weight.detach().to(torch.float32)
        n, k = w.shape
        if self.group_size is not None:
            if k % self.group_size:
                raise ValueError(f"quantization_group_size={self.group_size} does not divide a weight's "
                                 f"input size {k}.")
            absmax = w.view(n, k // self.group_size, self.group_size).abs().amax(-1)  # [N, K / G]
        else:
            absmax = w.abs().amax(1)  # [N]
        # Round the scale to the dtype it is stored in first, then quantize against that rounded scale,
        # so the stored pair (q, scale) is the best this grid can do.
        scales = (absmax / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
        s = scales.to(torch.float32)
        s = s.repeat_interleave(self.group_size, dim=1) if self.group_size is not None else s.view(-1, 1)
        q = torch.round(w / s).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return QuantizedWeight(q, scales, self)

    def _int8pack_ok(self, x: torch.Tensor, weight: QuantizedWeight) -> bool:
        if x.device.type != "cpu" or x.dtype not in _INT8PACK_DTYPES or weight.scales.dim() != 1:
            return False
        return x.dtype == torch.float32 or x.shape[1] % 16 == 0

    def dequantize(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if isinstance(weight, VnniWeight):
            return weight.dequantize(dtype)
        return super().dequantize(weight, dtype)

    def apply(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, VnniWeight):
            return weight.apply(x, bias)
        n, k = weight.qweight.shape
        x2 = x.reshape(-1, k)
        if self._int8pack_ok(x2, weight):
            scales = weight.scales if weight.scales.dtype == x.dtype else weight.scales.to(x.dtype)
            y = torch._weight_int8pack_mm(x2.contiguous(), weight.qweight, scales)
        else:
            buf = self.workspace(n * k, x.dtype, x.device).view(n, k)
            if weight.scales.dim() == 1:
                buf.copy_(weight.qweight)  # exact: |q| <= 127 fits any float dtype's mantissa
                y = F.linear(x2, buf)
                y.mul_(weight.scales.to(y.dtype))
            else:
                groups = weight.scales.shape[1]
                torch.mul(weight.qweight.view(n, groups, -1), weight.scales.unsqueeze(-1).to(x.dtype),
                          out=buf.view(n, groups, -1))
                y = F.linear(x2, buf)
        if bias is not None:
            y.add_(bias)
        return y.view(*x.shape[:-1], n)
