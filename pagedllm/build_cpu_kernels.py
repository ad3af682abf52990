"""Run as a script (`python pagedllm/build_cpu_kernels.py`, as setup.py does at install): compile the C++
CPU ops into the kernel cache for this CPU; exit status 0 when they load.

It imports pagedllm.cpu_kernels from the folder it sits in without running pagedllm/__init__.py (which
needs every runtime dependency, some not installed yet while pip builds): an empty package object whose
path is this folder stands in for the package.
"""

import os
import sys
import types

if __name__ == "__main__":
    package = types.ModuleType("pagedllm")
    package.__path__ = [os.path.dirname(os.path.abspath(__file__))]
    sys.modules["pagedllm"] = package
    from pagedllm.cpu_kernels import load_cpu_kernels

    sys.exit(0 if load_cpu_kernels() else 1)
