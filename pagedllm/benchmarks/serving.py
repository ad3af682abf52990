"""`pagedllm bench serve`: load an OpenAI-compatible server with streamed /v1/completions requests
arriving as a Poisson process, and report TTFT, TPOT, ITL and end-to-end latency, throughput and
goodput under latency SLOs (the metrics of vLLM's benchmark_serving, with its definitions):

- TTFT: request sent to first non-empty text chunk received.
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request.
- ITL: every gap between consecutive text chunks, pooled over requests.
- goodput: requests per second that met every SLO given.

Any server that speaks the OpenAI streaming protocol works. `ignore_eos` (a vLLM extension) is sent so
every request produces its output length; `--no-ignore-eos` leaves it out for servers that reject it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pagedllm.benchmarks.datasets import SampleRequest


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # requested
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    generated_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ServeConfig:
    base_url: str
    model: str
    request_rate: float  # requests/s; inf sends all at once
    num_prompts: int
    max_concurrency: int | None = None
    ignore_eos: bool = True
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None


async def _send(client: Any, config: ServeConfig, request: SampleRequest, tokenizer: Any | None) -> RequestResult:
    payload: dict[str, Any] = {
        "model": config.model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True
    result = RequestResult(request.prompt_len, request.output_len)
    usage_tokens: int | None = None
    chunks: list[str] = []
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                text = "".join(choice.get("text") or "" for choice in chunk.get("choices") or [])
                if not text:
                    continue
                now = time.perf_counter()
                if not chunks:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                chunks.append(text)
        result.e2e_s = time.perf_counter() - start
    except Exception as exc:  # a failed request is a result, not a crash of the benchmark
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.generated_text = "".join(chunks)
    if usage_tokens is not None:
        result.output_tokens = usage_tokens
    elif tokenizer is not None:
        result.output_tokens = len(tokenizer.encode(result.generated_text, add_special_tokens=False))
    else:
        result.output_tokens = len(chunks)
    result.success = bool(chunks)
    if not result.success:
        result.error = "no text received"
    return result


async def _run(
    config: ServeConfig, requests: list[SampleRequest], tokenizer: Any | None
) -> tuple[list[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.max_concurrency or len(requests) + 1)
    rng = random.Random(config.seed)
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    async def limited(client: Any, request: SampleRequest) -> RequestResult:
        if semaphore is None:
            return await _send(client, config, request, tokenizer)
        async with semaphore:
            return await _send(client, config, request, tokenizer)

    async with httpx.AsyncClient(
        base_url=config.base_url.rstrip("/"), headers=headers, limits=limits, timeout=config.timeout_s
    ) as client:
        tasks = []
        start = time.perf_counter()
        for request in requests:
            tasks.append(asyncio.create_task(limited(client, request)))
            if config.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(config.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


def discover_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def _stats(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan"), "std": float("nan")}
    array = np.asarray(values) * scale
    return {
        "mean": float(array.mean()),
        "median": float(np.median(array)),
        "p99": float(np.percentile(array, 99)),
        "std": float(array.std()),
    }


def summarize(config: ServeConfig, results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft_s for r in ok]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    e2es = [r.e2e_s for r in ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)

    def meets_slos(r: RequestResult) -> bool:
        if config.slo_ttft_ms is not None and r.ttft_s * 1e3 > config.slo_ttft_ms:
            return False
        tpot = r.tpot_s
        return config.slo_tpot_ms is None or tpot is None or tpot * 1e3 <= config.slo_tpot_ms

    good = [r for r in ok if meets_slos(r)]
    return {
        "config": asdict(config) | {"request_rate": str(config.request_rate), "api_key": None},
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "goodput": len(good) / duration_s if (config.slo_ttft_ms or config.slo_tpot_ms) else None,
        "ttft_ms": _stats(ttfts),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats(itls),
        "e2e_ms": _stats(e2es),
        "raw": {
            "ttft_s": ttfts,
            "tpot_s": tpots,
            "itl_s": itls,
            "e2e_s": e2es,
            "output_tokens": [r.output_tokens for r in ok],
        },
    }


def run_serving_benchmark(
    config: ServeConfig, requests: list[SampleRequest], tokenizer: Any | None = None
) -> dict[str, Any]:
    results, duration = asyncio.run(_run(config, requests, tokenizer))
    return summarize(config, results, duration)


def format_serving(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        f"server {cfg['base_url']}  model {cfg['model']}  rate {cfg['request_rate']} req/s",
        f"completed {report['completed']}, failed {report['failed']}, duration {report['duration_s']:.2f} s",
        f"request throughput      {report['request_throughput']:10.2f} req/s",
        f"output token throughput {report['output_throughput']:10.1f} tokens/s",
        f"total token throughput  {report['total_token_throughput']:10.1f} tokens/s",
    ]
    if report["goodput"] is not None:
        slos = ", ".join(
            f"{name} <= {cfg[key]} ms"
            for name, key in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))
            if cfg[key] is not None
        )
        lines.append(f"goodput ({slos}) {report['goodput']:10.2f} req/s")
    lines.append(f"{'(ms)':<6} {'mean':>10} {'median':>10} {'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = report[f"{name}_ms"]
        lines.append(f"{name.upper():<6} {s['mean']:>10.2f} {s['median']:>10.2f} {s['p99']:>10.2f}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def plot_latencies(report: dict[str, Any], path: str) -> None:
    """Histograms of TTFT, TPOT, ITL and end-to-end latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (name, key) in zip(axes, (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))):
        values = np.asarray(report["raw"][key]) * 1e3
        if len(values):
            ax.hist(values, bins=min(50, max(5, len(values) // 2)))
            ax.axvline(float(np.median(values)), color="black", linestyle="--", label="median")
            ax.axvline(float(np.percentile(values, 99)), color="red", linestyle=":", label="p99")
            ax.legend(fontsize=8)
        ax.set_title(name)
        ax.set_xlabel("ms")
    axes[0].set_ylabel("count")
    fig.suptitle(f"{report['config']['model']} at {report['config']['request_rate']} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
