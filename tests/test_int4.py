"""int4 weights (GGUF Q4_0 / Q4_1 / Q4_K kept packed; quantization='int4'): llama.cpp's own dequantization
(`gguf.quants.dequantize`) is the oracle for the repacking and the kernel, the dequantized engine for the
tokens.

Unit tests of torch's int4 kernel (PAGEDLLM_QUANT_KERNEL=torch: the path where the CPU lacks AVX512-VNNI)
pin it; the engine tests run whichever kernel this CPU gets (pagedllm's VNNI kernel has its own bounds,
tests/test_vnni_kernel.py).

torch's kernel's error bound, the same for the three types: it multiplies by the scale s and the zero
z = offset + 8 s each rounded once to bf16 (unit roundoff 2**-8), so a weight is off by at most
2**-8 * (|q - 8| |s| + |z|), and its bf16 output adds 2**-8 of its magnitude; fp32 sums add far less.
So |y - x @ W^T| <= 2**-8 * (|x| @ B^T + |x @ W^T|) (times 1.01), with B = |q - 8| |s| + |z|. For Q4_0 z is
0 exactly (its offset is -8 s), so only the scale term counts there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from gguf_models import _random_k_blocks, write_gguf
from tiny_models import build_model

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.quantization.int4 import Int4Weight, Int4WeightOnlyMethod, pack_int4, unpack_int4
from pagedllm.layers.quantization.vnni import VnniWeight, kernel_enabled, vnni_matmul
from pagedllm.models.gguf import INT4_TYPES, PACKED_TYPES, PackedParts

BF16_UNIT_ROUNDOFF = 2.0 ** -8
INT4_WEIGHTS = (Int4Weight, VnniWeight)  # torch's layout, or pagedllm's VNNI kernel's


@pytest.fixture
def torch_kernel(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_QUANT_KERNEL", "torch")


def _blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "Q4_K":  # the gguf package cannot quantize K-quants: random valid blocks
        return _random_k_blocks(n, k, kind, rng)
    return quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[kind])


def _oracle(kind: str, data: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_gguf_blocks_are_relaid_losslessly(kind):
    n, k = 48, 512
    data = _blocks(kind, n, k)
    parts = PACKED_TYPES[kind](data, (n, k))
    weight = parts.q.float().view(n, k // 32, 32) * parts.scale.float().unsqueeze(-1)
    if parts.offset is not None:
        weight = weight + parts.offset.unsqueeze(-1)
    assert torch.equal(weight.view(n, k), _oracle(kind, data, n, k))


@pytest.mark.parametrize("kind", INT4_TYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 64])  # decode batches and a prefill chunk
def test_kernel_matches_llama_cpp_dequantization_within_the_stated_bound(kind, m, torch_kernel):
    n, k = 96, 512
    data = _blocks(kind, n, k, seed=m)
    parts = PACKED_TYPES[kind](data, (n, k))
    weight = parts.build(torch.bfloat16, {})
    assert isinstance(weight, Int4Weight) and tuple(weight.shape) == (n, k)
    want_weight = _oracle(kind, data, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    got = weight.method.apply(x, weight, bias).float()
    want = x.float() @ want_weight.T + bias.float()
    scale, zero = parts.scale.abs(), parts.offset + 8 * parts.scale
    per_weight = ((parts.q.float().view(n, -1, 32) - 8).abs() * scale.unsqueeze(-1) + zero.abs().unsqueeze(-1))
    bound = BF16_UNIT_ROUNDOFF * (x.float().abs() @ per_weight.view(n, k).T + want.abs()) * 1.01 + 1e-6
    assert got.shape == (m, n)
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()
    # a token's result does not depend on the other tokens in the call
    assert torch.equal(weight.method.apply(x[-1:], weight, bias)[0], weight.method.apply(x, weight, bias)[-1])


def test_pack_unpack_and_narrow_keep_whole_groups(torch_kernel):
    torch.manual_seed(0)
    q = torch.randint(0, 16, (64, 256), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q), 64, 256), q)
    method = Int4WeightOnlyMethod(group_size=64)
    weight = method.quantize(torch.randn(64, 256), torch.bfloat16)
    full = weight.dequantize()
    assert (full - method.dequantize(weight)).abs().max() == 0
    for dim in (0, 1):
        for rank in range(2):
            size = full.shape[dim] // 2
            shard = weight.narrow(dim, rank * size, size)
            assert torch.equal(shard.dequantize(), full.narrow(dim, rank * size, size))
    with pytest.raises(ValueError, match="whole quantization groups"):
        weight.narrow(1, 32, 128)


def test_quantize_is_within_half_a_step_and_refuses_shapes_the_kernel_cannot_take(torch_kernel):
    method = Int4WeightOnlyMethod(group_size=32)
    w = torch.randn(32, 128)
    weight = method.quantize(w, torch.bfloat16)
    step = (w.view(32, 4, 32).amax(-1) - w.view(32, 4, 32).amin(-1)) / 15
    error = (weight.dequantize() - w).abs().view(32, 4, 32)
    # half a step, plus the bf16 rounding of the scale and zero the kernel reads
    assert (error <= (0.5 + 16 * BF16_UNIT_ROUNDOFF) * step.unsqueeze(-1) + 1e-6).all()
    with pytest.raises(ValueError, match="multiple of 16"):
        method.quantize(torch.randn(24, 128), torch.bfloat16)
    with pytest.raises(ValueError, match="quantization_group_size=32"):
        method.quantize(torch.randn(32, 48), torch.bfloat16)


def test_fused_parts_concatenate_before_packing(torch_kernel):
    data = [_blocks("Q4_1", 32, 256, seed=s) for s in range(3)]
    parts = PackedParts.cat([PACKED_TYPES["Q4_1"](d, (32, 256)) for d in data])
    weight = parts.build(torch.bfloat16, {})
    want = torch.cat([_oracle("Q4_1", d, 32, 256) for d in data])
    assert tuple(weight.shape) == (96, 256)
    zero = (parts.offset + 8 * parts.scale).abs().unsqueeze(-1)
    bound = BF16_UNIT_ROUNDOFF * ((parts.q.float().view(96, -1, 32) - 8).abs() * parts.scale.abs().unsqueeze(-1) + zero)
    assert ((weight.dequantize() - want).abs() <= bound.view(96, 256) * 1.01).all()


PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over", "Hello"]


@pytest.fixture(scope="module")
def llama256(tmp_path_factory: pytest.TempPathFactory) -> str:
    # K-quants pack 256 weights a block: every input dimension a multiple of 256
    return build_model(tmp_path_factory.mktemp("int4") / "llama256", "llama", hidden_size=256,
                       intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, seed=3)


def _teacher_forced(llm: LLM, sequences: list[list[int]], start: int) -> tuple[list[int], list[float]]:
    """Over every sequence's positions from `start` on: the greedy token, and the log-probability of the
    sequence's own token."""
    outs = llm.generate([{"prompt_token_ids": ids} for ids in sequences],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    top1, logprobs = [], []
    for ids, out in zip(sequences, outs):
        for token, ranked in zip(ids[start:], out.prompt_logprobs[start:]):
            top1.append(max(ranked, key=lambda t: ranked[t].logprob))
            logprobs.append(ranked[token].logprob)
    return top1, logprobs


def _assert_as_faithful(got: tuple[list[int], list[float]], dense: tuple[list[int], list[float]],
                        want: tuple[list[int], list[float]]) -> None:
    """`got` picks the reference's token about as often as `dense` (within 5% of the positions: near-ties
    flip either way under bf16 rounding), at 80% of positions at least, and its log-probabilities of
    the reference's tokens stay within twice `dense`'s worst deviation."""
    agree = sum(a == b for a, b in zip(got[0], want[0]))
    dense_agree = sum(a == b for a, b in zip(dense[0], want[0]))
    positions = len(want[0])
    assert agree >= dense_agree - max(1, positions // 20) and agree >= 0.8 * positions, (agree, dense_agree, positions)
    error = max(abs(a - b) for a, b in zip(got[1], want[1]))
    dense_error = max(abs(a - b) for a, b in zip(dense[1], want[1]))
    assert error <= 2 * dense_error + 0.05, (error, dense_error)


@pytest.mark.parametrize("kind", INT4_TYPES)
def test_packed_engine_is_as_faithful_as_the_dequantized_engine(llama256, tmp_path, monkeypatch, kind):
    """Teacher-forced on the fp32 dequantized engine's greedy continuations: the packed bf16 engine picks
    the reference's token about as often as the bf16 engine on dequantized weights does, and its
    log-probabilities stay as close to the reference's (_assert_as_faithful). Exact greedy equality between
    the two bf16 engines is not a property either has: on a random tiny model some steps are near-ties
    (logit gaps under 0.1), which bf16 rounding anywhere in the model flips either way."""
    path = write_gguf(llama256, str(tmp_path / f"tiny-{kind}.gguf"), kind)
    packed = LLM(model=path, dtype="bfloat16")
    layer = packed.llm_engine.model_runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.weight, INT4_WEIGHTS)
    assert isinstance(layer.mlp.down_proj.weight, INT4_WEIGHTS)
    _assert_as_faithful_as_dequantized(packed, path, monkeypatch)


def _assert_as_faithful_as_dequantized(packed: LLM, path: str, monkeypatch) -> None:
    """Teacher-forced on the fp32 dequantized engine's greedy continuations, `packed` is as faithful to it as
    the bf16 engine on dequantized weights (_assert_as_faithful)."""
    monkeypatch.setenv("PAGEDLLM_GGUF_DEQUANTIZE", "1")
    reference = LLM(model=path, dtype="float32")
    tokenizer = reference.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    sequences = [tokenizer(p).input_ids + list(o.outputs[0].token_ids)
                 for p, o in zip(PROMPTS, reference.generate(PROMPTS, params, use_tqdm=False))]
    start = 1
    want = _teacher_forced(reference, sequences, start)
    del reference
    dense = LLM(model=path, dtype="bfloat16")
    assert isinstance(dense.llm_engine.model_runner.model.layers[0].mlp.down_proj.weight, torch.Tensor)
    dense_result = _teacher_forced(dense, sequences, start)
    del dense
    _assert_as_faithful(_teacher_forced(packed, sequences, start), dense_result, want)


@pytest.mark.skipif(not kernel_enabled(torch.bfloat16), reason="mixed and 5-/6-bit types need the VNNI kernel")
def test_a_file_that_mixes_block_types_stays_packed_in_its_own_bits(llama256, tmp_path, monkeypatch):
    """A Q4_K_M-like file (q and k in Q5_0, v in Q8_0, down in Q6_K, the rest Q4_K): every projection stays
    packed, a fused one whose parts differ in the widest part's bits (qkv: 8-bit, symmetric since every part
    is), the file's own bits elsewhere, and the engine is as faithful as the dequantized one."""
    types = {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q8_0", "ffn_down.weight": "Q6_K"}
    path = write_gguf(llama256, str(tmp_path / "tiny-mixed.gguf"), "Q4_K", tensor_types=types)
    packed = LLM(model=path, dtype="bfloat16")
    layer = packed.llm_engine.model_runner.model.layers[0]
    qkv, down, gate_up = (layer.self_attn.qkv_proj.weight, layer.mlp.down_proj.weight, layer.mlp.gate_up_proj.weight)
    assert all(isinstance(w, VnniWeight) for w in (qkv, down, gate_up))
    assert (qkv.bits, qkv.symmetric, qkv.group_size) == (8, True, 32)
    assert (down.bits, down.symmetric, down.group_size) == (6, True, 16)
    assert (gate_up.bits, gate_up.symmetric) == (4, False)
    assert layer.mlp.down_proj.matmul is vnni_matmul  # the kernel, chosen at load
    # every packed weight in one buffer (huge pages where Linux gives them), in the forward pass's order
    weights = [m for m in packed.llm_engine.model_runner.model.modules() if isinstance(m, VnniWeight)]
    assert len({w.qweight.untyped_storage().data_ptr() for w in weights}) == 1
    starts = [w.qweight.data_ptr() for w in weights]
    assert starts == sorted(starts)
    _assert_as_faithful_as_dequantized(packed, path, monkeypatch)


@pytest.mark.skipif(not kernel_enabled(torch.float32), reason="no AVX2 + FMA + F16C (or kernels not built)")
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q6_K", "Q8_0", "mixed"])
def test_fp32_models_keep_files_packed_and_compute_what_dequantizing_does(llama256, tmp_path, monkeypatch, kind):
    """An fp32 model keeps every block type packed (a Q4_K_M-like mix too) and multiplies in fp32: its greedy
    tokens and teacher-forced top-1 equal the dequantized fp32 engine's, and its log-probabilities match up
    to fp32 rounding. This random model's logits span about 90 nats, and the kernel sums each group in the
    factored form (sum(q * x) * scale + min * sum(x), where the two terms may cancel), so the bound is a
    fraction of that span (measured: up to 1.6e-4 of it, for a qkv merged from Q4_K and Q8_0)."""
    types = {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q8_0", "ffn_down.weight": "Q6_K"}
    path = write_gguf(llama256, str(tmp_path / f"tiny-{kind}.gguf"), "Q4_K" if kind == "mixed" else kind,
                      tensor_types=types if kind == "mixed" else None)
    packed = LLM(model=path, dtype="float32")
    layer = packed.llm_engine.model_runner.model.layers[0]
    weights = (layer.self_attn.qkv_proj.weight, layer.mlp.down_proj.weight, layer.mlp.gate_up_proj.weight)
    assert all(isinstance(w, VnniWeight) for w in weights)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in packed.generate(PROMPTS, params, use_tqdm=False)]
    tokenizer = packed.get_tokenizer()
    sequences = [tokenizer(p).input_ids + ids for p, ids in zip(PROMPTS, got)]
    got_top1, got_logprobs = _teacher_forced(packed, sequences, 1)
    del packed
    monkeypatch.setenv("PAGEDLLM_GGUF_DEQUANTIZE", "1")
    reference = LLM(model=path, dtype="float32")
    assert isinstance(reference.llm_engine.model_runner.model.layers[0].mlp.down_proj.weight, torch.Tensor)
    want = [list(o.outputs[0].token_ids) for o in reference.generate(PROMPTS, params, use_tqdm=False)]
    want_top1, want_logprobs = _teacher_forced(reference, sequences, 1)
    assert got == want and got_top1 == want_top1
    span = max(abs(v) for v in want_logprobs)
    assert max(abs(a - b) for a, b in zip(got_logprobs, want_logprobs)) <= 3e-4 * span


# ---- compressed-tensors W4A16 (pack-quantized), the library's own compressor and decompressor as oracle ----

def _w4a16_scheme(symmetric: bool, group_size: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def _w4a16_compress(weight: torch.Tensor, symmetric: bool, group_size: int) -> dict[str, torch.Tensor]:
    """The library's compressed tensors of one weight, with min/max scales (and zero points)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    state = {"weight": weight}
    if symmetric:
        state["weight_scale"] = (groups.abs().amax(-1) / 7.5).to(weight.dtype)
    else:
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).to(weight.dtype)
        state["weight_scale"] = scale
        state["weight_zero_point"] = torch.clamp(torch.round(-low / scale.float()) - 8, -8, 7).to(torch.int8)
    return PackedQuantizationCompressor.compress(state, _w4a16_scheme(symmetric, group_size))


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_reads_as_the_compressed_tensors_library_decompresses(symmetric, torch_kernel):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    from pagedllm.layers.quantization.compressed_tensors import read_int4

    n, k, group = 48, 256, 128
    compressed = _w4a16_compress(torch.randn(n, k).to(torch.bfloat16), symmetric, group)
    assert ("weight_zero_point" in compressed) != symmetric
    want = PackedQuantizationCompressor.decompress(dict(compressed), _w4a16_scheme(symmetric, group))["weight"]
    q, scale, offset = read_int4("p", lambda name: compressed[name.removeprefix("p.")], {f"p.{k}" for k in compressed})
    exact = (q.float().view(n, -1, group) * scale.unsqueeze(-1) + offset.unsqueeze(-1)).view(n, k)
    # the library multiplies in the scale's dtype (bf16): one rounding of our exact fp32 value
    assert torch.equal(exact.to(want.dtype), want)
    weight = Int4WeightOnlyMethod(group).create(q, scale, offset)
    zero = (offset + 8 * scale).abs().unsqueeze(-1)
    bound = BF16_UNIT_ROUNDOFF * ((q.float().view(n, -1, group) - 8).abs() * scale.abs().unsqueeze(-1) + zero)
    assert ((weight.dequantize() - exact).abs() <= bound.view(n, k) * 1.01).all()


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_checkpoint_loads_packed_and_is_as_faithful_as_its_dequantized_copy(llama256, tmp_path, symmetric):
    """A checkpoint written by the compressed-tensors library (group 128) loads into the int4 kernel; its
    teacher-forced tokens against the library-dequantized checkpoint in fp32 are as close as that
    checkpoint's own in bf16."""
    import json
    import shutil

    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from safetensors.torch import load_file, save_file

    from pagedllm.layers.quantization.compressed_tensors import build_quantization_config, is_projection_weight

    quantized_dir, dequantized_dir = tmp_path / "w4a16", tmp_path / "dequantized"
    shutil.copytree(llama256, quantized_dir)
    shutil.copytree(llama256, dequantized_dir)
    tensors = load_file(str(quantized_dir / "model.safetensors"))
    packed, dense = {}, {}
    for name, tensor in tensors.items():
        if is_projection_weight(name):
            compressed = _w4a16_compress(tensor.to(torch.bfloat16), symmetric, 128)
            prefix = name.removesuffix(".weight")
            packed.update({f"{prefix}.{key}": value for key, value in compressed.items()})
            dense[name] = PackedQuantizationCompressor.decompress(
                dict(compressed), _w4a16_scheme(symmetric, 128))["weight"].to(tensor.dtype)
        else:
            packed[name] = dense[name] = tensor
    save_file(packed, str(quantized_dir / "model.safetensors"))
    save_file(dense, str(dequantized_dir / "model.safetensors"))
    config = json.loads((quantized_dir / "config.json").read_text())
    quantization_config = build_quantization_config(QuantizationConfig("int8", 128))
    quantization_config["config_groups"]["group_0"]["weights"].update(num_bits=4, symmetric=symmetric)
    config["quantization_config"] = quantization_config
    (quantized_dir / "config.json").write_text(json.dumps(config))

    packed_llm = LLM(model=str(quantized_dir), dtype="bfloat16")
    assert isinstance(packed_llm.llm_engine.model_runner.model.layers[0].self_attn.qkv_proj.weight, INT4_WEIGHTS)
    reference = LLM(model=str(dequantized_dir), dtype="float32")
    tokenizer = reference.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    sequences = [tokenizer(p).input_ids + list(o.outputs[0].token_ids)
                 for p, o in zip(PROMPTS, reference.generate(PROMPTS, params, use_tqdm=False))]
    want_top1, want_lp = _teacher_forced(reference, sequences, 1)
    del reference
    dense_top1, dense_lp = _teacher_forced(LLM(model=str(dequantized_dir), dtype="bfloat16"), sequences, 1)
    got_top1, got_lp = _teacher_forced(packed_llm, sequences, 1)
    _assert_as_faithful((got_top1, got_lp), (dense_top1, dense_lp), (want_top1, want_lp))


def test_quantize_command_writes_w4a16_the_library_reads(llama256, tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from safetensors.torch import load_file

    from pagedllm.entrypoints.cli import main

    out = tmp_path / "int4"
    assert main(["quantize", llama256, str(out), "--quantization", "int4", "--group-size", "128"]) == 0
    import json

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (config["format"], weights["num_bits"], weights["group_size"], weights["symmetric"]) == \
        ("pack-quantized", 4, 128, False)
    original, written = load_file(f"{llama256}/model.safetensors"), load_file(str(out / "model.safetensors"))
    llm = LLM(model=str(out), dtype="bfloat16")
    down = llm.llm_engine.model_runner.model.layers[0].mlp.down_proj.weight
    assert isinstance(down, INT4_WEIGHTS) and down.group_size == 128
    prefix = "model.layers.0.mlp.down_proj"
    tensors = {key.removeprefix(prefix + "."): value for key, value in written.items() if key.startswith(prefix + ".")}
    want = PackedQuantizationCompressor.decompress(tensors, _w4a16_scheme(False, 128))["weight"].float()
    full = original[f"{prefix}.weight"].float()
    step = tensors["weight_scale"].float().repeat_interleave(128, dim=1)
    assert ((want - full).abs() <= 0.5 * step * 1.01 + 1e-6).all()  # within half a step of the original
    assert ((down.dequantize() - want).abs() <= 2 * BF16_UNIT_ROUNDOFF * (want.abs() + 8 * step)).all()
    out_text = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out_text[0].outputs[0].token_ids) == 4
