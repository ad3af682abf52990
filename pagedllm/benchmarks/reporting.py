"""What every benchmark command shares at its edge: a one-line error exit, the JSON report file, and the
parsing of the options they have in common."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any


def fail(message: str) -> int:
    """Print `error: message` to stderr; the exit status of a refused command."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def write_json(path: str | None, report: Any) -> None:
    """Write `report` to `path` (nothing without a path); values JSON cannot hold are written as text."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)
            f.write("\n")


def int_list(text: str) -> list[int]:
    """An argparse type: positive integers separated by commas ("1,16,64")."""
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def choice_list(allowed: Iterable[str], what: str):
    """An argparse type: a comma-separated, non-empty selection from `allowed` ("bf16,int8")."""
    allowed = list(allowed)

    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        if not values or any(v not in allowed for v in values):
            raise argparse.ArgumentTypeError(f"{what} must be among {allowed}, got {text!r}")
        return values

    return parse


def set_num_threads(num_threads: int | None) -> int | None:
    """Apply --num-threads to torch (None keeps torch's count); the exit status if the value is refused."""
    if num_threads is None:
        return None
    if num_threads < 1:
        return fail(f"--num-threads must be at least 1, got {num_threads}")
    import torch

    torch.set_num_threads(num_threads)
    return None


def cpu_kernel_summary(llm: Any) -> dict[str, Any]:
    """How the engine's CPU work ran: the OpenMP wait policy and which linear kernel served each row bucket
    (None where the model is not in this process, or has no full-precision CPU linears)."""
    from pagedllm.openmp import wait_policy

    runner = getattr(llm.llm_engine, "model_runner", None)  # AttributeError: in worker processes
    model = getattr(runner, "model", None)
    choice = getattr(model, "linear_kernel_choice", None)
    quant_choices = getattr(model, "quant_kernel_choices", None) or []  # weight-only int4 / int8 linears
    return {"wait_policy": wait_policy(),
            "linear_kernels": choice.describe() if choice is not None else None,
            "linear_kernel": choice.path if choice is not None else None,
            "linear_kernel_bucket_ms": choice.bucket_ms if choice is not None else None,
            "quantized_linear_kernels": [c.describe() for c in quant_choices],
            "quantized_prompt_rows": _prompt_rows(runner)}


def _prompt_rows(runner: Any) -> str | None:
    """How the model's weight-only quantized linears multiply prompt rows (None: it has none of pagedllm's)."""
    from pagedllm.layers.quantization.vnni import describe_prompt_rows, has_vnni_weights

    model = getattr(runner, "model", None)
    if model is None or not has_vnni_weights(model):
        return None
    return describe_prompt_rows(runner.model_config.dtype)


def format_cpu_kernels(summary: dict[str, Any]) -> str:
    lines = [f"idle torch threads: {summary['wait_policy']}"]
    if summary["linear_kernels"] is not None:
        lines.append(f"linear kernel: {summary['linear_kernels']}")
    for quantized in summary.get("quantized_linear_kernels") or []:
        lines.append(f"quantized linear kernel: {quantized}")
    if summary.get("quantized_prompt_rows"):
        lines.append(f"quantized linears' prompt rows: {summary['quantized_prompt_rows']}")
    return "\n".join(lines)
