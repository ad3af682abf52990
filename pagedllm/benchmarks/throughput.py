"""`pagedllm bench throughput`: offline throughput of LLM.generate over a request set, optionally against
Hugging Face transformers' `generate` on the same prompts and output lengths in the same run.

Both sides decode greedily and ignore EOS, so each request produces exactly its output_len tokens and
the two runs do the same useful work. transformers gets static batches, as a user of `generate` would
write them: requests sorted by prompt length, left-padded, each batch generating until its longest
requested output; only the requested tokens are counted.
"""

from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedllm.benchmarks.datasets import SampleRequest
from pagedllm.benchmarks.profile import StepProfiler


@dataclass
class ThroughputResult:
    backend: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    # tokens actually generated, counting a static batch's padding rows that run on to its longest
    # output; equals output_tokens for continuous batching
    generated_tokens: int | None = None

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "requests_per_s": self.requests_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
        }


def run_pagedllm(llm: Any, requests: list[SampleRequest], use_tqdm: bool = False,
                 profiler: StepProfiler | None = None, detokenize: bool = True,
                 lora_requests: list[Any] | None = None, backend: str = "pagedllm") -> ThroughputResult:
    """Time one LLM.generate call over every request (after a short warm-up outside the timing); with a
    profiler, where the step time goes (below). Outputs are detokenized, as a user's are,
    unless `detokenize` is False (vLLM's --disable-detokenize). lora_requests: request i runs under
    lora_requests[i % len] (the warm-up touches every adapter, so each is in a slot before the timing).
    The profiler clocks the timed run's steps, then splits a second run's by phase (see StepProfiler)."""
    from pagedllm import SamplingParams

    num_warmup = max(2, len(lora_requests or []))
    warmup = [{"prompt_token_ids": requests[i % len(requests)].prompt_token_ids} for i in range(num_warmup)]
    loras = None
    if lora_requests:
        loras = [lora_requests[i % len(lora_requests)] for i in range(len(requests))]
    llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False,
                 lora_request=[lora_requests[i % len(lora_requests)] for i in range(num_warmup)]
                 if lora_requests else None)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=detokenize)
        for r in requests
    ]
    if profiler is not None:
        profiler.attach(llm.llm_engine, phases=False)
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=loras)
        elapsed = time.perf_counter() - start
    finally:
        if profiler is not None:
            profiler.detach()
    if profiler is not None:
        # the phase split from a second run of the same requests, as cold to the prefix cache as the first
        llm.reset_prefix_cache()
        with profiler.attach(llm.llm_engine):
            llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return ThroughputResult(backend, len(requests), elapsed, sum(r.prompt_len for r in requests), output_tokens)


def run_hf_fresh_process(
    model: str, requests: list[SampleRequest], dtype: torch.dtype, batch_sizes: list[int], device: str = "cpu"
) -> list[ThroughputResult]:
    """run_hf_batch_sizes (the same requests through transformers' generate in static, left-padded
    batches) in a fresh process with this one's thread count: transformers then runs as a
    user would run it, with none of the state our engine left here (on CPU it tunes glibc's malloc for
    its whole process, which would speed up the baseline's prefill as well)."""
    threads = torch.get_num_threads()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context, initializer=torch.set_num_threads,
                                                initargs=(threads,)) as pool:
        return pool.submit(run_hf_batch_sizes, model, requests, dtype, batch_sizes, device).result()


def run_hf_batch_sizes(
    model: str, requests: list[SampleRequest], dtype: torch.dtype, batch_sizes: list[int], device: str = "cpu"
) -> list[ThroughputResult]:
    """One transformers run per static batch size, on one loaded model: a user's usual batch, and the batch
    our engine ran at, so a ratio is not only continuous batching's effect."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.models.gguf import resolve_gguf_file

    # transformers 5 renamed torch_dtype to dtype; 4.x would not apply an unknown `dtype`
    dtype_kwarg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    # a GGUF file: transformers reads it dequantized (its gguf_file argument), as its users run one
    gguf_file = resolve_gguf_file(model)
    where = {"pretrained_model_name_or_path": os.path.dirname(os.path.abspath(gguf_file)),
             "gguf_file": os.path.basename(gguf_file)} if gguf_file else {"pretrained_model_name_or_path": model}
    hf_model = AutoModelForCausalLM.from_pretrained(**where, **{dtype_kwarg: dtype}).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(**where)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0

    def generate(batch: list[SampleRequest]) -> None:
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - r.prompt_len :] = 1
        new_tokens = max(r.output_len for r in batch)
        # min_new_tokens = max_new_tokens is transformers' way to ignore EOS
        hf_model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )

    ordered = sorted(requests, key=lambda r: r.prompt_len)
    results = []
    with torch.inference_mode():
        generate([SampleRequest(r.prompt_token_ids, "", r.prompt_len, 4) for r in ordered[:2]])  # warm-up
        for batch_size in batch_sizes:
            batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
            start = time.perf_counter()
            for batch in batches:
                generate(batch)
            elapsed = time.perf_counter() - start
            results.append(ThroughputResult(
                f"transformers (static batch {batch_size})",
                len(requests),
                elapsed,
                sum(r.prompt_len for r in requests),
                sum(r.output_len for r in requests),
                generated_tokens=sum(len(b) * max(r.output_len for r in b) for b in batches),
            ))
    gc.collect()
    return results


def format_results(results: list[ThroughputResult]) -> str:
    header = f"{'backend':<32} {'requests':>8} {'elapsed s':>10} {'req/s':>8} "
    header += f"{'total tok/s':>12} {'output tok/s':>13}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.backend:<32} {r.num_requests:>8} {r.elapsed_s:>10.2f} {r.requests_per_s:>8.2f} "
            f"{r.total_tokens_per_s:>12.1f} {r.output_tokens_per_s:>13.1f}"
        )
    for other in results[1:]:
        lines.append(
            f"ratio {results[0].backend} / {other.backend}: "
            f"{results[0].output_tokens_per_s / other.output_tokens_per_s:.2f}x output tokens/s"
        )
    return "\n".join(lines)


def throughput_report(results: list[ThroughputResult], config: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = {"config": config, "results": [r.to_dict() for r in results]}
    report["config"]["num_threads"] = torch.get_num_threads()
    if len(results) >= 2:
        # against the first baseline (transformers at --hf-batch-size); every baseline in "ratios"
        report["ratios_output_tokens_per_s"] = {
            r.backend: results[0].output_tokens_per_s / r.output_tokens_per_s for r in results[1:]
        }
        report["ratio_output_tokens_per_s"] = results[0].output_tokens_per_s / results[1].output_tokens_per_s
        report["ratio_total_tokens_per_s"] = results[0].total_tokens_per_s / results[1].total_tokens_per_s
    return report
