"""Machines for the planner: datasheet presets for accelerators, and the local CPU measured on the spot."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HardwareSpec:
    """Peak dense 16-bit FLOP/s, memory bandwidth (bytes/s) and memory (bytes) of one device."""

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    measured: bool = False  # True when the numbers come from running on this machine

    @property
    def ridge_point(self) -> float:
        return self.peak_flops / self.memory_bandwidth


# Datasheet numbers (dense fp16/bf16 tensor-core FLOP/s, without sparsity), decimal units.
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "h100-sxm": HardwareSpec("h100-sxm", 989e12, 3.35e12, 80e9),
    "h100-pcie": HardwareSpec("h100-pcie", 756e12, 2.0e12, 80e9),
    "h200": HardwareSpec("h200", 989e12, 4.8e12, 141e9),
    "a100-80g": HardwareSpec("a100-80g", 312e12, 2.039e12, 80e9),
    "a100-40g": HardwareSpec("a100-40g", 312e12, 1.555e12, 40e9),
    "l40s": HardwareSpec("l40s", 362e12, 0.864e12, 48e9),
    "mi300x": HardwareSpec("mi300x", 1307e12, 5.3e12, 192e9),
}


def synchronizer(device: str | torch.device) -> Callable[[], None]:
    """What waits for the device's queued work before a clock is read: nothing on the CPU."""
    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def measure_memory_bandwidth(num_bytes: int = 128 * 2**20, repeats: int = 5, device: str | torch.device = "cpu",
                             clock=time.perf_counter) -> float:
    """STREAM-like copy bandwidth in bytes/s: best of a few `dst.copy_(src)` over buffers far larger than
    the caches, counting the read and the write. Best-of because other processes only ever slow it down.
    `clock`: what times each copy (bench attention's `--clock cpu` passes time.process_time)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first: a fresh tensor's page faults are not bandwidth
    sync = synchronizer(src.device)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = clock()
        dst.copy_(src)
        sync()
        best = min(best, clock() - start)
    return 2 * num_bytes / best


def measure_matmul_flops(dtype: torch.dtype = torch.bfloat16, max_size: int = 2048, budget_s: float = 0.5) -> float:
    """Square `F.linear` FLOP/s (2 n^3 per product), best of a few, in the given dtype.

    F.linear because that is what the model's layers call (on some CPUs it takes a faster oneDNN path
    than torch.matmul). The size grows from 256 until one product takes about 20 ms, so a CPU without
    16-bit matrix units (bf16 can be 50x slower than fp32 there) still finishes within the budget.
    """
    size = 256
    while True:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        torch.nn.functional.linear(a, b)  # warm-up: oneDNN picks and caches its kernel on the first call
        best = float("inf")
        for _ in range(2):  # best of two, so one call slowed by another process does not stop the growth
            start = time.perf_counter()
            torch.nn.functional.linear(a, b)
            best = min(best, time.perf_counter() - start)
        if best > 0.02 or size >= max_size:
            break
        size *= 2
    for _ in range(max(0, min(4, int(budget_s / best) - 1))):
        start = time.perf_counter()
        torch.nn.functional.linear(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _physical_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@functools.lru_cache(maxsize=4)
def measure_cpu(dtype: torch.dtype = torch.bfloat16) -> HardwareSpec:
    """This machine's CPU with torch's current thread count; takes a fraction of a second."""
    return HardwareSpec(
        name=f"cpu ({torch.get_num_threads()} threads, measured)",
        peak_flops=measure_matmul_flops(dtype),
        memory_bandwidth=measure_memory_bandwidth(),
        memory_bytes=_physical_memory_bytes(),
        measured=True,
    )


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def get_hardware(name: str, dtype: str = "bfloat16") -> HardwareSpec:
    """A preset by name, or "cpu" measured now with matmuls in `dtype` (8-bit dtypes measure bf16)."""
    key = name.lower()
    if key == "cpu":
        return measure_cpu(_TORCH_DTYPES.get(dtype.removeprefix("torch."), torch.bfloat16))
    if key not in HARDWARE_PRESETS:
        raise ValueError(f"--hardware {name!r} is unknown; expected cpu or one of {', '.join(HARDWARE_PRESETS)}")
    return HARDWARE_PRESETS[key]
