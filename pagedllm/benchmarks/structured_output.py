"""`pagedllm bench structured-output`: decode tokens/s with and without a JSON schema, and compile time.

For each batch size, the same prompts run twice: constrained by a nested JSON schema (objects, an array of
objects, enums, bounded numbers and strings), then unconstrained with max_tokens set to the mean length
the constrained run produced (ignore_eos), so both decode the same number of tokens. It reports output
tokens/s of each, their ratio, the time the engine spent building grammar bitmasks per step, and the
schema's compile time (a cache miss: the tokenizer's trie is built first, once, and timed apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pagedllm.assets import demo_model_path
from pagedllm.benchmarks.reporting import fail, set_num_threads, write_json

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "version": {"type": "integer", "minimum": 0, "maximum": 999},
        "license": {"enum": ["MIT", "BSD", "GPL", "Apache-2.0"]},
        "modules": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"path": {"type": "string", "maxLength": 16},
                           "lines": {"type": "integer", "minimum": 1, "maximum": 9999},
                           "tested": {"type": "boolean"}},
            "required": ["path", "lines", "tested"], "additionalProperties": False}},
    },
    "required": ["name", "version", "license", "modules"],
    "additionalProperties": False,
}


@dataclass
class BatchResult:
    batch_size: int
    mean_output_tokens: float
    constrained_tokens_per_s: float
    unconstrained_tokens_per_s: float
    bitmask_ms_per_step: float
    num_valid: int               # constrained outputs that parse as JSON

    @property
    def ratio(self) -> float:
        return self.constrained_tokens_per_s / self.unconstrained_tokens_per_s


@dataclass
class StructuredOutputResult:
    model: str
    num_threads: int
    tokenizer_setup_ms: float
    compile_ms: float            # median over iterations, cache misses
    cached_compile_ms: float     # the same schema again: a cache hit
    batches: list[BatchResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        report = asdict(self)
        for batch, row in zip(self.batches, report["batches"]):
            row["ratio"] = batch.ratio
        return report


def _timed_bitmask(manager: Any) -> list[float]:
    """Wrap the manager's per-step bitmask so each call's time is recorded (for this benchmark only)."""
    times: list[float] = []
    original = manager.grammar_bitmask

    def grammar_bitmask(scheduled):
        start = time.perf_counter()
        result = original(scheduled)
        if result is not None:
            times.append(time.perf_counter() - start)
        return result

    manager.grammar_bitmask = grammar_bitmask
    return times


def _generate(llm: Any, prompts: list[str], params: Any) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def run_structured_output(llm: Any, model: str, batch_sizes: list[int], num_compile_iters: int = 5,
                          max_tokens: int = 256) -> StructuredOutputResult:
    from pagedllm import GuidedDecodingParams, SamplingParams

    manager = llm.llm_engine.structured_output_manager
    start = time.perf_counter()
    manager.ll_tokenizer()
    tokenizer_setup_ms = (time.perf_counter() - start) * 1e3
    compile_times = []
    for i in range(num_compile_iters):
        # a distinct title per iteration: every compile is a cache miss
        schema = {**SCHEMA, "title": f"bench-{i}-{time.time_ns()}"}
        params = GuidedDecodingParams(json=schema, disable_any_whitespace=True)
        start = time.perf_counter()
        manager.compile(params)
        compile_times.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        manager.compile(params)
        cached_ms = (time.perf_counter() - start) * 1e3
    result = StructuredOutputResult(model=model, num_threads=torch.get_num_threads(),
                                    tokenizer_setup_ms=tokenizer_setup_ms,
                                    compile_ms=statistics.median(compile_times), cached_compile_ms=cached_ms)

    guided = GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=True)
    bitmask_times = _timed_bitmask(manager)
    for batch_size in batch_sizes:
        prompts = [f"# package {i}\nmetadata = " for i in range(batch_size)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        bitmask_times.clear()
        constrained = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0, guided_decoding=guided)
        elapsed, outputs = _generate(llm, prompts, constrained)
        num_steps = len(bitmask_times)
        bitmask_s = sum(bitmask_times)
        tokens = [len(o.outputs[0].token_ids) for o in outputs]
        num_valid = 0
        for output in outputs:
            try:
                json.loads(output.outputs[0].text)
                num_valid += 1
            except ValueError:
                pass
        mean_tokens = sum(tokens) / len(tokens)
        plain = SamplingParams(temperature=1.0, max_tokens=max(1, round(mean_tokens)), seed=0, ignore_eos=True)
        plain_elapsed, plain_outputs = _generate(llm, prompts, plain)
        plain_tokens = sum(len(o.outputs[0].token_ids) for o in plain_outputs)
        result.batches.append(BatchResult(
            batch_size=batch_size, mean_output_tokens=mean_tokens,
            constrained_tokens_per_s=sum(tokens) / elapsed, unconstrained_tokens_per_s=plain_tokens / plain_elapsed,
            bitmask_ms_per_step=bitmask_s / num_steps * 1e3 if num_steps else 0.0, num_valid=num_valid))
    return result


def format_results(r: StructuredOutputResult) -> str:
    lines = [f"model {r.model}, {r.num_threads} threads",
             f"schema compile (cache miss): {r.compile_ms:.2f} ms median; cache hit {r.cached_compile_ms:.3f} ms; "
             f"tokenizer trie (once per engine) {r.tokenizer_setup_ms:.1f} ms",
             f"{'batch':>5}  {'tokens':>6}  {'schema tok/s':>12}  {'plain tok/s':>11}  {'ratio':>5}  "
             f"{'mask ms/step':>12}  {'valid':>5}"]
    for b in r.batches:
        lines.append(f"{b.batch_size:>5}  {b.mean_output_tokens:>6.1f}  {b.constrained_tokens_per_s:>12.1f}  "
                     f"{b.unconstrained_tokens_per_s:>11.1f}  {b.ratio:>5.2f}  {b.bitmask_ms_per_step:>12.3f}  "
                     f"{b.num_valid:>2}/{b.batch_size}")
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import EngineArgs

    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on a constrained output's length")
    parser.add_argument("--num-compile-iters", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(parser)
    return parser


def run_cmd(args: argparse.Namespace) -> int:
    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        return fail(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if not batch_sizes or min(batch_sizes) < 1:
        return fail(f"--batch-sizes must be at least 1, got {args.batch_sizes!r}")
    for name in ("max_tokens", "num_compile_iters"):
        if getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if (status := set_num_threads(args.num_threads)) is not None:
        return status
    model = args.model or demo_model_path()
    if model is None:
        return fail("--model is required (the bundled demo model is not installed)")
    args.model = model
    try:
        llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
        result = run_structured_output(llm, model, batch_sizes, args.num_compile_iters, args.max_tokens)
    except ValueError as exc:
        return fail(str(exc))
    print(format_results(result))
    write_json(args.output_json, result.to_dict())
    return 0
