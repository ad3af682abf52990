"""Weight-only quantization: the config, the method interface and the quantized weight (vLLM's shape:
a QuantizationConfig names a method; the method quantizes a weight and applies it to activations).

Only weights are quantized; activations and outputs stay in the model dtype (W8A16). A quantized
weight is a small module holding `qweight` [N, K] and `scales` ([N] per output channel, or
[N, K / group_size] per group), so `.to(device)`, `parameters()` and the weight-size accounting see it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.module import Module

QUANTIZATION_METHODS = ("int8", "fp8", "int4")
GROUPED_METHODS = ("int8", "int4")  # methods with per-group scales (fp8: per output channel)


@dataclass
class QuantizationConfig:
    """Which method quantizes the linear projections, and how.

    `method` is "int8" (symmetric integer, 127 levels either side), "fp8" (float8_e4m3fn) or "int4"
    (16 levels with a scale and an offset per group, group 128 unless given). Scales are per output
    channel, or per group of `group_size` input channels (int8, int4). `from_checkpoint` is
    True when the checkpoint already holds quantized tensors (compressed-tensors layout), False when
    full-precision weights are quantized as they load.
    """

    method: str
    group_size: int | None = None
    from_checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)} (or None), "
                             f"got {self.method!r}.")
        if self.method == "int4" and self.group_size is None:
            self.group_size = 128  # int4 is always grouped: 16 levels per row would lose too much
        if self.group_size is not None:
            if self.method not in GROUPED_METHODS:
                raise ValueError(f"quantization_group_size applies to quantization in {list(GROUPED_METHODS)} "
                                 f"only; {self.method} scales are per output channel.")
            if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 1:
                raise ValueError(f"quantization_group_size must be a positive integer, got {self.group_size!r}.")
            if self.method == "int4":
                from pagedllm.layers.quantization.int4 import GROUP_SIZES

                if self.group_size not in GROUP_SIZES:
                    raise ValueError(f"quantization_group_size for int4 must be one of {list(GROUP_SIZES)}, "
                                     f"got {self.group_size}.")

    def get_method(self) -> QuantizationMethod:
        if self.method == "int8":
            from pagedllm.layers.quantization.int8 import Int8WeightOnlyMethod

            return Int8WeightOnlyMethod(self.group_size)
        if self.method == "int4":
            from pagedllm.layers.quantization.int4 import Int4WeightOnlyMethod

            return Int4WeightOnlyMethod(self.group_size)
        from pagedllm.layers.quantization.fp8 import Fp8WeightOnlyMethod

        return Fp8WeightOnlyMethod()


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """w = q * scale (+ offset) in fp32, one scale (and offset) per group of input channels: q [N, K]
    integers, scale and offset [N, K / G]. Each product and sum is one fp32 rounding, as llama.cpp's
    reference dequantization of the GGUF types that store q, a scale and a min computes them."""
    n, k = q.shape
    groups = scale.shape[1]
    w = q.to(torch.float32).view(n, groups, k // groups) * scale.to(torch.float32).unsqueeze(-1)
    if offset is not None:
        w = w + offset.to(torch.float32).unsqueeze(-1)
    return w.view(n, k)


class QuantizedWeight(Module):
    """A quantized [N, K] weight: `qweight` (int8 or float8_e4m3fn) and `scales`, both frozen."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, method: QuantizationMethod):
        super().__init__()
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.method = method

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in (self.qweight, self.scales))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.method.dequantize(self, dtype)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """The part a tensor-parallel rank keeps, scales sharded with their channels: output rows
        (dim 0, column-parallel) take their scales; input columns (dim 1, row-parallel) keep per-channel
        scales whole and take their groups' scales (ValueError unless start and length fall on group boundaries)."""
        qweight = self.qweight.narrow(dim, start, length).contiguous()
        scales = self.scales
        if dim == 0:
            scales = scales.narrow(0, start, length)
        elif scales.dim() == 2:
            group = self.qweight.shape[1] // scales.shape[1]
            if start % group or length % group:
                raise ValueError(f"a tensor-parallel shard must hold whole quantization groups of {group} input "
                                 f"features, got [{start}, {start + length}).")
            scales = scales.narrow(1, start // group, length // group)
        return QuantizedWeight(qweight, scales.contiguous(), self.method)

    def extra_repr(self) -> str:
        return f"{self.method.name}, shape={tuple(self.qweight.shape)}, scales={tuple(self.scales.shape)}"


class QuantizationMethod(ABC):
    """How one kind of quantized weight is made and multiplied. One instance per model: it owns the
    scratch buffer its dequantizing kernels write into (layers run one after another, so they share it,
    and a preallocated buffer avoids the page faults a fresh weight-sized tensor costs every call)."""

    name: str = ""
    storage_dtype: torch.dtype = torch.int8

    def __init__(self) -> None:
        self._workspace: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    @abstractmethod
    def quantize(self, weight: torch.Tensor, scale_dtype: torch.dtype) -> QuantizedWeight:
        """Quantize a full-precision [N, K] weight; scales are stored in `scale_dtype` (the model's)."""

    @abstractmethod
    def apply(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] in the model dtype -> [M, N], the fastest correct kernel for this device."""

    def dequantize(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: the full-precision weight the quantized one stands for, computed in fp32."""
        q = weight.qweight.to(torch.float32)
        scales = weight.scales.to(torch.float32)
        if scales.dim() == 2 and scales.shape[1] > 1:  # per group: [N, K / G]
            n, k = q.shape
            q = (q.view(n, scales.shape[1], -1) * scales.unsqueeze(-1)).view(n, k)
        else:
            q = q * scales.view(-1, 1)
        return q.to(dtype)

    def apply_reference(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantize(weight, x.dtype), bias)

    def workspace(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        buf = self._workspace.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._workspace[key] = buf
        return buf[:numel]

    def check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ValueError when this device cannot run the method."""
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"quantization={self.name!r} runs on cpu or cuda, not {device.type}; "
                             f"allowed values: {list(QUANTIZATION_METHODS)} or None.")
