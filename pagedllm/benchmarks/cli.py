"""`pagedllm bench throughput|latency|serve`: each prints a table and can write JSON (--output-json)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from typing import Any

from pagedllm.assets import demo_model_path
from pagedllm.benchmarks.datasets import DATASETS
from pagedllm.benchmarks.reporting import cpu_kernel_summary, fail, format_cpu_kernels, write_json

# Engine flags used when the engine's own EngineArgs cannot be imported (they mirror its spelling).
_FALLBACK_ENGINE_FLAGS: dict[str, tuple[type, Any]] = {
    "--dtype": (str, "auto"),
    "--block-size": (int, 16),
    "--max-num-batched-tokens": (int, 2048),
    "--max-num-seqs": (int, 256),
    "--max-model-len": (int, None),
    "--kv-cache-dtype": (str, "auto"),
    "--seed": (int, 0),
    "--device": (str, "auto"),
}


def _engine_args_class() -> Any | None:
    try:
        from pagedllm.engine.arg_utils import EngineArgs
    except ImportError:
        return None
    return EngineArgs


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    engine_args = _engine_args_class()
    if engine_args is not None:
        engine_args.add_cli_args(parser)
    else:
        for flag, (kind, default) in _FALLBACK_ENGINE_FLAGS.items():
            parser.add_argument(flag, type=kind, default=default)
    if "--model" not in parser._option_string_actions:
        parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    if "--seed" not in parser._option_string_actions:
        parser.add_argument("--seed", type=int, default=0)
    if "--num-threads" not in parser._option_string_actions:
        parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")


def _resolve_model(args: argparse.Namespace) -> str:
    model = getattr(args, "model", None)
    if model:
        return str(model)
    model = demo_model_path()
    if not model:
        raise ValueError("--model is required (the bundled demo model is not installed)")
    print(f"no --model: benchmarking the bundled demo model ({model}), not the default SmolLM2", file=sys.stderr)
    return str(model)


def _build_llm(args: argparse.Namespace, model: str) -> Any:
    from pagedllm import LLM

    engine_args = _engine_args_class()
    if engine_args is not None:
        args.model = model
        kwargs = dataclasses.asdict(engine_args.from_cli_args(args))
    else:
        kwargs = {
            flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag in _FALLBACK_ENGINE_FLAGS
        }
    kwargs["model"] = model
    if getattr(args, "num_threads", None) is not None:
        kwargs["num_threads"] = args.num_threads
    return LLM(**kwargs)


def _add_dataset_args(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    parser.add_argument(
        "--dataset",
        default="random",
        help=f"{' or '.join(DATASETS)}, or a JSON/JSONL file of prompts (ShareGPT format works)",
    )
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (the mean for sharegpt-like)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (the mean for sharegpt-like)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="throughput, latency and serving benchmarks")
    bench = parser.add_subparsers(dest="bench_command", required=True)

    throughput = bench.add_parser(
        "throughput",
        help="offline throughput of LLM.generate",
        description="Offline throughput (requests/s, tokens/s), optionally against "
        "Hugging Face transformers' generate on the same requests.",
    )
    _add_dataset_args(throughput, num_prompts=100)
    throughput.add_argument(
        "--compare",
        choices=["hf"],
        help="also run transformers' generate, at --hf-batch-size and at our engine's batch size "
        "(min(num prompts, max_num_seqs)), and print the ratios",
    )
    throughput.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for --compare hf")
    throughput.add_argument(
        "--profile",
        action="store_true",
        help="split pagedllm's step time into scheduling, input preparation, forward, sampling, "
        "detokenisation and output processing, and print the engine overhead",
    )
    throughput.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="do not detokenize pagedllm's outputs, keeping that work out of the measurement (vLLM's flag)",
    )
    throughput.add_argument("--output-json")
    throughput.add_argument("--disable-tqdm", action="store_true")
    throughput.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
        help="PEFT LoRA adapters: run the requests on the plain base model, then spread round-robin over "
        "these adapters on one engine (--max-loras defaults to their number), and print the ratio and each "
        "adapter's load time and bytes",
    )
    throughput.add_argument("--num-random-loras", type=int, default=0,
                            help="as --lora-modules, with this many random adapters written to a temporary directory")
    throughput.add_argument("--lora-rank", type=int, default=16, help="rank of the --num-random-loras adapters")
    _add_engine_args(throughput)
    throughput.set_defaults(func=run_throughput_cmd)

    latency = bench.add_parser(
        "latency",
        help="batch-1 TTFT, decode speed and roofline fraction",
        description="Batch-1 time to first token and decode tokens/s, and decode as a "
        "fraction of the memory-bandwidth roofline measured in the same run.",
    )
    latency.add_argument("--input-len", type=int, default=32)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--num-iters", type=int, default=5)
    latency.add_argument("--num-iters-warmup", type=int, default=1)
    latency.add_argument(
        "--compare",
        choices=["llama.cpp"],
        help="also run llama.cpp's llama-bench on the same GGUF file with the same thread count, alternating "
        "with pagedllm's runs, and print both and the ratio (builds llama.cpp on first use: pagedllm[bench])",
    )
    latency.add_argument(
        "--gguf-type",
        default=None,
        help="with --compare llama.cpp and a Hugging Face model directory: the GGUF type both engines read "
        "(BF16 by default; F32, F16, or a llama-quantize type such as Q8_0 or Q4_K_M), converted once and cached",
    )
    latency.add_argument("--output-json")
    _add_engine_args(latency)
    latency.set_defaults(func=run_latency_cmd)

    serve = bench.add_parser(
        "serve",
        help="load an OpenAI-compatible server",
        description="Streamed /v1/completions requests with Poisson arrivals against any "
        "OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput, goodput.",
    )
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    serve.add_argument("--model", default=None, help="served model name (default: the first in /v1/models)")
    serve.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory for building prompts (default: --model if a directory, else the demo model)",
    )
    _add_dataset_args(serve, num_prompts=100)
    serve.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (inf: all at once)",
    )
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--slo-ttft-ms", type=float, default=None)
    serve.add_argument("--slo-tpot-ms", type=float, default=None)
    serve.add_argument("--no-ignore-eos", action="store_true", help="do not send vLLM's ignore_eos extension")
    serve.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--output-json")
    serve.add_argument("--plot", help="PNG of the latency distributions")
    serve.set_defaults(func=run_serve_cmd)
    _add_other_benchmarks(bench)
    return parser


# Benchmarks that live in their own modules (built by others), wired in by name: sub-command ->
# (module, function adding its flags, function running it, help).
OTHER_BENCHMARKS = {
    "spec-decode": (
        "pagedllm.benchmarks.spec_decode",
        "add_cli_args",
        "run_spec_decode_cmd",
        "speculative decoding at batch 1 against plain decoding",
    ),
    "attention": (
        "pagedllm.benchmarks.attention",
        "add_cli_args",
        "run_cmd",
        "paged attention kernels against gather + SDPA: per-layer decode time, KV bandwidth, e2e tok/s",
    ),
    "prefix-caching": (
        "pagedllm.benchmarks.prefix_caching",
        "add_cli_args",
        "run_cmd",
        "time to first token with a cached long prefix against without",
    ),
    "mla": (
        "pagedllm.benchmarks.mla",
        "add_cli_args",
        "run_cmd",
        "MLA decode absorbed against expanded at 1k/8k context, and KV bytes per token against MHA",
    ),
    "quantization": (
        "pagedllm.benchmarks.quantization",
        "add_cli_args",
        "run_cmd",
        "decode tokens/s with int8 / fp8 weights against bf16, and their roofline fractions",
    ),
    "prepack": (
        "pagedllm.benchmarks.prepack",
        "add_cli_args",
        "run_cmd",
        "prefill and decode with linear weights prepacked for oneDNN against plain F.linear",
    ),
    "kv-cache": (
        "pagedllm.benchmarks.kv_cache",
        "add_cli_args",
        "run_cmd",
        "kv_cache_dtype against the model dtype: perplexity, greedy agreement, decode tok/s, sequences per budget",
    ),
    "kv-cache-snapshot": (
        "pagedllm.benchmarks.kv_cache_snapshot",
        "add_cli_args",
        "run_cmd",
        "cost of the /kv-cache/state snapshot at a 100,000-block pool against a plain decode step",
    ),
    "gguf": (
        "pagedllm.benchmarks.llama_cpp",
        "add_cli_args",
        "run_cmd",
        "a Hugging Face model as GGUF files (BF16, Q8_0, Q4_K_M...) by llama.cpp's converter, for --compare llama.cpp",
    ),
    "structured-output": (
        "pagedllm.benchmarks.structured_output",
        "add_cli_args",
        "run_cmd",
        "decode tokens/s with and without a JSON schema, and schema compile time",
    ),
}


def _add_other_benchmarks(bench: argparse._SubParsersAction) -> None:
    import importlib

    for name, (module_name, add_args, run, help_text) in OTHER_BENCHMARKS.items():
        try:
            module = importlib.import_module(module_name)
            add_fn, run_fn = getattr(module, add_args), getattr(module, run)
        except (ImportError, AttributeError):
            continue  # not built (yet): the other sub-commands still work
        sub = bench.add_parser(name, help=help_text, description=(module.__doc__ or help_text).split("\n\n")[0])
        add_fn(sub)
        sub.set_defaults(func=run_fn)


def tensor_parallel_summary(llm: Any) -> dict[str, Any] | None:
    """Under tensor parallelism: bytes rank 0 all-reduced per computed token, beside the planner's figure."""
    from pagedllm.planner import roofline as rl

    engine = llm.llm_engine
    tp = engine.parallel_config.tensor_parallel_size
    if tp == 1:
        return None
    stats = engine.model_executor.collective_rpc("communication_stats")[0]
    config = engine.model_config
    spec = rl.ModelSpec.from_hf_config(config.hf_config, name=config.model)
    return {
        "tensor_parallel_size": tp,
        "all_reduce_bytes_per_token": stats["all_reduce_bytes"] / max(1, stats["num_computed_tokens"]),
        "planner_all_reduce_bytes_per_token": rl.all_reduce_bytes_per_token(spec, tp, config.dtype.itemsize),
        "logits_gather_bytes": stats["gather_bytes"],
    }


def format_tensor_parallel(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return "tensor parallel size 1 (no collectives)"
    return (f"tensor parallel size {summary['tensor_parallel_size']}: all-reduced "
            f"{summary['all_reduce_bytes_per_token']:,.0f} B per token (planner: "
            f"{summary['planner_all_reduce_bytes_per_token']:,.0f} B)")


def run_throughput_cmd(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.datasets import get_requests
    from pagedllm.benchmarks.throughput import format_results, run_hf_fresh_process, run_pagedllm, throughput_report

    if getattr(args, "lora_modules", None) or getattr(args, "num_random_loras", 0):
        return run_lora_throughput_cmd(args)
    try:
        model = _resolve_model(args)
        if args.hf_batch_size < 1:
            raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
        llm = _build_llm(args, model)
        model_config = llm.llm_engine.model_config
        requests = get_requests(
            args.dataset,
            llm.get_tokenizer(),
            args.num_prompts,
            args.input_len,
            args.output_len,
            seed=args.seed,
            max_model_len=model_config.max_model_len,
        )
    except ValueError as exc:
        return fail(str(exc))
    from pagedllm.benchmarks.profile import StepProfiler

    profiler = StepProfiler() if args.profile else None
    results = [run_pagedllm(llm, requests, use_tqdm=not args.disable_tqdm, profiler=profiler,
                            detokenize=not args.disable_detokenize)]
    tp_summary = tensor_parallel_summary(llm)
    cpu_summary = cpu_kernel_summary(llm)
    dtype = model_config.dtype
    device = str(getattr(model_config, "device", None) or getattr(llm.llm_engine, "device", "cpu"))
    # the most requests our engine can run at once here: transformers also runs at that static batch
    our_batch = min(len(requests), llm.llm_engine.scheduler.config.max_num_seqs)
    del llm  # free its weights and KV cache before transformers loads its own copy
    if args.compare == "hf":
        batch_sizes = [args.hf_batch_size] + ([our_batch] if our_batch != args.hf_batch_size else [])
        device = "cuda" if device.startswith("cuda") else "cpu"
        results.extend(run_hf_fresh_process(model, requests, dtype, batch_sizes, device=device))
    mean_prompt = sum(r.prompt_len for r in requests) / len(requests)
    mean_output = sum(r.output_len for r in requests) / len(requests)
    print(
        f"{args.dataset}: {len(requests)} prompts, mean {mean_prompt:.1f} prompt / {mean_output:.1f} output "
        f"tokens, {str(dtype).removeprefix('torch.')}"
    )
    print(format_results(results))
    print(format_tensor_parallel(tp_summary))
    print(format_cpu_kernels(cpu_summary))
    if profiler is not None:
        print(profiler.format())
    config = {
        "model": model,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": str(dtype).removeprefix("torch."),
        "compare": args.compare,
        "hf_batch_size": args.hf_batch_size,
        "seed": args.seed,
        "mean_prompt_len": mean_prompt,
        "mean_output_len": mean_output,
        "tensor_parallel": tp_summary,
        "cpu_kernels": cpu_summary,
    }
    report = throughput_report(results, config)
    if profiler is not None:
        report["profile"] = profiler.to_dict()
    write_json(args.output_json, report)
    return 0


def run_lora_throughput_cmd(args: argparse.Namespace) -> int:
    """The same requests on the plain base model, then spread over LoRA adapters on one engine (see
    pagedllm.benchmarks.lora); the first table row is the adapters', so its ratio reads LoRA / base."""
    import tempfile

    from pagedllm.benchmarks import lora as lora_bench
    from pagedllm.benchmarks.datasets import get_requests
    from pagedllm.benchmarks.throughput import format_results, run_pagedllm, throughput_report

    try:
        model = _resolve_model(args)
        modules = lora_bench.parse_modules(args.lora_modules)
        if args.num_random_loras < 0 or (args.num_random_loras and modules):
            raise ValueError("give --lora-modules or a positive --num-random-loras, not both")
        if args.compare:
            raise ValueError("--compare hf does not apply to a LoRA run (its baseline is the base model)")
        args.enable_lora = False
        base_llm = _build_llm(args, model)
        model_config = base_llm.llm_engine.model_config
        requests = get_requests(args.dataset, base_llm.get_tokenizer(), args.num_prompts, args.input_len,
                                args.output_len, seed=args.seed, max_model_len=model_config.max_model_len)
    except ValueError as exc:
        return fail(str(exc))
    base = run_pagedllm(base_llm, requests, use_tqdm=not args.disable_tqdm, detokenize=not args.disable_detokenize,
                        backend="pagedllm base model")
    del base_llm  # its weights and KV cache go before the LoRA engine loads its own
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="pagedllm-loras-") as tmp:
        for i in range(args.num_random_loras):
            path = lora_bench.write_random_adapter(model_config, os.path.join(tmp, f"lora{i}"), args.lora_rank,
                                                   args.seed + i, model_config.dtype)
            modules.append((f"lora{i}", path))
        ranks = [lora_bench.read_rank(path) for _, path in modules]
        args.enable_lora = True
        args.max_loras = max(args.max_loras, len(modules))
        args.max_cpu_loras = max(args.max_cpu_loras or 0, args.max_loras)
        args.max_lora_rank = max(args.max_lora_rank, *ranks)
        try:
            llm = _build_llm(args, model)
            lora_requests, loads = lora_bench.load_adapters(llm, modules)
        except ValueError as exc:
            return fail(str(exc))
        profiler = None
        if args.profile:
            from pagedllm.benchmarks.profile import StepProfiler

            profiler = StepProfiler()
        with_loras = run_pagedllm(llm, requests, use_tqdm=not args.disable_tqdm, profiler=profiler,
                                  detokenize=not args.disable_detokenize, lora_requests=lora_requests,
                                  backend=f"pagedllm {len(modules)} LoRA adapters")
        slot_bytes = llm.llm_engine.model_runner.lora_manager.slot_bytes()
    results = [with_loras, base]
    print(f"{args.dataset}: {len(requests)} prompts over {len(modules)} adapters (round-robin), "
          f"{str(model_config.dtype).removeprefix('torch.')}, max_loras {args.max_loras}, "
          f"max_lora_rank {args.max_lora_rank}")
    print(format_results(results))
    print(lora_bench.format_loads(loads, slot_bytes))
    if profiler is not None:
        print(profiler.format())
    config = {"model": model, "dataset": args.dataset, "num_prompts": len(requests), "input_len": args.input_len,
              "output_len": args.output_len, "dtype": str(model_config.dtype).removeprefix("torch."),
              "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank, "seed": args.seed,
              "lora_modules": [name for name, _ in modules], "random_loras": args.num_random_loras}
    report = throughput_report(results, config)
    report["lora"] = lora_bench.loads_report(loads, slot_bytes)
    write_json(args.output_json, report)
    return 0


def _llama_cpp_model(model: str, args: argparse.Namespace) -> tuple[str, Any]:
    """The GGUF file both engines read, and the llama.cpp build: the model itself when it is a .gguf
    file, else its directory converted (and quantized) by llama.cpp's own tools."""
    from pagedllm.benchmarks import llama_cpp
    from pagedllm.models.gguf import resolve_gguf_file

    gguf_file = resolve_gguf_file(model)
    if gguf_file is not None and args.gguf_type is not None:
        raise ValueError(f"--gguf-type applies to a Hugging Face model directory; {model!r} is already a GGUF file")
    build = llama_cpp.ensure_built()
    if gguf_file is None:
        gguf_file = str(llama_cpp.ensure_gguf(model, args.gguf_type or "BF16", build,
                                              num_threads=args.num_threads or 2))
    return gguf_file, build


def run_latency_cmd(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.datasets import get_requests
    from pagedllm.benchmarks.latency import format_latency, run_latency
    from pagedllm.benchmarks.llama_cpp import LlamaCppError

    comparing = getattr(args, "compare", None) == "llama.cpp"
    try:
        model = _resolve_model(args)
        if args.num_iters < 1 or args.num_iters_warmup < 0:
            raise ValueError("--num-iters must be >= 1 and --num-iters-warmup >= 0")
        if getattr(args, "gguf_type", None) is not None and not comparing:
            raise ValueError("--gguf-type applies to --compare llama.cpp only")
        if comparing:
            model, llama_build = _llama_cpp_model(model, args)
        llm = _build_llm(args, model)
        prompt = get_requests("random", llm.get_tokenizer(), 1, args.input_len, args.output_len, seed=args.seed)[0]
    except (ValueError, LlamaCppError) as exc:
        return fail(str(exc))
    between_runs, baseline_runs = None, []
    if comparing:
        import torch

        from pagedllm.benchmarks import llama_cpp

        llama_command = llama_cpp.llama_bench_command(llama_build, model, torch.get_num_threads(),
                                                      len(prompt.prompt_token_ids), args.output_len)

        def between_runs() -> None:
            baseline_runs.append(llama_cpp.run_llama_bench(llama_command))

    try:
        result = run_latency(llm, model, prompt.prompt_token_ids, args.output_len, args.num_iters,
                             args.num_iters_warmup, between_runs=between_runs)
    except LlamaCppError as exc:  # llama-bench failed: its command and stderr say why
        return fail(str(exc))
    tp_summary = tensor_parallel_summary(llm)
    cpu_summary = cpu_kernel_summary(llm)
    print(format_latency(result))
    print(format_tensor_parallel(tp_summary))
    print(format_cpu_kernels(cpu_summary))
    report = {**result.to_dict(), "tensor_parallel": tp_summary, "cpu_kernels": cpu_summary}
    if comparing:
        comparison = llama_cpp.compare(model, result.num_threads, result.decode_tokens_per_s_all, result.ttft_all_s,
                                       result.input_len, baseline_runs, llama_command)
        print(llama_cpp.format_comparison(comparison))
        report.update(cpu=comparison.cpu, llama_cpp=comparison.to_dict())
    write_json(args.output_json, report)
    return 0


def run_serve_cmd(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedllm.benchmarks.datasets import get_requests
    from pagedllm.benchmarks.serving import (
        ServeConfig,
        discover_model,
        format_serving,
        plot_latencies,
        run_serving_benchmark,
    )

    try:
        if not (args.request_rate > 0):
            raise ValueError(f"--request-rate must be > 0 (inf for all at once), got {args.request_rate}")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        model = args.model or discover_model(args.base_url, args.api_key)
        tokenizer_dir = args.tokenizer or (model if os.path.isdir(model) else demo_model_path())
        if tokenizer_dir is None:
            raise ValueError("--tokenizer is required to build prompts (no demo model installed)")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        requests = get_requests(
            args.dataset,
            tokenizer,
            args.num_prompts,
            args.input_len,
            args.output_len,
            seed=args.seed,
            with_text=True,
        )
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    config = ServeConfig(
        base_url=args.base_url,
        model=model,
        request_rate=args.request_rate,
        num_prompts=len(requests),
        max_concurrency=args.max_concurrency,
        ignore_eos=not args.no_ignore_eos,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        seed=args.seed,
        api_key=args.api_key,
    )
    report = run_serving_benchmark(config, requests, tokenizer)
    print(format_serving(report))
    write_json(args.output_json, report)
    if args.plot:
        plot_latencies(report, args.plot)
    return 0 if report["completed"] > 0 else 1
