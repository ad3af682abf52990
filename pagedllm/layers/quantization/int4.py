"""int4 weight-only quantization (W4A16): 4-bit integers with a scale and an offset per group of input
channels, w = q * scale + offset, q in 0..15 (GGUF Q4_0 / Q4_1 / Q4_K and asymmetric or symmetric
group quantization all take this form).

Two kernels, chosen per model after loading (layers/quantization/vnni.py, select_quantized_kernels: by
the measured kernel table, or PAGEDLLM_QUANT_KERNEL):
- pagedllm's VNNI kernel (layers/csrc/cpu_quant_linear.cpp), on CPUs with AVX512-VNNI, for bf16 and fp16
  models: activations quantized to int8 per row in blocks of up to 128, integer dot products, the scales and
  offsets kept exact (its bound is in vnni.py). Where it runs, `create` builds that weight (VnniWeight);
  fp32 models keep that weight on any CPU with AVX2 and FMA, multiplied in fp32 (qlinear_fp32, vnni.py).
- torch's own CPU int4 GEMM (`_weight_int4pack_mm_for_cpu`, on the layout
  `_convert_weight_to_int4pack_for_cpu` makes), elsewhere (AVX2-only CPUs) or when the table picks it.
  It computes (q - 8) * scale + zero per group with fp32 accumulation on bf16 activations (its
  fp32-activation variant is scalar code, tens of times slower), and stores `scales_and_zeros` in bf16.
  Error against the fp32 reference (q * scale + offset exactly, times x, in fp32): the scale and the zero
  (offset + 8 * scale) are each rounded to bf16 once (relative 2**-9), so each weight is off by at most
  2**-9 * (|q - 8| * |scale| + |zero|), and the bf16 output adds its own rounding (2**-9 relative);
  tests/test_int4.py checks exactly that bound.
The weights stay 4 bits plus a scale and an offset per group.
"""

from __future__ import annotations

import functools

import torch

from pagedllm.layers.quantization.base import QuantizationMethod, QuantizedWeight
from pagedllm.layers.quantization.vnni import VnniWeight, kernel_enabled, kernel_supports

INT4_LEVELS = 16
INT4_ZERO = 8  # the kernel's q - 8
KERNEL_DTYPE = torch.bfloat16
GROUP_SIZES = (32, 64, 128, 256)  # groups the kernel accepts (and K must hold whole groups)
OUT_FEATURES_MULTIPLE = 16  # the packing's unit of output features


def int4_supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the kernel takes an [out_features, in_features] weight with this group size."""
    return (group_size in GROUP_SIZES and in_features % group_size == 0
            and out_features % OUT_FEATURES_MULTIPLE == 0)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (integers 0..15) -> the kernel's packed uint8 layout."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


@functools.lru_cache(maxsize=2)  # int64 per weight: kept for the shape at hand only
def _nibble_sources(n: int, k: int) -> torch.Tensor:
    """For each nibble of pack_int4's output (byte i low, byte i high, ...), the flat index n * K + k of
    the weight it holds: found by packing the indices themselves, 4 bits per pass (the layout depends
    on the CPU build torch dispatched to, so it is asked rather than restated)."""
    index = torch.arange(n * k, dtype=torch.int64)
    sources = torch.zeros(n * k, dtype=torch.int64)
    for shift in range(0, max(1, (n * k - 1).bit_length()), 4):
        packed = pack_int4(((index >> shift) & 15).view(n, k)).view(-1)
        nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).view(-1).to(torch.int64)
        sources |= nibbles << shift
    return sources


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_int4's inverse: uint8 integers 0..15, [N, K]."""
    nibbles = torch.stack([packed.view(-1) & 15, packed.view(-1) >> 4], dim=-1).view(-1)
    q = torch.empty(n * k, dtype=torch.uint8)
    q[_nibble_sources(n, k)] = nibbles
    return q.view(n, k)


def quantize_groups(weight: torch.Tensor, group_size: int,
                    scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization with integer zero points, as compressed-tensors and GPTQ store it:
    w ~ (q - 8 - zero_point) * scale, q in 0..15 (uint8 [N, K]), scale [N, K / G] in `scale_dtype`,
    zero_point in -8..7 (int8 [N, K / G]); q is chosen against the scale as stored."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if not int4_supports(n, k, group_size):
        fits = next((g for g in (128, 64, 32) if g < group_size and int4_supports(n, k, g)), None)
        raise ValueError(f"quantization='int4' needs weights whose input size is a multiple of "
                         f"quantization_group_size={group_size} and whose output size is a multiple of "
                         f"{OUT_FEATURES_MULTIPLE}; got a [{n}, {k}] weight"
                         + (f" (quantization_group_size={fits} fits it)." if fits else "."))
    groups = w.view(n, k // group_size, group_size)
    low = groups.amin(-1).clamp(max=0)  # the range holds 0, so an all-positive group keeps zero exact
    high = groups.amax(-1).clamp(min=0)
    scales = ((high - low) / (INT4_LEVELS - 1)).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    s = scales.to(torch.float32)
    zero_points = torch.round(-low / s).sub_(INT4_ZERO).clamp_(-INT4_ZERO, INT4_ZERO - 1)
    q = torch.round(groups / s.unsqueeze(-1)) + (zero_points + INT4_ZERO).unsqueeze(-1)
    q = q.clamp_(0, INT4_LEVELS - 1).to(torch.uint8).view(n, k)
    return q, scales, zero_points.to(torch.int8)


class Int4Weight(QuantizedWeight):
    """`qweight`: the kernel's packed bytes; `scales`: scales_and_zeros [K / G, N, 2] in bf16."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, method: QuantizationMethod, in_features: int):
        super().__init__(qweight, scales, method)
        self.in_features = in_features

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.scales.shape[1], self.in_features))

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[0]

    def unpacked(self) -> torch.Tensor:
        n, k = self.shape
        return unpack_int4(self.qweight.data, n, k)

    def narrow(self, dim: int, start: int, length: int) -> Int4Weight:
        """Output rows (dim 0) or whole groups of input columns (dim 1), repacked."""
        q = self.unpacked().narrow(dim, start, length)
        scales = self.scales.data
        if dim == 0:
            scales = scales.narrow(1, start, length)
        else:
            group = self.group_size
            if start % group or length % group:
                raise ValueError(f"a tensor-parallel shard must hold whole quantization groups of {group} input "
                                 f"features, got [{start}, {start + length}).")
            scales = scales.narrow(0, start // group, length // group)
        return Int4Weight(pack_int4(q), scales.contiguous(), self.method, q.shape[1])

    def extra_repr(self) -> str:
        return f"int4, shape={tuple(self.shape)}, group_size={self.group_size}"


class Int4WeightOnlyMethod(QuantizationMethod):
    name = "int4"
    storage_dtype = torch.uint8

    def __init__(self, group_size: int | None = None):
        super().__init__()
        self.group_size = 128 if group_size is None else group_size

    def create(self, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> Int4Weight | VnniWeight:
        """The weight w = q * scales + offsets per group: q [N, K] integers 0..15, scales and offsets
        [N, K / G] in fp32 (exact for GGUF's fp16 block scales), for a model in `dtype`. Where pagedllm's
        VNNI kernel runs for it, its weight (scales and offsets kept exact); else torch's layout (rounded
        to bf16 here, once)."""
        n, k = q.shape
        groups = scales.shape[1]
        if kernel_enabled(dtype) and kernel_supports(n, k, k // groups, 4):
            return VnniWeight.from_logical(q, scales, offsets, 4, self)
        return self.create_torch_layout(q, scales, offsets)

    def create_torch_layout(self, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> Int4Weight:
        """create's weight for torch's kernel, whatever the CPU."""
        n, k = q.shape
        groups = scales.shape[1]
        assert k % groups == 0 and int4_supports(n, k, k // groups), (n, k, groups)
        scales = scales.to(torch.float32)
        zeros = offsets.to(torch.float32) + INT4_ZERO * scales
        scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
        return Int4Weight(pack_int4(q), scales_and_zeros, self, k)

    def quantize(self, weight: torch.Tensor, scale_dtype: torch.dtype) -> Int4Weight | VnniWeight:
        """Asymmetric min/max quantization per group of `group_size` input channels (quantize_groups)."""
        q, scales, zero_points = quantize_groups(weight, self.group_size, scale_dtype)
        s = scales.to(torch.float32)
        return self.create(q, s, -(INT4_ZERO + zero_points.to(torch.float32)) * s, scale_dtype)

    def dequantize(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if isinstance(weight, VnniWeight):
            return weight.dequantize(dtype)
        assert isinstance(weight, Int4Weight)
        n, k = weight.shape
        q = weight.unpacked().to(torch.float32).view(n, -1, weight.group_size) - INT4_ZERO
        scales, zeros = weight.scales.to(torch.float32).permute(2, 1, 0)  # each [N, K / G]
        return (q * scales.unsqueeze(-1) + zeros.unsqueeze(-1)).view(n, k).to(dtype)

    def apply(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(weight, VnniWeight):
            return weight.apply(x, bias)
        assert isinstance(weight, Int4Weight)
        n, k = weight.shape
        x2 = x.reshape(-1, k)
        if x2.dtype != KERNEL_DTYPE:  # not reached from GGUF files (fp32/fp16 models dequantize them)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(KERNEL_DTYPE).contiguous(), weight.qweight,
                                                           weight.group_size, weight.scales).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), weight.qweight, weight.group_size,
                                                           weight.scales)
        if bias is not None:
            y.add_(bias)
        return y.view(*x.shape[:-1], n)

    def check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        if device.type != "cpu":
            raise ValueError(f"quantization='int4' runs on cpu only (torch's CPU int4 kernel), not {device.type}.")
