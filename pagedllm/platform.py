"""What the host can do fast. On a CPU without bf16/fp16 matrix instructions (AVX2-only x86, for
instance) half-precision matmuls are emulated and run several times slower than float32."""

from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import logging
import mmap
import os
import platform
import time
from collections.abc import Iterable

import torch

from pagedllm import envs
from pagedllm.openmp import wait_policy

logger = logging.getLogger(__name__)

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


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (a container
    limited to 2 CPUs on a 64-core host sees 64 cores, and torch's default would start 64 threads)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def busy_cpus(samples: int = 5, interval_s: float = 0.005, stat_path: str = "/proc/stat") -> int:
    """CPUs other processes keep busy now: the runnable tasks Linux counts (/proc/stat's procs_running)
    less the thread asking, the least of a few samples milliseconds apart, so that a moment's burst is not
    taken for a steady load. Elsewhere the 1-minute load average, which still counts work that ended a
    minute ago (right after a compile it made a 2-core machine look busy)."""
    counts = []
    for sample in range(samples):
        try:
            with open(stat_path) as f:
                counts += [int(line.split()[1]) - 1 for line in f if line.startswith("procs_running")]
        except (OSError, ValueError, IndexError):
            break
        if sample + 1 < samples:
            time.sleep(interval_s)
    if counts:
        return max(0, min(counts))
    return int(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0


def default_num_threads() -> tuple[int, str]:
    """(threads, why) when neither num_threads nor OMP_NUM_THREADS says: torch's default (one per
    physical core), lowered to the usable CPUs not already kept busy by other processes.

    OpenMP threads meet at a barrier after every operator, so one thread that the OS has parked behind
    another process stalls all of them: with other jobs on a 2-core machine, 2 threads ran decode 5-20x
    slower than 1. `busy_cpus()` counts the CPUs other processes keep busy (ours has only just started).
    Never raises torch's own count (a caller may have lowered it already)."""
    current = torch.get_num_threads()
    cpus = usable_cpus()
    busy = busy_cpus()
    threads = max(1, min(current, cpus - busy))
    return threads, f"{cpus} usable CPUs, {busy} kept busy by other processes now, torch default {current}"


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count for this process and return it.

    An explicit count wins; else OMP_NUM_THREADS, which torch read when it loaded; else
    `default_num_threads()`. The count is process-wide: torch has one thread pool.
    """
    if num_threads is not None:
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}.")
    elif not os.environ.get("OMP_NUM_THREADS"):
        num_threads, why = default_num_threads()
        if num_threads != torch.get_num_threads():
            logger.info("Using %d torch threads (%s); set num_threads / --num-threads or OMP_NUM_THREADS "
                        "to choose.", num_threads, why)
    if num_threads is not None and torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    if torch.get_num_threads() > 1:
        logger.info("Idle torch threads: %s", wait_policy())
    return torch.get_num_threads()


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, for its malloc tuning calls; None off Linux or where it cannot be loaded."""
    if platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@functools.cache
def configure_cpu_allocator() -> bool:
    """Keep freed memory in the process's heap for the next step instead of handing it back to the OS.

    By default glibc serves every allocation above a threshold (at most 32 MiB) with its own mmap and
    unmaps it on free, so a prefill's large activations (a 2,048-token chunk through a 4,864-wide MLP
    is 40 MB in bf16) arrive as fresh pages every layer, each page faulted in and zeroed by the kernel.
    Serving everything from the heap and trimming it only past 2 GiB of free space at its top makes
    long prefills faster and leaves decode steps as they are (docs/performance/index.md). The cost is
    that the process keeps its peak heap. This is the process
    that runs the model, as vLLM's CPU backend gets the same effect by preloading tcmalloc.
    PAGEDLLM_CPU_MALLOC_TUNING=0 leaves glibc's defaults; other C libraries are left alone.
    """
    libc = _glibc()
    if not envs.value("PAGEDLLM_CPU_MALLOC_TUNING") or libc is None:
        return False
    try:
        tuned = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except AttributeError:  # a C library without mallopt
        return False
    if tuned:
        logger.info("glibc malloc keeps freed memory in the heap (no per-allocation mmap); "
                    "PAGEDLLM_CPU_MALLOC_TUNING=0 restores its defaults")
    return tuned


def release_free_heap_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim), e.g. after a model's plain weights
    were replaced by packed copies that live outside the heap: with the allocator tuning above, the freed
    weights would otherwise stay resident as free heap for the life of the process."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def freeze_gc_heap() -> None:
    """Collect once, then hide every object alive now from the cyclic garbage collector (gc.freeze),
    as vLLM does once its engine has started.

    The collector's oldest generation scans every tracked object in the process, and after torch,
    transformers and a model are loaded there are hundreds of thousands of them: a decoding batch
    triggers such a collection every few hundred steps, each one a stall of many steps' length.
    Frozen objects are never scanned again; objects made later (requests, outputs) are collected as
    usual, and what was frozen is
    still freed by reference counting (an engine that is dropped goes away whole: it holds no cycles
    through its model or KV cache). Call it in each process that runs the engine loop, once it is built.
    At exit everything is handed back to the collector, so the interpreter's last collection still
    finalizes what it would have (extension modules such as Triton's check that their objects went).
    """
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)


HUGE_PAGE_BYTES = 2 << 20


def zero_page_buffer(nbytes: int) -> torch.Tensor:
    """An uint8 CPU tensor of `nbytes` zeros that takes no memory until written: a private anonymous
    mapping, whose pages the OS hands out zeroed on first touch. For the KV cache, most of which no request
    may ever use. (calloc gives the same only while the heap's top is fresh: after a load has freed and
    trimmed heap memory it may clear the whole allocation, making a 1.5 GiB cache resident at start-up.)"""
    if nbytes == 0:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """An uint8 CPU tensor of `nbytes` that Linux may back with 2 MiB transparent huge pages.

    For weights read front to back every decode step. With 4 KiB pages the CPU's prefetchers stop at every
    page boundary and every page costs a TLB walk; from huge pages a weight read runs at the bandwidth
    of one large copy (docs/performance/index.md). The buffer is its own private anonymous mapping, aligned to 2 MiB and
    advised MADV_HUGEPAGE before its first touch (THP is often 'madvise' only). Elsewhere, when THP is
    off, or with PAGEDLLM_CPU_HUGE_PAGES=0, it is a plain torch.empty.
    """
    if (not envs.value("PAGEDLLM_CPU_HUGE_PAGES") or platform.system() != "Linux"
            or not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE_BYTES):
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # shares the mapping and keeps it alive
        offset = -buffer.data_ptr() % HUGE_PAGE_BYTES
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, len(mapping) - offset)
    except (OSError, ValueError):
        return torch.empty(nbytes, dtype=torch.uint8)
    return buffer[offset:offset + nbytes]


class HugePageArena:
    """One huge_page_buffer handed out front to back in 64-byte aligned slices: a model's weights placed in
    the order the forward pass reads them, so a decode step streams through one region of 2 MiB pages."""

    ALIGN = 64

    def __init__(self, sizes: Iterable[int]):
        self.buffer = huge_page_buffer(sum(self._aligned(nbytes) for nbytes in sizes))
        self.offset = 0

    @classmethod
    def _aligned(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of the buffer (uint8), the sizes taken in the order they were given."""
        out = self.buffer[self.offset:self.offset + nbytes]
        self.offset += self._aligned(nbytes)
        return out
