"""A GGUF file's block-quantized token embedding stays in its type (issue 41): each lookup dequantizes
only the rows asked for, bit for bit as llama.cpp's reference (`gguf.quants.dequantize`) does, the tokens
are those of the dense embedding, and tools/model_memory.py counts what loading the model adds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from gguf_models import write_gguf
from test_int4 import _oracle
from test_vnni_kernel import _gguf_blocks
from tiny_models import build_model

from pagedllm import LLM, SamplingParams
from pagedllm.models.gguf import PACKED_TYPES, GGUFRows, GGUFTensor, GGUFTensorIndex

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 17, 30, 41, 2, 9], [100, 200, 300], list(range(40, 75))]


@pytest.mark.parametrize("kind", sorted(PACKED_TYPES))
def test_lookup_equals_llama_cpp_dequantization_bit_for_bit(kind: str) -> None:
    n, k = 40, 256
    data = _gguf_blocks(kind, n, k, seed=0)
    rows = GGUFRows(torch.from_numpy(np.ascontiguousarray(data)), kind, k)
    ids = torch.tensor([3, 0, 39, 3, 17])
    got = rows(ids)
    assert got.dtype == torch.float32 and torch.equal(got, _oracle(kind, data, n, k)[ids])
    assert rows.raw.numel() == data.size  # the file's bytes, no more


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K", "BF16", "F16"])
def test_tensor_index_reads_the_tensors_gguf_reader_reads(tmp_path: Path, weight_type: str) -> None:
    """The loader's header-only reader (it skips the metadata arrays GGUFReader builds) gives the same
    tensors: names, types, shapes and the same bytes of the mapped file."""
    model = build_model(tmp_path / "llama256", "llama", hidden_size=256, intermediate_size=512, seed=3)
    path = write_gguf(model, str(tmp_path / f"tiny-{weight_type}.gguf"), weight_type)
    reader, index = GGUFReader(path), GGUFTensorIndex(path)
    assert index.fields["general.architecture"] == "llama"
    assert len(index.tensors) == len(reader.tensors)
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert (ours.name, ours.tensor_type, list(ours.shape)) == (theirs.name, theirs.tensor_type,
                                                                 [int(d) for d in theirs.shape])
        assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data)


@pytest.fixture(scope="module")
def tied_qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("gguf_embedding")
    return build_model(root / "qwen2", "qwen2", tie_word_embeddings=True, seed=1)


def _token_embd(path: str) -> np.ndarray:
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    return dequantize(tensor.data, GGMLQuantizationType[tensor.tensor_type.name]).reshape(tensor.shape[::-1])


def test_tied_embedding_stays_quantized_and_tokens_are_unchanged(tied_qwen2: str, tmp_path: Path,
                                                                monkeypatch) -> None:
    """torch's kernels (PAGEDLLM_QUANT_KERNEL=torch): the embedding keeps the file's Q8_0 rows, the LM head
    one dense copy, and the tokens and logprobs are those of the dense-embedding engine, bit for bit."""
    monkeypatch.setenv("PAGEDLLM_QUANT_KERNEL", "torch")
    path = write_gguf(tied_qwen2, str(tmp_path / "tiny-Q8_0.gguf"), "Q8_0")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    llm = LLM(model=path, dtype="float32", block_size=8, max_model_len=128)
    model = llm.llm_engine.model_runner.model
    embedding = model.embed_tokens
    assert isinstance(embedding.quantized_rows, GGUFRows) and embedding.weight is None
    assert embedding.quantized_rows.type_name == "Q8_0"
    assert model.lm_head.packed_weight is not None and model.lm_head.weight is None  # one LM head copy
    ids = torch.tensor([0, 7, 300, 7, 511])
    assert torch.equal(embedding(ids), torch.from_numpy(_token_embd(path))[ids].to(embedding.dtype))
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    del llm

    monkeypatch.setattr(GGUFTensor, "quantized_rows", lambda self, start, stop: None)  # the dense embedding
    dense = LLM(model=path, dtype="float32", block_size=8, max_model_len=128)
    assert dense.llm_engine.model_runner.model.embed_tokens.quantized_rows is None
    want = [o.outputs[0] for o in dense.generate(PROMPTS, params, use_tqdm=False)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.cumulative_logprob for g in got] == [w.cumulative_logprob for w in want]  # the same bits


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_1"])
def test_tied_table_is_one_copy_the_lm_head_multiplies_as_stored(tied_qwen2: str, tmp_path: Path,
                                                                weight_type: str, dtype: str) -> None:
    """Where pagedllm's kernel runs for the dtype (bf16: AVX512-VNNI; fp32: AVX2): the LM head multiplies by
    the file's table as stored and the embedding reads its rows from that one copy, exactly as llama.cpp
    dequantizes them; the logits are the dequantized table's within the kernel's activation rounding (bf16)
    or fp32 rounding (fp32)."""
    from pagedllm.layers.quantization.vnni import VnniRows, VnniWeight, kernel_enabled

    if not kernel_enabled(getattr(torch, dtype)):
        pytest.skip(f"pagedllm's quantized kernel does not run {dtype} on this CPU")
    path = write_gguf(tied_qwen2, str(tmp_path / f"tiny-{weight_type}.gguf"), weight_type)
    llm = LLM(model=path, dtype=dtype, block_size=8, max_model_len=128)
    model = llm.llm_engine.model_runner.model
    embedding, lm_head = model.embed_tokens, model.lm_head
    assert isinstance(lm_head.quantized_weight, VnniWeight) and isinstance(embedding.quantized_rows, VnniRows)
    assert embedding.weight is None and lm_head.weight is None and lm_head.packed_weight is None
    table = torch.from_numpy(_token_embd(path))
    ids = torch.tensor([0, 7, 300, 7, 511, 16, 15])
    assert torch.equal(embedding.quantized_rows(ids), table[ids])
    hidden = torch.randn(5, table.shape[1], generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    logits = lm_head.compute_logits(hidden)
    want = hidden.float() @ table.T
    tolerance = 2e-2 if dtype == "bfloat16" else 1e-5
    assert torch.allclose(logits, want, atol=tolerance * float(want.abs().max()), rtol=0)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)


def test_model_memory_tool_counts_the_quantized_embedding(tied_qwen2: str, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("model_memory", ROOT / "tools" / "model_memory.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # its dataclass looks its module up there
    spec.loader.exec_module(tool)
    path = write_gguf(tied_qwen2, str(tmp_path / "tiny-Q8_0.gguf"), "Q8_0")
    report = tool.measure(path, "float32")
    assert report.file_mib > 0 and report.tensors_mib > 0
    assert "KV cache: not allocated (excluded)" in report.describe()
