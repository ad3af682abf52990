"""The server's engine core in its own process (issue 19), tested on the real `pagedllm serve`.

While one request's 1 MB prompt is being tokenized, and while another's 4k-token prefill runs, the
server answers /health and other clients' streams keep receiving tokens: observed as order of events
(which finished first), never as durations. A killed core process ends in errors, not a hang: the
stream in flight gets an error event, /health answers 503, and the server exits with a non-zero status.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import RemoteServer
from test_server_load import wait_until
from tiny_models import build_model

MAX_MODEL_LEN = 8192


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """A tiny random model with a long context; the last test of this module kills its core."""
    model_dir = build_model(tmp_path_factory.mktemp("long_llama"), "llama", seed=0,
                            max_position_embeddings=MAX_MODEL_LEN)
    remote = RemoteServer(model_dir, tmp_path_factory.mktemp("server_core_logs"),
                          extra_args=["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                                      "--max-prompt-chars", str(2_000_000), "--tokenize-timeout", "600"])
    yield remote
    if remote.proc.poll() is None:
        remote.terminate()


class BackgroundStream:
    """A streaming completion read on a thread; for each chunk, whether `other_done` was set yet."""

    def __init__(self, server: RemoteServer, other_done: threading.Event, max_tokens: int = 4000) -> None:
        self.server = server
        self.other_done = other_done
        self.max_tokens = max_tokens
        self.chunks: list[bool] = []
        self.events: list[str] = []
        self.hang_up = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        body = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": self.max_tokens, "stream": True,
                "temperature": 0.0, "ignore_eos": True}
        with httpx.stream("POST", f"{self.server.url}/v1/completions", json=body, timeout=600.0) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.chunks.append(self.other_done.is_set())
                if self.hang_up.is_set():
                    return  # the server aborts the request

    def close(self, hang_up: bool = True) -> None:
        if hang_up:
            self.hang_up.set()
        self.thread.join(timeout=600.0)


def progress_while(server: RemoteServer, long_request: Any) -> tuple[list[bool], list[bool], Any]:
    """Run `long_request()` on a thread while a stream runs and /health is polled; returns (for each
    stream chunk, for each /health 200) whether the long request had finished yet, and its result."""
    done = threading.Event()
    stream = BackgroundStream(server, done, max_tokens=3000)
    wait_until(lambda: len(stream.chunks) >= 2, 300.0, "the background stream to start")
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = long_request()
        finally:
            done.set()

    long_thread = threading.Thread(target=run, daemon=True)
    num_chunks_before = len(stream.chunks)
    long_thread.start()
    health: list[bool] = []
    while not done.is_set():
        if httpx.get(f"{server.url}/health", timeout=60.0).status_code == 200:
            health.append(done.is_set())
    long_thread.join()
    return stream.chunks[num_chunks_before:], health, (result.get("value"), stream)


def test_health_and_streams_go_on_while_a_1mb_prompt_is_tokenized(server: RemoteServer) -> None:
    rng = random.Random(0)
    words = ["def", "return", "self", "import", "class", "for", "while", "x", "(", ")", ":", "\n", "    "]
    prompt = "".join(rng.choice(words) + " " for _ in range(300_000))[:1_000_000]
    chunks, health, (response, stream) = progress_while(
        server, lambda: server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1},
                                    timeout=600.0))
    # its tokens do not fit the context: a 400 naming the prompt, once tokenized
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert False in health, "/health answered while the 1 MB prompt was being tokenized"
    assert False in chunks, "another stream received tokens while the 1 MB prompt was being tokenized"
    stream.close()


def test_health_and_streams_go_on_during_a_4k_token_prefill(server: RemoteServer) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(4096)]
    chunks, health, (response, stream) = progress_while(
        server, lambda: server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8},
                                    timeout=600.0))
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 4096
    assert False in health, "/health answered while the 4k-token prefill ran"
    assert False in chunks, "another stream received tokens while the 4k-token prefill ran"
    stream.close()


def core_pid(server: RemoteServer) -> int:
    """The engine core: the server's child process running pagedllm.engine.core_proc."""
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"pagedllm.engine.core_proc" in f.read():
                return pid
    raise AssertionError(f"no engine core among the server's children {children}")


def test_a_killed_core_gives_errors_not_a_hang(server: RemoteServer) -> None:
    """Runs last in this module: the server exits."""
    stream = BackgroundStream(server, threading.Event(), max_tokens=MAX_MODEL_LEN - 16)
    wait_until(lambda: len(stream.chunks) >= 2, 300.0, "the stream to start")
    os.kill(core_pid(server), signal.SIGKILL)
    stream.close(hang_up=False)
    assert not stream.thread.is_alive(), "the stream in flight ended"
    assert stream.events[-1] == "[DONE]"
    error = json.loads(stream.events[-2])["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailable"
    # /health says 503 until the server is gone (it does not go back to 200)
    statuses = []
    while server.proc.poll() is None:
        try:
            statuses.append(httpx.get(f"{server.url}/health", timeout=10.0).status_code)
        except httpx.TransportError:
            break  # the server closed its socket on its way out
    assert statuses and set(statuses) == {503}, statuses
    assert server.proc.wait(timeout=120) != 0, server.log()
    assert "the engine core process" in server.log() and "exited with code -9" in server.log()
