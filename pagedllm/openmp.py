"""How torch's OpenMP threads wait between parallel regions. GNU OpenMP reads the policy once, when torch
loads it, so `pagedllm/__init__.py` calls `configure_wait_policy()` before anything imports torch; this
module must not import torch itself.

A thread that finishes a region early either spins, ready for the next one, or sleeps on a futex and is
woken. Both extremes fail somewhere:
- Sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a wake-up for each of the hundreds of parallel regions
  of a decode step: on an idle 2-core Xeon the real SmolLM2-135M (bf16, 2 threads, batch 1) decoded at
  33.9 tok/s sleeping against 57.5 spinning (ACTIVE).
- Spinning long (ACTIVE, or GNU OpenMP's default of 300,000 iterations, 3-12 ms) collapses when
  another process holds a core: the spinner keeps a runnable thread on the CPU that the thread it waits
  for needs, and with one busy-loop competitor on 2 cores two spinning threads ran 5-40x slower than two
  sleeping ones (58 and 46 output tok/s against 601, 404 and 634 in one table).

So the default is a bounded spin, GOMP_SPINCOUNT iterations of a load and a `pause`, then sleep, with
the count set for a duration: SPIN_MICROSECONDS covers the gap between two regions of one decode step
(Python dispatch between operators, tens of microseconds), so an idle machine wakes nothing within a
step; a longer wait, which is what a thread parked behind another process causes, ends in a sleep after
a fraction of a scheduler tick, as with PASSIVE. A `pause` lasts about 40 ns on Zen 4 but about 11 ns on
the AMX Xeons these sessions get, so a count fixed on one kind is 4x too short on the other (2,500
iterations spun 28 us there, and the 386M bf16 model decoded 5-8% slower at batch 1 for the wake-ups):
the iteration is timed at import, before torch loads, by running a pause loop (`spin_iteration_ns`). It
is decided from nothing outside the process, so a benchmark run just after another job no longer comes
out 40% slower (the old rule read the 1-minute load average, which still counts work that ended a
minute ago).

An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment always wins.
"""

from __future__ import annotations

import os
import sys

# How long an idle OpenMP thread spins before it sleeps, and the count used where a spin iteration
# cannot be timed (not x86-64 Linux, or executable memory refused): 100 us at Zen 4's 40 ns.
SPIN_MICROSECONDS = 100
FALLBACK_SPINCOUNT = 2500

# "pagedllm" when configure_wait_policy chose the policy, "environment" when the user's variables did,
# "torch loaded first" when torch had read them before pagedllm could choose.
_chosen_by = ""
_iteration_ns: float | None = None

# x86-64 System V: spin(n) runs n iterations of `pause` (GNU OpenMP's cpu_relax): mov rcx, rdi;
# 1: pause; dec rcx; jnz 1b; ret.
_PAUSE_LOOP = bytes([0x48, 0x89, 0xF9, 0xF3, 0x90, 0x48, 0xFF, 0xC9, 0x75, 0xF9, 0xC3])


def spin_iteration_ns(iterations: int = 5000, runs: int = 5) -> float | None:
    """Nanoseconds one iteration of GNU OpenMP's spin-wait loop takes on this CPU (the least of a few timed
    runs of a `pause` loop placed in executable memory), or None where that cannot be measured."""
    import ctypes
    import mmap
    import platform
    import time

    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError):
        return None  # W^X policies (SELinux, PaX) refuse a writable executable mapping
    try:
        code.write(_PAUSE_LOOP)
        buffer = ctypes.c_char.from_buffer(code)
        spin = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64)(ctypes.addressof(buffer))
        best = float("inf")
        for _ in range(runs):
            start = time.perf_counter_ns()
            spin(iterations)
            best = min(best, time.perf_counter_ns() - start)
        del spin, buffer  # the mapping cannot close while a ctypes object still points into it
    finally:
        code.close()
    return best / iterations if best > 0 else None


def default_spincount() -> int:
    """GOMP_SPINCOUNT for SPIN_MICROSECONDS on this CPU (FALLBACK_SPINCOUNT where it cannot be timed)."""
    global _iteration_ns
    if _iteration_ns is None:
        _iteration_ns = spin_iteration_ns()
    if not _iteration_ns:
        return FALLBACK_SPINCOUNT
    return max(100, round(SPIN_MICROSECONDS * 1000 / _iteration_ns))


def configure_wait_policy() -> None:
    """Set GOMP_SPINCOUNT to default_spincount() unless the user chose a wait policy or torch already loaded."""
    global _chosen_by
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        _chosen_by = "environment"
    elif "torch" in sys.modules:
        _chosen_by = "torch loaded first"  # its OpenMP runtime has read the variables already
    else:
        os.environ["GOMP_SPINCOUNT"] = str(default_spincount())
        _chosen_by = "pagedllm"


def wait_policy() -> str:
    """How idle OpenMP threads wait in this process, and who chose it, for start-up lines and benchmarks."""
    if _chosen_by == "torch loaded first":
        return "OpenMP's default (spin about 300,000 iterations, then sleep; torch was imported before pagedllm)"
    who = "pagedllm's default" if _chosen_by == "pagedllm" else "from the environment"
    spin = os.environ.get("GOMP_SPINCOUNT", "").strip()
    if spin:
        timed = ""
        if _chosen_by == "pagedllm" and _iteration_ns:
            timed = f", about {SPIN_MICROSECONDS} us at {_iteration_ns:.0f} ns an iteration on this CPU"
        return f"spin {spin} iterations{timed}, then sleep ({who}: GOMP_SPINCOUNT={spin})"
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    if policy == "PASSIVE":
        return f"sleep at once ({who}: OMP_WAIT_POLICY=PASSIVE)"
    if policy == "ACTIVE":
        return f"spin without bound ({who}: OMP_WAIT_POLICY=ACTIVE)"
    return "OpenMP's default (spin about 300,000 iterations, then sleep)"
