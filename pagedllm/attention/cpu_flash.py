"""The CPU FlashAttention backend: the C++ kernel in csrc/paged_attention_cpu.cpp, compiled on first use.

The kernel is built with `-march=native` for the machine that runs it (AVX2 or AVX-512, whichever the
CPU has), so it is compiled here rather than shipped: `torch.utils.cpp_extension.load` builds it into
a cache directory keyed by the source, the torch version and the CPU's flags, once per machine. With
no compiler (or a failed build) one line is logged and the same algorithm runs in plain torch
(`torch_flash.paged_flash_attention`): correct, slower.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import time

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.torch_flash import paged_flash_attention
from pagedllm.kv_cache import quant

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention_cpu.cpp")


def _cache_dir(source_digest: str) -> str:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm")
    # -march=native binaries are only valid on CPUs with the same flags: key the build by them.
    from pagedllm.platform import _cpu_flags

    machine = hashlib.sha256(" ".join(sorted(_cpu_flags())).encode() + platform.machine().encode()).hexdigest()[:12]
    return os.path.join(root, "kernels", f"cpu_attention-{torch.__version__}-{source_digest}-{machine}")


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (first time on this machine) and load the C++ ops; False, with one log line, if impossible."""
    if os.environ.get("PAGEDLLM_DISABLE_CPU_KERNELS") == "1":
        return False
    try:
        from torch.utils import cpp_extension

        with open(_SOURCE, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        build_dir = _cache_dir(digest)
        os.makedirs(build_dir, exist_ok=True)
        start = time.perf_counter()
        flags = ["-O3", "-fopenmp-simd", "-std=c++17"]
        if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"):
            flags.append("-march=native")
        # torch's build lock is a plain file: a process killed mid-build leaves it behind and every later
        # load would wait on it forever. An flock dies with its holder, so whoever holds ours may clear it.
        with open(build_dir + ".flock", "w") as flock_file:
            fcntl.flock(flock_file, fcntl.LOCK_EX)
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                os.remove(stale)
            cpp_extension.load(name="pagedllm_cpu_attention", sources=[_SOURCE], extra_cflags=flags,
                               build_directory=build_dir, is_python_module=False, verbose=False)
        elapsed = time.perf_counter() - start
        if elapsed > 1.0:
            logger.info("Built the CPU attention kernel in %.0f s (cached in %s)", elapsed, build_dir)
        return True
    except Exception as exc:  # no compiler, no headers, a failed build: all mean "use the torch path"
        logger.warning("CPU attention kernel unavailable (%s: %s); using the pure-torch tiled attention",
                       type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return False


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, kv_cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Attention of every query row over its sequence's paged context (bottom-right causal).

    query [T, Hq, D]; kv_cache [2, Hkv, num_blocks, block_size, D], or a one-byte cache of kv_cache_dtype
    (kv_cache/quant.py); block_tables [B, max_blocks] and seq_lens [B] and query_start_loc [B + 1], all
    int64. Returns [T, Hq, D] in the query's dtype.
    """
    if out is None:
        out = torch.empty_like(query)
    if load_cpu_kernels():
        if kv_cache_dtype is not None and quant.is_quantized(kv_cache_dtype):
            codes, scales = quant.split_cache(kv_cache, kv_cache_dtype, query.shape[-1])
            torch.ops.pagedllm_cpu.paged_attention(query.contiguous(), codes, block_tables, seq_lens,
                                                   query_start_loc, scale, out, scales)
        else:
            torch.ops.pagedllm_cpu.paged_attention(query.contiguous(), kv_cache, block_tables, seq_lens,
                                                   query_start_loc, scale, out)
    else:
        paged_flash_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale, out=out,
                              kv_cache_dtype=kv_cache_dtype)
    return out


class CpuFlashAttention(AttentionBackend):
    """Reads K/V in place from the paged cache: no gather, no padding to the longest sequence, no mask."""

    name = "CPU_FLASH"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, compute_dtype: torch.dtype):
        super().__init__(num_heads, num_kv_heads, head_dim, compute_dtype)
        self.use_kernel = load_cpu_kernels()

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if self.use_kernel and self.quantized:
            codes, scales = quant.split_cache(kv_cache, self.kv_cache_dtype, self.head_dim)
            torch.ops.pagedllm_cpu.write_kv_quant(key, value, codes, scales, slot_mapping,
                                                  self.layer_static_scales(kv_cache, key, value),
                                                  quant.QMAX[self.kv_cache_dtype])
        elif self.use_kernel:
            torch.ops.pagedllm_cpu.write_kv(key, value, kv_cache, slot_mapping)
        else:
            super().write_kv(kv_cache, key, value, slot_mapping)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        return paged_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                               metadata.query_start_loc, scale, kv_cache_dtype=self.kv_cache_dtype)
