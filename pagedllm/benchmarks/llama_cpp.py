"""llama.cpp as a benchmark baseline: built from source for this CPU, and the same GGUF file for both engines.

llama.cpp is the batch-1 mark on a CPU, so `pagedllm bench latency --compare llama.cpp` runs its
`llama-bench` on the very file pagedllm loads, with the same thread count, alternating with pagedllm's
runs so that a shared host's drift hits both alike. The source is the package registry's
`llama-cpp-python` source distribution (it vendors llama.cpp under vendor/llama.cpp): pip fetches it
through its ordinary client, cmake builds `llama-bench` and `llama-quantize` with -march=native
(GGML_NATIVE), no CUDA, no curl or HTTPS client, all under pagedllm's cache directory and keyed by the CPU's
flags, so a second call reuses the build. Nothing here is part of the engine or its default install
(cmake and sentencepiece come with the `bench` extra).

A Hugging Face model directory is converted once by the same tree's `convert_hf_to_gguf.py` and, for a
block type such as Q4_K_M or Q8_0, quantized by `llama-quantize`; the files are cached.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedllm import envs

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BINARIES = ("llama-bench", "llama-quantize")

# Release, this CPU's instruction set, the CPU backend only; no tests, examples, server or HTTPS client
# (the benchmark reads local files), static libraries so the binaries stand alone.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
)

# ggml's AMX kernels (compiled in wherever -march=native defines __AMX_INT8__) crash llama-bench on quantized
# files on the AMX Xeons these benchmarks run on (exit -11 at load, 0.3.36); there it is built without them,
# as its AVX-512 path.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_flags() -> tuple[str, ...]:
    """CMAKE_FLAGS, plus compiler flags that leave ggml's AMX kernels out on a CPU that has AMX."""
    if "amx_tile" not in cpu_flags():
        return CMAKE_FLAGS
    return (*CMAKE_FLAGS, f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}")


# GGUF types the converter writes directly; every other type is quantized from the BF16 file
CONVERT_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
# llama-quantize's types (its `--help` list), the ones a benchmark asks for
QUANTIZE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S",
                  "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS")
GGUF_TYPES = tuple(CONVERT_TYPES) + QUANTIZE_TYPES


class LlamaCppError(RuntimeError):
    """A download, build, conversion or llama-bench run that failed; the message carries its output."""


def cache_root() -> Path:
    """pagedllm's cache (PAGEDLLM_CACHE_DIR, else $XDG_CACHE_HOME/pagedllm, else ~/.cache/pagedllm)/llama.cpp."""
    root = envs.value("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm")
    return Path(root) / "llama.cpp"


def cpu_flags() -> frozenset[str]:
    from pagedllm.platform import _cpu_flags

    return _cpu_flags()


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and the flags that tell the machine kinds apart (AMX or AVX512-BF16)."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    flags = cpu_flags()
    kind = [flag for flag in ("amx_bf16", "amx_int8", "avx512_bf16", "avx512f", "avx2") if flag in flags]
    return {"model": name, "flags": kind, "os_cpu_count": os.cpu_count()}


def format_cpu(cpu: dict[str, Any]) -> str:
    flags = cpu["flags"]
    amx = "amx_bf16" if "amx_bf16" in flags else "no amx_bf16"
    bf16 = "avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16"
    return f"{cpu['model']} ({amx}, {bf16})"


@dataclass(frozen=True)
class LlamaCppBuild:
    """A llama.cpp source tree and its build: the binaries and the converter the benchmark uses."""

    source_dir: Path  # vendor/llama.cpp of the source distribution
    build_dir: Path

    def binary(self, name: str) -> Path:
        return self.build_dir / "bin" / name

    @property
    def llama_bench(self) -> Path:
        return self.binary("llama-bench")

    @property
    def llama_quantize(self) -> Path:
        return self.binary("llama-quantize")

    @property
    def convert_script(self) -> Path:
        return self.source_dir / "convert_hf_to_gguf.py"

    @property
    def stamp(self) -> Path:
        """Written after a successful build: the cmake flags it was built with."""
        return self.build_dir / "pagedllm-build-flags.txt"

    def is_built(self) -> bool:
        """The binaries are there and were built with today's flags (changed flags rebuild in place)."""
        return (all(os.access(self.binary(name), os.X_OK) for name in BINARIES) and self.stamp.is_file()
                and self.stamp.read_text() == " ".join(cmake_flags()))


def build_paths(version: str = LLAMA_CPP_PYTHON_VERSION, root: Path | None = None) -> LlamaCppBuild:
    """Where the source and build of `version` live. -march=native binaries only run on CPUs with the
    same flags, so the build directory is keyed by them."""
    root = root or cache_root()
    key = hashlib.sha256(" ".join(sorted(cpu_flags())).encode() + platform.machine().encode()).hexdigest()[:12]
    source = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    return LlamaCppBuild(source, root / f"build-{version}-{key}")


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One download and build at a time: two benchmarks started together share the result."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cmake_configure_command(build: LlamaCppBuild) -> list[str]:
    return ["cmake", "-S", str(build.source_dir), "-B", str(build.build_dir), *cmake_flags()]


def cmake_build_command(build: LlamaCppBuild, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build.build_dir), "--config", "Release", f"-j{jobs}", "--target", *BINARIES]


def _run_logged(command: list[str], log_path: Path, what: str) -> None:
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        raise LlamaCppError(f"{what} failed (exit {done.returncode}); the last lines of {log_path}:\n"
                            + "\n".join(tail))


def _fetch_source(version: str, root: Path, say: Callable[[str], None]) -> None:
    """The registry's source distribution of llama-cpp-python, unpacked once into `root`."""
    unpacked = root / f"llama_cpp_python-{version}"
    if (unpacked / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        say(f"downloading llama-cpp-python {version}'s source distribution into {root}")
        # the source distribution only: its build requirements (cmake, used by pip to read its metadata)
        # come as wheels, as `--no-binary :all:` would not have them (it bootstraps cmake from source)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                               "llama-cpp-python", f"llama-cpp-python=={version}", "-d", str(root)],
                              capture_output=True, text=True)
        if done.returncode != 0 or not sdist.is_file():
            raise LlamaCppError(f"pip download of llama-cpp-python=={version} failed:\n{done.stderr[-2000:]}")
    staging = root / f".unpack-{version}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(staging, filter="data")
    # unpacked under a temporary name, then renamed: a half-unpacked tree is never mistaken for a whole one
    os.replace(staging / unpacked.name, unpacked)
    shutil.rmtree(staging, ignore_errors=True)


def ensure_built(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2, say: Callable[[str], None] = print,
                 root: Path | None = None) -> LlamaCppBuild:
    """llama.cpp's benchmark binaries for this CPU, downloaded and built on the first call (minutes on
    two cores), found in the cache afterwards."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    build = build_paths(version, root)
    if build.is_built():
        return build
    root = root or cache_root()
    if shutil.which("cmake") is None:
        raise ValueError("building llama.cpp needs cmake: pip install 'pagedllm[bench]' (or a system cmake)")
    with _locked(root):
        if build.is_built():  # another process built it while this one waited
            return build
        _fetch_source(version, root, say)
        build.build_dir.mkdir(parents=True, exist_ok=True)
        log = build.build_dir / "pagedllm-build.log"
        say(f"building llama.cpp ({', '.join(BINARIES)}) for this CPU with {jobs} jobs; log: {log}")
        _run_logged(cmake_configure_command(build), log, "cmake configure of llama.cpp")
        _run_logged(cmake_build_command(build, jobs), log, "cmake build of llama.cpp")
        build.stamp.write_text(" ".join(cmake_flags()))
    if not build.is_built():
        raise LlamaCppError(f"the llama.cpp build finished without {', '.join(BINARIES)} in {build.build_dir / 'bin'}")
    return build


# ---- GGUF files for a Hugging Face model ----

# Run instead of convert_hf_to_gguf.py itself: the same script, except that a tokenizer whose
# pre-tokenizer llama.cpp's table does not list (the random test models' tokenizers) is written as
# "default" with a warning instead of stopping the conversion. Benchmarks feed token ids, so the
# pre-tokenizer's regex does not touch what they measure.
_CONVERT_RUNNER = """
import runpy, sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/gguf-py"]
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("pagedllm: llama.cpp does not know this tokenizer's pre-tokenizer; written as 'default' "
              "(the benchmark feeds token ids, so this does not change what it measures)", file=sys.stderr)
        return "default"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
script = tree + "/convert_hf_to_gguf.py"
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def normalize_gguf_type(gguf_type: str) -> str:
    name = gguf_type.strip().upper()
    if name not in GGUF_TYPES:
        raise ValueError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    return name


def _model_key(model_dir: Path) -> str:
    """A digest of the model's files (names, sizes, modification times): a rewritten model converts anew."""
    digest = hashlib.sha256(str(model_dir.resolve()).encode())
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def gguf_path(model_dir: str | Path, gguf_type: str, output_dir: str | Path | None = None) -> Path:
    """Where the `gguf_type` file of a model directory lives: `output_dir`, else the cache keyed by the
    model's files."""
    model_dir = Path(model_dir)
    name = model_dir.resolve().name
    folder = Path(output_dir) if output_dir else cache_root() / "gguf" / f"{name}-{_model_key(model_dir)}"
    return folder / f"{name}.{normalize_gguf_type(gguf_type)}.gguf"


def convert_command(build: LlamaCppBuild, model_dir: str | Path, outtype: str, outfile: str | Path) -> list[str]:
    return [sys.executable, "-c", _CONVERT_RUNNER, str(build.source_dir), str(model_dir),
            "--outtype", outtype, "--outfile", str(outfile)]


def quantize_command(build: LlamaCppBuild, source: str | Path, target: str | Path, gguf_type: str,
                     num_threads: int) -> list[str]:
    return [str(build.llama_quantize), str(source), str(target), gguf_type, str(num_threads)]


def _run_to(command: list[str], target: Path, what: str) -> None:
    """Run `command`, which writes `target`'s temporary twin, then move it into place: an interrupted
    conversion never leaves a file a later call would take for finished."""
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    partial = target.with_name(target.name + ".partial")
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise LlamaCppError(f"{what} failed (exit {done.returncode}):\n{(done.stderr or done.stdout)[-3000:]}")
    for line in done.stderr.splitlines():
        if line.startswith("pagedllm:"):
            print(line)
    os.replace(partial, target)


def ensure_gguf(model_dir: str | Path, gguf_type: str = "BF16", build: LlamaCppBuild | None = None,
                output_dir: str | Path | None = None, num_threads: int = 2,
                say: Callable[[str], None] = print) -> Path:
    """The model directory as a `gguf_type` GGUF file: converted to BF16 (or F32/F16) by llama.cpp's
    converter, then quantized by llama-quantize for a block type; each file made once."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {str(model_dir)!r} is not a Hugging Face model directory (no config.json)")
    gguf_type = normalize_gguf_type(gguf_type)
    target = gguf_path(model_dir, gguf_type, output_dir)
    if target.is_file():
        return target
    build = build or ensure_built(say=say)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    if gguf_type in CONVERT_TYPES:
        say(f"converting {model_dir} to {target} (llama.cpp's convert_hf_to_gguf.py)")
        _run_to(convert_command(build, model_dir, CONVERT_TYPES[gguf_type], partial), target, "convert_hf_to_gguf.py")
        return target
    source = ensure_gguf(model_dir, "BF16", build, output_dir, num_threads, say)
    say(f"quantizing {source} to {gguf_type}: {target}")
    _run_to(quantize_command(build, source, partial, gguf_type, num_threads), target, "llama-quantize")
    return target


# ---- llama-bench ----

@dataclass
class LlamaBenchRun:
    """One llama-bench invocation's tests: prompt processing (pp) and text generation (tg) tokens/s."""

    prompt_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    num_threads: int | None
    model_type: str = ""
    model_size_bytes: int | None = None
    cpu_info: str = ""
    build_commit: str = ""
    decode_samples_tokens_per_s: list[float] = field(default_factory=list)


def llama_bench_command(build: LlamaCppBuild, model: str | Path, num_threads: int, input_len: int, output_len: int,
                        repetitions: int = 1) -> list[str]:
    """llama-bench on `model`: a prompt of `input_len` tokens and a generation of `output_len` tokens, each
    `repetitions` times after its warm-up, as JSON."""
    for name, value, low in (("num_threads", num_threads, 1), ("input_len", input_len, 0),
                             ("output_len", output_len, 0), ("repetitions", repetitions, 1)):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if input_len == 0 and output_len == 0:
        raise ValueError("input_len and output_len cannot both be 0")
    return [str(build.llama_bench), "-m", str(model), "-t", str(num_threads), "-p", str(input_len),
            "-n", str(output_len), "-r", str(repetitions), "-o", "json"]


def parse_llama_bench_json(text: str) -> LlamaBenchRun:
    """llama-bench's `-o json` report: a list with one object per test; a test with n_gen > 0 is
    generation (decode), one with only n_prompt is prompt processing."""
    start = text.find("[")
    if start < 0:
        raise ValueError(f"no JSON list in llama-bench's output: {text[:200]!r}")
    tests = json.loads(text[start:])
    if not isinstance(tests, list) or not tests:
        raise ValueError("llama-bench's JSON report holds no test")
    prompt = [t for t in tests if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0]
    decode = [t for t in tests if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    first = tests[0]
    return LlamaBenchRun(
        prompt_tokens_per_s=float(prompt[0]["avg_ts"]) if prompt else None,
        decode_tokens_per_s=float(decode[0]["avg_ts"]) if decode else None,
        num_threads=first.get("n_threads"),
        model_type=str(first.get("model_type", "")),
        model_size_bytes=first.get("model_size"),
        cpu_info=str(first.get("cpu_info", "")),
        build_commit=str(first.get("build_commit", "")),
        decode_samples_tokens_per_s=[float(v) for v in decode[0].get("samples_ts", [])] if decode else [],
    )


def run_llama_bench(command: list[str]) -> LlamaBenchRun:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise LlamaCppError(f"llama-bench failed (exit {done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
    return parse_llama_bench_json(done.stdout)


@dataclass
class LlamaCppComparison:
    """pagedllm's and llama.cpp's batch-1 figures on the same file, runs alternated."""

    model_file: str
    num_threads: int
    cpu: dict[str, Any]
    pagedllm_decode_tokens_per_s: float
    pagedllm_prompt_tokens_per_s: float  # prompt tokens / time to first token
    llama_cpp_decode_tokens_per_s: float | None
    llama_cpp_prompt_tokens_per_s: float | None
    llama_cpp_command: list[str]
    llama_cpp_build_commit: str = ""
    llama_cpp_decode_all: list[float] = field(default_factory=list)
    llama_cpp_prompt_all: list[float] = field(default_factory=list)
    pagedllm_decode_all: list[float] = field(default_factory=list)

    @property
    def decode_ratio(self) -> float | None:
        if not self.llama_cpp_decode_tokens_per_s:
            return None
        return self.pagedllm_decode_tokens_per_s / self.llama_cpp_decode_tokens_per_s

    @property
    def prompt_ratio(self) -> float | None:
        if not self.llama_cpp_prompt_tokens_per_s:
            return None
        return self.pagedllm_prompt_tokens_per_s / self.llama_cpp_prompt_tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "decode_ratio": self.decode_ratio, "prompt_ratio": self.prompt_ratio}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def compare(model_file: str, num_threads: int, pagedllm_decode_all: list[float], pagedllm_ttft_all: list[float],
            input_len: int, runs: list[LlamaBenchRun], command: list[str]) -> LlamaCppComparison:
    return LlamaCppComparison(
        model_file=model_file,
        num_threads=num_threads,
        cpu=cpu_description(),
        pagedllm_decode_tokens_per_s=statistics.median(pagedllm_decode_all),
        pagedllm_prompt_tokens_per_s=statistics.median(input_len / t for t in pagedllm_ttft_all),
        llama_cpp_decode_tokens_per_s=_median([r.decode_tokens_per_s for r in runs]),
        llama_cpp_prompt_tokens_per_s=_median([r.prompt_tokens_per_s for r in runs]),
        llama_cpp_command=command,
        llama_cpp_build_commit=runs[0].build_commit if runs else "",
        llama_cpp_decode_all=[r.decode_tokens_per_s for r in runs if r.decode_tokens_per_s is not None],
        llama_cpp_prompt_all=[r.prompt_tokens_per_s for r in runs if r.prompt_tokens_per_s is not None],
        pagedllm_decode_all=list(pagedllm_decode_all),
    )


def format_comparison(c: LlamaCppComparison) -> str:
    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    rows = [("", "pagedllm", "llama.cpp", "pagedllm / llama.cpp"),
            ("decode tokens/s (batch 1)", rate(c.pagedllm_decode_tokens_per_s), rate(c.llama_cpp_decode_tokens_per_s),
             ratio(c.decode_ratio)),
            ("prompt tokens/s", rate(c.pagedllm_prompt_tokens_per_s), rate(c.llama_cpp_prompt_tokens_per_s),
             ratio(c.prompt_ratio))]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [f"llama.cpp on the same file ({c.model_file}), {c.num_threads} threads, CPU {format_cpu(c.cpu)}; "
             "runs alternated, medians:"]
    lines += ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                                enumerate(zip(row, widths))) for row in rows]
    lines.append("  runs, decode tokens/s: pagedllm " + ", ".join(f"{v:.1f}" for v in c.pagedllm_decode_all)
                 + "; llama.cpp " + ", ".join(f"{v:.1f}" for v in c.llama_cpp_decode_all))
    lines.append("  (pagedllm's prompt rate is prompt tokens / time to first token; llama-bench's generation "
                 "starts from an empty cache, pagedllm's after the prompt)")
    lines.append(f"  (llama.cpp {c.llama_cpp_build_commit or '?'}: {' '.join(c.llama_cpp_command)})")
    return "\n".join(lines)


# ---- `pagedllm bench gguf` ----

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory to convert")
    parser.add_argument("--gguf-type", nargs="+", default=["BF16"], metavar="TYPE",
                        help=f"one or more of {', '.join(GGUF_TYPES)} (block types are quantized from BF16)")
    parser.add_argument("--output-dir", default=None,
                        help="where the files go (default: pagedllm's cache, keyed by the model's files); "
                        "an existing file of the same name is reused")
    parser.add_argument("--num-threads", type=int, default=2, help="llama-quantize's threads")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs if llama.cpp must be built")


def run_cmd(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.reporting import fail

    try:
        types = [normalize_gguf_type(t) for t in args.gguf_type]
        if args.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
        build = ensure_built(jobs=args.jobs)
        print(f"llama.cpp binaries: {build.build_dir / 'bin'}")
        for gguf_type in types:
            path = ensure_gguf(args.model, gguf_type, build, args.output_dir, args.num_threads)
            print(f"{gguf_type}: {path} ({path.stat().st_size / 2**20:,.1f} MiB)")
    except (ValueError, LlamaCppError) as exc:
        return fail(str(exc))
    return 0
