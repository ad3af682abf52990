"""fp8 weight-only quantization (W8A16): float8_e4m3fn weights with one scale per output channel.

On CUDA the weight is cast to the model dtype and multiplied (the cast is native there; untested in this
project: no GPU). `torch._scaled_mm` is not used: it multiplies fp8 by fp8, so it would quantize the
activations too, and on CPU it ran at about 0.08 GFLOP/s.

On CPU torch's float8 -> bf16 cast is scalar code (0.15-0.37 Gelem/s measured), which would make every
decode step several times slower than bf16. The cast is done with integer ops instead, which torch
vectorizes (9-16 Gelem/s each): an e4m3fn byte s.eeee.mmm read as int8 and sign-extended to int16, shifted
left by 4 and masked with 0x87F0, is the bf16 bit pattern s.0000eeee.mmm0000, i.e. the same value times
2**-120 (the exponent biases are 7 and 127), subnormals included. Multiplying by scale * 2**120 in the same
pass gives the dequantized weight. Four vectorized passes into a preallocated buffer (about 2.6 Gelem/s
together), then a bf16 matmul: fp8 halves the weights' memory here, but at batch 1 on CPU it decodes
slower than bf16 (see the quantization benchmark); it pays off with batch and on GPUs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.quantization.base import QuantizationMethod, QuantizedWeight

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448; e4m3fn saturates there rather than overflowing to inf
_BF16_BITS_MASK = -30736  # 0x87F0 as int16: the sign bit and the 7 bits of exponent and mantissa
_EXPONENT_REBIAS = 2.0 ** 120  # 2 ** (127 - 7)


def fp8_bits_to_bf16(qweight: torch.Tensor, out_bits: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [N, K] -> bf16 [N, K] equal to the fp8 values times 2**-120, written into the int16
    buffer `out_bits` and returned as its bf16 view."""
    out_bits.copy_(qweight.view(torch.int8))
    out_bits.bitwise_left_shift_(4)
    out_bits.bitwise_and_(_BF16_BITS_MASK)
    return out_bits.view(torch.bfloat16)


class Fp8WeightOnlyMethod(QuantizationMethod):
    name = "fp8"
    storage_dtype = FP8_DTYPE

    def quantize(self, weight: torch.Tensor, scale_dtype: torch.dtype) -> QuantizedWeight:
        w = weight.detach().to(torch.float32)
        absmax = w.abs().amax(1)
        # Scales in fp32: compressed-tensors stores fp8 channel scales as float32, and the CPU kernel
        # folds 2**120 into them, which the model dtype could not hold for fp16.
        scales = (absmax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        q = (w / scales.view(-1, 1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return QuantizedWeight(q, scales, self)

    def apply(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = weight.qweight.shape
        x2 = x.reshape(-1, k)
        scales = weight.scales.view(-1, 1)
        if x.device.type == "cpu":
            bits = self.workspace(n * k, torch.int16, x.device).view(n, k)
            w = fp8_bits_to_bf16(weight.qweight, bits)
            if x.dtype == torch.bfloat16:
                w.mul_((scales * _EXPONENT_REBIAS).to(torch.bfloat16))
            else:
                out = self.workspace(n * k, x.dtype, x.device).view(n, k)
                w = torch.mul(w, scales * _EXPONENT_REBIAS, out=out) if x.dtype == torch.float32 else \
                    torch.mul(w.float(), scales * _EXPONENT_REBIAS).to(x.dtype)
        else:
            w = weight.qweight.to(x.dtype) * scales.to(x.dtype)
        y = F.linear(x2, w, bias)
        return y.view(*x.shape[:-1], n)
