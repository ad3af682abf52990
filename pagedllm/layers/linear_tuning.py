"""Which kernel serves a model's full-precision linear layers on this CPU, chosen by measurement here.

A kernel tuned on one CPU can be several times slower than torch's own on another: pagedllm's blocked
kernel, written on a Zen 4 core, ran a 386M model's batch of 16 at a third of oneDNN's speed on a Xeon
with AMX, where oneDNN uses the matrix tiles. So at first start the candidates this CPU can run are timed
on the model's own weight shapes, at one row count per bucket (1, 2-4, 5-16, 17-64, a prefill chunk),
for a bounded time (TUNE_BUDGET_S, a progress bar on stderr), and the times are cached as JSON beside
the compiled kernels, keyed by the CPU model name, its flags, the thread count, the torch version and
the kernels' sources. Later starts, and other models with the same shapes, read the table. `pagedllm
tune` measures again. A measurement another process disturbed (fewer rows timed far slower than more) is
timed again, and if it stays so, used for this start but not cached.

One path serves every bucket of a dtype. Each candidate computes a row the same way whatever else is in
the batch, but not the same way as another candidate (another summation order), so a path per bucket
would make a row's result depend on how many rows its batch had, which the invariance tests forbid
(tests/test_invariance.py). The path is the one with the smallest weighted sum over the buckets of its
time relative to that bucket's fastest (BUCKET_WEIGHTS: batch-1 decode and batches up to 16 count most).
An LM head chosen alone (a model whose projections are quantized) multiplies only the rows sampled in a
step, one per sequence, never a prefill chunk: its choice leaves that bucket out (LM_HEAD_BUCKET_WEIGHTS).
Plain F.linear is not batch-invariant (the BLAS takes another path for one or two rows), so it is a
candidate only for a model whose numerics never reach the outputs (a speculative draft).

PAGEDLLM_CPU_PREPACK_WEIGHTS=amx|blocked|onednn|0 forces a path; PAGEDLLM_CPU_TUNE=0 skips the measurement
(and any table) and takes the static default, the first of PATHS this CPU runs (the blocked kernel on AMX
tiles for bf16 where the CPU has them, else the blocked kernel, else oneDNN).

Weight-only quantized linears (int4, int8) are chosen the same way, per method and group size, between
pagedllm's VNNI kernel and torch's own (choose_quant_kernel, the same table under "int4-g128:NxK" keys);
PAGEDLLM_QUANT_KERNEL=pagedllm|torch forces one, and the static default is pagedllm's where it runs.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm import envs

logger = logging.getLogger(__name__)

PATHS = ("amx", "blocked", "onednn", "plain")
QUANT_PATHS = ("pagedllm", "torch")
PATH_NAMES = {"amx": "pagedllm's blocked kernel on AMX tiles", "blocked": "pagedllm's blocked kernel",
              "onednn": "oneDNN prepacked", "plain": "F.linear",
              "pagedllm": "pagedllm's VNNI kernel", "torch": "torch's kernel"}
# row-count bucket -> the row count it is timed at
BUCKETS = {"1": 1, "2-4": 4, "5-16": 16, "17-64": 64, "prefill": 256}
BUCKET_WEIGHTS = {"1": 4.0, "2-4": 1.0, "5-16": 2.0, "17-64": 1.0, "prefill": 1.0}
LM_HEAD_BUCKET_WEIGHTS = {**BUCKET_WEIGHTS, "prefill": 0.0}
TUNE_BUDGET_S = 8.0
_REPEAT_S = 0.02  # time each cell for about this long, at least twice, and keep the fastest run

Shape = tuple[int, int]  # (out_features, in_features)


@dataclass
class LinearKernelChoice:
    """The path that serves one dtype's linears, why, and (when measured) each path's time per bucket:
    milliseconds for one pass through all the model's linears at the bucket's row count."""

    dtype: torch.dtype | str  # a quantized choice names its method and group size ("int4-g128")
    path: str
    source: str
    bucket_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # bucket -> path -> ms

    def describe(self) -> str:
        """One line: which path serves which bucket, and how it compares with each bucket's fastest."""
        dtype = str(self.dtype).removeprefix("torch.")
        head = f"{dtype} linears: {self.path} ({PATH_NAMES[self.path]}) serves every row bucket ({self.source})"
        if not self.bucket_ms:
            return head
        cells = []
        for bucket, times in self.bucket_ms.items():
            if self.path not in times:
                continue
            fastest = min(times, key=times.__getitem__)
            cell = f"{bucket}: {times[self.path]:.2f} ms"
            if fastest != self.path:
                cell += f" ({fastest} {times[self.path] / times[fastest]:.2f}x faster)"
            cells.append(cell)
        return head + "; " + ", ".join(cells)


def runnable_paths(dtype: torch.dtype) -> list[str]:
    """The candidates this CPU runs for dtype: the blocked kernel where its C++ ops are built and support
    the dtype (on AMX tiles too, for bf16 where the CPU has them), oneDNN where it reorders the dtype's
    weights, F.linear always."""
    from pagedllm.cpu_kernels import load_cpu_kernels

    paths = []
    if load_cpu_kernels() and bool(torch.ops.pagedllm_cpu_linear.blocked_linear_supports(dtype)):
        if bool(torch.ops.pagedllm_cpu_linear.blocked_linear_supports(dtype, True)):
            paths.append("amx")
        paths.append("blocked")
    if torch.backends.mkldnn.is_available():
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
            paths.append("onednn")
        except RuntimeError:
            pass
    paths.append("plain")
    return paths


def table_key(num_threads: int | None = None) -> dict[str, object]:
    """What the measured times depend on, besides the shapes."""
    from pagedllm.cpu_kernels import sources_digest
    from pagedllm.platform import _cpu_flags

    cpu_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu_name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu_name)
    except OSError:
        pass
    return {"cpu": cpu_name, "flags": hashlib.sha256(" ".join(sorted(_cpu_flags())).encode()).hexdigest()[:16],
            "threads": num_threads if num_threads is not None else torch.get_num_threads(),
            "torch": torch.__version__, "kernels": sources_digest()}


def table_dir() -> str:
    """Beside the compiled kernels."""
    from pagedllm.cpu_kernels import cache_root

    return cache_root()


def table_path(key: dict[str, object]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(table_dir(), f"linear-kernels-{digest}.json")


def load_table(path: str, key: dict[str, object]) -> dict[str, dict[str, dict[str, float]]]:
    """shape key -> path -> bucket -> seconds, from the cache; empty when absent, unreadable or for
    another key (a hash collision, or a file edited by hand)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("shapes"), dict):
        return {}
    return data["shapes"]


def save_table(path: str, key: dict[str, object], shapes: dict[str, dict[str, dict[str, float]]]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"key": key, "shapes": shapes}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # whole or not at all, for a process that reads it meanwhile


def shape_key(dtype: torch.dtype | str, shape: Shape) -> str:
    return f"{str(dtype).removeprefix('torch.')}:{shape[0]}x{shape[1]}"


def _matmul(path: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight^T by one path, its weight packed once here."""
    if path in ("blocked", "amx"):
        packed, out_features = torch.ops.pagedllm_cpu_linear.blocked_linear_pack(weight), weight.shape[0]
        amx = path == "amx"
        return lambda x: torch.ops.pagedllm_cpu_linear.blocked_linear(x, packed, out_features, None, amx)
    if path == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return lambda x: F.linear(x, weight)


def _time(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    fn(x)  # first touch: page faults, oneDNN's primitive cache
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 2 or (spent < _REPEAT_S and runs < 20):
        start = time.perf_counter()
        fn(x)
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best


def measure(dtype: torch.dtype, shapes: Iterable[Shape], paths: list[str],
            known: dict[str, dict[str, dict[str, float]]] | None = None, budget_s: float | None = None,
            progress: bool = True, label: str | None = None,
            factory: Callable[[str, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None = None
            ) -> dict[str, dict[str, dict[str, float]]]:
    """`known` (shape key -> path -> bucket -> seconds per call) with the cells it lacks for these shapes
    and paths measured, as many as fit in budget_s; a later call goes on where this one stopped.
    `label` (default: the dtype) names the cells; `factory(path, weight)` (default: the full-precision
    paths) makes the matmul of a path from a `dtype` weight."""
    key_name: torch.dtype | str = label or dtype
    factory = factory or _matmul
    from tqdm import tqdm

    table = {name: {path: dict(cells) for path, cells in paths_.items()} for name, paths_ in (known or {}).items()}
    todo = [(shape, path) for shape in shapes for path in paths
            if len(table.get(shape_key(key_name, shape), {}).get(path, {})) < len(BUCKETS)]
    budget_s = TUNE_BUDGET_S if budget_s is None else budget_s
    deadline = time.perf_counter() + budget_s
    generator = torch.Generator().manual_seed(0)
    dtype_name = str(key_name).removeprefix("torch.")
    bar = tqdm(total=len(todo) * len(BUCKETS), disable=not progress, file=sys.stderr, leave=False,
               desc=f"Timing linear kernels ({dtype_name}, {torch.get_num_threads()} threads, at most "
                    f"{budget_s:.0f} s)")
    with torch.inference_mode(), bar:
        for shape, path in todo:
            cells = table.setdefault(shape_key(key_name, shape), {}).setdefault(path, {})
            weight = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
            matmul = factory(path, weight)
            inputs = {bucket: torch.randn(rows, shape[1], generator=generator).to(dtype)
                      for bucket, rows in BUCKETS.items()}
            for bucket in BUCKETS:
                if time.perf_counter() > deadline:
                    return table
                if bucket not in cells:
                    cells[bucket] = _time(matmul, inputs[bucket])
                bar.update()
            # Fewer rows never take longer: where they seem to, another process took the CPU during that
            # cell (the tables would keep the accident), so time it again and keep the faster.
            for _ in range(2):
                disturbed = implausible_buckets(cells)
                if not disturbed or time.perf_counter() > deadline:
                    break
                for bucket in disturbed:
                    cells[bucket] = min(cells[bucket], _time(matmul, inputs[bucket]))
    return table


def implausible_buckets(cells: dict[str, float]) -> list[str]:
    """Buckets timed more than twice as slow as the next bucket's larger row count: not a kernel's own
    shape (a matrix-vector path slower than a small matrix one stays within that), an interruption."""
    names = [bucket for bucket in BUCKETS if bucket in cells]
    return [small for small, large in zip(names, names[1:]) if cells[small] > 2.0 * cells[large]]


def _bucket_ms(table: dict[str, dict[str, dict[str, float]]], dtype: torch.dtype | str,
               shape_counts: collections.Counter[Shape], paths: list[str]) -> dict[str, dict[str, float]]:
    """bucket -> path -> ms for one pass through every linear of the model, for the buckets where every
    shape was measured on every path."""
    out: dict[str, dict[str, float]] = {}
    for bucket in BUCKETS:
        times: dict[str, float] = {}
        for path in paths:
            cells = [table.get(shape_key(dtype, shape), {}).get(path, {}).get(bucket) for shape in shape_counts]
            if any(cell is None for cell in cells):
                break
            times[path] = 1e3 * sum(cell * count for cell, count in zip(cells, shape_counts.values()))
        else:
            out[bucket] = times
    return out


def _pick(bucket_ms: dict[str, dict[str, float]], candidates: list[str],
          weights: dict[str, float] = BUCKET_WEIGHTS) -> str | None:
    """The candidate with the smallest weighted sum of its time relative to each bucket's fastest."""
    if not bucket_ms:
        return None

    def score(path: str) -> float:
        return sum(weights[bucket] * times[path] / min(times[p] for p in candidates)
                   for bucket, times in bucket_ms.items())

    return min(candidates, key=score)  # ties go to the earlier path in PATHS order


def _static_default(paths: list[str]) -> str:
    return next(path for path in PATHS if path in paths)


def choose_linear_kernel(shapes: Iterable[Shape], dtype: torch.dtype, batch_invariant: bool = True,
                         weights: dict[str, float] = BUCKET_WEIGHTS) -> LinearKernelChoice:
    """The path for a model's linears of this dtype (their (out, in) shapes, one per layer), by the rules
    in this module's docstring, the buckets counted by `weights`; measures the shapes the cached table
    lacks unless told not to."""
    forced = str(envs.value("PAGEDLLM_CPU_PREPACK_WEIGHTS")).strip().lower()
    if forced not in ("1", "auto", "amx", "blocked", "onednn", "0", "plain"):
        raise ValueError(f"PAGEDLLM_CPU_PREPACK_WEIGHTS must be 1 (measured), amx, blocked, onednn or 0, got "
                         f"{forced!r}.")
    paths = runnable_paths(dtype)
    if forced in ("0", "plain"):
        return LinearKernelChoice(dtype, "plain", f"PAGEDLLM_CPU_PREPACK_WEIGHTS={forced}")
    if forced in ("onednn", "blocked", "amx"):
        if forced in paths:
            return LinearKernelChoice(dtype, forced, f"PAGEDLLM_CPU_PREPACK_WEIGHTS={forced}")
        fallback = _static_default([p for p in paths if p != forced])
        logger.warning("PAGEDLLM_CPU_PREPACK_WEIGHTS=%s: this CPU cannot run it for %s; using %s", forced,
                       dtype, fallback)
        return LinearKernelChoice(dtype, fallback, f"PAGEDLLM_CPU_PREPACK_WEIGHTS={forced} cannot run here")
    candidates = paths if not batch_invariant else [p for p in paths if p != "plain"] or ["plain"]
    if not envs.value("PAGEDLLM_CPU_TUNE") or len(candidates) == 1:
        why = "not measured: PAGEDLLM_CPU_TUNE=0" if len(candidates) > 1 else "the only candidate"
        return LinearKernelChoice(dtype, _static_default(candidates), why)
    shape_counts = collections.Counter(shapes)
    key = table_key()
    path = table_path(key)
    table = load_table(path, key)
    complete = all(len(table.get(shape_key(dtype, shape), {}).get(p, {})) == len(BUCKETS)
                   for shape in shape_counts for p in paths)
    source = f"measured on this CPU, cached in {path}"
    if not complete:
        start = time.perf_counter()
        table = measure(dtype, shape_counts, paths, known=table)
        source = f"measured on this CPU in {time.perf_counter() - start:.1f} s, cached in {path}"
        disturbed = [name for name, by_path in table.items() for cells in by_path.values()
                     if implausible_buckets(cells)]
        cached = {name: by_path for name, by_path in table.items() if name not in disturbed}
        if disturbed:  # used for this start only: a later, quieter one measures them again
            source = (f"measured on this CPU in {time.perf_counter() - start:.1f} s, disturbed by other work "
                      f"(not cached: measured again next start, or run `pagedllm tune` on a quiet machine)")
        try:
            save_table(path, key, cached)
        except OSError as error:
            logger.warning("Could not cache the linear kernel table in %s (%s); it is measured again next start",
                           path, error)
    bucket_ms = _bucket_ms(table, dtype, shape_counts, paths)
    chosen = _pick(bucket_ms, candidates, weights)
    if chosen is None:
        return LinearKernelChoice(dtype, _static_default(candidates), "not measured: the time budget ran out")
    return LinearKernelChoice(dtype, chosen, source, bucket_ms)


def choose_quant_kernel(label: str, shapes: Iterable[Shape], dtype: torch.dtype, paths: list[str],
                        factory: Callable[[str, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
                        ) -> LinearKernelChoice:
    """The kernel for a model's weight-only quantized linears of one method and group size (`label`,
    e.g. "int4-g128"; their (out, in) shapes, one per layer) among `paths` (QUANT_PATHS this CPU runs for
    them), for activations in `dtype`: forced by PAGEDLLM_QUANT_KERNEL, else measured and cached like the
    full-precision paths (factory(path, weight) quantizes a `dtype` weight for a path and returns its
    matmul), else pagedllm's where it runs. Each path computes a row the same way at every row count
    (pagedllm's; torch's int4), so one path serves every bucket."""
    forced = str(envs.value("PAGEDLLM_QUANT_KERNEL")).strip().lower()
    if forced in QUANT_PATHS:
        if forced in paths:
            return LinearKernelChoice(label, forced, f"PAGEDLLM_QUANT_KERNEL={forced}")
        return LinearKernelChoice(label, paths[0], f"PAGEDLLM_QUANT_KERNEL={forced} cannot run here")
    if not envs.value("PAGEDLLM_CPU_TUNE") or len(paths) == 1:
        why = "not measured: PAGEDLLM_CPU_TUNE=0" if len(paths) > 1 else "the only candidate"
        return LinearKernelChoice(label, paths[0], why)
    shape_counts = collections.Counter(shapes)
    key = table_key()
    path = table_path(key)
    table = load_table(path, key)
    source = f"measured on this CPU, cached in {path}"
    if not all(len(table.get(shape_key(label, shape), {}).get(p, {})) == len(BUCKETS)
               for shape in shape_counts for p in paths):
        start = time.perf_counter()
        table = measure(dtype, shape_counts, paths, known=table, label=label, factory=factory)
        source = f"measured on this CPU in {time.perf_counter() - start:.1f} s, cached in {path}"
        disturbed = {name for name, by_path in table.items() for cells in by_path.values()
                     if implausible_buckets(cells)}
        try:
            save_table(path, key, {name: by_path for name, by_path in table.items() if name not in disturbed})
        except OSError as error:
            logger.warning("Could not cache the linear kernel table in %s (%s)", path, error)
    bucket_ms = _bucket_ms(table, label, shape_counts, paths)
    chosen = _pick(bucket_ms, paths)
    if chosen is None:
        return LinearKernelChoice(label, paths[0], "not measured: the time budget ran out")
    return LinearKernelChoice(label, chosen, source, bucket_ms)
