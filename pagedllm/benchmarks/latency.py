"""`pagedllm bench latency`: batch-1 time to first token and decode speed, and decode as a fraction of
the memory-bandwidth roofline.

The roofline is the planner's: bandwidth (a copy probed right before each timed run, each run set
against its own probe) divided by the bytes one decode step reads (every weight plus the cached KV at
the mean context of the run). Timings come from the engine's own RequestMetrics, so they exclude
Python-side setup around `generate`. When the weights fit in the CPU's last-level cache, decode reads
them from cache, not DRAM, and the report says the roofline then means nothing (a 32 MiB L3 holds a
16M-parameter bf16 model).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pagedllm.openmp import wait_policy
from pagedllm.planner import roofline as rl
from pagedllm.planner.hardware import measure_cpu, measure_memory_bandwidth


@dataclass
class LatencyResult:
    model: str
    dtype: str
    kv_cache_dtype: str
    device: str
    input_len: int
    output_len: int
    num_iters: int
    ttft_s: float  # medians over iterations
    decode_tokens_per_s: float
    e2e_s: float
    memory_bandwidth_bytes_per_s: float  # median of the probes, one right before each timed run
    bytes_per_token: float
    roofline_tokens_per_s: float
    roofline_fraction: float  # median over runs of each run's decode rate against its own probe
    planner_bound_tokens_per_s: float  # min of memory and compute bounds (compute measured on CPU only)
    planner_limited_by: str
    num_threads: int = 0
    # how idle OpenMP threads wait (pagedllm/__init__.py): at 2+ threads it moves batch-1 decode by tens of percent
    openmp_wait: str = ""
    plan_command: str = ""  # the `pagedllm plan` line that predicts the same bound
    ttft_all_s: list[float] = field(default_factory=list)
    decode_tokens_per_s_all: list[float] = field(default_factory=list)
    memory_bandwidth_all: list[float] = field(default_factory=list)
    roofline_fraction_all: list[float] = field(default_factory=list)
    weight_bytes: float = 0.0
    # the weights' bytes are the loaded model's (kept packed as a GGUF file stores them), not the planner's
    weights_as_loaded: bool = False
    last_level_cache_bytes: int | None = None  # CPU only, from sysfs; None where unknown
    # KV cache the request holds while decoding (at its last decode step, in one more untimed run):
    # blocks, layers each block holds (a KV cache group's, see kv_cache/manager.py; all layers with one
    # group) and their bytes. Comparable across runs in bytes only.
    decode_kv_blocks: int = 0
    kv_layers_per_block: int = 0
    decode_kv_bytes: int = 0
    # Sliding-window models: the KV the planner says a sequence of this length holds with the window
    # counted, as a fraction of the same model with windows ignored (None without a window)
    planner_sliding_window_kv_fraction: float | None = None

    @property
    def weights_fit_in_cache(self) -> bool:
        return self.last_level_cache_bytes is not None and self.weight_bytes <= self.last_level_cache_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "weights_fit_in_cache": self.weights_fit_in_cache}


def last_level_cache_bytes(path: str = "/sys/devices/system/cpu/cpu0/cache/index3/size") -> int | None:
    """The CPU's L3 size as Linux reports it ("32768K"); None where the file is missing or unreadable."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if text and text[-1].upper() in units:
            return int(text[:-1]) * units[text[-1].upper()]
        return int(text)
    except ValueError:
        return None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _one_run(llm: Any, prompt_ids: list[int], output_len: int) -> tuple[float, float, float]:
    """(ttft, decode tokens/s, end-to-end) for one request, from the engine's metrics when it has them."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    start = time.time()
    output = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
    end = time.time()
    num_tokens = len(output.outputs[0].token_ids)
    m = output.metrics
    if m is not None and m.first_token_time is not None and m.last_token_time is not None:
        ttft = m.first_token_time - m.arrival_time
        decode_s = m.last_token_time - m.first_token_time
        e2e = (m.finished_time or m.last_token_time) - m.arrival_time
    else:  # no metrics: time a one-token request for the first token, the rest is decode
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        t0 = time.time()
        llm.generate([{"prompt_token_ids": prompt_ids}], one, use_tqdm=False)
        ttft = time.time() - t0
        e2e = end - start
        decode_s = e2e - ttft
    decode_tps = (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else float("nan")
    return ttft, decode_tps, e2e


def _loaded_weight_bytes(engine: Any) -> int | None:
    """The parameters' bytes of a model loaded with packed quantized weights though no quantization was asked
    for (a GGUF file's block types), where its runner is in this process; else None."""
    from pagedllm.layers.quantization import QuantizedWeight

    runner = getattr(engine, "model_runner", None)
    if runner is None or not any(isinstance(m, QuantizedWeight) for m in runner.model.modules()):
        return None
    return runner.weight_bytes()


def run_latency(
    llm: Any, model: str, prompt_ids: list[int], output_len: int, num_iters: int = 5, num_warmup: int = 1,
    between_runs: Callable[[], None] | None = None,
) -> LatencyResult:
    """`num_iters` timed runs after `num_warmup` short ones; `between_runs` (a baseline such as llama.cpp)
    is called after each timed run, so that the two alternate and a drifting host slows both alike."""
    engine = llm.llm_engine
    model_config = engine.model_config
    weight_dtype = _dtype_name(model_config.dtype)
    cache_config = getattr(engine, "cache_config", None)
    kv_dtype = getattr(cache_config, "kv_cache_dtype", None) or getattr(cache_config, "cache_dtype", None) or "auto"
    kv_dtype = weight_dtype if _dtype_name(kv_dtype) == "auto" else _dtype_name(kv_dtype)
    device = str(getattr(model_config, "device", None) or getattr(engine, "device", "cpu"))

    on_cuda = device.startswith("cuda")
    for _ in range(num_warmup):
        _one_run(llm, prompt_ids, min(output_len, 8))
    # The roofline's bandwidth is probed right before each timed run, and each run is set against its own
    # probe: a shared host's bandwidth drifts by 2x from one minute to the next, so a probe taken at another
    # moment than the run it divides says more about the drift than about the engine.
    bandwidths, runs = [], []
    for _ in range(num_iters):
        bandwidths.append(measure_memory_bandwidth(device="cuda" if on_cuda else "cpu"))
        runs.append(_one_run(llm, prompt_ids, output_len))
        if between_runs is not None:
            between_runs()
    ttfts, decode_rates, e2es = zip(*runs)
    bandwidth = statistics.median(bandwidths)

    # the roofline: bytes per token from the planner at the run's mean context length
    hf_config = model_config.hf_config
    spec = rl.ModelSpec.from_hf_config(hf_config if isinstance(hf_config, dict) else hf_config.to_dict(), name=model)
    mean_context = len(prompt_ids) + output_len // 2
    wb, kb = rl.dtype_bytes(weight_dtype), rl.dtype_bytes(kv_dtype)
    quantization = getattr(model_config, "quantization", None)
    loaded = _loaded_weight_bytes(engine) if quantization is None else None
    if quantization is not None:  # the projections' quantized bytes, embeddings and LM head in the model dtype
        wb = rl.quantized_weight_dtype_bytes(spec, wb, quantization.method, quantization.group_size)
    elif loaded is not None:
        # kept packed as loaded (a GGUF file's block types, whose bits the planner does not know): a decode
        # step reads the loaded weights (an untied embedding table is a buffer, not counted, as it is read
        # a row a token)
        wb = loaded / rl.decode_weight_params(spec, 1)
    bytes_per_token = rl.decode_bytes_per_token(spec, mean_context, 1, wb, kb)
    roofline = bandwidth / bytes_per_token
    fractions = [rate * bytes_per_token / bw for rate, bw in zip(decode_rates, bandwidths)]
    if on_cuda:  # no quick peak-FLOP measurement on GPUs here; decode at batch 1 is memory-bound anyway
        peak_flops = float("inf")
    else:
        peak_flops = measure_cpu(getattr(torch, weight_dtype, torch.float32)).peak_flops
    bound = rl.decode_bound(spec, mean_context, 1, wb, kb, peak_flops, bandwidth)
    decode_tps = statistics.median(decode_rates)
    kv = _decode_kv(llm, prompt_ids, output_len)
    # (at the length of _decode_kv's run)
    window = rl.sliding_window_kv(spec, len(prompt_ids) + _kv_run_tokens(output_len) - 1,
                                  getattr(cache_config, "block_size", 16))
    return LatencyResult(
        model=model,
        dtype=weight_dtype,
        kv_cache_dtype=kv_dtype,
        device=device,
        input_len=len(prompt_ids),
        output_len=output_len,
        num_iters=num_iters,
        ttft_s=statistics.median(ttfts),
        decode_tokens_per_s=decode_tps,
        e2e_s=statistics.median(e2es),
        memory_bandwidth_bytes_per_s=bandwidth,
        bytes_per_token=bytes_per_token,
        roofline_tokens_per_s=roofline,
        roofline_fraction=statistics.median(fractions),
        planner_bound_tokens_per_s=bound.tokens_per_s,
        planner_limited_by=bound.limited_by,
        num_threads=torch.get_num_threads(),
        openmp_wait=wait_policy(),
        plan_command=f"pagedllm plan --model {model} --hardware {'cpu' if not on_cuda else '<gpu preset>'} "
        f"--context {mean_context} --batch 1 --dtype {weight_dtype} --kv-cache-dtype {kv_dtype}"
        + (f" --quantization {quantization.method}" if quantization is not None else ""),
        ttft_all_s=list(ttfts),
        decode_tokens_per_s_all=list(decode_rates),
        memory_bandwidth_all=bandwidths,
        roofline_fraction_all=fractions,
        weight_bytes=rl.weight_bytes(spec, wb) if loaded is None else loaded,
        weights_as_loaded=loaded is not None,
        last_level_cache_bytes=None if on_cuda else last_level_cache_bytes(),
        decode_kv_blocks=kv[0], kv_layers_per_block=kv[1], decode_kv_bytes=kv[2],
        planner_sliding_window_kv_fraction=window["fraction_engine"] if window is not None else None,
    )


def _kv_run_tokens(output_len: int) -> int:
    return max(3, min(output_len, 16))


def _decode_kv(llm: Any, prompt_ids: list[int], output_len: int) -> tuple[int, int, int]:
    """(blocks in use at the last decode step, layers per block, their bytes): one more run of the prompt,
    stepped by hand. At a decode step a sliding group holds only its window's blocks; right after a prefill
    chunk it still holds the chunk's, so the prefill's steps are not what a long decode holds. Zeros where
    the engine is not in this process or the run has fewer than two decode steps."""
    from pagedllm import SamplingParams
    from pagedllm.kv_cache.quant import resolve_kv_cache_dtype

    engine = llm.llm_engine
    try:
        pool = engine.kv_cache_manager.pool
    except AttributeError:
        return 0, 0, 0
    engine.add_request("kv-in-use", {"prompt_token_ids": prompt_ids},
                       SamplingParams(temperature=0.0, max_tokens=_kv_run_tokens(output_len), ignore_eos=True,
                                      detokenize=False))
    in_use = []
    while engine.has_unfinished_requests():
        engine.step()
        in_use.append(pool.num_usable_blocks - pool.num_free_blocks)
    if len(in_use) < 3:
        return 0, 0, 0
    blocks = in_use[-2]  # the last step frees the request's blocks
    model_config, cache_config = engine.model_config, engine.cache_config
    groups = cache_config.kv_cache_groups
    layers = len(groups[0][1]) if groups else model_config.num_hidden_layers
    kv_dtype = resolve_kv_cache_dtype(cache_config.kv_cache_dtype, model_config.dtype)
    per_layer_token = model_config.kv_bytes_per_token(kv_dtype) // model_config.num_hidden_layers
    return blocks, layers, blocks * layers * cache_config.block_size * per_layer_token


def format_latency(r: LatencyResult) -> str:
    rows = [
        ("model", f"{r.model} ({r.dtype}, KV {r.kv_cache_dtype}, {r.device}, {r.num_threads} threads"
                  + (f", OpenMP threads {r.openmp_wait}" if r.openmp_wait and r.num_threads > 1 else "") + ")"),
        ("prompt / output tokens", f"{r.input_len} / {r.output_len}, {r.num_iters} iterations (medians)"),
        ("time to first token", f"{r.ttft_s * 1e3:,.1f} ms"),
        (
            "decode, batch 1",
            f"{r.decode_tokens_per_s:,.1f} tokens/s ({1e3 / r.decode_tokens_per_s:,.2f} ms/token)",
        ),
        ("end-to-end", f"{r.e2e_s:,.3f} s"),
        ("memory bandwidth (measured)", f"{r.memory_bandwidth_bytes_per_s / 1e9:,.1f} GB/s (a copy before each run)"),
        ("bytes per token (loaded weights)" if r.weights_as_loaded else "bytes per token (planner)",
         f"{r.bytes_per_token / 1e6:,.2f} MB"),
        ("roofline", f"{r.roofline_tokens_per_s:,.1f} tokens/s"),
        ("fraction of roofline", f"{r.roofline_fraction:.1%} (each run against its own copy; runs: "
                                 + ", ".join(f"{f:.0%}" for f in r.roofline_fraction_all) + ")"),
        (
            "planner bound (mem+compute)",
            f"{r.planner_bound_tokens_per_s:,.1f} tokens/s ({r.planner_limited_by}-bound)",
        ),
    ]
    if r.decode_kv_blocks:
        rows.append(("KV cache while decoding", f"{r.decode_kv_blocks:,} blocks of {r.kv_layers_per_block} layers = "
                                                f"{r.decode_kv_bytes / 2**20:,.2f} MiB"))
    if r.planner_sliding_window_kv_fraction is not None:
        rows.append(("sliding window (planner)", f"the window's KV is {r.planner_sliding_window_kv_fraction:.1%} "
                                                 "of full attention's at this length (compare the KV while "
                                                 "decoding of a run with --ignore-sliding-window)"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append(f"(the planner's prediction: {r.plan_command})")
    if r.weights_fit_in_cache:
        lines.append(
            f"WARNING: the weights ({r.weight_bytes / 2**20:,.1f} MiB) fit in the CPU's last-level cache "
            f"({r.last_level_cache_bytes / 2**20:,.0f} MiB): decode reads them from cache, so the DRAM "
            "roofline above says nothing about this model; measure a model larger than the cache."
        )
    return "\n".join(lines)
