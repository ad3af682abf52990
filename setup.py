"""Build hook: `pip install .` and `pip install -e .` compile pagedllm's C++ CPU ops for this CPU into the
kernel cache (pagedllm/cpu_kernels.py), so the first start does not pay the build.

The ops are compiled with -march=native for the machine that runs them, so they go to the per-user cache
keyed by the sources, the torch version and the CPU's flags, not into the wheel: a wheel moved to another
machine builds there at first use, as before. The build runs in a child process of the interpreter being
installed into, outside pip's isolated build environment (which has no torch); where torch is not
installed yet (a fresh virtualenv installs dependencies after building), or the build fails, the install
goes on, says so, and the kernels build at first use. PAGEDLLM_SKIP_KERNEL_BUILD=1 skips this step.
"""

from __future__ import annotations

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))

class BuildPyWithCpuKernels(build_py):
    def run(self) -> None:
        super().run()
        if os.environ.get("PAGEDLLM_SKIP_KERNEL_BUILD", "").strip().lower() in ("1", "true", "yes", "on"):
            return
        # Leave pip's isolated environment: its PYTHONPATH hides the site-packages that hold torch.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
        print("pagedllm: compiling the C++ CPU ops for this CPU (once per machine and version; about 20-60 s)",
              flush=True)
        try:
            result = subprocess.run([sys.executable, os.path.join(HERE, "pagedllm", "build_cpu_kernels.py")],
                                    env=env, capture_output=True, text=True, timeout=1800)
            ok, detail = result.returncode == 0, (result.stderr.strip().splitlines() or [""])[-1]
        except (OSError, subprocess.TimeoutExpired) as error:
            ok, detail = False, str(error)
        if ok:
            print("pagedllm: CPU ops built into the kernel cache", flush=True)
        else:
            print(f"pagedllm: CPU ops not built at install ({detail or 'no torch here yet'}); they build at "
                  "first use", flush=True)


setup(cmdclass={"build_py": BuildPyWithCpuKernels})
