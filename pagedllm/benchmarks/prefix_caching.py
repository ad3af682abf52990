"""Prefix-caching benchmark: time to first token of a request whose long prefix is cached, against the
same request with the cache emptied, as a ratio measured in one run on one engine.

Each iteration runs a pair on the same engine: first `reset_prefix_cache()` and a request
prefix + question (everything computed), then prefix + another question of the same length (the
prefix's full blocks come from the cache). Pairs are interleaved so drift in machine load hits both
sides alike; medians are reported. TTFT comes from the engine's RequestMetrics (arrival to first
token), so Python setup around `generate` is excluded.

    python -m pagedllm.benchmarks.prefix_caching [--model DIR] [--prefix-len 4000] [--output-json F]

Without --model it uses the bundled demo model when installed, else (or with `--model random`) a small
random Llama with an 8,192-token context built in a temporary directory (token-id prompts only). A
default prefix longer than the model's context is shortened to fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pagedllm.assets import demo_model_path
from pagedllm.benchmarks.reporting import fail, write_json

DEFAULT_PREFIX_LEN = 4000
DEFAULT_QUESTION_LEN = 50


@dataclass
class PrefixCachingResult:
    model: str
    device: str
    dtype: str
    block_size: int
    num_threads: int
    prefix_len: int
    question_len: int
    num_iters: int
    ttft_uncached_s: float  # medians over iterations
    ttft_cached_s: float
    speedup: float  # ttft_uncached / ttft_cached
    cpu_uncached_s: float  # process CPU time of the whole request: steadier than wall time on a shared box
    cpu_cached_s: float
    num_cached_tokens: int  # prefix-cache hit of each cached request (full blocks of the prefix)
    tokens_computed_uncached: int
    tokens_computed_cached: int
    ttft_uncached_all_s: list[float] = field(default_factory=list)
    ttft_cached_all_s: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_random_model(path: str, max_position_embeddings: int = 8192, seed: int = 0) -> str:
    """A small random-weight Llama checkpoint (no tokenizer) in `path`: enough layers and width that a
    4,000-token prefill is real work, small enough to build in a second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _random_ids(num_tokens: int, vocab_size: int, generator: torch.Generator) -> list[int]:
    # Ids from 3 up: skip the usual bos/eos/pad ids so no prompt carries a special token by accident.
    low = min(3, vocab_size - 1)
    return torch.randint(low, vocab_size, (num_tokens,), generator=generator).tolist()


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, float, int]:
    """(time to first token, CPU seconds, prefix-cache hit in tokens) of one request run alone."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    cpu_start = time.process_time()
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    cpu_s = time.process_time() - cpu_start
    metrics = output.metrics
    assert metrics is not None and metrics.first_token_time is not None
    return metrics.first_token_time - metrics.arrival_time, cpu_s, output.num_cached_tokens


def run_prefix_caching(llm: Any, model: str, prefix_len: int, question_len: int = DEFAULT_QUESTION_LEN,
                       num_iters: int = 3, num_warmup: int = 1, seed: int = 0) -> PrefixCachingResult:
    engine = llm.llm_engine
    if not engine.cache_config.enable_prefix_caching:
        raise ValueError("prefix caching must be enabled for this benchmark (drop --no-enable-prefix-caching)")
    max_model_len = engine.model_config.max_model_len
    if prefix_len + question_len + 1 > max_model_len:
        raise ValueError(f"--prefix-len {prefix_len} plus --question-len {question_len} plus one output token "
                         f"exceeds the model's max_model_len={max_model_len}")
    generator = torch.Generator().manual_seed(seed)
    vocab_size = engine.model_config.vocab_size
    prefix = _random_ids(prefix_len, vocab_size, generator)

    uncached: list[float] = []
    cached: list[float] = []
    cpu_uncached: list[float] = []
    cpu_cached: list[float] = []
    hits: list[int] = []
    for i in range(num_warmup + num_iters):
        cold_question, warm_question = (_random_ids(question_len, vocab_size, generator) for _ in range(2))
        if not llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused: the engine still holds requests")
        cold_s, cold_cpu_s, cold_hit = _ttft(llm, prefix + cold_question)
        assert cold_hit == 0, "the uncached request hit the cache"
        warm_s, warm_cpu_s, warm_hit = _ttft(llm, prefix + warm_question)
        if i >= num_warmup:
            uncached.append(cold_s)
            cached.append(warm_s)
            cpu_uncached.append(cold_cpu_s)
            cpu_cached.append(warm_cpu_s)
            hits.append(warm_hit)
    prompt_len = prefix_len + question_len
    ttft_uncached, ttft_cached = statistics.median(uncached), statistics.median(cached)
    return PrefixCachingResult(
        model=model,
        device=str(engine.device),
        dtype=str(engine.model_config.dtype).removeprefix("torch."),
        block_size=engine.cache_config.block_size,
        num_threads=torch.get_num_threads(),
        prefix_len=prefix_len,
        question_len=question_len,
        num_iters=num_iters,
        ttft_uncached_s=ttft_uncached,
        ttft_cached_s=ttft_cached,
        speedup=ttft_uncached / ttft_cached,
        cpu_uncached_s=statistics.median(cpu_uncached),
        cpu_cached_s=statistics.median(cpu_cached),
        num_cached_tokens=min(hits),
        tokens_computed_uncached=prompt_len,
        tokens_computed_cached=prompt_len - min(hits),
        ttft_uncached_all_s=uncached,
        ttft_cached_all_s=cached,
    )


def format_prefix_caching(r: PrefixCachingResult) -> str:
    rows = [
        ("model", f"{r.model} ({r.dtype}, {r.device}, {r.num_threads} threads, block_size {r.block_size})"),
        ("prompt", f"{r.prefix_len}-token shared prefix + {r.question_len}-token question, 1 output token"),
        ("", "TTFT (median)   CPU time (median)   tokens computed"),
        ("uncached", f"{r.ttft_uncached_s * 1e3:>10,.1f} ms   {r.cpu_uncached_s * 1e3:>12,.1f} ms   "
                     f"{r.tokens_computed_uncached:>10,}"),
        ("prefix cached", f"{r.ttft_cached_s * 1e3:>10,.1f} ms   {r.cpu_cached_s * 1e3:>12,.1f} ms   "
                          f"{r.tokens_computed_cached:>10,}"),
        ("ratio uncached/cached", f"{r.speedup:>10,.1f}x   {r.cpu_uncached_s / r.cpu_cached_s:>12,.1f}x"
                                  f"      (medians of {r.num_iters} interleaved pairs)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This benchmark's flags plus the engine's (so `pagedllm bench prefix-caching` can reuse them)."""
    from pagedllm.engine.arg_utils import EngineArgs

    parser.add_argument("--model", default=None,
                        help="model directory, or 'random' for a random Llama built here (default: the bundled demo "
                        "model when installed, else 'random')")
    parser.add_argument("--prefix-len", type=int, default=None,
                        help=f"shared prefix tokens (default {DEFAULT_PREFIX_LEN}, less if the model's context "
                        "is shorter)")
    parser.add_argument("--question-len", type=int, default=DEFAULT_QUESTION_LEN, help="tokens after the prefix")
    parser.add_argument("--num-iters", type=int, default=3, help="measured (uncached, cached) pairs")
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(parser)
    return parser


def run_cmd(args: argparse.Namespace) -> int:
    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    for name in ("question_len", "num_iters"):
        if getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.prefix_len is not None and args.prefix_len < 1:
        return fail(f"--prefix-len must be at least 1, got {args.prefix_len}")
    if args.num_threads is not None and args.num_threads < 1:
        return fail(f"--num-threads must be at least 1, got {args.num_threads}")
    with tempfile.TemporaryDirectory(prefix="pagedllm-prefix-bench-") as tmp:
        model = demo_model_path() if args.model is None else args.model
        label = model
        if model is None or model == "random":
            wanted = (args.prefix_len or DEFAULT_PREFIX_LEN) + args.question_len + 1
            model = build_random_model(tmp, max_position_embeddings=max(8192, wanted))
            label = "random Llama (hidden 256, 4 layers)"
        args.model = model
        args.enable_prefix_caching = True
        if args.num_gpu_blocks_override is None and args.kv_cache_memory_bytes is None:
            # Room for a few such prompts: on CPU the engine's default KV budget for a long context
            # can be gigabytes, which this one-request-at-a-time benchmark never touches.
            wanted = (args.prefix_len or DEFAULT_PREFIX_LEN) + args.question_len + 1
            args.num_gpu_blocks_override = 4 * -(-wanted // args.block_size)
        try:
            engine_args = EngineArgs.from_cli_args(args)
            llm = LLM(**dataclasses.asdict(engine_args))
            prefix_len = args.prefix_len
            if prefix_len is None:  # the default fits the model's context
                prefix_len = min(DEFAULT_PREFIX_LEN, llm.llm_engine.model_config.max_model_len - args.question_len - 1)
                if prefix_len < 1:
                    raise ValueError(f"--question-len {args.question_len} leaves no room for a prefix")
            result = run_prefix_caching(llm, label, prefix_len, args.question_len, args.num_iters,
                                        args.num_iters_warmup, args.seed)
        except ValueError as exc:
            return fail(str(exc))
    print(format_prefix_caching(result))
    write_json(args.output_json, result.to_dict())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.benchmarks.prefix_caching", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    return run_cmd(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
