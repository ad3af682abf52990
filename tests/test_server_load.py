"""The server under load and at shutdown.

64 concurrent streaming requests of which a quarter hang up mid-stream: every other request gets the
text it would have had offline, and afterwards /metrics shows nothing running and the KV cache empty.
SIGTERM stops accepting, lets in-flight requests finish within the grace period (or cuts them off
after it), and ends the process with status 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from test_server import RemoteServer
from tiny_models import random_prompts

from pagedllm import LLM, SamplingParams

NUM_REQUESTS = 64
NUM_CUT = NUM_REQUESTS // 4
CHUNKS_BEFORE_CUT = 2


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """Shared by the load test and then ended by the SIGTERM test (the last one in this module)."""
    remote = RemoteServer(tiny_llama_dir, tmp_path_factory.mktemp("server_load_logs"),
                          extra_args=["--max-model-len", "1024"])
    yield remote
    assert remote.terminate() == 0, remote.log()


@pytest.mark.slow
def test_concurrent_streams_with_disconnects(server: RemoteServer, tiny_llama_dir: str) -> None:
    prompts = random_prompts(NUM_REQUESTS, 512, lengths=[4 + (7 * i) % 40 for i in range(NUM_REQUESTS)], seed=3)
    is_cut = [i % 4 == 3 for i in range(NUM_REQUESTS)]
    assert sum(is_cut) == NUM_CUT

    def request_args(i: int) -> dict[str, Any]:
        if is_cut[i]:  # long enough to be cut while still generating, however slow the client is
            return {"max_tokens": 960, "temperature": 0.8, "seed": i, "extra_body": {"ignore_eos": True}}
        return {"max_tokens": 12 + i % 9, "temperature": 0.8, "seed": i}

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await client.completions.create(model="tiny", prompt=prompts[i], stream=True,
                                                 **request_args(i))
        text, finish_reason, chunks = "", None, 0
        try:
            async for chunk in stream:
                chunks += 1
                for choice in chunk.choices:
                    text += choice.text
                    finish_reason = choice.finish_reason or finish_reason
                if is_cut[i] and chunks == CHUNKS_BEFORE_CUT:
                    break  # hang up mid-stream
        finally:
            await stream.close()
        return text, finish_reason, chunks

    async def run_all() -> list[tuple[str, str | None, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300.0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS)))

    before = server.metrics()
    results = asyncio.run(run_all())

    kept = [i for i in range(NUM_REQUESTS) if not is_cut[i]]
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, seed=0)
    params = [SamplingParams(max_tokens=12 + i % 9, temperature=0.8, seed=i) for i in kept]
    want = llm.generate([{"prompt_token_ids": prompts[i]} for i in kept], params, use_tqdm=False)
    for i, reference in zip(kept, want):
        text, finish_reason, _ = results[i]
        assert text == reference.outputs[0].text, f"request {i}"
        assert finish_reason == reference.outputs[0].finish_reason
    for i in range(NUM_REQUESTS):
        if is_cut[i]:
            assert results[i][1] is None and results[i][2] == CHUNKS_BEFORE_CUT

    # the hung-up requests are aborted and their blocks freed, without any further traffic
    def drained() -> bool:
        metrics = server.metrics()
        return metrics["pagedllm:num_requests_running"] == 0 and metrics["pagedllm:num_requests_waiting"] == 0
    wait_until(drained, 60.0, "running and waiting requests to drain")
    after = server.metrics()
    # freed blocks that keep a prefix hash are free too: usage counts only blocks held by requests
    assert after["pagedllm:kv_cache_usage_perc"] == 0.0
    assert after["pagedllm:kv_cache_free_blocks"] == after["pagedllm:kv_cache_total_blocks"]
    aborted = [line for line in server.get("/metrics").text.splitlines()
               if line.startswith("pagedllm:request_success_total") and 'finished_reason="abort"' in line]
    assert float(aborted[0].rsplit(" ", 1)[1]) == NUM_CUT
    finished = after["pagedllm:request_success_total"] - before.get("pagedllm:request_success_total", 0)
    assert finished == NUM_REQUESTS
    server.assert_healthy()


def stream_in_thread(server: RemoteServer, body: dict[str, Any]) -> tuple[threading.Thread, threading.Event,
                                                                            dict[str, Any]]:
    """Stream a completion in a thread; the event is set at the first chunk, results land in the dict."""
    first_chunk = threading.Event()
    result: dict[str, Any] = {"events": [], "error": None}

    def run() -> None:
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120.0) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        payload = line[len("data: "):]
                        result["events"].append(payload)
                        first_chunk.set()
        except httpx.HTTPError as exc:  # the server cut the connection
            result["error"] = exc
        first_chunk.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, first_chunk, result


def refuses_connections(server: RemoteServer) -> bool:
    try:
        httpx.get(f"{server.url}/health", timeout=5.0)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def test_sigterm_finishes_in_flight_requests(server: RemoteServer) -> None:
    body = {"prompt": "hello", "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True}
    thread, first_chunk, result = stream_in_thread(server, body)
    try:
        assert first_chunk.wait(120.0)
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: refuses_connections(server) or server.proc.poll() is not None, 60.0,
                   "the server to stop accepting connections")
    finally:
        thread.join(120.0)
        status = server.terminate()
    assert result["error"] is None, result["error"]
    assert result["events"][-1] == "[DONE]", "the in-flight request ran to its end"
    finishes = [choice["finish_reason"] for event in result["events"][:-1]
                for choice in json.loads(event)["choices"] if choice["finish_reason"]]
    assert finishes == ["length"]
    assert status == 0, server.log()


def test_sigterm_answers_what_outlives_the_grace_period(tiny_llama_dir: str,
                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    """After the grace period, a stream ends with an error event and [DONE], and a plain request gets
    a 503 in OpenAI's shape (not a text/plain 500 or a cut connection)."""
    server = RemoteServer(tiny_llama_dir, tmp_path_factory.mktemp("server_grace_logs"),
                          extra_args=["--max-model-len", "1024", "--timeout-graceful-shutdown", "0.5"])
    body = {"prompt": "hello", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "n": 4, "logprobs": 5}
    thread, first_chunk, result = stream_in_thread(server, {**body, "stream": True})
    plain: dict[str, Any] = {}

    def post_plain() -> None:
        plain["response"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120.0)

    plain_thread = threading.Thread(target=post_plain)
    try:
        assert first_chunk.wait(120.0)
        plain_thread.start()
        # The gauge counts sequences, so the stream alone shows n; both requests show 2n.
        wait_until(lambda: server.metrics()["pagedllm:num_requests_running"] >= 2 * body["n"], 60.0,
                   "both to run")
        server.proc.send_signal(signal.SIGTERM)
    finally:
        thread.join(120.0)
        plain_thread.join(120.0)
        status = server.terminate()
    assert result["error"] is None, result["error"]
    assert result["events"][-1] == "[DONE]", "the stream ends properly"
    last = json.loads(result["events"][-2])
    assert last["error"]["code"] == 503, last
    response = plain["response"]
    assert response.status_code == 503 and response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == "ServiceUnavailable"
    assert status == 0, server.log()


def test_offline_with_nothing_cached_serves_the_bundled_demo_model(tmp_path_factory: pytest.TempPathFactory,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.assets import demo_model_path

    if not os.path.exists(os.path.join(demo_model_path(), "config.json")):
        pytest.skip("the bundled demo model is not installed")
    monkeypatch.setenv("PAGEDLLM_MODELS_DIR", str(tmp_path_factory.mktemp("no_models")))
    server = RemoteServer(None, tmp_path_factory.mktemp("server_demo_logs"), served_model_name=None)
    assert "using the bundled demo model pycode-target" in server.log()
    try:
        client = server.client()
        assert [model.id for model in client.models.list().data] == ["pycode-target"]
        result = client.completions.create(model="pycode-target", prompt="def add(a, b):", max_tokens=8,
                                           temperature=0.0)
        assert result.usage.completion_tokens > 0
    finally:
        assert server.terminate() == 0, server.log()
