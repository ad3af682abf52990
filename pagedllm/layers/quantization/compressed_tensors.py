"""The compressed-tensors checkpoint layout (what vLLM and llm-compressor read and write) for W8A16.

config.json carries `quantization_config` with `quant_method: "compressed-tensors"`, a `format`, one
config group whose `weights` say num_bits 8, type "int" or "float", symmetric, strategy "channel" (or
"group" with group_size), and an `ignore` list (["lm_head"]: the LM head and embeddings stay in the
model dtype). Per quantized projection `<prefix>` (e.g. model.layers.0.self_attn.q_proj):

- int8, format "pack-quantized" (what vLLM's W8A16 integer kernels read): `<prefix>.weight_packed`
  int32 [N, K / 4], four values offset by +128 per int32, the first in the lowest byte;
  `<prefix>.weight_scale` [N, 1] (or [N, K / group_size]) in the model dtype; `<prefix>.weight_shape`
  int64 [N, K]. "int-quantized" (an int8 `<prefix>.weight`) is read too.
- fp8, format "float-quantized": `<prefix>.weight` float8_e4m3fn [N, K], `<prefix>.weight_scale`
  float32 [N, 1] (a per-tensor [1] scale is read too).

- int4 (W4A16), format "pack-quantized", strategy "group": `<prefix>.weight_packed` int32 [N, K / 8], eight
  values offset by +8 per int32, the first in the lowest bits; `<prefix>.weight_scale` [N, K / G];
  `<prefix>.weight_zero_point` (asymmetric only) int32 [N / 8, K / G], packed the same way down the
  rows; `<prefix>.weight_shape`. Read into the int4 kernel's layout (layers/quantization/int4.py).

Asymmetric 8-bit schemes, activation quantization and other bit widths are refused with the field named.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.layers.quantization.base import QuantizationConfig, QuantizationMethod, QuantizedWeight

QUANT_METHOD = "compressed-tensors"
FORMATS = {"int8": "pack-quantized", "fp8": "float-quantized", "int4": "pack-quantized"}
_READABLE_FORMATS = {"int": ("pack-quantized", "int-quantized", "naive-quantized"),
                     "float": ("float-quantized", "naive-quantized")}
# The Llama family's linear projections (what `ignore: ["lm_head"]` leaves quantized).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fail(field: str, message: str) -> ValueError:
    return ValueError(f"checkpoint quantization_config.{field}: {message}")


def parse_quantization_config(qc: Any) -> QuantizationConfig:
    """A config.json `quantization_config` -> our QuantizationConfig (from_checkpoint=True), or a
    ValueError naming the field we cannot read."""
    if not isinstance(qc, dict):
        raise ValueError(f"checkpoint quantization_config must be an object, got {type(qc).__name__}.")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise _fail("quant_method", f"{method!r} is not supported; pagedllm reads {QUANT_METHOD!r} checkpoints.")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _fail("config_groups", "must be a non-empty object of quantization schemes.")
    schemes = []
    for name, group in groups.items():
        field = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise _fail(field, "must be an object.")
        if group.get("input_activations") is not None:
            raise _fail(f"{field}.input_activations", "activation quantization is not supported "
                        "(weight-only W8A16 checkpoints only).")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise _fail(f"{field}.weights", "must be an object describing the weight quantization.")
        schemes.append((field, weights))
    field, weights = schemes[0]
    for other_field, other in schemes[1:]:
        if other != weights:
            raise _fail(other_field, f"differs from {field}; one scheme for every layer is supported.")
    wfield = f"{field}.weights"
    num_bits = weights.get("num_bits")
    if num_bits not in (8, 4):
        raise _fail(f"{wfield}.num_bits", f"{num_bits!r} is not supported (8, or 4 for W4A16).")
    kind = weights.get("type")
    if kind not in _READABLE_FORMATS:
        raise _fail(f"{wfield}.type", f"{kind!r} is not supported ('int' or 'float').")
    if num_bits == 4:
        return _parse_w4a16(qc, weights, wfield)
    if weights.get("symmetric") is not True:
        raise _fail(f"{wfield}.symmetric", "asymmetric weights (weight_zero_point) are not supported.")
    if weights.get("dynamic") not in (None, False):
        raise _fail(f"{wfield}.dynamic", "dynamic weight quantization is not supported.")
    strategy = weights.get("strategy")
    allowed = ("channel", "group") if kind == "int" else ("channel", "tensor")
    if strategy not in allowed:
        raise _fail(f"{wfield}.strategy", f"{strategy!r} is not supported for type {kind!r} ({list(allowed)}).")
    group_size = None
    if strategy == "group":
        group_size = weights.get("group_size")
        if not isinstance(group_size, int) or group_size < 1:
            raise _fail(f"{wfield}.group_size", f"must be a positive integer, got {group_size!r}.")
    fmt = qc.get("format")
    if fmt not in _READABLE_FORMATS[kind]:
        raise _fail("format", f"{fmt!r} is not supported for type {kind!r} ({list(_READABLE_FORMATS[kind])}).")
    return QuantizationConfig("int8" if kind == "int" else "fp8", group_size, from_checkpoint=True)


def _parse_w4a16(qc: dict[str, Any], weights: dict[str, Any], wfield: str) -> QuantizationConfig:
    """4-bit integers packed eight to an int32, per group, symmetric or with packed zero points."""
    from pagedllm.layers.quantization.int4 import GROUP_SIZES

    if weights.get("type") != "int":
        raise _fail(f"{wfield}.type", "4-bit weights must be 'int'.")
    if weights.get("dynamic") not in (None, False):
        raise _fail(f"{wfield}.dynamic", "dynamic weight quantization is not supported.")
    if weights.get("strategy") != "group":
        raise _fail(f"{wfield}.strategy", f"{weights.get('strategy')!r} is not supported for 4-bit weights ('group').")
    group_size = weights.get("group_size")
    if group_size not in GROUP_SIZES:
        raise _fail(f"{wfield}.group_size", f"{group_size!r} is not supported for 4-bit weights {list(GROUP_SIZES)}.")
    if weights.get("actorder") not in (None, False):
        raise _fail(f"{wfield}.actorder", "activation-ordered groups (g_idx) are not supported.")
    if qc.get("format") != "pack-quantized":
        raise _fail("format", f"{qc.get('format')!r} is not supported for 4-bit weights ('pack-quantized').")
    return QuantizationConfig("int4", group_size, from_checkpoint=True)


def _unpack_int4(packed: torch.Tensor, rows: int, cols: int, packed_dim: int = 1) -> torch.Tensor:
    """int32 holding eight 4-bit values each, lowest bits first, offset by +8 -> uint8 0..15 [rows, cols]
    (packed_dim 0: the eight values run down a column, as zero points are packed)."""
    assert packed.dtype == torch.int32
    packed = packed.t() if packed_dim == 0 else packed
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    values = ((packed.unsqueeze(-1) >> shifts) & 15).to(torch.uint8).flatten(-2)
    values = values[:, :rows if packed_dim == 0 else cols]
    return values.t().contiguous() if packed_dim == 0 else values.contiguous()


def _pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, cols] in 0..15, cols a multiple of 8 -> int32 [rows, cols / 8], lowest bits first."""
    rows, cols = values.shape
    nibbles = values.to(torch.int32).view(rows, cols // 8, 8)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int32)
    for i in range(8):
        packed |= nibbles[:, :, i] << (4 * i)
    return packed


def write_int4(prefix: str, weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One full-precision projection as compressed-tensors W4A16 tensors (asymmetric, per group)."""
    from pagedllm.layers.quantization.int4 import quantize_groups

    q, scales, zero_points = quantize_groups(weight, group_size, scale_dtype)
    n, k = q.shape
    return {f"{prefix}.weight_packed": _pack_int4(q),
            f"{prefix}.weight_scale": scales.contiguous(),
            f"{prefix}.weight_zero_point": _pack_int4((zero_points + 8).to(torch.uint8).t()).t().contiguous(),
            f"{prefix}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}


def read_int4(prefix: str, get_tensor: Callable[[str], torch.Tensor],
              names: set[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One W4A16 projection as (q [N, K] in 0..15, scale, offset [N, K / G] fp32), w = q * scale + offset:
    compressed-tensors' w = (q_signed - zero_point) * scale with q = q_signed + 8."""
    from pagedllm.layers.quantization.int4 import int4_supports

    n, k = (int(v) for v in get_tensor(f"{prefix}.weight_shape").tolist())
    q = _unpack_int4(get_tensor(f"{prefix}.weight_packed"), n, k)
    scale = get_tensor(f"{prefix}.weight_scale").to(torch.float32)
    groups = scale.shape[1]
    if scale.shape[0] != n or k % groups or not int4_supports(n, k, k // groups):
        raise ValueError(f"checkpoint tensor {prefix}.weight_scale has shape {tuple(scale.shape)} for a [{n}, {k}] "
                         f"weight; the int4 kernel needs whole groups of 32-256 and output sizes in multiples of 16.")
    zero_point = torch.zeros_like(scale)
    if f"{prefix}.weight_zero_point" in names:
        zero_point = _unpack_int4(get_tensor(f"{prefix}.weight_zero_point"), n, groups, packed_dim=0)
        zero_point = zero_point.to(torch.float32) - 8
    return q, scale, -(8 + zero_point) * scale


def build_quantization_config(config: QuantizationConfig) -> dict[str, Any]:
    """The `quantization_config` that `pagedllm quantize` writes into config.json."""
    is_int = config.method in ("int8", "int4")
    is_int4 = config.method == "int4"
    weights = {
        "num_bits": 4 if is_int4 else 8, "type": "int" if is_int else "float", "symmetric": not is_int4,
        "dynamic": False,
        "strategy": "group" if config.group_size else "channel", "group_size": config.group_size,
        "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {},
    }
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMATS[config.method],
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def is_projection_weight(name: str) -> bool:
    """A decoder-layer linear projection's weight, as a Hugging Face Llama-family checkpoint names it."""
    parts = name.split(".")
    return len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in PROJECTIONS and ".layers." in name


def has_quantized(prefix: str, names: set[str]) -> bool:
    return f"{prefix}.weight_scale" in names


def _unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 4] of +128-offset bytes, lowest byte first -> int8 [N, K]."""
    assert packed.dtype == torch.int32
    raw = packed.contiguous().view(torch.uint8)
    if sys.byteorder != "little":  # the layout is little-endian by definition
        raw = raw.view(-1, 4).flip(-1).reshape(packed.shape[0], -1)
    return (raw ^ 0x80).view(torch.int8)  # offset binary -> two's complement


def _pack_int8(q: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    if k % 4:
        raise ValueError(f"pack-quantized int8 needs an input size divisible by 4, got {k}.")
    raw = (q.contiguous().view(torch.uint8) ^ 0x80)
    if sys.byteorder != "little":
        raw = raw.view(-1, 4).flip(-1).reshape(n, k)
    return raw.view(torch.int32)


def read_quantized(prefix: str, get_tensor: Callable[[str], torch.Tensor], names: set[str],
                   method: QuantizationMethod, model_dtype: torch.dtype) -> QuantizedWeight:
    """One projection's stored qweight and scales (never a full-precision weight)."""
    if f"{prefix}.weight_packed" in names:
        qweight = _unpack_int8(get_tensor(f"{prefix}.weight_packed"))
        if f"{prefix}.weight_shape" in names:
            shape = [int(v) for v in get_tensor(f"{prefix}.weight_shape").tolist()]
            qweight = qweight[:, :shape[1]].contiguous()
    else:
        qweight = get_tensor(f"{prefix}.weight")
    if qweight.dtype != method.storage_dtype:
        raise ValueError(f"checkpoint tensor {prefix}.weight has dtype {qweight.dtype}, but its "
                         f"quantization_config describes {method.name} ({method.storage_dtype}).")
    if f"{prefix}.weight_zero_point" in names:
        raise ValueError(f"checkpoint tensor {prefix}.weight_zero_point: asymmetric weights are not supported.")
    scales = get_tensor(f"{prefix}.weight_scale")
    n = qweight.shape[0]
    if scales.numel() == 1:  # per tensor
        scales = scales.reshape(1).expand(n).contiguous()
    elif scales.dim() == 2 and scales.shape[1] == 1:
        scales = scales.reshape(n)
    scales = scales.to(model_dtype if method.name == "int8" else torch.float32)
    return QuantizedWeight(qweight.contiguous(), scales.contiguous(), method)


def write_quantized(prefix: str, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized projection."""
    scales = weight.scales.detach()
    scales = scales.view(-1, 1) if scales.dim() == 1 else scales
    if weight.method.name == "int8":
        n, k = weight.qweight.shape
        return {f"{prefix}.weight_packed": _pack_int8(weight.qweight.detach()),
                f"{prefix}.weight_scale": scales.contiguous(),
                f"{prefix}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    return {f"{prefix}.weight": weight.qweight.detach().contiguous(),
            f"{prefix}.weight_scale": scales.to(torch.float32).contiguous()}


def quantize_checkpoint(model_dir: str, out_dir: str, config: QuantizationConfig) -> dict[str, Any]:
    """Write a quantized copy of a full-precision Hugging Face checkpoint in the compressed-tensors
    layout: shard by shard, one tensor at a time, so memory holds one quantized shard at most.
    Everything else in the directory (tokenizer, generation config) is copied as is."""
    import json
    import os
    import shutil

    from pagedllm.config import _STR_TO_DTYPE

    config_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(model_dir):
        raise ValueError(f"model_dir {model_dir!r} does not exist.")
    if model_dir.endswith(".gguf"):
        raise ValueError(f"model_dir {model_dir!r} is a GGUF file: its weights are quantized already, and load as "
                         "they are (quantize reads a Hugging Face checkpoint directory).")
    if not os.path.isfile(config_path):
        raise ValueError(f"model directory {model_dir!r} has no config.json.")
    if os.path.abspath(model_dir) == os.path.abspath(out_dir):
        raise ValueError("out_dir must differ from model_dir.")
    with open(config_path) as f:
        hf = json.load(f)
    if hf.get("quantization_config") is not None:
        raise ValueError(f"model {model_dir!r} is already quantized (its config.json has a quantization_config).")
    scale_dtype = _STR_TO_DTYPE.get(str(hf.get("dtype") or hf.get("torch_dtype")), torch.float32)
    method = config.get_method()
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir!r} has no .safetensors weights.")
    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        return _write_quantized_checkpoint(model_dir, out_dir, files, hf, method, scale_dtype, config)
    except BaseException:
        if created:  # a failed run leaves no half-written directory behind
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _write_quantized_checkpoint(model_dir: str, out_dir: str, files: list[str], hf: dict[str, Any], method: Any,
                                scale_dtype: torch.dtype, config: QuantizationConfig) -> dict[str, Any]:
    import json
    import os
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    num_quantized = full_bytes = out_bytes = 0
    for file in files:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(os.path.join(model_dir, file), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                if is_projection_weight(name) and tensor.dim() == 2:
                    full_bytes += tensor.numel() * tensor.element_size()
                    prefix = name.removesuffix(".weight")
                    if config.method == "int4":  # integer zero points, straight from the full weight
                        written = write_int4(prefix, tensor, method.group_size, scale_dtype)
                    else:
                        written = write_quantized(prefix, method.quantize(tensor, scale_dtype))
                    num_quantized += 1
                else:
                    written = {name: tensor}
                for key, value in written.items():
                    tensors[key] = value
                    weight_map[key] = file
                    out_bytes += value.numel() * value.element_size()
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        del tensors
    if len(files) > 1 or os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json")):
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": out_bytes}, "weight_map": dict(sorted(weight_map.items()))},
                      f, indent=2)
    for entry in os.listdir(model_dir):
        src = os.path.join(model_dir, entry)
        if (os.path.isfile(src) and not entry.endswith(".safetensors")
                and entry not in ("config.json", "model.safetensors.index.json")):
            shutil.copy2(src, os.path.join(out_dir, entry))
    hf["quantization_config"] = build_quantization_config(config)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
        f.write("\n")
    return {"num_quantized": num_quantized, "quantized_input_bytes": full_bytes, "output_bytes": out_bytes}
