"""What the host can do fast. On a CPU without bf16/fp16 matrix instructions (AVX2-only x86, for
instance) half-precision matmuls are emulated and run several times slower than float32."""

from __future__ import annotations

import functools
import platform

import torch

_NATIVE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native(dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return True
    if platform.machine().lower() in ("arm64", "aarch64"):
        return True  # Arm cores with bf16/fp16 units; torch dispatches to them where present
    return any(flag in _cpu_flags() for flag in _NATIVE_FLAGS.get(dtype, ()))


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count for this process and return it.

    An explicit count wins; else OMP_NUM_THREADS, which torch read when it loaded; else torch's own
    default (one thread per physical core). The count is process-wide: torch has one thread pool.
    """
    if num_threads is not None:
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}.")
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)
    return torch.get_num_threads()
