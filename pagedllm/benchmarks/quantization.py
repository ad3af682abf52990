"""`pagedllm bench quantization`: decode tokens/s with weight-only int8 and fp8 against the model dtype,
at batch 1 and batch 16, each as a fraction of the memory-bandwidth roofline at its own bytes per token.

One run loads the model once per method (bf16 = no quantization; all engines stay loaded), measures
the memory bandwidth, and for each batch size decodes `--output-len` tokens after a `--input-len`-token
random prompt per sequence (ignore_eos, greedy), the methods taking turns in every iteration so that
load from other processes on a shared machine falls on all of them alike. Decode speed comes from the
engine's RequestMetrics: the generated tokens after the first, over the time from the last sequence's
first token to the last token, so prefill is excluded. Beside it, the same tokens over the process CPU
time of decoding (a whole request's CPU time minus a one-token request's), which other processes on
the machine disturb less than wall time. The roofline is the planner's: bandwidth / bytes one decode
step reads (weights once, with the projections at their quantized size, plus each sequence's KV at the
mean context) x batch.

    python -m pagedllm.entrypoints.cli bench quantization --model random-qwen2-386m --num-threads 1

`--model random-qwen2-386m` builds (once per run, in a temporary directory) the 386M-parameter random
Qwen2 the performance work uses: hidden 896, 24 layers, 14 query / 2 KV heads, intermediate 4864,
vocab 32,000, tied embeddings, bf16. Without --model the bundled demo model is used.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedllm.assets import demo_model_path
from pagedllm.benchmarks.reporting import choice_list, int_list, set_num_threads, write_json
from pagedllm.planner import roofline as rl
from pagedllm.planner.hardware import measure_memory_bandwidth

RANDOM_QWEN2 = "random-qwen2-386m"
METHODS = ("bf16", "int8", "fp8", "int4")  # "bf16" here means no quantization, in the model's --dtype
# int4 is asked for by name: it needs bf16 and input sizes in whole groups of 128, which tiny models lack
DEFAULT_METHODS = ("bf16", "int8", "fp8")


@dataclass
class QuantizationRow:
    method: str
    batch_size: int
    decode_tokens_per_s: float  # summed over the batch, median over iterations
    decode_tokens_per_cpu_s: float  # the same tokens over the process CPU time of decoding
    speedup_vs_unquantized: float
    bytes_per_step: float
    roofline_tokens_per_s: float
    roofline_fraction: float
    weight_bytes: int  # in memory, as the engine holds them
    decode_tokens_per_s_all: list[float]
    cpu_speedup_vs_unquantized: float = 0.0


def build_random_qwen2(path: str, seed: int = 0) -> str:
    """The 386M random Qwen2 checkpoint (bf16, no tokenizer) in `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, dtype="bfloat16")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    return path


def _decode_rates(llm: Any, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(decode tokens per wall second, per CPU second) of one batch."""
    from pagedllm import SamplingParams

    requests = [{"prompt_token_ids": p} for p in prompts]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    cpu = time.process_time()
    llm.generate(requests, one, use_tqdm=False)
    prefill_cpu = time.process_time() - cpu
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    cpu = time.process_time()
    outputs = llm.generate(requests, params, use_tqdm=False)
    decode_cpu = time.process_time() - cpu - prefill_cpu
    metrics = [o.metrics for o in outputs]
    start = max(m.first_token_time for m in metrics)
    end = max(m.last_token_time for m in metrics)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    return tokens / (end - start), tokens / max(decode_cpu, 1e-9)


def run_quantization_benchmark(model: str, methods: list[str], batch_sizes: list[int], input_len: int,
                               output_len: int, num_iters: int, dtype: str = "bfloat16",
                               seed: int = 0, num_threads: int | None = None) -> dict[str, Any]:
    from pagedllm import LLM

    bandwidth = measure_memory_bandwidth()
    generator = torch.Generator().manual_seed(seed)
    num_blocks = max(batch_sizes) * ((input_len + output_len) // 16 + 2)  # the KV the largest batch needs
    llms = {method: LLM(model, dtype=dtype, quantization=None if method == "bf16" else method, seed=seed,
                        enable_prefix_caching=False, max_num_seqs=max(batch_sizes),
                        num_gpu_blocks_override=num_blocks, num_threads=num_threads) for method in methods}
    rows: list[QuantizationRow] = []
    for batch in batch_sizes:
        vocab_size = next(iter(llms.values())).llm_engine.model_config.vocab_size
        prompts = [torch.randint(3, vocab_size, (input_len,), generator=generator).tolist() for _ in range(batch)]
        for llm in llms.values():
            _decode_rates(llm, prompts, min(output_len, 8))  # warm-up
        runs: dict[str, list[tuple[float, float]]] = {method: [] for method in methods}
        for _ in range(num_iters):
            for method, llm in llms.items():
                runs[method].append(_decode_rates(llm, prompts, output_len))
        for method, llm in llms.items():
            engine = llm.llm_engine
            config = engine.model_config
            spec = rl.ModelSpec.from_hf_config(config.hf_config, name=model)
            wb = rl.dtype_bytes(str(config.dtype).removeprefix("torch."))
            if config.quantization is not None:
                wb = rl.quantized_weight_dtype_bytes(spec, wb, config.quantization.method,
                                                     config.quantization.group_size)
            kb = engine.model_runner.kv_dtype.itemsize
            step_bytes = rl.decode_bytes_per_step(spec, input_len + output_len // 2, batch, wb, kb)
            roofline = bandwidth / step_bytes * batch
            rate = statistics.median(wall for wall, _ in runs[method])
            cpu_rate = statistics.median(cpu for _, cpu in runs[method])
            rows.append(QuantizationRow(method, batch, rate, cpu_rate, 0.0, step_bytes, roofline, rate / roofline,
                                        engine.model_runner.weight_bytes(), [wall for wall, _ in runs[method]]))
    del llms
    gc.collect()
    for row in rows:
        base = next(r for r in rows if r.method == methods[0] and r.batch_size == row.batch_size)
        row.speedup_vs_unquantized = row.decode_tokens_per_s / base.decode_tokens_per_s
        row.cpu_speedup_vs_unquantized = row.decode_tokens_per_cpu_s / base.decode_tokens_per_cpu_s
    return {"model": model, "dtype": dtype, "num_threads": torch.get_num_threads(), "input_len": input_len,
            "output_len": output_len, "num_iters": num_iters, "memory_bandwidth_bytes_per_s": bandwidth,
            "rows": [asdict(r) for r in rows]}


def format_quantization(report: dict[str, Any]) -> str:
    lines = [f"{report['model']}: {report['dtype']} activations, {report['num_threads']} thread(s), "
             f"{report['input_len']}-token prompts, {report['output_len']} generated tokens, median of "
             f"{report['num_iters']}; bandwidth measured {report['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
             f"{'method':<7} {'batch':>5} {'decode tok/s':>13} {'vs ' + report['rows'][0]['method']:>8} "
             f"{'tok/CPU-s':>10} {'vs':>6} {'weights MiB':>12} {'MB/step':>8} {'roofline tok/s':>15} "
             f"{'of roofline':>12}"]
    for r in report["rows"]:
        lines.append(f"{r['method']:<7} {r['batch_size']:>5} {r['decode_tokens_per_s']:>13.1f} "
                     f"{r['speedup_vs_unquantized']:>7.2f}x {r['decode_tokens_per_cpu_s']:>10.1f} "
                     f"{r['cpu_speedup_vs_unquantized']:>5.2f}x {r['weight_bytes'] / 2**20:>12.1f} "
                     f"{r['bytes_per_step'] / 1e6:>8.1f} {r['roofline_tokens_per_s']:>15.1f} "
                     f"{r['roofline_fraction']:>11.1%}")
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"model directory, or {RANDOM_QWEN2} (default: the bundled demo model)")
    parser.add_argument("--methods", type=choice_list(METHODS, "methods"), default=list(DEFAULT_METHODS),
                        help="comma-separated, the first is the baseline (default: bf16,int8,fp8)")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 16])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", help="activation (and unquantized weight) dtype")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json")


def run_cmd(args: argparse.Namespace) -> int:
    if (status := set_num_threads(args.num_threads)) is not None:
        return status
    if args.input_len < 1 or args.output_len < 2 or args.num_iters < 1:
        print("error: --input-len and --num-iters must be >= 1 and --output-len >= 2", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or demo_model_path()
        if model == RANDOM_QWEN2:
            model = build_random_qwen2(tmp, args.seed)
        if not model:
            print("error: --model is required (the bundled demo model is not installed)", file=sys.stderr)
            return 2
        try:
            report = run_quantization_benchmark(str(model), args.methods, args.batch_sizes, args.input_len,
                                                args.output_len, args.num_iters, args.dtype, args.seed,
                                                args.num_threads)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.model == RANDOM_QWEN2:
        report["model"] = RANDOM_QWEN2
    print(format_quantization(report))
    write_json(args.output_json, report)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    sys.exit(run_cmd(parser.parse_args()))
