"""Weight-only quantization of the linear projections (int8, fp8, int4), vLLM-style.

`linear(x, weight, bias)` is the one call every quantizable projection makes: `F.linear` for a plain
tensor, the method's kernel for a QuantizedWeight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.layers.quantization.base import (
    GROUPED_METHODS,
    QUANTIZATION_METHODS,
    QuantizationConfig,
    QuantizationMethod,
    QuantizedWeight,
)

# What `quantization=` accepts: a method to quantize on load, or the checkpoint's own format.
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, "compressed-tensors")


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return weight.method.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def validate_quantization(quantization: Any, group_size: Any) -> None:
    """The boundary check of `quantization=` / `quantization_group_size=` (EngineArgs, CLI)."""
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_CHOICES)} or None, got {quantization!r}.")
    if group_size is not None:
        if quantization not in GROUPED_METHODS:
            raise ValueError(f"quantization_group_size needs quantization in {list(GROUPED_METHODS)} (fp8 scales "
                             f"are per output channel), got quantization={quantization!r}.")
        QuantizationConfig(quantization, group_size)


def resolve_quantization(quantization: str | None, group_size: int | None,
                         hf_config: dict[str, Any]) -> QuantizationConfig | None:
    """What quantizes this model: the checkpoint's `quantization_config` when it has one (and the
    request, if any, must agree with it), else `quantization` applied as the weights load."""
    from pagedllm.layers.quantization.compressed_tensors import parse_quantization_config

    validate_quantization(quantization, group_size)
    stored = hf_config.get("quantization_config")
    if stored is not None:
        config = parse_quantization_config(stored)
        if quantization not in (None, "compressed-tensors", config.method):
            raise ValueError(f"quantization={quantization!r} but the checkpoint is already quantized as "
                             f"{config.method} (compressed-tensors); pass quantization=None or "
                             f"{config.method!r}.")
        if group_size is not None and group_size != config.group_size:
            raise ValueError(f"quantization_group_size={group_size} but the checkpoint's group size is "
                             f"{config.group_size}.")
        return config
    if quantization == "compressed-tensors":
        raise ValueError("quantization='compressed-tensors' but the checkpoint's config.json has no "
                         "quantization_config; pass 'int8' or 'fp8' to quantize it on load.")
    if quantization is None:
        return None
    return QuantizationConfig(quantization, group_size)


__all__ = [
    "QUANTIZATION_CHOICES",
    "QUANTIZATION_METHODS",
    "QuantizationConfig",
    "QuantizationMethod",
    "QuantizedWeight",
    "linear",
    "resolve_quantization",
    "validate_quantization",
]
