"""Which attention backend runs: the engine's `attention_backend`, else the PAGEDLLM_ATTENTION_BACKEND
environment variable (as vLLM's VLLM_ATTENTION_BACKEND), else the device's default.

    TORCH_SDPA   K/V gathered through the block tables, then torch SDPA: the reference, any device
    TORCH_FLASH  the tiled online-softmax recurrence in torch ops: any device, no compiler needed
    CPU_FLASH    the C++ kernel (compiled on first use; the TORCH_FLASH code if that fails): CPU
    TRITON       Triton kernels: CUDA (or the Triton interpreter, for tests)
"""

from __future__ import annotations

import logging
import os

import torch

from pagedllm import envs
from pagedllm.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)

ENV_VAR = "PAGEDLLM_ATTENTION_BACKEND"
BACKENDS = ("TORCH_SDPA", "TORCH_FLASH", "CPU_FLASH", "TRITON")


def _triton_usable(device: torch.device) -> bool:
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_backend_name(device: torch.device, kv_cache_dtype: torch.dtype) -> str:
    if device.type == "cpu":
        from pagedllm.cpu_kernels import load_cpu_kernels

        # The kernel reads the pages in place where the reference gathers them first (`pagedllm bench
        # attention` compares the two); without a compiler the reference is faster than the torch-op recurrence.
        return "CPU_FLASH" if load_cpu_kernels() else "TORCH_SDPA"
    if device.type == "cuda" and kv_cache_dtype.itemsize != 1 and _triton_usable(device):
        return "TRITON"
    return "TORCH_SDPA"


def resolve_backend_name(name: str | None, device: torch.device, kv_cache_dtype: torch.dtype,
                         block_size: int | None = None) -> str:
    """The backend to use; ValueError (naming the parameter) for an unknown or unusable choice."""
    source = "attention_backend"
    if name is None and envs.is_set(ENV_VAR):
        name, source = envs.value(ENV_VAR), ENV_VAR
    if name is None or name.lower() == "auto":
        return default_backend_name(device, kv_cache_dtype)
    name = name.upper()
    if name not in BACKENDS:
        raise ValueError(f"{source} must be 'auto' or one of {list(BACKENDS)}, got {name!r}.")
    if name == "CPU_FLASH" and device.type != "cpu":
        raise ValueError(f"{source}=CPU_FLASH runs on CPU only; the device is {device}.")
    if name == "TRITON":
        if not _triton_usable(device):
            raise ValueError(f"{source}=TRITON needs a CUDA device with triton installed; the device is {device}.")
        if block_size is not None:
            from pagedllm.attention.triton_paged import _check_block_size

            _check_block_size(block_size)
    return name


def get_attn_backend(name: str | None, num_heads: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, kv_cache_dtype: torch.dtype, device: torch.device,
                     block_size: int | None = None, calculate_kv_scales: bool = False) -> AttentionBackend:
    name = resolve_backend_name(name, device, kv_cache_dtype, block_size)
    if name == "TORCH_SDPA":
        from pagedllm.attention.torch_paged import TorchPagedAttention as backend_class
    elif name == "TORCH_FLASH":
        from pagedllm.attention.torch_flash import TorchFlashAttention as backend_class
    elif name == "CPU_FLASH":
        from pagedllm.attention.cpu_flash import CpuFlashAttention as backend_class
    else:
        from pagedllm.attention.triton_paged import TritonPagedAttention as backend_class
    logger.debug("attention backend: %s", name)
    backend = backend_class(num_heads, num_kv_heads, head_dim, dtype)
    backend.configure_kv_cache(kv_cache_dtype, calculate_kv_scales)
    return backend
