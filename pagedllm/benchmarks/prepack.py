"""`pagedllm bench prepack`: prefill and decode with the linear weights prepacked (the default on CPU),
in pagedllm's blocked layout (on AMX tiles too where the CPU has them) and in oneDNN's, against plain
F.linear on the same weights, in one run.

The model is loaded once per variant (PAGEDLLM_CPU_PREPACK_WEIGHTS=0, =onednn, =blocked and =amx where
this CPU runs them; all engines stay loaded); for each batch size they take turns in every
iteration, so load from other processes on a shared machine falls on all alike. Per iteration: a
one-token request batch (prefill, timed whole), then the same prompts with `--output-len` tokens; decode
speed is the engine's RequestMetrics' (tokens after the first over the time from the last first token to
the last token), as in `bench quantization`. The report also says whether each engine produced the
plain one's tokens (greedy).

    python -m pagedllm.entrypoints.cli bench prepack --model random-qwen2-386m --num-threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from pagedllm.assets import demo_model_path
from pagedllm.benchmarks.quantization import RANDOM_QWEN2, _decode_rates, build_random_qwen2
from pagedllm.benchmarks.reporting import fail, int_list, set_num_threads, write_json
from pagedllm.layers.linear import PREPACK_ENV
from pagedllm.layers.linear_tuning import runnable_paths

# the PAGEDLLM_CPU_PREPACK_WEIGHTS value each engine loads under (those this CPU runs)
VARIANTS = {"plain": "0", "onednn": "onednn", "blocked": "blocked", "amx": "amx"}


def _load(model: str, flag: str, **kwargs: Any) -> Any:
    from pagedllm import LLM

    before = os.environ.get(PREPACK_ENV)
    os.environ[PREPACK_ENV] = flag
    try:
        return LLM(model, **kwargs)
    finally:
        if before is None:
            os.environ.pop(PREPACK_ENV, None)
        else:
            os.environ[PREPACK_ENV] = before


def run_prepack_benchmark(model: str, batch_sizes: list[int], input_len: int, output_len: int, num_iters: int,
                          dtype: str = "bfloat16", seed: int = 0) -> dict[str, Any]:
    from pagedllm import SamplingParams

    num_blocks = max(batch_sizes) * ((input_len + output_len) // 16 + 2)
    torch_dtype = getattr(torch, dtype)
    variants = {name: flag for name, flag in VARIANTS.items() if name in runnable_paths(torch_dtype)}
    llms = {name: _load(model, flag, dtype=dtype, seed=seed, enable_prefix_caching=False,
                        max_num_seqs=max(batch_sizes), num_gpu_blocks_override=num_blocks)
            for name, flag in variants.items()}
    generator = torch.Generator().manual_seed(seed)
    vocab_size = llms["plain"].llm_engine.model_config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    rows = []
    for batch in batch_sizes:
        prompts = [torch.randint(3, vocab_size, (input_len,), generator=generator).tolist() for _ in range(batch)]
        requests = [{"prompt_token_ids": p} for p in prompts]
        tokens = {name: [o.outputs[0].token_ids for o in llm.generate(requests, greedy, use_tqdm=False)]
                  for name, llm in llms.items()}  # also the warm-up
        prefill: dict[str, list[float]] = {name: [] for name in llms}
        decode: dict[str, list[float]] = {name: [] for name in llms}
        for _ in range(num_iters):
            for name, llm in llms.items():
                start = time.perf_counter()
                llm.generate(requests, one, use_tqdm=False)
                prefill[name].append(time.perf_counter() - start)
                decode[name].append(_decode_rates(llm, prompts, output_len)[0])
        row: dict[str, Any] = {"batch_size": batch}
        for name in llms:
            row[f"{name}_prefill_s"] = statistics.median(prefill[name])
            row[f"{name}_decode_tokens_per_s"] = statistics.median(decode[name])
            row[f"{name}_decode_tokens_per_s_all"] = decode[name]
            if name != "plain":
                row[f"{name}_same_tokens"] = tokens[name] == tokens["plain"]
                row[f"{name}_prefill_speedup"] = row["plain_prefill_s"] / row[f"{name}_prefill_s"]
                row[f"{name}_decode_speedup"] = (row[f"{name}_decode_tokens_per_s"]
                                                 / row["plain_decode_tokens_per_s"])
        rows.append(row)
    return {"model": model, "dtype": dtype, "num_threads": torch.get_num_threads(), "input_len": input_len,
            "output_len": output_len, "num_iters": num_iters, "variants": list(llms), "rows": rows}


def format_prepack(report: dict[str, Any]) -> str:
    lines = [f"{report['model']}: {report['dtype']}, {report['num_threads']} thread(s), {report['input_len']}-token "
             f"prompts, {report['output_len']} generated tokens, median of {report['num_iters']}; speed-ups "
             "against plain F.linear",
             f"{'batch':>5} {'weights':>8} {'prefill':>10} {'speedup':>8} {'decode tok/s':>13} {'speedup':>8} "
             f"{'same tokens':>12}"]
    for r in report["rows"]:
        for name in report["variants"]:
            plain = name == "plain"
            lines.append(f"{r['batch_size']:>5} {name:>8} {r[f'{name}_prefill_s'] * 1e3:>7.0f} ms "
                         f"{1.0 if plain else r[f'{name}_prefill_speedup']:>7.2f}x "
                         f"{r[f'{name}_decode_tokens_per_s']:>13.1f} "
                         f"{1.0 if plain else r[f'{name}_decode_speedup']:>7.2f}x "
                         f"{'-' if plain else ('yes' if r[f'{name}_same_tokens'] else 'NO'):>12}")
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"model directory, or {RANDOM_QWEN2} (default: the bundled demo model)")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json")


def run_cmd(args: argparse.Namespace) -> int:
    if (status := set_num_threads(args.num_threads)) is not None:
        return status
    if args.input_len < 1 or args.output_len < 2 or args.num_iters < 1:
        return fail("--input-len and --num-iters must be >= 1 and --output-len >= 2")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or demo_model_path()
        if model == RANDOM_QWEN2:
            model = build_random_qwen2(tmp, args.seed)
        if not model:
            return fail("--model is required (the bundled demo model is not installed)")
        report = run_prepack_benchmark(model, args.batch_sizes, args.input_len, args.output_len, args.num_iters,
                                       args.dtype, args.seed)
    print(format_prepack(report))
    write_json(args.output_json, report)
    return 0
