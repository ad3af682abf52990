"""`pagedllm bench`: the request sets, and each command run end to end on a tiny model with a handful of
prompts. These are smoke tests of behaviour and output format; no timing is asserted."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request  # module level: the stub's handlers' annotations must resolve
from fastapi.responses import StreamingResponse

from pagedllm.benchmarks.datasets import get_requests, sharegpt_like_lengths
from pagedllm.benchmarks.serving import RequestResult, ServeConfig, summarize


def _cli(argv: list[str]) -> int:
    from pagedllm.entrypoints.cli import main

    return main(argv)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


# --- datasets ------------------------------------------------------------------------------------


def test_random_dataset_has_exact_lengths_and_no_special_tokens(tokenizer: Any) -> None:
    requests = get_requests("random", tokenizer, 5, input_len=12, output_len=7, seed=3)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(12, 7)] * 5
    special = set(tokenizer.all_special_ids)
    assert all(len(r.prompt_token_ids) == 12 and not special & set(r.prompt_token_ids) for r in requests)
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 5
    assert get_requests("random", tokenizer, 5, 12, 7, seed=3)[0].prompt_token_ids == requests[0].prompt_token_ids


def test_sharegpt_like_lengths_are_seeded_and_skewed() -> None:
    pairs = sharegpt_like_lengths(2000, mean_input_len=200, mean_output_len=100, seed=0)
    assert pairs == sharegpt_like_lengths(2000, 200, 100, seed=0)
    assert pairs != sharegpt_like_lengths(2000, 200, 100, seed=1)
    inputs, outputs = [p for p, _ in pairs], [o for _, o in pairs]
    assert all(4 <= p <= 800 for p in inputs) and all(1 <= o <= 400 for o in outputs)
    # a long right tail: the mean sits well above the median, as in real chat traffic
    assert statistics.mean(inputs) > 1.3 * statistics.median(inputs)
    assert statistics.mean(outputs) > 1.15 * statistics.median(outputs)
    assert 150 < statistics.mean(inputs) < 230 and 80 < statistics.mean(outputs) < 115
    capped = sharegpt_like_lengths(500, 200, 100, seed=0, max_model_len=256)
    assert all(p + o <= 256 for p, o in capped)


def test_file_datasets(tmp_path: Path, tokenizer: Any) -> None:
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "def add(a, b):", "output_len": 5}\n{"prompt": "hello world"}\n')
    requests = get_requests(str(jsonl), tokenizer, 10, output_len=9)
    assert [r.output_len for r in requests] == [5, 9]
    assert requests[0].prompt_token_ids == tokenizer.encode("def add(a, b):", add_special_tokens=False)
    sharegpt = tmp_path / "sharegpt.json"
    reply = "return a + b"
    sharegpt.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "def add(a, b):"},
                        {"from": "gpt", "value": reply},
                    ]
                }
            ]
            * 3
        )
    )
    requests = get_requests(str(sharegpt), tokenizer, 2)
    assert len(requests) == 2
    assert requests[0].output_len == len(tokenizer.encode(reply, add_special_tokens=False))


def test_dataset_validation(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="--num-prompts"):
        get_requests("random", tokenizer, 0)
    with pytest.raises(ValueError, match="--dataset"):
        get_requests("no/such/file.json", tokenizer, 3)


# --- bench throughput / latency on the engine ----------------------------------------------------

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256"]


def test_bench_throughput_against_transformers(
    tiny_llama_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "throughput.json"
    argv = [
        "bench",
        "throughput",
        "--model",
        tiny_llama_dir,
        "--dataset",
        "sharegpt-like",
        "--num-prompts",
        "6",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--compare",
        "hf",
        "--hf-batch-size",
        "4",
        "--disable-tqdm",
        "--profile",
        "--output-json",
        str(out),
        *ENGINE_FLAGS,
    ]
    assert _cli(argv) == 0
    table = capsys.readouterr().out
    assert "pagedllm" in table and "transformers" in table and "ratio" in table and "output tok/s" in table
    assert "engine overhead" in table and "sampling" in table
    # how the CPU work ran: the wait policy, and the linear kernel that served every row bucket
    assert "idle torch threads: " in table and "linear kernel: float32 linears: " in table
    report = json.loads(out.read_text())
    assert report["config"]["cpu_kernels"]["linear_kernel"] in ("blocked", "onednn")
    # transformers at the usual static batch (4) and at ours (all 6 requests at once)
    ours, hf, hf_same = report["results"]
    assert hf["backend"] == "transformers (static batch 4)" and hf_same["backend"] == "transformers (static batch 6)"
    assert set(report["ratios_output_tokens_per_s"]) == {hf["backend"], hf_same["backend"]}
    profile = report["profile"]
    assert profile["steps"] > 0 and profile["seconds"]["forward"] > 0 and 0 < profile["overhead_fraction"] < 1
    # the decode steps apart: fewer than all steps (the first one prefills), each with a forward
    assert 0 < profile["decode_steps"] < profile["steps"] and profile["decode_seconds"]["forward"] > 0
    assert 0 < profile["decode_overhead_fraction"] < 1 and "decode-only steps" in table
    assert profile["total_s"] <= ours["elapsed_s"]
    # the headline figures from the timed run's step and forward clocks, the split from a second run
    clock, decode_clock = profile["clock"], profile["decode_clock"]
    assert clock["steps"] == profile["steps"] and 0 < clock["forward_s"] < clock["seconds"] <= ours["elapsed_s"]
    assert 0 < decode_clock["steps"] < clock["steps"]
    assert profile["overhead_fraction"] == pytest.approx(1 - clock["forward_s"] / clock["seconds"])
    assert "clocked by step and forward pass only" in table
    requested = round(report["config"]["mean_output_len"] * 6)
    # ignore_eos: every request yields exactly its requested output length, on both sides
    assert ours["output_tokens"] == hf["output_tokens"] == requested
    assert ours["prompt_tokens"] == hf["prompt_tokens"]
    # static batches run on to their longest output; continuous batching generates only what was asked
    assert hf["generated_tokens"] >= hf["output_tokens"] and ours["generated_tokens"] is None
    for result in (ours, hf):
        assert result["num_requests"] == 6 and result["elapsed_s"] > 0 and result["output_tokens_per_s"] > 0
    assert report["ratio_output_tokens_per_s"] == pytest.approx(ours["output_tokens_per_s"] / hf["output_tokens_per_s"])


def test_bench_latency_reports_roofline_fraction(
    tiny_llama_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "latency.json"
    argv = [
        "bench",
        "latency",
        "--model",
        tiny_llama_dir,
        "--input-len",
        "8",
        "--output-len",
        "8",
        "--num-iters",
        "2",
        "--output-json",
        str(out),
        *ENGINE_FLAGS,
    ]
    assert _cli(argv) == 0
    table = capsys.readouterr().out
    for needle in (
        "time to first token",
        "decode, batch 1",
        "fraction of roofline",
        "bytes per token (planner)",
    ):
        assert needle in table
    assert "idle torch threads: " in table and "serves every row bucket" in table
    report = json.loads(out.read_text())
    assert report["cpu_kernels"]["wait_policy"] and report["cpu_kernels"]["linear_kernel"] in ("blocked", "onednn")
    assert report["num_iters"] == 2 and len(report["ttft_all_s"]) == 2 and report["dtype"] == "float32"
    assert report["ttft_s"] > 0 and report["decode_tokens_per_s"] > 0 and report["memory_bandwidth_bytes_per_s"] > 0
    # each timed run is set against the bandwidth probed right before it; the report gives their median
    assert len(report["memory_bandwidth_all"]) == len(report["roofline_fraction_all"]) == 2
    for rate, bandwidth, fraction in zip(report["decode_tokens_per_s_all"], report["memory_bandwidth_all"],
                                         report["roofline_fraction_all"]):
        assert fraction == pytest.approx(rate * report["bytes_per_token"] / bandwidth)
    assert report["roofline_fraction"] == pytest.approx(statistics.median(report["roofline_fraction_all"]))
    assert report["memory_bandwidth_bytes_per_s"] == pytest.approx(statistics.median(report["memory_bandwidth_all"]))
    assert report["roofline_tokens_per_s"] == pytest.approx(
        report["memory_bandwidth_bytes_per_s"] / report["bytes_per_token"]
    )
    # the tiny model's weights fit in any L3: the roofline is flagged as meaningless where the size is known
    if report["last_level_cache_bytes"] is not None:
        assert report["weights_fit_in_cache"] and "last-level cache" in table


def test_bench_latency_reads_a_packed_gguf_models_bytes_as_loaded(tiny_llama_dir: str, tmp_path: Path) -> None:
    """A GGUF file's weights stay packed in its block types, which the planner does not know: the roofline
    then divides by the bytes of the weights as loaded (the planner would count bf16 and read 3x)."""
    from gguf_models import write_gguf

    from pagedllm import LLM
    from pagedllm.benchmarks.latency import run_latency

    path = write_gguf(tiny_llama_dir, str(tmp_path / "tiny-Q4_0.gguf"), "Q4_0")
    llm = LLM(model=path, dtype="bfloat16", max_model_len=64)
    result = run_latency(llm, path, list(range(3, 11)), 4, num_iters=1, num_warmup=0)
    loaded = llm.llm_engine.model_runner.weight_bytes()
    assert result.weights_as_loaded and result.weight_bytes == loaded
    assert loaded <= result.bytes_per_token < loaded + 64 * 1024  # the weights, and a few blocks of KV


def test_transformers_baseline_reads_a_gguf_file(tiny_llama_dir: str, tmp_path: Path) -> None:
    """bench throughput --compare hf on a .gguf model: transformers loads the file through gguf_file."""
    import torch
    from gguf_models import write_gguf

    from pagedllm.benchmarks.datasets import SampleRequest
    from pagedllm.benchmarks.throughput import run_hf_batch_sizes

    path = write_gguf(tiny_llama_dir, str(tmp_path / "tiny-Q8_0.gguf"), "Q8_0")
    requests = [SampleRequest(prompt="", prompt_token_ids=[3, 4, 5], prompt_len=3, output_len=2)]
    (result,) = run_hf_batch_sizes(path, requests, torch.float32, [1])
    assert result.output_tokens == 2


def test_last_level_cache_size_parsing(tmp_path: Path) -> None:
    from pagedllm.benchmarks.latency import last_level_cache_bytes

    for text, want in (("32768K\n", 32 << 20), ("96M", 96 << 20), ("1048576", 1 << 20), ("junk", None)):
        (tmp_path / "size").write_text(text)
        assert last_level_cache_bytes(str(tmp_path / "size")) == want
    assert last_level_cache_bytes(str(tmp_path / "missing")) is None


def test_bench_rejects_bad_flags(tiny_llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["bench", "throughput", "--model", tiny_llama_dir, "--num-prompts", "0", *ENGINE_FLAGS]) == 2
    assert "--num-prompts" in capsys.readouterr().err
    assert _cli(["bench", "serve", "--model", "m", "--tokenizer", tiny_llama_dir, "--request-rate", "0"]) == 2
    assert "--request-rate" in capsys.readouterr().err


# --- bench serve ---------------------------------------------------------------------------------


class StubServer:
    """A minimal OpenAI-compatible streaming server (FastAPI on uvicorn in a thread) that answers every
    completion with max_tokens one-word chunks: `bench serve` must work against servers other than ours.
    The socket is bound and listening before the thread starts, so requests queue instead of racing it."""

    def __init__(self, include_usage: bool = True) -> None:
        import uvicorn

        app = FastAPI()
        self.bodies: list[dict[str, Any]] = []

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> StreamingResponse:
            body = await request.json()
            self.bodies.append(body)

            async def events() -> Any:
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(0)
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' w{i}'}]})}\n\n"
                if include_usage:
                    usage = {"prompt_tokens": 1, "completion_tokens": body["max_tokens"]}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@pytest.fixture
def stub_server() -> Iterator[StubServer]:
    server = StubServer()
    yield server
    server.close()


def test_bench_serve_against_a_stub_server(
    stub_server: StubServer, tiny_llama_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = [
        "bench",
        "serve",
        "--base-url",
        stub_server.url,
        "--tokenizer",
        tiny_llama_dir,
        "--num-prompts",
        "5",
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--request-rate",
        "50",
        "--slo-ttft-ms",
        "60000",
        "--slo-tpot-ms",
        "60000",
        "--output-json",
        str(out_json),
        "--plot",
        str(out_png),
    ]
    assert _cli(argv) == 0
    table = capsys.readouterr().out
    for needle in ("TTFT", "TPOT", "ITL", "E2E", "goodput", "output token throughput"):
        assert needle in table
    report = json.loads(out_json.read_text())
    assert report["config"]["model"] == "stub-model"  # found through /v1/models
    assert report["completed"] == 5 and report["failed"] == 0
    assert report["output_tokens"] == 5 * 6
    assert len(report["raw"]["itl_s"]) == 5 * 5  # 6 chunks each, 5 gaps
    # every request met the generous SLOs, so goodput equals the request throughput
    assert report["goodput"] == pytest.approx(report["request_throughput"])
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(report[name]) >= {"mean", "median", "p99"} and report[name]["p99"] >= report[name]["median"]
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    body = stub_server.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 6
    assert body["model"] == "stub-model" and isinstance(body["prompt"], str)


def test_goodput_counts_only_requests_within_slos() -> None:
    config = ServeConfig(
        base_url="http://x", model="m", request_rate=1.0, num_prompts=3, slo_ttft_ms=100, slo_tpot_ms=10
    )
    fast = RequestResult(4, 5, success=True, output_tokens=5, ttft_s=0.05, e2e_s=0.05 + 4 * 0.005)
    slow_first = RequestResult(4, 5, success=True, output_tokens=5, ttft_s=0.5, e2e_s=0.5 + 4 * 0.005)
    slow_decode = RequestResult(4, 5, success=True, output_tokens=5, ttft_s=0.05, e2e_s=0.05 + 4 * 0.05)
    failed = RequestResult(4, 5, error="HTTP 500")
    report = summarize(config, [fast, slow_first, slow_decode, failed], duration_s=2.0)
    assert report["completed"] == 3 and report["failed"] == 1 and report["errors"] == ["HTTP 500"]
    assert report["goodput"] == pytest.approx(0.5)
    assert report["request_throughput"] == pytest.approx(1.5)
    assert report["tpot_ms"]["median"] == pytest.approx(5.0)


@pytest.mark.slow
def test_bench_serve_against_pagedllm_serve(
    tiny_llama_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        from test_server import RemoteServer
    except ImportError as exc:
        pytest.skip(f"the server (pagedllm serve) or its test helpers are not available: {exc}")
    server = RemoteServer(tiny_llama_dir, tmp_path)
    try:
        out = tmp_path / "serve.json"
        argv = [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--tokenizer",
            tiny_llama_dir,
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--output-json",
            str(out),
        ]
        assert _cli(argv) == 0, server.log()
        report = json.loads(out.read_text())
        assert report["config"]["model"] == "tiny"
        assert report["completed"] == 4 and report["failed"] == 0
        assert report["output_tokens"] == 4 * 5  # counted by the server's usage chunk, ignore_eos honoured
        assert report["ttft_ms"]["median"] > 0
    finally:
        server.terminate()


@pytest.mark.parametrize(
    "name, module",
    [("spec-decode", "pagedllm.benchmarks.spec_decode"), ("prefix-caching", "pagedllm.benchmarks.prefix_caching"),
     ("structured-output", "pagedllm.benchmarks.structured_output"), ("prepack", "pagedllm.benchmarks.prepack")],
)
def test_other_benchmarks_are_wired_into_pagedllm_bench(name: str, module: str) -> None:
    pytest.importorskip(module)
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", name, "--output-json", "x.json"])
    assert callable(args.func) and args.func.__module__ == module


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_profile_charges_worker_processes_to_forward(tiny_llama_dir: str, async_scheduling: bool) -> None:
    """With the model in a worker process (distributed_executor_backend='mp', and async scheduling), the
    forward pass is the worker's own, as each step's output reports it; the engine's wait on the worker is
    not overhead in itself, and the table says so."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.profile import StepProfiler

    llm = LLM(model=tiny_llama_dir, distributed_executor_backend="mp", dtype="float32", max_model_len=256,
              async_scheduling=async_scheduling)
    try:
        with StepProfiler().attach(llm.llm_engine) as profiler:
            llm.generate(["def f(x):", "class A:"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        assert profiler.workers_in_forward and profiler.steps > 0 and profiler.seconds["forward"] > 0
        assert 0 < profiler.worker_forward_s < profiler.total_s
        assert 0 < profiler.decode_worker_forward_s < profiler.worker_forward_s
        assert 0 < profiler.overhead_fraction < 1 and 0 < profiler.decode_overhead_fraction < 1
        assert profiler.to_dict()["workers_in_forward"] and "worker processes" in profiler.format()
    finally:
        llm.shutdown()
