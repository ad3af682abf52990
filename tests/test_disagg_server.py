"""Disaggregated prefill and decode with real servers: a kv_producer, a kv_consumer and `pagedllm router`
in front, driven by the real openai client.

Through the router every completion and chat answer (streamed or not, greedy or seeded) equals what the
decode instance gives when asked directly, usage included; a prompt prefix the decode instance already
holds is not sent again; after the load both KV pools are empty and nothing is left staged; and a prefill
instance killed while requests are in flight costs nothing but a recompute on the decode side.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_server import RemoteServer, free_port
from test_server_load import wait_until

BLOCK_SIZE = 16


class RemoteRouter(RemoteServer):
    """`pagedllm router --prefill ... --decode ...` as a child process, ready once /health answers 200."""

    def __init__(self, log_dir: Path, prefill: list[str], decode: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = None
        self.log_path = log_dir / f"router-{self.port}.log"
        args = [sys.executable, "-m", "pagedllm.entrypoints.cli", "router", "--port", str(self.port),
                "--prefill", *prefill, "--decode", *decode, "--health-interval", "0.5"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self.wait_ready()


def kv_server(model_dir: str, log_dir: Path, config: dict[str, Any]) -> RemoteServer:
    return RemoteServer(model_dir, log_dir, extra_args=["--block-size", str(BLOCK_SIZE),
                                                        "--kv-transfer-config", json.dumps(config)])


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RemoteServer]]:
    logs = tmp_path_factory.mktemp("disagg_logs")
    prefill = kv_server(tiny_llama_dir, logs, {"kv_role": "kv_producer", "kv_port": free_port()})
    decode = kv_server(tiny_llama_dir, logs, {"kv_role": "kv_consumer",
                                              "kv_connector_extra_config": {"transfer_timeout_s": 5}})
    router = RemoteRouter(logs, [prefill.url], [decode.url])
    yield {"prefill": prefill, "decode": decode, "router": router}
    for remote in (router, decode, prefill):
        if remote.proc.poll() is None:
            remote.terminate()


def _answer(client: openai.OpenAI, kind: str, stream: bool, **kwargs: Any) -> tuple[str, Any]:
    """(text, usage) of one completion or chat request, streamed or not."""
    if kind == "chat":
        create = client.chat.completions.create
        kwargs["messages"] = [{"role": "user", "content": kwargs.pop("prompt")}]
    else:
        create = client.completions.create
    if not stream:
        result = create(model="tiny", **kwargs)
        choice = result.choices[0]
        return (choice.message.content if kind == "chat" else choice.text), result.usage.model_dump()
    text, usage = "", None
    for chunk in create(model="tiny", stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text += (choice.delta.content or "") if kind == "chat" else choice.text
    return text, usage


@pytest.mark.slow
def test_router_answers_equal_one_instance_and_pools_end_empty(cluster: dict[str, RemoteServer]) -> None:
    router, decode, prefill = cluster["router"], cluster["decode"], cluster["prefill"]
    case = 0
    for kind in ("completion", "chat"):
        for stream in (False, True):
            for sampling in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 11}):
                # a prompt of its own, so the decode instance holds none of it before the routed call
                case += 1
                prompt = f"Case {case}. A paged key-value cache stores keys and values in fixed-size blocks. " * 2
                received = decode.metrics().get("pagedllm:kv_transfer_bytes_total", 0)
                got = _answer(router.client(), kind, stream, prompt=prompt, max_tokens=12, **sampling)
                assert decode.metrics()["pagedllm:kv_transfer_bytes_total"] > received
                expected = _answer(decode.client(), kind, stream, prompt=prompt, max_tokens=12, **sampling)
                assert got == expected, (kind, stream, sampling)

    # A shared prefix is sent once: the second prompt's transfer carries only its blocks past the prefix.
    ids = [5 + (i * 7) % 400 for i in range(4 * BLOCK_SIZE)]  # four full blocks, shared
    sent = []
    for tail in ([3, 4, 5, 6, 7], [8, 9, 10, 11, 12]):
        before = decode.metrics()["pagedllm:kv_transfer_bytes_total"]
        router.client().completions.create(model="tiny", prompt=ids + tail, max_tokens=2, temperature=0.0)
        sent.append(decode.metrics()["pagedllm:kv_transfer_bytes_total"] - before)
    assert sent[1] * 5 == sent[0]  # 5 blocks, then 1

    for server in (prefill, decode):
        metrics = server.metrics()
        assert metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]
        assert metrics["pagedllm:num_requests_running"] == metrics["pagedllm:num_requests_waiting_for_kv"] == 0
    assert prefill.metrics()["pagedllm:kv_transfer_staged_requests"] == 0
    assert decode.metrics()["pagedllm:kv_transfer_fallbacks_total"] == 0
    assert decode.metrics()["pagedllm:kv_transfer_seconds_count"] == case + 2  # every routed request pulled once
    health = httpx.get(f"{router.url}/health").json()
    assert all(instance["healthy"] for instance in health["instances"])
    assert "pagedllm:router_requests_total" in httpx.get(f"{router.url}/metrics").text


@pytest.mark.slow
def test_prefill_instance_killed_mid_load_loses_nothing(cluster: dict[str, RemoteServer]) -> None:
    router, decode, prefill = cluster["router"], cluster["decode"], cluster["prefill"]
    prompts = [f"Request {i}: continuous batching lets new requests join while others decode. " * 3
               for i in range(8)]
    results: dict[int, str] = {}
    errors: list[BaseException] = []
    first_done = threading.Event()

    def one(i: int) -> None:
        try:
            result = router.client().completions.create(model="tiny", prompt=prompts[i], max_tokens=24,
                                                        temperature=0.0)
            results[i] = result.choices[0].text
            first_done.set()
        except BaseException as exc:  # noqa: BLE001 (collected, asserted below)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    assert first_done.wait(timeout=300)
    prefill.proc.kill()  # mid-load: the other requests are in prefill, in transfer, or not yet sent
    prefill.proc.wait()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors
    direct = decode.client()
    expected = [direct.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0.0).choices[0].text
                for p in prompts]
    assert [results[i] for i in range(len(prompts))] == expected

    # Later requests go straight to the decode instance, which computes their prompts itself.
    late = router.client().completions.create(model="tiny", prompt=prompts[0], max_tokens=24, temperature=0.0)
    assert late.choices[0].text == expected[0]
    router_metrics = httpx.get(f"{router.url}/metrics").text
    assert 'pagedllm:router_instance_healthy{instance="' + prefill.url + '",role="prefill"} 0.0' in router_metrics
    wait_until(lambda: decode.metrics()["pagedllm:num_requests_running"] == 0, 60, "the decode instance to drain")
    metrics = decode.metrics()
    assert metrics["pagedllm:kv_cache_free_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]
    assert metrics["pagedllm:num_requests_waiting_for_kv"] == 0
