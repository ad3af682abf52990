"""Per-layer KV cache scales stored in a checkpoint, as vLLM reads them for fp8 KV caches:
`model.layers.N.self_attn.k_scale` and `.v_scale` (scalars; older checkpoints spell them
`self_attn.k_proj.output_scale` / `v_proj.output_scale`). A value is `code * scale` with e4m3 codes.
"""

from __future__ import annotations

import glob
import logging
import os
import re

import torch

from pagedllm.kv_cache import quant

logger = logging.getLogger(__name__)

_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$")


def load_kv_scales(model_dir: str, num_layers: int, kv_dtype: torch.dtype) -> list[torch.Tensor] | None:
    """[2] fp32 (K, V) scales per layer for a one-byte cache of kv_dtype, or None when the checkpoint has
    none. ValueError if it has them for some layers only. Scales are for e4m3 codes (range +-448); for
    other formats they are stretched to cover the same range (x 448 / qmax)."""
    if not os.path.isdir(model_dir):
        return None
    from safetensors import safe_open

    found: dict[tuple[int, int], float] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                match = _NAME.search(name)
                if match is None:
                    continue
                part = 0 if (match.group(2) or match.group(3)) == "k" else 1
                found[(int(match.group(1)), part)] = float(f.get_tensor(name).float().reshape(-1)[0])
    if not found:
        return None
    missing = [(layer, "kv"[part]) for layer in range(num_layers) for part in (0, 1) if (layer, part) not in found]
    if missing:
        raise ValueError(f"The checkpoint in {model_dir!r} has KV cache scales for some layers but not for "
                         f"{missing[:4]}{'...' if len(missing) > 4 else ''}; kv_cache_dtype needs all or none.")
    stretch = quant.QMAX[torch.float8_e4m3fn] / quant.QMAX[kv_dtype]
    logger.info("KV cache: using the checkpoint's per-layer k_scale / v_scale (%d layers)", num_layers)
    return [torch.tensor([found[(layer, 0)] * stretch, found[(layer, 1)] * stretch], dtype=torch.float32)
            for layer in range(num_layers)]
