"""`pagedllm bench kv-cache`: what each kv_cache_dtype costs and buys, in one run, against the model's own
dtype (the first in --kv-cache-dtypes):

- quality: validation perplexity of the bundled demo model's held-out windows (prompt logprobs, so
  every position reads the cache), and top-1 agreement with the baseline's greedy output over 16
  prompts x 64 tokens, teacher-forced (the baseline's output fed back as the prompt) and free-running;
- speed: decode tokens/s at batch 1 and 32 (the dtypes taking turns every iteration, so load from other
  processes falls on all alike; medians), from the engine's RequestMetrics, prefill excluded;
- capacity: how many --seq-len-token sequences fit in --memory-budget bytes of KV cache, from the
  engine's own bytes per block (scales included).

    python -m pagedllm.entrypoints.cli bench kv-cache --num-threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pagedllm.assets import demo_model_path
from pagedllm.benchmarks.reporting import choice_list, fail, int_list, set_num_threads, write_json
from pagedllm.kv_cache.quant import KV_CACHE_DTYPES

DEFAULT_DTYPES = ["auto", "int8", "fp8", "fp8_e5m2"]


def demo_windows(model: str) -> list[list[int]]:
    """The held-out token windows the bundled models ship with (val_slice.json), or [] for other models."""
    path = Path(model) / "val_slice.json"
    return json.loads(path.read_text())["windows"] if path.is_file() else []


def agreement_prompts(windows: list[list[int]], count: int = 16, length: int = 24) -> list[list[int]]:
    """`count` prompts of `length` tokens from the windows (several from each when there are few)."""
    return [windows[i % len(windows)][(i // len(windows)) * 100:][:length] for i in range(count)]


def greedy_outputs(llm: Any, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(llm: Any, prompts: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(teacher-forced, free-running) top-1 agreement of `llm` with the reference continuations."""
    from pagedllm import SamplingParams

    forced = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, reference)],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False),
                          use_tqdm=False)
    agree = total = 0
    for prompt, ref, out in zip(prompts, reference, forced):
        for position, token in enumerate(ref, start=len(prompt)):
            agree += out.prompt_logprobs[position][token].rank == 1
            total += 1
    free = greedy_outputs(llm, prompts, len(reference[0]))
    free_agree = sum(a == b for x, y in zip(reference, free) for a, b in zip(x, y))
    return agree / total, free_agree / total


def perplexity(llm: Any, windows: list[list[int]]) -> float:
    from pagedllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    nll = [-o.prompt_logprobs[i][t].logprob for o, w in zip(outs, windows) for i, t in enumerate(w) if i]
    return math.exp(sum(nll) / len(nll))


def decode_rate(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    """Decode tokens/s of one batch: tokens after each first one, from the last first token to the end."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    metrics = [o.metrics for o in outputs]
    start = max(m.first_token_time for m in metrics)
    end = max(m.last_token_time for m in metrics)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outputs) / (end - start)


def run_kv_cache_benchmark(model: str, kv_dtypes: list[str], batch_sizes: list[int], input_len: int,
                           output_len: int, num_iters: int, memory_budget: int, seq_len: int,
                           dtype: str = "bfloat16", agreement_tokens: int = 64, seed: int = 0) -> dict[str, Any]:
    from pagedllm import LLM

    max_batch = max(batch_sizes)
    num_blocks = max_batch * ((input_len + output_len) // 16 + 2) + 64
    llms = {name: LLM(model, dtype=dtype, kv_cache_dtype=name, seed=seed, enable_prefix_caching=False,
                      max_num_seqs=max(max_batch, 16), num_gpu_blocks_override=num_blocks) for name in kv_dtypes}
    windows = demo_windows(model)
    rows: dict[str, dict[str, Any]] = {}
    for name, llm in llms.items():
        runner = llm.llm_engine.model_runner
        blocks_per_seq = -(-seq_len // runner.block_size)
        rows[name] = {"kv_cache_dtype": name, "storage": str(runner.kv_dtype).removeprefix("torch."),
                      "bytes_per_token": runner.model_config.kv_bytes_per_token(runner.kv_dtype),
                      "sequences_in_budget": memory_budget // runner.kv_cache_bytes_per_block() // blocks_per_seq}
    if windows:
        prompts = agreement_prompts(windows)
        reference = greedy_outputs(llms[kv_dtypes[0]], prompts, agreement_tokens)
        for name, llm in llms.items():
            rows[name]["perplexity"] = perplexity(llm, windows)
            rows[name]["agreement_teacher_forced"], rows[name]["agreement_free_running"] = \
                agreement(llm, prompts, reference)
    generator = torch.Generator().manual_seed(seed)
    vocab_size = llms[kv_dtypes[0]].llm_engine.model_config.vocab_size
    for batch in batch_sizes:
        prompts = [torch.randint(3, vocab_size, (input_len,), generator=generator).tolist() for _ in range(batch)]
        for llm in llms.values():
            decode_rate(llm, prompts, min(output_len, 8))  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in kv_dtypes}
        for _ in range(num_iters):
            for name, llm in llms.items():
                rates[name].append(decode_rate(llm, prompts, output_len))
        for name in kv_dtypes:
            rows[name][f"decode_tokens_per_s_batch_{batch}"] = statistics.median(rates[name])
            rows[name][f"decode_tokens_per_s_batch_{batch}_all"] = rates[name]
    base = rows[kv_dtypes[0]]
    for row in rows.values():
        for key in [k for k in row if k.startswith("decode_tokens_per_s_batch_") and not k.endswith("_all")]:
            row[key.replace("decode_tokens_per_s", "decode_ratio")] = row[key] / base[key]
        if "perplexity" in row:
            row["perplexity_ratio"] = row["perplexity"] / base["perplexity"]
        row["sequences_ratio"] = row["sequences_in_budget"] / base["sequences_in_budget"]
    return {"model": model, "dtype": dtype, "num_threads": torch.get_num_threads(), "batch_sizes": batch_sizes,
            "input_len": input_len, "output_len": output_len, "num_iters": num_iters,
            "memory_budget_bytes": memory_budget, "seq_len": seq_len, "agreement_tokens": agreement_tokens,
            "rows": list(rows.values())}


def format_kv_cache(report: dict[str, Any]) -> str:
    budget = report["memory_budget_bytes"]
    lines = [f"{Path(report['model']).name}: {report['dtype']} model, {report['num_threads']} thread(s); decode "
             f"{report['input_len']}-token prompts + {report['output_len']} tokens, median of "
             f"{report['num_iters']}; capacity: {report['seq_len']}-token sequences in "
             f"{budget / 2**20:g} MiB of KV"]
    header = f"{'kv_cache_dtype':<14} {'B/token':>8} {'ppl':>7} {'ratio':>6} {'top-1 forced':>12} {'free':>6}"
    for batch in report["batch_sizes"]:
        header += f" {'tok/s b' + str(batch):>11} {'ratio':>6}"
    header += f" {'seqs':>6} {'ratio':>6}"
    lines.append(header)
    for r in report["rows"]:
        line = f"{r['kv_cache_dtype']:<14} {r['bytes_per_token']:>8}"
        if "perplexity" in r:
            line += (f" {r['perplexity']:>7.3f} {r['perplexity_ratio']:>6.3f} {r['agreement_teacher_forced']:>12.1%}"
                     f" {r['agreement_free_running']:>6.1%}")
        else:
            line += f" {'-':>7} {'-':>6} {'-':>12} {'-':>6}"
        for batch in report["batch_sizes"]:
            line += (f" {r[f'decode_tokens_per_s_batch_{batch}']:>11.1f}"
                     f" {r[f'decode_ratio_batch_{batch}']:>6.2f}")
        line += f" {r['sequences_in_budget']:>6} {r['sequences_ratio']:>6.2f}"
        lines.append(line)
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    parser.add_argument("--kv-cache-dtypes", type=choice_list(KV_CACHE_DTYPES, "kv cache dtypes"),
                        default=DEFAULT_DTYPES,
                        help=f"comma-separated, the first is the baseline (default: {','.join(DEFAULT_DTYPES)})")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 32])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--memory-budget", type=int, default=1 << 30, help="KV bytes for the capacity column")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence for the capacity column")
    parser.add_argument("--dtype", default="bfloat16", help="model (activation) dtype")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json")


def run_cmd(args: argparse.Namespace) -> int:
    if (status := set_num_threads(args.num_threads)) is not None:
        return status
    if args.input_len < 1 or args.output_len < 2 or args.num_iters < 1 or args.seq_len < 1 or args.memory_budget < 1:
        return fail("--input-len, --num-iters, --seq-len and --memory-budget must be >= 1 and --output-len >= 2")
    model = args.model or demo_model_path()
    if not model:
        return fail("--model is required (the bundled demo model is not installed)")
    start = time.perf_counter()
    try:
        report = run_kv_cache_benchmark(str(model), args.kv_cache_dtypes, args.batch_sizes, args.input_len,
                                        args.output_len, args.num_iters, args.memory_budget, args.seq_len,
                                        args.dtype, seed=args.seed)
    except ValueError as exc:
        return fail(str(exc))
    report["elapsed_s"] = time.perf_counter() - start
    print(format_kv_cache(report))
    write_json(args.output_json, report)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    sys.exit(run_cmd(parser.parse_args()))
