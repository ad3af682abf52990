"""Load a local checkpoint into our own layers: a Hugging Face directory (safetensors, single file or
sharded) or a GGUF file (pagedllm.models.gguf).

With weight-only quantization the linear projections are quantized one at a time as they are read
(full-precision checkpoint) or read as stored (compressed-tensors checkpoint), so the full-precision
model is never held in memory: each projection's parameter is replaced by a QuantizedWeight before
the next one is read. Under tensor parallelism a rank keeps its part of the logical quantized weight
(values and group scales, models/quantized_parts.py) and packs only that.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import ExitStack

import torch
from safetensors import safe_open

from pagedllm.attention.backend import AttentionBackend
from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import WeightShard
from pagedllm.layers.linear import prepack_linear_weights
from pagedllm.layers.module import bind_attributes
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.quantization.compressed_tensors import has_quantized, read_int4, read_quantized
from pagedllm.layers.quantization.int4 import (
    INT4_ZERO,
    OUT_FEATURES_MULTIPLE,
    Int4WeightOnlyMethod,
    int4_supports,
    quantize_groups,
)
from pagedllm.layers.quantization.vnni import describe_prompt_rows, has_vnni_weights, select_quantized_kernels
from pagedllm.models.gguf import GGUFCheckpoint, is_gguf_path
from pagedllm.models.quantized_parts import QuantizedParts, shard_parts
from pagedllm.models.registry import get_model_class
from pagedllm.platform import release_free_heap_memory

logger = logging.getLogger(__name__)


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, shard) for shard in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise ValueError(f"model directory {model_dir!r} has no .safetensors weights.")
    return [os.path.join(model_dir, f) for f in found]


class QuantizedLinearLoader:
    """Called by a model's load_weights for each parameter it fills: for a quantizable projection it
    builds the QuantizedWeight from the checkpoint names (fused projections: their rows concatenated,
    scales with their channels) and puts it in the parameter's place."""

    def __init__(self, model: torch.nn.Module, config: QuantizationConfig, model_dtype: torch.dtype,
                 get_tensor, names: set[str]):
        self.config = config
        self.method = config.get_method()
        self.model_dtype = model_dtype
        self.get_tensor = get_tensor
        self.names = names
        # Named "<module>.<param>" (qkv_proj.weight, ...): the embedding, LM head and norms have a
        # `weight` too, and stay in the model dtype.
        quantizable = set(getattr(model, "quantizable_weights", ()))
        self.slots = {id(param): (module, attr) for module_name, module in model.named_modules()
                      for attr, param in module.named_parameters(recurse=False)
                      if f"{module_name.rpartition('.')[2]}.{attr}" in quantizable}
        self.num_quantized = 0
        self.full_precision_bytes = 0
        self.quantized_bytes = 0

    def __call__(self, dst: torch.Tensor, srcs: tuple[str, ...], shard: WeightShard) -> bool:
        slot = self.slots.pop(id(dst), None)
        if slot is None:
            return False
        prefixes = [name.removesuffix(".weight") for name in srcs]
        if self.config.from_checkpoint:
            stored = [has_quantized(prefix, self.names) for prefix in prefixes]
            if not any(stored):
                return False  # left in full precision by the checkpoint's `ignore` list
            if not all(stored):
                raise ValueError(f"checkpoint quantizes only some of {prefixes}, which this model fuses.")
        # Each checkpoint tensor in its logical quantized form (a fused tensor read once, however many
        # ranges of it this rank holds), this rank's ranges of them, and only then the packed weight.
        names = list(dict.fromkeys(srcs))
        if self.config.from_checkpoint:
            read = {name: self._read_stored(name.removesuffix(".weight")) for name in names}
        else:
            read = self._quantize(names, dst.shape[1] if shard.dim == 0 else None)
        parts = shard_parts([read[name] for name in srcs], shard, srcs)
        del read
        if tuple(parts.shape) != tuple(dst.shape):
            raise ValueError(f"checkpoint weights {prefixes} give this rank a weight of shape {tuple(parts.shape)}, "
                             f"expected {tuple(dst.shape)}.")
        if isinstance(self.method, Int4WeightOnlyMethod) and not int4_supports(*parts.shape, parts.group_size):
            raise ValueError(f"quantization='int4': this rank's part of {list(srcs)} is a {list(parts.shape)} "
                             f"weight, which the int4 kernel cannot take (output features in multiples of "
                             f"{OUT_FEATURES_MULTIPLE}, whole groups of {parts.group_size}); use another "
                             f"tensor_parallel_size.")
        qweight = parts.build(self.method, self.model_dtype)
        module, attr = slot
        self.full_precision_bytes += dst.numel() * dst.element_size()
        self.quantized_bytes += qweight.nbytes()
        self.num_quantized += 1
        del module._parameters[attr]  # frees the (never written) full-precision parameter
        setattr(module, attr, qweight)
        return True

    def _read_stored(self, prefix: str) -> QuantizedParts:
        """One checkpoint tensor as stored (compressed-tensors)."""
        if isinstance(self.method, Int4WeightOnlyMethod):
            return QuantizedParts("int4", *read_int4(prefix, self.get_tensor, self.names))
        weight = read_quantized(prefix, self.get_tensor, self.names, self.method, self.model_dtype)
        return QuantizedParts(self.method.name, weight.qweight.data, weight.scales.data)

    def _quantize(self, names: list[str], in_features: int | None) -> dict[str, QuantizedParts]:
        """Full-precision checkpoint tensors quantized whole and together (their rows fused, as the
        kernel's shape rules apply to the fused weight), then split back by tensor. Whole, not a rank's
        part: every tensor-parallel size then runs the same weights (a per-channel scale is the row's)."""
        fulls = [self.get_tensor(name) for name in names]
        rows = [f.shape[0] for f in fulls]
        full = torch.cat(fulls) if len(fulls) > 1 else fulls[0]
        if full.dim() != 2 or in_features not in (None, full.shape[1]):
            raise ValueError(f"checkpoint weights {names} have shape {tuple(full.shape)}, expected "
                             f"{in_features} input features.")
        if isinstance(self.method, Int4WeightOnlyMethod):
            q, scales, zero_points = quantize_groups(full, self.method.group_size, self.model_dtype)
            s = scales.to(torch.float32)
            whole = QuantizedParts("int4", q, s, -(INT4_ZERO + zero_points.to(torch.float32)) * s)
        else:
            weight = self.method.quantize(full, self.model_dtype)
            whole = QuantizedParts(self.method.name, weight.qweight.data, weight.scales.data)
        del full, fulls
        out, start = {}, 0
        for name, count in zip(names, rows):
            out[name] = whole.narrow(0, start, count, name)
            start += count
        return out


def load_model(config: ModelConfig, backend: AttentionBackend, device: torch.device,
               tp_rank: int = 0, tp_size: int = 1, batch_invariant: bool = True) -> torch.nn.Module:
    """The model with this rank's shard of every weight; only that shard is read from the files.
    batch_invariant=False: a model whose numerics never reach the outputs (a draft) may use faster
    matmuls whose results depend on the batch (prepack_linear_weights)."""
    model_class = get_model_class(config.architecture)
    model = model_class(config, backend, tp_rank, tp_size)
    if is_gguf_path(config.model):
        _load_gguf(model, config)
    else:
        _load_safetensors(model, config, device)
    model = model.to(device).eval()
    prepack_linear_weights(model, device, config.dtype, batch_invariant)
    if device.type == "cpu":
        model.quant_kernel_choices = select_quantized_kernels(model, config.dtype)
        for choice in model.quant_kernel_choices:
            logger.info("Quantized linear kernel: %s", choice.describe())
        if has_vnni_weights(model):
            logger.info("Quantized linears' prompt rows: %s", describe_prompt_rows(config.dtype))
        # What loading freed (file buffers, unpacked parts, weights replaced by packed ones) would stay in
        # the heap, resident, until later allocations reuse it: hand it back now.
        release_free_heap_memory()
    bind_attributes(model)
    return model


def _load_gguf(model: torch.nn.Module, config: ModelConfig) -> None:
    checkpoint = GGUFCheckpoint(config.model, config.hf_config)
    with torch.no_grad():
        if config.quantization is not None:  # asked for: every projection quantized from its dense form
            packed = checkpoint.packed_types()
            if packed:
                logger.warning("quantization=%r re-quantizes this GGUF file's %s weights from their dequantized "
                               "values instead of keeping them packed as stored (more bytes per weight if the "
                               "file's are fewer, and two roundings); leave quantization unset to run the file's "
                               "own.", config.quantization.method, "/".join(packed))
            loader = QuantizedLinearLoader(model, config.quantization, config.dtype,
                                           lambda name: checkpoint.get_slice(name)[:], set())
            model.load_weights(checkpoint.get_slice, checkpoint, loader)
        elif getattr(model, "quantizable_weights", ()):
            checkpoint.bind_model(model)
            model.load_weights(checkpoint.get_slice, checkpoint, checkpoint.load_linear)
        else:
            model.load_weights(checkpoint.get_slice, checkpoint)
    checkpoint.log_summary(config.dtype)


def _load_safetensors(model: torch.nn.Module, config: ModelConfig, device: torch.device) -> None:
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(path, framework="pt")) for path in
                   _safetensors_files(config.model)]
        where = {name: handle for handle in handles for name in handle.keys()}

        def get_slice(name: str):
            if name not in where:
                raise ValueError(f"checkpoint {config.model!r} lacks weight {name!r}.")
            return where[name].get_slice(name)

        def get_tensor(name: str) -> torch.Tensor:
            return get_slice(name)[:]

        names = set(where)
        with torch.no_grad():
            if config.quantization is None:
                model.load_weights(get_slice, names)
            else:
                config.quantization.get_method().check_device(device, config.dtype)
                loader = QuantizedLinearLoader(model, config.quantization, config.dtype, get_tensor, names)
                model.load_weights(get_slice, names, loader)
                logger.info("quantization=%s%s: %d linear weights %s, %.1f MiB in %s -> %.1f MiB",
                            config.quantization.method,
                            f" (group size {config.quantization.group_size})" if config.quantization.group_size
                            else "", loader.num_quantized,
                            "read as stored" if config.quantization.from_checkpoint else "quantized on load",
                            loader.full_precision_bytes / 2**20, str(config.dtype).removeprefix("torch."),
                            loader.quantized_bytes / 2**20)
