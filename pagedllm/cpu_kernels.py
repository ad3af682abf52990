"""pagedllm's C++ CPU ops, compiled on first use: the paged attention kernel
(attention/csrc/paged_attention_cpu.cpp, namespace torch.ops.pagedllm_cpu), the decoder's small fused
ops (layers/csrc/cpu_layers.cpp, torch.ops.pagedllm_cpu_layers: argmax, residual add + RMSNorm, RoPE), the
blocked linear kernel (layers/csrc/cpu_linear.cpp, torch.ops.pagedllm_cpu_linear), the quantized linear
kernel (layers/csrc/cpu_quant_linear.cpp, torch.ops.pagedllm_cpu_qlinear), the sampler's seeded Gumbel
race, unseeded draw and top candidates (layers/csrc/sampler_ops.cpp, torch.ops.pagedllm_cpu_sampler) and a
step's input tensors (worker/csrc/step_inputs.cpp, torch.ops.pagedllm_cpu_step).

They are built with `-march=native` for the machine that runs them (AVX2 or AVX-512, whichever the CPU
has), so they are compiled here rather than shipped: `torch.utils.cpp_extension.load` builds one
extension into a cache directory keyed by the sources, the torch version and the CPU's flags, once per
machine. `pip install` builds them into that cache (setup.py); the first use builds them where it did not
(a wheel moved to another machine, a fresh virtualenv). With no compiler (or a failed build) one warning
says so and what it costs, and every caller runs its plain-torch path: correct, slower.
PAGEDLLM_DISABLE_CPU_KERNELS=1 forces that path.
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

from pagedllm import envs

logger = logging.getLogger(__name__)

_ROOT = os.path.dirname(__file__)
_SOURCES = [os.path.join(_ROOT, "attention", "csrc", "paged_attention_cpu.cpp"),
            os.path.join(_ROOT, "layers", "csrc", "cpu_layers.cpp"),
            os.path.join(_ROOT, "layers", "csrc", "cpu_linear.cpp"),
            os.path.join(_ROOT, "layers", "csrc", "cpu_quant_linear.cpp"),
            os.path.join(_ROOT, "layers", "csrc", "sampler_ops.cpp"),
            os.path.join(_ROOT, "worker", "csrc", "step_inputs.cpp")]
_INCLUDE = os.path.join(_ROOT, "csrc")  # headers both share (fast_exp.h)

# What running without the ops costs, for the line that says so: batch-1 decode of the real SmolLM2-135M
# (bf16, one thread, 128-token prompt) ran 1.50x and 1.58x slower with PAGEDLLM_DISABLE_CPU_KERNELS=1 in
# two interleaved pairs on a shared 2-core Zen 4 (`pagedllm bench latency` both ways re-measures it).
FALLBACK_COST = "about 1.5x slower at batch-1 decode"


def cache_root() -> str:
    """Where compiled kernels (and the measured kernel table, layers/linear_tuning.py) live."""
    root = envs.value("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm")
    return os.path.join(root, "kernels")


def _cache_dir(source_digest: str) -> str:
    # -march=native binaries are only valid on CPUs with the same flags: key the build by them.
    from pagedllm.platform import _cpu_flags

    machine = hashlib.sha256(" ".join(sorted(_cpu_flags())).encode() + platform.machine().encode()).hexdigest()[:12]
    return os.path.join(cache_root(), f"cpu_ops-{torch.__version__}-{source_digest}-{machine}")


def _build_flags() -> tuple[list[str], bool]:
    """(compiler flags, whether OpenMP is on). -fopenmp turns at::parallel_for into torch's OpenMP pool
    (without it the header's parallel_for runs serially); on Linux the extension links libgomp.so.1, which
    resolves to the copy torch has loaded. Elsewhere (Apple's clang has no -fopenmp) the ops build without
    it and run on one thread."""
    openmp = platform.system() == "Linux"
    flags = ["-O3", "-fopenmp" if openmp else "-fopenmp-simd", "-std=c++17"]
    if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"):
        flags.append("-march=native")
    if platform.machine().lower() in ("x86_64", "amd64"):
        # GCC vectorises for 256-bit registers even where the CPU has AVX-512 unless told otherwise: the
        # elementwise ops' loops (silu and mul, the norms, RoPE) ran at half width (figures in
        # docs/performance/intel-amx.md). The kernels written in intrinsics choose their own width.
        flags.append("-mprefer-vector-width=512")
    return flags, openmp


@functools.cache
def sources_digest() -> str:
    """The C++ sources and compiler flags, hashed: a change of either is a new build (and a new kernel table)."""
    digest = hashlib.sha256(" ".join(_build_flags()[0]).encode())
    for path in _SOURCES + sorted(os.path.join(_INCLUDE, name) for name in os.listdir(_INCLUDE)):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def _copy_sources(build_dir: str) -> tuple[list[str], str]:
    """The sources, copied into the build directory (keyed by their content), and the header folder there.
    ninja records the paths it compiled: built from each install's own paths, two clones or virtualenvs
    of the same version would rebuild each other's build at every switch; from these copies they share it."""
    src_dir = os.path.join(build_dir, "src")
    include_dir = os.path.join(src_dir, "include")
    os.makedirs(include_dir, exist_ok=True)
    copies = [(path, os.path.join(src_dir, os.path.basename(path))) for path in _SOURCES]
    copies += [(os.path.join(_INCLUDE, name), os.path.join(include_dir, name)) for name in os.listdir(_INCLUDE)]
    for source, copy in copies:
        with open(source, "rb") as f:
            data = f.read()
        if not os.path.exists(copy) or open(copy, "rb").read() != data:  # the same bytes keep their mtime
            tmp = f"{copy}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, copy)
    return [copy for _, copy in copies[:len(_SOURCES)]], include_dir


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (first time on this machine) and load the C++ ops; False, with one log line, if impossible."""
    if envs.value("PAGEDLLM_DISABLE_CPU_KERNELS"):
        logger.info("PAGEDLLM_DISABLE_CPU_KERNELS=1: torch ops instead of pagedllm's C++ CPU ops (%s)",
                    FALLBACK_COST)
        return False
    try:
        from torch.utils import cpp_extension

        flags, openmp = _build_flags()
        build_dir = _cache_dir(sources_digest())
        os.makedirs(build_dir, exist_ok=True)
        build_sources, build_include = _copy_sources(build_dir)
        start = time.perf_counter()
        # torch's build lock is a plain file: a process killed mid-build leaves it behind and every later
        # load would wait on it forever. An flock dies with its holder, so whoever holds ours may clear it.
        with open(build_dir + ".flock", "w") as flock_file:
            fcntl.flock(flock_file, fcntl.LOCK_EX)
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                os.remove(stale)
            cpp_extension.load(name="pagedllm_cpu_ops", sources=build_sources, extra_cflags=flags,
                               extra_include_paths=[build_include], extra_ldflags=["-fopenmp"] if openmp else [],
                               build_directory=build_dir,
                               is_python_module=False, verbose=False)
        elapsed = time.perf_counter() - start
        if elapsed > 1.0:
            logger.info("Built the CPU kernels in %.0f s (cached in %s)", elapsed, build_dir)
        return True
    except Exception as exc:  # no compiler, no headers, a failed build: all mean "use the torch path"
        lines = str(exc).strip().splitlines()
        logger.warning("pagedllm's C++ CPU ops could not be built (%s%s): falling back to torch ops, %s; "
                       "PAGEDLLM_LOGGING_LEVEL=DEBUG shows the compiler's output", type(exc).__name__,
                       f": {lines[-1]}" if lines else "", FALLBACK_COST)
        logger.debug("CPU kernel build failure", exc_info=True)
        return False


def cpu_ops_available(*tensors: torch.Tensor) -> bool:
    """Whether the C++ ops can take these tensors: all on the CPU, and the ops built. Asked several times
    per layer, so it is kept to a loop over `is_cpu` (no device objects, no generator)."""
    for t in tensors:
        if not t.is_cpu:
            return False
    return load_cpu_kernels()
