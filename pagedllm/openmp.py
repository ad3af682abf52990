"""How torch's OpenMP threads wait between parallel regions. GNU OpenMP reads the policy once, when torch
loads it, so `pagedllm/__init__.py` calls `configure_wait_policy()` before anything imports torch; this
module must not import torch itself.

A thread that finishes a region early either spins, ready for the next one, or sleeps on a futex and is
woken. Both extremes fail somewhere:
- Sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a wake-up for each of the hundreds of parallel regions
  of a decode step: on an idle 2-core Xeon the real SmolLM2-135M (bf16, 2 threads, batch 1) decoded at
  33.9 tok/s sleeping against 57.5 spinning (ACTIVE).
- Spinning long (ACTIVE, or GNU OpenMP's default of 300,000 iterations, about 12 ms here) collapses when
  another process holds a core: the spinner keeps a runnable thread on the CPU that the thread it waits
  for needs, and with one busy-loop competitor on 2 cores two spinning threads ran 5-40x slower than two
  sleeping ones (58 and 46 output tok/s against 601, 404 and 634 in one table).

So the default is a bounded spin: GOMP_SPINCOUNT iterations of a load and a `pause` (about 40 ns each
on Zen 4 and on recent Xeons), then sleep. DEFAULT_SPINCOUNT covers the gap between two regions of one
decode step (Python dispatch between operators, tens of microseconds), so an idle machine wakes nothing
within a step; a longer wait, which is what a thread parked behind another process causes, ends in a
sleep after a fraction of a scheduler tick, as with PASSIVE. It is decided from nothing outside the
process, so a benchmark run just after another job no longer comes out 40% slower (the old rule read the
1-minute load average, which still counts work that ended a minute ago).

An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment always wins.
"""

from __future__ import annotations

import os
import sys

# Iterations of GNU OpenMP's spin loop; at about 40 ns each, about 100 microseconds.
DEFAULT_SPINCOUNT = 2500

# "pagedllm" when configure_wait_policy chose the policy, "environment" when the user's variables did,
# "torch loaded first" when torch had read them before pagedllm could choose.
_chosen_by = ""


def configure_wait_policy() -> None:
    """Set GOMP_SPINCOUNT to DEFAULT_SPINCOUNT unless the user chose a wait policy or torch already loaded."""
    global _chosen_by
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        _chosen_by = "environment"
    elif "torch" in sys.modules:
        _chosen_by = "torch loaded first"  # its OpenMP runtime has read the variables already
    else:
        os.environ["GOMP_SPINCOUNT"] = str(DEFAULT_SPINCOUNT)
        _chosen_by = "pagedllm"


def wait_policy() -> str:
    """How idle OpenMP threads wait in this process, and who chose it, for start-up lines and benchmarks."""
    if _chosen_by == "torch loaded first":
        return "OpenMP's default (spin about 300,000 iterations, then sleep; torch was imported before pagedllm)"
    who = "pagedllm's default" if _chosen_by == "pagedllm" else "from the environment"
    spin = os.environ.get("GOMP_SPINCOUNT", "").strip()
    if spin:
        return f"spin {spin} iterations, then sleep ({who}: GOMP_SPINCOUNT={spin})"
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    if policy == "PASSIVE":
        return f"sleep at once ({who}: OMP_WAIT_POLICY=PASSIVE)"
    if policy == "ACTIVE":
        return f"spin without bound ({who}: OMP_WAIT_POLICY=ACTIVE)"
    return "OpenMP's default (spin about 300,000 iterations, then sleep)"
