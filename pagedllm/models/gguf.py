"""GGUF checkpoints (llama.cpp's one-file format): config, tokenizer and weights from a `.gguf` file.

The file is read with the `gguf` package (llama.cpp's own reader); the Hugging Face config and the
tokenizer are built from its metadata by transformers (`from_pretrained(dir, gguf_file=...)`), as vLLM
does. The model then loads through the same `load_weights(get_slice, names)` as a safetensors checkpoint:
`get_slice` answers Hugging Face names from the file's tensors (gguf's own name map), with llama.cpp's
permutation of the Llama q/k rows undone. F32/F16/BF16 tensors load as they are; a block type with a
packed weight kernel stays packed: Q8_0 (int8 with one scale per 32 weights), Q4_0, Q4_1 and Q4_K (int4
with a scale and an offset per 32 weights, layers/quantization/int4.py; with torch's int4 kernel, in bf16
models only), and, where pagedllm's VNNI kernel runs (layers/quantization/vnni.py), Q5_0, Q5_1, Q5_K (5-bit)
and Q6_K (6-bit, groups of 16) as stored, and a fused projection whose parts mix types in the widest of
them, so a Q4_K_M file stays packed whole in about its own size. Every other block type, and every one
under PAGEDLLM_GGUF_DEQUANTIZE=1, is dequantized into the model dtype on load.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm import envs
from pagedllm.distributed.parallel_state import WeightShard
from pagedllm.layers.module import Module
from pagedllm.layers.quantization.base import dequantize_groups
from pagedllm.models.quantized_parts import QuantizedParts
from pagedllm.platform import release_free_heap_memory

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"

# transformers' model_type for a GGUF architecture -> the Hugging Face architecture pagedllm serves it as
_MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# GGUF architectures whose converter permuted the q/k rows for llama.cpp's RoPE layout (as transformers,
# our oracle, undoes it: its Llama tensor processor)
_PERMUTED_QK_ARCHS = ("llama",)
# GGUF architectures whose converter stored each RMSNorm weight as the (1 + weight) Gemma multiplies by:
# given back here as the checkpoint's own weight (transformers' Gemma2 tensor processor does the same)
_OFFSET_NORM_ARCHS = ("gemma2", "gemma3")

_UNQUANTIZED = ("F32", "F16", "BF16")
TRIM_EVERY_BYTES = 64 << 20  # freed load-time buffers handed back to the OS after about this many


def is_gguf_path(model: str) -> bool:
    return model.endswith(GGUF_SUFFIX)


def resolve_gguf_file(model: str) -> str | None:
    """The .gguf file `model` names: the file itself, or the one .gguf in a directory without a
    config.json; None for a Hugging Face directory. ValueError when it cannot be one file."""
    if os.path.isfile(model) and is_gguf_path(model):
        if re.search(r"-\d{5}-of-\d{5}\.gguf$", model):
            raise ValueError(f"model {model!r} is one part of a split GGUF file; merge the parts first "
                             "(llama.cpp's `llama-gguf-split --merge`) and pass the merged file.")
        return model
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        found = sorted(f for f in os.listdir(model) if is_gguf_path(f))
        if len(found) == 1:
            return resolve_gguf_file(os.path.join(model, found[0]))
        if len(found) > 1:
            raise ValueError(f"model directory {model!r} holds {len(found)} GGUF files ({', '.join(found)}); "
                             "pass the path of the one to load as model.")
    return None


def gguf_model_name(path: str) -> str:
    """The served model name of a GGUF file: its file name without the extension."""
    return os.path.basename(path).removesuffix(GGUF_SUFFIX)


def _check_gguf_installed() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as exc:  # pragma: no cover - gguf is a dependency
        raise ValueError("loading a .gguf model needs the `gguf` package: pip install gguf") from exc


def read_hf_config(path: str) -> dict[str, Any]:
    """The Hugging Face config.json the file's metadata stands for, with `architectures` set."""
    _check_gguf_installed()
    from transformers import AutoConfig

    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    try:
        hf = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                        gguf_file=os.path.basename(path)).to_dict()
    except (ValueError, KeyError) as exc:
        raise ValueError(f"GGUF architecture {arch!r} of {path!r} is not supported ({exc}); supported: "
                         f"{', '.join(sorted(set(_MODEL_TYPE_TO_ARCHITECTURE)))}.") from exc
    model_type = hf.get("model_type", arch)
    experts = _field(reader, f"{arch}.expert_count")
    if model_type == "llama" and experts:  # llama.cpp writes Mixtral as a Llama with experts
        hf.update(model_type="mixtral", num_local_experts=int(experts),
                  num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count")))
        hf["architectures"] = ["MixtralForCausalLM"]
    elif model_type in _MODEL_TYPE_TO_ARCHITECTURE:
        hf["architectures"] = [_MODEL_TYPE_TO_ARCHITECTURE[model_type]]
    else:
        raise ValueError(f"GGUF architecture {arch!r} of {path!r} is not supported; supported: "
                         f"{', '.join(sorted(set(_MODEL_TYPE_TO_ARCHITECTURE)))}.")
    if model_type == "gemma3_text":
        _read_gemma3_rope(reader, arch, hf)
    if model_type == "gemma2":
        # transformers' metadata map leaves these out; llama.cpp's converter writes them
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = _field(reader, f"{arch}.{key}")
            if value is not None:
                hf[key] = float(value)
    if model_type in ("gemma2", "gemma3_text"):
        hf["query_pre_attn_scalar"] = _gemma_query_scalar(hf)
    if model_type == "qwen3_moe":
        expert_ffn = _field(reader, f"{arch}.expert_feed_forward_length")
        if expert_ffn:  # transformers' metadata map leaves it out and falls back to its default (768)
            hf["moe_intermediate_size"] = int(expert_ffn)
    if model_type == "phi3":
        _read_phi3(reader, arch, hf)
    hf["dtype"] = _checkpoint_dtype(reader)
    names = {t.name for t in reader.tensors}
    hf["tie_word_embeddings"] = "output.weight" not in names
    for key, meta in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        value = _field(reader, meta)
        if value is not None:
            hf[key] = int(value)
    return hf


def _read_gemma3_rope(reader, arch: str, hf: dict[str, Any]) -> None:
    """Gemma 3's global-layer RoPE scaling (4B and up: linear, factor 8) and local-layer base, which
    llama.cpp's converter writes and transformers' metadata map leaves out."""
    params = hf.setdefault("rope_parameters", {})
    full = params.setdefault("full_attention", {"rope_type": "default"})
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if scaling == "linear" and factor:
        full.update(rope_type="linear", factor=float(factor))
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type {scaling!r} is not supported for Gemma 3 (linear only).")
    local_base = _field(reader, f"{arch}.rope.freq_base_swa")
    if local_base:
        params.setdefault("sliding_attention", {"rope_type": "default"})["rope_theta"] = float(local_base)


def _gemma_query_scalar(hf: dict[str, Any]) -> float:
    """Gemma's attention scale 1 / sqrt(query_pre_attn_scalar), which the file does not store: llama.cpp
    takes hidden_size / heads for the 27B models (Gemma 2: 46 layers, 144; Gemma 3: 62 layers, 168) and
    the head size for the others, whose checkpoints give that value."""
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    layers_27b = 46 if hf.get("model_type") == "gemma2" else 62
    if int(hf["num_hidden_layers"]) == layers_27b:
        return float(hidden // heads)
    return float(hf.get("head_dim") or hidden // heads)


def _read_phi3(reader, arch: str, hf: dict[str, Any]) -> None:
    """Phi-3's partial rotary (Phi-4-mini), sliding window and LongRoPE factors (the 128k models, Phi-3.5),
    which llama.cpp's converter writes (the factors as two tensors) and transformers' metadata map leaves
    out."""
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    rotary_dims = _field(reader, f"{arch}.rope.dimension_count")
    if rotary_dims and int(rotary_dims) != head_dim:
        hf["partial_rotary_factor"] = int(rotary_dims) / head_dim
        if isinstance(hf.get("rope_parameters"), dict):  # (transformers writes its default 1.0 there)
            hf["rope_parameters"]["partial_rotary_factor"] = hf["partial_rotary_factor"]
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window:
        hf["sliding_window"] = int(window)
    factors = {t.name: t for t in reader.tensors if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if len(factors) == 2:
        params = dict(hf.get("rope_parameters") or {})
        params.update(rope_type="longrope",
                      long_factor=[float(v) for v in factors["rope_factors_long.weight"].data],
                      short_factor=[float(v) for v in factors["rope_factors_short.weight"].data])
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            hf["original_max_position_embeddings"] = int(original)
        attn_factor = _field(reader, f"{arch}.rope.scaling.attn_factor")
        if attn_factor:
            params["attention_factor"] = float(attn_factor)
        hf["rope_parameters"] = params
        hf.pop("rope_scaling", None)


def stored_weight_bytes(path: str) -> tuple[int, int]:
    """(every tensor's bytes as the file stores them, the bytes a decode step reads): what the engine holds
    and streams when it keeps the file's block types packed. An untied token embedding is left out of the
    second (a step reads a row of it per token)."""
    index = GGUFTensorIndex(path)
    sizes = {t.name: t.nbytes for t in index.tensors}
    total = sum(sizes.values())
    untied_embedding = sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0
    return total, total - untied_embedding


def _checkpoint_dtype(reader) -> str:
    """The dtype `auto` means for this file: its own float type, bfloat16 for block-quantized files."""
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    if kinds and set(kinds) <= set(_UNQUANTIZED):
        return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[kinds.most_common(1)[0][0]]
    return "bfloat16"


def load_gguf_tokenizer(path: str):
    """The tokenizer built from the file's metadata (vocabulary, merges, special tokens, chat template)."""
    _check_gguf_installed()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))


def _reader(path: str):
    from gguf import GGUFReader

    return GGUFReader(path, "r")


@dataclass
class _TensorInfo:
    """One tensor of a GGUF file as GGUFReader describes it: `shape` innermost first, `data` a read-only
    view of the mapped file (uint8 block bytes [..., bytes per row] for block types)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int = 0  # where its bytes start in the file
    nbytes: int = 0


# GGUF metadata value types -> bytes of one value (8: string, 9: array, read by length)
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class GGUFTensorIndex:
    """The file's tensors and its few scalar metadata values, read from the header of the mapped file.
    GGUFReader turns every metadata value into numpy views, the tokenizer's tens of thousands of strings
    among them (about 140 MiB of objects for SmolLM2's 94 MiB file, all freed again after loading);
    loading weights needs only the tensor directory, so arrays are skipped here, never built."""

    def __init__(self, path: str):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        with open(path, "rb") as f:
            self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.map = np.frombuffer(self.mmap, dtype=np.uint8)
        self.offset = 0
        if self._u32() != 0x46554747 or self._u32() not in (2, 3):  # b"GGUF"; version
            raise ValueError(f"{path!r} is not a little-endian GGUF file of version 2 or 3.")
        num_tensors, num_fields = self._u64(), self._u64()
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._str()
            value = self._value(self._u32())
            if value is not None:
                self.fields[key] = value
        infos = []
        for _ in range(num_tensors):
            name = self._str()
            dims = tuple(self._u64() for _ in range(self._u32()))
            infos.append((name, GGMLQuantizationType(self._u32()), dims, self._u64()))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self.offset // alignment) * alignment
        self.tensors = []
        for name, qtype, dims, offset in infos:
            shape = tuple(reversed(dims))
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims)) * type_size // block_size
            begin = start + offset
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                dtype = np.float32 if qtype == GGMLQuantizationType.F32 else np.float16
                data = self.map[begin:begin + count].view(dtype).reshape(shape)
            else:
                data = self.map[begin:begin + count].reshape(quant_shape_to_byte_shape(shape, qtype))
            self.tensors.append(_TensorInfo(name, qtype, dims, data, begin, count))

    def release(self, tensor: _TensorInfo, begin: int = 0, end: int | None = None) -> None:
        """Drop the mapped pages of bytes [begin, end) of a tensor (all of it by default) from this
        process's resident set once they are copied or re-laid; the file stays in the page cache, and
        readable should anything read them again."""
        page = mmap.PAGESIZE
        first = -(-(tensor.offset + begin) // page) * page  # whole pages inside the range only
        last = (tensor.offset + (tensor.nbytes if end is None else end)) // page * page
        if last > first and hasattr(mmap, "MADV_DONTNEED"):
            self.mmap.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _take(self, nbytes: int) -> np.ndarray:
        out = self.map[self.offset:self.offset + nbytes]
        self.offset += nbytes
        return out

    def _u32(self) -> int:
        return int(self._take(4).view("<u4")[0])

    def _u64(self) -> int:
        return int(self._take(8).view("<u8")[0])

    def _str(self) -> str:
        return bytes(self._take(self._u64())).decode("utf-8")

    def _value(self, kind: int) -> Any:
        """A scalar or string value; an array is skipped (None)."""
        if kind == _GGUF_STRING:
            return self._str()
        if kind == _GGUF_ARRAY:
            item_kind, count = self._u32(), self._u64()
            if item_kind == _GGUF_STRING:
                for _ in range(count):
                    self.offset += 8 + int(self.map[self.offset:self.offset + 8].view("<u8")[0])
            elif item_kind == _GGUF_ARRAY:
                for _ in range(count):
                    self._value(_GGUF_ARRAY)
            else:
                self.offset += count * _GGUF_SCALAR_BYTES[item_kind]
            return None
        raw = self._take(_GGUF_SCALAR_BYTES[kind])
        return raw.view({0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                         10: "<u8", 11: "<i8", 12: "<f8"}[kind])[0].item()


def _field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


# ---- weights ----

# A packed block type -> a function (raw rows [N, bytes] uint8, logical shape [N, K]) -> the weight in a
# form its kernel's weight is built from (PackedParts), for block types read without dequantizing.
# The parts of a fused projection are concatenated along the output rows before the weight is built.


@dataclass
class KQuantScales:
    """A K-quant's scales as the file factors them: per group, small integers `sc` (and `m`) [N, K / G]; per
    super-block of 256 weights, fp16 `d` (and `neg_dmin`, the negated dmin) [N, K / 256]. scale = sc * d and
    min = m * neg_dmin are exact in fp32; m and neg_dmin are None for a symmetric type (Q6_K)."""

    sc: torch.Tensor
    m: torch.Tensor | None
    d: torch.Tensor
    neg_dmin: torch.Tensor | None

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.sc, self.m, self.d, self.neg_dmin

    @staticmethod
    def cat(parts: list[KQuantScales | None]) -> KQuantScales | None:
        if any(p is None for p in parts) or len({p.m is None for p in parts}) > 1:  # type: ignore[union-attr]
            return None
        columns = zip(*(p._tensors() for p in parts))  # type: ignore[union-attr]
        return KQuantScales(*(None if c[0] is None else torch.cat(c) for c in columns))  # type: ignore[arg-type]

    def rows(self, start: int, length: int) -> KQuantScales:
        return KQuantScales(*(None if t is None else t[start:start + length]  # type: ignore[arg-type]
                              for t in self._tensors()))


class PackedParts(QuantizedParts):
    """A block-quantized weight, losslessly re-laid: `q` [N, K] integers, and per group of weights (32, or 16
    for Q6_K) a `scale` and (except Q8_0) an `offset`, so that w = q * scale + offset exactly as llama.cpp
    dequantizes it. kind: "int8" (Q8_0: signed q, fp16 scales), "int4" (q 0..15), "uint5" (Q5_*: q 0..31)
    or "uint6" (Q6_K: q 0..63); only pagedllm's VNNI kernel reads the last two packed."""

    k_scales: KQuantScales | None = None  # a K-quant's factored scales, kept where the VNNI kernel reads them

    @staticmethod
    def cat(parts: list[QuantizedParts]) -> QuantizedParts:
        fused = QuantizedParts.cat(parts)
        if len(parts) > 1 and isinstance(fused, PackedParts):
            fused.k_scales = KQuantScales.cat([getattr(p, "k_scales", None) for p in parts])
        return fused

    def narrow(self, dim: int, start: int, length: int, name: str) -> QuantizedParts:
        part = super().narrow(dim, start, length, name)
        if isinstance(part, PackedParts) and part is not self:
            # output rows keep their factors; a column shard keeps the fp32 products (exact as well)
            part.k_scales = self.k_scales.rows(start, length) if dim == 0 and self.k_scales is not None else None
        return part

    @property
    def bits(self) -> int:
        """The bits the VNNI kernel keeps this kind in."""
        return {"int4": 4, "int8": 8}.get(self.kind) or UNSIGNED_BITS[self.kind]

    def build(self, dtype: torch.dtype, methods: dict[str, Any]):  # type: ignore[override]
        """The QuantizedWeight; weights of one kind share one method (it owns the model's scratch buffers)."""
        from pagedllm.layers.quantization import QuantizedWeight
        from pagedllm.layers.quantization.vnni import VnniWeight, kernel_enabled

        method = _method(methods, self.bits, self.q.shape[1] // self.scale.shape[1])
        if self.k_scales is not None and kernel_enabled(dtype):
            ks = self.k_scales
            return VnniWeight.from_k_quant(self.q, ks.sc, ks.m, ks.d, ks.neg_dmin, self.bits, method)
        if self.kind == "int4":
            assert self.offset is not None
            return method.create(self.q, self.scale, self.offset, dtype)
        # 5 and 6 bits only packed for the VNNI kernel; Q8_0 there too where it runs, its fp16 scales kept exact
        # (the int8 weight would round them to `dtype`)
        if self.kind in UNSIGNED_BITS or kernel_enabled(dtype):
            return VnniWeight.from_logical(*_unsigned(self), method)
        return QuantizedWeight(self.q, self.scale.to(dtype), method)


PackedReader = Callable[[np.ndarray, tuple[int, int]], PackedParts]
PACKED_TYPES: dict[str, PackedReader] = {}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
VNNI_ONLY_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")  # kept packed only where pagedllm's VNNI kernel runs
UNSIGNED_BITS = {"uint5": 5, "uint6": 6}  # their PackedParts kinds, and the bits the kernel keeps them in


def _blocks(data: np.ndarray, n: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    return np.asarray(data).reshape(n, num_blocks, block_bytes)


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields [..., 2] uint8 -> float32 [...] (exact)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_of_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of 32 weights, byte j holding weight j (low nibble) and j + 16 (high) -> [..., 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _read_q8_0(data: np.ndarray, shape: tuple[int, int]) -> PackedParts:
    """Q8_0 blocks (an fp16 scale, then 32 int8 weights) as int8 with one scale per group of 32."""
    n, k = shape
    blocks = torch.from_numpy(np.array(data)).view(n, k // 32, 34)  # a copy: the file is mapped read-only
    scales = blocks[:, :, :2].contiguous().view(torch.float16).view(n, k // 32)
    qweight = blocks[:, :, 2:].contiguous().view(torch.int8).view(n, k)
    return PackedParts("int8", qweight, scales)


def _read_q4_0(data: np.ndarray, shape: tuple[int, int]) -> PackedParts:
    """Q4_0 blocks (an fp16 d, 16 bytes of nibbles): w = (q - 8) * d."""
    n, k = shape
    blocks = _blocks(data, n, k // 32, 18)
    d = _fp16(blocks[:, :, 0:2])
    q = _nibbles_of_32(blocks[:, :, 2:]).reshape(n, k)
    return PackedParts("int4", torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(-8 * d))


def _read_q4_1(data: np.ndarray, shape: tuple[int, int]) -> PackedParts:
    """Q4_1 blocks (fp16 d and m, 16 bytes of nibbles): w = q * d + m."""
    n, k = shape
    blocks = _blocks(data, n, k // 32, 20)
    d, m = _fp16(blocks[:, :, 0:2]), _fp16(blocks[:, :, 2:4])
    q = _nibbles_of_32(blocks[:, :, 4:]).reshape(n, k)
    return PackedParts("int4", torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))


def _read_q4_k(data: np.ndarray, shape: tuple[int, int]) -> PackedParts:
    """Q4_K super-blocks of 256 (fp16 d and dmin, 12 bytes of 6-bit scales and mins for 8 groups of 32,
    128 bytes of nibbles, each 32 bytes holding 64 weights: the first 32 in the low nibbles):
    w = q * (d * sc) - dmin * m. Both products are exact in fp32 (11-bit and 6-bit mantissas)."""
    n, k = shape
    blocks = _blocks(data, n, k // 256, 144)
    d, dmin = _fp16(blocks[:, :, 0:2]), _fp16(blocks[:, :, 2:4])
    sc, mins = _k_scales(blocks[:, :, 4:16].astype(np.uint8))  # groups 0-3: 6 bits each; 4-7 split
    qs = blocks[:, :, 16:].reshape(n, k // 256, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k)  # per 64: 32 low nibbles, then 32 high
    scale = (d[..., None] * sc).reshape(n, k // 32)
    offset = (-(dmin[..., None] * mins)).reshape(n, k // 32)
    parts = PackedParts("int4", torch.from_numpy(q), torch.from_numpy(scale.astype(np.float32)),
                        torch.from_numpy(offset.astype(np.float32)))
    parts.k_scales = _k_quant_scales(sc.reshape(n, k // 32), mins.reshape(n, k // 32), d, dmin)
    return parts


def _k_quant_scales(sc: np.ndarray, mins: np.ndarray | None, d: np.ndarray, dmin: np.ndarray | None) -> KQuantScales:
    """The factors of a K-quant's scales: per group sc (and m) as int8, per super-block d (and -dmin) in fp16."""
    def small(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values).astype(np.int8))

    def half(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values).astype(np.float16))

    return KQuantScales(small(sc), None if mins is None else small(mins), half(d),
                        None if dmin is None else half(-dmin))


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of 6-bit scales and mins of Q4_K / Q5_K super-blocks -> (scales, mins), each [..., 8]."""
    low, high, last = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 63, (last & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (last >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc, mins


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: the 4 bytes of high bits (a little-endian uint32, bit j for weight j) -> [..., 32] of 0/16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.astype(np.uint8) << 4


def _read_q5_0(data: np.ndarray, shape: tuple[int, int]) -> PackedParts:
    """Q5_0 blocks (fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles): w = (q - 16) * d, q 0..31."""
    n, k = shape
    blocks = _blocks(data, n, k // 32, 22)
    d = _fp16(blocks[:, :, 0:2])
    q = (_nibbles_of_32(blocks[:, :, 6:]) | _fifth_bits(blocks[:, :, 2:6])).reshape(n, k)
    return PackedParts("uint5", torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(-16 * d))


def _read_q5_1(data: np.ndarray, shape: tuple[int, int]) -> PackedParts:
    """Q5_1 blocks (fp16 d and m, 4 bytes of fifth bits, 16 bytes of nibbles): w = q * d + m, q 0..31."""
    n, k = shape
    blocks = _blocks(data, n, k // 32, 24)
    d, m = _fp16(blocks[:, :, 0:2]), _fp16(blocks[:, :, 2:4])
    q = (_nibbles_of_32(blocks[:, :, 8:]) | _fifth_bits(blocks[:, :, 4:8])).reshape(n, k)
    return PackedParts("uint5", torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))


def _read_q5_k(data: np.ndarray, shape: tuple[int, int]) -> PackedParts:
    """Q5_K super-blocks of 256 (fp16 d and dmin, 12 bytes of 6-bit scales and mins, 32 bytes of fifth
    bits, 128 bytes of nibbles laid out as Q4_K's): w = q * (d * sc) - dmin * m, q 0..31; byte l of the
    fifth bits holds, at bits 2j and 2j + 1, weight l of the super-block's groups 2j and 2j + 1."""
    n, k = shape
    blocks = _blocks(data, n, k // 256, 176)
    d, dmin = _fp16(blocks[:, :, 0:2]), _fp16(blocks[:, :, 2:4])
    sc, mins = _k_scales(blocks[:, :, 4:16].astype(np.uint8))
    qh = blocks[:, :, 16:48]  # [..., 32]
    qs = blocks[:, :, 48:].reshape(n, k // 256, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, k // 256, 8, 32)  # group g = 2 * pair + half
    high = np.stack([((qh >> g) & 1) << 4 for g in range(8)], axis=2)  # [n, blocks, 8, 32]
    q = (low | high.astype(np.uint8)).reshape(n, k)
    scale = (d[..., None] * sc).reshape(n, k // 32)
    offset = (-(dmin[..., None] * mins)).reshape(n, k // 32)
    parts = PackedParts("uint5", torch.from_numpy(q), torch.from_numpy(scale.astype(np.float32)),
                        torch.from_numpy(offset.astype(np.float32)))
    parts.k_scales = _k_quant_scales(sc.reshape(n, k // 32), mins.reshape(n, k // 32), d, dmin)
    return parts


def _read_q6_k(data: np.ndarray, shape: tuple[int, int]) -> PackedParts:
    """Q6_K super-blocks of 256 (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d):
    w = d * sc * (q - 32), q 0..63, one scale per 16 weights. Per half of 128 weights, position l < 32 of
    its four quarters takes the low nibble of ql[l] or ql[l + 32] (low, then high nibbles) and bit pair
    0, 1, 2 or 3 of qh[l]. d * sc is exact in fp32 (11- and 8-bit mantissas)."""
    n, k = shape
    blocks = _blocks(data, n, k // 256, 210)
    ql = blocks[:, :, 0:128].reshape(n, k // 256, 2, 2, 32)  # [.., half, ql[l] or ql[l + 32], l]
    qh = blocks[:, :, 128:192].reshape(n, k // 256, 2, 1, 32)
    sc = np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).astype(np.float32)  # [n, blocks, 16]
    d = _fp16(blocks[:, :, 208:210])
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # quarters 0..3: ql[l] lo, ql[l+32] lo, ql[l] hi, ...
    high = np.concatenate([(qh >> (2 * j)) & 3 for j in range(4)], axis=3) << 4
    q = (low | high).astype(np.uint8).reshape(n, k)
    scale = (d[..., None] * sc).reshape(n, k // 16).astype(np.float32)
    parts = PackedParts("uint6", torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(-32 * scale))
    parts.k_scales = _k_quant_scales(sc.reshape(n, k // 16), None, d, None)
    return parts


PACKED_TYPES.update(Q8_0=_read_q8_0, Q4_0=_read_q4_0, Q4_1=_read_q4_1, Q4_K=_read_q4_k,
                    Q5_0=_read_q5_0, Q5_1=_read_q5_1, Q5_K=_read_q5_k, Q6_K=_read_q6_k)


def _method(methods: dict[str, Any], bits: int, group: int):
    """The model's one method for weights of these bits and groups (int4 for 4 bits, else int8)."""
    from pagedllm.layers.quantization.int4 import Int4WeightOnlyMethod
    from pagedllm.layers.quantization.int8 import Int8WeightOnlyMethod

    if bits == 4:
        return methods.setdefault(f"int4-g{group}", Int4WeightOnlyMethod(group_size=group))
    return methods.setdefault(f"int8-g{group}", Int8WeightOnlyMethod(group_size=group))


def _unsigned(parts: PackedParts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q unsigned, scale and offset fp32 [N, K / G], bits) of a block type's parts, as the VNNI kernel
    takes them (Q8_0's signed q as q + 128, min = -128 * scale)."""
    scale = parts.scale.to(torch.float32)
    if parts.kind == "int8":
        return (parts.q.to(torch.int16) + 128).to(torch.uint8), scale, -128 * scale, 8
    assert parts.offset is not None
    return parts.q, scale, parts.offset.to(torch.float32), parts.bits


def merge_mixed_parts(parts: list[PackedParts], methods: dict[str, Any]):
    """A fused projection whose parts the file stores in different block types (a Q4_K_M file keeps
    attn_v wider than attn_q and attn_k) as one VNNI weight, losslessly: every part in the widest part's
    bits and the narrowest groups (a wider group's scale repeated). A narrower symmetric part stays
    symmetric (its q shifted by 2^(B - 1) - 2^(b - 1)), so a merge of symmetric types keeps no mins."""
    from pagedllm.layers.quantization.vnni import VnniWeight, symmetric_min_factor

    unsigned = [_unsigned(part) for part in parts]
    bits = max(b for *_, b in unsigned)
    group = min(q.shape[1] // scale.shape[1] for q, scale, _, _ in unsigned)
    qs, scales, offsets = [], [], []
    for q, scale, offset, b in unsigned:
        if b < bits and torch.equal(offset, symmetric_min_factor(b) * scale):
            q = q + ((1 << (bits - 1)) - (1 << (b - 1)))
            offset = symmetric_min_factor(bits) * scale
        repeat = q.shape[1] // scale.shape[1] // group
        qs.append(q)
        scales.append(scale.repeat_interleave(repeat, dim=1))
        offsets.append(offset.repeat_interleave(repeat, dim=1))
    return VnniWeight.from_logical(torch.cat(qs), torch.cat(scales), torch.cat(offsets), bits,
                                   _method(methods, bits, group))


def dequantize_parts(parts: QuantizedParts) -> torch.Tensor:
    """The re-laid weight in fp32 (dequantize_groups): the same bits as llama.cpp's reference
    (`gguf.quants.dequantize`), checked for every type in tests/test_gguf_embedding.py."""
    return dequantize_groups(parts.q, parts.scale, parts.offset)


class GGUFRows(Module):
    """An embedding table kept in the file's block type: the stored rows ([rows, bytes per row] uint8,
    a block never spans two rows) and, per lookup, only the rows asked for dequantized by the same
    readers that re-lay the projections (PACKED_TYPES). A Q8_0 table takes 34 bytes per 32 weights where
    a bf16 copy would take 64."""

    def __init__(self, raw: torch.Tensor, type_name: str, hidden_size: int):
        super().__init__()
        self.register_buffer("raw", raw, persistent=False)
        self.type_name = type_name
        self.hidden_size = hidden_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows [len(ids), hidden_size], exactly as llama.cpp dequantizes them."""
        rows = self.raw.index_select(0, ids.reshape(-1).to(self.raw.device)).cpu().numpy()
        out = dequantize_parts(PACKED_TYPES[self.type_name](rows, (rows.shape[0], self.hidden_size)))
        return out.to(ids.device)  # the readers run on the host (numpy); a no-op on CPU

    def as_weight(self, dtype: torch.dtype) -> torch.nn.Module | None:
        """The table as pagedllm's VNNI kernel's weight, losslessly (a tied LM head that multiplies by it
        as stored); None where that kernel does not run for `dtype` or take the table's shape."""
        from pagedllm.layers.quantization.vnni import VnniWeight, kernel_enabled, kernel_supports

        rows, group = self.raw.shape[0], 16 if self.type_name == "Q6_K" else 32
        bits = 4 if self.type_name in INT4_TYPES else 6 if self.type_name == "Q6_K" else \
            5 if self.type_name in VNNI_ONLY_TYPES else 8
        if self.raw.device.type != "cpu" or not kernel_enabled(dtype) or \
                not kernel_supports(rows, self.hidden_size, group, bits):
            return None
        weight = PACKED_TYPES[self.type_name](self.raw.numpy(), (rows, self.hidden_size)).build(dtype, {})
        return weight if isinstance(weight, VnniWeight) else None

    def extra_repr(self) -> str:
        return f"{self.type_name}, rows={self.raw.shape[0]}, hidden_size={self.hidden_size}"


class GGUFTensor:
    """One tensor of the file, answered in Hugging Face layout: `get_shape()`, and indexing (which
    dequantizes the whole tensor first; a slice of a quantized row would split its blocks)."""

    def __init__(self, tensor, permute_heads: int | None = None, on_dequantize: Callable[[str], None] | None = None,
                 on_keep_packed: Callable[[str], None] | None = None,
                 release: Callable[[Any, int, int | None], None] | None = None):
        self.tensor = tensor
        self.on_dequantize = on_dequantize
        self.on_keep_packed = on_keep_packed
        self.release = release  # drops the mapped pages of bytes [a, b) of the tensor once they are read
        self.type_name = tensor.tensor_type.name
        self.shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        self.permute_heads = permute_heads

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def rows(self) -> np.ndarray:
        """The stored rows (packed bytes for block types), q/k rows back in Hugging Face order."""
        data = self.tensor.data
        if len(self.shape) > 1:
            data = data.reshape(self.shape[0], -1)
        if self.permute_heads:
            heads = self.permute_heads
            data = data.reshape(heads, self.shape[0] // heads // 2, 2, *data.shape[1:])
            data = data.swapaxes(1, 2).reshape(self.shape[0], -1)
        return data

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor (or its rows [start, stop): rows hold whole blocks) in full precision."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        whole = (start, stop) in ((0, None), (0, self.shape[0]))
        data = self.rows() if whole else self.rows()[start:stop]
        shape = self.shape if whole else (data.shape[0], *self.shape[1:])
        if self.type_name in ("F32", "F16"):
            out = torch.from_numpy(np.array(data))  # a copy: the file is mapped read-only
        elif self.type_name == "BF16":
            out = torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
        else:
            if self.type_name in PACKED_TYPES and len(shape) == 2:  # the projections' readers, same bits
                out = dequantize_parts(PACKED_TYPES[self.type_name](data, shape))
            else:
                try:
                    out = torch.from_numpy(dequantize(data, GGMLQuantizationType[self.type_name]))
                except NotImplementedError as exc:
                    raise ValueError(f"GGUF tensor {self.tensor.name!r} has type {self.type_name}, which the gguf "
                                     "package cannot dequantize; pagedllm cannot load this file.") from exc
            if self.on_dequantize is not None and start == 0:  # counted once per tensor
                self.on_dequantize(self.type_name)
        if self.release is not None and (whole or not self.permute_heads):
            row_bytes = self.tensor.nbytes // self.shape[0]
            self.release(self.tensor, start * row_bytes, None if whole else (start + data.shape[0]) * row_bytes)
        return out.reshape(shape)

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, slice) and len(self.shape) == 2 and index.step in (None, 1):
            # only the rows asked for are copied or dequantized (an embedding loads in chunks)
            start, stop, _ = index.indices(self.shape[0])
            return self.dense(start, stop)
        return self.dense()[index]

    def quantized_rows(self, start: int, stop: int) -> GGUFRows | None:
        """Rows [start, stop) kept in the file's block type, for an embedding to look up (None when the
        type has no reader or PAGEDLLM_GGUF_DEQUANTIZE asks for dense weights)."""
        if len(self.shape) != 2 or self.type_name not in PACKED_TYPES or envs.value("PAGEDLLM_GGUF_DEQUANTIZE"):
            return None
        raw = torch.from_numpy(np.array(self.rows()[start:stop]))  # a copy: the file is mapped read-only
        if self.on_keep_packed is not None:
            self.on_keep_packed(self.type_name)
        if self.release is not None:
            row_bytes = self.tensor.nbytes // self.shape[0]
            self.release(self.tensor, start * row_bytes, stop * row_bytes)
        return GGUFRows(raw, self.type_name, self.shape[1])


class GGUFCheckpoint:
    """The file's tensors under Hugging Face names, for a model's `load_weights`."""

    def __init__(self, path: str, hf_config: dict[str, Any]):
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        self.path = path
        self.reader = GGUFTensorIndex(path)
        self.arch = self.reader.fields.get("general.architecture")
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch_ids = {name: arch_id for arch_id, name in MODEL_ARCH_NAMES.items()}
        if self.arch not in arch_ids:
            raise ValueError(f"GGUF architecture {self.arch!r} of {path!r} is not known to the gguf package.")
        self.name_map = get_tensor_name_map(arch_ids[self.arch], int(hf_config["num_hidden_layers"]))
        self.num_heads = int(hf_config["num_attention_heads"])
        self.num_kv_heads = int(hf_config.get("num_key_value_heads") or self.num_heads)
        self.dequantized: Counter[str] = Counter()
        self.kept_packed: Counter[str] = Counter()
        self._slots: dict[int, tuple[torch.nn.Module, str]] = {}
        self._methods: dict[str, Any] = {}
        self._experts: tuple[str, torch.Tensor] | None = None  # the last 3-D expert tensor, dequantized
        self._transient_bytes = 0

    def gguf_name(self, name: str) -> tuple[str, int | None] | None:
        """(the file's tensor for Hugging Face `name`, the expert index for a per-expert name), or None."""
        base, dot, suffix = name.rpartition(".")
        expert = None
        mapped = self.name_map.get_name(base)
        if mapped is None:
            # experts are one 3-D tensor in the file ([E, out, in]); Hugging Face names them one by one
            match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)", base)
            if match is None:
                return None
            expert = int(match.group(2))
            mapped = self.name_map.get_name(f"{match.group(1)}.{match.group(3)}")
            if mapped is None:
                return None
        full = f"{mapped}{dot}{suffix}"
        return (full, expert) if full in self.tensors else None

    def __contains__(self, name: str) -> bool:
        return self.gguf_name(name) is not None

    def get_slice(self, name: str) -> GGUFTensor | torch.Tensor:
        found = self.gguf_name(name)
        if found is None:
            raise ValueError(f"GGUF file {self.path!r} lacks weight {name!r} (architecture {self.arch!r}).")
        gguf_name, expert = found
        tensor = self.tensors[gguf_name]
        heads = None
        if self.arch in _PERMUTED_QK_ARCHS:
            if gguf_name.endswith("attn_q.weight"):
                heads = self.num_heads
            elif gguf_name.endswith("attn_k.weight"):
                heads = self.num_kv_heads
        view = GGUFTensor(tensor, heads, self._count_dequantized, self._count_kept_packed, self.reader.release)
        if self.arch in _OFFSET_NORM_ARCHS and gguf_name.endswith("norm.weight"):
            return view.dense() - 1
        if expert is None:
            return view
        if self._experts is None or self._experts[0] != gguf_name:
            self._experts = (gguf_name, view.dense())
        return self._experts[1][expert]

    def _count_dequantized(self, type_name: str) -> None:
        self.dequantized[type_name] += 1

    def _count_kept_packed(self, type_name: str) -> None:
        self.kept_packed[type_name] += 1

    def bind_model(self, model: torch.nn.Module) -> None:
        """Where each parameter lives, so that load_linear can put a packed weight in its place."""
        self._slots = {id(param): (module, attr) for module in model.modules()
                       for attr, param in module.named_parameters(recurse=False)}

    def load_linear(self, dst: torch.Tensor, srcs: tuple[str, ...], shard: WeightShard) -> bool:
        """The models' `load_linear` hook: keeps a projection packed when every part of it is stored in
        a block type that a weight kernel reads (PACKED_TYPES; parts of different types only where the
        VNNI kernel runs: merge_mixed_parts); otherwise the model copies it dense.
        Under tensor parallelism this rank's rows are cut from the file's blocks before they are read
        (rows hold whole blocks), its columns from the re-laid groups of 32 (never within a group), and
        only this rank's part is packed."""
        if envs.value("PAGEDLLM_GGUF_DEQUANTIZE"):
            return False
        views = [self.get_slice(name) for name in srcs]
        kinds = [view.type_name if isinstance(view, GGUFTensor) else None for view in views]
        if len(views) != len(srcs) or any(kind not in PACKED_TYPES for kind in kinds):
            return False
        k = views[0].shape[-1]
        if shard.dim == 0:
            shape = (sum(length for _, length in shard.ranges), k)
        else:
            shape = (sum(v.shape[0] for v in views), shard.ranges[0][1])
        if shape != tuple(dst.shape):
            raise ValueError(f"GGUF weights {list(srcs)} give this rank shape {shape}, expected {tuple(dst.shape)}.")
        mixed = len(set(kinds)) > 1
        if (mixed or any(kind in VNNI_ONLY_TYPES for kind in kinds)) and not self._vnni_ok(shape, dst):
            return False
        if any(kind in INT4_TYPES for kind in kinds) and not self._int4_ok(shape, dst):
            return False
        parts = []
        for view, kind, name, (start, length) in zip(views, kinds, srcs, shard.ranges):
            if shard.dim == 0:
                parts.append(PACKED_TYPES[kind](view.rows()[start:start + length], (length, k)))
            else:
                parts.append(PACKED_TYPES[kind](view.rows(), view.shape).narrow(1, start, length, name))
        weight = (merge_mixed_parts(parts, self._methods) if mixed
                  else PackedParts.cat(parts).build(dst.dtype, self._methods))
        module, attr = self._slots[id(dst)]
        del module._parameters[attr]  # frees the (never written) full-precision parameter
        setattr(module, attr, weight)
        for kind in kinds:
            self.kept_packed[kind] += 1
        for view in views:
            self.reader.release(view.tensor)
        # The re-laid parts (a byte per weight and more) and the kernel's packing buffers are freed, but
        # with the allocator keeping freed memory in the heap they would pile up to several times the
        # file's size by the last layer: hand them back every so often.
        self._transient_bytes += sum(part.q.numel() for part in parts) * 8
        if self._transient_bytes >= TRIM_EVERY_BYTES:
            release_free_heap_memory()
            self._transient_bytes = 0
        return True

    @staticmethod
    def _vnni_ok(shape: tuple[int, int], dst: torch.Tensor) -> bool:
        """pagedllm's VNNI kernel runs here for the model's dtype and takes the shape (groups of 16 cover
        Q6_K too)."""
        from pagedllm.layers.quantization.vnni import kernel_enabled, kernel_supports

        return dst.device.type == "cpu" and kernel_enabled(dst.dtype) and kernel_supports(*shape, 16, 8) \
            and kernel_supports(*shape, 32, 8)

    @classmethod
    def _int4_ok(cls, shape: tuple[int, int], dst: torch.Tensor) -> bool:
        """pagedllm's kernels take any float activations (fp32 ones in fp32); torch's int4 kernel bf16 only
        (an fp32 or fp16 model would lose bits in it), and output sizes in multiples of 16."""
        from pagedllm.layers.quantization.int4 import int4_supports

        if cls._vnni_ok(shape, dst):
            return True
        return dst.dtype == torch.bfloat16 and dst.device.type == "cpu" and int4_supports(*shape, 32)

    def packed_types(self) -> list[str]:
        """The file's block types that hold quantized weights (Q8_0, Q4_K, ...), not plain floats."""
        return sorted({t.tensor_type.name for t in self.reader.tensors} - {"F32", "F16", "BF16", "F64"})

    def log_summary(self, dtype: torch.dtype) -> None:
        stored = Counter(t.tensor_type.name for t in self.reader.tensors)
        dequantized = {k: v for k, v in self.dequantized.items() if v > 0}
        logger.info("GGUF %s: tensors %s; kept packed: %s; dequantized to %s on load: %s",
                    os.path.basename(self.path), dict(stored), dict(self.kept_packed) or "none",
                    str(dtype).removeprefix("torch."), dequantized or "none")
