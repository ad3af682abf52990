"""Tensor parallelism over quantized weights (issue 41): a TP-2 engine over real gloo processes gives the
TP-1 engine's greedy tokens on the same quantized model (int8 and int4 checkpoints written by `pagedllm
quantize`, int8 quantized on load, GGUF Q8_0 and Q4_1 kept packed), and each rank holds half of every
quantized projection; a shard that would split a quantization group is a ValueError naming the weight.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_models import write_gguf
from test_int4 import _blocks, _oracle
from tiny_models import build_model

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import WeightShard
from pagedllm.layers.quantization import QuantizedWeight
from pagedllm.models.gguf import INT4_TYPES, PACKED_TYPES, GGUFCheckpoint
from pagedllm.models.quantized_parts import QuantizedParts

PROMPTS = [[5, 17, 30, 41, 2, 9], [100, 200, 300], list(range(40, 75)), [7, 300, 12, 450, 81]]
ENGINE_ARGS = dict(block_size=8, max_model_len=128, max_num_batched_tokens=24, enable_chunked_prefill=True)


def _quantized_checkpoint(model_dir: str, out: Path, method: str, group: int) -> str:
    from pagedllm.entrypoints.cli import main

    assert main(["quantize", model_dir, str(out), "--quantization", method,
                 "--quantization-group-size", str(group)]) == 0
    return str(out)


def _projection_bytes(llm: LLM) -> list[int]:
    """Per rank: bytes of the quantized projections it holds (none of them left in full precision)."""
    return [info["quantized_weight_bytes"] for info in llm.llm_engine.model_executor.collective_rpc("shard_info")]


# bf16 models: a row-parallel projection's partial sums are rounded to bf16 on each rank before the
# all-reduce adds them, so logits move by about bf16's rounding (as on the dense bf16 engine); a random
# tiny model's top two logits are often that close. There the tokens must agree up to the first step
# whose TP-1 margin is under this, and most steps must have a wider margin. The logits are bf16 values,
# 1/32 apart at this model's magnitudes (4 to 8): each of the two can move a step, so a margin of two
# steps (0.0625) can flip, and was seen to (activation blocks of 64 under TP 1, of 32 on each rank).
BF16_TIE_MARGIN = 0.07


def _agreed_prefix(want, got, dtype: str) -> int:
    """How many greedy tokens must agree: all in fp32, up to the first near-tie in bf16."""
    if dtype == "float32":
        return len(want.token_ids)
    for step, logprobs in enumerate(want.logprobs):
        top = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
        if top[0] - top[1] < BF16_TIE_MARGIN:
            return step
    return len(want.token_ids)


def _check_tp2_equals_tp1(model: str, dtype: str, **kwargs) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    reference = LLM(model=model, dtype=dtype, **ENGINE_ARGS, **kwargs)
    want = [o.outputs[0] for o in reference.generate(PROMPTS, params, use_tqdm=False)]
    whole = _projection_bytes(reference)[0]
    del reference
    llm = LLM(model=model, dtype=dtype, tensor_parallel_size=2, **ENGINE_ARGS, **kwargs)
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    compared = 0
    for w, g in zip(want, got):
        n = _agreed_prefix(w, g, dtype)
        assert g.token_ids[:n] == w.token_ids[:n]
        compared += n
    assert compared >= len(PROMPTS) * params.max_tokens // 3
    per_rank = _projection_bytes(llm)
    assert whole > 0 and per_rank == [whole // 2, whole // 2]  # values and group scales split in halves


@pytest.mark.parametrize("method,dtype,group", [("int8", "float32", 32), ("int4", "bfloat16", 32)])
def test_quantized_checkpoint_tp2_equals_tp1(tiny_llama_dir: str, tmp_path: Path, method: str, dtype: str,
                                             group: int) -> None:
    _check_tp2_equals_tp1(_quantized_checkpoint(tiny_llama_dir, tmp_path / method, method, group), dtype)


@pytest.mark.parametrize("weight_type,dtype", [("Q8_0", "float32"), ("Q4_1", "bfloat16")])
def test_gguf_packed_tp2_equals_tp1(tiny_llama_dir: str, tmp_path: Path, weight_type: str, dtype: str) -> None:
    _check_tp2_equals_tp1(write_gguf(tiny_llama_dir, str(tmp_path / f"tiny-{weight_type}.gguf"), weight_type),
                          dtype)


def test_phi3_fused_checkpoint_tensors_quantized_on_load_tp2_equals_tp1(tmp_path: Path) -> None:
    """Phi-3 stores q|k|v and gate|up fused: a rank's ranges of each part are cut from the one tensor."""
    model = build_model(tmp_path / "phi3", "phi3", seed=0)
    _check_tp2_equals_tp1(model, "float32", quantization="int8", quantization_group_size=32)


def test_group_split_by_a_rank_is_refused_at_start_up(tiny_llama_dir: str) -> None:
    # o_proj has 64 input features: 32 per rank, half of a group of 64
    with pytest.raises(ValueError, match=r"quantization_group_size \(64\).*o_proj\.weight"):
        LLM(model=tiny_llama_dir, dtype="bfloat16", tensor_parallel_size=2, quantization="int4",
            quantization_group_size=64)


def test_narrow_names_the_weight_whose_group_it_would_split() -> None:
    parts = QuantizedParts("int8", torch.zeros(4, 256, dtype=torch.int8), torch.ones(4, 2))
    assert parts.narrow(1, 128, 128, "w").q.shape == (4, 128)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight'.*groups of 128"):
        parts.narrow(1, 64, 64, "model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="group"):
        QuantizedWeight(parts.q, parts.scale, None).narrow(1, 64, 64)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("dim", [0, 1])
def test_a_rank_packs_exactly_its_part_of_the_file_blocks(kind: str, dim: int) -> None:
    """Rank 1 of 2 cuts its rows (or whole groups of columns) from the re-laid blocks and packs only them:
    its weight dequantizes to that part of llama.cpp's own dequantization, bit for bit."""
    n, k = 64, 512
    data = _blocks(kind, n, k)
    want = _oracle(kind, data, n, k)
    half = (n, k)[dim] // 2
    if dim == 0:
        parts = PACKED_TYPES[kind](data[half:], (half, k))
    else:
        parts = PACKED_TYPES[kind](data, (n, k)).narrow(1, half, half, "w")
    weight = parts.build(torch.bfloat16 if kind != "Q8_0" else torch.float32, {})
    got = weight.dequantize(torch.float32)
    if kind in INT4_TYPES:  # the kernel's bf16 scale and zero: compare the exact parts instead
        q = parts.q.float().view(got.shape[0], -1, 32)
        got = (q * parts.scale.unsqueeze(-1) + parts.offset.unsqueeze(-1)).view(got.shape)
        assert tuple(weight.shape) == tuple(got.shape)
    assert torch.equal(got, want.narrow(dim, half, half))


def test_gguf_rank_columns_inside_a_block_are_a_named_error(tiny_llama_dir: str, tmp_path: Path) -> None:
    path = write_gguf(tiny_llama_dir, str(tmp_path / "tiny-Q8_0.gguf"), "Q8_0")
    from pagedllm.config import ModelConfig

    checkpoint = GGUFCheckpoint(path, ModelConfig.from_pretrained(path, dtype="float32").hf_config)
    name = "model.layers.0.self_attn.o_proj.weight"
    dst = torch.empty(64, 16)
    with pytest.raises(ValueError, match=r"o_proj\.weight.*groups of 32"):
        checkpoint.load_linear(dst, (name,), WeightShard(1, ((16, 16),)))
    assert np.asarray(checkpoint.get_slice(name).rows()).dtype == np.uint8  # the file's blocks, untouched
