"""The quantized weights' fp32 op (layers/csrc/cpu_quant_linear.cpp, qlinear_fp32): fp32 activations times
4- to 8-bit weights in every scale encoding the loaders build (fp32, fp16, GGUF K-quants' int8 scales with
fp16 super-block factors; symmetric or with mins), against the dequantized weight's product in float64, and
each row's result the same whatever rows share its call."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.quantization.int4 import Int4WeightOnlyMethod
from pagedllm.layers.quantization.int8 import Int8WeightOnlyMethod
from pagedllm.layers.quantization.vnni import VnniWeight, kernel_enabled

pytestmark = pytest.mark.skipif(not kernel_enabled(torch.float32), reason="no AVX2 + FMA + F16C (or kernels not built)")


def _method(bits: int, group: int):
    return Int4WeightOnlyMethod(group) if bits == 4 else Int8WeightOnlyMethod(group)


def _logical(bits: int, n: int, k: int, group: int, symmetric: bool, half: bool, seed: int) -> VnniWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    offset = -(1 << (bits - 1)) * scale if symmetric else torch.randn(n, k // group, generator=gen) * 0.05
    if half:  # exact in fp16: stored so
        scale, offset = scale.half().float(), offset.half().float()
    return VnniWeight.from_logical(q, scale, offset, bits, _method(bits, group))


def _k_quant(bits: int, n: int, k: int, group: int, symmetric: bool, seed: int) -> VnniWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=gen)
    sc = torch.randint(0, 63, (n, k // group), dtype=torch.int8, generator=gen)
    m = None if symmetric else torch.randint(0, 63, (n, k // group), dtype=torch.int8, generator=gen)
    d = (torch.rand(n, k // 256, generator=gen) * 0.01).half()
    neg_dmin = None if symmetric else -(torch.rand(n, k // 256, generator=gen) * 0.01).half()
    return VnniWeight.from_k_quant(q, sc, m, d, neg_dmin, bits, _method(bits, group))


WEIGHTS = {
    "int4-g32-mins-fp32": lambda: _logical(4, 48, 256, 32, False, False, 0),
    "int4-g128-symmetric-fp16": lambda: _logical(4, 32, 512, 128, True, True, 1),
    "int5-g32-mins-fp16": lambda: _logical(5, 48, 256, 32, False, True, 2),
    "int6-g16-symmetric-fp32": lambda: _logical(6, 16, 256, 16, True, False, 3),
    "int8-g32-symmetric-fp16 (Q8_0)": lambda: _logical(8, 32, 256, 32, True, True, 4),
    "int8-channel-symmetric": lambda: _logical(8, 64, 384, 384, True, False, 5),
    "Q4_K": lambda: _k_quant(4, 32, 512, 32, False, 6),
    "Q5_K": lambda: _k_quant(5, 16, 256, 32, False, 7),
    "Q6_K": lambda: _k_quant(6, 32, 512, 16, True, 8),
}


@pytest.mark.parametrize("name", WEIGHTS)
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_equals_the_dequantized_product_up_to_fp32_rounding(name: str, rows: int) -> None:
    weight = WEIGHTS[name]()
    n, k = weight.shape
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, k + 8, generator=gen)
    x = wide[:, 3:k + 3]  # rows with a stride longer than K
    bias = torch.randn(n, generator=gen)
    y = weight.apply(x, bias)
    w = weight.dequantize(torch.float64)
    want = x.double() @ w.T + bias.double()
    # a few fp32 roundings of the terms summed: |x| |q * scale| and |x| |min| apart (they may cancel)
    q, scale, offset = weight.logical()
    terms = x.double().abs() @ (q.double() * scale.double().repeat_interleave(k // scale.shape[1], 1)).abs().T
    terms += x.double().abs() @ offset.double().abs().repeat_interleave(k // offset.shape[1], 1).T
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y.double() - want).abs() <= 1e-6 * (terms + bias.double().abs())).all()


@pytest.mark.parametrize("name", ["int4-g32-mins-fp32", "int8-channel-symmetric", "Q6_K"])
def test_a_rows_result_does_not_depend_on_its_batch(name: str) -> None:
    weight = WEIGHTS[name]()
    x = torch.randn(11, weight.shape[1], generator=torch.Generator().manual_seed(0))
    together = weight.apply(x, None)
    for size in (1, 2, 5):
        parts = torch.cat([weight.apply(x[i:i + size], None) for i in range(0, 11, size)])
        assert torch.equal(parts, together), size
