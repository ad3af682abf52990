"""The weight of pagedllm's own quantized CPU kernel (layers/csrc/cpu_quant_linear.cpp, AVX512-VNNI): 4-,
5-, 6- or 8-bit unsigned integers q with a scale and a min per group of input channels, w = q * scale + min.

Every integer weight format the engine reads is this form without loss: int4 groups (our checkpoints,
compressed-tensors W4A16, GGUF Q4_0 / Q4_1 / Q4_K), GGUF Q5_0 / Q5_1 / Q5_K (5 bits) and Q6_K (6 bits,
groups of 16) in as many bits as the file stores, and signed int8 (per channel or per group, GGUF Q8_0) as
q + 128 with min = -128 * scale. A symmetric weight (min = -2^(bits - 1) * scale, as Q4_0, Q5_0, Q6_K,
Q8_0 and signed int8 are) keeps no mins: the kernel forms them from the scales, so such a weight takes
the bytes its file does. The kernel's weight is built from the logical triple (q, scale, min) and gives
it back (`logical()`): tensor-parallel narrowing and dequantizing work on that triple, never on the
packed bytes.

The kernel quantizes each activation row in blocks (activation_block: 128 input channels where the
weight's K and groups allow, else 64 or 32) into two int8 terms, x^ = d * xq + d2 * xq2
(d = the block's absmax / 127, xq = round(x / d); xq2 the same for the remainder x - d * xq, so d2 <= d /
254: about 15 bits against the block's absmax; one int8 term alone, as llama.cpp's Q8_0, cost the real
SmolLM2-135M 1.5% of its teacher-forced top-1 tokens against fp32, but does half the integer products:
PAGEDLLM_QUANT_ACTIVATION_TERMS=1 chooses it, then d2 = 0 below), and multiplies in integers. Its
error bound per output y = sum_k w_k x_k, the same for every format since the weights are exact (fp32
scales and mins, or fp16 where every value is exactly one):
- against x^ times the weight (dequantize, then an exact matmul): the fp32 steps, at most K / 8 + 4
  roundings of 2**-24 relative to the terms the kernel sums, sum_k |x^_k| (q_k |scale| + |min|) (the min
  term is added apart from q * scale, so their cancellation counts), plus the output's rounding to the
  model dtype (2**-8 relative for bf16);
- against x itself: plus the activation rounding, sum over blocks b of d2_b / 2 * sum_{k in b} |w_k|.
tests/test_vnni_kernel.py checks both for every format against llama.cpp's and compressed-tensors'
dequantization.

fp32 models keep the same weights and run them through a second op of that file (qlinear_fp32, on any CPU
with AVX2, FMA and F16C): the activations are not quantized, each weight byte is widened to fp32, and per
group sum(q * x) * scale + min * sum(x) is added in one fixed order, so an output is the dequantized
weight's product up to fp32 rounding and a row's result does not depend on its batch
(tests/test_qlinear_fp32.py). torch's own weight-only kernels are scalar code for fp32 activations (on a
2-core AVX2 EPYC, 2 threads, a 4864 x 3584 int8 weight at batch 1: 11.8 ms in `_weight_int8pack_mm`, 0.86
ms in qlinear_fp32, 3.3 ms for the fp32 weight in F.linear), so fp32 models take no measurement between
them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pagedllm import envs, forward_context
from pagedllm.layers.module import Module
from pagedllm.layers.quantization.base import QuantizationMethod, QuantizedWeight, dequantize_groups

TILE = 16  # output features per tile: the kernel's unit, so N must be a multiple of it
BLOCK = 32  # the smallest activation quantization block: K must be a multiple of it
MAX_BLOCK = 128
KERNEL_CHOICES = ("auto", "pagedllm", "torch")


@functools.cache
def _kernel_built() -> bool:
    from pagedllm.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels() and bool(torch.ops.pagedllm_cpu_qlinear.qlinear_supports())


@functools.cache
def _fp32_kernel_built() -> bool:
    from pagedllm.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels() and bool(torch.ops.pagedllm_cpu_qlinear.qlinear_fp32_supports())


KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def kernel_enabled(dtype: torch.dtype | None = None) -> bool:
    """Whether weight-only int4 / int8 linears of a model in `dtype` keep this weight: not turned off by
    PAGEDLLM_QUANT_KERNEL=torch (which keeps torch's own int4 / int8 kernels), and its op built for the
    dtype: the integer one (AVX512-VNNI in the CPU's flags) for bf16 and fp16 models (and for None), the
    fp32 one (AVX2, FMA and F16C) for fp32 models, which stay exact up to fp32 rounding."""
    if dtype is not None and dtype not in KERNEL_DTYPES and dtype != torch.float32:
        return False
    choice = str(envs.value("PAGEDLLM_QUANT_KERNEL")).strip().lower()
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"PAGEDLLM_QUANT_KERNEL must be one of {list(KERNEL_CHOICES)}, got {choice!r}.")
    if choice == "torch":
        return False
    return _fp32_kernel_built() if dtype == torch.float32 else _kernel_built()


def activation_terms() -> int:
    """How many int8 terms each block of 32 activations is quantized into (PAGEDLLM_QUANT_ACTIVATION_TERMS):
    2 (default, about 15 bits: as faithful as bf16 activations) or 1 (llama.cpp's Q8_0: half the integer
    products, so faster batches and prefill, and about 8 bits)."""
    terms = str(envs.value("PAGEDLLM_QUANT_ACTIVATION_TERMS")).strip()
    if terms not in ("1", "2"):
        raise ValueError(f"PAGEDLLM_QUANT_ACTIVATION_TERMS must be 1 or 2, got {terms!r}.")
    return int(terms)


PROMPT_ROW_CHOICES = ("auto", "dense", "integer")


@functools.cache
def _dense_amx() -> bool:
    return bool(torch.ops.pagedllm_cpu_qlinear.qlinear_dense_supports(True))


def dense_prompt_rows(dtype: torch.dtype) -> bool:
    """Whether a bf16 model's prompt rows take the dense path (PAGEDLLM_QUANT_PROMPT_ROWS): each weight
    rounded to bf16 a block of 64 outputs at a time and multiplied as the blocked bf16 linear multiplies,
    on the AMX tiles where the CPU has them. There a 512-token prefill chunk multiplies at the bf16 tiles'
    speed, where the integer path's two activation terms cost as many tile products as bf16 plus the
    unpacking and the fp32 steps (docs/performance/intel-amx.md). `auto` takes it where the tiles are;
    without them the integer path stays until measured otherwise. Generated rows always take the
    integer path, so a row's arithmetic follows from its position alone (pagedllm/forward_context.py)."""
    choice = str(envs.value("PAGEDLLM_QUANT_PROMPT_ROWS")).strip().lower()
    if choice not in PROMPT_ROW_CHOICES:
        raise ValueError(f"PAGEDLLM_QUANT_PROMPT_ROWS must be one of {list(PROMPT_ROW_CHOICES)}, got {choice!r}.")
    if dtype != torch.bfloat16 or choice == "integer" or not kernel_enabled(dtype):
        return False
    dense_ops = bool(torch.ops.pagedllm_cpu_qlinear.qlinear_dense_supports(False))
    return dense_ops and (choice == "dense" or _dense_amx())


def has_vnni_weights(model: nn.Module) -> bool:
    """Whether any of the model's weights is this kernel's."""
    return any(isinstance(module, VnniWeight) for module in model.modules())


def describe_prompt_rows(dtype: torch.dtype) -> str:
    """How this kernel's prompt rows are multiplied, for the start-up line and the benchmarks."""
    if dtype == torch.float32:
        return "fp32 (activations not quantized, as generated rows)"
    if not dense_prompt_rows(dtype):
        return "integer (quantized activations, as generated rows)"
    return f"dense (weights rounded to bf16 per 64 outputs, {'AMX tiles' if _dense_amx() else 'VDPBF16PS'})"


def routes_prompt_rows(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the model's forward pass wants its prompt rows named (forward_context.use): it has weights of
    this kernel and their prompt rows take the dense path."""
    return dense_prompt_rows(dtype) and has_vnni_weights(model)


BITS = (4, 5, 6, 8)


def activation_block(in_features: int, group_size: int) -> int:
    """The kernel's activation quantization block for a weight of these input features and groups (its C++
    twin in cpu_quant_linear.cpp): the largest of 128, 64 and 32 that divides K and that the group divides
    or is a multiple of. Each integer partial sum spans min(block, group) channels and is scaled into fp32
    once, so longer blocks mean fewer rescales (with blocks of 32, a group of 128 took four)."""
    block = MAX_BLOCK
    while block > BLOCK and not (in_features % block == 0 and (group_size % block == 0 or block % group_size == 0)):
        block //= 2
    return block


def kernel_supports(out_features: int, in_features: int, group_size: int, bits: int) -> bool:
    """Whether the kernel takes an [out_features, in_features] weight with these groups."""
    groups_ok = group_size % BLOCK == 0 or group_size == 16
    return (bits in BITS and out_features % TILE == 0 and in_features % BLOCK == 0 and group_size > 0
            and in_features % group_size == 0 and groups_ok)


def _tiles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K / 4, 16, 4]: per tile of 16 features, 4 consecutive k per feature side by side."""
    n, k = q.shape
    return q.reshape(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3)


def _untile(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return tiles.reshape(n // TILE, k // 4, TILE, 4).permute(0, 2, 1, 3).reshape(n, k)


def pack_q(q: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] uint8 -> the kernel's (bytes, bit planes). 8-bit: the bytes per tile [K / 4][16][4], no
    planes. 4-, 5- and 6-bit: two such 64-byte vectors (k-quads 2t, 2t + 1) in one, low nibbles then high,
    and per tile [K / 8][bits - 4][2] 64-bit little-endian masks (plane p, k-quad 2t + h): bit i the bit
    4 + p of byte i of that k-quad's vector."""
    n, k = q.shape
    tiles = _tiles(q.to(torch.uint8))  # [T, K/4, 16, 4]
    if bits == 8:
        return tiles.contiguous().view(-1), torch.empty(0, dtype=torch.uint8)
    pairs = tiles.reshape(n // TILE, k // 8, 2, TILE * 4)  # [T, K/8, quad parity, 64 bytes]
    low = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).contiguous().view(-1)
    if bits == 4:
        return low, torch.empty(0, dtype=torch.uint8)
    planes = torch.stack([(pairs >> (4 + p)) & 1 for p in range(bits - 4)], dim=2)  # [T, K/8, P, 2, 64]
    bits_of_bytes = planes.view(*planes.shape[:-1], 8, 8)  # byte j of a mask holds bits 8j..8j+7
    masks = bits_of_bytes[..., 0].clone()
    for b in range(1, 8):  # in uint8 throughout: a model's largest table packs without a wider copy
        masks |= bits_of_bytes[..., b] << b
    return low, masks.contiguous().view(-1)


def unpack_q(packed: torch.Tensor, high: torch.Tensor, n: int, k: int, bits: int) -> torch.Tensor:
    """pack_q's inverse: [N, K] uint8."""
    if bits == 8:
        return _untile(packed, n, k)
    pairs = packed.view(n // TILE, k // 8, 1, TILE * 4)
    q = torch.cat([pairs & 15, pairs >> 4], dim=2)  # [T, K/8, quad parity, 64 bytes]
    if bits > 4:
        masks = high.view(n // TILE, k // 8, bits - 4, 2, 8, 1).to(torch.int32)
        planes = ((masks >> torch.arange(8, dtype=torch.int32)) & 1).view(n // TILE, k // 8, bits - 4, 2, TILE * 4)
        for p in range(bits - 4):
            q = q | (planes[:, :, p].to(torch.uint8) << (4 + p))
    return _untile(q, n, k)


def symmetric_min_factor(bits: int) -> int:
    """A symmetric weight's min over its scale: -2^(bits - 1) (q - 8 for 4 bits, q - 128 for 8)."""
    return -(1 << (bits - 1))


def pack_groups(values: torch.Tensor) -> torch.Tensor:
    """[N, K / G] -> [N / 16, K / G, 16]: a tile's 16 scales of a group side by side."""
    n, groups = values.shape
    return values.view(n // TILE, TILE, groups).transpose(1, 2).contiguous()


def unpack_groups(packed: torch.Tensor) -> torch.Tensor:
    tiles, groups, _ = packed.shape
    return packed.transpose(1, 2).reshape(tiles * TILE, groups)


def _storage_dtype(*values: torch.Tensor) -> torch.dtype:
    """fp16 where every value survives the round trip (GGUF's block scales do; half the bytes per group),
    else fp32."""
    for v in values:
        half = v.to(torch.float16)
        if not bool(torch.isfinite(half).all()) or not torch.equal(half.to(torch.float32), v):
            return torch.float32
    return torch.float16


class VnniWeight(QuantizedWeight):
    """`qweight`, `high`: pack_q's bytes and bit planes; `scales`, `mins`: [N / 16, K / G, 16] fp32 or fp16,
    `mins` empty for a symmetric weight; or, for GGUF's K-quants, int8 scales and mins with `super_scales`
    [N / 16, K / 256, 2, 16] fp16 (each super-block's d and -dmin: scale = sc * d, min = m * -dmin, exact
    in fp32). `method` is the method the weight belongs to (int4 or int8), which routes its `apply` here."""

    def __init__(self, qweight: torch.Tensor, high: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 bits: int, in_features: int, method: QuantizationMethod, super_scales: torch.Tensor | None = None):
        super().__init__(qweight, scales, method)
        self.high = nn.Parameter(high, requires_grad=False)
        self.mins = nn.Parameter(mins, requires_grad=False)
        if super_scales is None:
            super_scales = torch.empty(0, dtype=torch.float16)
        self.super_scales = nn.Parameter(super_scales, requires_grad=False)
        self.bits = bits
        self.in_features = in_features
        self.activation_terms = activation_terms()  # read once: every call of a model computes rows alike
        # plain ints for apply: a decode step calls it about a hundred times, and each Parameter read
        # through nn.Module.__getattr__ costs as much as a small matmul's arithmetic
        self._out_features = scales.shape[0] * TILE
        self._group_size = in_features // scales.shape[1]

    @classmethod
    def from_logical(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                     method: QuantizationMethod) -> VnniWeight:
        """w = q * scale + offset: q [N, K] integers (0..15 for 4 bits, 0..255 for 8), scale and offset
        [N, K / G] (held exactly: fp32, or fp16 where that is exact)."""
        n, k = q.shape
        groups = scale.shape[1]
        assert k % groups == 0 and kernel_supports(n, k, k // groups, bits), (n, k, groups, bits)
        scale, offset = scale.to(torch.float32), offset.to(torch.float32)
        symmetric = torch.equal(offset, symmetric_min_factor(bits) * scale)
        dtype = _storage_dtype(scale) if symmetric else _storage_dtype(scale, offset)
        mins = torch.empty(0, dtype=dtype) if symmetric else pack_groups(offset.to(dtype))
        return cls(*pack_q(q, bits), pack_groups(scale.to(dtype)), mins, bits, k, method)

    @classmethod
    def from_k_quant(cls, q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor | None, d: torch.Tensor,
                     neg_dmin: torch.Tensor | None, bits: int, method: QuantizationMethod) -> VnniWeight:
        """A K-quant as the file factors it: w = q * (sc * d) + m * neg_dmin, q [N, K], sc and m [N, K / G]
        small integers (int8), d and neg_dmin [N, S] fp16 per super-block of K / S weights; m and neg_dmin
        None for a symmetric type (Q6_K: min = -2^(bits - 1) * scale)."""
        n, k = q.shape
        groups, supers = sc.shape[1], d.shape[1]
        assert groups % supers == 0 and kernel_supports(n, k, k // groups, bits) and bits < 8, (n, k, groups, bits)
        pairs = torch.stack([d, d if neg_dmin is None else neg_dmin], dim=1)  # [N, 2, S]
        super_scales = pairs.to(torch.float16).view(n // TILE, TILE, 2, supers).permute(0, 3, 2, 1).contiguous()
        mins = torch.empty(0, dtype=torch.int8) if m is None else pack_groups(m.to(torch.int8))
        return cls(*pack_q(q, bits), pack_groups(sc.to(torch.int8)), mins, bits, k, method, super_scales)

    @property
    def symmetric(self) -> bool:
        return self.mins.numel() == 0

    def _scales_and_offsets(self, tile: torch.Tensor | None = None,
                            lane: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (scale, offset) [rows, K / G] of every output row, or of rows tile * 16 + lane."""
        def rows(packed: torch.Tensor) -> torch.Tensor:  # [T, G, 16] -> [rows, G]
            return unpack_groups(packed) if tile is None else packed[tile, :, lane]

        scale = rows(self.scales.data).to(torch.float32)
        offset = None if self.symmetric else rows(self.mins.data).to(torch.float32)
        supers = self.super_scales.data
        if supers.numel():  # a K-quant's small integers times its super-block's d and -dmin
            repeat = scale.shape[1] // supers.shape[1]
            d, neg_dmin = (rows(supers[:, :, j]).to(torch.float32).repeat_interleave(repeat, dim=1) for j in (0, 1))
            scale = scale * d
            offset = None if offset is None else offset * neg_dmin
        return scale, symmetric_min_factor(self.bits) * scale if offset is None else offset

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.scales.shape[0] * TILE, self.in_features))

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def nbytes(self) -> int:
        return sum(self._parameters[name].nbytes for name in _ARENA_PARTS)

    def logical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K] uint8, scale [N, K / G] fp32, min [N, K / G] fp32)."""
        n, k = self.shape
        return (unpack_q(self.qweight.data, self.high.data, n, k, self.bits), *self._scales_and_offsets())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_groups(*self.logical()).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> VnniWeight:
        """Output rows (dim 0) or whole groups of input columns (dim 1) of the logical weight, repacked."""
        q, scale, offset = self.logical()
        if dim == 1:
            group = self.group_size
            assert start % group == 0 and length % group == 0, "a shard must hold whole groups"
            scale = scale.narrow(1, start // group, length // group)
            offset = offset.narrow(1, start // group, length // group)
        else:
            scale, offset = scale.narrow(0, start, length), offset.narrow(0, start, length)
        return VnniWeight.from_logical(q.narrow(dim, start, length), scale, offset, self.bits, self.method)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # (a model's activations are already [T, K] rows: no reshape or view, each as dear as a small op)
        flat = x.dim() == 2 and x.stride(1) == 1
        x2 = x if flat else x.reshape(-1, self.in_features).contiguous()
        # the kernel adds a bias of x's dtype before its one rounding, as a full-precision linear does
        fused = bias is None or (bias.dtype == x2.dtype and bias.is_contiguous())
        if x2.dtype == torch.float32:
            y = self._fp32(x2, bias if fused else None)
        elif (split := forward_context.prompt_rows()) is not None and split.num_rows == x2.shape[0]:
            y = self._split_rows(x2, bias if fused else None, split)  # a forward pass's rows, some of them prompt rows
        else:
            y = self._integer(x2, bias if fused else None)
        if not fused:
            y.add_(bias)
        return y if flat else y.view(*x.shape[:-1], self._out_features)

    def _integer(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        params = self._parameters
        return torch.ops.pagedllm_cpu_qlinear.qlinear(x, params["qweight"], params["high"], params["scales"],
                                                      params["mins"], params["super_scales"], self.bits,
                                                      self._group_size, self.activation_terms, bias)

    def _fp32(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        params = self._parameters
        return torch.ops.pagedllm_cpu_qlinear.qlinear_fp32(x, params["qweight"], params["high"], params["scales"],
                                                           params["mins"], params["super_scales"], self.bits,
                                                           self._group_size, bias)

    def _dense(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        params = self._parameters
        return torch.ops.pagedllm_cpu_qlinear.qlinear_dense(x, params["qweight"], params["high"], params["scales"],
                                                            params["mins"], params["super_scales"], self.bits,
                                                            self._group_size, bias, _dense_amx())

    def _split_rows(self, x: torch.Tensor, bias: torch.Tensor | None, split: forward_context.RowSplit) -> torch.Tensor:
        """Prompt rows by the dense path, the others by the integer one (see dense_prompt_rows)."""
        if split.other is None:
            return self._dense(x, bias)
        y = x.new_empty((x.shape[0], self._out_features))
        if isinstance(split.prompt, slice):
            y[split.prompt] = self._dense(x[split.prompt], bias)
            y[split.other] = self._integer(x[split.other], bias)
        else:
            y.index_copy_(0, split.prompt, self._dense(x.index_select(0, split.prompt), bias))
            y.index_copy_(0, split.other, self._integer(x.index_select(0, split.other), bias))
        return y

    def extra_repr(self) -> str:
        return (f"{self.method.name} (pagedllm VNNI kernel, {self.bits}-bit{', symmetric' if self.symmetric else ''}), "
                f"shape={tuple(self.shape)}, group_size={self.group_size}, "
                f"scales={str(self.scales.dtype).removeprefix('torch.')}")


def vnni_matmul(x: torch.Tensor, weight: VnniWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The `matmul` of a linear module whose weight is a VnniWeight (layers/linear.py's `linear` without its
    type tests)."""
    return weight.apply(x, bias)


class VnniRows(Module):
    """An embedding table read from a tied LM head's VnniWeight: each lookup unpacks only the rows asked
    for, w = q * scale + min in fp32 (VnniWeight.dequantize's arithmetic), so the table and the LM head are
    one copy of the weights. The weight is the LM head's (registered there, not here)."""

    def __init__(self, weight: VnniWeight):
        super().__init__()
        object.__setattr__(self, "source", weight)
        weight.read_by_rows = True  # select_quantized_kernels keeps it in this layout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w: VnniWeight = self.source  # type: ignore[assignment]
        n, k = w.shape
        ids = ids.reshape(-1).to(torch.long)
        tile, lane = ids // TILE, ids % TILE
        if w.bits == 8:  # [tiles, K / 4, 16 features, 4 k] -> the rows' [len, K / 4, 4]
            q = w.qweight.view(n // TILE, k // 4, TILE, 4)[tile, :, lane]
        else:  # byte j of a feature's 4 in k-octet t: k-quad 2t in its low nibble, 2t + 1 in its high one
            packed = w.qweight.view(n // TILE, k // 8, TILE, 4)[tile, :, lane]
            q = torch.stack([packed & 15, packed >> 4], dim=2)  # [len, K / 8, quad parity, 4]
            if w.bits > 4:  # mask (plane p, parity h) of k-octet t: bit 4 * lane + j of its 8 bytes
                masks = w.high.view(n // TILE, k // 8, w.bits - 4, 2, 8)[tile]  # [len, K / 8, P, 2, 8]
                byte = (lane * 4 // 8).view(-1, 1, 1, 1, 1).expand(*masks.shape[:-1], 1)
                lanes = masks.gather(-1, byte).to(torch.int32)  # the byte holding this lane's 4 bits
                shift = (lane * 4 % 8).view(-1, 1, 1, 1, 1).to(torch.int32) + torch.arange(4, dtype=torch.int32)
                bits = (lanes >> shift) & 1  # [len, K / 8, P, 2, 4]
                for p in range(w.bits - 4):
                    q = q | (bits[:, :, p].to(torch.uint8) << (4 + p))
        return dequantize_groups(q.reshape(-1, k), *w._scales_and_offsets(tile, lane))

    def extra_repr(self) -> str:
        return f"rows of the LM head's {self.source.bits}-bit VNNI weight"


def int8_to_vnni(weight: QuantizedWeight) -> VnniWeight | None:
    """A signed int8 weight (per-channel scales [N] or per-group [N, K / G]) as the kernel's, losslessly
    (q + 128, min = -128 * scale); None where the kernel does not take its shape."""
    q = weight.qweight.data
    n, k = q.shape
    scale = weight.scales.data.to(torch.float32)
    scale = scale.view(n, 1) if scale.dim() == 1 else scale
    if not kernel_supports(n, k, k // scale.shape[1], 8) or k % scale.shape[1]:
        return None
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    return VnniWeight.from_logical(u, scale, -128 * scale, 8, weight.method)


def _label(weight: QuantizedWeight) -> str:
    """The method and group size, which the kernel choice is made per (e.g. "int4-g128", "int8-channel")."""
    if isinstance(weight, VnniWeight):
        group = weight.group_size
        per_channel = weight.method.name == "int8" and group == weight.in_features
    else:
        group = getattr(weight, "group_size", None) or (
            weight.qweight.shape[1] // weight.scales.shape[1] if weight.scales.dim() == 2 else None)
        per_channel = group is None
    return f"{weight.method.name}-channel" if per_channel else f"{weight.method.name}-g{group}"


def _torch_can_take(weight: QuantizedWeight) -> bool:
    """Whether torch's kernels take the weight: not GGUF's Q5 / Q6 types (5- and 6-bit integers with
    mins), and int4 only in the shapes its packing takes."""
    if not isinstance(weight, VnniWeight):
        return True
    if weight.bits == 4:
        from pagedllm.layers.quantization.int4 import int4_supports

        return int4_supports(*weight.shape, weight.group_size)
    return weight.bits == 8 and weight.symmetric


def _to_torch(weight: QuantizedWeight, dtype: torch.dtype) -> QuantizedWeight:
    """The weight in torch's kernels' form (scales rounded to bf16 / the model dtype, as those kernels
    take them); only for weights _torch_can_take."""
    if not isinstance(weight, VnniWeight):
        return weight
    from pagedllm.layers.quantization.int4 import Int4WeightOnlyMethod

    q, scale, offset = weight.logical()
    if isinstance(weight.method, Int4WeightOnlyMethod):
        return weight.method.create_torch_layout(q, scale, offset)
    n = q.shape[0]
    signed = (q.to(torch.int16) - 128).to(torch.int8)
    scales = scale.to(dtype).view(n) if scale.shape[1] == 1 else scale.to(dtype)
    return QuantizedWeight(signed, scales, weight.method)


def _to_pagedllm(weight: QuantizedWeight) -> QuantizedWeight:
    if isinstance(weight, VnniWeight) or weight.method.name != "int8":
        return weight
    return int8_to_vnni(weight) or weight


def _timing_factory(label: str, dtype: torch.dtype):
    """For the kernel choice's measurement: factory(path, weight) -> the matmul of that path."""
    from pagedllm.layers.quantization.int4 import Int4WeightOnlyMethod
    from pagedllm.layers.quantization.int8 import Int8WeightOnlyMethod

    name, _, group_text = label.partition("-")
    group = None if group_text == "channel" else int(group_text.removeprefix("g"))

    def factory(path: str, weight: torch.Tensor):
        if name == "int4":
            from pagedllm.layers.quantization.int4 import INT4_ZERO, quantize_groups

            method: QuantizationMethod = Int4WeightOnlyMethod(group)
            q, scales, zero_points = quantize_groups(weight, group, dtype)
            s = scales.to(torch.float32)
            offsets = -(INT4_ZERO + zero_points.to(torch.float32)) * s
            qw: QuantizedWeight = (VnniWeight.from_logical(q, s, offsets, 4, method) if path == "pagedllm"
                                   else method.create_torch_layout(q, s, offsets))
        else:
            method = Int8WeightOnlyMethod(group)
            qw = method.quantize(weight, dtype)
            if path == "pagedllm":
                qw = int8_to_vnni(qw) or qw
        return lambda x: method.apply(x, qw, None)

    return factory


def select_quantized_kernels(model: nn.Module, dtype: torch.dtype) -> list:
    """Choose, per method and group size, between pagedllm's VNNI kernel and torch's for the model's
    weight-only quantized linears (layers/linear_tuning.choose_quant_kernel: forced, measured and cached,
    or pagedllm's by default), and put each weight in the chosen kernel's form: int4 weights are built in
    the VNNI layout where it runs (exact), int8 ones in their logical form. Returns the choices (the
    benchmarks print them); none where the VNNI kernel does not run for this dtype (torch's as loaded)."""
    if not kernel_enabled(dtype):
        return []
    from pagedllm.layers.linear_tuning import choose_quant_kernel

    slots: dict[str, list[tuple[nn.Module, str, QuantizedWeight]]] = {}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if (isinstance(child, QuantizedWeight) and child.method.name in ("int4", "int8")
                    and child.qweight.device.type == "cpu" and not getattr(child, "read_by_rows", False)):
                slots.setdefault(_label(child), []).append((module, name, child))
    choices = []
    for label, entries in slots.items():
        torch_runs = dtype != torch.float32 and all(_torch_can_take(w) for _, _, w in entries)  # fp32: scalar code
        paths = ["pagedllm", "torch"] if torch_runs else ["pagedllm"]
        choice = choose_quant_kernel(label, [tuple(w.shape) for _, _, w in entries], dtype, paths,
                                     _timing_factory(label, dtype))
        choices.append(choice)
        for module, name, weight in entries:
            weight = _to_pagedllm(weight) if choice.path == "pagedllm" else _to_torch(weight, dtype)
            setattr(module, name, weight)
            if isinstance(weight, VnniWeight) and name == "weight" and hasattr(module, "matmul"):
                module.matmul = vnni_matmul  # the kernel, chosen once: no per-call dispatch on the weight's type
    place_in_huge_pages([m for m in model.modules() if isinstance(m, VnniWeight) and m.qweight.device.type == "cpu"])
    return choices


_ARENA_PARTS = ("qweight", "high", "scales", "mins", "super_scales")


def place_in_huge_pages(weights: list[VnniWeight]) -> None:
    """Move the weights' tensors into one HugePageArena, in the order given (the forward pass's:
    model.modules()), as the blocked bf16 weights are: with 4 KiB pages the prefetchers stop at every page
    of a decode step's many short weight streams (a 7 KiB tile spans two or three; the figures are in
    docs/performance/amd-zen4.md). The copies replace the tensors as they go, and the heap they leave is
    handed back every 64 MiB, so the process holds about one copy."""
    from pagedllm.platform import HugePageArena, release_free_heap_memory

    unique = list({id(w): w for w in weights}.values())  # a tied weight is reached twice
    params = [(w, name, w._parameters[name]) for w in unique for name in _ARENA_PARTS]
    if not any(param.nbytes for _, _, param in params):
        return
    arena, moved = HugePageArena(param.nbytes for _, _, param in params), 0
    for weight, name, param in params:
        slot = arena.take(param.nbytes).view(param.dtype).view(param.shape)
        slot.copy_(param.data)
        weight._parameters[name] = nn.Parameter(slot, requires_grad=False)
        moved += param.nbytes
        if moved >= 64 << 20:
            release_free_heap_memory()
            moved = 0
