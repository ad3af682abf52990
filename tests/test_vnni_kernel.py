"""pagedllm's VNNI kernel for quantized linears (layers/csrc/cpu_quant_linear.cpp): every weight format it
reads is repacked without loss (oracles: llama.cpp's `gguf.quants.dequantize` for each GGUF type, the
compressed-tensors library's decompressor for W4A16), and its output stays within the bound stated in
layers/quantization/vnni.py, the same for every type since the weights are exact:

- against the same quantized activations x^ (each row in blocks of vnni.activation_block's size, 32 to
  128, x^ = d * xq + d2 * xq2: xq =
  round(x / d), d the block's absmax / 127, and xq2 the same of the remainder x - d * xq) times the exact
  weight in fp64: the fp32 steps (K / 8 + 4 roundings of 2**-24 in a row at most) relative to the terms
  the kernel sums, |x^| @ B^T with B = q |scale| + |min| per weight (the min term is summed apart from
  q * scale, so their cancellation counts), plus the output's rounding to its dtype (2**-8 relative for
  bf16, 2**-23 for fp32);
- against the unquantized activations: plus sum over blocks of d2 / 2 * sum |w| in the block (d2 is at
  most d / 254: about 15 bits against the block's absmax); with PAGEDLLM_QUANT_ACTIVATION_TERMS=1 (one
  term, llama.cpp's Q8_0) d2 = 0 above and d / 2 here.

And a row's result never depends on the rows beside it (batch invariance).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from gguf_models import _random_k_blocks

from pagedllm.layers.quantization.int4 import Int4WeightOnlyMethod
from pagedllm.layers.quantization.int8 import Int8WeightOnlyMethod
from pagedllm.layers.quantization.vnni import (
    VnniWeight,
    activation_block,
    int8_to_vnni,
    kernel_enabled,
    kernel_supports,
    pack_q,
    unpack_q,
)
from pagedllm.models.gguf import PACKED_TYPES, merge_mixed_parts
from pagedllm.platform import _cpu_flags

VNNI_CPU = {"avx512f", "avx512bw", "avx512_vnni"} <= set(_cpu_flags())
pytestmark = pytest.mark.skipif(not VNNI_CPU, reason="the CPU lacks AVX512-VNNI: torch's kernels serve it")

GGUF_TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
OUTPUT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -23}
FP32_ROUNDOFF = 2.0 ** -24


def _gguf_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind.endswith("_K"):  # the gguf package cannot quantize K-quants: random valid blocks
        return _random_k_blocks(n, k, kind, rng)
    return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, GGMLQuantizationType[kind])


def _int8_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of fp32 blocks [..., B] as the kernel rounds them: scale = absmax / 127, codes =
    round-half-even(v * (127 / absmax)) in fp32."""
    absmax = blocks.abs().amax(-1, keepdim=True)
    # tensor / tensor: torch's scalar / tensor multiplies by a reciprocal, off by an ulp, and bf16 inputs
    # hit exact ties (v = absmax / 2) where that ulp changes the rounding
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127) / absmax, torch.zeros_like(absmax))
    return torch.round(blocks * inv), absmax / torch.full_like(absmax, 127)


def _quantized_activations(x: torch.Tensor, terms: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x^ in fp64, the last term's scale of each element), as the kernel quantizes each row in blocks of
    b: x^ = d * xq (+ d2 * xq2, xq2 the codes of the remainder x - d * xq, rounded once to fp32)."""
    m, k = x.shape
    blocks = x.float().view(m, k // b, b)
    codes, scale = _int8_codes(blocks)
    if terms == 1:
        return (codes.double() * scale.double()).view(m, k), scale.double().expand(m, k // b, b).reshape(m, k)
    remainder = (blocks.double() - codes.double() * scale.double()).float()
    codes2, scale2 = _int8_codes(remainder)
    xhat = codes.double() * scale.double() + codes2.double() * scale2.double()
    return xhat.view(m, k), scale2.double().expand(m, k // b, b).reshape(m, k)


def _check_bounds(weight: VnniWeight, exact: torch.Tensor, x: torch.Tensor) -> None:
    got = weight._integer(x, None).double()  # the integer kernel, fp32 rows too (fp32 models take qlinear_fp32)
    roundoff = OUTPUT_ROUNDOFF[x.dtype]
    b = activation_block(x.shape[1], weight.group_size)
    xhat, d = _quantized_activations(x, weight.activation_terms, b)
    w = exact.double()
    same_act = xhat @ w.T
    q, scale, offset = (t.double() for t in weight.logical())
    n, k = q.shape
    terms = (q.view(n, scale.shape[1], -1) * scale.abs().unsqueeze(-1) + offset.abs().unsqueeze(-1)).view(n, k)
    fp32_steps = (k / 8 + 4) * FP32_ROUNDOFF
    tight = fp32_steps * (xhat.abs() @ terms.T) + roundoff * same_act.abs() + 1e-30
    assert ((got - same_act).abs() <= tight).all(), ((got - same_act).abs() / tight).max()
    ref = x.double() @ w.T
    act_error = (d / 2).view(x.shape[0], -1, b)
    loose = tight + (act_error.view(x.shape[0], -1) @ w.abs().T) + roundoff * (ref - same_act).abs()
    assert ((got - ref).abs() <= loose).all(), ((got - ref).abs() / loose).max()


def _check_invariance(weight: VnniWeight, x: torch.Tensor) -> None:
    full = weight.method.apply(x, weight, None)
    for rows in (1, 2, 3, 5):
        for start in range(0, x.shape[0] - rows + 1, 3):
            assert torch.equal(weight.method.apply(x[start:start + rows], weight, None), full[start:start + rows])


def test_the_kernel_is_built_where_the_cpu_has_avx512_vnni(monkeypatch):
    """The C++ ops build with -march=native: on such a CPU the kernel must be there (a failed build would
    otherwise only show as slower int4 / int8); half-precision models use it, fp32 ones its fp32 op (built
    wherever AVX2, FMA and F16C are, so on every AVX512-VNNI CPU)."""
    assert kernel_enabled(torch.bfloat16) and kernel_enabled(torch.float16) and kernel_enabled(torch.float32)
    monkeypatch.setenv("PAGEDLLM_QUANT_KERNEL", "torch")
    assert not kernel_enabled(torch.bfloat16)
    monkeypatch.setenv("PAGEDLLM_QUANT_KERNEL", "fastest")
    with pytest.raises(ValueError, match="PAGEDLLM_QUANT_KERNEL"):
        kernel_enabled(torch.bfloat16)


@pytest.mark.parametrize("terms", [2, 1])
@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_gguf_types_repack_losslessly_and_stay_within_the_bound(kind, terms, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_QUANT_ACTIVATION_TERMS", str(terms))
    n, k = 48, 512
    data = _gguf_blocks(kind, n, k, seed=len(kind))
    oracle = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).reshape(n, k).astype(np.float64))
    parts = PACKED_TYPES[kind](data, (n, k))
    weight = parts.build(torch.bfloat16, {})
    assert isinstance(weight, VnniWeight) and tuple(weight.shape) == (n, k)
    # exact: q * scale + offset in fp64 is llama.cpp's value (which it computes in fp32: compare there too)
    exact = weight.dequantize(torch.float64)
    assert torch.equal(exact.float(), oracle.float())
    assert (exact - oracle).abs().max() <= 2.0 ** -24 * oracle.abs().max()
    for m in (1, 5, 64):  # a decode token, a small batch (a 4-row block and a remainder), a prefill chunk
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        for dtype in (torch.bfloat16, torch.float32):
            _check_bounds(weight, exact, x.to(dtype))
    _check_invariance(weight, torch.randn(11, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))


# bits a weight the kernel keeps each type in: (weight bits, whether it stores mins), as the file stores it
# where its scales are exact in fp16 (a K-quant's scale is a product of two: fp32)
STORED = {"Q4_0": (4, False), "Q4_1": (4, True), "Q4_K": (4, True), "Q5_0": (5, False), "Q5_1": (5, True),
          "Q5_K": (5, True), "Q6_K": (6, False), "Q8_0": (8, False)}


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_each_gguf_type_keeps_its_bits_and_drops_the_mins_a_symmetric_type_implies(kind):
    """Storage: a 5-bit type in 5 bits and Q6_K in 6, fp16 scales where every value is exact in fp16, and
    no mins where min = -2^(bits - 1) * scale: Q4_0, Q5_0 and Q8_0 then take the file's bytes."""
    n, k = 32, 256
    data = _gguf_blocks(kind, n, k, 0)
    weight = PACKED_TYPES[kind](data, (n, k)).build(torch.bfloat16, {})
    bits, with_mins = STORED[kind]
    assert weight.bits == bits and weight.symmetric == (not with_mins)
    assert weight.group_size == (16 if kind == "Q6_K" else 32)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        assert weight.scales.dtype == torch.float16 and weight.nbytes() == data.nbytes
    else:  # K-quants: int8 scales (and mins) per group, fp16 d (and -dmin) per 256 weights: within 3% of the file
        assert weight.scales.dtype == torch.int8 and weight.super_scales.dtype == torch.float16
        assert data.nbytes <= weight.nbytes() <= 1.03 * data.nbytes


@pytest.mark.parametrize("kinds", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q6_K"), ("Q4_0", "Q4_1"), ("Q5_1", "Q4_0")])
def test_a_fused_projection_of_mixed_types_is_its_parts_exactly(kinds):
    """merge_mixed_parts: the widest part's bits, the narrowest groups, every weight as llama.cpp
    dequantizes it; symmetric only where every part is."""
    n, k = 32, 256
    blocks = [_gguf_blocks(kind, n, k, seed) for seed, kind in enumerate(kinds)]
    weight = merge_mixed_parts([PACKED_TYPES[kind](data, (n, k)) for kind, data in zip(kinds, blocks)], {})
    oracle = torch.cat([torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).reshape(n, k))
                        for kind, data in zip(kinds, blocks)])
    assert torch.equal(weight.dequantize(), oracle.float())
    assert weight.bits == max(STORED[kind][0] for kind in kinds)
    assert weight.symmetric == (not any(STORED[kind][1] for kind in kinds))
    assert weight.group_size == (16 if "Q6_K" in kinds else 32)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_pack_unpack_and_narrow_work_on_the_logical_weight(bits):
    torch.manual_seed(0)
    n, k, group = 64, 256, 64
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
    packed, high = pack_q(q, bits)
    assert high.numel() == n * k * max(bits - 4, 0) // 8 if bits < 8 else high.numel() == 0
    assert torch.equal(unpack_q(packed, high, n, k, bits), q)
    scale, offset = torch.rand(n, k // group), -torch.rand(n, k // group)
    weight = VnniWeight.from_logical(q, scale, offset, bits, Int4WeightOnlyMethod(group))
    full = weight.dequantize()
    x = torch.randn(3, k).to(torch.bfloat16)
    for dim in (0, 1):
        for rank in range(2):
            size = full.shape[dim] // 2
            shard = weight.narrow(dim, rank * size, size)
            assert torch.equal(shard.dequantize(), full.narrow(dim, rank * size, size))
            if dim == 0:  # a column shard computes its rows exactly as the whole weight does
                assert torch.equal(shard.method.apply(x, shard, None),
                                   weight.method.apply(x, weight, None)[:, rank * size:(rank + 1) * size])
    with pytest.raises(AssertionError, match="whole groups"):
        weight.narrow(1, 32, 128)
    assert not kernel_supports(24, 256, 32, 4) and not kernel_supports(32, 48, 16, 4)


@pytest.mark.parametrize("group_size", [None, 32, 128])
def test_int8_weights_repack_losslessly(group_size):
    n, k = 64, 256
    method = Int8WeightOnlyMethod(group_size)
    logical = method.quantize(torch.randn(n, k), torch.bfloat16)
    weight = int8_to_vnni(logical)
    assert weight is not None and weight.method is method
    exact = method.dequantize(logical, torch.float64)
    assert torch.equal(weight.dequantize(torch.float64), exact)
    for m in (1, 7, 40):
        _check_bounds(weight, exact, torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16))
    _check_invariance(weight, torch.randn(9, k).to(torch.bfloat16))


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_as_the_compressed_tensors_library_decompresses(symmetric):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from test_int4 import _w4a16_compress, _w4a16_scheme

    from pagedllm.layers.quantization.compressed_tensors import read_int4

    n, k, group = 48, 256, 128
    compressed = _w4a16_compress(torch.randn(n, k).to(torch.bfloat16), symmetric, group)
    want = PackedQuantizationCompressor.decompress(dict(compressed), _w4a16_scheme(symmetric, group))["weight"]
    q, scale, offset = read_int4("p", lambda name: compressed[name.removeprefix("p.")], {f"p.{k}" for k in compressed})
    weight = Int4WeightOnlyMethod(group).create(q, scale, offset, torch.bfloat16)
    assert isinstance(weight, VnniWeight)
    exact = weight.dequantize(torch.float64)
    # the library multiplies in the scale's dtype (bf16): one rounding of the exact value we keep
    assert torch.equal(exact.to(want.dtype), want)
    for m in (1, 16):
        _check_bounds(weight, exact, torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16))


def test_zero_rows_and_bias():
    weight = Int4WeightOnlyMethod(32).quantize(torch.randn(32, 64), torch.bfloat16)
    assert isinstance(weight, VnniWeight)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    bias = torch.randn(32).to(torch.bfloat16)
    assert torch.equal(weight.method.apply(x, weight, bias), bias.expand(2, 32))
    assert weight.method.apply(torch.zeros(0, 64, dtype=torch.bfloat16), weight, None).shape == (0, 32)
    # The bias is added to the fp32 result before its one rounding to the output dtype, for every row
    # count (the 16-row tiles of an AMX CPU too): fp32 input quantizes to the same codes, and its output
    # is the fp32 result itself.
    for m in (1, 5, 16, 21):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        exact = weight._integer(x.float(), None)  # the integer kernel on fp32 rows (models take qlinear_fp32)
        assert torch.equal(weight.method.apply(x, weight, bias), (exact + bias.float()).to(torch.bfloat16))


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once, as a fused multiply-add: the product is exact in fp64, the sum is
    rounded to odd there (its exact error by TwoSum makes the last bit sticky), and that rounds to fp32
    exactly as the exact sum would."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)
    even = (s.view(torch.int64) & 1) == 0
    nudged = torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf).double())
    return torch.where((err != 0) & even, nudged, s).float()


def _rows_as_the_kernel_quantizes(x: torch.Tensor, terms: int, group: int, b: int):
    """Per row: the int8 codes and block scales (blocks of b) of each term (_int8_codes), and the group sums
    the kernel folds the mins with: per 16 channels d * sum(xq) (+ d2 * sum(xq2), the two products rounded
    apart and added), then the 16-wide pieces added in order from 0."""
    m, k = x.shape
    blocks = x.float().view(m, k // b, b)
    codes, scale = _int8_codes(blocks)
    parts = [(codes, scale)]
    if terms == 2:
        parts.append(_int8_codes((blocks.double() - codes.double() * scale.double()).float()))
    sum16 = None
    for c, s in parts:
        piece = (c.view(m, k // b, b // 16, 16).sum(-1) * s).view(m, k // 16)
        sum16 = piece if sum16 is None else sum16 + piece
    xs = torch.zeros(m, k // group)
    for p in range(group // 16):
        xs = xs + sum16.view(m, k // group, group // 16)[:, :, p]
    return [(c.view(m, k), s.view(m, k // b)) for c, s in parts], xs


def _kernel_arithmetic(x: torch.Tensor, weight: VnniWeight) -> torch.Tensor:
    """The kernel's result bit for bit, step by step: per output, per group, per unit of min(group, block)
    input channels (block: activation_block's) the exact integer sum of each term times its block scale
    fma'd into the group's fp32 sum; per group acc = fma(group sum, scale, acc), then acc = fma(min, the
    row's group sum, acc); the result rounded to the output dtype. Batch invariance follows: nothing here
    looks at another row."""
    q, scale, offset = weight.logical()
    n, k = q.shape
    group = weight.group_size
    b = activation_block(k, group)
    unit = min(group, b)
    terms, xs = _rows_as_the_kernel_quantizes(x, weight.activation_terms, group, b)
    qd = q.double()
    acc = torch.zeros(x.shape[0], n)
    for g in range(k // group):
        facc = torch.zeros(x.shape[0], n)
        for k0 in range(g * group, (g + 1) * group, unit):
            for codes, d in terms:
                isum = (codes[:, k0:k0 + unit].double() @ qd[:, k0:k0 + unit].T).float()  # exact integers
                facc = _fma32(isum, d[:, k0 // b:k0 // b + 1], facc)
        acc = _fma32(facc, scale[:, g], acc)
        acc = _fma32(offset[:, g].expand_as(acc), xs[:, g:g + 1], acc)
    return acc.to(x.dtype)


@pytest.mark.parametrize("terms", [2, 1])
@pytest.mark.parametrize("bits,group,fp16_scales,symmetric", [
    (8, None, False, False), (8, 16, True, False), (8, 64, False, True), (4, 32, True, False),
    (4, 128, False, False), (4, 64, True, True), (4, 16, False, False), (5, 32, True, True),
    (5, 64, False, False), (6, 16, False, True), (6, 32, True, False)])
def test_the_kernel_computes_each_output_in_its_fixed_arithmetic(bits, group, fp16_scales, symmetric, terms,
                                                                 monkeypatch):
    """Bit for bit the arithmetic of _kernel_arithmetic, for every row count (the kernel computes rows in
    blocks of up to four and tiles several at a time, in ways that differ with the batch) and for tile
    counts that leave every remainder: a faster kernel must give the same bits. A symmetric weight keeps
    no mins, and its min formed in the kernel is the one it would have stored."""
    assert kernel_enabled(torch.bfloat16)
    monkeypatch.setenv("PAGEDLLM_QUANT_ACTIVATION_TERMS", str(terms))
    n, k = 16 * 7, 256
    gen = torch.Generator().manual_seed(bits * 1000 + (group or 0) + terms)
    q = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    groups = k // (group or k)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 0.001
    offset = -torch.rand(n, groups, generator=gen) * 0.1
    if fp16_scales:  # values exact in fp16: the weight keeps them in fp16
        scale, offset = scale.half().float(), offset.half().float()
    if symmetric:
        offset = -(2.0 ** (bits - 1)) * scale
    method = Int8WeightOnlyMethod(group) if bits == 8 else Int4WeightOnlyMethod(group)
    weight = VnniWeight.from_logical(q, scale, offset, bits, method)
    assert weight.scales.dtype == (torch.float16 if fp16_scales else torch.float32)
    assert weight.symmetric == symmetric and weight.mins.numel() == (0 if symmetric else n * groups)
    assert torch.equal(weight.logical()[2], offset)
    x = torch.randn(64, k, generator=gen) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=gen)]
    threads = torch.get_num_threads()
    try:
        for dtype in (torch.bfloat16, torch.float16):
            xd = x.to(dtype)
            want = _kernel_arithmetic(xd, weight)
            for m in (1, 2, 3, 5, 16, 17, 64):
                for count in (1, 2):  # threads split the output tiles; up to 4 rows each quantizes them itself
                    torch.set_num_threads(count)
                    assert torch.equal(weight.method.apply(xd[-m:], weight, None), want[-m:]), (m, count)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, False), (5, 32, False), (6, 16, True)])
def test_k_quant_scales_formed_in_the_kernel_give_the_stored_products_bits(bits, group, symmetric):
    """Q4_K / Q5_K / Q6_K keep int8 scales (and mins) per group and fp16 d (and -dmin) per 256 weights; the
    kernel forms sc * d in fp32 (exact), so its output is bit for bit _kernel_arithmetic's, at 1 and 2
    threads and every row count."""
    n, k = 16 * 5, 512
    gen = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    sc = torch.randint(-128 if symmetric else 0, 128 if symmetric else 64, (n, k // group), generator=gen)
    d = (torch.rand(n, k // 256, generator=gen) * 0.002 + 1e-4).half()
    m = None if symmetric else torch.randint(0, 64, (n, k // group), generator=gen)
    neg_dmin = None if symmetric else -(torch.rand(n, k // 256, generator=gen) * 0.002).half()
    weight = VnniWeight.from_k_quant(q, sc, m, d, neg_dmin, bits, Int8WeightOnlyMethod(group))
    assert weight.scales.dtype == torch.int8 and weight.symmetric == symmetric
    _, scale, offset = weight.logical()
    per_group = 256 // group  # groups per super-block of 256 weights
    assert torch.equal(scale, sc.float() * d.float().repeat_interleave(per_group, dim=1))
    if not symmetric:
        assert torch.equal(offset, m.float() * neg_dmin.float().repeat_interleave(per_group, dim=1))
    x = (torch.randn(17, k, generator=gen) * 3).to(torch.bfloat16)
    want = _kernel_arithmetic(x, weight)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 3, 17):
                assert torch.equal(weight.method.apply(x[-rows:], weight, None), want[-rows:]), (rows, count)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_rows_read_from_a_tied_table_are_llama_cpps_rows(kind):
    """VnniRows (the embedding of a tied LM head kept in the kernel's layout) unpacks the asked rows of every
    type, bit planes and K-quant factors included, to exactly llama.cpp's values."""
    from pagedllm.layers.quantization.vnni import VnniRows

    n, k = 48, 256
    data = _gguf_blocks(kind, n, k, seed=3)
    weight = PACKED_TYPES[kind](data, (n, k)).build(torch.bfloat16, {})
    oracle = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).reshape(n, k)).float()
    ids = torch.tensor([0, 17, 47, 17, 5, 31])
    assert torch.equal(VnniRows(weight)(ids), oracle[ids])


def _dense_paths() -> list[bool]:
    """The dense op's paths this CPU runs: VDPBF16PS (AVX512-BF16), and the AMX tiles where it has them."""
    if not kernel_enabled(torch.bfloat16):  # (which builds or loads the ops)
        return []
    ops = torch.ops.pagedllm_cpu_qlinear
    return [amx for amx in (False, True) if bool(ops.qlinear_dense_supports(amx))]


def _dense(weight: VnniWeight, x: torch.Tensor, bias: torch.Tensor | None, amx: bool) -> torch.Tensor:
    p = weight._parameters
    return torch.ops.pagedllm_cpu_qlinear.qlinear_dense(x, p["qweight"], p["high"], p["scales"], p["mins"],
                                                        p["super_scales"], weight.bits, weight.group_size, bias, amx)


def _gguf_weight(kind: str, n: int, k: int) -> VnniWeight:
    return PACKED_TYPES[kind](_gguf_blocks(kind, n, k, seed=len(kind)), (n, k)).build(torch.bfloat16, {})


def _logical_weight(bits: int, group: int, symmetric: bool, n: int, k: int) -> VnniWeight:
    gen = torch.Generator().manual_seed(bits * 100 + group)
    q = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    offset = -(2.0 ** (bits - 1)) * scale if symmetric else -torch.rand(n, k // group, generator=gen) * 0.1
    method = Int8WeightOnlyMethod(group) if bits == 8 else Int4WeightOnlyMethod(group)
    return VnniWeight.from_logical(q, scale, offset, bits, method)


@pytest.mark.skipif(not VNNI_CPU or not _dense_paths(), reason="no AVX512-BF16 for the dense path")
@pytest.mark.parametrize("make", [*(pytest.param(lambda n, k, kind=kind: _gguf_weight(kind, n, k), id=kind)
                                    for kind in GGUF_TYPES),
                                  pytest.param(lambda n, k: _logical_weight(4, 128, False, n, k), id="int4_g128"),
                                  pytest.param(lambda n, k: _logical_weight(4, 32, True, n, k), id="int4_g32_sym"),
                                  pytest.param(lambda n, k: _logical_weight(8, 256, True, n, k), id="int8_channel")])
def test_the_dense_path_multiplies_the_weights_rounded_once_to_bf16(make):
    """qlinear_dense (a bf16 model's prompt rows): each weight q * scale + min rounded once to bf16, the
    products summed in fp32, the output rounded to bf16: within 2**-8 of the output plus 2**-8 (the
    weights' rounding, with margin) and K * 2**-24 (the fp32 sums) of sum |x| |w|, for output widths that
    leave partial blocks of 64 (80 = 64 + 16), one row and rows past the 256 of a pass; and a row's result
    does not depend on the rows beside it."""
    n, k = 80, 512
    weight = make(n, k)
    exact = weight.dequantize(torch.float64)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(300, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    want = x.double() @ exact.T + bias.double()
    scale = x.double().abs() @ exact.abs().T
    bound = 2.0 ** -8 * want.abs() + (2.0 ** -8 + k * 2.0 ** -24) * scale + 2.0 ** -8 * bias.double().abs()
    for amx in _dense_paths():
        y = _dense(weight, x, bias, amx)
        assert ((y.double() - want).abs() <= bound).all(), amx
        for m in (1, 17):
            assert torch.equal(_dense(weight, x[-m:], bias, amx), y[-m:]), (amx, m)
